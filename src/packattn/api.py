"""Public entry points: validation, dispatch, and the call of the custom ops (see :mod:`packattn.ops`)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal, cast, overload

import torch

from . import dispatch, ops
from .errors import InputTypeError
from .inputs import AttentionInputs, MaskSpec, check_mask, check_tensors, needs_grad
from .layout import SeqLayout, check_traced

__all__ = ["varlen_attention"]


@overload
def varlen_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    *,
    cu_seqlens_q_host: Sequence[int] | None = ...,
    cu_seqlens_k_host: Sequence[int] | None = ...,
    softmax_scale: float | None = ...,
    causal: bool = ...,
    window_size: tuple[int, int] = ...,
    softcap: float = ...,
    return_lse: Literal[False] = ...,
    backend: str | None = ...,
) -> torch.Tensor: ...


@overload
def varlen_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    *,
    cu_seqlens_q_host: Sequence[int] | None = ...,
    cu_seqlens_k_host: Sequence[int] | None = ...,
    softmax_scale: float | None = ...,
    causal: bool = ...,
    window_size: tuple[int, int] = ...,
    softcap: float = ...,
    return_lse: Literal[True],
    backend: str | None = ...,
) -> tuple[torch.Tensor, torch.Tensor]: ...


def varlen_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    *,
    cu_seqlens_q_host: Sequence[int] | None = None,
    cu_seqlens_k_host: Sequence[int] | None = None,
    softmax_scale: float | None = None,
    causal: bool = False,
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    return_lse: bool = False,
    backend: str | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Exact attention over a packed batch of variable-length sequences.

    Shapes (B sequences, ``Tq``/``Tk`` packed query/key tokens)::

        q  (Tq, Hq, D)      k  (Tk, Hkv, D)      v  (Tk, Hkv, Dv)      Hq % Hkv == 0
        cu_seqlens_q, cu_seqlens_k  (B + 1,) int32/int64, 0 = cu[0] <= cu[1] <= ... <= cu[B] = T
        out (Tq, Hq, Dv) in q.dtype      lse (Hq, Tq) float32 (float64 for float64 inputs)

    Sequence ``b`` pairs query rows ``cu_seqlens_q[b]:cu_seqlens_q[b+1]`` with key rows
    ``cu_seqlens_k[b]:cu_seqlens_k[b+1]``; query head ``h`` reads key/value head ``h // (Hq // Hkv)``.
    Either side of a sequence may be empty.

    Masking (flash-attn's conventions). Query ``i`` of a sequence with ``Lq`` queries and ``Lk`` keys sees
    key ``j`` iff ``i + Lk - Lq - left <= j <= i + Lk - Lq + right`` with ``window_size=(left, right)``
    (``-1`` is unbounded). ``causal=True`` is ``right = 0``, aligned to the bottom-right corner::

        causal, Lq=2, Lk=5        causal, Lq=5, Lk=2        window (1, 0), Lq=Lk=4
            1 1 1 1 0                 0 0                       1 0 0 0
            1 1 1 1 1                 0 0                       1 1 0 0
                                      0 0                       0 1 1 0
                                      1 0                       0 0 1 1
                                      1 1

    A query row that sees no key has output 0 and LSE ``-inf`` (never NaN).

    Args:
        q, k, v: packed tensors, any strides; fp32, fp16, bf16 or fp64. They are never modified.
        cu_seqlens_q, cu_seqlens_k: prefix sums of the sequence lengths, on any device.
        cu_seqlens_q_host, cu_seqlens_k_host: optional copies as Python ints. When given they are trusted,
            so the call never waits on the device; otherwise the offsets are read once.
        softmax_scale: scale of ``q @ k^T``; ``None`` means ``D ** -0.5``.
        causal: bottom-right causal mask (see above).
        window_size: ``(left, right)`` sliding window, inclusive; ``-1`` is unbounded.
        softcap: if ``> 0``, scores become ``softcap * tanh(score / softcap)`` before masking.
        return_lse: also return the natural-log log-sum-exp of the scores of each query row.
        backend: run exactly this backend (see :func:`packattn.info`) or raise, listing why it cannot.

    Returns:
        ``out``, or ``(out, lse)`` with ``return_lse=True``.

    Equivalent PyTorch code (one sequence, ``Hq == Hkv``, float64)::

        s = softmax_scale * torch.einsum("ihd,jhd->hij", q_b, k_b)
        if softcap > 0:
            s = softcap * torch.tanh(s / softcap)
        s = s.masked_fill(~visible, -inf)                     # visible[i, j] from the rule above
        lse_b = torch.logsumexp(s, dim=-1)                    # (H, Lq)
        out_b = torch.einsum("hij,jhd->ihd", torch.exp(s - lse_b[..., None]).nan_to_num(0.0), v_b)

    Example (the second sequence has 0 queries and 8 keys):
        >>> import torch, packattn
        >>> cu_q = torch.tensor([0, 5, 5, 12]); cu_k = torch.tensor([0, 9, 17, 25])
        >>> q = torch.randn(12, 4, 64); k = torch.randn(25, 2, 64); v = torch.randn(25, 2, 32)
        >>> out, lse = packattn.varlen_attention(q, k, v, cu_q, cu_k, causal=True, return_lse=True)
        >>> tuple(out.shape), tuple(lse.shape)
        ((12, 4, 32), (4, 12))
    """
    return run_attention(
        q,
        k,
        v,
        cu_seqlens_q,
        cu_seqlens_k,
        cu_seqlens_q_host=cu_seqlens_q_host,
        cu_seqlens_k_host=cu_seqlens_k_host,
        softmax_scale=softmax_scale,
        causal=causal,
        window_size=window_size,
        softcap=softcap,
        return_lse=return_lse,
        backend=backend,
        where="varlen_attention",
    )


