"""packattn as the attention of diffusers' Flux-style joint text+image blocks.

``model.set_attn_processor(PackedJointAttnProcessor())`` replaces the attention of every ``FluxAttention``
module of a ``FluxTransformer2DModel`` (its dual-stream blocks, which attend the text tokens concatenated in
front of the image tokens, and its single-stream blocks, which get that sequence already concatenated).
Everything else the default ``FluxAttnProcessor`` does (projections, fused projections, Q/K RMS norms,
rotary embeddings, output projections) is unchanged.

Prompts of different lengths are padded to one text length. Give the processor a key-padding mask over the
joint sequence ``[text, image]`` through ``joint_attention_kwargs={"attention_mask": mask}``:

    mask: (B, S) bool, or the (B, 1, 1, S) broadcastable form the default processor accepts; S = text + image
          tokens, True = a real token. E.g. ``torch.cat([text_mask, text_mask.new_ones(B, image_tokens)], 1)``.

Each sample's real tokens (its prompt and its image) then become one sequence of a packed batch: no padding
is attended and none is computed. The outputs at padding positions are 0. Without a mask every sample is one
sequence, its offsets taken from the shapes (no device sync).
"""

from __future__ import annotations

from typing import Any

import torch

from ..errors import InputTypeError
from ._packing import Rows, attend_padded, attend_rows, marked_rows, memo

__all__ = ["PackedJointAttnProcessor"]

_WHERE = "PackedJointAttnProcessor"


class PackedJointAttnProcessor:
    """Attention processor for diffusers' ``FluxAttention`` that attends through :func:`packattn.varlen_attention`
    (see the module docstring for the mask). ``backend`` picks a packattn backend (None: dispatch chooses)."""

    def __init__(self, *, backend: str | None = None) -> None:
        self.backend = backend

    def __call__(
        self,
        attn: Any,
        hidden_states: torch.Tensor,
        encoder_hidden_states: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        image_rotary_emb: Any = None,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        from diffusers.models.embeddings import apply_rotary_emb

        rope: Any = apply_rotary_emb  # annotated as returning a pair; it returns one tensor

        q, k, v = _project(attn, hidden_states, _IMAGE)
        q, k = attn.norm_q(q), attn.norm_k(k)
        if encoder_hidden_states is not None and attn.added_kv_proj_dim is not None:
            eq, ek, ev = _project(attn, encoder_hidden_states, _TEXT)
            q = torch.cat([attn.norm_added_q(eq), q], dim=1)  # (B, S, H, D), text first
            k = torch.cat([attn.norm_added_k(ek), k], dim=1)
            v = torch.cat([ev, v], dim=1)
        if image_rotary_emb is not None:
            q = rope(q, image_rotary_emb, sequence_dim=1)
            k = rope(k, image_rotary_emb, sequence_dim=1)
        if attention_mask is None:
            out = attend_rows(q, k, v, backend=self.backend)
        else:
            _check_mask(attention_mask, q.shape[0], q.shape[1])
            rows = memo(_mask_rows, attention_mask)
            out = attend_padded(q, k, v, rows, rows, backend=self.backend)
        out = out.flatten(2, 3).to(q.dtype)
        if encoder_hidden_states is None:
            return out
        text, image = out.split_with_sizes([encoder_hidden_states.shape[1], hidden_states.shape[1]], dim=1)
        image = attn.to_out[1](attn.to_out[0](image.contiguous()))
        return image, attn.to_add_out(text.contiguous())


_IMAGE = ("to_qkv", "to_q", "to_k", "to_v")  # the projections' names: fused, then separate
_TEXT = ("to_added_qkv", "add_q_proj", "add_k_proj", "add_v_proj")


def _project(attn: Any, x: torch.Tensor, names: tuple[str, ...]) -> list[torch.Tensor]:
    """Q, K, V of ``x`` as ``(B, L, H, D)``, from the fused or the separate projections."""
    if attn.fused_projections:
        qkv = getattr(attn, names[0])(x).chunk(3, dim=-1)
    else:
        qkv = tuple(getattr(attn, name)(x) for name in names[1:])
    return [t.unflatten(-1, (-1, attn.head_dim)) for t in qkv]


def _mask_rows(mask: torch.Tensor) -> Rows:
    return marked_rows(mask.reshape(mask.shape[0], -1))


def _check_mask(mask: object, batch: int, length: int) -> None:
    """A ``(B, S)`` or ``(B, 1, 1, S)`` boolean key-padding mask."""
    if not isinstance(mask, torch.Tensor):
        raise InputTypeError(f"{_WHERE}: attention_mask must be a torch.Tensor or None, got {type(mask).__name__}")
    if mask.dtype != torch.bool:
        raise InputTypeError(
            f"{_WHERE}: attention_mask must be a boolean key-padding mask (True = real token), got {mask.dtype}"
        )
    if tuple(mask.shape) not in ((batch, length), (batch, 1, 1, length)):
        raise ValueError(
            f"{_WHERE}: attention_mask must have shape (batch, text + image tokens) = {(batch, length)} or "
            f"{(batch, 1, 1, length)}, a key-padding mask over the joint sequence, got {tuple(mask.shape)}"
        )
