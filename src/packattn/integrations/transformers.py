"""packattn as a Hugging Face transformers attention implementation.

After :func:`register`, ``AutoModel*.from_config(cfg, attn_implementation="packattn")`` (or
``from_pretrained(..., attn_implementation="packattn")``) runs every attention layer through
:func:`packattn.varlen_attention`, on any device. Each call turns HF's ``(batch, heads, seq, head_dim)``
tensors into a packed batch, chosen in this order:

1. ``cu_seq_lens_q``/``cu_seq_lens_k`` keyword arguments (``DataCollatorWithFlattening(return_flash_attn_kwargs=
   True)``): batch 1, one sequence per offset pair.
2. A 2-D padding mask ``(batch, kv_len)`` (1 = token). In a causal layer the real tokens of each row form one
   sequence and the output rows of padding are 0 (eager's depend on its masking: with left padding and labels
   on the first real token, a loss counts the last padding row's logits, so mask that label too); with
   ``q_len < kv_len`` (decoding with a cache) the queries are the last ``q_len`` positions of each row, as in
   flash-attention's varlen path. In a bidirectional layer without a window (encoders, cross-attention) every
   query attends to its row's real keys, as eager does; with a window, queries are taken as in a causal
   layer. A static cache (``cache_implementation="static"``) hands over all its slots: the mask builder keeps
   only the slots filled so far.
3. Batch 1 with ``position_ids`` restarting (``DataCollatorWithFlattening``): a new sequence starts wherever a
   position is not the previous one + 1 (transformers' own rule for packed masks). As in transformers'
   flash-attention path, this holds with a cache and with an all-ones mask too, where eager and sdpa attend
   across the sequences (they split them only without both).
4. Otherwise every row is one sequence and the offsets come from the shapes alone: no device sync, and the
   model compiles with ``torch.compile(fullgraph=True)`` as far as the chosen packattn backend does.

Cases 1-3 read offsets from the device once per forward (every layer reuses them while the tensor object
is unchanged), so they are not free of syncs or graph breaks.

Masking follows the module: ``is_causal`` (keyword or ``module.is_causal``) is bottom-right causal, so
decoding with a cache sees the whole prefix. The ``sliding_window=W`` a layer passes counts the token
itself: window ``(W - 1, 0)`` for causal layers (the ``W`` most recent keys), ``(W - 1, W - 1)`` for
bidirectional ones (ModernBERT passes its half-window + 1), as transformers' eager masks compute.
``softcap`` and ``scaling`` are passed on; GQA runs without repeating K/V. What packattn cannot compute
exactly raises instead of being ignored: attention dropout, attention sinks (``s_aux``) and an additive
``position_bias`` (T5) raise ``ValueError``; so do masks that no layer argument describes (Llama 4's chunked
attention, bidirectional blocks of image tokens, sequences that transformers finds packed into the rows of a
batch larger than 1: without a cache or a mask), and a sliding window over a padding mask with gaps inside a
row (the window would count packed tokens, not positions). A model's own mask functions are taken to say what
its layers' ``is_causal`` and ``sliding_window`` say; these are checked in eager calls (torch.compile cannot
read them). A 4-D mask (a custom mask, or one built for another implementation) raises ``TypeError``.
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Iterator
from typing import Any

import torch

from ..errors import InputTypeError
from ._packing import Offsets, Rows, attend_offsets, attend_padded, attend_rows, marked_rows, memo

__all__ = ["NAME", "attention_forward", "mask_forward", "register"]

NAME = "packattn"
_WHERE = "packattn transformers attention"


def register(name: str = NAME, *, backend: str | None = None) -> None:
    """Register packattn with transformers under ``name`` (attention function and its 2-D mask builder).

    Registration is global; registering a name again replaces it. Choose it per model with
    ``attn_implementation=name``. ``backend`` runs exactly that packattn backend (None: dispatch chooses).
    """
    from transformers import AttentionInterface, AttentionMaskInterface

    forward = attention_forward if backend is None else functools.partial(attention_forward, backend=backend)
    AttentionInterface.register(name, forward)
    AttentionMaskInterface.register(name, mask_forward)


def mask_forward(
    batch_size: int,
    q_length: int,
    kv_length: int,
    q_offset: int | torch.Tensor = 0,
    kv_offset: int = 0,
    mask_function: Any = None,
    attention_mask: torch.Tensor | None = None,
    **kwargs: Any,
) -> torch.Tensor | None:
    """The mask transformers hands to :func:`attention_forward`: the 2-D padding mask ``(batch, kv_len)``
    as booleans, or None when nothing is padded. Causality, windows and packing are applied by packattn,
    from the layer's arguments and ``position_ids``.

    In a causal layer, keys past the last query's position are left out: a static cache passes all its
    slots, the empty ones past that position. The mask is then narrower than the keys.
    Raises ``ValueError`` for a mask pattern packattn does not compute."""
    factories = set(_mask_factories(mask_function))
    refused = [f"{what} ({name})" for name, what in _REFUSED_MASKS.items() if name in factories]
    if batch_size > 1 and "packed_sequence_mask_function" in factories:
        refused.append("sequences packed into the rows of a batch of more than one (packed_sequence_mask_function)")
    if refused:
        raise ValueError(
            f"{_WHERE}: this model's attention mask has {', '.join(refused)}, which packattn does not compute "
            "(it computes causal, bidirectional and sliding-window attention over padded sequences, or sequences "
            "packed into batch 1); use another attn_implementation for this model"
        )
    if torch.compiler.is_compiling():  # the factories cannot be read: cross-attention's mask is plain
        causal = getattr(mask_function, "__name__", "") != "bidirectional_mask_function"
    else:
        causal = "causal_mask_function" in factories
    filled = kv_length
    if kv_length > q_length and causal:
        # The keys up to the last query's position (a static cache's fill level is a tensor: a device read).
        filled = min(kv_length, int(q_offset) - kv_offset + q_length)
    if attention_mask is None:
        if filled == kv_length:
            return None
        return torch.ones(batch_size, filled, dtype=torch.bool, device=kwargs.get("device"))
    # The keys' columns, as transformers' own masks read them (a narrower mask: padding on the right). A mask
    # as wide as the keys is taken whole: generate may hand over the mask this function built before.
    if attention_mask.shape[1] != kv_length:
        attention_mask = attention_mask[:, kv_offset : kv_offset + kv_length]
    attention_mask = attention_mask[:, :filled].bool()
    if attention_mask.shape[1] == kv_length and not torch.compiler.is_compiling() and bool(attention_mask.all()):
        return None  # every token is real: the shape-only path, with no sync in the layers
    return attention_mask


# Pieces of transformers' mask functions that no argument of the attention layers describes. Any other piece
# (causal, bidirectional, a window, a model's own overlay for them) is what the layer's is_causal and
# sliding_window say, which packattn computes.
_REFUSED_MASKS = {"chunked_overlay": "chunked attention", "blockwise_overlay": "bidirectional blocks of image tokens"}


def _mask_factories(fn: Any, depth: int = 0) -> Iterator[str]:
    """The transformers.masking_utils factories that built ``fn`` and the functions in its closure. While
    compiling, nothing is read: torch.compile cannot trace into closures, and an eager call checks the same."""
    if torch.compiler.is_compiling() or depth > 8 or not callable(fn) or isinstance(fn, torch.Tensor):
        return
    qualname = getattr(fn, "__qualname__", "")
    if getattr(fn, "__module__", None) == "transformers.masking_utils":
        yield qualname.split(".<locals>")[0]
    for cell in getattr(fn, "__closure__", None) or ():
        inner = cell.cell_contents
        for part in inner if isinstance(inner, tuple) else (inner,):
            yield from _mask_factories(part, depth + 1)


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
    *,
    backend: str | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """Attention of one HF layer: ``query (B, Hq, Lq, D)``, ``key (B, Hkv, Lk, D)``, ``value (B, Hkv, Lk, Dv)``
    -> ``(out (B, Lq, Hq, Dv), None)``. See the module docstring for how the packed batch is formed."""
    if dropout:
        raise ValueError(
            f"{_WHERE}: attention dropout is not supported, got dropout={dropout} (module {type(module).__name__} "
            "in training mode); set the config's attention dropout to 0.0"
        )
    if kwargs.get("output_attentions"):
        warnings.warn(f"{_WHERE}: output_attentions=True returns no attention weights (as with sdpa)", stacklevel=2)
    for name, what in (("s_aux", "attention sinks (s_aux)"), ("position_bias", "an additive position_bias")):
        if kwargs.get(name) is not None:
            raise ValueError(f"{_WHERE}: {what} is not supported; use another attn_implementation")
    causal = bool(getattr(module, "is_causal", True) if is_causal is None else is_causal)
    left = right = -1
    windowed = sliding_window is not None and sliding_window > 0
    if windowed:  # HF's window counts the token itself
        left, right = (sliding_window - 1, -1 if causal else sliding_window - 1)  # type: ignore[operator]
    options: dict[str, Any] = {
        "softmax_scale": scaling,
        "causal": causal,
        "window_size": (left, right),
        "softcap": float(softcap or 0.0),
        "backend": backend,
    }
    batch, lq = query.shape[0], query.shape[2]
    q, k, v = (t.transpose(1, 2) for t in (query, key, value))  # (B, L, H, D) views
    cu_q, cu_k = kwargs.get("cu_seq_lens_q"), kwargs.get("cu_seq_lens_k")
    if cu_q is not None and cu_k is not None:
        _check_packed(batch)
        out = attend_offsets(q[0], k[0], v[0], memo(_host, cu_q), memo(_host, cu_k), **options)
        return out.unsqueeze(0), None
    if attention_mask is not None:
        mask = _padding_mask(attention_mask, batch, lq, k.shape[1])
        k, v = k[:, : mask.shape[1]], v[:, : mask.shape[1]]  # a static cache's filled slots
        if windowed and memo(_has_gaps, mask):
            raise ValueError(
                f"{_WHERE}: a sliding window over a padding mask with gaps inside a row is not supported: the "
                "window would count the packed tokens instead of the positions; pad on the left (generate appends "
                "after right padding, which leaves a gap)"
            )
        # Every query attends to its row's real keys in a bidirectional layer without a window (encoders,
        # cross-attention) and in a layer with one query; otherwise the queries are the last lq positions of
        # each row, and those of padding are not computed.
        every_query = lq == 1 or not (causal or windowed)
        rows_q = None if every_query else memo(_query_rows, mask, lq)
        return attend_padded(q, k, v, rows_q, memo(marked_rows, mask), **options), None
    position_ids = kwargs.get("position_ids")
    if batch == 1 and lq == k.shape[1] > 1 and isinstance(position_ids, torch.Tensor):
        cu = memo(_offsets_from_positions, position_ids, lq)
        if cu is not None:
            return attend_offsets(q[0], k[0], v[0], cu, cu, **options).unsqueeze(0), None
    return attend_rows(q, k, v, **options), None  # offsets from the shapes only: no device sync


def _check_packed(batch: int) -> None:
    if batch != 1:
        raise ValueError(f"{_WHERE}: a batch packed with cu_seq_lens_q/k must have batch size 1, got {batch}")


def _padding_mask(mask: object, batch: int, lq: int, lk: int) -> torch.Tensor:
    if not isinstance(mask, torch.Tensor) or mask.dim() != 2:
        shape = tuple(mask.shape) if isinstance(mask, torch.Tensor) else type(mask).__name__
        raise InputTypeError(
            f"{_WHERE}: attention_mask must be a 2-D padding mask (batch, kv_len) as built by packattn's mask "
            f"function, got {shape}; pass a 2-D mask of 1s (tokens) and 0s (padding), not a custom 4-D mask"
        )
    if mask.shape[0] != batch or not min(lq, lk) <= mask.shape[1] <= lk:
        raise ValueError(
            f"{_WHERE}: attention_mask must have shape {(batch, lk)} (batch, kv_len), or fewer columns (the filled "
            f"slots of a static cache, at least {min(lq, lk)}), got {tuple(mask.shape)}"
        )
    return mask.bool()


def _has_gaps(mask: torch.Tensor) -> bool:
    """Whether some row's True entries are not one contiguous run (a device read)."""
    idx = torch.arange(mask.shape[1], device=mask.device)
    first = torch.where(mask, idx, mask.shape[1]).amin(1)
    last = torch.where(mask, idx, -1).amax(1)
    count = mask.sum(1)
    return bool(((count > 0) & (last - first + 1 != count)).any())


def _host(cu: torch.Tensor) -> Offsets:
    return Offsets(cu, [int(x) for x in cu.tolist()])


def _query_rows(mask: torch.Tensor, lq: int) -> Rows:
    if lq > mask.shape[1]:
        raise ValueError(
            f"{_WHERE}: a causal or windowed layer needs its {lq} queries among the mask's positions, but the "
            f"attention_mask has {mask.shape[1]} columns"
        )
    return marked_rows(mask if lq == mask.shape[1] else mask[:, -lq:])


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
    return Offsets(torch.tensor(host, dtype=torch.int32, device=pos.device), host)
