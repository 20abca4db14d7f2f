"""Per-sequence ``torch.nn.functional.scaled_dot_product_attention`` on any device.

Uses whatever SDPA kernel PyTorch picks for the device (flash, memory-efficient, cuDNN, math) and its
autograd. Public SDPA returns no LSE and has no soft-capping or sliding window, so those requests go
elsewhere. Causal with ``Lq != Lk`` is bottom-right aligned through an explicit mask.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..inputs import AttentionInputs
from . import nonfinite
from .base import AUTOGRAD, Backend, Capabilities


def forward(inp: AttentionInputs) -> tuple[torch.Tensor, torch.Tensor | None]:
    q, k, v, mask = inp.q, inp.k, inp.v, inp.mask
    g = inp.heads_q // inp.heads_kv
    pieces = []
    for qs, qe, ks, ke in inp.layout.sequences():
        lq, lk = qe - qs, ke - ks
        # Rows that see no key stay 0: no keys at all, or causal rows above a short key side.
        first = mask.visible_rows(lq, lk)[0]
        if first > 0:
            pieces.append(q.new_zeros(first, q.shape[1], v.shape[2]))
        if first == lq:
            continue
        # 4-D (1, H, L, D) views: the fused kernels take them without copies (3-D inputs fall back to math).
        qb = q[qs + first : qe].transpose(0, 1)[None]
        kb = k[ks:ke].transpose(0, 1)[None].repeat_interleave(g, dim=1)
        vb = v[ks:ke].transpose(0, 1)[None].repeat_interleave(g, dim=1)
        rows = lq - first
        attn_mask = None
        is_causal = mask.causal and rows == lk
        if mask.causal and rows != lk:
            i = torch.arange(rows, device=q.device)[:, None]
            attn_mask = torch.arange(lk, device=q.device)[None, :] <= i + (lk - rows)
        o = F.scaled_dot_product_attention(qb, kb, vb, attn_mask=attn_mask, is_causal=is_causal, scale=mask.scale)
        pieces.append(o[0].transpose(0, 1))
    out = torch.cat(pieces) if pieces else q.new_zeros(0, q.shape[1], v.shape[2])
    if torch.is_grad_enabled() and not out.requires_grad and any(t.requires_grad for t in (q, k, v)):
        # No row sees a key: the zeros still join the graph (an empty sum is 0 and carries no NaN), so that a
        # backward through them gives zero gradients, as on every other backend.
        out = out + (q[:0].sum() + k[:0].sum() + v[:0].sum()).to(out.dtype)
    return nonfinite.propagate(inp, out.contiguous(), None)  # SDPA's CPU kernel drops NaN queries


class Sdpa(Backend):
    name = "sdpa"
    label = "scaled_dot_product_attention"
    # Its backward on accelerators may accumulate with atomics (the memory-efficient and flash kernels).
    capabilities = Capabilities(softcap=False, windows=False, lse=False, deterministic=False)
    gradients = (AUTOGRAD,)

    def forward(self, inp: AttentionInputs) -> tuple[torch.Tensor, torch.Tensor | None]:
        return forward(inp)


BACKEND = Sdpa()
