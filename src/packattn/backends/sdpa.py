"""Per-sequence ``torch.nn.functional.scaled_dot_product_attention`` on any device.

Uses whatever SDPA kernel PyTorch picks for the device (flash, memory-efficient, cuDNN, math) and its
autograd. Public SDPA returns no LSE and has no soft-capping or sliding window, so those requests go
elsewhere. Causal with ``Lq != Lk`` is bottom-right aligned through an explicit mask.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..inputs import AttentionInputs

NAME = "sdpa"
NATIVE_AUTOGRAD = True


def unavailable_reason() -> str | None:
    return None


def supports(inp: AttentionInputs) -> list[str]:
    why = []
    if inp.return_lse:
        why.append("public scaled_dot_product_attention returns no LSE (return_lse=True)")
    if inp.mask.softcap > 0:
        why.append(f"scaled_dot_product_attention has no soft-capping (softcap={inp.mask.softcap})")
    if inp.mask.left >= 0 or inp.mask.right > 0:
        why.append(
            f"scaled_dot_product_attention has no sliding window (window_size=({inp.mask.left}, {inp.mask.right}))"
        )
    return why


def forward(inp: AttentionInputs) -> tuple[torch.Tensor, None]:
    q, k, v, mask = inp.q, inp.k, inp.v, inp.mask
    g = inp.heads_q // inp.heads_kv
    pieces = []
    for qs, qe, ks, ke in inp.layout.sequences():
        lq, lk = qe - qs, ke - ks
        # Rows that see no key stay 0: no keys at all, or causal rows above a short key side.
        first = max(0, lq - lk) if mask.causal else (lq if lk == 0 else 0)
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
    if not pieces:
        return q.new_zeros(0, q.shape[1], v.shape[2]), None
    return torch.cat(pieces).contiguous(), None
