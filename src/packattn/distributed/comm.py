"""Process-group plumbing: group checks, ring hops, all-to-all and all-gather with autograd."""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar, cast

import torch
import torch.distributed as dist

from ..errors import InputTypeError
from .plan import ShardPlan, ranges_index

T = TypeVar("T")


@dataclass(frozen=True)
class Ring:
    """A process group seen as a ring: this rank's place in it and its neighbours' global ranks."""

    group: Any  # a ProcessGroup, or None for the default group
    size: int
    rank: int
    next_peer: int  # global rank that receives from us
    prev_peer: int  # global rank that sends to us

    def shift(self, send: torch.Tensor, recv: torch.Tensor) -> list[Any]:
        """Post ``send`` to the next rank and ``recv`` from the previous one; returns the requests."""
        ops = [
            dist.P2POp(dist.isend, send, self.next_peer, self.group),
            dist.P2POp(dist.irecv, recv, self.prev_peer, self.group),
        ]
        return dist.batch_isend_irecv(ops)


def wait(requests: list[Any] | None, ring: Ring, where: str) -> None:
    """Wait for a ring hop; a peer that died or stopped answering is an error naming the peers, raised when
    the transport notices (a closed connection) or at the process group's ``timeout`` at the latest."""
    try:
        for r in requests or ():
            r.wait()
    except RuntimeError as e:
        raise RuntimeError(
            f"{where}: the ring hop between rank {ring.prev_peer} (sending to this rank) and rank "
            f"{ring.next_peer} (receiving from it) failed: a peer exited or did not answer within the process "
            f"group's timeout ({str(e).strip().splitlines()[0][:200]})"
        ) from e


def join_group(group: Any, where: str) -> Ring:
    """This process's place in ``group``, or a local error when it cannot take part in any exchange (no
    process group, a process outside the group): those are the only errors raised before the ranks talk."""
    if not dist.is_available():
        raise RuntimeError(f"{where}: torch.distributed is not available in this PyTorch build")
    if not dist.is_initialized():
        raise RuntimeError(
            f"{where}: the default process group is not initialised; call torch.distributed.init_process_group() "
            "first (e.g. under torchrun)"
        )
    # On a process outside a group, torch.distributed.new_group returns GroupMember.NON_GROUP_MEMBER (an int).
    outside = isinstance(group, int) and group == dist.GroupMember.NON_GROUP_MEMBER
    if not outside and group is not None and not isinstance(group, dist.ProcessGroup):
        raise InputTypeError(
            f"{where}: group must be a torch.distributed ProcessGroup or None, got {type(group).__name__}"
        )
    rank = -1 if outside else dist.get_rank(group)
    if rank < 0:
        raise ValueError(
            f"{where}: this process (global rank {dist.get_rank()}) is not a member of group; "
            "call it only on the group's ranks"
        )
    size = dist.get_world_size(group)
    world = cast(dist.ProcessGroup, group if group is not None else dist.group.WORLD)
    nxt = dist.get_global_rank(world, (rank + 1) % size)
    prv = dist.get_global_rank(world, (rank - 1) % size)
    return Ring(group, size, rank, nxt, prv)


def check_plan(plan: object, ring: Ring, where: str) -> ShardPlan:
    """``plan`` is a :class:`ShardPlan` built for this rank of the group."""
    if not isinstance(plan, ShardPlan):
        raise InputTypeError(f"{where}: plan must be a ShardPlan (see ShardPlan.build), got {type(plan).__name__}")
    if plan.world_size != ring.size:
        raise ValueError(
            f"{where}: plan was built for world_size={plan.world_size}, but the group has {ring.size} ranks; "
            "build the plan with world_size=dist.get_world_size(group)"
        )
    if plan.rank != ring.rank:
        raise ValueError(
            f"{where}: plan was built for rank {plan.rank}, but this process is rank {ring.rank} of the group; "
            "build the plan with rank=dist.get_rank(group)"
        )
    return plan


FINGERPRINT_SLOTS = 24  # fixed width, so that calls with different option sets still gather equal sizes


def _digest(value: object) -> int:
    """A hash of ``repr(value)`` that is the same in every process (Python's ``hash`` of str is not)."""
    return int.from_bytes(hashlib.blake2b(repr(value).encode(), digest_size=8).digest(), "little", signed=True)


