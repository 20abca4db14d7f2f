"""The drop-in signatures: sglang's ``fused_infer_attention_varlen`` and flash-attn 2's ``flash_attn_varlen_func``,
against the oracle, with their return conventions, validation messages, refusals and gradients."""

from __future__ import annotations

import pytest
import torch

import packattn
from packattn.compat.flash_attn import flash_attn_varlen_func
from packattn.compat.sglang import fused_infer_attention_varlen
from packattn.testing import oracle

from .helpers import Case, assert_matches_oracle, check_backward, make_case

SEED_CASE = ([5, 0, 7], [9, 8, 8])  # cu_q = [0, 5, 5, 12], cu_k = [0, 9, 17, 25]
PATTERNS = {
    "seed": SEED_CASE,
    "empty_k_side": ([4, 6, 3], [5, 0, 3]),
    "no_keys_at_all": ([4, 2], [0, 0]),
    "nothing_at_all": ([0, 0], [0, 0]),
    "lq_gt_lk": ([9, 17], [4, 3]),
}


def longest(lengths: list[int]) -> int:
    return max(lengths, default=0)


# sglang's fused_infer_attention_varlen -----------------------------------------------------------------


def sglang(case: Case, *, host: bool = False, **kwargs: object):
    copies = {"cu_seqlens_q_host": case.cu_q, "cu_seqlens_k_host": case.cu_k} if host else {}
    return fused_infer_attention_varlen(case.q, case.k, case.v, *case.tensors(), **copies, **kwargs)


@pytest.mark.parametrize("host", [False, True], ids=["device-offsets", "host-copies"])
@pytest.mark.parametrize("pattern", PATTERNS)
def test_sglang_matches_oracle_with_empty_sides(pattern, host):
    case = make_case(*PATTERNS[pattern], hq=4, hkv=2, d=16, dv=8)
    out, lse = sglang(case, host=host, return_softmax_lse=True)
    assert_matches_oracle(case, out, lse)
    assert lse.dtype == torch.float32 and lse.shape == (4, case.q.shape[0])
    only = sglang(case, host=host)
    assert isinstance(only, torch.Tensor) and torch.equal(only, out)


def test_sglang_seed_case_rows_without_keys_and_scale():
    case = make_case([4, 3], [0, 6], hq=2, hkv=1, d=8)
    out, lse = sglang(case, return_softmax_lse=True, softmax_scale=0.2)
    assert_matches_oracle(case, out, lse, softmax_scale=0.2)
    assert torch.equal(out[:4], torch.zeros_like(out[:4])) and torch.equal(lse[:, :4], torch.full((2, 4), -torch.inf))


def test_sglang_fp64_lse_is_fp64():
    case = make_case(*SEED_CASE, dtype=torch.float64)
    out, lse = sglang(case, return_softmax_lse=True)
    assert_matches_oracle(case, out, lse)
    assert lse.dtype == torch.float64


def test_sglang_gradients(monkeypatch):
    check_backward_through(monkeypatch, lambda c: sglang(c, return_softmax_lse=True))


def _seed_args() -> dict[str, object]:
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(n, h, 64, generator=gen) for n, h in ((12, 4), (25, 2), (25, 2)))
    return {
        "q": q,
        "k": k,
        "v": v,
        "cu_seqlens_q": torch.tensor([0, 5, 5, 12]),
        "cu_seqlens_k": torch.tensor([0, 9, 17, 25]),
    }


