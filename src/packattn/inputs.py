"""One validated attention call: tensors, layout and mask options, checked once at the boundary."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from .layout import SeqLayout

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)


@dataclass(frozen=True)
class MaskSpec:
    """Scores are ``softcap * tanh(scale * q.k / softcap)`` (softcap > 0), then masked.

    Query ``i`` of a sequence with ``Lq`` queries and ``Lk`` keys sees key ``j`` iff
    ``i + Lk - Lq - left <= j <= i + Lk - Lq + right`` (a bound of -1 is unbounded). Causal is ``right=0``.
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

    def key_range(self, i0: int, i1: int, lq: int, lk: int) -> tuple[int, int]:
        """Keys ``[lo, hi)`` that any of the query rows ``[i0, i1)`` may see (clamped to ``[0, lk)``)."""
        off = lk - lq
        lo = 0 if self.left < 0 else max(0, i0 + off - self.left)
        hi = lk if self.right < 0 else min(lk, i1 - 1 + off + self.right + 1)
        return lo, max(lo, hi)

    def query_range(self, j0: int, j1: int, lq: int, lk: int) -> tuple[int, int]:
        """Query rows ``[lo, hi)`` that may see any of the keys ``[j0, j1)`` (the mirror of :meth:`key_range`)."""
        off = lk - lq
        lo = 0 if self.right < 0 else max(0, j0 - off - self.right)
        hi = lq if self.left < 0 else min(lq, j1 - 1 - off + self.left + 1)
        return lo, max(lo, hi)

    def fully_visible(self, i0: int, i1: int, j0: int, j1: int, lq: int, lk: int) -> bool:
        """Whether every query row in ``[i0, i1)`` sees every key in ``[j0, j1)``."""
        off = lk - lq
        ok_left = self.left < 0 or j0 >= i1 - 1 + off - self.left
        ok_right = self.right < 0 or j1 - 1 <= i0 + off + self.right
        return ok_left and ok_right

    def visible(self, rows: torch.Tensor, cols: torch.Tensor, lq: int, lk: int) -> torch.Tensor:
        """Boolean ``(len(rows), len(cols))`` mask of visible pairs (index tensors are sequence-local)."""
        diff = cols[None, :] - rows[:, None] - (lk - lq)
        ok = torch.ones_like(diff, dtype=torch.bool)
        if self.left >= 0:
            ok &= diff >= -self.left
        if self.right >= 0:
            ok &= diff <= self.right
        return ok


@dataclass(frozen=True)
class AttentionInputs:
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    layout: SeqLayout
    mask: MaskSpec
    return_lse: bool = False  # the LSE is read (by the caller or a backward); if not, a backend may return None

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

    @property
    def requires_grad(self) -> bool:
        return torch.is_grad_enabled() and any(t.requires_grad for t in (self.q, self.k, self.v))


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """Accumulation dtype: float64 for float64 inputs, float32 for everything else."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def check_tensors(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, where: str) -> None:
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{where}: {name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 3:
            raise ValueError(f"{where}: {name} must be 3-D (tokens, heads, head_dim), got shape {tuple(t.shape)}")
        if t.shape[2] == 0:
            raise ValueError(f"{where}: {name} must have head_dim > 0, got shape {tuple(t.shape)}")
    if q.dtype not in FLOAT_DTYPES:
        raise TypeError(f"{where}: q must be float32, float16, bfloat16 or float64, got {q.dtype}")
    for name, t in (("k", k), ("v", v)):
        if t.dtype != q.dtype:
            raise TypeError(f"{where}: {name} must have the same dtype as q ({q.dtype}), got {t.dtype}")
        if t.device != q.device:
            raise ValueError(f"{where}: {name} must be on the same device as q ({q.device}), got {t.device}")
    if k.shape[0] != v.shape[0]:
        raise ValueError(f"{where}: k and v must have the same number of tokens, got {k.shape[0]} and {v.shape[0]}")
    if k.shape[1] != v.shape[1]:
        raise ValueError(f"{where}: k and v must have the same number of heads, got {k.shape[1]} and {v.shape[1]}")
    if q.shape[2] != k.shape[2]:
        raise ValueError(
            f"{where}: q and k must have the same head_dim because scores are q @ k^T, got {q.shape[2]} "
            f"and {k.shape[2]} (v's head_dim may differ from theirs)"
        )
    if k.shape[1] == 0 or q.shape[1] % k.shape[1] != 0:
        raise ValueError(
            f"{where}: the number of query heads (q.shape[1] = {q.shape[1]}) must be a multiple of the number "
            f"of key/value heads (k.shape[1] = {k.shape[1]}) for MHA/GQA/MQA"
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
        raise TypeError(f"{where}: causal must be a bool, got {type(causal).__name__}")
    if not isinstance(window_size, (tuple, list)) or not all(
        isinstance(w, int) and not isinstance(w, bool) for w in window_size
    ):
        raise TypeError(f"{where}: window_size must be a pair of ints (left, right), got {window_size!r}")
    if len(window_size) != 2:
        raise ValueError(
            f"{where}: window_size must be a pair (left, right), got {len(window_size)} entries: {window_size!r}"
        )
    left, right = window_size
    if left < -1 or right < -1:
        raise ValueError(f"{where}: window_size entries must be >= 0, or -1 for unbounded, got {tuple(window_size)}")
    if causal:
        if right > 0:
            raise ValueError(
                f"{where}: causal=True means window_size right = 0, got window_size={tuple(window_size)}; "
                "pass causal=False to look right of the diagonal"
            )
        right = 0
    if isinstance(softcap, bool) or not isinstance(softcap, (int, float)):
        raise TypeError(f"{where}: softcap must be a float, got {type(softcap).__name__}")
    softcap = float(softcap)
    # Comparisons rather than math.isfinite, which torch.compile cannot trace on a symbolic float; NaN fails both.
    if not 0 <= softcap < math.inf:
        raise ValueError(f"{where}: softcap must be a finite float >= 0 (0 disables it), got {softcap}")
    if softmax_scale is None:
        scale = q.shape[2] ** -0.5
    else:
        if isinstance(softmax_scale, bool) or not isinstance(softmax_scale, (int, float)):
            raise TypeError(f"{where}: softmax_scale must be a float or None, got {type(softmax_scale).__name__}")
        scale = float(softmax_scale)
        if not 0 < scale < math.inf:
            raise ValueError(f"{where}: softmax_scale must be finite and > 0, got {softmax_scale}")
    return MaskSpec(scale=scale, left=left, right=right, softcap=softcap)