def collective_check(
    ring: Ring, where: str, device: torch.device, validate: Callable[[], tuple[dict, T]], group_name: str = "group"
) -> T:
    """Validate this rank's call, then settle with every rank of the group, before any data moves, that all
    ranks may go on: one all-gather of a status flag and one hash per item that ranks must agree on.

    ``validate()`` raises TypeError/ValueError for this rank's bad input, or returns the items ranks must
    agree on (plan, options, head counts, dims, dtype) and what the caller needs next. If any rank failed,
    every rank raises: the failing ranks their own error, the others a ValueError naming each failing rank
    and its message (one more exchange, only then). If ranks disagree, every rank raises a ValueError naming
    what differs. Otherwise ``validate``'s result is returned (``group_name`` names the group in messages).
    So one rank's bad input never leaves the others waiting in a collective it will not join (a hang until
    the process group's timeout on NCCL).
    """
    error: TypeError | ValueError | None = None
    try:
        items, result = validate()
    except (TypeError, ValueError) as e:
        items, result, error = {}, None, e
    if ring.size == 1:
        if error is not None:
            raise error
        return cast(T, result)
    items = {"the function": where, **items}
    mine = torch.zeros(1 + FINGERPRINT_SLOTS, dtype=torch.int64)
    mine[0] = int(error is not None)
    mine[1 : 1 + len(items)] = torch.tensor([_digest(v) for v in items.values()], dtype=torch.int64)
    parts = [torch.empty_like(mine, device=device) for _ in range(ring.size)]
    dist.all_gather(parts, mine.to(device), group=ring.group)
    table = torch.stack(parts).cpu()
    failed = [r for r in range(ring.size) if table[r, 0]]
    if failed:
        messages: list[Any] = [None] * ring.size
        dist.all_gather_object(messages, None if error is None else f"{type(error).__name__}: {error}", ring.group)
        if error is not None:
            raise error
        raise ValueError(
            f"{where}: rank {', '.join(map(str, failed))} of the {group_name} rejected its input, so every rank stops "
            "before exchanging data: " + " | ".join(f"rank {r}: {messages[r]}" for r in failed)
        )
    differ = []
    for i, (name, value) in enumerate(items.items(), start=1):
        same = [r for r in range(ring.size) if table[r, i] == table[ring.rank, i]]
        if len(same) < ring.size:
            others = [r for r in range(ring.size) if r not in same]
            shown = repr(value) if len(repr(value)) <= 80 else repr(value)[:77] + "..."
            differ.append(f"{name} (this rank, {ring.rank}: {shown}; the same on ranks {same}, not on {others})")
    if differ:
        raise ValueError(
            f"{where}: ranks disagree on " + "; ".join(differ) + ". Every rank of the group must pass the same "
            "plan (built from the same global cu_seqlens and balance), options, head counts, head dims and dtype"
        )
    return cast(T, result)


def plan_items(plan: ShardPlan) -> dict[str, object]:
    """What the ranks' plans must agree on."""
    return {
        "plan.balance": plan.balance,
        "plan.global_cu_seqlens_q": plan.global_cu_seqlens_q,
        "plan.global_cu_seqlens_k": plan.global_cu_seqlens_k,
        "plan.ulysses_degree": plan.ulysses_degree,
    }


def attention_options(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, **options: Any) -> dict[str, object]:
    """What the ranks of one sequence-parallel attention call must agree on (see :func:`collective_check`)."""
    return {
        "q heads and head dim (q.shape[1:])": tuple(q.shape[1:]),
        "key/value heads (k.shape[1])": k.shape[1],
        "value head dim (v.shape[2])": v.shape[2],
        "dtype": q.dtype,
        **{name: tuple(x) if isinstance(x, list) else x for name, x in options.items()},
    }


def check_rows(x: torch.Tensor, expected: int, name: str, side: str, plan: ShardPlan, where: str) -> None:
    if x.shape[0] != expected:
        raise ValueError(
            f"{where}: {name} must hold this rank's {expected} {side} rows (plan.local_{side} for rank "
            f"{plan.rank}), got {x.shape[0]}; shard the global tensor with plan.shard_{side}"
        )