SGLANG_ERRORS = {  # id: (changed arguments, from the seed case's, error, message)
    "q-2d": (
        lambda a: {"q": a["q"][:, 0]},
        ValueError,
        r"q must be 3-D \(tokens, heads, head_dim\), got shape \(12, 64\)",
    ),
    "k-dtype": (lambda a: {"k": a["k"].double()}, TypeError, r"k must have the same dtype as q \(torch.float32\)"),
    "v-tokens": (
        lambda a: {"v": a["v"][:24]},
        ValueError,
        r"k and v must have the same number of tokens, got 25 and 24",
    ),
    "k-head-dim": (lambda a: {"k": a["k"][..., :32]}, ValueError, r"q and k must have the same head_dim"),
    "cu-missing": (lambda a: {"cu_seqlens_k": None}, TypeError, r"cu_seqlens_k is required \(a 1-D int32/int64 tensor"),
    "cu-float": (
        lambda a: {"cu_seqlens_q": a["cu_seqlens_q"].float()},
        TypeError,
        r"cu_seqlens_q must have dtype int32",
    ),
    "cu-2d": (lambda a: {"cu_seqlens_q": a["cu_seqlens_q"][None]}, ValueError, r"cu_seqlens_q must be 1-D"),
    "cu-start": (lambda a: {"cu_seqlens_k": torch.tensor([1, 9, 17, 25])}, ValueError, r"cu_seqlens_k must start at 0"),
    "cu-end": (
        lambda a: {"cu_seqlens_k": torch.tensor([0, 9, 17, 24])},
        ValueError,
        r"cu_seqlens_k must end at k.shape\[0\] \(25\), got 24",
    ),
    "cu-decreasing": (
        lambda a: {"cu_seqlens_q": torch.tensor([0, 6, 5, 12])},
        ValueError,
        r"cu_seqlens_q must be non-decreasing, got 6 then 5",
    ),
    "batch": (
        lambda a: {"cu_seqlens_k": torch.tensor([0, 25])},
        ValueError,
        r"cu_seqlens_q and cu_seqlens_k must describe the same number of sequences, got 3 and 1",
    ),
    "host-length": (
        lambda a: {"cu_seqlens_q_host": [0, 5, 12]},
        ValueError,
        r"cu_seqlens_q_host must have the same length as cu_seqlens_q \(4\)",
    ),
    "lse-flag": (lambda a: {"return_softmax_lse": 1}, TypeError, r"return_softmax_lse must be a bool, got int"),
}


@pytest.mark.parametrize("name", SGLANG_ERRORS)
def test_sglang_validation_messages(name):
    change, error, message = SGLANG_ERRORS[name]
    args = _seed_args()
    args.update(change(args))
    with pytest.raises(error, match=f"^fused_infer_attention_varlen: {message}"):
        fused_infer_attention_varlen(**args)  # type: ignore[arg-type]
    with pytest.raises(ValueError):  # the original raises ValueError for every one of its input rules
        fused_infer_attention_varlen(**args)  # type: ignore[arg-type]
    fused_infer_attention_varlen(**_seed_args())  # type: ignore[arg-type]  # the unchanged case runs


# flash-attn 2's flash_attn_varlen_func ---------------------------------------------------------------------


def flash(case: Case, **kwargs: object):
    lens_q = [b - a for a, b in zip(case.cu_q, case.cu_q[1:])]
    lens_k = [b - a for a, b in zip(case.cu_k, case.cu_k[1:])]
    return flash_attn_varlen_func(case.q, case.k, case.v, *case.tensors(), longest(lens_q), longest(lens_k), **kwargs)


MASKS = {
    "full": {},
    "causal": {"causal": True},
    "window": {"window_size": (3, 2)},
    "window_causal": {"window_size": (4, -1), "causal": True},
    "softcap_scale": {"softcap": 2.5, "softmax_scale": 0.3},
}


@pytest.mark.parametrize("mask", MASKS)
@pytest.mark.parametrize("pattern", PATTERNS)
def test_flash_attn_matches_oracle(pattern, mask):
    case = make_case(*PATTERNS[pattern], hq=4, hkv=2, d=16)
    out, lse, probs = flash(case, return_attn_probs=True, **MASKS[mask])
    assert probs is None
    assert_matches_oracle(case, out, lse, **MASKS[mask])
    only = flash(case, **MASKS[mask])
    assert isinstance(only, torch.Tensor) and torch.equal(only, out)


