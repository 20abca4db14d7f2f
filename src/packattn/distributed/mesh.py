"""USP: Ulysses all-to-all inside groups of ranks and ring attention across the groups, on a 2-D mesh.

A mesh of ``W = U x R`` ranks: each Ulysses group of ``U`` ranks trades heads for tokens with two
all-to-alls (so each member holds ``Hq / U`` heads of the whole group's rows), and the ``R`` groups run ring
attention across each other on those heads (members with the same Ulysses rank form one ring). The plan is
a :class:`ShardPlan` built with ``ulysses_degree=U``; rank ``r * U + u`` is Ulysses rank ``u`` of ring rank
``r``. ``U = 1`` is exactly :func:`ring_varlen_attention` and ``R = 1`` exactly
:func:`ulysses_varlen_attention`.

Joint attention (:func:`joint_varlen_attention`): some tokens of every sequence (the text of a joint
text+image sequence) are held whole on every rank while the rest is sharded, as the multimodal runtimes do.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from itertools import pairwise
from typing import Any, Literal, TypeVar, cast, overload

import torch
import torch.distributed as dist

from ..api import check_call, varlen_attention
from ..errors import InputTypeError
from ..inputs import MaskSpec, check_tensors, compute_dtype, needs_grad
from ..merge import merge_attention_states
from .comm import Ring, attention_options, check_rows, collective_check, join_group, joined, plan_items
from .plan import ShardPlan, offsets_on
from .ring import check_ring_backend, ring_setup, run_ring
from .ulysses import check_heads, exchange_heads, outputs_to_heads, ulysses_attend

__all__ = ["joint_varlen_attention", "usp_varlen_attention"]

T = TypeVar("T")


def _dimension(group: Any, where: str) -> Ring:
    """One dimension of the mesh: ``group``'s ring, or this process alone for ``None``."""
    if group is not None:
        return join_group(group, where)
    join_group(None, where)  # the default group's checks (initialised): the only errors before any exchange
    me = dist.get_rank()
    return Ring(None, 1, 0, me, me)


def mesh_dimensions(mesh: Any, ulysses_group: Any, ring_group: Any, where: str) -> tuple[Ring, Ring]:
    """The (Ulysses, ring) dimensions from a 2-D ``DeviceMesh`` or from two process groups."""
    if mesh is not None:
        from torch.distributed.device_mesh import DeviceMesh

        if ulysses_group is not None or ring_group is not None:
            raise ValueError(f"{where}: pass mesh= or ulysses_group= / ring_group=, not both")
        if not isinstance(mesh, DeviceMesh):
            raise InputTypeError(f"{where}: mesh must be a torch.distributed DeviceMesh, got {type(mesh).__name__}")
        names = mesh.mesh_dim_names or ()
        if mesh.ndim != 2 or set(names) != {"ring", "ulysses"}:
            raise ValueError(
                f"{where}: mesh must be 2-D with mesh_dim_names ('ring', 'ulysses'), got {mesh.ndim}-D with "
                f"names {names!r}; e.g. init_device_mesh(device, (ring_degree, ulysses_degree), "
                "mesh_dim_names=('ring', 'ulysses'))"
            )
        ulysses_group, ring_group = mesh.get_group("ulysses"), mesh.get_group("ring")
    elif ulysses_group is None and ring_group is None:
        raise ValueError(f"{where}: pass mesh= (a 2-D DeviceMesh) or ulysses_group= and/or ring_group=")
    return _dimension(ulysses_group, where), _dimension(ring_group, where)


def check_mesh_plan(plan: object, uly: Ring, ring: Ring, where: str) -> ShardPlan:
    """``plan`` is a :class:`ShardPlan` built for this rank of the ``uly.size x ring.size`` mesh."""
    if not isinstance(plan, ShardPlan):
        raise InputTypeError(f"{where}: plan must be a ShardPlan (see ShardPlan.build), got {type(plan).__name__}")
    u, r = uly.size, ring.size
    expected = (u * r, u, ring.rank * u + uly.rank)
    # With one ring part, a plan for plain Ulysses (ulysses_degree=1) holds the same rows.
    degree = u if r == 1 and plan.ulysses_degree == 1 else plan.ulysses_degree
    if (plan.world_size, degree, plan.rank) != expected:
        raise ValueError(
            f"{where}: plan was built for world_size={plan.world_size}, ulysses_degree={plan.ulysses_degree}, "
            f"rank={plan.rank}, but this process is Ulysses rank {uly.rank} of {u} and ring rank {ring.rank} of "
            f"{r}; build it with world_size={expected[0]}, ulysses_degree={u}, rank={expected[2]} "
            "(ring rank * ulysses_degree + Ulysses rank)"
        )
    return plan


