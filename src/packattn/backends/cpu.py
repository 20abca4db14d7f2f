"""Fast exact attention on CPU, built on PyTorch's fused CPU flash-attention kernel.

``aten::_scaled_dot_product_flash_attention_for_cpu`` computes in fp32 blocks for every dtype (so bf16 and
fp16 avoid this CPU's slow low-precision matmuls), takes strided ``(B, H, L, D)`` views of the packed
tensors without copies and returns the LSE. This module maps a packed batch onto as few, as well-shaped
calls of it as it can:

* Consecutive sequences of equal lengths are one batched call on a zero-copy view of the packed rows.
* Without a mask, the ``G = Hq / Hkv`` query heads that share a key/value head are stacked along the query
  axis (rows of unmasked attention are independent): GQA/MQA needs no K/V expansion, and decode-like
  sequences with one query become one well-shaped matmul per KV head.
* Causal GQA: the ``G`` query heads of a KV head become the kernel's batch with K/V broadcast over it
  (stride 0), again without K/V copies.
* The bottom-right causal mask is the kernel's own (top-left) causal mask when ``Lq == Lk``, which skips
  the blocks above the diagonal. With ``Lq < Lk`` every query also sees the first ``Lk - Lq`` keys: an
  unmasked call for those, merged through the LSE with a square causal call for the rest. With
  ``Lq > Lk`` the first ``Lq - Lk`` queries see no key (out 0, LSE -inf) and the rest is square.

Anything the kernel cannot express (sliding windows, soft-capping, ``Dv != D``) runs on the tiled
reference path, which is exact for all options. Gradients come from the reference backward.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..inputs import AttentionInputs
from ..merge import merge_attention_states
from . import reference

NAME = "cpu"
NATIVE_AUTOGRAD = False
backward = reference.backward


def _kernel():
    return getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)


def unavailable_reason() -> str | None:
    if _kernel() is None:
        return f"torch {torch.__version__} has no aten::_scaled_dot_product_flash_attention_for_cpu"
    return None


def supports(inp: AttentionInputs) -> list[str]:
    if inp.q.device.type != "cpu":
        return [f"runs on CPU tensors only, got {inp.q.device}"]
    return []


def _uses_kernel(inp: AttentionInputs) -> bool:
    m = inp.mask
    return m.softcap == 0 and m.left < 0 and m.right in (-1, 0) and inp.head_dim == inp.head_dim_v


@dataclass(frozen=True)
class _Rows:
    """``n`` equally long, equally spaced groups of packed rows: ``start + b * step + [0, length)``."""

    start: int
    n: int
    length: int
    step: int

    def view(self, x: torch.Tensor) -> torch.Tensor:
        """Packed ``(T, H, D)`` -> zero-copy ``(n, H, length, D)``."""
        _, h, d = x.shape
        s0, s1, s2 = x.stride()
        return x.as_strided(
            (self.n, h, self.length, d), (self.step * s0, s1, s0, s2), x.storage_offset() + self.start * s0
        )

    def indices(self) -> torch.Tensor:
        return (torch.arange(self.n)[:, None] * self.step + torch.arange(self.length) + self.start).reshape(-1)


def _attend(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, qr: _Rows, kr: _Rows, scale: float, causal: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """One kernel call -> out ``(n * Lq, Hq, D)`` in the order of ``qr``'s rows and LSE ``(Hq, n * Lq)``."""
    n, lq, hq, d = qr.n, qr.length, q.shape[1], q.shape[2]
    hkv = k.shape[1]
    g = hq // hkv
    qv, kv, vv = qr.view(q), kr.view(k), kr.view(v)
    if g > 1 and not causal:
        qs = qv.reshape(n, hkv, g * lq, d)  # stack the G query heads of each KV head (copies q)
        o, lse = _kernel()(qs, kv, vv, 0.0, False, scale=scale)
        o = o.reshape(n, hkv, g, lq, d).permute(0, 3, 1, 2, 4)
    elif g > 1 and n == 1:
        # The G query heads of a KV head become the batch; K/V are broadcast over it (stride 0, no copy).
        qs = qv[0].view(hkv, g, lq, d).transpose(0, 1)
        o, lse = _kernel()(qs, kv.expand(g, -1, -1, -1), vv.expand(g, -1, -1, -1), 0.0, True, scale=scale)
        o = o.permute(2, 1, 0, 3)  # (Lq, Hkv, G, D)
        lse = lse.transpose(0, 1)
    else:
        if g > 1:
            kv, vv = kv.repeat_interleave(g, dim=1), vv.repeat_interleave(g, dim=1)
        o, lse = _kernel()(qv, kv, vv, 0.0, causal, scale=scale)
        o = o.transpose(1, 2)
    return o.reshape(n * lq, hq, d), lse.reshape(n, hq, lq).transpose(0, 1).reshape(hq, n * lq)


