"""The cross-backend contract suite: every backend the test device runs, against the float64 oracle (dtypes,
layouts, strides, masks, gradients, memory)."""

from __future__ import annotations

import pytest
import torch

import packattn
from packattn import dispatch
from packattn.backends import reference
from packattn.backends.base import backward_of
from packattn.testing import assert_close_to_oracle, attention_naive, oracle

from .helpers import (
    COMPILED_LSE_BACKENDS,
    DEVICE,
    DEVICE_BACKENDS,
    LSE_BACKENDS,
    STRIDES,
    assert_matches_oracle,
    attend,
    backend_mask_params,
    backend_reasons,
    check_backward,
    check_forward,
    interpreted,
    make_case,
    restride,
    supported,
)

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16, "fp64": torch.float64}

# (query lengths, key lengths): named patterns, empty sides and odd sizes included.
PATTERNS = {
    "equal": ([7, 13, 5], [7, 13, 5]),
    "design_example": ([5, 0, 7], [9, 8, 8]),
    "empty_k_side": ([4, 6, 3], [5, 0, 3]),
    "empty_both": ([0, 5, 0], [0, 5, 0]),
    "no_queries_at_all": ([0, 0], [3, 5]),
    "no_keys_at_all": ([4, 2], [0, 0]),
    "nothing_at_all": ([0, 0, 0], [0, 0, 0]),
    "length_one": ([1, 1, 2], [1, 3, 1]),
    "lq_gt_lk": ([9, 17], [4, 3]),
    "one_long": ([300], [300]),
    "cross": ([33, 10], [77, 77]),
    "equal_runs": ([16, 16, 16, 5, 5], [16, 16, 16, 7, 7]),
    "long_lq_lt_lk": ([600], [700]),
    "long_lq_gt_lk": ([700, 1], [300, 9]),
}
MASKS = {
    "full": {},
    "causal": {"causal": True},
    "window": {"window_size": (3, 2)},
    "window_causal": {"window_size": (4, -1), "causal": True},
    "right_band_1": {"window_size": (-1, 1)},
    "right_band_4": {"window_size": (-1, 4)},
    "softcap": {"softcap": 2.5},
    "scale": {"softmax_scale": 0.3},
}
# The refusals the backends owe (fragments of their reasons); every other (backend, mask) pair runs.
REFUSALS = {
    ("window", "sdpa"): "no sliding window (window_size=(3, 2))",
    ("window_causal", "sdpa"): "no sliding window (window_size=(4, 0))",
    ("right_band_1", "sdpa"): "no sliding window (window_size=(-1, 1))",
    ("right_band_4", "sdpa"): "no sliding window (window_size=(-1, 4))",
    ("softcap", "sdpa"): "no soft-capping (softcap=2.5)",
    ("softcap", "npu"): "no soft-capping (softcap=2.5)",
}


def pairs(*names: str) -> list[object]:
    """``(backend, mask)`` parameters for the named masks, only where the backend runs them."""
    return backend_mask_params({n: MASKS[n] for n in names})


@pytest.mark.parametrize(("backend", "mask"), pairs(*MASKS))
@pytest.mark.parametrize("pattern", PATTERNS)
def test_patterns_fp32(backend, mask, pattern):
    lens_q, lens_k = PATTERNS[pattern]
    check_forward(backend, make_case(lens_q, lens_k), **MASKS[mask])


def test_backends_refuse_masks_they_cannot_run_with_their_reasons():
    # Only the backends that serve this device (backend_mask_params' choice): the others refuse every mask.
    refused = {(p.values[1], p.values[0]) for p in backend_mask_params(MASKS, runs=False)}
    expected = {key: fragment for key, fragment in REFUSALS.items() if key[1] in DEVICE_BACKENDS}
    assert refused == set(expected)
    case = make_case([5, 0, 7], [9, 8, 8])
    cu_q, cu_k = case.tensors()
    for (mask, name), fragment in expected.items():
        why = backend_reasons(name, case, False, **MASKS[mask])
        with pytest.raises(ValueError) as info:
            packattn.varlen_attention(case.q, case.k, case.v, cu_q, cu_k, backend=name, **MASKS[mask])
        assert str(info.value) == f"varlen_attention: backend={name!r} cannot run these inputs: " + "; ".join(why)
        assert fragment in str(info.value)


