"""Sequence parallelism over ``torch.distributed``: ring and all-to-all varlen attention.

Every rank holds some rows of a global packed batch, as a :class:`ShardPlan` says; the attention result on
each rank equals its rows of single-process :func:`packattn.varlen_attention` on the whole batch, forward
and backward. :func:`ring_varlen_attention` passes keys and values around the group (any head count);
:func:`ulysses_varlen_attention` exchanges heads for tokens with two all-to-alls (``Hq`` divisible by the
group size); :func:`usp_varlen_attention` does both on a 2-D mesh (Ulysses inside groups, ring across
them), and :func:`joint_varlen_attention` adds tokens that every rank holds whole (joint text+image).

Typical use, on every rank (e.g. under ``torchrun``)::

    plan = ShardPlan.build(cu_q, cu_k, world_size=dist.get_world_size(), rank=dist.get_rank())
    out = ring_varlen_attention(plan.shard_q(q), plan.shard_k(k), plan.shard_k(v), plan, causal=True)
    full = plan.unshard_q(out)  # the global (Tq, Hq, Dv) result, on every rank
"""

from .mesh import joint_varlen_attention, usp_varlen_attention
from .plan import ShardPlan
from .ring import ring_varlen_attention
from .ulysses import ulysses_varlen_attention

__all__ = [
    "ShardPlan",
    "joint_varlen_attention",
    "ring_varlen_attention",
    "ulysses_varlen_attention",
    "usp_varlen_attention",
]
