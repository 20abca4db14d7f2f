"""packattn as the attention of diffusers' Flux and Wan transformers, on one process or split over ranks.

``model.set_attn_processor(PackedJointAttnProcessor())`` replaces the attention of every ``FluxAttention``
module of a ``FluxTransformer2DModel`` (its dual-stream blocks, which attend the text tokens concatenated in
front of the image tokens, and its single-stream blocks, which get that sequence already concatenated);
``PackedWanAttnProcessor()`` does the same for the ``WanAttention`` modules of a ``WanTransformer3DModel``
(self-attention over the video tokens, cross-attention to the text, and to the image context of the
image-to-video models). Everything else the default processors do (projections, fused projections, Q/K
RMS norms, rotary embeddings, output projections) is unchanged.

Flux prompts of different lengths are padded to one text length. Give the processor a key-padding mask over
the joint sequence ``[text, image]`` through ``joint_attention_kwargs={"attention_mask": mask}``:

    mask: (B, S) bool, or the (B, 1, 1, S) broadcastable form the default processor accepts; S = text + image
          tokens, True = a real token. E.g. ``torch.cat([text_mask, text_mask.new_ones(B, image_tokens)], 1)``.

Each sample's real tokens (its prompt and its image) then become one sequence of a packed batch: no padding
is attended and none is computed. The outputs at padding positions are 0. Without a mask every sample is one
sequence, its offsets taken from the shapes (no device sync).

Sequence parallelism: every image's (or video's) tokens are split over the ranks of a ``ring x ulysses``
mesh, while the text, which every rank holds whole, never travels. On every rank::

    sp = SequenceParallel.build(batch, image_tokens, mesh=mesh)
    sp.attach(model)  # sets the packattn processors and the hooks that split and gather the tokens
    out = model(...)  # the whole batch in, the single-process output out, on every rank

The tokens are split after the embeddings (and their rotary embeddings with them) and gathered after the
output projection; everything between runs on this rank's share. The image tokens attend through ring
and/or Ulysses attention on the mesh (:func:`packattn.distributed.usp_varlen_attention`, Flux's text as
joint tokens of :func:`packattn.distributed.joint_varlen_attention`); Wan's cross-attention to the text is
local. In training every rank computes the same loss from the gathered output; the gradients of the weights
(and of the model's inputs) summed over the ranks, an all-reduce as for data parallelism, are the
single-process gradients. Flux masks may then mark text padding only.

Without :meth:`SequenceParallel.attach`, ``PackedJointAttnProcessor(parallel=sp)`` runs a Flux model that
is given its share of the image tokens (``sp.shard(latents)``, ``img_ids=sp.shard(img_ids, dim=0)``) and
the whole prompt, and returns this rank's rows of the output (``sp.gather(out)`` puts them together).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from ..dispatch import check_backend_name
from ..distributed import ShardPlan, joint_varlen_attention, usp_varlen_attention
from ..distributed.mesh import mesh_dimensions
from ..errors import InputTypeError
from ._packing import Rows, attend_padded, attend_rows, marked_rows, memo

__all__ = ["PackedJointAttnProcessor", "PackedWanAttnProcessor", "SequenceParallel"]

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

    def attach(self, model: Any, *, group: Any = None, backend: str | None = None) -> Hooks:
        """Split ``model``'s tokens over the mesh (see the module docstring): a ``FluxTransformer2DModel`` or
        a ``WanTransformer3DModel``, built for ``plan.batch`` inputs of ``image_tokens`` tokens after
        patching. Sets the packattn processors (``backend`` as theirs) and the hooks; returns them, and
        their ``remove()`` takes the hooks off (the processors stay). ``group`` is as in :meth:`gather`.

        The output gather's backward keeps this rank's rows of the gradient, without communication, which
        is exact when every rank computes the same loss from the output."""
        from diffusers import FluxTransformer2DModel, WanTransformer3DModel

        def gather(module: Any, args: Any, out: torch.Tensor) -> torch.Tensor:
            return _GatherTokens.apply(out, self, group)

        def tokens(dim: int) -> Callable[[torch.Tensor], torch.Tensor]:
            return lambda x: self.shard(x, dim if dim >= 0 else x.dim() + dim)

        kind = type(model)  # not isinstance: model stays Any for the checker (diffusers' classes are lazy)
        if issubclass(kind, FluxTransformer2DModel):
            model.set_attn_processor(PackedJointAttnProcessor(backend=backend, parallel=self))
            split = {"hidden_states": tokens(1), "img_ids": tokens(-2)}  # img_ids (S, 3), or the old (1, S, 3)
            hooks = [model.register_forward_pre_hook(_replace_arguments(model.forward, split), with_kwargs=True)]
        elif issubclass(kind, WanTransformer3DModel):
            model.set_attn_processor(PackedWanAttnProcessor(backend=backend, parallel=self))
            per_token = {"timestep": lambda t: self.shard(t, 1) if t.dim() == 2 else t}  # Wan 2.2's (B, S)
            first = {"hidden_states": tokens(1)}
            hooks = [
                model.register_forward_pre_hook(_replace_arguments(model.forward, per_token), with_kwargs=True),
                model.rope.register_forward_hook(lambda m, a, freqs: tuple(self.shard(f, 1) for f in freqs)),
                model.blocks[0].register_forward_pre_hook(
                    _replace_arguments(model.blocks[0].forward, first), with_kwargs=True
                ),
            ]
        else:
            raise InputTypeError(
                "SequenceParallel.attach: model must be a diffusers FluxTransformer2DModel or "
                f"WanTransformer3DModel, got {type(model).__name__}"
            )
        return Hooks([*hooks, model.proj_out.register_forward_hook(gather)])


class Hooks:
    """The hooks :meth:`SequenceParallel.attach` registered."""

    def __init__(self, handles: list[Any]) -> None:
        self.handles = handles

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles = []


def _replace_arguments(forward: Any, replace: dict[str, Callable[[Any], Any]]) -> Callable[..., Any]:
    """A forward pre-hook (``with_kwargs=True``) that passes the named arguments through ``replace``."""
    signature = inspect.signature(forward)

    def hook(module: Any, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        bound = signature.bind(*args, **kwargs)
        for name, fn in replace.items():
            if isinstance(bound.arguments.get(name), torch.Tensor):
                bound.arguments[name] = fn(bound.arguments[name])
        return bound.args, bound.kwargs

    return hook


class _GatherTokens(torch.autograd.Function):
    """:meth:`SequenceParallel.gather` whose backward keeps this rank's rows (the loss is the same on every
    rank, so no sum over ranks)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, sp: SequenceParallel, group: Any) -> torch.Tensor:
        ctx.sp = sp
        return sp.gather(x, group=group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        return ctx.sp.shard(grad), None, None


class PackedJointAttnProcessor:
    """Attention processor for diffusers' ``FluxAttention`` that attends through :func:`packattn.varlen_attention`
    (see the module docstring for the mask). ``backend`` picks a packattn backend (None: dispatch chooses);
    ``parallel`` shards the image tokens over ranks (:class:`SequenceParallel`)."""

    def __init__(self, *, backend: str | None = None, parallel: SequenceParallel | None = None) -> None:
        _check_parallel_type(parallel, _WHERE)
        check_backend_name(backend, _WHERE)
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

        _check_module(attn, _WHERE, "FluxAttention", ("head_dim", "added_kv_proj_dim", "norm_q", "norm_k"))
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


class PackedWanAttnProcessor:
    """Attention processor for diffusers' ``WanAttention`` that attends through :func:`packattn.varlen_attention`:
    self-attention over the video tokens (through the mesh with ``parallel``, see :class:`SequenceParallel`)
    and cross-attention to the text and, in image-to-video models, the image context (always local).
    ``backend`` picks a packattn backend (None: dispatch chooses)."""

    def __init__(self, *, backend: str | None = None, parallel: SequenceParallel | None = None) -> None:
        _check_parallel_type(parallel, "PackedWanAttnProcessor")
        check_backend_name(backend, "PackedWanAttnProcessor")
        self.backend = backend
        self.parallel = parallel

    def __call__(
        self,
        attn: Any,
        hidden_states: torch.Tensor,
        encoder_hidden_states: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        rotary_emb: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        _check_module(attn, "PackedWanAttnProcessor", "WanAttention", _WAN_ATTRIBUTES)
        if attention_mask is not None:  # WanTransformerBlock passes none; the default would attend with it
            raise ValueError(
                "PackedWanAttnProcessor: attention_mask must be None (Wan attends every text token), got "
                f"{type(attention_mask).__name__}"
            )
        context = None
        if encoder_hidden_states is not None and attn.add_k_proj is not None:
            # Image-to-video: the image context tokens come first, then Wan's fixed 512 text tokens.
            if encoder_hidden_states.shape[1] < _WAN_TEXT_TOKENS:
                raise ValueError(
                    "PackedWanAttnProcessor: an image-to-video model's encoder_hidden_states must be the image "
                    f"context followed by {_WAN_TEXT_TOKENS} text tokens, got {encoder_hidden_states.shape[1]} tokens"
                )
            context, encoder_hidden_states = encoder_hidden_states.split_with_sizes(
                [encoder_hidden_states.shape[1] - _WAN_TEXT_TOKENS, _WAN_TEXT_TOKENS], dim=1
            )
        heads = (-1, attn.inner_dim // attn.heads)
        if encoder_hidden_states is None:
            qkv = attn.to_qkv(hidden_states).chunk(3, -1) if attn.fused_projections else _linears(attn, hidden_states)
        else:
            q = attn.to_q(hidden_states)
            kv = attn.to_kv(encoder_hidden_states).chunk(2, -1) if attn.fused_projections else None
            qkv = (q, *(kv or (attn.to_k(encoder_hidden_states), attn.to_v(encoder_hidden_states))))
        q, k, v = attn.norm_q(qkv[0]), attn.norm_k(qkv[1]), qkv[2]
        q, k, v = (t.unflatten(-1, heads) for t in (q, k, v))
        if rotary_emb is not None:
            q, k = _wan_rotary(q, *rotary_emb), _wan_rotary(k, *rotary_emb)
        if encoder_hidden_states is None and self.parallel is not None:
            sp = self.parallel
            _check_parallel(sp, q.shape[0], q.shape[1], q.shape[1], "PackedWanAttnProcessor")
            flat = usp_varlen_attention(
                q.flatten(0, 1),
                k.flatten(0, 1),
                v.flatten(0, 1),
                sp.plan,
                mesh=sp.mesh,
                ulysses_group=sp.ulysses_group,
                ring_group=sp.ring_group,
                backend=self.backend,
            )
            out = flat.view(q.shape[0], -1, *flat.shape[1:])
        else:
            out = attend_rows(q, k, v, backend=self.backend)
        out = out.flatten(2, 3).type_as(q)
        if context is not None:
            fused = attn.fused_projections
            ck, cv = attn.to_added_kv(context).chunk(2, -1) if fused else _linears(attn, context, _ADDED)
            ck, cv = attn.norm_added_k(ck).unflatten(-1, heads), cv.unflatten(-1, heads)
            out = out + attend_rows(q, ck, cv, backend=self.backend).flatten(2, 3).type_as(q)
        return attn.to_out[1](attn.to_out[0](out))


_WAN_TEXT_TOKENS = 512  # the text length of Wan's image-to-video models, which diffusers' processor assumes too
_WAN_ATTRIBUTES = ("is_cross_attention", "inner_dim", "heads", "add_k_proj", "norm_q", "norm_k", "to_out")


def _check_module(attn: Any, where: str, kind: str, attributes: tuple[str, ...]) -> None:
    """A clear error for a processor set on an attention module of another kind (it would fail deep inside)."""
    missing = [name for name in attributes if not hasattr(attn, name)]
    if missing:
        raise InputTypeError(
            f"{where}: attn must be a diffusers {kind} (or one of its kind), got {type(attn).__name__}, which has "
            f"no {', '.join(missing)}"
        )


def _wan_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Wan's rotary embedding of ``x (B, S, H, D)``: each pair ``(x[2i], x[2i+1])`` turned by the angle whose
    cosine is ``cos[..., 2i]`` and sine ``sin[..., 2i+1]``; ``cos``/``sin`` are ``(B or 1, S, 1, D)``. Computed
    in the promoted dtype of ``x`` and the tables, as Wan's processor does (float64 stays float64)."""
    even, odd = x.unflatten(-1, (-1, 2)).unbind(-1)
    c, s = cos[..., 0::2], sin[..., 1::2]
    return torch.stack((even * c - odd * s, even * s + odd * c), dim=-1).flatten(-2).type_as(x)


_ADDED = ("add_k_proj", "add_v_proj")


def _linears(attn: Any, x: torch.Tensor, names: tuple[str, ...] = ("to_q", "to_k", "to_v")) -> list[torch.Tensor]:
    return [getattr(attn, name)(x) for name in names]


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
        # Over [text, local image], or [text, image] (the whole image, as the model was given it).
        _check_mask(mask, batch, q.shape[1], text_len + sp.plan.global_cu_seqlens_q[1])
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


def _check_parallel_type(parallel: object, where: str) -> None:
    if parallel is not None and not isinstance(parallel, SequenceParallel):
        raise InputTypeError(f"{where}: parallel must be a SequenceParallel or None, got {type(parallel).__name__}")


def _check_parallel(sp: SequenceParallel, batch: int, length: int, image_len: int, where: str = _WHERE) -> None:
    plan = sp.plan
    if plan.batch != batch:
        raise ValueError(
            f"{where}: parallel's plan is for a batch of {plan.batch}, got {batch} (build it with "
            "SequenceParallel.build for the batch the model runs, e.g. twice the prompts with classifier-free "
            "guidance in one batch)"
        )
    if image_len != sp.local_tokens or length < image_len:
        raise ValueError(
            f"{where}: parallel's plan is for {plan.batch} images of {plan.global_cu_seqlens_q[1]} tokens, of which "
            f"this rank holds {sp.local_tokens}; got {batch} images of {image_len} tokens ({length} tokens with "
            "the text): attach the model with SequenceParallel.attach, or shard its inputs with SequenceParallel.shard"
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


def _check_mask(mask: object, batch: int, *lengths: int) -> None:
    """A ``(B, S)`` or ``(B, 1, 1, S)`` boolean key-padding mask, with S one of ``lengths``."""
    if not isinstance(mask, torch.Tensor):
        raise InputTypeError(f"{_WHERE}: attention_mask must be a torch.Tensor or None, got {type(mask).__name__}")
    if mask.dtype != torch.bool:
        raise InputTypeError(
            f"{_WHERE}: attention_mask must be a boolean key-padding mask (True = real token), got {mask.dtype}"
        )
    shapes = [shape for n in dict.fromkeys(lengths) for shape in ((batch, n), (batch, 1, 1, n))]
    if tuple(mask.shape) not in shapes:
        expected = " or ".join(map(str, shapes))
        raise ValueError(
            f"{_WHERE}: attention_mask must have shape (batch, text + image tokens) = {expected}, a key-padding "
            f"mask over the joint sequence, got {tuple(mask.shape)}"
        )