def mesh_check(uly: Ring, ring: Ring, where: str, device: torch.device, validate: Callable[[], tuple[dict, T]]) -> T:
    """:func:`collective_check` over the whole mesh: inside the Ulysses group, then across the ring, whose
    members then know the outcome of every Ulysses group. Every rank raises if any rank's input is bad or
    if any two ranks disagree."""

    def in_group() -> tuple[dict, tuple[dict, T]]:
        # Groups that form a mesh: a Ulysses group's members share their ring rank, a ring's their Ulysses rank.
        items, result = validate()
        mesh = "must share it: the groups must form a mesh"
        across = {**items, f"the Ulysses rank (a ring's members {mesh})": uly.rank}
        return {**items, f"the ring rank (a Ulysses group's members {mesh})": ring.rank}, (across, result)

    return collective_check(
        ring, where, device, lambda: collective_check(uly, where, device, in_group, "Ulysses group"), "ring group"
    )


def _attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    plan: ShardPlan,
    uly: Ring,
    ring: Ring,
    mask: MaskSpec,
    options: dict[str, Any],
    return_lse: bool,
    backend: str | None,
    where: str,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The checked call's ``(out, lse or None)``."""
    grad = needs_grad(q, k, v)
    if ring.size == 1 and uly.size > 1:
        return ulysses_attend(q, k, v, plan, uly, options, return_lse, backend)
    ring_plan = plan.ring_level()
    if uly.size > 1:
        members = range(ring.rank * uly.size, (ring.rank + 1) * uly.size)
        q, k, v, ex_q = exchange_heads(q, k, v, plan, members, ring_plan, uly.group)
    setup = ring_setup(ring_plan, ring, mask, backend, q.device, where)
    # Decided by the options, head counts and dtype, which every rank has agreed on: every rank raises alike.
    check_ring_backend(setup, q, k, v, mask, grad)
    out, lse = run_ring(setup, q, k, v, grad)
    if uly.size > 1:
        return outputs_to_heads(out, lse if return_lse else None, ex_q, uly.rank, uly.group)
    return out, lse


def _validate(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    plan: Any,
    uly: Ring,
    ring: Ring,
    mask_options: dict[str, Any],
    return_lse: bool,
    backend: str | None,
    where: str,
) -> tuple[dict, MaskSpec]:
    mask = check_call(q, k, v, **mask_options, return_lse=return_lse, backend=backend, where=where)
    check_mesh_plan(plan, uly, ring, where)
    check_rows(q, plan.local_q, "q", "q", plan, where)
    check_rows(k, plan.local_k, "k", "k", plan, where)
    check_heads(q, uly.size, where, "Ulysses group", "use a smaller ulysses_degree")
    options = attention_options(q, k, v, **mask_options, return_lse=return_lse, backend=backend)
    return {**plan_items(plan), **options}, mask


@overload
def usp_varlen_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    plan: ShardPlan,
    *,
    mesh: Any = ...,
    ulysses_group: Any = ...,
    ring_group: Any = ...,
    causal: bool = ...,
    softmax_scale: float | None = ...,
    window_size: tuple[int, int] = ...,
    softcap: float = ...,
    return_lse: Literal[False] = ...,
    backend: str | None = ...,
) -> torch.Tensor: ...


@overload
def usp_varlen_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    plan: ShardPlan,
    *,
    mesh: Any = ...,
    ulysses_group: Any = ...,
    ring_group: Any = ...,
    causal: bool = ...,
    softmax_scale: float | None = ...,
    window_size: tuple[int, int] = ...,
    softcap: float = ...,
    return_lse: Literal[True],
    backend: str | None = ...,
) -> tuple[torch.Tensor, torch.Tensor]: ...


