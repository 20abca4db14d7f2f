"""packattn as a Hugging Face transformers attention implementation.

After :func:`register`, ``AutoModel*.from_config(cfg, attn_implementation="packattn")`` (or
``from_pretrained(..., attn_implementation="packattn")``) runs every attention layer through
:func:`packattn.varlen_attention`, on any device. Each call turns HF's ``(batch, heads, seq, head_dim)``
tensors into a packed batch, chosen in this order:

1. ``cu_seq_lens_q``/``cu_seq_lens_k`` keyword arguments (``DataCollatorWithFlattening(return_flash_attn_kwargs=
   True)``): batch 1, the sequences are read from the offsets.
2. A 2-D padding mask ``(batch, kv_len)`` (1 = token): the valid tokens of each row form one sequence; the
   output rows of padding are 0. With ``q_len < kv_len`` (decoding with a cache) the queries are the last
   ``q_len`` positions of each row, as in flash-attention's varlen path.
3. Batch 1 with ``position_ids`` restarting (``DataCollatorWithFlattening``): a new sequence starts wherever a
   position is not the previous one + 1 (transformers' own rule for packed masks). Reading the positions
   costs one device sync per forward (the offsets are reused by every layer while the tensor is unchanged).
4. Otherwise every row is one sequence and the offsets come from the shapes alone: no device sync.

Masking follows the module: ``is_causal`` (keyword or ``module.is_causal``) is bottom-right causal, so
decoding with a cache sees the whole prefix; ``sliding_window=W`` keeps the ``W`` most recent keys,
the token itself included (window ``(W - 1, 0)``), and ``|i - j| <= W`` for bidirectional layers, as
transformers' eager masks do; ``softcap`` and ``scaling`` are passed on. GQA runs without repeating K/V.
Attention dropout and attention sinks (``s_aux``) are not supported and raise ``ValueError``; a 4-D mask
(a custom mask or one built for another implementation) raises ``TypeError``.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch

from ..api import varlen_attention

__all__ = ["NAME", "attention_forward", "mask_forward", "register"]

NAME = "packattn"
_WHERE = "packattn transformers attention"


def register(name: str = NAME) -> None:
    """Register packattn with transformers under ``name`` (attention function and its 2-D mask builder).

    Registration is global and idempotent; choose it per model with ``attn_implementation=name``.
    """
    from transformers import AttentionInterface, AttentionMaskInterface

    AttentionInterface.register(name, attention_forward)
    AttentionMaskInterface.register(name, mask_forward)


def mask_forward(
    batch_size: int,
    q_length: int,
    kv_length: int,
    q_offset: int = 0,
    kv_offset: int = 0,
    mask_function: Any = None,
    attention_mask: torch.Tensor | None = None,
    **kwargs: Any,
) -> torch.Tensor | None:
    """The mask transformers hands to :func:`attention_forward`: the 2-D padding mask ``(batch, kv_len)``
    as booleans, or None when nothing is padded. Causality, windows and packing are applied by packattn."""
    if attention_mask is None:
        return None
    attention_mask = attention_mask[:, -kv_length:].bool()
    if attention_mask.shape[1] == kv_length and not torch.compiler.is_compiling() and bool(attention_mask.all()):
        return None  # every token is real: the shape-only path, with no sync in the layers
    return attention_mask


def attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    sliding_window: int | None = None,
    softcap: float | None = None,
    is_causal: bool | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """Attention of one HF layer: ``query (B, Hq, Lq, D)``, ``key (B, Hkv, Lk, D)``, ``value (B, Hkv, Lk, Dv)``
    -> ``(out (B, Lq, Hq, Dv), None)``. See the module docstring for how the packed batch is formed."""
    if dropout:
        raise ValueError(
            f"{_WHERE}: attention dropout is not supported, got dropout={dropout} (module {type(module).__name__} "
            "in training mode); set the config's attention dropout to 0.0"
        )
    if kwargs.get("s_aux") is not None:
        raise ValueError(f"{_WHERE}: attention sinks (s_aux) are not supported; use another attn_implementation")
    causal = bool(getattr(module, "is_causal", True) if is_causal is None else is_causal)
    left = right = -1
    if sliding_window is not None and sliding_window > 0:  # HF's window counts the token itself
        left, right = (sliding_window - 1, -1) if causal else (sliding_window, sliding_window)
    options: dict[str, Any] = {
        "softmax_scale": scaling,
        "causal": causal,
        "window_size": (left, right),
        "softcap": float(softcap or 0.0),
    }
    batch, lq, lk = query.shape[0], query.shape[2], key.shape[2]
    q, k, v = (t.transpose(1, 2) for t in (query, key, value))  # (B, L, H, D) views
    cu_q, cu_k = kwargs.get("cu_seq_lens_q"), kwargs.get("cu_seq_lens_k")
    if cu_q is not None and cu_k is not None:
        return _packed(q, k, v, (cu_q, _memo(cu_q, 0, _host)), (cu_k, _memo(cu_k, 0, _host)), options), None
    if attention_mask is not None:
        return _padded(q, k, v, _padding_mask(attention_mask, batch, lk), options), None
    position_ids = kwargs.get("position_ids")
    if batch == 1 and lq == lk > 1 and isinstance(position_ids, torch.Tensor):
        cu = _memo(position_ids, lq, _offsets_from_positions)
        if cu is not None:
            return _packed(q, k, v, cu, cu, options), None
    # Every row is one sequence: offsets from the shapes only (no device sync, compiles without breaks).
    out = varlen_attention(
        q.reshape(batch * lq, *q.shape[2:]),
        k.reshape(batch * lk, *k.shape[2:]),
        v.reshape(batch * lk, *v.shape[2:]),
        _arange_offsets(batch, lq, query.device),
        _arange_offsets(batch, lk, query.device),
        cu_seqlens_q_host=[lq * b for b in range(batch + 1)],
        cu_seqlens_k_host=[lk * b for b in range(batch + 1)],
        **options,
    )
    return out.view(batch, lq, *out.shape[1:]), None


Offsets = tuple[torch.Tensor, list[int]]  # device offsets and the same as Python ints


def _packed(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_q: Offsets, cu_k: Offsets, options: Any) -> Any:
    if q.shape[0] != 1:
        raise ValueError(
            f"{_WHERE}: a packed batch (cu_seq_lens_q/k or restarting position_ids) must have batch size 1, "
            f"got {q.shape[0]}"
        )
    out = varlen_attention(
        q[0], k[0], v[0], cu_q[0], cu_k[0], cu_seqlens_q_host=cu_q[1], cu_seqlens_k_host=cu_k[1], **options
    )
    return out.unsqueeze(0)


def _padded(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, options: Any) -> torch.Tensor:
    """Unpads the rows of ``mask`` into a packed batch, attends, and scatters back (padding rows are 0)."""
    batch, lq, lk = q.shape[0], q.shape[1], k.shape[1]
    (idx_q, cu_q), (idx_k, cu_k) = _memo(mask, lq, _unpad)
    out = varlen_attention(
        q.reshape(batch * lq, *q.shape[2:]).index_select(0, idx_q),
        k.reshape(batch * lk, *k.shape[2:]).index_select(0, idx_k),
        v.reshape(batch * lk, *v.shape[2:]).index_select(0, idx_k),
        cu_q[0],
        cu_k[0],
        cu_seqlens_q_host=cu_q[1],
        cu_seqlens_k_host=cu_k[1],
        **options,
    )
    full = out.new_zeros(batch * lq, *out.shape[1:]).index_copy(0, idx_q, out)
    return full.view(batch, lq, *out.shape[1:])


def _padding_mask(mask: object, batch: int, lk: int) -> torch.Tensor:
    if not isinstance(mask, torch.Tensor) or mask.dim() != 2:
        shape = tuple(mask.shape) if isinstance(mask, torch.Tensor) else type(mask).__name__
        raise TypeError(
            f"{_WHERE}: attention_mask must be a 2-D padding mask (batch, kv_len) as built by packattn's mask "
            f"function, got {shape}; pass a 2-D mask of 1s (tokens) and 0s (padding), not a custom 4-D mask"
        )
    if tuple(mask.shape) != (batch, lk):
        raise ValueError(
            f"{_WHERE}: attention_mask must have shape {(batch, lk)} (batch, kv_len), got {tuple(mask.shape)}"
        )
    return mask.bool()


def _arange_offsets(batch: int, length: int, device: torch.device) -> torch.Tensor:
    if length == 0:
        return torch.zeros(batch + 1, dtype=torch.int32, device=device)
    return torch.arange(0, batch * length + 1, length, dtype=torch.int32, device=device)


def _host(cu: torch.Tensor, _: object) -> list[int]:
    return [int(x) for x in cu.tolist()]


def _offsets(lengths: torch.Tensor) -> Offsets:
    host = [0]
    for n in lengths.tolist():
        host.append(host[-1] + int(n))
    return torch.tensor(host, dtype=torch.int32, device=lengths.device), host


def _unpad(mask: torch.Tensor, lq: int) -> tuple[tuple[torch.Tensor, Offsets], tuple[torch.Tensor, Offsets]]:
    """Row indices and offsets of the real tokens; the queries are the last ``lq`` positions of each row
    (all of them for a single query, as in decoding)."""
    mask_q = mask[:, -lq:] if lq > 1 else torch.ones(mask.shape[0], lq, dtype=torch.bool, device=mask.device)
    rows_q, rows_k = mask_q.reshape(-1).nonzero().reshape(-1), mask.reshape(-1).nonzero().reshape(-1)
    return (rows_q, _offsets(mask_q.sum(1))), (rows_k, _offsets(mask.sum(1)))


def _offsets_from_positions(position_ids: torch.Tensor, length: int) -> Offsets | None:
    """Sequence offsets of a packed row: a sequence starts where a position is not the previous one + 1.
    None when the row holds one sequence (or the positions do not describe the row)."""
    if position_ids.numel() != length:
        return None
    pos = position_ids.reshape(-1)
    starts = (pos[1:] != pos[:-1] + 1).nonzero().reshape(-1) + 1
    if starts.numel() == 0:
        return None
    host = [0, *(int(s) for s in starts.tolist()), length]
    return torch.tensor(host, dtype=torch.int32, device=pos.device), host


_MEMO: list[tuple[Any, int, object, Any]] = []


def _memo(t: torch.Tensor, extra: object, fn: Any) -> Any:
    """``fn(t, extra)``, reused while ``t`` is the same unmodified tensor: every layer of a forward gets the
    same mask / positions / offsets object, so the device is read once per forward, not once per layer."""
    if torch.compiler.is_compiling():
        return fn(t, extra)
    for ref, version, ex, value in _MEMO:
        if ref() is t and version == t._version and ex == extra:
            return value
    value = fn(t, extra)
    _MEMO.insert(0, (weakref.ref(t), t._version, extra, value))
    del _MEMO[8:]
    return value
