"""All-to-all ("Ulysses") sequence parallelism: trade the sequence split for a head split and back.

Each rank sends head group ``p`` of its rows to rank ``p`` (one ``all_to_all_single``), so rank ``p`` holds
every token of the global batch for ``Hq / W`` query heads. It runs ordinary varlen attention on the global
``cu_seqlens``, and a second all-to-all returns the rows to their owners with all heads. Keys and values
are packed into one exchange. With ``Hkv`` not divisible by ``W`` (e.g. GQA with fewer KV heads than
ranks), each KV head is repeated ``W / gcd(Hkv, W)`` times first, which keeps the query-to-KV head
mapping; its gradient sums the copies.
"""

from __future__ import annotations

import math
from typing import Any, Literal, overload

import torch

from ..api import check_call, varlen_attention
from .comm import (
    all_to_all,
    attention_options,
    check_plan,
    check_rows,
    collective_check,
    gather_order,
    join_group,
    plan_items,
    rank_major_rows,
)
from .plan import ShardPlan, offsets_on

__all__ = ["ulysses_varlen_attention"]


def _orders(plan: ShardPlan, side: str, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(rank-major -> global, global -> rank-major) row indices, cached on the plan per device."""
    return plan.cached(
        ("ulysses", side, str(device)),
        lambda: (gather_order(plan, side).to(device), rank_major_rows(plan, side).to(device)),
    )


def _global_cu_seqlens(plan: ShardPlan, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """The global batch's offsets as int32 tensors, cached on the plan per device."""
    return plan.cached(
        ("global_cu_seqlens", str(device)),
        lambda: offsets_on(plan.global_cu_seqlens_q, plan.global_cu_seqlens_k, device),
    )


def _heads_to_sequence(x: torch.Tensor, plan: ShardPlan, side: str, group: Any) -> torch.Tensor:
    """``(local rows, W * h, D)`` on every rank -> ``(global rows, h, D)``: head group ``p`` on rank ``p``."""
    w = plan.world_size
    rows, heads, dim = x.shape
    send = x.reshape(rows, w, heads // w, dim).transpose(0, 1).reshape(w * rows, heads // w, dim)
    counts = [s.total for s in plan.shards(side)]
    got = all_to_all(send, [rows] * w, counts, group)
    return got.index_select(0, _orders(plan, side, x.device)[0])


def _sequence_to_heads(y: torch.Tensor, plan: ShardPlan, side: str, group: Any) -> torch.Tensor:
    """Inverse of :func:`_heads_to_sequence`: ``(global rows, h, D)`` -> ``(local rows, W * h, D)``."""
    w = plan.world_size
    rows = plan.shards(side)[plan.rank].total
    counts = [s.total for s in plan.shards(side)]
    send = y.index_select(0, _orders(plan, side, y.device)[1])
    got = all_to_all(send, counts, [rows] * w, group)
    h, dim = y.shape[1], y.shape[2]
    return got.reshape(w, rows, h, dim).transpose(0, 1).reshape(rows, w * h, dim)


@overload
def ulysses_varlen_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    plan: ShardPlan,
    *,
    group: Any = ...,
    causal: bool = ...,
    softmax_scale: float | None = ...,
    window_size: tuple[int, int] = ...,
    softcap: float = ...,
    return_lse: Literal[False] = ...,
    backend: str | None = ...,
) -> torch.Tensor: ...


@overload
def ulysses_varlen_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    plan: ShardPlan,
    *,
    group: Any = ...,
    causal: bool = ...,
    softmax_scale: float | None = ...,
    window_size: tuple[int, int] = ...,
    softcap: float = ...,
    return_lse: Literal[True],
    backend: str | None = ...,
) -> tuple[torch.Tensor, torch.Tensor]: ...


def ulysses_varlen_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    plan: ShardPlan,
    *,
    group: Any = None,
    causal: bool = False,
    softmax_scale: float | None = None,
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    return_lse: bool = False,
    backend: str | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """All-to-all sequence-parallel attention on this rank's shards of a packed batch.

    Same contract as :func:`ring_varlen_attention` (shapes, result equal to the sharded single-process
    result, gradients, collective), by a different route: two all-to-alls per tensor and one local
    :func:`packattn.varlen_attention` over the whole batch for ``Hq / W`` heads. Each rank therefore holds
    ``Hq / W`` heads of every token at once (``W`` times less than one process would, not ``W`` times less
    per rank as in the ring).

    Requires ``Hq % W == 0``. Any ``Hkv`` works: KV heads are repeated ``W / gcd(Hkv, W)`` times when
    ``Hkv`` is not divisible by ``W``. The rows may be planned with either balance.

    Args:
        q, k, v, plan, group, causal, softmax_scale, window_size, softcap, return_lse, backend:
            as in :func:`ring_varlen_attention`; ``backend`` selects the local attention backend.

    Returns:
        ``out``, or ``(out, lse)`` with ``return_lse=True``.
    """
    where = "ulysses_varlen_attention"
    ring = join_group(group, where)
    mask = {"causal": causal, "softmax_scale": softmax_scale, "window_size": window_size, "softcap": softcap}

    def validate() -> tuple[dict, None]:
        check_call(q, k, v, **mask, return_lse=return_lse, backend=backend, where=where)  # type: ignore[arg-type]
        check_plan(plan, ring, where)
        check_rows(q, plan.local_q, "q", "q", plan, where)
        check_rows(k, plan.local_k, "k", "k", plan, where)
        if q.shape[1] % ring.size != 0:
            raise ValueError(
                f"{where}: the number of query heads (q.shape[1] = {q.shape[1]}) must be divisible by the group "
                f"size ({ring.size}), since each rank attends with Hq / world_size heads; use "
                "ring_varlen_attention for this head count"
            )
        options = attention_options(q, k, v, **mask, return_lse=return_lse, backend=backend)
        return {**plan_items(plan), **options}, None

    collective_check(ring, where, q.device if isinstance(q, torch.Tensor) else torch.device("cpu"), validate)
    w, hkv = ring.size, k.shape[1]
    repeat = w // math.gcd(hkv, w)
    if repeat > 1:
        k, v = k.repeat_interleave(repeat, dim=1), v.repeat_interleave(repeat, dim=1)
    qg = _heads_to_sequence(q, plan, "q", group)
    d = k.shape[2]
    kv = _heads_to_sequence(torch.cat([k, v], dim=2), plan, "k", group)
    kg, vg = kv[..., :d], kv[..., d:]
    cu_q, cu_k = _global_cu_seqlens(plan, q.device)
    options: dict[str, Any] = {
        "cu_seqlens_q_host": plan.global_cu_seqlens_q,
        "cu_seqlens_k_host": plan.global_cu_seqlens_k,
        "backend": backend,
        **mask,
    }
    if not return_lse:
        return _sequence_to_heads(varlen_attention(qg, kg, vg, cu_q, cu_k, **options), plan, "q", group)
    out, lse = varlen_attention(qg, kg, vg, cu_q, cu_k, return_lse=True, **options)
    out_local = _sequence_to_heads(out, plan, "q", group)
    lse_local = _sequence_to_heads(lse.transpose(0, 1)[..., None], plan, "q", group)
    return out_local, lse_local[..., 0].transpose(0, 1).contiguous()
