"""flash-attn 2's ``flash_attn_varlen_func`` on CUDA (fp16/bf16, ``D == Dv <= 256``, SM80+).

Its conventions are flash-attn's own: int32 offsets on the device, ``max_seqlen_*`` as
Python ints (taken from the host copies, no device sync), bottom-right causal and ``(left, right)`` windows as
ours, soft-capping since flash-attn 2.6, LSE ``(Hq, Tq)`` with +inf for rows that see no key (converted to
-inf here). Gradients: flash-attn's own backward kernel when the LSE has no gradient (it cannot take one;
``deterministic`` is passed on), else packattn's exact kernels (see :mod:`.fa2_convention`).

"""

from __future__ import annotations

import functools
import importlib.util
import inspect
import sys

import torch

from ..inputs import AttentionInputs
from . import fa2_convention
from .base import Grads


@functools.cache
def _varlen_func():
    """flash-attn's public ``flash_attn_varlen_func``, or the reason it cannot be had."""
    try:
        from flash_attn import flash_attn_varlen_func
    except ImportError as e:  # not installed, or built against another torch/CUDA
        return None, f"flash_attn is not installed or does not import ({e})"
    if "softcap" not in inspect.signature(flash_attn_varlen_func).parameters:
        return None, "flash_attn is older than 2.6 (no softcap argument); packattn needs flash_attn >= 2.6"
    return flash_attn_varlen_func, None


# The leading parameters of flash-attn 2.7-2.8's ``flash_attn::_flash_attn_varlen_backward``, which packattn passes.
BACKWARD_PARAMETERS = (
    "dout", "q", "k", "v", "out", "softmax_lse", "dq", "dk", "dv", "cu_seqlens_q", "cu_seqlens_k", "max_seqlen_q",
    "max_seqlen_k", "dropout_p", "softmax_scale", "causal", "window_size_left", "window_size_right", "softcap",
    "alibi_slopes", "deterministic", "rng_state",
)  # fmt: skip


def _varlen_backward():
    """flash-attn's varlen backward op (``torch.ops.flash_attn``, flash_attn >= 2.7), or None where it is not
    there or takes other parameters."""
    if _varlen_func()[0] is None:  # importing flash_attn registers its ops
        return None
    op = getattr(torch.ops.flash_attn, "_flash_attn_varlen_backward", None)
    if op is None:
        return None
    names = tuple(a.name for a in op.default._schema.arguments)
    return op if names[: len(BACKWARD_PARAMETERS)] == BACKWARD_PARAMETERS else None


def backward(
    inp: AttentionInputs, out: torch.Tensor, lse: torch.Tensor, dout: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients through ``out`` on flash-attn's backward kernel (head dims padded to a multiple of 8 by
    :func:`.fa2_convention.backward`, as flash-attn's own autograd does)."""
    op, m = _varlen_backward(), inp.mask

    def kernel(dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k):
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        op(
            dout, q, k, v, out, lse, dq, dk, dv, cu_q, cu_k, max_q, max_k, 0.0, m.scale, m.causal, m.left, m.right,
            m.softcap, None, inp.deterministic, None,
        )  # fmt: skip
        return dq, dk, dv

    with torch.no_grad():
        return fa2_convention.backward(inp, out, lse, dout, kernel)


def forward(inp: AttentionInputs) -> tuple[torch.Tensor, torch.Tensor]:
    func, _ = _varlen_func()
    m = inp.mask

    def kernel(q, k, v, cu_q, cu_k, max_q, max_k):
        out, lse, _ = func(
            q, k, v, cu_q, cu_k, max_q, max_k,
            softmax_scale=m.scale, causal=m.causal, window_size=(m.left, m.right), softcap=m.softcap,
            return_attn_probs=True,
        )  # fmt: skip
        return out, lse

    with torch.no_grad():  # gradients come from packattn's backward (the LSE's included)
        return fa2_convention.forward(inp, kernel)


class FlashAttn(fa2_convention.Fa2Convention):
    name = "flash_attn"

    def unavailable_reason(self) -> str | None:
        why = self.no_cuda_reason()
        if why is None:
            return _varlen_func()[1]
        installed = "flash_attn" in sys.modules or importlib.util.find_spec("flash_attn") is not None
        return why if installed else f"{why}; flash_attn is not installed"

    def own_backward_reasons(self, inp: AttentionInputs) -> list[str]:
        if _varlen_backward() is None:
            return ["this flash_attn has no torch.ops.flash_attn._flash_attn_varlen_backward of 2.7-2.8's parameters"]
        return []

    def forward(self, inp: AttentionInputs) -> tuple[torch.Tensor, torch.Tensor]:
        return forward(inp)

    def backward(
        self, inp: AttentionInputs, out: torch.Tensor, lse: torch.Tensor, dout: torch.Tensor, dlse: torch.Tensor | None
    ) -> Grads:
        return backward(inp, out, lse, dout)


BACKEND = FlashAttn()
