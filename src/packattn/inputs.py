"""One validated attention call: tensors, layout and mask options, checked once at the boundary."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from .errors import InputTypeError
from .layout import SeqLayout

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)


@dataclass(frozen=True)
class MaskSpec:
    """Scores are ``softcap * tanh(scale * q.k / softcap)`` (softcap > 0), then masked.

    Query ``i`` of a sequence with ``Lq`` queries and ``Lk`` keys sees key ``j`` iff
    ``i + Lk - Lq - left <= j <= i + Lk - Lq + right`` (a bound of -1 is unbounded). Causal is ``right=0``.

    This class is the one place in Python that answers geometry questions about the mask (which keys a
    block of rows sees, which rows a block of keys reaches, how many pairs are visible); the float64 oracle
    in :mod:`packattn.testing` builds its masks independently, so that it checks these answers. Every method
    takes an optional ``offset``, the diagonal ``j - i`` that a row and key of the same "position" have
    (``Lk - Lq`` for a whole sequence): a sub-box of a sequence (ring attention's pieces) passes its own.
    """

    scale: float
    left: int = -1
    right: int = -1
    softcap: float = 0.0

    @property
    def causal(self) -> bool:
        return self.right == 0

    @property
    def masked(self) -> bool:
        return self.left >= 0 or self.right >= 0

    def band(self, lq: int, lk: int, offset: int | None = None) -> tuple[int | None, int | None]:
        """The visible pairs as a band ``lo <= j - i <= hi`` (``None``: unbounded on that side)."""
        off = lk - lq if offset is None else offset
        return (None if self.left < 0 else off - self.left), (None if self.right < 0 else off + self.right)

    def key_range(self, i0: int, i1: int, lq: int, lk: int, offset: int | None = None) -> tuple[int, int]:
        """Keys ``[lo, hi)`` that any of the query rows ``[i0, i1)`` may see (clamped to ``[0, lk)``)."""
        lo_d, hi_d = self.band(lq, lk, offset)
        lo = 0 if lo_d is None else min(lk, max(0, i0 + lo_d))
        hi = lk if hi_d is None else min(lk, i1 + hi_d)
        return lo, max(lo, hi)

    def query_range(self, j0: int, j1: int, lq: int, lk: int, offset: int | None = None) -> tuple[int, int]:
        """Query rows ``[lo, hi)`` that may see any of the keys ``[j0, j1)`` (the mirror of :meth:`key_range`)."""
        if j1 <= j0:
            return 0, 0
        lo_d, hi_d = self.band(lq, lk, offset)
        lo = 0 if hi_d is None else min(lq, max(0, j0 - hi_d))
        hi = lq if lo_d is None else min(lq, j1 - lo_d)
        return lo, max(lo, hi)

    def visible_rows(self, lq: int, lk: int, offset: int | None = None) -> tuple[int, int]:
        """Query rows ``[lo, hi)`` that see at least one key; ``(Lq, Lq)`` when none does (e.g. no keys). For a
        whole sequence ``hi == Lq``: a bottom-right mask hides only leading rows."""
        lo, hi = self.query_range(0, lk, lq, lk, offset)
        return (lo, hi) if lo < hi else (lq, lq)

    def fully_visible(self, i0: int, i1: int, j0: int, j1: int, lq: int, lk: int) -> bool:
        """Whether every query row in ``[i0, i1)`` sees every key in ``[j0, j1)``."""
        lo_d, hi_d = self.band(lq, lk)
        return (lo_d is None or j0 >= i1 - 1 + lo_d) and (hi_d is None or j1 - 1 <= i0 + hi_d)

    def visible(self, rows: torch.Tensor, cols: torch.Tensor, lq: int, lk: int) -> torch.Tensor:
        """Boolean ``(len(rows), len(cols))`` mask of visible pairs (index tensors are sequence-local)."""
        lo_d, hi_d = self.band(lq, lk)
        diff = cols[None, :] - rows[:, None]
        ok = torch.ones_like(diff, dtype=torch.bool)
        if lo_d is not None:
            ok &= diff >= lo_d
        if hi_d is not None:
            ok &= diff <= hi_d
        return ok

    def visible_pairs(self, lq: int, lk: int) -> int:
        """How many (query, key) pairs of a sequence are visible."""
        return sum(hi - lo for lo, hi in (self.key_range(i, i + 1, lq, lk) for i in range(lq)))

    def window_of_box(self, m: int, n: int, offset: int) -> tuple[int, int]:
        """The ``(left, right)`` under which a sequence of ``m`` queries and ``n`` keys has exactly this mask's
        visible pairs for a box of ``m`` rows and ``n`` keys at diagonal ``offset`` (bounds that hide nothing
        in the box become -1)."""
        lo_d, hi_d = self.band(m, n, offset)
        base = n - m  # the box's own diagonal offset
        left = -1 if lo_d is None or base - lo_d >= n - 1 else base - lo_d
        right = -1 if hi_d is None or hi_d - base >= m - 1 else hi_d - base
        return left, right


@dataclass(frozen=True)
class AttentionInputs:
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    layout: SeqLayout
    mask: MaskSpec
    return_lse: bool = False  # the LSE is read (by the caller or a backward); if not, a backend may return None
    grad: bool = False  # gradients of q, k, v will be asked for (dispatch then needs a backward route)
    deterministic: bool = False  # those gradients must be the same bits run to run

    @property
    def heads_q(self) -> int:
        return self.q.shape[1]

    @property
    def heads_kv(self) -> int:
        return self.k.shape[1]

    @property
    def head_dim(self) -> int:
        return self.q.shape[2]

    @property
    def head_dim_v(self) -> int:
        return self.v.shape[2]


def needs_grad(*tensors: torch.Tensor) -> bool:
    """Whether autograd will ask for gradients of ``tensors`` (grad mode on and any of them requires grad)."""
    return torch.is_grad_enabled() and any(t.requires_grad for t in tensors)


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """Accumulation dtype: float64 for float64 inputs, float32 for everything else."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def check_tensors(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, where: str, names: tuple[str, str, str] = ("q", "k", "v")
) -> None:
    nq, nk, nv = names
    for name, t in ((nq, q), (nk, k), (nv, v)):
        if not isinstance(t, torch.Tensor):
            raise InputTypeError(f"{where}: {name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 3:
            raise ValueError(f"{where}: {name} must be 3-D (tokens, heads, head_dim), got shape {tuple(t.shape)}")
        if t.shape[2] == 0:
            raise ValueError(f"{where}: {name} must have head_dim > 0, got shape {tuple(t.shape)}")
        if t.shape[1] == 0:
            raise ValueError(f"{where}: {name} must have at least one head, got shape {tuple(t.shape)}")
    if q.dtype not in FLOAT_DTYPES:
        raise InputTypeError(f"{where}: {nq} must be float32, float16, bfloat16 or float64, got {q.dtype}")
    for name, t in ((nk, k), (nv, v)):
        if t.dtype != q.dtype:
            raise InputTypeError(f"{where}: {name} must have the same dtype as {nq} ({q.dtype}), got {t.dtype}")
        if t.device != q.device:
            raise ValueError(f"{where}: {name} must be on the same device as {nq} ({q.device}), got {t.device}")
    if k.shape[0] != v.shape[0]:
        raise ValueError(
            f"{where}: {nk} and {nv} must have the same number of tokens, got {k.shape[0]} and {v.shape[0]}"
        )
    if k.shape[1] != v.shape[1]:
        raise ValueError(
            f"{where}: {nk} and {nv} must have the same number of heads, got {k.shape[1]} and {v.shape[1]}"
        )
    if q.shape[2] != k.shape[2]:
        raise ValueError(
            f"{where}: {nq} and {nk} must have the same head_dim because scores are {nq} @ {nk}^T, got "
            f"{q.shape[2]} and {k.shape[2]} ({nv}'s head_dim may differ from theirs)"
        )
    if k.shape[1] == 0 or q.shape[1] % k.shape[1] != 0:
        raise ValueError(
            f"{where}: the number of query heads ({nq}.shape[1] = {q.shape[1]}) must be a multiple of the number "
            f"of key/value heads ({nk}.shape[1] = {k.shape[1]}) for MHA/GQA/MQA"
        )


# Window bounds at or above this are unbounded (-1): 2**60 tokens is beyond any machine's memory.
UNBOUNDED_WINDOW = 2**60
_FP32_MIN = 2.0**-149  # the smallest float32 above 0 (subnormal): anything below rounds to 0
_FP32_MAX = float(torch.finfo(torch.float32).max)


def _check_representable(value: float, name: str, dtype: torch.dtype, where: str) -> None:
    """Kernels compute in float32 (float64 for float64 inputs): a positive value that rounds to 0 or inf there
    would silently disable soft-capping or break every score."""
    if dtype == torch.float64 or value == 0:
        return
    if not _FP32_MIN <= value <= _FP32_MAX:
        raise ValueError(
            f"{where}: {name} must be representable in float32, the compute dtype of {dtype} inputs "
            f"(between {_FP32_MIN:.3g} and {_FP32_MAX:.4g}), got {value}"
        )


def check_mask(
    q: torch.Tensor,
    *,
    softmax_scale: float | None,
    causal: bool,
    window_size: Sequence[int],
    softcap: float,
    where: str,
) -> MaskSpec:
    if not isinstance(causal, bool):
        raise InputTypeError(f"{where}: causal must be a bool, got {type(causal).__name__}")
    if not isinstance(window_size, (tuple, list)) or not all(
        isinstance(w, int) and not isinstance(w, bool) for w in window_size
    ):
        raise InputTypeError(f"{where}: window_size must be a pair of ints (left, right), got {window_size!r}")
    if len(window_size) != 2:
        raise ValueError(
            f"{where}: window_size must be a pair (left, right), got {len(window_size)} entries: {window_size!r}"
        )
    left, right = window_size
    if left < -1 or right < -1:
        raise ValueError(f"{where}: window_size entries must be >= 0, or -1 for unbounded, got {tuple(window_size)}")
    # No sequence is UNBOUNDED_WINDOW tokens long, so such a bound hides nothing; as -1, no kernel does
    # arithmetic with it near the int64 limit (or fails to take it as an int64).
    left, right = (-1 if w >= UNBOUNDED_WINDOW else w for w in (left, right))
    if causal:
        if right > 0:
            raise ValueError(
                f"{where}: causal=True means window_size right = 0, got window_size={tuple(window_size)}; "
                "pass causal=False to look right of the diagonal"
            )
        right = 0
    if isinstance(softcap, bool) or not isinstance(softcap, (int, float)):
        raise InputTypeError(f"{where}: softcap must be a float, got {type(softcap).__name__}")
    softcap = float(softcap)
    # Comparisons rather than math.isfinite, which torch.compile cannot trace on a symbolic float; NaN fails both.
    if not 0 <= softcap < math.inf:
        raise ValueError(f"{where}: softcap must be a finite float >= 0 (0 disables it), got {softcap}")
    _check_representable(softcap, "softcap", q.dtype, where)
    if softmax_scale is None:
        scale = q.shape[2] ** -0.5
    else:
        if isinstance(softmax_scale, bool) or not isinstance(softmax_scale, (int, float)):
            raise InputTypeError(f"{where}: softmax_scale must be a float or None, got {type(softmax_scale).__name__}")
        scale = float(softmax_scale)
        if not 0 < scale < math.inf:
            raise ValueError(f"{where}: softmax_scale must be finite and > 0, got {softmax_scale}")
        _check_representable(scale, "softmax_scale", q.dtype, where)
    return MaskSpec(scale=scale, left=left, right=right, softcap=softcap)
