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

Sequence parallelism: ``PackedJointAttnProcessor(parallel=SequenceParallel.build(batch, image_tokens,
mesh=mesh))`` on every rank, where each rank runs the model on its share of every image's tokens
(``sp.shard(latents)``, ``img_ids=sp.shard(img_ids, dim=0)``) and the whole prompt. The image tokens
attend through ring and/or Ulysses attention on the mesh (:func:`packattn.distributed.joint_varlen_attention`),
the text tokens, which every rank holds whole, never travel; each rank's image output is its rows of the
single-process result (``sp.gather(out)`` puts them together). A mask then covers ``[text, local image]``
(the image tokens are all real). In training, gradients of weights summed over the ranks (an all-reduce,
as for data parallelism) are the single-process gradients.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from ..distributed import ShardPlan, joint_varlen_attention
from ..distributed.mesh import mesh_dimensions
from ..errors import InputTypeError
from ._packing import Rows, attend_padded, attend_rows, marked_rows, memo

__all__ = ["PackedJointAttnProcessor", "SequenceParallel"]

_WHERE = "PackedJointAttnProcessor"


@dataclass(frozen=True)
class SequenceParallel:
    """Every image's tokens sharded over the ranks of a ``ring x ulysses`` mesh (see the module docstring).

    ``plan`` describes the batch as ``batch`` sequences of ``image_tokens`` image tokens each; build it
    with :meth:`build`. ``mesh`` / ``ulysses_group`` / ``ring_group`` are those of
    :func:`packattn.distributed.usp_varlen_attention`.
    """

    plan: ShardPlan
    mesh: Any = None
    ulysses_group: Any = None
    ring_group: Any = None

    @staticmethod
    def build(
        batch: int,
        image_tokens: int,
        *,
        mesh: Any = None,
        ulysses_group: Any = None,
        ring_group: Any = None,
        balance: str = "zigzag",
    ) -> SequenceParallel:
        """The plan of this rank for ``batch`` images of ``image_tokens`` tokens. ``"zigzag"`` and
        ``"contiguous"`` hold the same work here (no causal mask); contiguous keeps each rank's tokens
        one run."""
        where = "SequenceParallel.build"
        for name, value in (("batch", batch), ("image_tokens", image_tokens)):
            if isinstance(value, bool) or not isinstance(value, int):
                raise InputTypeError(f"{where}: {name} must be an int, got {type(value).__name__}")
            if value < 1:
                raise ValueError(f"{where}: {name} must be >= 1, got {value}")
        uly, ring = mesh_dimensions(mesh, ulysses_group, ring_group, where)
        cu = [image_tokens * b for b in range(batch + 1)]
        plan = ShardPlan.build(
            cu,
            cu,
            world_size=uly.size * ring.size,
            rank=ring.rank * uly.size + uly.rank,
            balance=balance,  # type: ignore[arg-type]
            ulysses_degree=uly.size,
        )
        return SequenceParallel(plan, mesh, ulysses_group, ring_group)

    @property
    def local_tokens(self) -> int:
        """Image tokens of each image on this rank."""
        return self.plan.cu_seqlens_q_host[1]

    def shard(self, x: torch.Tensor, dim: int = 1) -> torch.Tensor:
        """This rank's image tokens of ``x`` along ``dim``: ``(B, image_tokens, C)`` latents, or the
        ``(image_tokens, 3)`` ids with ``dim=0``."""
        tokens = self.plan.global_cu_seqlens_q[1]
        if not isinstance(x, torch.Tensor) or not -x.dim() <= dim < x.dim() or x.shape[dim] != tokens:
            got = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
            raise ValueError(
                f"SequenceParallel.shard: x must have the {tokens} image tokens along dim {dim}, got {got}"
            )
        positions = self.plan.positions()[: self.local_tokens].to(x.device)
        return x.index_select(dim, positions)

    def gather(self, x_local: torch.Tensor, *, group: Any = None) -> torch.Tensor:
        """Every rank's ``(B, local_tokens, ...)`` into ``(B, image_tokens, ...)``: collective over ``group``,
        whose ranks must be the plan's ranks in order (None: the default group, as for a mesh over the
        whole world)."""
        batch = self.plan.batch
        whole = self.plan.unshard_q(x_local.flatten(0, 1), group=group)
        return whole.view(batch, -1, *whole.shape[1:])