def test_flash_attn_lse_is_minus_inf_for_rows_without_keys():
    """flash-attn 2 returns +inf there; this drop-in returns packattn's -inf (see the module docstring)."""
    case = make_case([3, 4, 2], [0, 5, 2], hq=2, hkv=2, d=8)
    out, lse, _ = flash(case, return_attn_probs=True, causal=True)  # sequence 2: first 0 rows see no key
    assert lse.shape == (2, 9) and lse.dtype == torch.float32
    assert torch.equal(lse[:, :3], torch.full((2, 3), -torch.inf)) and torch.equal(out[:3], torch.zeros_like(out[:3]))
    assert torch.isfinite(lse[:, 3:]).all()


def test_flash_attn_larger_max_seqlen_is_fine_and_smaller_raises():
    case = make_case(*SEED_CASE, hq=4, hkv=2, d=16)
    args = (case.q, case.k, case.v, *case.tensors())
    torch.testing.assert_close(flash_attn_varlen_func(*args, 100, 100), flash(case), rtol=0, atol=0)
    message = r"^flash_attn_varlen_func: max_seqlen_q must be at least the longest sequence \(7\), got 6; flash-attn"
    with pytest.raises(ValueError, match=message):
        flash_attn_varlen_func(*args, 6, 9)
    with pytest.raises(ValueError, match=r"max_seqlen_k must be at least the longest sequence \(9\), got 8"):
        flash_attn_varlen_func(*args, 7, 8)
    with pytest.raises(TypeError, match=r"max_seqlen_q must be an int, got Tensor; pass a Python int"):
        flash_attn_varlen_func(*args, torch.tensor(7), 9)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"dropout_p": 0.1}, r"dropout_p must be 0.0, got 0.1; packattn computes exact attention without dropout"),
        ({"alibi_slopes": torch.ones(4)}, r"alibi_slopes is not supported; pass None"),
        ({"block_table": torch.zeros(3, 1, dtype=torch.int32)}, r"block_table \(paged KV cache\) is not supported"),
    ],
    ids=["dropout", "alibi", "block_table"],
)
def test_flash_attn_refuses_what_it_cannot_honour(kwargs, message):
    case = make_case(*SEED_CASE)
    with pytest.raises(NotImplementedError, match=f"^flash_attn_varlen_func: {message}"):
        flash(case, **kwargs)


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        ({"dropout_p": None}, TypeError, r"dropout_p must be a float, got NoneType"),
        ({"return_attn_probs": 1}, TypeError, r"return_attn_probs must be a bool, got int"),
        ({"deterministic": "yes"}, TypeError, r"deterministic must be a bool, got str"),
        ({"window_size": (2, 3, 4)}, TypeError, r"window_size must be a pair \(left, right\) of ints"),
        ({"window_size": torch.tensor([2.0, 3.0])}, TypeError, r"window_size must be a pair"),
        ({"softcap": "1.0"}, TypeError, r"softcap must be a float, got str"),
        ({"softmax_scale": float("inf")}, ValueError, r"softmax_scale must be a finite number, got inf"),
    ],
    ids=["dropout-type", "probs-type", "deterministic-type", "window-3", "window-float-tensor", "softcap", "scale"],
)
def test_flash_attn_validation_messages(kwargs, error, message):
    with pytest.raises(error, match=f"^flash_attn_varlen_func: {message}"):
        flash(make_case(*SEED_CASE), **kwargs)


# flash-attn 2's own varlen test grid, restated: (seqlen_q, seqlen_k) pairs including Lq > Lk and lengths
# one off a power of two, head dims that are no multiple of 8, MHA/GQA/MQA, causal with and without a
# local window (drawn below seqlen_k, as its tests draw it), softcap 0 and 50; fp16 and bf16 as it runs them.
FA2_SEQLENS = [(1, 147), (113, 203), (128, 217), (113, 211), (108, 256), (256, 512), (512, 256), (1023, 1024)]
FA2_HEADS = {"mha": (6, 6), "gqa": (6, 2), "mqa": (6, 1)}


