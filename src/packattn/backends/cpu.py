"""Fast exact attention on CPU, built on PyTorch's fused CPU flash-attention kernel.

``aten::_scaled_dot_product_flash_attention_for_cpu`` accumulates in fp32 blocks for fp32/bf16/fp16 (fp64 in
fp64): bf16 and fp16 use the CPU's matrix units where it has them (AMX) and never a slow plain low-precision
matmul where it has not. It takes strided ``(B, H, L, D)`` views of the packed tensors without copies and
returns the LSE. This module maps a packed batch onto as few, as well-shaped calls of it as it can:

* Consecutive sequences of equal lengths are one batched call on a zero-copy view of the packed rows.
* Without a mask, the ``G = Hq / Hkv`` query heads that share a key/value head are stacked along the query
  axis (rows of unmasked attention are independent): GQA/MQA needs no K/V expansion, and decode-like
  sequences with one query become one well-shaped matmul per KV head.
* Causal GQA repeats the K/V heads (the kernel masks by row, so the heads cannot be stacked; a stride-0
  broadcast of K/V is slower than the copy, see benchmarks/README.md).
* The bottom-right causal mask is the kernel's own (top-left) causal mask when ``Lq == Lk``, which skips
  the blocks above the diagonal. Otherwise, and for any window ``(-1, right)`` (which ring attention
  produces for blocks off the diagonal), query ``i`` sees keys ``j <= i + shift``: the rows that see a
  prefix of the keys get an unmasked call for the keys every one of them sees, merged through the LSE
  with a square causal call for the rest; rows that see every key, or none, need no mask at all.

Anything the kernel cannot express (windows bounded on the left, soft-capping, ``Dv != D``) runs on the tiled
reference path, which is exact for all options. Gradients come from the reference backward.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from dataclasses import dataclass
from typing import cast

import torch

from ..inputs import AttentionInputs, MaskSpec
from ..layout import SeqLayout
from ..merge import merge_attention_states
from . import nonfinite, reference
from .base import Backend, Capabilities, backward_of


def _kernel():
    op = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)
    return None if op is None else op.default


def _uses_kernel(inp: AttentionInputs) -> bool:
    m = inp.mask
    return m.softcap == 0 and m.left < 0 and inp.head_dim == inp.head_dim_v


_Piece = tuple[int, torch.Tensor, torch.Tensor]  # (first packed row, out (R, Hq, Dv), lse (Hq, R))


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
    else:
        if g > 1:
            kv, vv = kv.repeat_interleave(g, dim=1), vv.repeat_interleave(g, dim=1)
        o, lse = _kernel()(qv, kv, vv, 0.0, causal, scale=scale)
        o = o.transpose(1, 2)
    return o.reshape(n * lq, hq, d), lse.reshape(n, hq, lq).transpose(0, 1).reshape(hq, n * lq)


def _banded_sequence(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: MaskSpec, qs: int, lq: int, ks: int, lk: int
) -> list[_Piece]:
    """Pieces of one sequence under a window ``(-1, right)``: query ``i`` sees keys ``j <= i + shift``.

        With ``shift = Lk - Lq + right``, rows before ``-shift`` see no key. The next rows see a prefix of
        keys: every key before ``first + shift`` (an unmasked call) and a square under the kernel's top-left
        causal mask after it, merged through the LSE. Rows from the first that sees the last key on see every key
    (unmasked).
    """
    scale = mask.scale
    shift = cast(int, mask.band(lq, lk)[1])  # row i sees keys j <= i + shift
    first = mask.visible_rows(lq, lk)[0]
    last = max(first, mask.query_range(lk - 1, lk, lq, lk)[0])  # rows [first, last) see a strict prefix of the keys
    pieces = []
    if last > first:
        # Rows [first, last) see keys [0, last + shift): a prefix every one of them sees, then a square.
        qw, kw, vw = q[qs + first : qs + last], k[ks : ks + last + shift], v[ks : ks + last + shift]
        if q.dtype in (torch.float16, torch.bfloat16):  # the two calls merge in fp32: the output is rounded once
            qw, kw, vw = qw.float(), kw.float(), vw.float()
        rows = _Rows(0, 1, last - first, 0)
        out, lse = _attend(qw, kw, vw, rows, _Rows(first + shift, 1, last - first, 0), scale, True)
        if first + shift > 0:
            o_pre, l_pre = _attend(qw, kw, vw, rows, _Rows(0, 1, first + shift, 0), scale, False)
            out, lse = merge_attention_states(o_pre, l_pre, out, lse)
        pieces.append((qs + first, out.to(q.dtype), lse))
    if lq > last:
        pieces.append(
            (qs + last, *_attend(q, k, v, _Rows(qs + last, 1, lq - last, 0), _Rows(ks, 1, lk, 0), scale, False))
        )
    return pieces


def _runs(inp: AttentionInputs) -> tuple[tuple[int, int, int, int, int], ...]:
    """``(q_start, lq, k_start, lk, n)``: maximal runs of consecutive sequences with equal, non-zero sides."""
    return inp.layout.plan("cpu runs", lambda: _find_runs(inp.layout))


def _find_runs(layout: SeqLayout) -> tuple[tuple[int, int, int, int, int], ...]:
    runs: list[tuple[int, int, int, int, int]] = []
    for qs, qe, ks, ke in layout.sequences():
        lq, lk = qe - qs, ke - ks
        if lq == 0 or lk == 0:
            continue
        if runs:
            rq, rlq, rk, rlk, n = runs[-1]
            if (rlq, rlk) == (lq, lk) and qs == rq + n * lq and ks == rk + n * lk:
                runs[-1] = (rq, rlq, rk, rlk, n + 1)
                continue
        runs.append((qs, lq, ks, lk, 1))
    return tuple(runs)


def _unit_last_stride(x: torch.Tensor) -> torch.Tensor:
    # The kernel reads each head vector as contiguous memory and ignores a last-dim stride (wrong results).
    return x if x.stride(-1) == 1 else x.contiguous()


def _pieces(inp: AttentionInputs) -> Iterator[_Piece]:
    """The kernel calls of a packed batch, in row order."""
    q, k, v, scale = _unit_last_stride(inp.q), _unit_last_stride(inp.k), _unit_last_stride(inp.v), inp.mask.scale
    for qs, lq, ks, lk, n in _runs(inp):
        # Unmasked, or plain causal on a square: the kernel's own masks, batched over the run.
        if inp.mask.right < 0 or lq == 1 or (lq == lk and inp.mask.right == 0):  # one query sees every key
            causal = inp.mask.right == 0 and lq > 1
            yield (qs, *_attend(q, k, v, _Rows(qs, n, lq, lq), _Rows(ks, n, lk, lk), scale, causal))
        else:
            for b in range(n):
                yield from _banded_sequence(q, k, v, inp.mask, qs + b * lq, lq, ks + b * lk, lk)


def forward(inp: AttentionInputs) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Out and, when ``inp.return_lse`` (a caller or a backward pass reads it), the LSE; else ``None``."""
    if not _uses_kernel(inp):
        return reference.forward(inp)
    return nonfinite.propagate(inp, *_kernel_forward(inp))  # the kernel returns finite rows for NaN queries


