"""What the two backends over flash-attention-2-convention CUDA kernels (``flash_attn``, ``torch_varlen``) share.

Both kernels take int32 offsets on the device with their maxima as Python ints, run fp16/bf16 with
``D == Dv <= 256`` on SM80+ GPUs, and return the LSE as ``(Hq, Tq)`` float32 with **+inf** for rows that see
no key, where packattn's contract has -inf (-inf is what keeps LSE merges NaN-free). This module declares
those limits and converts at the edge.

Both read windows as flash-attn 2's ``mha_varlen_fwd`` does: a bound ``>= max_seqlen_k`` is dropped, then a
window bounded on the left only gets ``max_seqlen_k`` as its right bound. That is exact unless a sequence
has more than ``max_seqlen_k + 1`` queries, where it hides keys from leading rows: such calls are declined.
The kernels also take head dims that are multiples of 8 only (flash-attn's Python wrapper pads, PyTorch's
``varlen_attn`` does not: padded here for both), launch one block row per sequence and head (at most 65535
of each, CUDA's grid limit) and load 16-byte vectors (tensors whose rows are not 16-byte aligned are copied).

Gradients: neither library differentiates its LSE (flash-attn 2 and ``torch.nn.attention.varlen`` both drop
the LSE's gradient), but packattn's LSE is differentiable (merges and ring attention backpropagate through
it). So the library's own backward kernel serves calls whose LSE has no gradient (almost every training
call: the output alone reaches the loss), and packattn's Triton backward where it runs, else the exact
reference path, serves the others: all recompute from the LSE.
"""

from __future__ import annotations

import math
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
        layout = inp.layout
        if layout.batch > MAX_GRID or inp.heads_q > MAX_GRID:
            why.append(f"{label} launches a block row per sequence and head, at most {MAX_GRID} of each, "
                       f"got {layout.batch} sequences and {inp.heads_q} heads")  # fmt: skip
        right, kernel_right = (
            _right_bound(inp.mask.right),
            _kernel_right_bound(inp.mask.left, inp.mask.right, layout.max_k),
        )
        longest = max((lq for lq, lk in zip(lens_q, layout.seqlens_k()) if lk), default=0)
        if kernel_right != right and min(kernel_right, right) < longest - 1:
            why.append(
                f"{label} reads window_size right={inp.mask.right} as {_bound_text(kernel_right)} here "
                f"(max_seqlen_k={layout.max_k}), which hides keys from rows of a sequence of {longest} queries"
            )
        return why


MAX_GRID = 65535  # CUDA's limit on a launch grid's y and z extents


def _right_bound(right: int) -> float:
    return math.inf if right < 0 else right


def _kernel_right_bound(left: int, right: int, max_k: int) -> float:
    """The right window bound flash-attn 2's varlen kernels apply: bounds ``>= max_seqlen_k`` are dropped, then
    a window bounded on the left only gets ``max_seqlen_k`` on the right (a dropped left bound is exact: it
    covers every key)."""
    left, right = (-1 if b >= max_k else b for b in (left, right))
    if right < 0 and left >= 0:
        right = max_k
    return _right_bound(right)


def _bound_text(bound: float) -> str:
    return "unbounded" if bound == math.inf else str(int(bound))


def device_offsets(cu: torch.Tensor, device: torch.device) -> torch.Tensor:
    """The offsets as the kernels want them: int32, contiguous, on ``device`` (no copy when they already are)."""
    return cu.to(device=device, dtype=torch.int32, non_blocking=True).contiguous()


def _kernel_layout(*tensors: torch.Tensor) -> list[torch.Tensor]:
    """The tensors as the kernels load them: head dim zero-padded to a multiple of 8 (which changes no score
    and adds zero columns to the output, cut off after), unit last stride, 16-byte aligned rows."""
    pad = -tensors[0].shape[-1] % 8
    if pad:
        return [torch.nn.functional.pad(t, (0, pad)) for t in tensors]
    return [t if _aligned(t) else t.contiguous() for t in tensors]


def _aligned(t: torch.Tensor) -> bool:
    unit = 16 // t.element_size()
    return t.stride(-1) == 1 and t.data_ptr() % 16 == 0 and all(s % unit == 0 for s in t.stride()[:-1])


def _nothing_to_compute(inp: AttentionInputs) -> bool:
    return inp.layout.total_q == 0 or inp.layout.max_k == 0  # every row sees no key


def forward(inp: AttentionInputs, kernel: Kernel) -> tuple[torch.Tensor, torch.Tensor]:
    """Run ``kernel(q, k, v, cu_q, cu_k, max_q, max_k) -> (out, lse)`` and convert to packattn's conventions."""
    layout, q = inp.layout, inp.q
    if _nothing_to_compute(inp):
        out = q.new_zeros(q.shape[0], q.shape[1], inp.v.shape[2])
        return out, torch.full((q.shape[1], q.shape[0]), float("-inf"), dtype=torch.float32, device=q.device)
    cu_q, cu_k = device_offsets(layout.cu_q, q.device), device_offsets(layout.cu_k, q.device)
    out, lse = kernel(*_kernel_layout(q, inp.k, inp.v), cu_q, cu_k, layout.max_q, layout.max_k)
    if lse.shape != (q.shape[1], q.shape[0]):
        lse = lse.transpose(0, 1)  # some releases document (Tq, Hq)
    out = out[..., : inp.head_dim_v].contiguous()
    # The kernels write +inf for a row that sees no key (packattn: -inf) and for a row whose softmax sum is NaN
    # (a NaN or +inf score: packattn's LSE is NaN there), told apart by the NaN the latter leaves in its output.
    lse = lse.float()
    no_mass = torch.where(out.isnan().any(-1).transpose(0, 1), float("nan"), float("-inf"))
    return out, torch.where(lse == float("inf"), no_mass, lse).contiguous()


BackwardKernel = Callable[..., tuple[torch.Tensor, torch.Tensor, torch.Tensor]]


def backward(
    inp: AttentionInputs, out: torch.Tensor, lse: torch.Tensor, dout: torch.Tensor, kernel: BackwardKernel
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Run ``kernel(dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k) -> (dq, dk, dv)`` on the tensors as the
    forward kernel saw them (padded, aligned) and its LSE convention (+inf for rows that see no key)."""
    if _nothing_to_compute(inp):
        return torch.zeros_like(inp.q), torch.zeros_like(inp.k), torch.zeros_like(inp.v)
    layout, d = inp.layout, inp.head_dim
    cu_q, cu_k = device_offsets(layout.cu_q, inp.q.device), device_offsets(layout.cu_k, inp.q.device)
    kernel_lse = lse.float().masked_fill(torch.isneginf(lse), float("inf")).contiguous()
    q, k, v, out, dout = _kernel_layout(inp.q, inp.k, inp.v, out, dout)
    dq, dk, dv = kernel(dout, q, k, v, out, kernel_lse, cu_q, cu_k, layout.max_q, layout.max_k)
    return dq[..., :d], dk[..., :d], dv[..., :d]
