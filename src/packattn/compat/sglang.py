"""sglang's Ascend ``fused_infer_attention_varlen``, on any device and without its refusals.

Same signature, return conventions and checks as the function in sglang's multimodal runtime
(``runtime/layers/attention/backends/ascend_fa.py``), which calls ``torch_npu``'s fused TND kernel: full
(non-causal) attention over a packed batch, GQA allowed, LSE in flash-attn's ``(H, T)`` layout. Differences,
all in the caller's favour:

* any device (the original requires Ascend NPU tensors) and any packattn dtype;
* a sequence empty on only one side works (the original raises ``NotImplementedError``): its query rows
  have output 0 and LSE ``-inf``; a batch with no queries or no keys returns zeros rather than
  uninitialised memory;
* errors are packattn's, each naming the argument, the expected and the received value: a ``ValueError``
  wherever the original raises one (mixed dtypes, a missing or non-integer offsets tensor, ...), as
  ``packattn.InputTypeError`` (a ``TypeError`` and a ``ValueError``) for a wrong type or dtype.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ..api import run_attention
from ..errors import InputTypeError

__all__ = ["fused_infer_attention_varlen"]


def fused_infer_attention_varlen(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    *,
    cu_seqlens_q_host: Sequence[int] | None = None,
    cu_seqlens_k_host: Sequence[int] | None = None,
    softmax_scale: float | None = None,
    return_softmax_lse: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Full attention over a packed batch: :func:`packattn.varlen_attention` without a mask.

    Shapes: ``q (Tq, Hq, D)``, ``k (Tk, Hkv, D)``, ``v (Tk, Hkv, Dv)``, ``cu_seqlens_q/k (B + 1,)``
    int32/int64 prefix sums on any device (``cu_seqlens_*_host``: the same as Python ints, trusted, so the
    offsets are not read from the device). ``softmax_scale=None`` is ``D ** -0.5``.

    Returns ``out (Tq, Hq, Dv)`` in q's dtype, or ``(out, lse)`` with ``return_softmax_lse=True``: ``lse``
    is ``(Hq, Tq)`` float32 (float64 for float64 inputs), natural log, ``-inf`` for rows without keys.

    Example (the second sequence has 0 queries and 8 keys, which the original refuses):
        >>> import torch
        >>> from packattn.compat.sglang import fused_infer_attention_varlen
        >>> cu_q = torch.tensor([0, 5, 5, 12]); cu_k = torch.tensor([0, 9, 17, 25])
        >>> q = torch.randn(12, 4, 64); k = torch.randn(25, 2, 64); v = torch.randn(25, 2, 64)
        >>> out, lse = fused_infer_attention_varlen(q, k, v, cu_q, cu_k, return_softmax_lse=True)
        >>> tuple(out.shape), tuple(lse.shape), lse.dtype
        ((12, 4, 64), (4, 12), torch.float32)
    """
    if not isinstance(return_softmax_lse, bool):
        raise InputTypeError(
            f"fused_infer_attention_varlen: return_softmax_lse must be a bool, got {type(return_softmax_lse).__name__}"
        )
    return run_attention(
        q,
        k,
        v,
        cu_seqlens_q,
        cu_seqlens_k,
        cu_seqlens_q_host=cu_seqlens_q_host,
        cu_seqlens_k_host=cu_seqlens_k_host,
        softmax_scale=softmax_scale,
        causal=False,
        window_size=(-1, -1),
        softcap=0.0,
        return_lse=return_softmax_lse,
        backend=None,
        where="fused_infer_attention_varlen",
    )
