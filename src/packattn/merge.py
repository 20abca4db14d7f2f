"""Combine attention results over disjoint key sets through their log-sum-exp."""

from __future__ import annotations

import torch

from .errors import InputTypeError
from .inputs import compute_dtype


def merge_attention_states(
    out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor, lse_b: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge two partial attention results of the same queries over disjoint key sets.

    Args:
        out_a, out_b: ``(T, H, Dv)`` partial outputs, each normalised over its own keys.
        lse_a, lse_b: ``(H, T)`` natural-log LSE of each part; ``-inf`` marks a row that saw no key, NaN one
            whose softmax was undefined (NaN or infinite inputs), which makes the merged row NaN.

    Returns:
        ``(out, lse)`` with ``lse = logaddexp(lse_a, lse_b)`` and
        ``out = out_a * exp(lse_a - lse) + out_b * exp(lse_b - lse)``, computed in float32 (float64 for
        float64 inputs). ``out`` has ``out_a``'s dtype and ``lse`` is float32 (float64). A row that is
        empty on both sides gives out 0 and LSE -inf, never NaN. Differentiable.

    Example:
        >>> import torch, packattn
        >>> o, l = torch.ones(2, 1, 4), torch.zeros(1, 2)
        >>> out, lse = packattn.merge_attention_states(o, l, torch.zeros(2, 1, 4), torch.full((1, 2), -torch.inf))
        >>> out[0, 0].tolist(), lse.tolist()
        ([1.0, 1.0, 1.0, 1.0], [[0.0, 0.0]])
    """
    where = "merge_attention_states"
    for name, t in (("out_a", out_a), ("lse_a", lse_a), ("out_b", out_b), ("lse_b", lse_b)):
        if not isinstance(t, torch.Tensor):
            raise InputTypeError(f"{where}: {name} must be a torch.Tensor, got {type(t).__name__}")
        if not t.is_floating_point():
            raise InputTypeError(f"{where}: {name} must be a floating-point tensor, got {t.dtype}")
    if out_a.dim() != 3 or out_a.shape != out_b.shape:
        raise ValueError(
            f"{where}: out_a and out_b must both be (T, H, Dv) of the same shape, got "
            f"{tuple(out_a.shape)} and {tuple(out_b.shape)}"
        )
    expected = (out_a.shape[1], out_a.shape[0])
    for name, t in (("lse_a", lse_a), ("lse_b", lse_b)):
        if tuple(t.shape) != expected:
            raise ValueError(f"{where}: {name} must have shape (H, T) = {expected}, got {tuple(t.shape)}")
    if out_a.dtype != out_b.dtype:
        raise InputTypeError(f"{where}: out_a and out_b must have the same dtype, got {out_a.dtype} and {out_b.dtype}")
    if lse_a.dtype != lse_b.dtype:
        raise InputTypeError(f"{where}: lse_a and lse_b must have the same dtype, got {lse_a.dtype} and {lse_b.dtype}")
    for name, t in (("lse_a", lse_a), ("out_b", out_b), ("lse_b", lse_b)):
        if t.device != out_a.device:
            raise ValueError(f"{where}: {name} must be on the same device as out_a ({out_a.device}), got {t.device}")
    cdt = compute_dtype(torch.promote_types(out_a.dtype, lse_a.dtype))
    la, lb = lse_a.to(cdt), lse_b.to(cdt)
    # Rows empty on both sides have lse = -inf. logaddexp's gradient there is exp(-inf - -inf) = NaN, so
    # those rows are computed on zeros and masked: their gradients are 0, like any row with weight 0.
    empty = torch.isneginf(la) & torch.isneginf(lb)
    lse = torch.logaddexp(la.masked_fill(empty, 0.0), lb.masked_fill(empty, 0.0)).masked_fill(empty, float("-inf"))
    # Subtract 0 where lse is infinite so the weights of empty rows are exp(-inf) = 0.
    ref = lse.masked_fill(torch.isinf(lse), 0.0)
    # The weights as (T, H, 1) in memory order, so that out is laid out as the outputs, contiguous (a transposed
    # view would give it the LSE's head-major strides).
    wa = torch.exp(la - ref).transpose(0, 1).contiguous()[..., None]
    wb = torch.exp(lb - ref).transpose(0, 1).contiguous()[..., None]
    # A side with weight 0 contributes exactly 0, even if its output holds garbage (e.g. NaN); a NaN weight
    # (a NaN LSE: its softmax was undefined) makes the row NaN.
    zero = out_a.new_zeros((), dtype=cdt)
    out = torch.where(wa == 0, zero, out_a.to(cdt) * wa) + torch.where(wb == 0, zero, out_b.to(cdt) * wb)
    return out.to(out_a.dtype), lse