class PackedJointAttnProcessor:
    """Attention processor for diffusers' ``FluxAttention`` that attends through :func:`packattn.varlen_attention`
    (see the module docstring for the mask). ``backend`` picks a packattn backend (None: dispatch chooses);
    ``parallel`` shards the image tokens over ranks (:class:`SequenceParallel`)."""

    def __init__(self, *, backend: str | None = None, parallel: SequenceParallel | None = None) -> None:
        if parallel is not None and not isinstance(parallel, SequenceParallel):
            raise InputTypeError(
                f"{_WHERE}: parallel must be a SequenceParallel or None, got {type(parallel).__name__}"
            )
        self.backend = backend
        self.parallel = parallel

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
        if self.parallel is not None:
            # Dual-stream blocks see the image tokens alone, single-stream ones [text, image] already joined.
            image_len = hidden_states.shape[1] if encoder_hidden_states is not None else self.parallel.local_tokens
            out = _attend_parallel(q, k, v, image_len, attention_mask, self.parallel, self.backend)
        elif attention_mask is None:
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


def _attend_parallel(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    image_len: int,
    mask: torch.Tensor | None,
    sp: SequenceParallel,
    backend: str | None,
) -> torch.Tensor:
    """``(B, text + local image, H, D)``: the image tokens through the mesh, the text tokens as joint tokens."""
    batch, text_len = q.shape[0], q.shape[1] - image_len
    _check_parallel(sp, batch, q.shape[1], image_len)
    parts = [t.split_with_sizes([text_len, image_len], dim=1) for t in (q, k, v)]
    text_q, text_k, text_v = (text.flatten(0, 1) for text, _ in parts)
    image_q, image_k, image_v = (image.flatten(0, 1) for _, image in parts)
    if mask is None:
        cu_text = [text_len * b for b in range(batch + 1)]
    else:
        _check_mask(mask, batch, q.shape[1])
        rows, cu = memo(_text_rows, mask, text_len)
        text_q, text_k, text_v = (t.index_select(0, rows) for t in (text_q, text_k, text_v))
        cu_text = cu.host
    image_out, text_out = joint_varlen_attention(
        image_q,
        image_k,
        image_v,
        text_q,
        text_k,
        text_v,
        cu_text,
        sp.plan,
        mesh=sp.mesh,
        ulysses_group=sp.ulysses_group,
        ring_group=sp.ring_group,
        backend=backend,
    )
    if mask is not None:
        text_out = text_out.new_zeros(batch * text_len, *text_out.shape[1:]).index_copy(0, rows, text_out)
    return torch.cat([text_out.unflatten(0, (batch, text_len)), image_out.unflatten(0, (batch, image_len))], dim=1)


def _check_parallel(sp: SequenceParallel, batch: int, length: int, image_len: int) -> None:
    plan = sp.plan
    if plan.batch != batch or image_len != sp.local_tokens or length < image_len:
        raise ValueError(
            f"{_WHERE}: parallel's plan is for {plan.batch} images of {plan.global_cu_seqlens_q[1]} tokens, of which "
            f"this rank holds {sp.local_tokens}; got {batch} images of {image_len} tokens ({length} text + image "
            "tokens): shard the latents and img_ids with SequenceParallel.shard"
        )


def _text_rows(mask: torch.Tensor, text_len: int) -> Rows:
    """The real text tokens of a ``[text, local image]`` mask, whose image part must be all True."""
    mask = mask.reshape(mask.shape[0], -1)
    if not bool(mask[:, text_len:].all()):
        raise ValueError(
            f"{_WHERE}: with parallel=, attention_mask may mark text padding only: the image tokens (its last "
            f"{mask.shape[1] - text_len} columns) must all be True"
        )
    return marked_rows(mask[:, :text_len])


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
