"""flash-attn 2's ``flash_attn_varlen_func``, on any device, backed by :func:`packattn.varlen_attention`.

Same signature, defaults, masking conventions (bottom-right causal, inclusive ``(left, right)`` windows,
soft-capping) and return conventions. Where packattn differs, it says so instead of guessing:

* ``dropout_p > 0``, ``alibi_slopes`` and ``block_table`` (paged KV) raise ``NotImplementedError``: packattn
  computes exact attention over contiguous packed K/V, and ignoring them would change results silently.
* ``max_seqlen_q``/``max_seqlen_k`` smaller than a real sequence length raise ``ValueError`` (flash-attn
  sizes its grid with them and silently leaves the rows past them uncomputed). Checking them reads the
  offsets once (a device sync for offsets on an accelerator; flash-attn's signature has no host copies).
* Windows are read as flash-attn 2 reads them: ``causal=True`` sets the right bound to 0 and keeps the
  left one (``causal=True, window_size=(4, 7)`` is ``(4, 0)``), and a bound ``>= max_seqlen_k`` is
  unbounded (-1), as is any negative bound; ``window_size`` may be a tuple, a list or a 2-element integer
  tensor. (packattn's own ``varlen_attention`` refuses ``causal=True`` with a right bound > 0 and bounds
  below -1 instead.)
* ``softmax_scale`` and ``softcap`` are read as flash-attn 2 reads them: real numbers, NumPy scalars
  included; a finite scale of 0 or below is used as given (0: every visible key weighs the same), a cap of
  0 or below, or NaN, is off. (``varlen_attention`` takes a scale > 0 and a cap >= 0.)
* Rows that see no key have LSE **-inf**, where flash-attn 2 returns +inf: -inf is the log of an empty sum,
  the value that merges of partial results (ring attention, split-KV) need to stay NaN-free, and what
  FlashAttention-3's kernel and FlashInfer return. Code that tests ``lse.isinf()`` works with both; code
  that compares with ``+inf`` must compare with ``-inf``.
* ``deterministic=True`` is honoured: when gradients are needed, dispatch takes only a backend whose
  gradient route is deterministic (packattn's own backwards are: no atomics).
* Any packattn dtype (flash-attn: fp16/bf16) and int32 or int64 offsets; the LSE is differentiable.
"""

from __future__ import annotations

import math
import numbers

import torch

from ..api import run_attention
from ..errors import InputTypeError
from ..inputs import check_tensors
from ..layout import SeqLayout

__all__ = ["flash_attn_varlen_func"]

WHERE = "flash_attn_varlen_func"