@pytest.mark.parametrize("softcap", [0.0, 50.0])
@pytest.mark.parametrize("local", [False, True], ids=["global", "local"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize(
    ("seqlens", "d", "heads", "dtype"),
    [
        (FA2_SEQLENS[0], 59, "mha", torch.float16),
        (FA2_SEQLENS[1], 32, "gqa", torch.bfloat16),
        (FA2_SEQLENS[2], 111, "mqa", torch.float16),
        (FA2_SEQLENS[3], 80, "gqa", torch.bfloat16),
        (FA2_SEQLENS[4], 64, "mha", torch.float16),
        (FA2_SEQLENS[5], 96, "mqa", torch.bfloat16),
        (FA2_SEQLENS[6], 128, "gqa", torch.float16),
        (FA2_SEQLENS[7], 256, "mqa", torch.bfloat16),
    ],
    ids=lambda x: "x".join(map(str, x)) if isinstance(x, tuple) else str(x).replace("torch.", ""),
)
def test_flash_attn_2_varlen_grid(seqlens, d, heads, dtype, causal, local, softcap):
    """What flash-attn 2 returns for its own test grid: a window with causal keeps its left bound and gets
    right = 0 (flash-attn's reading; packattn's varlen_attention would refuse a right bound > 0)."""
    sq, sk = seqlens
    gen = torch.Generator().manual_seed(sq * 1000 + sk + d)
    # Three sequences of random lengths up to (sq, sk), one of them the longest, as flash-attn's random padding
    lens_q = [sq, *torch.randint(0, sq + 1, (2,), generator=gen).tolist()]
    lens_k = [sk, *torch.randint(1, sk + 1, (2,), generator=gen).tolist()]
    hq, hkv = FA2_HEADS[heads]
    case = make_case(lens_q, lens_k, hq=hq, hkv=hkv, d=d, dtype=dtype, seed=sq + sk)
    window = tuple(torch.randint(0, sk, (2,), generator=gen).tolist()) if local else (-1, -1)
    out, lse, _ = flash(case, return_attn_probs=True, causal=causal, window_size=window, softcap=softcap)
    expected = {"window_size": (window[0], 0 if causal else window[1]), "softcap": softcap}
    assert_matches_oracle(case, out, lse, **expected)


def test_flash_attn_window_bounds_at_max_seqlen_k_are_unbounded():
    """flash-attn reads a bound >= max_seqlen_k as -1; with Lq > Lk the literal bound would hide keys."""
    case = make_case([10, 3], [2, 3], hq=2, hkv=1, d=8, seed=4)
    args = (case.q, case.k, case.v, *case.tensors(), 10, 3)
    out = flash_attn_varlen_func(*args, window_size=(1, 3))  # right 3 >= max_seqlen_k: unbounded
    assert_matches_oracle(case, out, window_size=(1, -1))
    as_list = flash_attn_varlen_func(*args, window_size=[1, 3])
    as_tensor = flash_attn_varlen_func(*args, window_size=torch.tensor([1, 3]))
    assert torch.equal(out, as_list) and torch.equal(out, as_tensor)
    causal = flash_attn_varlen_func(*args, causal=True, window_size=(5, 7))  # left 5 >= 3: unbounded too
    assert torch.equal(causal, flash_attn_varlen_func(*args, causal=True))


@pytest.mark.parametrize("scale", [-0.3, 0.0], ids=["negative", "zero"])
def test_flash_attn_takes_a_scale_of_zero_or_below_as_flash_attn_2_does(scale):
    """packattn's own API wants a scale > 0; flash-attn 2 computes with any: so does its drop-in, gradients
    included (0: every visible key weighs the same)."""
    case = make_case(*SEED_CASE, hq=4, hkv=2, d=16)
    q = case.q.clone().requires_grad_()
    out, lse, _ = flash_attn_varlen_func(
        q, case.k, case.v, *case.tensors(), 7, 9, softmax_scale=scale, softcap=2.5, causal=True, return_attn_probs=True
    )
    mask = {"softmax_scale": scale, "softcap": 2.5, "causal": True}
    assert_matches_oracle(case, out.detach(), lse.detach(), **mask)
    ref = case.q.double().requires_grad_()
    ref_out, _ = oracle(ref, case.k.double(), case.v.double(), case.cu_q, case.cu_k, **mask)
    weights = torch.randn(out.shape, generator=torch.Generator().manual_seed(5))
    (out * weights).sum().backward()
    (ref_out * weights.double()).sum().backward()
    torch.testing.assert_close(q.grad, ref.grad.float(), atol=1e-5, rtol=1e-4)
    assert torch.equal(case.q, q.detach())  # q itself untouched


def test_flash_attn_reads_softcap_window_and_numpy_scale_as_flash_attn_2_does():
    """A cap of 0 or below is off, any negative window bound is unbounded, a NumPy scale is a number."""
    np = pytest.importorskip("numpy")
    case = make_case(*SEED_CASE, hq=4, hkv=2, d=16)
    plain = flash(case, causal=True)
    assert torch.equal(flash(case, causal=True, softcap=-1.0), plain)
    assert torch.equal(flash(case, causal=True, window_size=(-2, -5)), plain)
    assert torch.equal(flash(case, window_size=(-7, 2)), flash(case, window_size=(-1, 2)))
    assert torch.equal(flash(case, softmax_scale=np.float32(0.25)), flash(case, softmax_scale=0.25))
    assert torch.equal(flash(case, softcap=np.float32(2.5)), flash(case, softcap=2.5))
    assert torch.equal(flash(case, causal=True, softcap=float("nan")), plain)  # flash-attn caps only when > 0
    with pytest.raises(ValueError, match=r"^flash_attn_varlen_func: softmax_scale must be a finite number, got nan"):
        flash(case, softmax_scale=float("nan"))


def test_flash_attn_offsets_are_validated_with_its_name():
    case = make_case(*SEED_CASE)
    with pytest.raises(
        ValueError, match=r"^flash_attn_varlen_func: cu_seqlens_k must end at k.shape\[0\] \(25\), got 24"
    ):
        flash_attn_varlen_func(case.q, case.k, case.v, case.tensors()[0], torch.tensor([0, 9, 17, 24]), 7, 9)


@pytest.mark.parametrize("deterministic", [False, True])
def test_flash_attn_gradients(monkeypatch, deterministic):
    def drop_in(c: Case, **mask: object) -> tuple[torch.Tensor, torch.Tensor]:
        out, lse, _ = flash(c, deterministic=deterministic, return_attn_probs=True, **mask)
        return out, lse

    check_backward_through(monkeypatch, drop_in, causal=True, window_size=(5, -1))


# shared -----------------------------------------------------------------------------------------------------


def check_backward_through(monkeypatch: pytest.MonkeyPatch, drop_in, **mask: object) -> None:
    """Gradients through ``drop_in(case, **mask) -> (out, lse)`` against the oracle's (through out and LSE):
    the helpers' ``check_backward``, with its ``varlen_attention`` call routed through the drop-in."""

    def routed(q, k, v, cu_q, cu_k, *, return_lse, backend, **options):
        assert return_lse and backend is None and options == mask
        return drop_in(Case(q, k, v, case.cu_q, case.cu_k), **options)

    case = make_case(*SEED_CASE, hq=4, hkv=2, d=16, requires_grad=True)
    monkeypatch.setattr(packattn, "varlen_attention", routed)
    check_backward(None, case, **mask)  # type: ignore[arg-type]