def usp_varlen_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    plan: ShardPlan,
    *,
    mesh: Any = None,
    ulysses_group: Any = None,
    ring_group: Any = None,
    causal: bool = False,
    softmax_scale: float | None = None,
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    return_lse: bool = False,
    backend: str | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Sequence-parallel attention on a ``ulysses_degree x ring_degree`` mesh (Ulysses inside, ring across).

    Same contract as :func:`ring_varlen_attention` (shapes, result equal to this rank's rows of
    single-process attention on the whole batch, LSE, gradients, the per-call agreement check and fault
    behaviour), with the plan built for the mesh::

        plan = ShardPlan.build(cu_q, cu_k, world_size=U * R, rank=ring_rank * U + ulysses_rank,
                               ulysses_degree=U)

    Each rank sends ``Hq / U`` heads of its rows to each member of its Ulysses group (one all-to-all for
    ``q``, one for ``k`` and ``v`` together), the ring then runs on ``Hq / U`` heads of the whole group's
    rows, and one all-to-all returns the output (and LSE). KV heads are repeated only when ``Hkv`` does not
    divide by ``U``. With ``U = 1`` this is :func:`ring_varlen_attention` on ``ring_group``, with
    ``R = 1`` :func:`ulysses_varlen_attention` on ``ulysses_group``.

    Args:
        q, k, v, plan, causal, softmax_scale, window_size, softcap, return_lse, backend: as in
            :func:`ring_varlen_attention` (``Hq`` must divide by ``U``).
        mesh: a 2-D ``DeviceMesh`` with ``mesh_dim_names=("ring", "ulysses")``, e.g.
            ``init_device_mesh("cuda", (R, U), mesh_dim_names=("ring", "ulysses"))``; or, instead:
        ulysses_group, ring_group: this rank's Ulysses group and ring (``None``: that dimension has one rank).

    Returns:
        ``out``, or ``(out, lse)`` with ``return_lse=True``.
    """
    where = "usp_varlen_attention"
    uly, ring = mesh_dimensions(mesh, ulysses_group, ring_group, where)
    mask_options = {"causal": causal, "softmax_scale": softmax_scale, "window_size": window_size, "softcap": softcap}
    device = q.device if isinstance(q, torch.Tensor) else torch.device("cpu")

    def validate() -> tuple[dict, MaskSpec]:
        return _validate(q, k, v, plan, uly, ring, mask_options, return_lse, backend, where)

    mask = mesh_check(uly, ring, where, device, validate)
    out, lse = _attend(q, k, v, plan, uly, ring, mask, mask_options, return_lse, backend, where)
    return (out, cast(torch.Tensor, lse)) if return_lse else out


def _check_joint(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    jq: object,
    jk: object,
    jv: object,
    cu_joint: object,
    plan: ShardPlan,
    where: str,
) -> tuple[int, ...]:
    check_tensors(jq, jk, jv, where, names=("joint_q", "joint_k", "joint_v"))  # type: ignore[arg-type]
    jq, jk, jv = cast(torch.Tensor, jq), cast(torch.Tensor, jk), cast(torch.Tensor, jv)
    for name, t, like in (("joint_q", jq, q), ("joint_k", jk, k), ("joint_v", jv, v)):
        if t.shape[1:] != like.shape[1:] or t.dtype != like.dtype or t.device != like.device:
            lname = name.removeprefix("joint_")
            raise ValueError(
                f"{where}: {name} must have the heads, head dim, dtype and device of {lname} "
                f"({tuple(like.shape[1:])}, {like.dtype}, {like.device}), got {tuple(t.shape[1:])}, {t.dtype}, "
                f"{t.device}"
            )
    if isinstance(cu_joint, torch.Tensor) or not isinstance(cu_joint, Sequence):
        raise InputTypeError(
            f"{where}: cu_seqlens_joint_host must be a list/tuple of Python ints, got {type(cu_joint).__name__}"
        )
    cu = tuple(cu_joint)
    if not all(isinstance(x, int) and not isinstance(x, bool) for x in cu):
        raise InputTypeError(f"{where}: cu_seqlens_joint_host must hold only Python ints, got {cu!r}")
    ok = len(cu) == plan.batch + 1 and cu[0] == 0 and cu[-1] == jq.shape[0]
    if not ok or any(b < a for a, b in pairwise(cu)):
        raise ValueError(
            f"{where}: cu_seqlens_joint_host must be the non-decreasing offsets of the joint tokens of the plan's "
            f"{plan.batch} sequences, from 0 to joint_q.shape[0] = {jq.shape[0]}, got {cu!r}"
        )
    return cu


class _SumOverRanks(torch.autograd.Function):
    """All-reduce sum over one group; the gradient of every rank's input is the sum of the gradients."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any) -> torch.Tensor:
        ctx.group = group
        total = x.contiguous().clone()
        dist.all_reduce(total, group=group)
        return total

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        total = grad.contiguous().clone()
        dist.all_reduce(total, group=ctx.group)
        return total, None


