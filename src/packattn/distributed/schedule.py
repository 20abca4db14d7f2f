"""The ring's work list: for each step, which local queries meet which rows of the visiting keys.

At step ``s`` of the ring, rank ``r`` holds the keys of rank ``(r - s) % W``. For every sequence, each of
its query pieces meets each of the visiting key pieces. The mask is defined on global positions, so for
a pair of pieces the visible (query, key) set is a band ``lo <= j - i <= hi`` in piece coordinates.
Trimmed to its bounding box (rows that see a key, keys that some row sees), that band is exactly what
:func:`packattn.varlen_attention`'s bottom-right window rule gives for a box of ``m`` rows and ``n`` keys
with ``window_size = ((n - m) - lo, hi - (n - m))``; both entries are ``>= 0`` because the box is tight.
Pairs whose box is empty are hidden by the mask and are never computed. Boxes with the same window go
into one packed varlen call (one "sequence" each), so a step costs one call per distinct window.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import pairwise

from ..inputs import MaskSpec
from .plan import Piece, ShardPlan


@dataclass(frozen=True)
class Block:
    """Rows ``[q, q + m)`` of a query piece against keys ``[k, k + n)`` of a key piece (sequence positions)."""

    q: int
    m: int
    k: int
    n: int
    window: tuple[int, int]


def pair_block(qp: Piece, kp: Piece, lq: int, lk: int, left: int, right: int) -> Block | None:
    """The visible box of a query piece and a key piece of one sequence, or ``None`` if the mask hides it.

    ``lq``/``lk`` are the sequence's global lengths and ``left``/``right`` the global window (``-1`` is
    unbounded); the pieces sit at diagonal offset ``Lk - Lq + q_start - k_start`` of the sequence's band.
    """
    mask = MaskSpec(1.0, left, right)
    off = lk - lq + qp.start - kp.start
    r0, r1 = mask.visible_rows(qp.length, kp.length, off)
    c0, c1 = mask.key_range(r0, r1, qp.length, kp.length, off)
    if r0 >= r1 or c0 >= c1:
        return None
    m, n = r1 - r0, c1 - c0
    return Block(qp.start + r0, m, kp.start + c0, n, mask.window_of_box(m, n, off + r0 - c0))


@dataclass(frozen=True)
class Call:
    """One packed varlen call: entry ``e`` is local query rows ``q_rows[e]`` against the visiting rank's
    key rows ``k_rows[e]`` (one or more ranges, concatenated), all under ``window``."""

    window: tuple[int, int]
    q_rows: tuple[tuple[int, int], ...]
    k_rows: tuple[tuple[tuple[int, int], ...], ...]

    @property
    def cu_seqlens_q(self) -> tuple[int, ...]:
        cu = [0]
        for a, b in self.q_rows:
            cu.append(cu[-1] + b - a)
        return tuple(cu)

    @property
    def cu_seqlens_k(self) -> tuple[int, ...]:
        cu = [0]
        for ranges in self.k_rows:
            cu.append(cu[-1] + sum(b - a for a, b in ranges))
        return tuple(cu)


@dataclass(frozen=True)
class Step:
    source: int  # the rank whose keys visit at this step
    calls: tuple[Call, ...]


class _CallBuilder:
    """Collects the entries of one call; each local query row appears at most once per call."""

    def __init__(self, window: tuple[int, int]) -> None:
        self.window = window
        self.q_rows: list[tuple[int, int]] = []
        self.k_rows: list[list[tuple[int, int]]] = []
        self.used: dict[tuple[int, int], int] = {}  # (sequence, piece start) -> entry index

    def add(self, piece: tuple[int, int], q: tuple[int, int], k: tuple[int, int]) -> bool:
        e = self.used.get(piece)
        if e is None:
            self.used[piece] = len(self.q_rows)
            self.q_rows.append(q)
            self.k_rows.append([k])
            return True
        if self.window == (-1, -1) and self.q_rows[e] == q:
            self.k_rows[e].append(k)  # unmasked: keys of several pieces are one set
            return True
        return False

    def build(self) -> Call:
        return Call(self.window, tuple(self.q_rows), tuple(tuple(r) for r in self.k_rows))


def step_calls(plan: ShardPlan, rank: int, source: int, left: int, right: int) -> tuple[Call, ...]:
    """The calls of rank ``rank``'s queries against the keys of rank ``source``."""
    lens_q = [b - a for a, b in pairwise(plan.global_cu_seqlens_q)]
    lens_k = [b - a for a, b in pairwise(plan.global_cu_seqlens_k)]
    keys = plan.shards_k[source].by_sequence()
    builders: dict[tuple[int, int], list[_CallBuilder]] = {}
    for qp in plan.shards_q[rank].pieces:
        for kp in keys.get(qp.seq, ()):
            blk = pair_block(qp, kp, lens_q[qp.seq], lens_k[qp.seq], left, right)
            if blk is None:
                continue
            q = (qp.local + blk.q - qp.start, qp.local + blk.q - qp.start + blk.m)
            k = (kp.local + blk.k - kp.start, kp.local + blk.k - kp.start + blk.n)
            slots = builders.setdefault(blk.window, [])
            if not any(b.add((qp.seq, qp.start), q, k) for b in slots):
                slots.append(_CallBuilder(blk.window))
                slots[-1].add((qp.seq, qp.start), q, k)
    return tuple(b.build() for slots in builders.values() for b in slots)


def ring_schedule(plan: ShardPlan, left: int, right: int, rank: int | None = None) -> tuple[Step, ...]:
    """Every step of a rank's ring (default: the plan's rank); step ``s`` meets the keys of ``(rank - s) % W``.

    Cached on the plan, so repeated calls with the same plan and mask (every layer of a model) plan once.
    """
    r = plan.rank if rank is None else rank
    w = plan.world_size
    return plan.cached(
        ("ring", r, left, right),
        lambda: tuple(Step((r - s) % w, step_calls(plan, r, (r - s) % w, left, right)) for s in range(w)),
    )


def windows(plan: ShardPlan, left: int, right: int) -> set[tuple[int, int]]:
    """Every window that any rank's calls use (so that a backend's support is checked the same everywhere)."""
    return plan.cached(
        ("windows", left, right),
        lambda: {
            c.window for r in range(plan.world_size) for st in ring_schedule(plan, left, right, r) for c in st.calls
        },
    )
