"""``varlen_attention`` as ``torch.library`` custom ops, so that ``torch.compile`` traces around it.

Two ops, opaque to the compiler and described to it by fake implementations:

* ``packattn::varlen_attention_fwd -> (out (Tq, Hq, Dv) q.dtype, lse)``: ``lse`` is ``(Hq, Tq)`` float32
  (float64 for float64 inputs) when ``return_lse`` or ``grad`` (the caller or a backward reads it), else an
  empty ``(0,)``.
* ``packattn::varlen_attention_bwd -> (dq, dk, dv)``, contiguous, in the inputs' shapes and dtype.

The ops take the offsets as tensors and, optionally, as host lists of (Sym)ints; everything that needs the
offsets' values (reading them, checking them, choosing the backend) happens when an op runs, with the same
messages as the eager checks in :func:`packattn.varlen_attention`, which keeps the traced graph free of
data-dependent guards. The backward op computes the gradients by the route that dispatch resolves for the
forward's backend (:func:`packattn.dispatch.backward`).
"""

from collections.abc import Sequence
from dataclasses import replace

import torch

from . import dispatch
from .inputs import AttentionInputs, MaskSpec, compute_dtype
from .layout import SeqLayout

__all__ = ["varlen_attention_bwd", "varlen_attention_fwd"]

WHERE = "varlen_attention"


def _inputs(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_q: torch.Tensor,
    cu_k: torch.Tensor,
    host_q: Sequence[int] | None,
    host_k: Sequence[int] | None,
    mask: MaskSpec,
    return_lse: bool,
    grad: bool,
    deterministic: bool,
) -> AttentionInputs:
    """The validated inputs (the value checks that tracing skipped run here)."""
    layout = SeqLayout.build(
        cu_q, cu_k, q.shape[0], k.shape[0], cu_seqlens_q_host=host_q, cu_seqlens_k_host=host_k, where=WHERE
    )
    return AttentionInputs(q, k, v, layout, mask, return_lse, grad, deterministic)


@torch.library.custom_op("packattn::varlen_attention_fwd", mutates_args=())
def varlen_attention_fwd(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_q: torch.Tensor,
    cu_k: torch.Tensor,
    host_q: Sequence[int] | None,
    host_k: Sequence[int] | None,
    scale: float,
    left: int,
    right: int,
    softcap: float,
    return_lse: bool,
    grad: bool,
    deterministic: bool,
    backend: str | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Dispatch (``backend`` as in ``varlen_attention``) and run the forward; see the module docstring."""
    mask = MaskSpec(scale, left, right, softcap)
    inp = _inputs(q, k, v, cu_q, cu_k, host_q, host_k, mask, return_lse, grad, deterministic)
    chosen = dispatch.select(inp, backend, WHERE)
    if grad and not dispatch.uses_autograd(chosen, inp):
        inp = replace(inp, return_lse=True)  # the backward reads the LSE
    out, lse = chosen.forward(inp)
    if not (return_lse or grad):
        return out, _empty_lse(q, (0,))
    if lse is None:  # gradients by autograd, from a backend without LSE: nobody reads this one
        return out, torch.full(_lse_shape(q), float("nan"), dtype=compute_dtype(q.dtype), device=q.device)
    return out, lse


def _lse_shape(q: torch.Tensor) -> tuple[int, int]:
    return (q.shape[1], q.shape[0])


def _empty_lse(q: torch.Tensor, shape: Sequence[int]) -> torch.Tensor:
    return q.new_empty(shape, dtype=compute_dtype(q.dtype))


@varlen_attention_fwd.register_fake
def _fwd_fake(
    q, k, v, cu_q, cu_k, host_q, host_k, scale, left, right, softcap, return_lse, grad, deterministic, backend
):
    out = q.new_empty(q.shape[0], q.shape[1], v.shape[2])
    return out, _empty_lse(q, _lse_shape(q) if return_lse or grad else (0,))


@torch.library.custom_op("packattn::varlen_attention_bwd", mutates_args=())
def varlen_attention_bwd(
    dout: torch.Tensor,
    dlse: torch.Tensor | None,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    cu_q: torch.Tensor,
    cu_k: torch.Tensor,
    host_q: Sequence[int] | None,
    host_k: Sequence[int] | None,
    scale: float,
    left: int,
    right: int,
    softcap: float,
    return_lse: bool,
    deterministic: bool,
    backend: str | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients of ``q, k, v`` by the route of the backend the forward chose; ``dlse`` is None when no LSE
    was returned."""
    mask = MaskSpec(scale, left, right, softcap)
    inp = _inputs(q, k, v, cu_q, cu_k, host_q, host_k, mask, return_lse, True, deterministic)
    chosen = dispatch.select(inp, backend, WHERE)  # the forward's choice: same inputs, same answer
    gradients = dispatch.backward(chosen, inp, lse_grad=dlse is not None, where=WHERE)
    dq, dk, dv = gradients(replace(inp, return_lse=True), out, lse, dout.contiguous(), dlse)
    return dq.contiguous(), dk.contiguous(), dv.contiguous()


@varlen_attention_bwd.register_fake
def _bwd_fake(dout, dlse, q, k, v, out, lse, cu_q, cu_k, host_q, host_k, scale, left, right, softcap, rl, det, backend):
    return tuple(torch.empty(t.shape, dtype=t.dtype, device=t.device) for t in (q, k, v))


def _no_double_backward(ctx, *grads: torch.Tensor) -> None:
    raise NotImplementedError("varlen_attention: gradients of gradients (double backward) are not supported")


varlen_attention_bwd.register_autograd(_no_double_backward, setup_context=lambda ctx, inputs, output: None)


def _setup_context(ctx, inputs, output) -> None:
    q, k, v, cu_q, cu_k, host_q, host_k, scale, left, right, softcap, return_lse, _, deterministic, backend = inputs
    ctx.save_for_backward(q, k, v, output[0], output[1], cu_q, cu_k)  # autograd catches later in-place edits
    ctx.options = (host_q, host_k, scale, left, right, softcap, return_lse, deterministic, backend)
    # A gradient that no loss reaches stays None instead of zeros: an LSE nobody differentiates then lets the
    # backward take a route without LSE gradient (the wrapped library's own), with no device sync to find out.
    ctx.set_materialize_grads(False)


def _backward(ctx, dout: torch.Tensor | None, dlse: torch.Tensor | None) -> tuple[torch.Tensor | None, ...]:
    q, k, v, out, lse, cu_q, cu_k = ctx.saved_tensors
    return_lse = ctx.options[6]
    dlse = dlse if return_lse else None  # without return_lse the caller never saw the LSE
    if dout is None:  # only the LSE reaches the loss
        dout = torch.zeros_like(out)
    dq, dk, dv = varlen_attention_bwd(dout, dlse, q, k, v, out, lse, cu_q, cu_k, *ctx.options)
    return (dq, dk, dv) + (None,) * 12


varlen_attention_fwd.register_autograd(_backward, setup_context=_setup_context)