def run_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    *,
    cu_seqlens_q_host: Sequence[int] | None,
    cu_seqlens_k_host: Sequence[int] | None,
    softmax_scale: float | None,
    causal: bool,
    window_size: tuple[int, int],
    softcap: float,
    return_lse: bool,
    backend: str | None,
    where: str,
    deterministic: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """:func:`varlen_attention`, with eager error messages that start with ``where`` (the compat layer's names;
    checks that run inside the op under ``torch.compile`` name ``varlen_attention``). ``deterministic``: the
    gradients must be the same bits run to run (dispatch takes only backends whose backward route is)."""
    mask = check_call(
        q, k, v, softmax_scale=softmax_scale, causal=causal, window_size=window_size, softcap=softcap,
        return_lse=return_lse, backend=backend, where=where,
    )  # fmt: skip
    grad = needs_grad(q, k, v)
    if torch.compiler.is_compiling():
        # Traced: no offset values here (they would become guards); the op checks them and dispatches.
        host_q, host_k = check_traced(cu_seqlens_q, cu_seqlens_k, cu_seqlens_q_host, cu_seqlens_k_host, where)
        name = backend
    else:
        layout = SeqLayout.build(
            cu_seqlens_q,
            cu_seqlens_k,
            q.shape[0],
            k.shape[0],
            cu_seqlens_q_host=cu_seqlens_q_host,
            cu_seqlens_k_host=cu_seqlens_k_host,
            where=where,
        )
        inp = AttentionInputs(q, k, v, layout, mask, return_lse, grad, deterministic)
        chosen = dispatch.select(inp, backend, where)
        if not grad or dispatch.uses_autograd(chosen, inp):
            # No autograd at all, or PyTorch's through the backend's forward: no op in between (its dispatch
            # has a cost per call). The op carries gradients otherwise, and runs every call under torch.compile.
            out, lse = chosen.forward(inp)
            return (out, cast(torch.Tensor, lse)) if return_lse else out  # with return_lse, never None
        host_q, host_k, name = list(layout.host_q), list(layout.host_k), chosen.name
        # Offsets on the meta device hold no values; the op gets the trusted host copies as tensors.
        cu_seqlens_q, cu_seqlens_k = (
            _valued(cu, h, q.device) for cu, h in ((layout.cu_q, host_q), (layout.cu_k, host_k))
        )
    out, lse = ops.varlen_attention_fwd(
        q, k, v, cu_seqlens_q, cu_seqlens_k, host_q, host_k, mask.scale, mask.left, mask.right, mask.softcap,
        return_lse, grad, deterministic, name,
    )  # fmt: skip
    return (out, lse) if return_lse else out


def check_call(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    softmax_scale: float | None,
    causal: bool,
    window_size: tuple[int, int],
    softcap: float,
    return_lse: bool,
    backend: str | None,
    where: str,
) -> MaskSpec:
    """The checks every attention entry point makes of its tensors and options (offsets aside)."""
    check_tensors(q, k, v, where)
    mask = check_mask(
        q, softmax_scale=softmax_scale, causal=causal, window_size=window_size, softcap=softcap, where=where
    )
    if not isinstance(return_lse, bool):
        raise InputTypeError(f"{where}: return_lse must be a bool, got {type(return_lse).__name__}")
    dispatch.check_backend_name(backend, where)
    return mask


def _valued(cu: torch.Tensor, host: list[int], device: torch.device) -> torch.Tensor:
    return torch.tensor(host, dtype=cu.dtype, device=device) if cu.device.type == "meta" else cu