def dtype_pairs(dtypes: list[str], *masks: str) -> list[object]:
    """``(backend, mask, dtype)`` parameters where the backend runs the mask in that dtype."""
    return [
        pytest.param(*p.values, dt, id=f"{dt}-{p.id}")
        for dt in dtypes
        for p in pairs(*masks)
        if supported(p.values[0], dtype=DTYPES[dt], **MASKS[p.values[1]])
    ]


@pytest.mark.parametrize(("backend", "mask", "dtype"), dtype_pairs(list(DTYPES), "full", "causal", "window", "softcap"))
def test_dtypes(backend, mask, dtype):
    # The last sequence spans several tiles of the compiled kernels; under the interpreter (128 x 64 tiles,
    # ~0.1 s a launch) two query tiles and three key tiles are enough (tests/test_triton.py goes further).
    long_q, long_k = (150, 170) if interpreted(backend) else (530, 600)
    case = make_case([37, 0, 64, 64, long_q], [50, 9, 64, 64, long_k], hq=4, hkv=1, d=64, dtype=DTYPES[dtype], seed=3)
    check_forward(backend, case, **MASKS[mask])


@pytest.mark.skipif("cpu" not in DEVICE_BACKENDS, reason="the cpu backend does not run on this device")
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize(("lq", "lk", "right"), [(5, 700, 3), (64, 600, 0)], ids=["band", "causal_lq_lt_lk"])
def test_cpu_rounds_16_bit_outputs_once_where_it_merges_two_calls(dtype, lq, lk, right):
    """Rows that see a prefix of the keys are an unmasked call merged with a causal square: merged in fp32,
    within twice the error of a single SDPA call in the same dtype (stricter than the naive baseline)."""
    visible = torch.arange(lk)[None] <= torch.arange(lq)[:, None] + lk - lq + right
    for seed in range(6):
        case = make_case([lq], [lk], hq=2, hkv=2, d=64, dtype=dtype, seed=seed)
        q, k, v = (t.transpose(0, 1) for t in (case.q, case.k, case.v))
        plain = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=visible).transpose(0, 1)
        want, _ = oracle(case.q, case.k, case.v, case.cu_q, case.cu_k, window_size=(-1, right))
        got, _ = attend("cpu", case, window_size=(-1, right))
        assert_close_to_oracle(got, want, plain, name=f"seed {seed}", floor=0.0)


@pytest.mark.parametrize(("backend", "mask"), pairs("full", "causal"))
@pytest.mark.parametrize("heads", [(4, 4), (8, 2), (6, 1)], ids=["mha", "gqa", "mqa"])
@pytest.mark.parametrize("dims", [(32, 32), (48, 16), (16, 40)], ids=["d32", "dv_smaller", "dv_larger"])
def test_heads_and_dims(backend, mask, heads, dims):
    hq, hkv = heads
    d, dv = dims
    check_forward(backend, make_case([12, 1, 30], [12, 19, 30], hq=hq, hkv=hkv, d=d, dv=dv), **MASKS[mask])


@pytest.mark.parametrize(
    ("backend", "mask", "strides"),
    [
        pytest.param(*p.values, s, id=f"{p.id}-{s}")
        for p in pairs("full", "causal", "window", "right_band_1")
        for s in STRIDES
    ],
)
def test_any_strides(backend, mask, strides):
    # Runs of equal lengths (batched views on the cpu backend), empty sides and a single query.
    case = make_case([16, 16, 5, 0, 9, 1], [16, 16, 7, 3, 0, 4], hq=4, hkv=2, d=16, seed=4)
    check_forward(backend, restride(case, strides), **MASKS[mask])


def test_long_sequence_crosses_many_tiles():
    # 700 queries x 1100 keys: several query blocks and key chunks, causal and windowed.
    case = make_case([700], [1100], hq=2, hkv=1, d=16, seed=5)
    for mask in ({"causal": True}, {"window_size": (130, 70)}, {}):
        check_forward("reference", case, **mask)