def _check_max(value: object, name: str, longest: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise InputTypeError(f"{WHERE}: {name} must be an int, got {type(value).__name__}; pass a Python int (.item())")
    if value < longest:
        raise ValueError(
            f"{WHERE}: {name} must be at least the longest sequence ({longest}), got {value}; flash-attn would "
            "leave the rows past it uncomputed"
        )


def _window(window_size: object, causal: bool, max_seqlen_k: int) -> tuple[object, object]:
    """flash-attn 2's reading of ``window_size``: causal forces right = 0; bounds < 0 or >= max_seqlen_k are -1."""
    if isinstance(window_size, torch.Tensor) and window_size.shape == (2,) and not window_size.is_floating_point():
        window_size = tuple(window_size.tolist())
    if not isinstance(window_size, (tuple, list)) or len(window_size) != 2:
        raise InputTypeError(
            f"{WHERE}: window_size must be a pair (left, right) of ints (a tuple, list or 2-element integer tensor), "
            f"got {window_size!r}"
        )
    left, right = window_size
    if causal:
        right = 0
    if isinstance(left, int) and isinstance(right, int) and not isinstance(left, bool) and not isinstance(right, bool):
        left, right = (-1 if w < 0 or w >= max_seqlen_k else w for w in (left, right))
    return left, right


def _scale_and_cap(q: torch.Tensor, softmax_scale: object, softcap: object) -> tuple[torch.Tensor, object, object]:
    """flash-attn 2's reading of the scale and the soft cap: any real number (a NumPy scalar too), a finite
    scale of 0 or below used as given, a cap of 0 or below (or NaN) off. packattn's own API takes a scale
    > 0: a negative scale becomes -q and -scale (the same scores, exactly), a zero scale zero scores (q * 0
    keeps NaN and inf propagating as flash-attn's product would)."""
    if isinstance(softcap, numbers.Real) and not isinstance(softcap, bool):
        softcap = float(softcap) if float(softcap) > 0 else 0.0  # NaN too: flash-attn caps only when > 0
    if not isinstance(softmax_scale, numbers.Real) or isinstance(softmax_scale, bool):
        return q, softmax_scale, softcap  # None, or a wrong type that run_attention names
    scale = float(softmax_scale)
    if not math.isfinite(scale):
        raise ValueError(f"{WHERE}: softmax_scale must be a finite number, got {scale}")
    if scale < 0:
        return -q, -scale, softcap
    if scale == 0:
        return q * 0, 1.0, softcap
    return q, scale, softcap


def _refuse(dropout_p: object, alibi_slopes: object, block_table: object) -> None:
    if isinstance(dropout_p, bool) or not isinstance(dropout_p, (int, float)):
        raise InputTypeError(f"{WHERE}: dropout_p must be a float, got {type(dropout_p).__name__}")
    if dropout_p != 0:
        raise NotImplementedError(
            f"{WHERE}: dropout_p must be 0.0, got {dropout_p}; packattn computes exact attention without dropout "
            "(pass dropout_p=0.0, e.g. `dropout if self.training else 0.0` in evaluation)"
        )
    if alibi_slopes is not None:
        raise NotImplementedError(f"{WHERE}: alibi_slopes is not supported; pass None")
    if block_table is not None:
        raise NotImplementedError(f"{WHERE}: block_table (paged KV cache) is not supported; pass packed K/V and None")


def flash_attn_varlen_func(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    dropout_p: float = 0.0,
    softmax_scale: float | None = None,
    causal: bool = False,
    window_size: tuple[int, int] | list[int] | torch.Tensor = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes: torch.Tensor | None = None,
    deterministic: bool = False,
    return_attn_probs: bool = False,
    block_table: torch.Tensor | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor, None]:
    """flash-attn 2's varlen attention (see the module docstring for the differences).

    Shapes: ``q (total_q, nheads, headdim)``, ``k (total_k, nheads_k, headdim)``, ``v (total_k, nheads_k,
    headdim_v)``, ``cu_seqlens_q/k (batch + 1,)`` int32/int64. Query ``i`` of a sequence sees key ``j`` iff
    ``i + Lk - Lq - window_size[0] <= j <= i + Lk - Lq + window_size[1]`` (``-1`` unbounded; ``causal`` is
    ``window_size[1] = 0``).

    Returns ``out (total_q, nheads, headdim_v)``, or with ``return_attn_probs=True`` ``(out, softmax_lse,
    None)``: ``softmax_lse (nheads, total_q)`` float32 (float64 for float64 inputs), ``-inf`` for rows that
    see no key; the attention probabilities are never materialised.

    Example:
        >>> import torch
        >>> from packattn.compat.flash_attn import flash_attn_varlen_func
        >>> cu = torch.tensor([0, 3, 8], dtype=torch.int32)
        >>> q, k, v = (torch.randn(8, 2, 16) for _ in range(3))
        >>> out, lse, _ = flash_attn_varlen_func(q, k, v, cu, cu, 5, 5, causal=True, return_attn_probs=True)
        >>> tuple(out.shape), tuple(lse.shape)
        ((8, 2, 16), (2, 8))
    """
    _refuse(dropout_p, alibi_slopes, block_table)
    for name, flag in (("deterministic", deterministic), ("return_attn_probs", return_attn_probs)):
        if not isinstance(flag, bool):
            raise InputTypeError(f"{WHERE}: {name} must be a bool, got {type(flag).__name__}")
    check_tensors(q, k, v, WHERE)
    layout = SeqLayout.build(cu_seqlens_q, cu_seqlens_k, q.shape[0], k.shape[0], where=WHERE)
    _check_max(max_seqlen_q, "max_seqlen_q", layout.max_q)
    _check_max(max_seqlen_k, "max_seqlen_k", layout.max_k)
    if not isinstance(causal, bool):
        raise InputTypeError(f"{WHERE}: causal must be a bool, got {type(causal).__name__}")
    left, right = _window(window_size, causal, max_seqlen_k)
    q, scale, cap = _scale_and_cap(q, softmax_scale, softcap)
    res = run_attention(
        q,
        k,
        v,
        layout.cu_q,
        layout.cu_k,
        cu_seqlens_q_host=layout.host_q,
        cu_seqlens_k_host=layout.host_k,
        softmax_scale=scale,  # type: ignore[arg-type]  # run_attention checks them
        causal=False,  # in the window's right bound
        window_size=(left, right),  # type: ignore[arg-type]
        softcap=cap,  # type: ignore[arg-type]
        return_lse=return_attn_probs,
        backend=None,
        where=WHERE,
        deterministic=deterministic,
    )
    if isinstance(res, tuple):  # return_attn_probs
        out, lse = res
        return out, lse, None
    return res