def _causal_sequence(
    inp: AttentionInputs, qs: int, lq: int, ks: int, lk: int
) -> tuple[int, torch.Tensor, torch.Tensor]:
    """``(first_row, out, lse)`` of one sequence under the bottom-right causal mask.

    ``Lq > Lk``: the first ``Lq - Lk`` rows see no key; the rest is a square with the kernel's causal mask.
    ``Lq < Lk``: every row sees the first ``Lk - Lq`` keys (unmasked call) and a causal square after them.
    """
    q, k, v, scale = inp.q, inp.k, inp.v, inp.mask.scale
    off = lk - lq
    if off <= 0:
        return qs - off, *_attend(q, k, v, _Rows(qs - off, 1, lk, 0), _Rows(ks, 1, lk, 0), scale, True)
    o_pre, l_pre = _attend(q, k, v, _Rows(qs, 1, lq, 0), _Rows(ks, 1, off, 0), scale, False)
    o_sq, l_sq = _attend(q, k, v, _Rows(qs, 1, lq, 0), _Rows(ks + off, 1, lq, 0), scale, True)
    return qs, *merge_attention_states(o_pre, l_pre, o_sq, l_sq)


def _runs(inp: AttentionInputs) -> list[tuple[int, int, int, int, int]]:
    """``(q_start, lq, k_start, lk, n)``: maximal runs of consecutive sequences with equal, non-zero sides."""
    runs: list[tuple[int, int, int, int, int]] = []
    for qs, qe, ks, ke in inp.layout.sequences():
        lq, lk = qe - qs, ke - ks
        if lq == 0 or lk == 0:
            continue
        if runs:
            rq, rlq, rk, rlk, n = runs[-1]
            if (rlq, rlk) == (lq, lk) and qs == rq + n * lq and ks == rk + n * lk:
                runs[-1] = (rq, rlq, rk, rlk, n + 1)
                continue
        runs.append((qs, lq, ks, lk, 1))
    return runs


def forward(inp: AttentionInputs) -> tuple[torch.Tensor, torch.Tensor]:
    if not _uses_kernel(inp):
        return reference.forward(inp)
    q, v = inp.q, inp.v
    pieces = []
    for qs, lq, ks, lk, n in _runs(inp):
        causal = inp.mask.causal and lq > 1  # one causal query sees every key
        if not causal or lq == lk:
            pieces.append(
                (qs, *_attend(q, inp.k, v, _Rows(qs, n, lq, lq), _Rows(ks, n, lk, lk), inp.mask.scale, causal))
            )
        else:
            pieces += [_causal_sequence(inp, qs + b * lq, lq, ks + b * lk, lk) for b in range(n)]
    lse_dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
    if len(pieces) == 1 and pieces[0][1].shape[0] == q.shape[0]:
        _, o, lse = pieces[0]
        return o.contiguous(), lse.to(lse_dtype)
    out = torch.zeros(q.shape[0], q.shape[1], v.shape[2], dtype=q.dtype)
    lse = torch.full((q.shape[1], q.shape[0]), float("-inf"), dtype=lse_dtype)
    for start, o, l_ in pieces:
        out[start : start + o.shape[0]] = o
        lse[:, start : start + o.shape[0]] = l_
    return out, lse
