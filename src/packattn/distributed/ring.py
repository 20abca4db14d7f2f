"""Ring attention: keys and values travel around the group, each rank keeps its queries.

Forward: at step ``s`` rank ``r`` computes its queries against the keys of rank ``(r - s) % W`` (the
calls of :mod:`.schedule`, masked pairs skipped) while the next hop is already in flight, and merges the
partial results through their LSE in float32 (float64 for float64 inputs).

Backward: a second ring. Keys and values travel again, and with them float32 accumulators of their
gradients, one hop behind; each rank adds what its queries contribute, and after ``W`` hops every
accumulator is back with its owner. Per call the backend's backward runs with the *final* output and
LSE of the rows, so ``p = exp(s - lse_final)`` is each key's exact share (flash-attention's scheme).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal, cast, overload

import torch
from torch.autograd.function import once_differentiable

from .. import dispatch
from ..api import check_call
from ..backends.base import Backend
from ..inputs import AttentionInputs, MaskSpec, compute_dtype, needs_grad
from ..layout import SeqLayout
from ..merge import merge_attention_states
from .comm import Ring, attention_options, check_plan, check_rows, collective_check, join_group, plan_items, wait
from .plan import ShardPlan, offsets_on, ranges_index
from .schedule import Call, ring_schedule, windows

__all__ = ["ring_varlen_attention"]


def _index(ranges: Sequence[tuple[int, int]], total: int, device: torch.device) -> torch.Tensor | None:
    """Row index of ``ranges`` (``None`` when together they are exactly ``[0, total)`` in order)."""
    joined: list[tuple[int, int]] = []
    for a, b in ranges:
        if joined and joined[-1][1] == a:
            joined[-1] = (joined[-1][0], b)
        else:
            joined.append((a, b))
    if joined == [(0, total)]:
        return None
    return ranges_index([a for a, _ in joined], [b - a for a, b in joined], device)


def _take(x: torch.Tensor, idx: torch.Tensor | None, dim: int = 0) -> torch.Tensor:
    return x if idx is None else x.index_select(dim, idx)


@dataclass(frozen=True)
class _Job:
    """A call of the schedule, ready to run: its row indices and offsets on the device."""

    q_idx: torch.Tensor | None
    k_idx: torch.Tensor | None
    layout: SeqLayout
    mask: MaskSpec
    fresh: bool  # no earlier call wrote these rows: store the result instead of merging it


@dataclass(frozen=True)
class _Setup:
    ring: Ring
    plan: ShardPlan
    steps: tuple[tuple[int, tuple[_Job, ...]], ...]  # (source rank, jobs) per step
    backend: str | None
    where: str

    def kv_numel(self, source: int, k: torch.Tensor, v: torch.Tensor) -> tuple[int, int]:
        rows = self.plan.shards_k[source].total
        return rows * k.shape[1] * k.shape[2], rows * v.shape[1] * v.shape[2]


def _jobs(
    plan: ShardPlan, mask: MaskSpec, source: int, calls: tuple[Call, ...], device: torch.device, written: list[bool]
) -> tuple[_Job, ...]:
    """Device-side form of one step's calls; ``written`` marks the local query rows that earlier calls wrote."""
    jobs = []
    for c in calls:
        k_ranges = [r for ranges in c.k_rows for r in ranges]
        cu_q, cu_k = c.cu_seqlens_q, c.cu_seqlens_k
        layout = SeqLayout(*offsets_on(cu_q, cu_k, device), cu_q, cu_k)
        spec = MaskSpec(mask.scale, c.window[0], c.window[1], mask.softcap)
        fresh = not any(written[i] for a, b in c.q_rows for i in range(a, b))
        for a, b in c.q_rows:
            written[a:b] = [True] * (b - a)
        q_idx = _index(c.q_rows, plan.local_q, device)
        k_idx = _index(k_ranges, plan.shards_k[source].total, device)
        jobs.append(_Job(q_idx, k_idx, layout, spec, fresh))
    return tuple(jobs)