# Sequence 0 has Lq=6 > Lk=2, so the bottom-right masks hide its first rows; sequence 1 has no keys.
HIDDEN_ROWS_OF_SEQ0 = {"causal": 4, "window": 2, "right_band_1": 3}


@pytest.mark.parametrize(("backend", "mask"), pairs(*HIDDEN_ROWS_OF_SEQ0))
def test_rows_without_keys_are_zero_and_minus_inf(backend, mask):
    case = make_case([6, 3, 2], [2, 0, 5])
    n = HIDDEN_ROWS_OF_SEQ0[mask]
    hidden = torch.tensor([1] * n + [0] * (6 - n) + [1, 1, 1, 0, 0], dtype=torch.bool)
    out, lse = attend(backend, case, **MASKS[mask])
    assert torch.all(out[hidden] == 0) and torch.isfinite(out).all()
    if lse is not None:
        assert torch.all(lse[:, hidden] == float("-inf")) and torch.isfinite(lse[:, ~hidden]).all()
    assert_matches_oracle(case, out, lse, **MASKS[mask])


@pytest.mark.parametrize("backend", DEVICE_BACKENDS)
def test_a_batch_in_which_no_row_sees_a_key_backpropagates_zeros(backend):
    """Every sequence without keys (a ring step's empty key block), or no queries at all: the output still
    belongs to the graph, and every input gets a zero gradient."""
    for lens in (([2, 3], [0, 0]), ([0, 0], [3, 2])):
        case = make_case(*lens, hq=2, hkv=1, d=8, seed=6, requires_grad=True)
        out, _ = attend(backend, case)
        grads = torch.autograd.grad(out.sum(), (case.q, case.k, case.v))
        assert all(g.shape == t.shape and not g.any() for g, t in zip(grads, (case.q, case.k, case.v), strict=True))


@pytest.mark.parametrize("backend", [None, *DEVICE_BACKENDS], ids=["default", *DEVICE_BACKENDS])
def test_offsets_without_host_copies_with_them_and_on_meta(backend):
    """Host copies are trusted: with them, offsets on the meta device (which hold no values) work."""
    case = make_case([5, 0, 7], [9, 8, 8], hq=4, hkv=2, d=64, dv=32)
    meta = tuple(t.to("meta") for t in case.tensors())
    runs = [attend(backend, case, causal=True), attend(backend, case, host=True, causal=True)]
    runs.append(attend(backend, case, offsets=meta, host=True, causal=True))
    for out, lse in runs:
        assert_matches_oracle(case, out, lse, causal=True)
        assert torch.equal(out, runs[0][0])


EQUIVALENT_MASKS = {
    "causal": ({"causal": True}, {"window_size": (-1, 0)}),
    "causal_left_3": ({"causal": True, "window_size": (3, -1)}, {"window_size": (3, 0)}),
}


@pytest.mark.parametrize(
    ("backend", "masks"),
    [
        pytest.param(b, m, id=f"{m}-{b}")
        for m, pair in EQUIVALENT_MASKS.items()
        for b in DEVICE_BACKENDS
        if all(supported(b, **mask) for mask in pair)
    ],
)
def test_causal_is_exactly_right_window_zero(backend, masks):
    case = make_case([6, 3, 9, 0, 1], [2, 7, 9, 4, 5])
    causal, window = EQUIVALENT_MASKS[masks]
    (out, lse), (out_w, lse_w) = attend(backend, case, **causal), attend(backend, case, **window)
    assert torch.equal(out, out_w)
    assert (lse is None and lse_w is None) or torch.equal(lse, lse_w)
    assert_matches_oracle(case, out, lse, **causal)


# Gradients --------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("backend", "mask"), pairs("full", "causal", "window", "softcap"))
@pytest.mark.parametrize("dtype", ["fp32", "bf16", "fp16"])
def test_backward_matches_oracle(backend, mask, dtype):
    case = make_case(
        [9, 0, 20, 3], [14, 6, 20, 0], hq=4, hkv=2, d=16, dv=24, dtype=DTYPES[dtype], seed=7, requires_grad=True
    )
    check_backward(backend, case, **MASKS[mask])