class _AllToAll(torch.autograd.Function):
    """``all_to_all_single`` along dim 0 with uneven splits; its gradient is the reverse exchange."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, send: list[int], recv: list[int], group: Any) -> torch.Tensor:
        ctx.send, ctx.recv, ctx.group = send, recv, group
        return _exchange(x, send, recv, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        return _exchange(grad, ctx.recv, ctx.send, ctx.group), None, None, None


def _exchange(x: torch.Tensor, send: list[int], recv: list[int], group: Any) -> torch.Tensor:
    x = x.contiguous()
    out = x.new_empty((sum(recv), *x.shape[1:]))
    try:
        dist.all_to_all_single(out, x, output_split_sizes=recv, input_split_sizes=send, group=group)
    except RuntimeError as e:
        raise RuntimeError(
            "ulysses_varlen_attention: the all-to-all failed: a peer exited or did not answer within the process "
            f"group's timeout ({str(e).strip().splitlines()[0][:200]})"
        ) from e
    return out


def all_to_all(x: torch.Tensor, send: list[int], recv: list[int], group: Any) -> torch.Tensor:
    """Send rows ``x[sum(send[:p]) : sum(send[:p+1])]`` to rank ``p``; receive ``recv[p]`` rows from each."""
    return _AllToAll.apply(x, send, recv, group)


class _Joined(torch.autograd.Function):
    """Contiguous copies of a call's outputs, in ``dtypes``, made by one autograd node."""

    @staticmethod
    def forward(ctx: Any, dtypes: tuple[torch.dtype, ...], *xs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        ctx.dtypes = tuple(x.dtype for x in xs)
        fresh = (torch.empty_like(x, dtype=d, memory_format=torch.contiguous_format) for x, d in zip(xs, dtypes))
        return tuple(f.copy_(x) for f, x in zip(fresh, xs))

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[Any, ...]:
        return (None, *(g.to(d) for g, d in zip(grads, ctx.dtypes)))


def joined(xs: tuple[torch.Tensor, ...], dtypes: tuple[torch.dtype, ...]) -> tuple[torch.Tensor, ...]:
    """The outputs of a distributed call as fresh contiguous tensors of one autograd node: a backward that
    reaches any of them runs the backward of all of them (zeros for those no loss used), so ranks whose
    losses use different outputs (``out`` on one, ``out`` and ``lse`` on another) still meet in the same
    collectives, in the same order."""
    return _Joined.apply(dtypes, *xs)


def gather_order(plan: ShardPlan, side: str, stride: int) -> torch.Tensor:
    """Index that puts the rows of an all-gather of padded shards (rank ``p``'s from ``p * stride``) back in
    global order."""
    shards = plan.shards(side)
    src = ranges_index(
        [p * stride + piece.local for p, s in enumerate(shards) for piece in s.pieces],
        [piece.length for s in shards for piece in s.pieces],
    )
    pieces = [piece for s in shards for piece in s.pieces]
    order = torch.empty_like(src)
    order[ranges_index([p.row for p in pieces], [p.length for p in pieces])] = src
    return order


class _Unshard(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, plan: ShardPlan, side: str, group: Any) -> torch.Tensor:
        ctx.plan, ctx.side, ctx.group = plan, side, group
        stride = max(s.total for s in plan.shards(side))
        padded = x.new_zeros((stride, *x.shape[1:]))
        padded[: x.shape[0]] = x
        parts = [torch.empty_like(padded) for _ in range(plan.world_size)]
        dist.all_gather(parts, padded, group=group)
        order = plan.cached(("gather", side, str(x.device)), lambda: gather_order(plan, side, stride).to(x.device))
        return torch.cat(parts).index_select(0, order)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        total = grad.contiguous().clone()
        dist.all_reduce(total, group=ctx.group)
        select = ctx.plan.shard_q if ctx.side == "q" else ctx.plan.shard_k
        return select(total), None, None, None


def unshard(plan: ShardPlan, x: object, side: str, group: Any, where: str) -> torch.Tensor:
    ring = join_group(group, where)

    def validate() -> tuple[dict, torch.Tensor]:
        check_plan(plan, ring, where)
        if not isinstance(x, torch.Tensor):
            raise InputTypeError(f"{where}: x_local must be a torch.Tensor, got {type(x).__name__}")
        if x.dim() == 0:
            raise ValueError(f"{where}: x_local must have a row dimension, got a 0-d tensor")
        check_rows(x, plan.local_q if side == "q" else plan.local_k, "x_local", side, plan, where)
        return {**plan_items(plan), "x_local.shape[1:]": tuple(x.shape[1:]), "dtype": x.dtype}, x

    local = collective_check(ring, where, x.device if isinstance(x, torch.Tensor) else torch.device("cpu"), validate)
    return _Unshard.apply(local, plan, side, group)
