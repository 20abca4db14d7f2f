"""Exact pure-PyTorch attention in tiles: the behaviour every other backend must match.

Runs on any device and supports every option. Scores are computed per sequence in tiles of
``BLOCK_Q`` query rows by ``BLOCK_K`` keys with an online softmax, so memory stays bounded for long
sequences; tiles that the mask hides entirely are skipped. Query heads that share a key/value head are
stacked into one matmul (no K/V expansion for GQA). The backward recomputes the probabilities from the
saved LSE (flash-attention's scheme), tile by tile.
"""

from __future__ import annotations

import torch

from ..inputs import AttentionInputs, MaskSpec, compute_dtype
from .base import Backend, Grads

BLOCK_Q = 128
BLOCK_K = 512


def _grouped(x: torch.Tensor, heads_kv: int, dtype: torch.dtype) -> torch.Tensor:
    """``(L, Hq, D)`` -> ``(Hkv, G * L, D)`` with the G query heads of a KV head stacked along rows."""
    length, heads, dim = x.shape
    g = heads // heads_kv
    return x.to(dtype).reshape(length, heads_kv, g, dim).permute(1, 2, 0, 3).reshape(heads_kv, g * length, dim)


def _ungrouped(x: torch.Tensor, length: int) -> torch.Tensor:
    """Inverse of :func:`_grouped`: ``(Hkv, G * L, D)`` -> ``(L, Hq, D)``."""
    heads_kv, gl, dim = x.shape
    g = gl // length
    return x.reshape(heads_kv, g, length, dim).permute(2, 0, 1, 3).reshape(length, heads_kv * g, dim)


