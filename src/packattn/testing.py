"""Float64 oracle and tolerance helpers, public so that device checks can reuse them.

The oracle is written straight from the formulas of the contract (README), one sequence at a time, with
full score matrices: simple rather than fast. Tolerances follow flash-attention's rule: a result may be at
most ``factor`` times as far from the float64 oracle as plain PyTorch computing the same formula in the
same dtype, plus a small rounding floor.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

__all__ = ["Error", "assert_close_to_oracle", "attention_naive", "oracle"]

_FLOOR = {torch.float64: 1e-12, torch.float32: 1e-6, torch.float16: 1e-3, torch.bfloat16: 8e-3}


def attention_naive(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: list[int],
    cu_seqlens_k: list[int],
    *,
    softmax_scale: float | None = None,
    causal: bool = False,
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    dtype: torch.dtype | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(out, lse)`` of varlen attention computed naively in ``dtype`` (default: the inputs' dtype).

    Differentiable. ``out`` is ``(Tq, Hq, Dv)`` and ``lse`` is ``(Hq, Tq)``, both in ``dtype``.
    """
    dtype = dtype or q.dtype
    q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)
    scale = q.shape[-1] ** -0.5 if softmax_scale is None else softmax_scale
    left, right = window_size
    if causal:
        right = 0
    g = q.shape[1] // k.shape[1]
    outs, lses = [], []
    for b in range(len(cu_seqlens_q) - 1):
        qb = q[cu_seqlens_q[b] : cu_seqlens_q[b + 1]]
        kb = k[cu_seqlens_k[b] : cu_seqlens_k[b + 1]].repeat_interleave(g, dim=1)
        vb = v[cu_seqlens_k[b] : cu_seqlens_k[b + 1]].repeat_interleave(g, dim=1)
        lq, lk = qb.shape[0], kb.shape[0]
        s = scale * torch.einsum("ihd,jhd->hij", qb, kb)
        if softcap > 0:
            s = softcap * torch.tanh(s / softcap)
        i = torch.arange(lq)[:, None]
        j = torch.arange(lk)[None, :]
        visible = torch.ones(lq, lk, dtype=torch.bool)
        # A bound of lq + lk or more hides nothing: clipped there, huge bounds stay within int64.
        if left >= 0:
            visible &= j >= i + lk - lq - min(left, lq + lk)
        if right >= 0:
            visible &= j <= i + lk - lq + min(right, lq + lk)
        visible = visible.to(s.device)
        empty = ~visible.any(dim=-1)  # rows with no visible key: out 0, LSE -inf
        s = s.masked_fill(~visible, float("-inf")).masked_fill(empty[:, None], 0.0)
        lse = torch.logsumexp(s, dim=-1)
        p = torch.exp(s - lse[..., None]) * visible
        outs.append(torch.einsum("hij,jhd->ihd", p, vb))
        lses.append(lse.masked_fill(empty, float("-inf")))
    return torch.cat(outs), torch.cat(lses, dim=1)


def oracle(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: list[int],
    cu_seqlens_k: list[int],
    **mask: object,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The float64 truth: :func:`attention_naive` in float64 (same keyword options)."""
    return attention_naive(q, k, v, cu_seqlens_q, cu_seqlens_k, dtype=torch.float64, **mask)  # type: ignore[arg-type]


@dataclass(frozen=True)
class Error:
    """How far ``actual`` is from the oracle, next to how far plain PyTorch in the same dtype is."""

    actual: float
    baseline: float
    allowed: float

    @property
    def ok(self) -> bool:
        return self.actual <= self.allowed


def _max_abs_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    same_inf = torch.isinf(a) & torch.isinf(b) & (torch.sign(a) == torch.sign(b))
    d = torch.where(same_inf, torch.zeros_like(a), (a - b).abs())
    if torch.isnan(d).any():
        return math.inf
    return float(d.max()) if d.numel() else 0.0


def assert_close_to_oracle(
    actual: torch.Tensor,
    expected: torch.Tensor,
    baseline: torch.Tensor,
    *,
    name: str = "out",
    factor: float = 2.0,
    floor: float | None = None,
) -> Error:
    """Assert ``|actual - expected| <= factor * |baseline - expected| + floor`` (max over elements).

    ``expected`` is the float64 oracle and ``baseline`` plain PyTorch in ``actual``'s dtype. Infinities must
    match exactly and NaN never passes, nor does a baseline without a finite error. ``floor`` defaults to a
    rounding floor of ``actual``'s dtype scaled by the magnitude of ``expected``.
    """
    actual, expected, baseline = actual.detach(), expected.detach(), baseline.detach()  # compared as values
    if actual.shape != expected.shape:
        raise AssertionError(f"{name}: shape {tuple(actual.shape)} != oracle's {tuple(expected.shape)}")
    if torch.isnan(actual).any():
        raise AssertionError(f"{name}: contains NaN")
    if not torch.equal(torch.isinf(actual), torch.isinf(expected)):
        raise AssertionError(f"{name}: infinities differ from the oracle's")
    finite = expected[torch.isfinite(expected)]
    scale = max(1.0, float(finite.abs().max())) if finite.numel() else 1.0
    floor = _FLOOR.get(actual.dtype, 1e-6) * scale if floor is None else floor
    err = Error(_max_abs_diff(actual, expected), _max_abs_diff(baseline, expected), 0.0)
    if not math.isfinite(err.baseline):
        raise AssertionError(f"{name}: the baseline has NaN or other infinities than the oracle: no tolerance")
    err = Error(err.actual, err.baseline, factor * err.baseline + floor)
    if not err.ok:
        raise AssertionError(
            f"{name}: max error {err.actual:.3g} > allowed {err.allowed:.3g} "
            f"(plain PyTorch in {actual.dtype}: {err.baseline:.3g})"
        )
    return err