def _all_reduce(x: torch.Tensor, dims: Sequence[Ring], op: Any = None) -> torch.Tensor:
    """Sum (differentiable) or, with ``op``, another reduction (no gradient) over every rank of the mesh."""
    for d in dims:
        if d.size > 1:
            if op is None:
                x = _SumOverRanks.apply(x, d.group)
            else:
                x = x.clone()
                dist.all_reduce(x, op=op, group=d.group)
    return x


def _merge_over_ranks(out: torch.Tensor, lse: torch.Tensor, dims: Sequence[Ring]) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge every rank's partial ``(out, lse)`` of the same queries over disjoint key sets."""
    cdt = compute_dtype(out.dtype)
    lse = lse.to(cdt)
    top = _all_reduce(lse.detach(), dims, dist.ReduceOp.MAX)
    top = top.masked_fill(torch.isneginf(top), 0.0)  # rows without keys anywhere: weights exp(-inf) = 0
    weight = torch.exp(lse - top)  # (H, T)
    rows = out.shape[0]
    packed = torch.cat([(out.to(cdt) * weight.transpose(0, 1)[..., None]).reshape(-1), weight.reshape(-1)])
    total = _all_reduce(packed, dims)
    num, den = total[: out.numel()].view(out.shape), total[out.numel() :].view(weight.shape)
    seen = den > 0
    safe = torch.where(seen, den, torch.ones_like(den))
    merged = torch.where(seen.transpose(0, 1)[..., None], num / safe.transpose(0, 1)[..., None], 0.0)
    merged_lse = torch.where(seen, torch.log(safe) + top, float("-inf"))
    return merged.view(rows, *out.shape[1:]), merged_lse