@pytest.mark.parametrize("backend", LSE_BACKENDS)
@pytest.mark.parametrize("mask", ["full", "causal"])
def test_backward_without_return_lse(backend, mask):
    """Gradients need the LSE even when the caller does not ask for it (the cpu backend skips it otherwise)."""
    case = make_case([9, 0, 20, 3], [14, 6, 20, 0], seed=8, requires_grad=True)
    cu_q, cu_k = case.tensors()
    dout = torch.randn(case.q.shape[0], case.q.shape[1], case.v.shape[2])
    grads = []
    for with_lse in (False, True):
        res = packattn.varlen_attention(
            case.q, case.k, case.v, cu_q, cu_k, return_lse=with_lse, backend=backend, **MASKS[mask]
        )
        out = res[0] if with_lse else res
        grads.append(torch.autograd.grad((out * dout).sum(), (case.q, case.k, case.v)))
    for without, with_ in zip(*grads):  # with return_lse=True, test_backward_matches_oracle checks them
        assert torch.equal(without, with_)


def _one_hot_rows(lq: int, lk: int, d: int, hq: int, hkv: int, magnitude: float) -> tuple[torch.Tensor, ...]:
    """q, k, v whose scores are ~ ``magnitude`` with one key per query row ahead of the rest by far more than
    the softmax can see: keys evenly on a circle in a random plane, each query head aimed at one of them."""
    gen = torch.Generator().manual_seed(5)
    plane = torch.linalg.qr(torch.randn(d, 2, generator=gen, dtype=torch.float64))[0]
    radius = magnitude**0.5 * d**0.25  # scores: radius**2 / sqrt(d) * cos(angle)
    angles = torch.arange(lk, dtype=torch.float64) * (2 * torch.pi / lk)
    point = radius * torch.stack([angles.cos(), angles.sin()], -1) @ plane.T  # (lk, d)
    q = point[torch.randint(0, lk, (lq, hq), generator=gen)]
    k = point[:, None, :].expand(lk, hkv, d)
    v = torch.randn(lk, hkv, d, generator=gen, dtype=torch.float64)
    return tuple(x.float().contiguous().to(DEVICE) for x in (q, k, v))


# (query rows, keys, query heads, KV heads): GQA, MHA (the C++ kernel reads fp32 queries in place there), and
# decode (the C++ kernel's key chunks of all KV heads, merged into the LSE).
ONE_HOT_SHAPES = {"gqa": (300, 600, 2, 1), "mha": (300, 600, 2, 2), "decode": (2, 2500, 4, 1)}


@pytest.mark.parametrize("shape", ONE_HOT_SHAPES)
@pytest.mark.parametrize("backend", DEVICE_BACKENDS)
def test_huge_scores_one_hot_rows_give_exact_gradients(backend, shape):
    """Scores ~ 1e6, where one fp32 ulp is 0.06: a backward that recomputes a score or the LSE with any other
    rounding than the forward's gets exp(s - lse) != 1 for the one key a row sees (a 0.9x dV before). dV is
    the probabilities' transpose times dO; dQ and dK are ~0 here, with the rounding of
    delta = rowsum(dO * out) times |k| ~ 2000 on every flash-style backward, so they are not compared."""
    lq, lk, hq, hkv = ONE_HOT_SHAPES[shape]  # past the compiled kernels' key tiles
    if interpreted(backend):
        lq, lk = min(lq, 20), 100
    q, k, v = (x.requires_grad_() for x in _one_hot_rows(lq, lk, 16, hq, hkv, 1e6))
    cu_q, cu_k = torch.tensor([0, lq], dtype=torch.int32), torch.tensor([0, lk], dtype=torch.int32)
    dout = torch.randn(lq, hq, 16, generator=torch.Generator().manual_seed(6)).to(DEVICE)
    out = packattn.varlen_attention(q, k, v, cu_q, cu_k, backend=backend)
    (got,) = torch.autograd.grad(out, (v,), dout)

    def dv(dtype: torch.dtype) -> torch.Tensor:
        xs = [t.detach().to(dtype, copy=True).requires_grad_() for t in (q, k, v)]
        o, _ = attention_naive(*xs, [0, lq], [0, lk])
        return torch.autograd.grad(o, xs[2], dout.to(dtype))[0]

    assert_close_to_oracle(got, dv(torch.float64), dv(torch.float32), name="dv")


