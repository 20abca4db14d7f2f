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
from dataclasses import dataclass
from typing import Any, Literal, cast, overload

import torch

from ..api import check_call, varlen_attention
from .comm import (
    Ring,
    all_to_all,
    attention_options,
    check_plan,
    check_rows,
    collective_check,
    join_group,
    joined,
    plan_items,
)
from .plan import Shard, ShardPlan, offsets_on

__all__ = ["ulysses_varlen_attention"]


@dataclass(frozen=True)
class HeadExchange:
    """One side's all-to-all inside a Ulysses group: each member's row count, and where each row goes.

    ``to_target[i]`` is the place, among the rows that arrive (rank-major: member 0's, then member 1's, ...),
    of row ``i`` of the target order; ``to_members`` is the inverse permutation.
    """

    counts: tuple[int, ...]
    to_target: torch.Tensor
    to_members: torch.Tensor


def head_exchange(plan: ShardPlan, side: str, members: range, target: Shard, device: torch.device) -> HeadExchange:
    """The exchange among plan ranks ``members`` whose rows, together, are ``target``'s (cached on the plan)."""

    def build() -> HeadExchange:
        shards = [plan.shards(side)[r] for r in members]
        arrived, wanted = torch.cat([s.global_rows() for s in shards]), target.global_rows()
        to_target = torch.empty_like(wanted)
        if wanted.numel():
            place = torch.empty(int(arrived.max()) + 1, dtype=torch.int64)
            place[arrived] = torch.arange(arrived.numel())
            to_target = place[wanted]
        to_members = torch.empty_like(to_target)
        to_members[to_target] = torch.arange(to_target.numel())
        return HeadExchange(tuple(s.total for s in shards), to_target.to(device), to_members.to(device))

    return plan.cached(("heads", side, members.start, members.stop, str(device)), build)


def heads_to_rows(x: torch.Tensor, ex: HeadExchange, group: Any) -> torch.Tensor:
    """``(own rows, n * h, D)`` on each of the ``n`` members -> ``(target rows, h, D)``: head group ``p`` on
    member ``p``."""
    n = len(ex.counts)
    rows, heads, dim = x.shape
    send = x.reshape(rows, n, heads // n, dim).transpose(0, 1).reshape(n * rows, heads // n, dim)
    got = all_to_all(send, [rows] * n, list(ex.counts), group)
    return got.index_select(0, ex.to_target)


def rows_to_heads(y: torch.Tensor, ex: HeadExchange, member: int, group: Any) -> torch.Tensor:
    """Inverse of :func:`heads_to_rows` on member ``member``: ``(target rows, h, D)`` -> ``(own rows, n * h, D)``."""
    n, rows = len(ex.counts), ex.counts[member]
    got = all_to_all(y.index_select(0, ex.to_members), list(ex.counts), [rows] * n, group)
    h, dim = y.shape[1], y.shape[2]
    return got.reshape(n, rows, h, dim).transpose(0, 1).reshape(rows, n * h, dim).contiguous()


def repeat_kv_heads(k: torch.Tensor, v: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """KV heads repeated so that ``n`` members get whole heads, keeping the query-to-KV head mapping."""
    repeat = n // math.gcd(k.shape[1], n)
    if repeat == 1:
        return k, v
    return k.repeat_interleave(repeat, dim=1), v.repeat_interleave(repeat, dim=1)


def outputs_to_heads(
    out: torch.Tensor, lse: torch.Tensor | None, ex: HeadExchange, member: int, group: Any
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The ``(target rows, h, Dv)`` output and the ``(h, target rows)`` LSE (or None) back as
    ``(own rows, n * h, Dv)`` and ``(n * h, own rows)``; both, with the LSE, from one autograd node."""
    out = rows_to_heads(out, ex, member, group)
    if lse is None:
        return out, None
    lse = rows_to_heads(lse.transpose(0, 1)[..., None], ex, member, group)[..., 0].transpose(0, 1)
    out, lse = joined((out, lse), (out.dtype, lse.dtype))
    return out, lse


def check_heads(q: torch.Tensor, n: int, where: str, group_name: str, alternative: str) -> None:
    if q.shape[1] % n != 0:
        raise ValueError(
            f"{where}: the number of query heads (q.shape[1] = {q.shape[1]}) must be divisible by the "
            f"{group_name} size ({n}), since each rank attends with Hq / {n} heads; {alternative}"
        )


def _whole(plan: ShardPlan) -> ShardPlan:
    """The whole batch on one rank, in global order."""
    return plan.cached(
        "whole", lambda: ShardPlan.build(plan.global_cu_seqlens_q, plan.global_cu_seqlens_k, world_size=1, rank=0)
    )


def _global_cu_seqlens(plan: ShardPlan, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """The global batch's offsets as int32 tensors, cached on the plan per device."""
    return plan.cached(
        ("global_cu_seqlens", str(device)),
        lambda: offsets_on(plan.global_cu_seqlens_q, plan.global_cu_seqlens_k, device),
    )


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
        check_heads(q, ring.size, where, "group", "use ring_varlen_attention for this head count")
        options = attention_options(q, k, v, **mask, return_lse=return_lse, backend=backend)
        return {**plan_items(plan), **options}, None

    collective_check(ring, where, q.device if isinstance(q, torch.Tensor) else torch.device("cpu"), validate)
    out, lse = ulysses_attend(q, k, v, plan, ring, mask, return_lse, backend)
    return (out, cast(torch.Tensor, lse)) if return_lse else out


def exchange_heads(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: ShardPlan, members: range, target: ShardPlan, group: Any
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, HeadExchange]:
    """The first all-to-all: the plan ranks ``members`` (a Ulysses group, in group order) trade heads for the
    rows of ``target``'s local batch (all their rows together). Returns ``(q, k, v, the q side's exchange)``."""
    k, v = repeat_kv_heads(k, v, len(members))
    ex_q, ex_k = (head_exchange(plan, side, members, target.shards(side)[target.rank], q.device) for side in ("q", "k"))
    d = k.shape[2]
    kv = heads_to_rows(torch.cat([k, v], dim=2), ex_k, group)
    return heads_to_rows(q, ex_q, group), kv[..., :d], kv[..., d:], ex_q


def ulysses_attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    plan: ShardPlan,
    group: Ring,
    mask: dict[str, Any],
    return_lse: bool,
    backend: str | None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Ulysses over ``group`` (plan ranks 0..W-1) after the checks: ``(out, lse or None)`` of this rank's rows."""
    qg, kg, vg, ex_q = exchange_heads(q, k, v, plan, range(group.size), _whole(plan), group.group)
    cu_q, cu_k = _global_cu_seqlens(plan, q.device)
    options: dict[str, Any] = {
        "cu_seqlens_q_host": plan.global_cu_seqlens_q,
        "cu_seqlens_k_host": plan.global_cu_seqlens_k,
        "backend": backend,
        **mask,
    }
    if not return_lse:
        out = varlen_attention(qg, kg, vg, cu_q, cu_k, **options)
        return outputs_to_heads(out, None, ex_q, group.rank, group.group)
    out, lse = varlen_attention(qg, kg, vg, cu_q, cu_k, return_lse=True, **options)
    return outputs_to_heads(out, lse, ex_q, group.rank, group.group)
