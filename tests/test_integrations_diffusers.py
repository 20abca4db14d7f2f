"""The packattn processors in tiny random Flux and Wan transformers against diffusers' default processors."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
from diffusers import FluxTransformer2DModel, WanTransformer3DModel

from packattn.integrations.diffusers import PackedJointAttnProcessor, PackedWanAttnProcessor

TOL = {"atol": 2e-5, "rtol": 1e-4}  # float32; the observed differences are ~2e-7
PROMPT_LENGTHS = [3, 7, 1]
HEIGHT, WIDTH, CHANNELS, TEXT_DIM, POOLED_DIM = 2, 3, 4, 24, 8


def flux() -> FluxTransformer2DModel:
    torch.manual_seed(0)
    return FluxTransformer2DModel(
        patch_size=1,
        in_channels=CHANNELS,
        num_layers=1,  # one dual-stream (text + image) block
        num_single_layers=1,  # one single-stream block (text and image already concatenated)
        attention_head_dim=16,
        num_attention_heads=2,
        joint_attention_dim=TEXT_DIM,
        pooled_projection_dim=POOLED_DIM,
        axes_dims_rope=(4, 6, 6),
    )


@dataclass
class Batch:
    """Padded prompts (text padded on the right to the longest), image latents and the joint key mask."""

    image: torch.Tensor
    text: torch.Tensor
    pooled: torch.Tensor
    timestep: torch.Tensor
    joint_mask: torch.Tensor  # (B, text + image) bool

    @staticmethod
    def make(lengths: list[int], *, pad_value: float | None = None, image_tokens: int = HEIGHT * WIDTH) -> Batch:
        gen = torch.Generator().manual_seed(1)
        batch, width = len(lengths), max(lengths)
        text = torch.randn(batch, width, TEXT_DIM, generator=gen)
        text_mask = torch.arange(width)[None] < torch.tensor(lengths)[:, None]
        if pad_value is not None:
            text[~text_mask] = pad_value
        image = torch.randn(batch, image_tokens, CHANNELS, generator=gen)
        joint = torch.cat([text_mask, torch.ones(batch, image_tokens, dtype=torch.bool)], dim=1)
        return Batch(
            image, text, torch.randn(batch, POOLED_DIM, generator=gen), torch.rand(batch, generator=gen), joint
        )


def image_ids(height: int = HEIGHT, width: int = WIDTH) -> torch.Tensor:
    ids = torch.zeros(height * width, 3)
    ids[:, 1] = torch.arange(height).repeat_interleave(width)
    ids[:, 2] = torch.arange(width).repeat(height)
    return ids


def run(
    model: FluxTransformer2DModel,
    data: Batch,
    *,
    mask: torch.Tensor | None = None,
    img_ids: torch.Tensor | None = None,
) -> torch.Tensor:
    kwargs = None if mask is None else {"attention_mask": mask}
    return model(
        hidden_states=data.image,
        encoder_hidden_states=data.text,
        pooled_projections=data.pooled,
        timestep=data.timestep,
        img_ids=image_ids() if img_ids is None else img_ids,
        txt_ids=torch.zeros(data.text.shape[1], 3),
        joint_attention_kwargs=kwargs,
    ).sample


def alone(model: FluxTransformer2DModel, data: Batch, lengths: list[int]) -> torch.Tensor:
    """Each sample run by itself with its unpadded prompt."""
    outs = []
    for b, n in enumerate(lengths):
        one = Batch(
            data.image[b : b + 1],
            data.text[b : b + 1, :n],
            data.pooled[b : b + 1],
            data.timestep[b : b + 1],
            data.joint_mask[b : b + 1],
        )
        outs.append(run(model, one))
    return torch.cat(outs)


@pytest.mark.parametrize("mask_shape", ["2d", "4d"])
def test_padded_prompts_match_each_sample_alone_and_the_masked_default(mask_shape: str) -> None:
    model, data = flux(), Batch.make(PROMPT_LENGTHS)
    mask = data.joint_mask if mask_shape == "2d" else data.joint_mask[:, None, None]
    with torch.no_grad():
        want = alone(model, data, PROMPT_LENGTHS)
        masked_default = run(model, data, mask=data.joint_mask[:, None, None])
        unmasked_default = run(model, data)
        model.set_attn_processor(PackedJointAttnProcessor())
        assert all(isinstance(p, PackedJointAttnProcessor) for p in model.attn_processors.values())
        got = run(model, data, mask=mask)
    torch.testing.assert_close(got, want, **TOL)
    torch.testing.assert_close(got, masked_default, **TOL)
    assert not torch.allclose(unmasked_default, want, **TOL)  # attending the padding changes the result


def test_padding_is_never_read() -> None:
    """NaN in the padded prompt positions stays out of every real token."""
    model, data = flux(), Batch.make(PROMPT_LENGTHS, pad_value=float("nan"))
    with torch.no_grad():
        want = alone(model, data, PROMPT_LENGTHS)
        model.set_attn_processor(PackedJointAttnProcessor())
        got = run(model, data, mask=data.joint_mask)
    assert want.isfinite().all()
    torch.testing.assert_close(got, want, **TOL)


def test_unmasked_batch_and_fused_projections_match_the_default() -> None:
    model, data = flux(), Batch.make([5, 5])
    with torch.no_grad():
        want = run(model, data)
        model.set_attn_processor(PackedJointAttnProcessor(backend="reference"))
        torch.testing.assert_close(run(model, data), want, **TOL)
        model.fuse_qkv_projections()
        for name, param in model.named_parameters():  # the fused weights must be the ones read
            if name.endswith(("to_q.weight", "add_q_proj.weight")):
                param.zero_()
        assert all(
            m.fused_projections for m in (model.transformer_blocks[0].attn, model.single_transformer_blocks[0].attn)
        )
        torch.testing.assert_close(run(model, data), want, **TOL)


def test_gradients_match_each_sample_alone() -> None:
    reference, packed, data = flux(), flux(), Batch.make(PROMPT_LENGTHS)
    packed.set_attn_processor(PackedJointAttnProcessor())
    weights = torch.randn(len(PROMPT_LENGTHS), HEIGHT * WIDTH, CHANNELS, generator=torch.Generator().manual_seed(2))
    (run(packed, data, mask=data.joint_mask) * weights).sum().backward()
    (alone(reference, data, PROMPT_LENGTHS) * weights).sum().backward()
    ref = dict(reference.named_parameters())
    checked = 0
    for name, p in packed.named_parameters():
        if ref[name].grad is not None:
            torch.testing.assert_close(p.grad, ref[name].grad, **TOL, msg=lambda m, n=name: f"{n}: {m}")
            checked += 1
    assert checked > 20


def test_refuses_masks_that_are_not_boolean_key_padding_masks() -> None:
    model, data = flux(), Batch.make(PROMPT_LENGTHS)
    model.set_attn_processor(PackedJointAttnProcessor())
    with torch.no_grad():
        with pytest.raises(TypeError, match="boolean key-padding mask"):
            run(model, data, mask=data.joint_mask.float())
        with pytest.raises(ValueError, match="joint sequence"):
            run(model, data, mask=data.joint_mask[:, : max(PROMPT_LENGTHS)])
        square = data.joint_mask[:, None, :, None] & data.joint_mask[:, None, None, :]
        with pytest.raises(ValueError, match="joint sequence"):
            run(model, data, mask=square)


def test_parallel_must_be_a_sequence_parallel() -> None:
    for processor in (PackedJointAttnProcessor, PackedWanAttnProcessor):
        with pytest.raises(TypeError, match="parallel must be a SequenceParallel or None, got dict"):
            processor(parallel={"mesh": None})  # type: ignore[arg-type]


# ---------------------------------------------------------------- Wan (video)

VIDEO = (2, 4, 6)  # frames, height, width of the latents: 2 x 2 x 3 = 12 tokens after (1, 2, 2) patches
VIDEO_TOKENS = 12
WAN_TEXT_DIM, WAN_IMAGE_DIM = 16, 8


def wan(*, image_to_video: bool = False) -> WanTransformer3DModel:
    torch.manual_seed(0)
    return WanTransformer3DModel(
        patch_size=(1, 2, 2),
        num_attention_heads=2,
        attention_head_dim=12,  # rotary dims 4 (frames) + 4 (height) + 4 (width)
        in_channels=CHANNELS,
        out_channels=CHANNELS,
        text_dim=WAN_TEXT_DIM,
        freq_dim=16,
        ffn_dim=32,
        num_layers=2,
        rope_max_seq_len=32,
        image_dim=WAN_IMAGE_DIM if image_to_video else None,
        added_kv_proj_dim=24 if image_to_video else None,  # heads x head dim
    )


@dataclass
class Video:
    latents: torch.Tensor  # (B, C, frames, height, width)
    text: torch.Tensor
    timestep: torch.Tensor
    image: torch.Tensor | None = None  # the image-to-video context

    @staticmethod
    def make(batch: int = 2, *, image_to_video: bool = False, text_len: int = 7) -> Video:
        gen = torch.Generator().manual_seed(1)
        # The image-to-video models' processors take the last 512 context tokens as the text.
        text = torch.randn(batch, 512 if image_to_video else text_len, WAN_TEXT_DIM, generator=gen)
        image = torch.randn(batch, 5, WAN_IMAGE_DIM, generator=gen) if image_to_video else None
        latents = torch.randn(batch, CHANNELS, *VIDEO, generator=gen)
        return Video(latents, text, torch.rand(batch, generator=gen) * 1000, image)

    def run(self, model: WanTransformer3DModel, timestep: torch.Tensor | None = None) -> torch.Tensor:
        t = self.timestep if timestep is None else timestep
        return model(self.latents, t, self.text, encoder_hidden_states_image=self.image).sample


@pytest.mark.parametrize("image_to_video", [False, True], ids=["t2v", "i2v"])
def test_wan_matches_the_default_processor_forward_and_backward(image_to_video: bool) -> None:
    reference, packed = wan(image_to_video=image_to_video), wan(image_to_video=image_to_video)
    data = Video.make(image_to_video=image_to_video)
    data.latents.requires_grad_()
    packed.set_attn_processor(PackedWanAttnProcessor(backend="reference"))
    weights = torch.randn(data.latents.shape, generator=torch.Generator().manual_seed(2))
    want = data.run(reference)
    (want * weights).sum().backward()
    want_grad, data.latents.grad = data.latents.grad, None
    got = data.run(packed)
    torch.testing.assert_close(got, want, **TOL)
    (got * weights).sum().backward()
    torch.testing.assert_close(data.latents.grad, want_grad, **TOL)
    ref, checked = dict(reference.named_parameters()), 0
    for name, p in packed.named_parameters():
        if ref[name].grad is not None:
            torch.testing.assert_close(p.grad, ref[name].grad, **TOL, msg=lambda m, n=name: f"{n}: {m}")
            checked += 1
    assert checked > 40
    if image_to_video:  # the image context reaches the output
        assert packed.blocks[0].attn2.add_k_proj.weight.grad.abs().sum() > 0


@pytest.mark.parametrize("image_to_video", [False, True], ids=["t2v", "i2v"])
def test_wan_fused_projections_are_the_ones_read(image_to_video: bool) -> None:
    model, data = wan(image_to_video=image_to_video), Video.make(image_to_video=image_to_video)
    with torch.no_grad():
        want = data.run(model)
        model.set_attn_processor(PackedWanAttnProcessor())
        model.fuse_qkv_projections()
        for name, param in model.named_parameters():
            if name.endswith(("to_k.weight", "to_v.weight", "add_k_proj.weight")):
                param.zero_()
        assert model.blocks[0].attn1.fused_projections and model.blocks[0].attn2.fused_projections
        torch.testing.assert_close(data.run(model), want, **TOL)


def test_wan_refuses_an_attention_mask_and_a_short_image_to_video_context() -> None:
    x, text = torch.randn(1, 3, 24), torch.randn(1, 4, WAN_TEXT_DIM)
    with pytest.raises(ValueError, match="attention_mask must be None"):
        PackedWanAttnProcessor()(wan().blocks[0].attn2, x, torch.randn(1, 4, 24), torch.ones(1, 4, dtype=torch.bool))
    model = wan(image_to_video=True)
    model.set_attn_processor(PackedWanAttnProcessor())
    data = Video.make(batch=1, image_to_video=True)
    data.text = text
    with torch.no_grad(), pytest.raises(ValueError, match="followed by 512 text tokens, got 9 tokens"):
        data.run(model)


def test_masks_made_under_inference_mode_work_and_changed_masks_are_read_again() -> None:
    """Inference tensors have no version counter (nothing is reused for them); a mask whose memory is
    replaced (``.data``) is read again."""
    model, data = flux(), Batch.make(PROMPT_LENGTHS)
    with torch.no_grad():
        want = run(model, data, mask=data.joint_mask[:, None, None])
        model.set_attn_processor(PackedJointAttnProcessor())
        with torch.inference_mode():
            mask = data.joint_mask.clone()
            torch.testing.assert_close(run(model, data, mask=mask), want, **TOL)
        mask = torch.ones_like(data.joint_mask)
        run(model, data, mask=mask)
        mask.data = data.joint_mask.clone()
        torch.testing.assert_close(run(model, data, mask=mask), want, **TOL)


def test_processors_say_so_when_set_on_another_kind_of_attention() -> None:
    x = torch.randn(1, 3, 24)
    with pytest.raises(
        TypeError, match=r"attn must be a diffusers FluxAttention .*got WanAttention, which has no head_dim"
    ):
        PackedJointAttnProcessor()(wan().blocks[0].attn1, x)
    flux_attn = flux().transformer_blocks[0].attn
    with pytest.raises(
        TypeError, match=r"attn must be a diffusers WanAttention .*got FluxAttention, which has no is_cross"
    ):
        PackedWanAttnProcessor()(flux_attn, torch.randn(1, 3, 32))
    for processor in (PackedJointAttnProcessor, PackedWanAttnProcessor):
        with pytest.raises(ValueError, match="unknown backend 'nope'"):
            processor(backend="nope")


def test_wan_in_float64_and_per_sample_rotary_tables_match_the_default() -> None:
    """Wan's rotary embedding in the inputs' precision (float64 stays float64), and tables of shape
    (B, S, 1, D) applied per sample, as the default processor broadcasts them."""
    model, data = wan().double(), Video.make()
    data.latents, data.text = data.latents.double(), data.text.double()
    with torch.no_grad():
        want = data.run(model)
        model.set_attn_processor(PackedWanAttnProcessor(backend="reference"))
        torch.testing.assert_close(data.run(model), want, atol=1e-12, rtol=1e-12)
    attn, gen = wan().blocks[0].attn1, torch.Generator().manual_seed(3)
    x = torch.randn(2, 5, 24, generator=gen)
    angles = torch.randn(2, 5, 1, 6, generator=gen).repeat_interleave(2, dim=-1)  # one angle per pair
    tables = (angles.cos(), angles.sin())
    with torch.no_grad():
        want = attn(x, rotary_emb=tables)
        attn.set_processor(PackedWanAttnProcessor(backend="reference"))
        torch.testing.assert_close(attn(x, rotary_emb=tables), want, **TOL)