def _kernel_forward(inp: AttentionInputs) -> tuple[torch.Tensor, torch.Tensor | None]:
    total, heads, dv = inp.q.shape[0], inp.q.shape[1], inp.v.shape[2]
    lse_dtype = torch.float64 if inp.q.dtype == torch.float64 else torch.float32
    pieces = _pieces(inp)
    first = next(pieces, None)
    if first is not None and first[0] == 0 and first[1].shape[0] == total:  # one call covers the batch
        return first[1].contiguous(), first[2].to(lse_dtype).contiguous() if inp.return_lse else None
    # Copy each piece into place as it comes, so that at most one lives beside the output. Few-row pieces
    # (many short sequences) make this loop's per-op cost count: no op here that the piece does not need.
    out = inp.q.new_empty(total, heads, dv)
    lse = torch.empty(heads, total, dtype=lse_dtype) if inp.return_lse else None
    row = 0
    for start, o, piece_lse in itertools.chain([first] if first is not None else [], pieces):
        if start > row:  # rows between pieces see no key
            out[row:start] = 0
            if lse is not None:
                lse[:, row:start] = float("-inf")
        row = start + o.shape[0]
        out[start:row] = o
        if lse is not None:
            lse[:, start:row] = piece_lse
    out[row:] = 0
    if lse is not None:
        lse[:, row:] = float("-inf")
    return out, lse


class Cpu(Backend):
    name = "cpu"
    capabilities = Capabilities(devices=("cpu",))
    gradients = (backward_of("reference"),)

    def unavailable_reason(self) -> str | None:
        if _kernel() is None:
            return f"torch {torch.__version__} has no aten::_scaled_dot_product_flash_attention_for_cpu"
        return None

    def forward(self, inp: AttentionInputs) -> tuple[torch.Tensor, torch.Tensor | None]:
        return forward(inp)


BACKEND = Cpu()