def _pack(k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    return torch.cat([k.reshape(-1), v.reshape(-1)])


def _unpack(buf: torch.Tensor, rows: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    nk = rows * k.shape[1] * k.shape[2]
    return buf[:nk].view(rows, k.shape[1], k.shape[2]), buf[nk:].view(rows, v.shape[1], v.shape[2])


def _inputs(job: _Job, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, grad: bool) -> AttentionInputs:
    q, k, v = _take(q, job.q_idx), _take(k, job.k_idx), _take(v, job.k_idx)
    return AttentionInputs(q, k, v, job.layout, job.mask, True, grad)


def _select(setup: _Setup, inp: AttentionInputs) -> Backend:
    return dispatch.select(inp, setup.backend, setup.where)


def _forward(
    setup: _Setup, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, grad: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    cdt = compute_dtype(q.dtype)
    out = torch.zeros(q.shape[0], q.shape[1], v.shape[2], dtype=cdt, device=q.device)
    lse = torch.full((q.shape[1], q.shape[0]), float("-inf"), dtype=cdt, device=q.device)
    buf = _pack(k, v)
    for s, (source, jobs) in enumerate(setup.steps):
        pending, nxt = None, None
        if s + 1 < len(setup.steps):
            nxt = buf.new_empty(sum(setup.kv_numel(setup.steps[s + 1][0], k, v)))
            pending = setup.ring.shift(buf, nxt)  # in flight while this step computes
        kb, vb = _unpack(buf, setup.plan.shards_k[source].total, k, v)
        for job in jobs:
            inp = _inputs(job, q, kb, vb, grad)
            o, maybe_lse = _select(setup, inp).forward(inp)
            l_ = cast(torch.Tensor, maybe_lse)  # asked for (return_lse=True): never None
            if job.fresh:
                merged, merged_lse = o.to(cdt), l_.to(cdt)
            else:
                merged, merged_lse = merge_attention_states(
                    _take(out, job.q_idx), _take(lse, job.q_idx, 1), o.to(cdt), l_.to(cdt)
                )
            if job.q_idx is None:
                out, lse = merged, merged_lse
            else:
                out.index_copy_(0, job.q_idx, merged)
                lse.index_copy_(1, job.q_idx, merged_lse)
        wait(pending, setup.ring, setup.where)
        if nxt is not None:
            buf = nxt
    return out.to(q.dtype), lse


def _block_backward(
    setup: _Setup, inp: AttentionInputs, job: _Job, saved: tuple[torch.Tensor, ...], dlse: torch.Tensor | None
) -> tuple[torch.Tensor, ...]:
    out, lse, dout = saved
    rows = (_take(out, job.q_idx), _take(lse, job.q_idx, 1), _take(dout, job.q_idx))
    dlse_rows = None if dlse is None else _take(dlse, job.q_idx, 1)
    # Every route recomputes the block's probabilities from the final LSE (the merged one): each key's exact
    # share. Autograd through a forward could not; backends with that route return no LSE, so never run here.
    gradients = dispatch.backward(_select(setup, inp), inp, lse_grad=dlse_rows is not None, where=setup.where)
    return gradients(inp, rows[0], rows[1], rows[2].contiguous(), dlse_rows)


def _add_rows(acc: torch.Tensor, idx: torch.Tensor | None, x: torch.Tensor) -> None:
    if idx is None:
        acc += x.to(acc.dtype)
    else:
        acc.index_add_(0, idx, x.to(acc.dtype))


def _backward(
    setup: _Setup, saved: tuple[torch.Tensor, ...], dout: torch.Tensor, dlse: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    q, k, v, out, lse = saved
    cdt = compute_dtype(q.dtype)
    steps, ring, plan = setup.steps, setup.ring, setup.plan
    dq = torch.zeros(q.shape, dtype=cdt, device=q.device)
    buf = _pack(k, v)
    grad_pending, grad_in = None, None
    for s, (source, jobs) in enumerate(steps):
        kv_pending, nxt = None, None
        if s + 1 < len(steps):
            nxt = buf.new_empty(sum(setup.kv_numel(steps[s + 1][0], k, v)))
            kv_pending = ring.shift(buf, nxt)
        rows = plan.shards_k[source].total
        kb, vb = _unpack(buf, rows, k, v)
        grad = torch.zeros(sum(setup.kv_numel(source, k, v)), dtype=cdt, device=q.device)
        dkb, dvb = _unpack(grad, rows, k, v)
        for job in jobs:
            inp = _inputs(job, q, kb, vb, True)
            dq_j, dk_j, dv_j = _block_backward(setup, inp, job, (out, lse, dout), dlse)
            _add_rows(dq, job.q_idx, dq_j)
            _add_rows(dkb, job.k_idx, dk_j)
            _add_rows(dvb, job.k_idx, dv_j)
        wait(grad_pending, ring, setup.where)
        if grad_in is not None:
            grad += grad_in  # what the ranks before us added to these keys
        if ring.size > 1:
            # Pass the accumulator on and take the next one; after the last step it is our own, complete.
            # Two exchanges with the same peers and tag are now in flight (this one and the key/value hop
            # of step s + 1), and the transport pairs each receive with the send posted in the same place
            # on the peer. Invariant: every rank posts them in this order, key/value hop first; another
            # order on some rank would pair a key/value buffer with a gradient buffer.
            after = steps[s + 1][0] if s + 1 < len(steps) else plan.rank
            grad_in = grad.new_empty(sum(setup.kv_numel(after, k, v)))
            grad_pending = ring.shift(grad, grad_in)
        else:
            grad_in = grad
        wait(kv_pending, ring, setup.where)
        if nxt is not None:
            buf = nxt
    wait(grad_pending, ring, setup.where)
    dk, dv = _unpack(cast(torch.Tensor, grad_in), plan.local_k, k, v)
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, setup: _Setup
    ) -> tuple[torch.Tensor, torch.Tensor]:
        out, lse = _forward(setup, q, k, v, True)
        ctx.setup = setup
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.set_materialize_grads(False)
        return out, lse

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, dout: torch.Tensor | None, dlse: torch.Tensor | None) -> tuple[Any, ...]:
        saved = ctx.saved_tensors
        if dout is None:
            dout = torch.zeros_like(saved[3])
        dq, dk, dv = _backward(ctx.setup, saved, dout, dlse)
        return dq, dk, dv, None


def ring_setup(
    plan: ShardPlan, ring: Ring, mask: MaskSpec, backend: str | None, device: torch.device, where: str
) -> _Setup:
    """The ring's steps with their device-side indices, cached on the plan per mask and device."""

    def build() -> tuple[tuple[int, tuple[_Job, ...]], ...]:
        written = [False] * plan.local_q
        steps = ring_schedule(plan, mask.left, mask.right)
        return tuple((st.source, _jobs(plan, mask, st.source, st.calls, device, written)) for st in steps)

    steps = plan.cached(("jobs", mask, str(device)), build)
    return _Setup(ring, plan, steps, backend, where)


def run_ring(
    setup: _Setup, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, grad: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(out, lse)`` of this rank's queries over every rank's keys; differentiable when ``grad``."""
    if grad:
        return _RingAttention.apply(q, k, v, setup)
    return _forward(setup, q, k, v, False)


def check_ring_backend(
    setup: _Setup, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: MaskSpec, grad: bool
) -> None:
    """An explicit backend must run every call of every rank; checked here, before any rank communicates."""
    if setup.backend is None:
        return  # dispatch always finds one (the reference backend runs everything)
    plan = setup.plan
    cu_q, cu_k = plan.cu_seqlens_q_host, plan.cu_seqlens_k_host
    layout = SeqLayout(*plan.local_cu_seqlens(q.device), cu_q, cu_k)
    for left, right in sorted(windows(plan, mask.left, mask.right)):
        spec = MaskSpec(mask.scale, left, right, mask.softcap)
        dispatch.select(AttentionInputs(q, k, v, layout, spec, True, grad), setup.backend, setup.where)


@overload
def ring_varlen_attention(
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
def ring_varlen_attention(
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


def ring_varlen_attention(
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
    """Ring attention over the ranks of ``group`` on this rank's shards of a packed batch.

    Shapes (``plan`` says which rows of the global batch this rank holds)::

        q  (plan.local_q, Hq, D)      k  (plan.local_k, Hkv, D)      v  (plan.local_k, Hkv, Dv)
        out (plan.local_q, Hq, Dv) in q.dtype      lse (Hq, plan.local_q) float32 (float64 for float64)

    The result on every rank equals ``plan.shard_q(varlen_attention(q_global, k_global, v_global, ...))``
    with the same options (and the LSE likewise): masks apply to global positions inside each sequence,
    bottom-right aligned, as in :func:`packattn.varlen_attention`. Keys and values travel around the ring
    by point-to-point send/recv, the next hop in flight while the current block computes; (query, key)
    blocks that the mask hides entirely are skipped. Gradients of ``q``, ``k`` and ``v`` equal those of
    single-process attention; the backward runs its own ring (no rank ever holds the whole sequence).

    Collective: every rank of ``group`` calls it with the same options, head counts, head dims and dtype
    and a plan built from the same global batch for its rank, and every rank takes part in the backward if
    any does. Every call first validates this rank's inputs and settles with all ranks, in one small
    all-gather before any data moves, that every rank may go on: if any rank's input is bad, every rank
    raises (the others a ValueError naming that rank and its message), and if ranks disagree, every rank
    raises a ValueError naming what differs (e.g. ``ranks disagree on causal``). A peer that exits or stops
    answering during the ring is a RuntimeError on its neighbours when the transport notices, at the process
    group's ``timeout`` at the latest.

    Args:
        q, k, v: this rank's rows, e.g. ``plan.shard_q(q_global)``, ``plan.shard_k(k_global)``.
        plan: :class:`ShardPlan` built for this rank of ``group`` (its world size and rank are checked).
        group: the process group (default: the default group). Any backend with point-to-point send/recv:
            gloo for CPU tensors, nccl for CUDA, hccl for Ascend NPU.
        causal, softmax_scale, window_size, softcap: as in :func:`packattn.varlen_attention`.
        return_lse: also return the LSE of this rank's query rows.
        backend: run every block on exactly this attention backend (it must return the LSE).

    Returns:
        ``out``, or ``(out, lse)`` with ``return_lse=True``.
    """
    where = "ring_varlen_attention"
    ring = join_group(group, where)
    grad = isinstance(q, torch.Tensor) and isinstance(k, torch.Tensor) and isinstance(v, torch.Tensor)
    grad = grad and needs_grad(q, k, v)

    def validate() -> tuple[dict, _Setup]:
        mask = check_call(
            q, k, v, softmax_scale=softmax_scale, causal=causal, window_size=window_size, softcap=softcap,
            return_lse=return_lse, backend=backend, where=where,
        )  # fmt: skip
        check_plan(plan, ring, where)
        check_rows(q, plan.local_q, "q", "q", plan, where)
        check_rows(k, plan.local_k, "k", "k", plan, where)
        setup = ring_setup(plan, ring, mask, backend, q.device, where)
        check_ring_backend(setup, q, k, v, mask, grad)
        options = {"causal": causal, "softmax_scale": softmax_scale, "window_size": window_size, "softcap": softcap}
        return {**plan_items(plan), **attention_options(q, k, v, **options, backend=backend)}, setup

    setup = collective_check(ring, where, q.device if isinstance(q, torch.Tensor) else torch.device("cpu"), validate)
    out, lse = run_ring(setup, q, k, v, grad)
    return (out, lse) if return_lse else out