def joint_varlen_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    joint_q: torch.Tensor,
    joint_k: torch.Tensor,
    joint_v: torch.Tensor,
    cu_seqlens_joint_host: Sequence[int],
    plan: ShardPlan,
    *,
    mesh: Any = None,
    ulysses_group: Any = None,
    ring_group: Any = None,
    softmax_scale: float | None = None,
    softcap: float = 0.0,
    return_lse: bool = False,
    backend: str | None = None,
) -> tuple[torch.Tensor, ...]:
    """Joint attention of sharded tokens and tokens every rank holds whole (the text of text+image sequences).

    Sequence ``b`` of the global batch is its joint tokens ``joint_*[cu_seqlens_joint_host[b]:...[b+1]]``
    (the same on every rank) together with its sharded tokens (``plan``'s sequence ``b``, of which this rank
    holds ``q``, ``k``, ``v``), all attending to all, as one sequence ``[joint, sharded]`` of
    single-process :func:`packattn.varlen_attention` would. Bidirectional only (no ``causal``/``window``).

    Computed as: the sharded queries against the sharded keys by :func:`usp_varlen_attention` (ring,
    Ulysses or both, by the groups given), merged through the LSE with the sharded queries against the
    joint keys (local); the joint queries against this rank's sharded keys (local), merged over all ranks
    (two small all-reduces of ``(Tj, Hq, Dv)``), then with the joint queries against the joint keys. The
    joint keys never travel.

    Gradients: the sharded tensors get exactly their rows of the single-process gradient. Tensors every
    rank holds follow the rule of data-parallel replicas: the gradients reaching ``joint_out`` on the ranks
    are summed (as if each rank's loss were part of one total), and ``joint_q``/``joint_k``/``joint_v``
    get this rank's share, which summed over the ranks (an all-reduce, like the gradients of replicated
    parameters) is the single-process gradient. The outputs come from one autograd node: a rank whose
    loss leaves out ``joint_out`` (or ``out``) contributes zeros and still joins the backward's exchanges.

    Args:
        q, k, v, plan, mesh, ulysses_group, ring_group, softmax_scale, softcap, backend: as in
            :func:`usp_varlen_attention`.
        joint_q, joint_k, joint_v: ``(Tj, Hq, D)``, ``(Tj, Hkv, D)``, ``(Tj, Hkv, Dv)``, the same on every
            rank, with ``q``'s heads, dims, dtype and device.
        cu_seqlens_joint_host: ``B + 1`` Python ints, the joint tokens' offsets (a sequence may have none).
        return_lse: also return the LSEs.

    Returns:
        ``(out, joint_out)``, or ``(out, joint_out, lse, joint_lse)`` with ``return_lse=True``:
        ``out (plan.local_q, Hq, Dv)`` and ``joint_out (Tj, Hq, Dv)`` in ``q.dtype``, LSEs ``(Hq, rows)``
        in float32 (float64 for float64).
    """
    where = "joint_varlen_attention"
    uly, ring = mesh_dimensions(mesh, ulysses_group, ring_group, where)
    mask_options = {"causal": False, "softmax_scale": softmax_scale, "window_size": (-1, -1), "softcap": softcap}
    device = q.device if isinstance(q, torch.Tensor) else torch.device("cpu")

    def validate() -> tuple[dict, tuple[MaskSpec, tuple[int, ...]]]:
        items, mask = _validate(q, k, v, plan, uly, ring, mask_options, True, backend, where)
        cu = _check_joint(q, k, v, joint_q, joint_k, joint_v, cu_seqlens_joint_host, plan, where)
        return {**items, "cu_seqlens_joint_host": cu, "return_lse": return_lse}, (mask, cu)

    mask, cu_joint = mesh_check(uly, ring, where, device, validate)
    local: dict[str, Any] = {"softmax_scale": softmax_scale, "softcap": softcap, "backend": backend}
    cu_j = plan.cached(("joint", cu_joint, str(device)), lambda: offsets_on(cu_joint, cu_joint, device)[0])
    cu_q, cu_k = plan.local_cu_seqlens(device)

    def attend(qq: Any, kk: Any, vv: Any, cq: Any, hq: Any, ck: Any, hk: Any) -> tuple[torch.Tensor, torch.Tensor]:
        return varlen_attention(
            qq, kk, vv, cq, ck, cu_seqlens_q_host=hq, cu_seqlens_k_host=hk, return_lse=True, **local
        )

    # Local parts first, then the exchanges.
    o_sj, l_sj = attend(q, joint_k, joint_v, cu_q, plan.cu_seqlens_q_host, cu_j, cu_joint)
    o_js, l_js = attend(joint_q, k, v, cu_j, cu_joint, cu_k, plan.cu_seqlens_k_host)
    o_jj, l_jj = attend(joint_q, joint_k, joint_v, cu_j, cu_joint, cu_j, cu_joint)
    o_ss, l_ss = _attend(q, k, v, plan, uly, ring, mask, mask_options, True, backend, where)
    cdt = compute_dtype(q.dtype)
    out, lse = merge_attention_states(o_ss.to(cdt), cast(torch.Tensor, l_ss), o_sj.to(cdt), l_sj)
    o_js, l_js = _merge_over_ranks(o_js, l_js, (uly, ring))
    joint_out, joint_lse = merge_attention_states(o_js, l_js, o_jj.to(cdt), l_jj)
    if return_lse:
        return joined((out, joint_out, lse, joint_lse), (q.dtype, q.dtype, cdt, cdt))
    return joined((out, joint_out), (q.dtype, q.dtype))
