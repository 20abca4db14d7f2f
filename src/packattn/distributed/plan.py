"""Which tokens of a global packed batch live on which rank: :class:`ShardPlan`."""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, NamedTuple, TypeVar

import torch

from ..errors import InputTypeError

Balance = Literal["zigzag", "contiguous"]
BALANCES = ("zigzag", "contiguous")
T = TypeVar("T")


def offsets_on(
    cu_q: Sequence[int], cu_k: Sequence[int], device: torch.device | str | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Host offsets as the int32 ``(cu_seqlens_q, cu_seqlens_k)`` tensors ``varlen_attention`` takes."""
    return torch.tensor(cu_q, dtype=torch.int32, device=device), torch.tensor(cu_k, dtype=torch.int32, device=device)


class Piece(NamedTuple):
    """A run of consecutive positions of one sequence that one rank holds."""

    seq: int  # index of the sequence in the batch
    start: int  # first position inside the sequence
    length: int
    local: int  # first row in the rank's local tensor
    row: int  # first row in the global packed tensor


@dataclass(frozen=True)
class Shard:
    """One rank's rows of one side (queries or keys), in local order."""

    pieces: tuple[Piece, ...]
    cu_seqlens: tuple[int, ...]  # local offsets, one entry per sequence plus one

    @property
    def total(self) -> int:
        return self.cu_seqlens[-1]

    def by_sequence(self) -> dict[int, list[Piece]]:
        out: dict[int, list[Piece]] = {}
        for p in self.pieces:
            out.setdefault(p.seq, []).append(p)
        return out

    def global_rows(self) -> torch.Tensor:
        """int64 index of this shard's rows in the global tensor, in local order."""
        return ranges_index([p.row for p in self.pieces], [p.length for p in self.pieces])


def ranges_index(starts: Sequence[int], lengths: Sequence[int], device: torch.device | None = None) -> torch.Tensor:
    """``cat([arange(s, s + n) for s, n in zip(starts, lengths)])`` without a Python loop over rows."""
    n = torch.tensor(list(lengths), dtype=torch.int64)
    s = torch.tensor(list(starts), dtype=torch.int64)
    total = int(n.sum()) if n.numel() else 0
    first = torch.cumsum(n, 0) - n
    idx = torch.repeat_interleave(s - first, n) + torch.arange(total, dtype=torch.int64)
    return idx if device is None else idx.to(device)


def chunk_bounds(length: int, parts: int, index: int) -> tuple[int, int]:
    """``[start, end)`` of chunk ``index`` when ``length`` positions are cut into ``parts`` near-equal chunks.

    The first ``length % parts`` chunks are one longer; chunks past the end are empty.
    """
    base, extra = divmod(length, parts)
    start = index * base + min(index, extra)
    return start, start + base + (1 if index < extra else 0)


def _chunks_of(rank: int, world_size: int, balance: str) -> tuple[int, ...]:
    if balance == "contiguous":
        return (rank,)
    return (rank, 2 * world_size - 1 - rank)


Span = tuple[int, int, int]  # (sequence, first position, length)


def _cut(spans: list[Span], parts: int, index: int, balance: str) -> list[Span]:
    """Part ``index`` of ``parts`` of every span, by the balance's chunks (two per part under zigzag)."""
    chunks = parts if balance == "contiguous" else 2 * parts
    out: list[Span] = []
    for seq, first, length in spans:
        for c in _chunks_of(index, parts, balance):
            s, e = chunk_bounds(length, chunks, c)
            if e == s:
                continue
            if out and out[-1][0] == seq and out[-1][1] + out[-1][2] == first + s:
                # Chunks W-1 and W of the zigzag split are adjacent: keep them as one run.
                out[-1] = (seq, out[-1][1], out[-1][2] + e - s)
            else:
                out.append((seq, first + s, e - s))
    return out


def _shard(cu: tuple[int, ...], world_size: int, rank: int, balance: str, ulysses_degree: int) -> Shard:
    """Rank ``rank`` = ``ring_rank * ulysses_degree + member``: part ``member`` of ring part ``ring_rank``."""
    ring_rank, member = divmod(rank, ulysses_degree)
    spans = [(b, 0, cu[b + 1] - cu[b]) for b in range(len(cu) - 1)]
    spans = _cut(_cut(spans, world_size // ulysses_degree, ring_rank, balance), ulysses_degree, member, balance)
    pieces: list[Piece] = []
    counts = [0] * (len(cu) - 1)
    held = 0
    for seq, first, length in spans:
        pieces.append(Piece(seq, first, length, held, cu[seq] + first))
        counts[seq] += length
        held += length
    local = [0]
    for n in counts:
        local.append(local[-1] + n)
    return Shard(tuple(pieces), tuple(local))


def _check_offsets(cu: object, name: str) -> tuple[int, ...]:
    where = "ShardPlan.build"
    if isinstance(cu, torch.Tensor):
        raise InputTypeError(f"{where}: {name} must be a list/tuple of Python ints, got a torch.Tensor; pass .tolist()")
    if not isinstance(cu, Sequence) or isinstance(cu, (str, bytes)):
        raise InputTypeError(f"{where}: {name} must be a list/tuple of Python ints, got {type(cu).__name__}")
    values = tuple(cu)
    if not all(isinstance(x, int) and not isinstance(x, bool) for x in values):
        raise InputTypeError(f"{where}: {name} must hold only Python ints, got {values!r}")
    if len(values) < 2:
        raise ValueError(f"{where}: {name} must have at least 2 entries (B + 1 with B >= 1), got {len(values)}")
    if values[0] != 0:
        raise ValueError(f"{where}: {name} must start at 0, got {values[0]}")
    for b in range(len(values) - 1):
        if values[b + 1] < values[b]:
            raise ValueError(
                f"{where}: {name} must be non-decreasing, got {values[b]} then {values[b + 1]} "
                f"at positions {b} and {b + 1}"
            )
    return values


@dataclass(frozen=True)
class ShardPlan:
    """Which rows of a global packed batch one rank holds, for sequence-parallel attention.

    Every sequence of the batch is cut along its length, queries and keys separately, and each rank holds
    some chunks of it:

    * ``balance="contiguous"``: ``world_size`` chunks in rank order; rank ``r`` holds chunk ``r``.
    * ``balance="zigzag"``: ``2 * world_size`` chunks; rank ``r`` holds chunks ``r`` and ``2W - 1 - r``,
      so that under a causal mask every rank gets about the same work. For a sequence of 8 tokens on
      2 ranks::

          position   0 1 2 3 4 5 6 7
          chunk      0 0 1 1 2 2 3 3
          rank       0 0 1 1 1 1 0 0

    Chunks differ in length by at most one token (the first ones are longer). A sequence shorter than
    the number of chunks leaves some ranks without queries or keys of it; that is fine. A rank's local
    tensor holds its rows sequence by sequence, each sequence's chunks in order of position, and
    :attr:`cu_seqlens_q_host` / :attr:`cu_seqlens_k_host` describe that local batch. Mask semantics stay
    those of the global batch: positions are global positions inside each sequence.

    On a 2-D mesh (:func:`usp_varlen_attention`, ``ulysses_degree = U > 1``), the batch is first cut as
    above into ``R = world_size / U`` ring parts, and each ring part's runs are cut the same way again into
    ``U`` parts: rank ``r * U + u`` holds part ``u`` of ring part ``r``. With ``U = 1`` that is the plan
    above; with ``U = world_size`` (one ring part: the whole batch) it is again the plan above.

    Example (sequences of 8 and 3 tokens on 2 ranks; rank 0's rows):
        >>> plan = ShardPlan.build([0, 8, 11], [0, 8, 11], world_size=2, rank=0)
        >>> plan.shard_q(torch.arange(11)).tolist(), plan.cu_seqlens_q_host
        ([0, 1, 6, 7, 8], (0, 4, 5))
        >>> plan = ShardPlan.build([0, 8, 11], [0, 8, 11], world_size=2, rank=0, balance="contiguous")
        >>> plan.shard_q(torch.arange(11)).tolist(), plan.cu_seqlens_q_host
        ([0, 1, 2, 3, 8, 9], (0, 4, 6))
    """

    world_size: int
    rank: int
    balance: Balance
    global_cu_seqlens_q: tuple[int, ...]
    global_cu_seqlens_k: tuple[int, ...]
    shards_q: tuple[Shard, ...] = field(repr=False)  # one per rank
    shards_k: tuple[Shard, ...] = field(repr=False)
    ulysses_degree: int = 1
    cache: dict[Any, Any] = field(default_factory=dict, init=False, repr=False, compare=False, hash=False)

    @staticmethod
    def build(
        cu_seqlens_q_host: Sequence[int],
        cu_seqlens_k_host: Sequence[int],
        *,
        world_size: int,
        rank: int,
        balance: Balance = "zigzag",
        ulysses_degree: int = 1,
    ) -> ShardPlan:
        """Plan the rows of rank ``rank`` out of ``world_size`` for the global batch ``cu_seqlens_*_host``.

        The offsets are Python ints (the global batch's ``cu_seqlens``), so planning never touches a device.
        Every rank builds the same plan with its own ``rank``; ``rank`` is the rank inside the process
        group that the attention call will use. For :func:`usp_varlen_attention` on a mesh of
        ``ulysses_degree`` x ``world_size / ulysses_degree`` ranks, ``rank`` is
        ``ring_rank * ulysses_degree + ulysses_rank`` (the ranks inside the ring and the Ulysses group).
        """
        where = "ShardPlan.build"
        cu_q = _check_offsets(cu_seqlens_q_host, "cu_seqlens_q_host")
        cu_k = _check_offsets(cu_seqlens_k_host, "cu_seqlens_k_host")
        if len(cu_q) != len(cu_k):
            raise ValueError(
                f"{where}: cu_seqlens_q_host and cu_seqlens_k_host must describe the same number of sequences, "
                f"got {len(cu_q) - 1} and {len(cu_k) - 1}"
            )
        for name, value in (("world_size", world_size), ("rank", rank), ("ulysses_degree", ulysses_degree)):
            if isinstance(value, bool) or not isinstance(value, int):
                raise InputTypeError(f"{where}: {name} must be an int, got {type(value).__name__}")
        if world_size < 1:
            raise ValueError(f"{where}: world_size must be >= 1, got {world_size}")
        if not 0 <= rank < world_size:
            raise ValueError(f"{where}: rank must be in [0, world_size) = [0, {world_size}), got {rank}")
        if balance not in BALANCES:
            raise ValueError(f"{where}: balance must be one of {BALANCES}, got {balance!r}")
        if ulysses_degree < 1 or world_size % ulysses_degree != 0:
            raise ValueError(
                f"{where}: ulysses_degree must be >= 1 and divide world_size ({world_size}), got {ulysses_degree}"
            )
        shards_q = tuple(_shard(cu_q, world_size, r, balance, ulysses_degree) for r in range(world_size))
        shards_k = tuple(_shard(cu_k, world_size, r, balance, ulysses_degree) for r in range(world_size))
        return ShardPlan(world_size, rank, balance, cu_q, cu_k, shards_q, shards_k, ulysses_degree)

    @property
    def ring_degree(self) -> int:
        """Number of ring parts (``world_size / ulysses_degree``)."""
        return self.world_size // self.ulysses_degree

    def ring_level(self) -> ShardPlan:
        """The plan of the ring across Ulysses groups: rank ``rank // ulysses_degree`` of ``ring_degree``,
        whose local rows are the rows of this rank's whole Ulysses group (cached)."""
        return self.cached(
            "ring_level",
            lambda: ShardPlan.build(
                self.global_cu_seqlens_q,
                self.global_cu_seqlens_k,
                world_size=self.ring_degree,
                rank=self.rank // self.ulysses_degree,
                balance=self.balance,
            ),
        )

    @property
    def batch(self) -> int:
        return len(self.global_cu_seqlens_q) - 1

    @property
    def cu_seqlens_q_host(self) -> tuple[int, ...]:
        """This rank's local query offsets (B + 1 Python ints)."""
        return self.shards_q[self.rank].cu_seqlens

    @property
    def cu_seqlens_k_host(self) -> tuple[int, ...]:
        """This rank's local key offsets (B + 1 Python ints)."""
        return self.shards_k[self.rank].cu_seqlens

    @property
    def local_q(self) -> int:
        """Number of query rows this rank holds."""
        return self.shards_q[self.rank].total

    @property
    def local_k(self) -> int:
        """Number of key/value rows this rank holds."""
        return self.shards_k[self.rank].total

    def local_cu_seqlens(self, device: torch.device | str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """``(cu_seqlens_q, cu_seqlens_k)`` of the local batch as int32 tensors on ``device``.

        Cached per device (the same tensors on every call; do not modify them). These are *local* offsets:
        they count this rank's rows, not the sequences' global positions, so do not pass them to
        :func:`packattn.varlen_attention` on the local shards as if they were a batch of their own. With
        ``causal=True`` or a ``window_size`` the mask would be aligned to the local pieces instead of the
        global positions (wrong rows masked), and even without a mask each query would see only this
        rank's keys. For attention use :func:`ring_varlen_attention` or :func:`ulysses_varlen_attention`
        with the plan; use these offsets for per-token or per-sequence work on the local rows only.

        Example (rank 0 of 2 holds 4 + 1 rows of sequences of 8 and 3 tokens):
            >>> plan = ShardPlan.build([0, 8, 11], [0, 8, 11], world_size=2, rank=0)
            >>> [t.tolist() for t in plan.local_cu_seqlens()]
            [[0, 4, 5], [0, 4, 5]]
        """
        return self.cached(
            ("local_cu_seqlens", str(device)),
            lambda: offsets_on(self.cu_seqlens_q_host, self.cu_seqlens_k_host, device),
        )

    def positions(self, side: str = "q") -> torch.Tensor:
        """int64 position inside its sequence of each local row of ``side`` (``"q"`` or ``"k"``), e.g. to
        pick the local rows' positional embeddings. Cached on CPU (do not modify it).

        Example:
            >>> ShardPlan.build([0, 8, 11], [0, 8, 11], world_size=2, rank=0).positions().tolist()
            [0, 1, 6, 7, 0]
        """
        pieces = self.shards(side)[self.rank].pieces
        return self.cached(
            ("positions", side), lambda: ranges_index([p.start for p in pieces], [p.length for p in pieces])
        )

    def cached(self, key: Hashable, make: Callable[[], T]) -> T:
        """``make()``, computed on first use and then kept in :attr:`cache` under ``key``.

        Everything derived from the plan lives there (ring schedules, index tensors under a key that names
        their device, rank-agreement checks), so repeated calls with one plan, e.g. every layer of a model,
        pay for it once: no host-to-device copy after the first call.
        """
        if key not in self.cache:
            self.cache[key] = make()
        return self.cache[key]

    def shard_q(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's rows of a global ``(Tq, ...)`` tensor (differentiable)."""
        return self._select(x, "q")

    def shard_k(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's rows of a global ``(Tk, ...)`` tensor (differentiable)."""
        return self._select(x, "k")

    def unshard_q(self, x_local: torch.Tensor, *, group: Any = None) -> torch.Tensor:
        """All-gather every rank's ``(local_q, ...)`` rows into the global ``(Tq, ...)`` order.

        Collective: every rank of ``group`` must call it, with the same trailing shape and dtype (checked
        on the first call). Differentiable, and the backward is collective too: every rank must backpropagate
        through it, since each rank's gradient is an all-reduce (sum over ranks) of the full global
        ``(Tq, ...)`` gradient, of which it keeps its own rows. That all-reduce moves the whole global
        tensor, not one shard.
        """
        from .comm import unshard

        return unshard(self, x_local, "q", group, "ShardPlan.unshard_q")

    def unshard_k(self, x_local: torch.Tensor, *, group: Any = None) -> torch.Tensor:
        """Like :meth:`unshard_q`, for key-side ``(local_k, ...)`` rows."""
        from .comm import unshard

        return unshard(self, x_local, "k", group, "ShardPlan.unshard_k")

    def shards(self, side: str) -> tuple[Shard, ...]:
        return self.shards_q if side == "q" else self.shards_k

    def _select(self, x: torch.Tensor, side: str) -> torch.Tensor:
        where = f"ShardPlan.shard_{side}"
        total = (self.global_cu_seqlens_q if side == "q" else self.global_cu_seqlens_k)[-1]
        if not isinstance(x, torch.Tensor):
            raise InputTypeError(f"{where}: x must be a torch.Tensor, got {type(x).__name__}")
        if x.dim() == 0 or x.shape[0] != total:
            raise ValueError(
                f"{where}: x must be the global tensor with {total} rows (the plan's cu_seqlens end there), "
                f"got shape {tuple(x.shape)}"
            )
        rows = self.cached(
            ("rows", side, str(x.device)), lambda: self.shards(side)[self.rank].global_rows().to(x.device)
        )
        return x.index_select(0, rows)