# The backends whose gradients come from the reference backward (the reference itself, cpu).
REFERENCE_BACKWARD = [
    b for b in DEVICE_BACKENDS if b == "reference" or dispatch.BACKENDS[b].gradients[0] == backward_of("reference")
]


@pytest.mark.parametrize("backend", REFERENCE_BACKWARD)
@pytest.mark.parametrize("mask", ["full", "causal", "window", "right_band_1"])
def test_backward_across_tiles(backend, mask, monkeypatch):
    """Tiles of 4 queries x 8 keys: every sequence spans several, some fully hidden, some partly."""
    monkeypatch.setattr(reference, "BLOCK_Q", 4)
    monkeypatch.setattr(reference, "BLOCK_K", 8)
    case = make_case([13, 0, 22, 5, 9], [6, 7, 30, 0, 9], hq=4, hkv=2, d=16, seed=9, requires_grad=True)
    check_backward(backend, case, **MASKS[mask])


@pytest.mark.parametrize(
    ("backend", "mask"),
    [pytest.param(*p.values[:2], id=p.id[5:]) for p in dtype_pairs(["fp64"], "full", "causal", "window", "softcap")],
)
@pytest.mark.parametrize("dv", [4, 3], ids=["dv_eq_d", "dv_ne_d"])
def test_gradcheck_float64(backend, mask, dv):
    case = make_case(
        [3, 0, 4, 2], [4, 2, 4, 0], hq=2, hkv=1, d=4, dv=dv, dtype=torch.float64, seed=11, requires_grad=True
    )
    with_lse = supported(backend, return_lse=True, **MASKS[mask])
    cu_q, cu_k = case.tensors()

    def f(q, k, v):
        res = packattn.varlen_attention(q, k, v, cu_q, cu_k, return_lse=with_lse, backend=backend, **MASKS[mask])
        return (res[0], res[1].nan_to_num(0.0, 0.0, 0.0)) if with_lse else res

    # Triton's interpreter costs ~0.1 s a launch: check random projections of the Jacobian (2 launches per
    # input instead of 2 per element); tests/test_triton.py compares its fp64 gradients with the oracle's.
    fast = interpreted(backend)
    assert torch.autograd.gradcheck(f, (case.q, case.k, case.v), fast_mode=fast)


# Memory -----------------------------------------------------------------------------------------------

# An eighth of one fp32 score matrix for all heads at L = 4096 (4 x 4096 x 4096 x 4 bytes = 256 MiB).
SCORES_BOUND_MIB = 4 * 4096 * 4096 * 4 / 2**20 / 8


def _peak_extra_mib(run, length: int) -> float:
    """Peak memory beyond the output of ``run(case, cu_q, cu_k)`` on one sequence of ``length`` tokens."""
    from packattn.bench.runner import peak_extra_mib

    case = make_case([length], [length], hq=4, hkv=4, d=32, seed=2)
    cu_q, cu_k = case.tensors()
    return peak_extra_mib(lambda: run(case, cu_q, cu_k), length * 4 * 32 * 4)


@pytest.mark.parametrize("backend", COMPILED_LSE_BACKENDS)
def test_memory_grows_linearly_without_score_matrices(backend):
    """Peak memory beyond the output, for one long sequence: no (L, L) score matrix, linear growth."""
    peaks = {
        n: _peak_extra_mib(lambda c, a, b: packattn.varlen_attention(c.q, c.k, c.v, a, b, backend=backend), n)
        for n in (2048, 4096)
    }
    assert min(peaks.values()) > 0, peaks  # the profiler saw the call's allocations
    assert peaks[4096] < SCORES_BOUND_MIB, peaks
    assert peaks[4096] < 2.5 * max(peaks[2048], 1.0), peaks


def test_memory_measurement_sees_a_score_matrix():
    """Control: the naive computation, which builds (H, L, L) scores, breaks the bound at half the length."""
    naive = _peak_extra_mib(lambda c, a, b: attention_naive(c.q, c.k, c.v, c.cu_q, c.cu_k), 2048)
    assert naive > SCORES_BOUND_MIB, naive
