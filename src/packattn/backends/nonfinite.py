"""packattn's rule for NaN and infinities, for the backends on PyTorch's attention kernels.

The rule (README, "Non-finite inputs"): an output row that depends on a non-finite value through a visible
(query, key) pair is non-finite, and so are its LSE and the gradients that flow through it; nothing
outside that value's sequence and KV-head group changes; rows that see no key stay 0 and -inf. PyTorch's
fused CPU kernel returns a finite row for a query row holding NaN.

:func:`propagate` completes what those kernels do (they carry a NaN or infinity of a key or value into the
rows that see it): a query row holding one gets NaN out and LSE. Multiplying by NaN, rather than
overwriting, keeps the NaN in the gradients that autograd takes through the forward.
"""

from __future__ import annotations

import torch

from ..inputs import AttentionInputs


def _bad_rows(x: torch.Tensor) -> torch.Tensor:
    """``(T, H)``: rows with a NaN or infinity (max and min propagate NaN; a sum could overflow)."""
    return ~(torch.isfinite(x.amax(-1)) & torch.isfinite(x.amin(-1)))


def tainted_rows(inp: AttentionInputs) -> torch.Tensor:
    """``(Tq, Hq)`` bool: query rows that hold a NaN or infinity and see a key."""
    q, mask, layout = inp.q, inp.mask, inp.layout
    lens_q = torch.tensor(layout.seqlens_q(), device=q.device)
    lk = torch.tensor(layout.seqlens_k(), device=q.device).repeat_interleave(lens_q)
    start = torch.tensor(layout.host_q[:-1], device=q.device).repeat_interleave(lens_q)
    diag = torch.arange(q.shape[0], device=q.device) - start + lk - lens_q.repeat_interleave(lens_q)
    lo = torch.zeros_like(lk) if mask.left < 0 else (diag - mask.left).clamp(min=0).minimum(lk)
    hi = lk if mask.right < 0 else (diag + mask.right + 1).clamp(min=0).minimum(lk)
    return _bad_rows(q) & (hi > lo)[:, None]


def propagate(
    inp: AttentionInputs, out: torch.Tensor, lse: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``out`` and ``lse`` with NaN in every row of :func:`tainted_rows`."""
    # On CPU a quick test first: the sum is NaN or infinite for any NaN or infinity in q (or an overflow: then
    # the exact one). Elsewhere it would be a device sync: the rows are always computed.
    if inp.q.device.type == "cpu" and bool(torch.isfinite(inp.q.sum())):
        return out, lse
    rows = tainted_rows(inp)
    factor = torch.where(rows, float("nan"), 1.0).to(out.dtype)
    out = out * factor[..., None]
    if lse is not None:
        lse = lse + torch.where(rows, float("nan"), 0.0).to(lse.dtype).transpose(0, 1)
    return out, lse
