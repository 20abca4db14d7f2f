"""attn_implementation="packattn" in tiny random transformers models against each sequence run alone in eager."""

from __future__ import annotations

import copy
import inspect
import subprocess
import sys
from typing import Any

import pytest
import torch
import transformers
from transformers import AutoModelForCausalLM, BertConfig, BertModel, DataCollatorWithFlattening, ModernBertModel

from packattn.integrations import transformers as integration

integration.register()

TOL = {"atol": 2e-5, "rtol": 1e-4}  # float32; the observed differences are ~1e-7
LENGTHS = [5, 1, 9, 4]  # longer than the 3-token windows below, one single token
DIMS = {"vocab_size": 61, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2}
HEADS = {"num_attention_heads": 4, "num_key_value_heads": 2}
DECODERS = {
    "llama_gqa": transformers.LlamaConfig(**DIMS, **HEADS),
    "mistral_window": transformers.MistralConfig(**DIMS, **HEADS, sliding_window=3),
    # Scores large enough for the soft cap to change them; scaling 1 instead of head_dim ** -0.5.
    "gemma2_window_softcap": transformers.Gemma2Config(
        **DIMS,
        num_attention_heads=4,
        num_key_value_heads=1,
        head_dim=8,
        sliding_window=3,
        attn_logit_softcapping=1.0,
        query_pre_attn_scalar=1,
        initializer_range=0.2,
    ),
}
ENCODER = BertConfig(
    **DIMS, num_attention_heads=4, attention_probs_dropout_prob=0.0, hidden_dropout_prob=0.0, max_position_embeddings=32
)

# Bidirectional sliding window: eager keeps |i - j| <= 2, the layers pass sliding_window=3 (flash's convention).
WINDOWED_ENCODER = transformers.ModernBertConfig(
    **DIMS,
    num_attention_heads=4,
    local_attention=4,
    global_attn_every_n_layers=2,
    attention_dropout=0.0,
    embedding_dropout=0.0,
    mlp_dropout=0.0,
    pad_token_id=0,
    sep_token_id=2,
    cls_token_id=1,
    bos_token_id=1,
    eos_token_id=2,
)


def pair(cfg: Any, cls: Any = AutoModelForCausalLM) -> tuple[torch.nn.Module, torch.nn.Module]:
    """(eager, packattn) models with the same random weights, each from its own copy of ``cfg``
    (from_config writes the implementation into the config it is given)."""
    torch.manual_seed(0)
    build = cls.from_config if cls is AutoModelForCausalLM else cls._from_config
    eager = build(copy.deepcopy(cfg), attn_implementation="eager")
    packed = build(copy.deepcopy(cfg), attn_implementation="packattn")
    packed.load_state_dict(eager.state_dict())
    assert eager.config._attn_implementation == "eager" and packed.config._attn_implementation == "packattn"
    return eager, packed


def cache_argument(model: torch.nn.Module, cache: Any) -> dict[str, Any]:
    """A cache for ``model.forward``: ``cache=`` where it takes that (``past_key_values`` is deprecated)."""
    name = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    return {name: cache}


def sequences(seed: int = 1) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, DIMS["vocab_size"], (n,), generator=gen) for n in LENGTHS]


def outputs(model: torch.nn.Module, **batch: Any) -> torch.Tensor:
    result = model(**batch)
    return result.logits if hasattr(result, "logits") else result.last_hidden_state


def alone(model: torch.nn.Module, seqs: list[torch.Tensor]) -> list[torch.Tensor]:
    return [outputs(model, input_ids=s[None])[0] for s in seqs]


