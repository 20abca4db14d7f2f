"""What the two backends over flash-attention-2-convention CUDA kernels (``flash_attn``, ``torch_varlen``) share.

Both kernels take int32 offsets on the device with their maxima as Python ints, run fp16/bf16 with
``D == Dv <= 256`` on SM80+ GPUs, and return the LSE as ``(Hq, Tq)`` float32 with **+inf** for rows that see
no key, where packattn's contract has -inf (-inf is what keeps LSE merges NaN-free). This module declares
those limits and converts at the edge.

Gradients: neither library differentiates its LSE (flash-attn 2 and ``torch.nn.attention.varlen`` both drop
the LSE's gradient), but packattn's LSE is differentiable (merges and ring attention backpropagate through
it). So the library's own backward kernel serves calls whose LSE has no gradient (almost every training
call: the output alone reaches the loss), and packattn's Triton backward where it runs, else the exact
reference path, serves the others: all recompute from the LSE.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ..inputs import AttentionInputs
from .base import OWN_WITHOUT_LSE_GRAD, Backend, Capabilities, backward_of

Kernel = Callable[..., tuple[torch.Tensor, torch.Tensor]]


class Fa2Convention(Backend):
    """The limits, gradient routes and conversions that both backends share."""

    capabilities = Capabilities(
        devices=("cuda",), dtypes=(torch.float16, torch.bfloat16), max_head_dim=256, head_dim_v="equal"
    )
    # The library's own backward where the LSE has no gradient (it cannot take one), else packattn's.
    gradients = (OWN_WITHOUT_LSE_GRAD, backward_of("triton"), backward_of("reference"))

    def no_cuda_reason(self) -> str | None:
        """Why these kernels cannot run here at all: a PyTorch build without CUDA, or no CUDA device (PyPI's
        default Linux wheel is a CUDA build, on many machines without a GPU). ``None`` when they can."""
        if "cuda" not in (self.capabilities.devices or ()):
            return None
        if torch.version.cuda is None:
            return f"torch {torch.__version__} is built without CUDA"
        if not torch.cuda.is_available():
            return f"torch {torch.__version__} finds no CUDA device (torch.cuda.is_available() is False)"
        return None

    def special_reasons(self, inp: AttentionInputs) -> list[str]:
        why = []
        label, device = self.label or self.name, inp.q.device
        if device.type == "cuda" and torch.cuda.get_device_capability(device) < (8, 0):
            major, minor = torch.cuda.get_device_capability(device)
            why.append(f"{label} needs an SM80+ GPU (Ampere or newer), got SM{major}{minor}")
        lens_q = inp.layout.seqlens_q()
        if inp.heads_q != inp.heads_kv and max(lens_q, default=0) == 1 and 0 in lens_q:
            # Its decode path reshapes GQA queries assuming one query per sequence (flash-attention#1537, #1619).
            why.append(f"{label} mishandles GQA batches of at most one query per sequence when some have none")
        return why


def device_offsets(cu: torch.Tensor, device: torch.device) -> torch.Tensor:
    """The offsets as the kernels want them: int32, contiguous, on ``device`` (no copy when they already are)."""
    return cu.to(device=device, dtype=torch.int32, non_blocking=True).contiguous()


def _unit_last_stride(*tensors: torch.Tensor) -> list[torch.Tensor]:
    return [t if t.stride(-1) == 1 else t.contiguous() for t in tensors]


def _nothing_to_compute(inp: AttentionInputs) -> bool:
    return inp.layout.total_q == 0 or inp.layout.max_k == 0  # every row sees no key


def forward(inp: AttentionInputs, kernel: Kernel) -> tuple[torch.Tensor, torch.Tensor]:
    """Run ``kernel(q, k, v, cu_q, cu_k, max_q, max_k) -> (out, lse)`` and convert to packattn's conventions."""
    q, k, v = _unit_last_stride(inp.q, inp.k, inp.v)
    layout = inp.layout
    if _nothing_to_compute(inp):
        out = q.new_zeros(q.shape[0], q.shape[1], v.shape[2])
        return out, torch.full((q.shape[1], q.shape[0]), float("-inf"), dtype=torch.float32, device=q.device)
    cu_q, cu_k = device_offsets(layout.cu_q, q.device), device_offsets(layout.cu_k, q.device)
    out, lse = kernel(q, k, v, cu_q, cu_k, layout.max_q, layout.max_k)
    if lse.shape != (q.shape[1], q.shape[0]):
        lse = lse.transpose(0, 1)  # some releases document (Tq, Hq)
    return out.contiguous(), lse.float().masked_fill(lse == float("inf"), float("-inf")).contiguous()


BackwardKernel = Callable[..., tuple[torch.Tensor, torch.Tensor, torch.Tensor]]


def backward(
    inp: AttentionInputs, out: torch.Tensor, lse: torch.Tensor, dout: torch.Tensor, kernel: BackwardKernel
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Run ``kernel(dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k) -> (dq, dk, dv)`` on the tensors the
    forward kernel saw (unit last stride) and its LSE convention (+inf for rows that see no key)."""
    q, k, v, out, dout = _unit_last_stride(inp.q, inp.k, inp.v, out, dout)
    if _nothing_to_compute(inp):
        return torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    layout = inp.layout
    cu_q, cu_k = device_offsets(layout.cu_q, q.device), device_offsets(layout.cu_k, q.device)
    kernel_lse = lse.float().masked_fill(torch.isneginf(lse), float("inf")).contiguous()
    return kernel(dout, q, k, v, out, kernel_lse, cu_q, cu_k, layout.max_q, layout.max_k)