def tile_scores(
    qb: torch.Tensor,
    kc: torch.Tensor,
    mask: MaskSpec,
    rows: tuple[int, int],
    cols: tuple[int, int],
    lq: int,
    lk: int,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Masked scores ``(Hkv, G * bq, bk)`` of one tile, and ``tanh`` of the soft-capped scores if any.

    ``qb`` is ``(Hkv, G * bq, D)`` and ``kc`` is ``(Hkv, bk, D)``, both in the compute dtype.
    """
    s = torch.bmm(qb, kc.transpose(1, 2)).mul_(mask.scale)
    t = None
    if mask.softcap > 0:
        t = torch.tanh(s.div_(mask.softcap))
        s = t * mask.softcap
    (i0, i1), (j0, j1) = rows, cols
    if not mask.fully_visible(i0, i1, j0, j1, lq, lk):
        dev = s.device
        ok = mask.visible(torch.arange(i0, i1, device=dev), torch.arange(j0, j1, device=dev), lq, lk)
        hkv = s.shape[0]
        s = s.view(hkv, -1, i1 - i0, j1 - j0).masked_fill_(~ok, float("-inf")).view(hkv, -1, j1 - j0)
    return s, t


def _tiles(mask: MaskSpec, lq: int, lk: int):
    """Yield ``(i0, i1, [(j0, j1), ...])`` for every query block; the key chunks skip hidden keys."""
    for i0 in range(0, lq, BLOCK_Q):
        i1 = min(lq, i0 + BLOCK_Q)
        lo, hi = mask.key_range(i0, i1, lq, lk)
        yield i0, i1, [(j0, min(hi, j0 + BLOCK_K)) for j0 in range(lo, hi, BLOCK_K)]


def row_status(
    m: torch.Tensor, denom: torch.Tensor, mask: MaskSpec, rows: tuple[int, int], lq: int, lk: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(fine, empty)`` of the grouped rows ``(Hkv, G * bq)`` of query rows ``rows``, from their final max and
    sum: a finite max and sum is a defined softmax; a row that sees no key is empty (out 0, LSE -inf); any
    other met a NaN or +inf score, or only -inf ones (infinite inputs), and gets NaN out and LSE."""
    fine = torch.isfinite(m) & (denom > 0)
    lo, hi = mask.visible_rows(lq, lk)
    r = torch.arange(*rows, device=m.device)
    empty = ((r < lo) | (r >= hi)).repeat(m.shape[1] // len(r))
    return fine, empty.expand_as(m)


def forward(inp: AttentionInputs) -> tuple[torch.Tensor, torch.Tensor]:
    q, k, v, mask = inp.q, inp.k, inp.v, inp.mask
    cdt = compute_dtype(q.dtype)
    hkv = inp.heads_kv
    out = torch.zeros(q.shape[0], q.shape[1], v.shape[2], dtype=q.dtype, device=q.device)
    lse = torch.full((q.shape[1], q.shape[0]), float("-inf"), dtype=cdt, device=q.device)
    for qs, qe, ks, ke in inp.layout.sequences():
        lq, lk = qe - qs, ke - ks
        if lq == 0 or lk == 0:
            continue
        kseq = k[ks:ke].to(cdt).transpose(0, 1)  # (Hkv, Lk, D)
        vseq = v[ks:ke].to(cdt).transpose(0, 1)
        for i0, i1, chunks in _tiles(mask, lq, lk):
            if not chunks:
                continue
            qb = _grouped(q[qs + i0 : qs + i1], hkv, cdt)
            m = torch.full(qb.shape[:2], float("-inf"), dtype=cdt, device=q.device)
            denom = torch.zeros_like(m)
            acc = qb.new_zeros(hkv, qb.shape[1], v.shape[2])
            for j0, j1 in chunks:
                s, _ = tile_scores(qb, kseq[:, j0:j1], mask, (i0, i1), (j0, j1), lq, lk)
                m_new = torch.maximum(m, s.amax(-1))
                m_safe = torch.where(m_new == float("-inf"), torch.zeros_like(m_new), m_new)
                p = torch.exp(s - m_safe[..., None])
                alpha = torch.exp(m - m_safe)
                denom = denom * alpha + p.sum(-1)
                acc = acc * alpha[..., None] + torch.bmm(p, vseq[:, j0:j1])
                m = m_new
            fine, empty = row_status(m, denom, mask, (i0, i1), lq, lk)
            o = acc / torch.where(fine, denom, torch.ones_like(denom))[..., None]
            o = torch.where(fine[..., None], o, torch.where(empty, 0.0, float("nan"))[..., None])
            out[qs + i0 : qs + i1] = _ungrouped(o, i1 - i0).to(q.dtype)
            block_lse = torch.where(fine, m + torch.log(denom), torch.where(empty, float("-inf"), float("nan")))
            lse[:, qs + i0 : qs + i1] = block_lse.view(hkv, -1, i1 - i0).reshape(-1, i1 - i0)
    return out, lse


def delta(out: torch.Tensor, dout: torch.Tensor, dlse: torch.Tensor | None) -> torch.Tensor:
    """``rowsum(dout * out) - dlse`` as ``(Hq, Tq)`` in the compute dtype: every backward that recomputes the
    probabilities from the LSE needs it, as d(score) = p * (dP - delta)."""
    cdt = compute_dtype(out.dtype)
    d = (dout.to(cdt) * out.to(cdt)).sum(-1).transpose(0, 1)
    return d if dlse is None else d - dlse.to(cdt)


def backward(
    inp: AttentionInputs,
    out: torch.Tensor,
    lse: torch.Tensor,
    dout: torch.Tensor,
    dlse: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients of ``q, k, v`` given the output gradient and (optionally) the LSE gradient."""
    q, k, v, mask = inp.q, inp.k, inp.v, inp.mask
    cdt = compute_dtype(q.dtype)
    hkv = inp.heads_kv
    delta_t = delta(out, dout, dlse).transpose(0, 1)  # (Tq, Hq)
    dq = torch.zeros(q.shape, dtype=cdt, device=q.device)
    dk = torch.zeros(k.shape, dtype=cdt, device=q.device)
    dv = torch.zeros(v.shape, dtype=cdt, device=q.device)
    lse_t = lse.transpose(0, 1)  # (Tq, Hq)
    for qs, qe, ks, ke in inp.layout.sequences():
        lq, lk = qe - qs, ke - ks
        if lq == 0 or lk == 0:
            continue
        kseq = k[ks:ke].to(cdt).transpose(0, 1)
        vseq = v[ks:ke].to(cdt).transpose(0, 1)
        dkseq = torch.zeros_like(kseq)
        dvseq = torch.zeros_like(vseq)
        for i0, i1, chunks in _tiles(mask, lq, lk):
            if not chunks:
                continue
            rows = slice(qs + i0, qs + i1)
            qb = _grouped(q[rows], hkv, cdt)
            dob = _grouped(dout[rows], hkv, cdt)
            lse_b = _grouped(lse_t[rows, :, None], hkv, cdt)
            lse_b = torch.where(torch.isinf(lse_b), torch.zeros_like(lse_b), lse_b)
            delta_b = _grouped(delta_t[rows, :, None], hkv, cdt)
            dqb = torch.zeros_like(qb)
            for j0, j1 in chunks:
                kc, vc = kseq[:, j0:j1], vseq[:, j0:j1]
                s, t = tile_scores(qb, kc, mask, (i0, i1), (j0, j1), lq, lk)
                p = torch.exp(s - lse_b)
                dvseq[:, j0:j1] += torch.bmm(p.transpose(1, 2), dob)
                ds = p * (torch.bmm(dob, vc.transpose(1, 2)) - delta_b)
                if t is not None:
                    ds = ds * (1 - t * t)
                ds = ds * mask.scale
                dqb += torch.bmm(ds, kc)
                dkseq[:, j0:j1] += torch.bmm(ds.transpose(1, 2), qb)
            dq[rows] = _ungrouped(dqb, i1 - i0)
        dk[ks:ke] = dkseq.transpose(0, 1)
        dv[ks:ke] = dvseq.transpose(0, 1)
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


class Reference(Backend):
    name = "reference"

    def forward(self, inp: AttentionInputs) -> tuple[torch.Tensor, torch.Tensor]:
        return forward(inp)

    def backward(
        self, inp: AttentionInputs, out: torch.Tensor, lse: torch.Tensor, dout: torch.Tensor, dlse: torch.Tensor | None
    ) -> Grads:
        return backward(inp, out, lse, dout, dlse)


BACKEND = Reference()