def padded(seqs: list[torch.Tensor], side: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(input_ids, attention_mask) padded on ``side``; padding ids are nonzero so that they would change
    the result if they were attended."""
    width = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), width), 7, dtype=torch.long)
    mask = torch.zeros(len(seqs), width, dtype=torch.long)
    for b, s in enumerate(seqs):
        cols = slice(width - len(s), width) if side == "left" else slice(0, len(s))
        ids[b, cols], mask[b, cols] = s, 1
    return ids, mask


def unpad(out: torch.Tensor, mask: torch.Tensor) -> list[torch.Tensor]:
    return [out[b][mask[b].bool()] for b in range(out.shape[0])]


def collate(seqs: list[torch.Tensor], **options: Any) -> dict[str, torch.Tensor]:
    return DataCollatorWithFlattening(**options)([{"input_ids": s.tolist()} for s in seqs])


@pytest.mark.parametrize("name", DECODERS)
def test_packed_position_ids_match_each_sequence_alone(name: str) -> None:
    eager, packed = pair(DECODERS[name])
    seqs = sequences()
    batch = collate(seqs)
    assert batch["input_ids"].shape[0] == 1 and "cu_seq_lens_q" not in batch
    got = outputs(packed, input_ids=batch["input_ids"], position_ids=batch["position_ids"])[0]
    torch.testing.assert_close(got, torch.cat(alone(eager, seqs)), **TOL)
    # The same packed row in eager attends across the borders: the check above can fail.
    crossed = outputs(eager, input_ids=batch["input_ids"])[0]
    assert not torch.allclose(crossed, got, **TOL)


@pytest.mark.parametrize("name", DECODERS)
def test_packed_cu_seq_lens_kwargs_match_each_sequence_alone(name: str) -> None:
    eager, packed = pair(DECODERS[name])
    seqs = sequences()
    batch = collate(seqs, return_flash_attn_kwargs=True, return_position_ids=False)
    assert "cu_seq_lens_q" in batch and "position_ids" not in batch
    batch.pop("labels")
    torch.testing.assert_close(outputs(packed, **batch)[0], torch.cat(alone(eager, seqs)), **TOL)


@pytest.mark.parametrize("side", ["right", "left"])
@pytest.mark.parametrize("name", DECODERS)
def test_padded_batch_matches_each_sequence_alone(name: str, side: str) -> None:
    eager, packed = pair(DECODERS[name])
    seqs = sequences()
    ids, mask = padded(seqs, side)
    # Positions restart at 0 in every row, as for each sequence alone (left padding would shift them).
    positions = (mask.cumsum(1) - 1).clamp(min=0)
    got = unpad(outputs(packed, input_ids=ids, attention_mask=mask, position_ids=positions), mask)
    for g, want in zip(got, alone(eager, seqs)):
        torch.testing.assert_close(g, want, **TOL)


def test_padded_batch_under_inference_mode_matches_eager() -> None:
    """Inference tensors have no version counter: the per-forward reuse of the mask's offsets steps aside."""
    eager, packed = pair(DECODERS["llama_gqa"])
    ids, mask = padded(sequences(), "right")
    with torch.inference_mode():
        got, want = (
            outputs(packed, input_ids=ids, attention_mask=mask),
            outputs(eager, input_ids=ids, attention_mask=mask),
        )
    torch.testing.assert_close(got[mask.bool()], want[mask.bool()], **TOL)


def test_plain_batch_matches_eager() -> None:
    eager, packed = pair(DECODERS["gemma2_window_softcap"])
    ids = torch.randint(0, DIMS["vocab_size"], (3, 7), generator=torch.Generator().manual_seed(2))
    torch.testing.assert_close(outputs(packed, input_ids=ids), outputs(eager, input_ids=ids), **TOL)


def test_sliding_window_counts_the_token_itself() -> None:
    """HF's window W keeps W keys, the token included (packattn window (W - 1, 0)); an off-by-one differs."""
    cfg = DECODERS["mistral_window"]
    eager, packed = pair(cfg)
    ids = sequences()[2][None]  # 9 tokens, window 3
    want = outputs(eager, input_ids=ids)
    torch.testing.assert_close(outputs(packed, input_ids=ids), want, **TOL)
    for other in (2, 4):
        wider = copy.deepcopy(cfg)
        wider.sliding_window = other
        _, shifted = pair(wider)
        assert not torch.allclose(outputs(shifted, input_ids=ids), want, **TOL)


def test_causal_loss_gradients_match_each_sequence_alone() -> None:
    """DataCollatorWithFlattening's labels (-100 at each sequence start) give the sum of the per-sequence losses."""
    eager, packed = pair(DECODERS["gemma2_window_softcap"])
    seqs = sequences()
    batch = collate(seqs)
    tokens = sum(len(s) - 1 for s in seqs)
    (packed(**batch).loss * tokens).backward()
    sum(eager(input_ids=s[None], labels=s[None]).loss * (len(s) - 1) for s in seqs).backward()  # type: ignore[union-attr]
    assert_same_gradients(packed, eager)


def test_encoder_packed_padded_and_gradients_match_each_sequence_alone() -> None:
    eager, packed = pair(ENCODER, BertModel)
    seqs = sequences()
    want = alone(eager, seqs)
    batch = collate(seqs, return_flash_attn_kwargs=True)
    batch.pop("labels")
    got = outputs(packed, **batch)[0]
    torch.testing.assert_close(got, torch.cat(want), **TOL)
    ids, mask = padded(seqs, "right")
    got_padded = unpad(outputs(packed, input_ids=ids, attention_mask=mask), mask)
    torch.testing.assert_close(torch.cat(got_padded), torch.cat(want), **TOL)
    weights = torch.randn(got.shape, generator=torch.Generator().manual_seed(3))
    (torch.cat(got_padded) * weights).sum().backward()
    (torch.cat(want) * weights).sum().backward()
    assert_same_gradients(packed, eager)


def test_bidirectional_sliding_window_matches_each_sequence_alone() -> None:
    eager, packed = pair(WINDOWED_ENCODER, ModernBertModel)
    assert eager.config.layer_types == ["full_attention", "sliding_attention"]
    seqs = sequences()
    want = alone(eager, seqs)
    ids, mask = padded(seqs, "right")
    got = unpad(outputs(packed, input_ids=ids, attention_mask=mask), mask)
    torch.testing.assert_close(torch.cat(got), torch.cat(want), **TOL)
    plain = sequences()[2][None]  # 9 tokens, wider than the window
    torch.testing.assert_close(outputs(packed, input_ids=plain), outputs(eager, input_ids=plain), **TOL)


def assert_same_gradients(model: torch.nn.Module, reference: torch.nn.Module) -> None:
    ref = dict(reference.named_parameters())
    checked = 0
    for name, p in model.named_parameters():
        if ref[name].grad is None:
            assert p.grad is None or not p.grad.any(), name
            continue
        torch.testing.assert_close(p.grad, ref[name].grad, **TOL, msg=lambda m, n=name: f"{n}: {m}")
        checked += 1
    assert checked > 10


def test_refuses_dropout_in_training_and_4d_masks() -> None:
    cfg = copy.deepcopy(DECODERS["llama_gqa"])
    cfg.attention_dropout = 0.1
    _, packed = pair(cfg)
    ids = torch.randint(0, DIMS["vocab_size"], (1, 4))
    packed.train()
    with pytest.raises(ValueError, match="dropout"):
        packed(input_ids=ids)
    packed.eval()
    outputs(packed, input_ids=ids)  # dropout is off in eval mode
    with pytest.raises(TypeError, match="2-D padding mask"):
        packed(input_ids=ids, attention_mask=torch.ones(1, 1, 4, 4, dtype=torch.bool))


def test_importing_packattn_imports_neither_library() -> None:
    code = (
        "import sys, packattn, packattn.integrations; print('transformers' in sys.modules, 'diffusers' in sys.modules)"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.split() == ["False", "False"]


def test_offsets_are_read_once_per_forward_not_per_layer(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[int] = []
    find = integration._offsets_from_positions
    monkeypatch.setattr(integration, "_offsets_from_positions", lambda *a: calls.append(1) or find(*a))
    _, packed = pair(DECODERS["llama_gqa"])
    batch = collate(sequences())
    outputs(packed, input_ids=batch["input_ids"], position_ids=batch["position_ids"])
    outputs(packed, input_ids=batch["input_ids"], position_ids=batch["position_ids"].clone())
    assert len(calls) == 2  # two forwards of two layers each


def test_plain_batch_compiles_whole_forward_and_backward() -> None:
    """A model using attn_implementation="packattn" compiles with fullgraph=True (packattn's custom ops, the
    integration adds no sync): outputs and gradients equal eager attention's."""
    integration.register()
    cfg = copy.deepcopy(DECODERS["llama_gqa"])
    cfg.num_hidden_layers = 1
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(copy.deepcopy(cfg), attn_implementation="packattn")
    eager = AutoModelForCausalLM.from_config(copy.deepcopy(cfg), attn_implementation="eager")
    eager.load_state_dict(model.state_dict())
    ids = torch.randint(0, DIMS["vocab_size"], (2, 6), generator=torch.Generator().manual_seed(4))
    # aot_eager: dynamo and AOT autograd capture forward and backward whole, without inductor's build time.
    compiled = torch.compile(lambda x: model(input_ids=x, use_cache=False).logits, fullgraph=True, backend="aot_eager")
    got, want = compiled(ids), eager(input_ids=ids, use_cache=False).logits
    torch.testing.assert_close(got, want, **TOL)
    got.square().mean().backward()
    want.square().mean().backward()
    for (name, a), b in zip(model.named_parameters(), eager.parameters(), strict=True):
        torch.testing.assert_close(a.grad, b.grad, **TOL, msg=name)


@pytest.mark.parametrize("padding", ["left_padded", "unpadded"])
@pytest.mark.parametrize("cache", ["dynamic", "static"])
@pytest.mark.parametrize("model", list(DECODERS))
def test_generation_with_a_cache_matches_eager(model: str, cache: str, padding: str) -> None:
    """Decoding: one query per row against the cached keys (bottom-right causal), padded or not. A static
    cache hands every slot to the layers, the unfilled ones zero: only the filled ones are keys."""
    eager, packed = pair(DECODERS[model])
    seqs = sequences()
    if padding == "unpadded":
        seqs = [s[:4] for s in seqs if len(s) >= 4]
    ids, mask = padded(seqs, "left")
    options = {"max_new_tokens": 5, "do_sample": False, "return_dict_in_generate": True, "output_logits": True}
    runs = [
        m.generate(input_ids=ids, attention_mask=mask, pad_token_id=7, cache_implementation=cache, **options)
        for m in (eager, packed)
    ]
    torch.testing.assert_close(torch.stack(runs[1].logits), torch.stack(runs[0].logits), **TOL)
    assert torch.equal(runs[1].sequences, runs[0].sequences)


@pytest.mark.parametrize("cache", ["dynamic", "static"])
def test_a_mask_wider_than_the_keys_is_read_as_transformers_reads_it(cache: str) -> None:
    """A mask made for the whole cache up front (16 columns, the future ones 1): the keys' columns are those
    from the cache's offset on, as in transformers' own masks. Prefill of a left-padded batch, then decoding."""
    eager, packed = pair(DECODERS["mistral_window"])
    ids, mask = padded(sequences(), "left")
    wide = torch.cat([mask, torch.ones(mask.shape[0], 16 - mask.shape[1], dtype=mask.dtype)], 1)

    def run(model: torch.nn.Module, widen: bool) -> torch.Tensor:
        if cache == "static":
            kv: Any = transformers.StaticCache(config=model.config, max_cache_len=16)
        else:
            kv = transformers.DynamicCache(config=model.config)
        tokens, seen, pos = ids, mask, (mask.cumsum(1) - 1).clamp(min=0)
        logits = []
        for _ in range(4):
            mask_now = wide if widen else seen
            out = model(input_ids=tokens, attention_mask=mask_now, position_ids=pos, **cache_argument(model, kv))
            logits.append(out.logits[:, -1])
            tokens, pos = out.logits[:, -1:].argmax(-1), pos[:, -1:] + 1
            seen = torch.cat([seen, torch.ones_like(seen[:, :1])], 1)
        return torch.stack(logits)

    torch.testing.assert_close(run(packed, widen=True), run(eager, widen=False), **TOL)


def test_a_static_cache_without_a_mask_attends_to_its_filled_slots() -> None:
    eager, packed = pair(DECODERS["llama_gqa"])
    ids = sequences()[0][None]
    cache = transformers.StaticCache(config=DECODERS["llama_gqa"], max_cache_len=16)
    got = packed(input_ids=ids, **cache_argument(packed, cache)).logits
    torch.testing.assert_close(got, eager(input_ids=ids).logits, **TOL)


SEQ2SEQ = transformers.BartConfig(
    vocab_size=50,
    d_model=32,
    encoder_layers=1,
    decoder_layers=1,
    encoder_attention_heads=4,
    decoder_attention_heads=4,
    encoder_ffn_dim=64,
    decoder_ffn_dim=64,
    max_position_embeddings=64,
    dropout=0.0,
    attention_dropout=0.0,
    activation_dropout=0.0,
)


@pytest.mark.parametrize("decoder_length", [4, 8, 10])
def test_cross_attention_over_a_padded_encoder_matches_eager(decoder_length: int) -> None:
    """Cross-attention's mask is the encoder's: every decoder query attends to its row's real encoder tokens,
    whether the decoder is shorter than, as long as or longer than the encoder."""
    eager, packed = pair(SEQ2SEQ, transformers.BartModel)
    gen = torch.Generator().manual_seed(0)
    enc = torch.randint(3, 50, (2, 8), generator=gen)
    enc_mask = torch.ones(2, 8, dtype=torch.long)
    enc_mask[1, 5:] = 0
    dec = torch.randint(3, 50, (2, decoder_length), generator=gen)
    got, want = (m(input_ids=enc, attention_mask=enc_mask, decoder_input_ids=dec) for m in (packed, eager))
    torch.testing.assert_close(got.last_hidden_state, want.last_hidden_state, **TOL)
    real = enc_mask.bool()
    torch.testing.assert_close(got.encoder_last_hidden_state[real], want.encoder_last_hidden_state[real], **TOL)


def test_a_models_own_mask_overlays_follow_the_layers_arguments() -> None:
    """EmbeddingGemma's setting: Gemma3 layers made bidirectional through the model's own overlays, full and
    sliding (|i - j| < W), which the layers' is_causal=False and sliding_window describe."""
    cfg = transformers.Gemma3TextConfig(
        **DIMS,
        num_attention_heads=4,
        num_key_value_heads=1,
        head_dim=8,
        sliding_window=3,
        use_bidirectional_attention=True,
        layer_types=["sliding_attention", "full_attention"],
    )
    eager, packed = pair(cfg, transformers.Gemma3TextModel)
    seqs = sequences()
    want = alone(eager, seqs)
    ids, mask = padded(seqs, "right")
    got = unpad(outputs(packed, input_ids=ids, attention_mask=mask), mask)
    torch.testing.assert_close(torch.cat(got), torch.cat(want), **TOL)


def test_refuses_masks_and_biases_it_does_not_compute() -> None:
    """Chunked attention, T5's additive position bias and a window over a mask with a gap inside a row would
    be ignored or miscounted: each raises, naming what. Attention weights are not returned: a warning says so."""
    chunked = transformers.Llama4TextConfig(
        **DIMS,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        intermediate_size_mlp=64,
        num_local_experts=2,
        attention_chunk_size=4,
        no_rope_layers=[1, 0],
        layer_types=["chunked_attention", "full_attention"],
        moe_layers=[],
    )
    _, packed = pair(chunked, transformers.Llama4ForCausalLM)
    ids = torch.randint(0, DIMS["vocab_size"], (1, 10))
    with pytest.raises(ValueError, match=r"chunked attention \(chunked_overlay\), which packattn does not compute"):
        packed(input_ids=ids)
    _, packed = pair(DECODERS["llama_gqa"])
    rows = torch.tensor([[0, 1, 2, 0, 1], [0, 1, 0, 1, 2]])
    with pytest.raises(ValueError, match=r"rows of a batch of more than one \(packed_sequence_mask_function\)"):
        packed(input_ids=ids[:, :5].expand(2, 5), position_ids=rows, use_cache=False)
    t5 = transformers.T5Config(vocab_size=61, d_model=32, d_kv=8, d_ff=64, num_layers=1, num_heads=4, dropout_rate=0)
    _, packed = pair(t5, transformers.T5EncoderModel)
    with pytest.raises(ValueError, match="position_bias is not supported"):
        packed(input_ids=ids)
    _, packed = pair(DECODERS["mistral_window"])
    with pytest.warns(UserWarning, match="output_attentions=True returns no attention weights"):
        assert not packed(input_ids=ids, output_attentions=True).attentions
    gap = torch.tensor([[1, 1, 1, 0, 0, 1, 1, 1, 1, 1]])
    with pytest.raises(ValueError, match="gaps inside a row"):
        packed(input_ids=ids, attention_mask=gap)
    left = torch.tensor([[0, 0, 1, 1, 1, 1, 1, 1, 1, 1]])
    eager, packed = pair(DECODERS["mistral_window"])
    real = left[0].bool()
    torch.testing.assert_close(
        outputs(packed, input_ids=ids, attention_mask=left)[0, real],
        outputs(eager, input_ids=ids, attention_mask=left)[0, real],
        **TOL,
    )
