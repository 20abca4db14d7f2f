"""PyTorch's ``torch.nn.attention.varlen.varlen_attn`` on CUDA (its built-in flash-attention 2 kernel).

Needs a PyTorch with ``window_size`` and ``enable_gqa`` (2.12 and newer); fp16/bf16, ``D == Dv <= 256``,
SM80+, no soft-capping. Conventions as flash-attn 2's: int32 offsets on the device,
``max_q``/``max_k`` from the host copies, bottom-right ``(left, right)`` windows (causal is ``(-1, 0)``), LSE
``(Hq, Tq)`` with +inf for rows that see no key, converted to -inf here. Gradients: PyTorch's own varlen
backward op when the LSE has no gradient (it cannot take one), else packattn's exact kernels (see
:mod:`.fa2_convention`).
"""

from __future__ import annotations

import functools
import inspect
from dataclasses import replace

import torch

from ..inputs import AttentionInputs
from . import fa2_convention
from .base import Grads


@functools.cache
def _module():
    """``torch.nn.attention.varlen``, or the reason it cannot serve."""
    try:
        from torch.nn.attention import varlen
    except ImportError:
        return None, f"torch {torch.__version__} has no torch.nn.attention.varlen"
    params = inspect.signature(varlen.varlen_attn).parameters
    missing = [p for p in ("window_size", "enable_gqa", "scale", "return_aux") if p not in params]
    if missing:
        return None, f"torch {torch.__version__}'s varlen_attn lacks {', '.join(missing)} (torch >= 2.12 has them)"
    return varlen, None


def _varlen_backward():
    """PyTorch's varlen backward op (``torch.ops.torch_attn``, registered by ``torch.nn.attention.varlen``), or None."""
    if _module()[0] is None:
        return None
    return getattr(torch.ops.torch_attn, "_varlen_attn_backward", None)


def backward(
    inp: AttentionInputs, out: torch.Tensor, lse: torch.Tensor, dout: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients through ``out`` on the op that ``varlen_attn``'s own autograd calls, with the same arguments."""
    op, m = _varlen_backward(), inp.mask

    def kernel(dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k):
        rng_state = torch.zeros(2, dtype=torch.uint64, device=q.device)  # no dropout
        return op(dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, False, rng_state, m.scale, [m.left, m.right])

    with torch.no_grad():
        return fa2_convention.backward(inp, out, lse, dout, kernel)


def forward(inp: AttentionInputs) -> tuple[torch.Tensor, torch.Tensor]:
    varlen, _ = _module()
    m = inp.mask

    def kernel(q, k, v, cu_q, cu_k, max_q, max_k):
        return varlen.varlen_attn(
            q, k, v, cu_q, cu_k, max_q, max_k,
            return_aux=varlen.AuxRequest(lse=True), scale=m.scale, window_size=(m.left, m.right),
            enable_gqa=inp.heads_q != inp.heads_kv,
        )  # fmt: skip

    with torch.no_grad():  # gradients come from packattn's backward (the LSE's included)
        return fa2_convention.forward(inp, kernel)


class TorchVarlen(fa2_convention.Fa2Convention):
    name = "torch_varlen"
    label = "torch.nn.attention.varlen"
    # Its backward (PyTorch's flash kernel) accumulates dQ with atomics.
    capabilities = replace(fa2_convention.Fa2Convention.capabilities, softcap=False, deterministic=False)

    def unavailable_reason(self) -> str | None:
        # Importing torch.nn.attention.varlen loads torch's compiler stack (and Triton, where installed): not
        # where the kernel cannot run.
        return self.no_cuda_reason() or _module()[1]

    def own_backward_reasons(self, inp: AttentionInputs) -> list[str]:
        if _varlen_backward() is None:
            return [f"torch {torch.__version__} has no torch.ops.torch_attn._varlen_attn_backward"]
        return []

    def forward(self, inp: AttentionInputs) -> tuple[torch.Tensor, torch.Tensor]:
        return forward(inp)

    def backward(
        self, inp: AttentionInputs, out: torch.Tensor, lse: torch.Tensor, dout: torch.Tensor, dlse: torch.Tensor | None
    ) -> Grads:
        return backward(inp, out, lse, dout)


BACKEND = TorchVarlen()
