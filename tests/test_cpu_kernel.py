"""packattn's compiled CPU kernel: tiles and items at their edges, thread-count determinism, the validation
in front of it, and what happens when it cannot be built. (The cross-backend contract suite in
test_contract.py covers it too, through DEVICE_BACKENDS.)"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings

import packattn
from packattn import dispatch
from packattn.backends import cpu_kernel
from packattn.backends.cpu_kernel import build

from .helpers import DEVICE, Case, case_inputs, check_backward, check_forward, make_case, restride
from .strategies import BOUNDED, layouts

pytestmark = pytest.mark.skipif(
    DEVICE.type != "cpu" or cpu_kernel.BACKEND.unavailable_reason() is not None,
    reason=f"the cpu_kernel backend runs on CPU when built: {cpu_kernel.BACKEND.unavailable_reason()}",
)

MASKS = {
    "full": {},
    "causal": {"causal": True},
    "window": {"window_size": (70, 33)},
    "left_only": {"window_size": (5, -1)},
    "right_band": {"window_size": (-1, 130)},
    "softcap": {"softcap": 3.0, "causal": True},
}
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}

# Longer than a forward item (256 rows / G) and a key tile (256 forward, 128 backward), with Lq != Lk both
# ways, lengths that are no multiple of 16, an empty side, and a sequence whose first rows see no key.
LONG = ([300, 0, 1, 77, 520], [290, 5, 33, 0, 700])

# Decoded sequences (query rows x query heads per KV head <= 16: here up to 4 rows at G = 4) run as items of
# every KV head over chunks of 1024 keys, merged afterwards: keys over several chunks and at their edges,
# chunks that a window hides or leaves partly visible, no keys, no queries, a single key, and one prefill
# sequence (5 rows) between them, so both kinds of item share a call.
DECODE = ([1, 2, 4, 1, 0, 3, 5, 1], [3000, 1025, 0, 1024, 50, 2049, 1300, 1])


HEADS = {"mha": (4, 4), "gqa": (8, 2), "mqa": (5, 1)}


@pytest.mark.parametrize("mask", MASKS)
@pytest.mark.parametrize(
    ("heads", "dtype"), [("gqa", "fp32"), ("gqa", "bf16"), ("gqa", "fp16"), ("mha", "fp32"), ("mqa", "bf16")]
)
def test_forward_across_items_and_tiles(mask, heads, dtype):
    hq, hkv = HEADS[heads]
    case = make_case(*LONG, hq=hq, hkv=hkv, d=40, dv=24, dtype=DTYPES[dtype], seed=21)
    check_forward("cpu_kernel", case, **MASKS[mask])


@pytest.mark.parametrize("mask", MASKS)
@pytest.mark.parametrize("heads", [(2, 2), (6, 2)], ids=["mha", "gqa"])
def test_backward_across_items_and_tiles_fp32(mask, heads):
    lens_q, lens_k = [150, 0, 1, 40, 90], [140, 5, 17, 0, 200]
    case = make_case(lens_q, lens_k, hq=heads[0], hkv=heads[1], d=24, dv=16, seed=22, requires_grad=True)
    check_backward("cpu_kernel", case, **MASKS[mask])


@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_backward_low_precision_across_tiles(dtype):
    case = make_case([150, 3], [140, 200], hq=4, hkv=2, d=32, dtype=DTYPES[dtype], seed=23, requires_grad=True)
    check_backward("cpu_kernel", case, causal=True)


# Every way the kernel multiplies bf16 (AMX tiles, the AVX512_BF16 dot-product loop, fp32 tiles); those that
# do not run on this CPU and build are skipped with the reason.
BF16_PRODUCTS = ("amx", "avx512_bf16", "fp32")


@pytest.fixture(params=BF16_PRODUCTS)
def bf16_products(request, monkeypatch):
    runs_here = build.load().bf16_products()
    if request.param not in runs_here:
        pytest.skip(f"bf16 products {request.param} do not run here (only {runs_here})")
    monkeypatch.setenv(cpu_kernel.BF16_PRODUCTS_ENV, request.param)
    return request.param


@pytest.mark.parametrize("mask", ["full", "causal", "window", "softcap"])
def test_bf16_products_across_items_and_tiles(bf16_products, mask):
    fwd = make_case(*LONG, hq=8, hkv=2, d=40, dv=24, dtype=torch.bfloat16, seed=26)
    check_forward("cpu_kernel", fwd, **MASKS[mask])
    # Head dims that are no multiple of the 32 a dot-product step or the 64 columns of a packed block take.
    bwd = make_case(
        [150, 3, 0], [140, 200, 9], hq=4, hkv=2, d=72, dv=136, dtype=torch.bfloat16, seed=27, requires_grad=True
    )
    check_backward("cpu_kernel", bwd, **MASKS[mask])


def test_bf16_products_are_the_ones_asked_for(monkeypatch):
    """Each choice reaches the kernel: fp32 tiles keep the probabilities in fp32 for P V, the bf16 products
    round them, and the AMX and dot-product loops accumulate in different orders."""
    case = make_case([300, 77], [290, 700], hq=4, hkv=2, d=64, dtype=torch.bfloat16, seed=28)
    outs = {}
    for name in build.load().bf16_products():
        monkeypatch.setenv(cpu_kernel.BF16_PRODUCTS_ENV, name)
        outs[name] = _run(case, {"causal": True}, grads=False)[0]
    for a in outs:
        for b in outs:
            assert a == b or not torch.equal(outs[a], outs[b]), (a, b)
    monkeypatch.delenv(cpu_kernel.BF16_PRODUCTS_ENV)
    assert torch.equal(_run(case, {"causal": True}, grads=False)[0], outs[build.load().bf16_products()[0]])


@pytest.mark.parametrize("value", ["avx2", "AMX", "amx,fp32"])
def test_bad_bf16_products_name_the_variable(value, monkeypatch):
    monkeypatch.setenv(cpu_kernel.BF16_PRODUCTS_ENV, value)
    case = make_case([5, 7], [4, 8], hq=4, hkv=2, d=16, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=f"PACKATTN_CPU_BF16_PRODUCTS: expected one of .* got '{value}'"):
        _run(case, {}, grads=False)


@settings(BOUNDED, max_examples=30)
@given(layouts())
def test_random_layouts_backward_fp32(layout):
    case = make_case(
        layout.lens_q,
        layout.lens_k,
        hq=layout.hq,
        hkv=layout.hkv,
        d=layout.d,
        dv=layout.dv,
        seed=layout.seed,
        requires_grad=True,
    )
    check_backward("cpu_kernel", case, **layout.mask)


def test_strided_inputs_across_tiles():
    case = make_case([300, 20], [280, 20], hq=4, hkv=2, d=32, seed=24)
    for strides in ("heads_major", "last_dim_stride_2", "kv_broadcast"):
        check_forward("cpu_kernel", restride(case, strides), window_size=(100, 20))
    # V read in place by the products (fp32, unit last stride): one token's row for every key (stride 0)
    one_row = Case(case.q, case.k, case.v[:1].expand_as(case.v), case.cu_q, case.cu_k)
    check_forward("cpu_kernel", one_row, window_size=(100, 20))


def _run(case, mask, *, grads: bool) -> list[torch.Tensor]:
    cu_q, cu_k = case.tensors()
    out, lse = packattn.varlen_attention(
        case.q, case.k, case.v, cu_q, cu_k, return_lse=True, backend="cpu_kernel", **mask
    )
    if not grads:
        return [out, lse]
    gen = torch.Generator().manual_seed(5)
    dout, dlse = torch.randn(out.shape, generator=gen).to(out.dtype), torch.randn(lse.shape, generator=gen)
    return [out, lse, *torch.autograd.grad((out.float() * dout).sum() + (lse * dlse).sum(), (case.q, case.k, case.v))]


def test_parallel_loops_use_every_thread():
    """The build must compile ATen's parallel loops for torch's thread pool (OpenMP needs -fopenmp)."""
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        assert build.load()._test_parallel_threads() == 2
    finally:
        torch.set_num_threads(before)


# Many (sequence, KV head) pairs, and 4 of them: with 4 the backward runs its one-pass form on one thread and
# its two-pass form on two (it needs 4 per thread), which must agree to the bit.
THREAD_LAYOUTS = {"many": ([700, 3, 64, 0, 200, 129],) * 2, "few": ([300, 130],) * 2, "decode": DECODE}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("mask", ["full", "causal", "softcap"])
@pytest.mark.parametrize("layout", THREAD_LAYOUTS)
def test_one_and_two_threads_give_the_same_bits(dtype, mask, layout):
    """Forward and backward: every output element has one writer and a fixed order of accumulation."""
    _assert_same_bits_at_any_thread_count(
        make_case(*THREAD_LAYOUTS[layout], hq=4, hkv=2, d=32, dtype=DTYPES[dtype], seed=25, requires_grad=True),
        MASKS[mask],
    )


@pytest.mark.parametrize("layout", THREAD_LAYOUTS)
def test_one_and_two_threads_give_the_same_bits_per_bf16_products(bf16_products, layout):
    case = make_case(*THREAD_LAYOUTS[layout], hq=4, hkv=2, d=72, dtype=torch.bfloat16, seed=29, requires_grad=True)
    _assert_same_bits_at_any_thread_count(case, MASKS["causal"])


# Outputs of at least 1 MiB per thread go out with non-temporal stores when their rows are whole 64-byte
# lines (the other tests' outputs are smaller). 96 sequences of 40-88 tokens with 4 query heads and 2 KV heads
# of 64 dims give 3-6 MiB of output and 12 MiB of fp32 gradients: streamed at 1 thread (and at 2 where over
# 2 MiB), stored as usual at 16 threads, where the rule asks for 16 MiB.
STREAMED = [40 + (7 * i) % 49 for i in range(96)]


@pytest.mark.parametrize("dtype", DTYPES)
def test_streamed_outputs_match_the_oracle_and_give_the_same_bits(dtype):
    case = make_case(STREAMED, STREAMED, hq=4, hkv=2, d=64, dtype=DTYPES[dtype], seed=31, requires_grad=True)
    check_forward("cpu_kernel", case, causal=True)
    check_backward("cpu_kernel", case, causal=True)
    _assert_same_bits_at_any_thread_count(case, MASKS["causal"], threads=(1, 16, 2))


# Outputs of 32 MiB or more come from blocks that the kernel keeps when their tensors are freed (outputs.h).
# Sequences of every kind (no keys, no queries, decoded, one tile, several) repeated until out, dQ, dK and dV
# each pass 32 MiB: 8 heads of 64 dims in fp32, 16 in bf16 and fp16.
KEPT = ([0, 1, 5, 16, 33, 300] * 60, [7, 0, 40, 16, 33, 290] * 60)


def _kernel_call(q, k, v, cu_q, cu_k) -> list[torch.Tensor]:
    module = build.load()
    out, lse = module.forward(q, k, v, cu_q, cu_k, 0.125, 0.0, -1, 0, True, "")
    dout = torch.randn(out.shape, generator=torch.Generator().manual_seed(3)).to(out.dtype)
    delta = module.delta(out, dout)
    return [out, lse, *module.backward(q, k, v, dout, lse, delta, cu_q, cu_k, 0.125, 0.0, -1, 0, "")]


@pytest.mark.parametrize("dtype", DTYPES)
def test_outputs_in_kept_memory_are_written_whole(dtype, monkeypatch):
    """Outputs that land on freed blocks, poisoned with NaN, are the same bits as in newly allocated memory:
    every element is written, including the zeros of rows that see no key and of keys that no query sees."""
    heads = 8 if dtype == "fp32" else 16
    case = make_case(*KEPT, hq=heads, hkv=heads, d=64, dtype=DTYPES[dtype], seed=37)
    args = (case.q, case.k, case.v, *(t.long() for t in case.tensors()))
    module = build.load()
    module.release_output_cache()
    monkeypatch.setenv("PACKATTN_CPU_OUTPUT_CACHE_MIB", "0")
    fresh = _kernel_call(*args)
    monkeypatch.setenv("PACKATTN_CPU_OUTPUT_CACHE_MIB", "1024")
    first = _kernel_call(*args)
    big = [0, 2, 3, 4]  # out, dq, dk, dv; the LSE is smaller
    assert all(first[i].nbytes >= 32 * 2**20 for i in big)
    blocks = {first[i].data_ptr() for i in big}
    for t in first:
        t.fill_(float("nan"))
    del first, t
    assert module.kept_output_bytes() >= 4 * 32 * 2**20
    again = _kernel_call(*args)
    assert {again[i].data_ptr() for i in big} == blocks
    assert module.kept_output_bytes() == 0
    for a, b in zip(again, fresh, strict=True):
        assert torch.equal(a, b)
    del again, fresh, a, b
    module.release_output_cache()


def _out_of(mib: float) -> torch.Tensor:
    """A forward output of about ``mib`` MiB (fp32, 8 heads of 64 dims, sequences of 16 tokens)."""
    tokens = int(mib * 2**20) // (8 * 64 * 4) // 16 * 16
    q = torch.randn(tokens, 8, 64)
    cu = torch.arange(0, tokens + 1, 16)
    return build.load().forward(q, q, q, cu, cu, 0.125, 0.0, -1, -1, False, "")[0]


def test_kept_outputs_stay_within_the_limit(monkeypatch):
    module = build.load()
    module.release_output_cache()
    monkeypatch.setenv("PACKATTN_CPU_OUTPUT_CACHE_MIB", "0")
    _out_of(40)
    assert module.kept_output_bytes() == 0
    monkeypatch.setenv("PACKATTN_CPU_OUTPUT_CACHE_MIB", "100")
    _out_of(20)  # under 32 MiB: left to PyTorch's CPU allocator
    assert module.kept_output_bytes() == 0
    a, b, c = _out_of(40), _out_of(40), _out_of(40)
    size, newer = a.nbytes, {b.data_ptr(), c.data_ptr()}
    del a
    assert module.kept_output_bytes() == size
    del b
    assert module.kept_output_bytes() == 2 * size
    del c  # over the limit: the oldest block goes
    assert module.kept_output_bytes() == 2 * size
    x, y = _out_of(40), _out_of(40)
    assert {x.data_ptr(), y.data_ptr()} == newer and module.kept_output_bytes() == 0
    del x, y
    assert module.release_output_cache() == 2 * size and module.kept_output_bytes() == 0
    assert cpu_kernel.release_output_cache() == 0

    kept = _out_of(48)
    block = kept.data_ptr()
    del kept
    assert _out_of(39).data_ptr() == block  # an output that fills four fifths of a block reuses it
    assert _out_of(38).data_ptr() != block  # a smaller one would waste it
    module.release_output_cache()
    monkeypatch.setenv("PACKATTN_CPU_OUTPUT_CACHE_MIB", "30")
    _out_of(40)  # a block over the limit is not kept
    assert module.kept_output_bytes() == 0


def test_kept_outputs_are_ordinary_tensors():
    """A tensor on a kept block resizes, and the profiler sees its allocation and its free."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        out = _out_of(40)
        nbytes = out.nbytes
        del out
    sizes = [e.nbytes() for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"]
    assert nbytes in sizes and -nbytes in sizes
    out = _out_of(40)
    head = out[:16].clone()
    out.resize_(2 * out.shape[0], 8, 64)
    assert torch.equal(out[:16], head)


@pytest.mark.parametrize("value", ["lots", "-1", "1.5", " "])
def test_a_bad_output_cache_limit_names_the_variable(value, monkeypatch):
    monkeypatch.setenv("PACKATTN_CPU_OUTPUT_CACHE_MIB", value)
    expected = f"PACKATTN_CPU_OUTPUT_CACHE_MIB: expected a whole number of MiB >= 0 .*got '{value}'"
    with pytest.raises(ValueError, match=expected):
        _run(make_case([5, 7], [4, 8], hq=4, hkv=2, d=16), {}, grads=False)


def _assert_same_bits_at_any_thread_count(case, mask, threads=(1, 2, 1)):
    before = torch.get_num_threads()
    try:
        results = []
        for count in threads:
            torch.set_num_threads(count)
            results.append(_run(case, mask, grads=True))
    finally:
        torch.set_num_threads(before)
    for a, b, c in zip(*results):
        assert torch.equal(a, b) and torch.equal(a, c)


def test_default_cpu_dispatch_picks_it_except_float64():
    case = make_case([5, 2], [4, 6], dtype=torch.float64)
    assert "cpu_kernel takes float32, bfloat16 or float16 only, got torch.float64" in cpu_kernel.BACKEND.supports(
        case_inputs(case)
    )
    assert dispatch.select(case_inputs(case), None, "test").name == "cpu"
    assert dispatch.PRIORITY["cpu"][:2] == ("cpu_kernel", "cpu")
    for lens_q in ([9, 2], [1, 4, 0]):  # prefill, and decode (query rows x heads per KV head <= 16)
        inp = case_inputs(make_case(lens_q, [300, 90, 7][: len(lens_q)], hq=8, hkv=2))
        assert dispatch.select(inp, None, "test").name == "cpu_kernel"


@pytest.mark.parametrize("mask", [*MASKS, "wide_window"])
@pytest.mark.parametrize(("heads", "dtype"), [("gqa", "fp32"), ("gqa", "bf16"), ("gqa", "fp16"), ("mqa", "fp32")])
def test_decode_across_key_chunks(mask, heads, dtype):
    hq, hkv = HEADS[heads]
    lens_q = DECODE[0] if heads == "gqa" else [min(n, 3) for n in DECODE[0]]  # G = 5: up to 3 rows decoded
    case = make_case(lens_q, DECODE[1], hq=hq, hkv=hkv, d=40, dv=24, dtype=DTYPES[dtype], seed=31)
    check_forward("cpu_kernel", case, **({"window_size": (1500, 0)} if mask == "wide_window" else MASKS[mask]))


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_decode_reads_keys_of_any_strides(dtype):
    """Decoded rows take their scores from K's rows where they lie (fp32 with unit last stride) or widened
    ones: every layout, one token's row for every key (stride 0), and a head dim with a partial vector."""
    case = make_case(*DECODE, hq=8, hkv=2, d=40, dv=24, dtype=DTYPES[dtype], seed=34)
    one_row = Case(case.q, case.k[:1].expand_as(case.k), case.v, case.cu_q, case.cu_k)
    for strided in (*(restride(case, s) for s in ("heads_major", "last_dim_stride_2", "kv_broadcast")), one_row):
        check_forward("cpu_kernel", strided, causal=True)


def test_decode_with_every_bf16_products(bf16_products):
    case = make_case(*DECODE, hq=8, hkv=2, d=72, dv=136, dtype=torch.bfloat16, seed=32)
    check_forward("cpu_kernel", case, causal=True)
    check_forward("cpu_kernel", case, window_size=(1100, 20), softcap=5.0)


def test_decode_gradients():
    """The backward of decoded sequences (from the merged LSE) against the oracle."""
    case = make_case([1, 3, 2], [1500, 40, 2100], hq=8, hkv=2, d=24, seed=33, requires_grad=True)
    check_backward("cpu_kernel", case, causal=True)


class _Spy:
    """Stands in for the compiled module and records whether anything reached it."""

    def __init__(self, real):
        self.real, self.calls = real, 0

    def __getattr__(self, name):
        self.calls += 1
        return getattr(self.real, name)


BAD_INPUTS = {
    "k_dtype": ({"k": lambda c: c.k.half()}, TypeError),
    "head_dims": ({"k": lambda c: c.k[..., :8], "q": lambda c: c.q[..., :6]}, ValueError),
    "heads": ({"q": lambda c: c.q[:, :3]}, ValueError),
    "offsets_end": ({"cu_q": lambda c: torch.tensor([0, 5, 6])}, ValueError),
    "offsets_decrease": ({"cu_k": lambda c: torch.tensor([0, 7, 6, 12])}, ValueError),
    "offsets_dtype": ({"cu_k": lambda c: torch.tensor([0.0, 4.0, 12.0])}, TypeError),
    "window": ({"window_size": (-2, 0)}, ValueError),
    "softcap": ({"softcap": float("nan")}, ValueError),
    "float64": ({"all": lambda t: t.double()}, ValueError),
}


@pytest.mark.parametrize("bad", BAD_INPUTS)
def test_bad_inputs_never_reach_the_kernel(bad, monkeypatch):
    spy = _Spy(build.load())
    monkeypatch.setitem(build._state, "module", spy)
    case = make_case([5, 7], [4, 8], hq=4, hkv=2, d=16)
    change, error = BAD_INPUTS[bad]
    args = {"q": case.q, "k": case.k, "v": case.v, "cu_q": case.tensors()[0], "cu_k": case.tensors()[1]}
    options = {}
    for key, value in change.items():
        if key == "all":
            args.update({n: value(args[n]) for n in ("q", "k", "v")})
        elif callable(value):
            args[key] = value(case)
        else:
            options[key] = value
    spy.calls = 0
    with pytest.raises(error):
        packattn.varlen_attention(
            args["q"], args["k"], args["v"], args["cu_q"], args["cu_k"], backend="cpu_kernel", **options
        )
    assert spy.calls == 0


def _direct_args(**change):
    """Arguments of a valid direct call of the compiled forward and backward, with some replaced."""
    q, k, v = torch.randn(7, 4, 8), torch.randn(9, 2, 8), torch.randn(9, 2, 6)
    args = {"q": q, "k": k, "v": v, "cu_q": torch.tensor([0, 3, 7]), "cu_k": torch.tensor([0, 4, 9])}
    args.update(dout=torch.randn(7, 4, 6), lse=torch.zeros(4, 7), delta=torch.zeros(4, 7))
    args.update(scale=0.3, softcap=0.0, left=-1, right=-1, products="")
    args.update(change)
    return args


# What the C++ entry points refuse on their own when called directly (the second line behind validation):
# each would otherwise divide by zero or read out of bounds.
DIRECT_BAD = {
    "no_query_heads": ({"q": torch.randn(7, 0, 8), "dout": torch.randn(7, 0, 6)}, "query heads"),
    "no_kv_heads": ({"k": torch.randn(9, 0, 8), "v": torch.randn(9, 0, 6)}, "query heads"),
    "heads_not_multiple": ({"q": torch.randn(7, 3, 8), "dout": torch.randn(7, 3, 6)}, "multiple"),
    "int32_offsets": ({"cu_q": torch.tensor([0, 3, 7], dtype=torch.int32)}, "cu_q of dtype Long"),
    "offsets_past_tokens": ({"cu_k": torch.tensor([0, 4, 10])}, "cu_k to end at the token count"),
    "offsets_decreasing": ({"cu_q": torch.tensor([0, 5, 3, 7]), "cu_k": torch.tensor([0, 4, 4, 9])}, "non-decreasing"),
    "offsets_lengths": ({"cu_k": torch.tensor([0, 2, 4, 9])}, "of one length"),
    "strided_offsets": ({"cu_q": torch.tensor([0, 9, 3, 9, 7, 9])[::2]}, "contiguous"),
    "mixed_dtypes": ({"k": torch.randn(9, 2, 8).half()}, "of q's dtype"),
    "float64": ({"q": torch.randn(7, 4, 8).double()}, "dtype Float, BFloat16 or Half"),
    "head_dims": ({"k": torch.randn(9, 2, 5)}, "one head_dim"),
    "window": ({"left": -2}, "window bounds"),
    "scale": ({"scale": float("inf")}, "scale"),
    "products": ({"products": "avx512"}, "got 'avx512'"),
}
DIRECT_BAD_BACKWARD = {
    "short_lse": ({"lse": torch.zeros(4, 6)}, "lse of shape"),
    "fp16_delta": ({"delta": torch.zeros(4, 7).half()}, "delta of dtype Float"),
    "strided_lse": ({"lse": torch.zeros(7, 4).t()}, "lse contiguous"),
    "dout_shape": ({"dout": torch.randn(7, 4, 8)}, "dout of shape"),
}


@pytest.mark.parametrize("bad", [*DIRECT_BAD, *DIRECT_BAD_BACKWARD])
def test_entry_points_check_their_own_inputs(bad):
    change, message = {**DIRECT_BAD, **DIRECT_BAD_BACKWARD}[bad]
    a = _direct_args(**change)
    module = build.load()
    fwd = (a["q"], a["k"], a["v"], a["cu_q"], a["cu_k"], a["scale"], a["softcap"], a["left"], a["right"], True)
    fwd += (a["products"],)
    bwd = (a["q"], a["k"], a["v"], a["dout"], a["lse"], a["delta"], a["cu_q"], a["cu_k"])
    bwd += (a["scale"], a["softcap"], a["left"], a["right"], a["products"])
    if bad in DIRECT_BAD:
        with pytest.raises(RuntimeError, match=message):
            module.forward(*fwd)
    with pytest.raises(RuntimeError, match=message):
        module.backward(*bwd)


@pytest.mark.parametrize("dtype", DTYPES)
def test_entry_points_run_on_valid_direct_calls(dtype):
    """The checks above refuse only what is wrong: the same direct call, unchanged, runs, and returns out
    and the gradients in the inputs' dtype (the LSE in float32)."""
    a = {n: t.to(DTYPES[dtype]) if n in ("q", "k", "v", "dout") else t for n, t in _direct_args().items()}
    module = build.load()
    out, lse = module.forward(a["q"], a["k"], a["v"], a["cu_q"], a["cu_k"], 0.3, 0.0, -1, -1, True, "")
    assert out.shape == (7, 4, 6) and lse.shape == (4, 7)
    assert out.dtype == DTYPES[dtype] and lse.dtype == torch.float32
    grads = module.backward(
        a["q"], a["k"], a["v"], a["dout"], lse, a["delta"], a["cu_q"], a["cu_k"], 0.3, 0.0, -1, -1, ""
    )
    assert [g.shape for g in grads] == [a["q"].shape, a["k"].shape, a["v"].shape]
    assert all(g.dtype == DTYPES[dtype] for g in grads)


DELTA_BAD = {
    "out_2d": ((torch.randn(7, 4), torch.randn(7, 4)), "expected out of 3 dims"),
    "shapes": ((torch.randn(7, 4, 6), torch.randn(7, 4, 5)), "expected dout of out's shape"),
    "float64": ((torch.randn(7, 4, 6).double(), torch.randn(7, 4, 6).double()), "expected out of dtype Float"),
    "dtypes": ((torch.randn(7, 4, 6), torch.randn(7, 4, 6).bfloat16()), "expected dout of out's dtype"),
    "meta": ((torch.randn(7, 4, 6), torch.empty(7, 4, 6, device="meta")), "expected dout on the CPU"),
}


@pytest.mark.parametrize("bad", DELTA_BAD)
def test_delta_entry_point_checks_its_inputs(bad):
    args, message = DELTA_BAD[bad]
    with pytest.raises(RuntimeError, match=message):
        build.load().delta(*args)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("layout", ["contiguous", "expanded", "heads_major", "last_dim_stride_2"])
def test_delta_entry_point_on_any_strides(dtype, layout):
    """rowsum(dout * out) as (Hq, Tq), with dout as autograd hands it over: expanded from a sum, or a view."""
    gen = torch.Generator().manual_seed(33)
    dt = DTYPES[dtype]
    out = torch.randn(37, 3, 40, generator=gen).to(dt)
    dout = {
        "contiguous": lambda: torch.randn(37, 3, 40, generator=gen).to(dt),
        "expanded": lambda: torch.full((1, 1, 1), 0.5, dtype=dt).expand(37, 3, 40),
        "heads_major": lambda: torch.randn(3, 37, 40, generator=gen).to(dt).transpose(0, 1),
        "last_dim_stride_2": lambda: torch.randn(37, 3, 80, generator=gen).to(dt)[..., ::2],
    }[layout]()
    assert (dout.stride(2) == 0) == (layout == "expanded")
    got = build.load().delta(out, dout)
    expected = (out.double() * dout.double()).sum(-1).transpose(0, 1)
    assert got.dtype == torch.float32 and got.shape == (3, 37)
    torch.testing.assert_close(got.double(), expected, rtol=1e-5, atol=1e-5)


def _python(code: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    src = str(Path(packattn.__file__).parents[1])
    full = {**os.environ, "PYTHONPATH": src + os.pathsep + os.environ.get("PYTHONPATH", ""), **env}
    return subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=full, check=False
    )


FALLBACK_CHECK = """
import torch, packattn
from packattn import dispatch
from packattn.backends import cpu_kernel
print("REASON", cpu_kernel.BACKEND.unavailable_reason())
q = torch.randn(7, 2, 8); k = torch.randn(9, 2, 8); v = torch.randn(9, 2, 8)
cu_q = torch.tensor([0, 3, 7]); cu_k = torch.tensor([0, 4, 9])
out = packattn.varlen_attention(q, k, v, cu_q, cu_k, causal=True)
ref = packattn.varlen_attention(q, k, v, cu_q, cu_k, causal=True, backend="reference")
print("CLOSE", torch.allclose(out, ref, atol=1e-5))
from packattn.inputs import AttentionInputs, MaskSpec
from packattn.layout import SeqLayout
inp = AttentionInputs(q, k, v, SeqLayout.build(cu_q, cu_k, 7, 9), MaskSpec(scale=0.3))
print("CHOSEN", dispatch.select(inp, None, "test").name)
from packattn import cli
cli.main(["info"])
"""

FAILING_COMPILER = """#!/bin/sh
case "$*" in
  *.cpp*) echo "error: simulated compiler failure" >&2; exit 1 ;;
esac
exec c++ "$@"
"""


@pytest.mark.parametrize("how", ["no_compiler", "compile_error"])
def test_failed_build_leaves_the_cpu_backend_serving(how, tmp_path):
    if how == "no_compiler":
        cxx = str(tmp_path / "no-such-compiler")
        expected = f"no C++ compiler: {cxx!r} is not on PATH"
    else:
        script = tmp_path / "failing-c++"
        script.write_text(FAILING_COMPILER)
        script.chmod(0o755)
        cxx, expected = str(script), "the C++ kernel did not build: error: simulated compiler failure"
    res = _python(FALLBACK_CHECK, {"CXX": cxx, "PACKATTN_CACHE_DIR": str(tmp_path / "cache")})
    assert res.returncode == 0, res.stderr
    lines = dict(line.split(" ", 1) for line in res.stdout.splitlines() if line.split(" ")[0].isupper())
    assert lines["REASON"].startswith(expected), res.stdout
    assert lines["CLOSE"] == "True" and lines["CHOSEN"] == "cpu"
    info = [line.split(maxsplit=1) for line in res.stdout.splitlines() if line.strip().startswith("cpu_kernel")]
    assert info == [["cpu_kernel", f"unavailable: {lines['REASON']}"]]


def _copy_of_this_build(tmp_path: Path) -> Path:
    """A cache of its own holding a copy of this process's finished build (the same directory name)."""
    build.load()
    root = tmp_path / "cache"
    shutil.copytree(build.build_dir(), root / build.build_dir().name)  # keeps the files' times for ninja
    return root


def _kernel_serves(res: subprocess.CompletedProcess) -> None:
    assert res.returncode == 0, res.stderr
    lines = dict(line.split(" ", 1) for line in res.stdout.splitlines() if line.split(" ")[0].isupper())
    assert lines["REASON"] == "None" and lines["CLOSE"] == "True" and lines["CHOSEN"] == "cpu_kernel", res.stdout


def test_a_finished_build_loads_without_a_compiler_and_writes_nothing(tmp_path):
    """A build made ahead (``packattn build`` in an image) runs where no compiler is and the cache is read-only."""
    root = _copy_of_this_build(tmp_path)
    before = {p: p.stat().st_mtime_ns for p in root.rglob("*")}
    _kernel_serves(_python(FALLBACK_CHECK, {"PATH": str(tmp_path / "empty"), "PACKATTN_CACHE_DIR": str(root)}))
    assert {p: p.stat().st_mtime_ns for p in root.rglob("*")} == before


@pytest.mark.parametrize("damage", ["killed_build", "truncated_library"])
def test_a_killed_build_or_a_damaged_library_is_built_again_without_waiting(tmp_path, damage):
    """A build killed mid-way leaves torch's lock file and no mark (waited for forever before); a library cut
    short no longer matches its mark (a bus error at import before). Both are linked again and load."""
    root = _copy_of_this_build(tmp_path)
    where = root / build.build_dir().name
    library = where / f"{build._module_name()}.so"
    if damage == "killed_build":
        (where / build.READY).unlink()
        (where / "lock").write_text("")
    else:
        library.write_bytes(library.read_bytes()[:4096])
    res = _python(FALLBACK_CHECK, {"PACKATTN_CACHE_DIR": str(root)})
    _kernel_serves(res)
    assert "building the C++ CPU kernel" in res.stderr
    assert not (where / "lock").exists() and (where / build.READY).read_text().strip() == build._digest(library)


def test_cli_build_reports_the_cached_kernel(capsys):
    from packattn import cli

    assert cli.main(["build"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("cpu_kernel: ready in ") and str(build.build_dir()) in out


def _tests_pass_on_another_build(env: dict[str, str], files: list[str], select: str) -> str:
    """Runs the tests of ``files`` that ``select`` picks in a new process with ``env``, which makes another build
    of the kernel; asserts that they ran and passed, and returns pytest's report."""
    full = {k: v for k, v in os.environ.items() if k not in (build.EMULATE_ENV, cpu_kernel.BF16_PRODUCTS_ENV)}
    args = ["-q", "-x", "-rs", "-p", "no:cacheprovider", "--capture=sys"]  # sys: a crash's report reaches stderr
    res = subprocess.run(
        [sys.executable, "-m", "pytest", *args, *files, "-k", select],
        capture_output=True,
        text=True,
        timeout=900,
        env={**full, **env},
        check=False,
        cwd=Path(__file__).parents[1],
    )
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-2000:]
    assert " passed" in res.stdout and " failed" not in res.stdout
    return res.stdout


@pytest.mark.skipif(build.capability() != "AVX512", reason="the AVX2 build is this CPU's own build here")
def test_the_avx2_build_passes_the_kernel_tests():
    """What a CPU without AVX-512 compiles and runs (no dot-product kernel, the AVX2 exp and conversions),
    reached here by lowering ATen's capability: this file's forward, decode, thread-count and reused-memory
    tests on it."""
    env = {"ATEN_CPU_CAPABILITY": "avx2"}
    probe = _python("from packattn.backends.cpu_kernel import build; print(build.capability())", env)
    assert probe.stdout.strip() == "AVX2", probe.stderr
    _tests_pass_on_another_build(env, [__file__], "across_items_and_tiles or decode or same_bits or written_whole")


@pytest.mark.parametrize("value", ["avx512_fp16", "AVX512_BF16", "amx"])
def test_an_unknown_emulation_names_the_variable(value, monkeypatch):
    monkeypatch.setenv(build.EMULATE_ENV, value)
    with pytest.raises(RuntimeError, match=f"PACKATTN_KERNEL_EMULATE: expected one of .*avx512_bf16.* got '{value}'"):
        build.build_dir()


@pytest.mark.skipif(build.capability() != "AVX512", reason="the dot-product kernel is in the AVX512 build only")
def test_the_bf16_dot_product_kernel_passes_on_an_emulated_avx512_bf16():
    """The AVX512_BF16 dot-product loop (the bf16 default on AMD CPUs) on a CPU without the instruction: a build
    that does vdpbf16ps in AVX-512F instructions runs this file's bf16, decode and thread-count tests and the
    fuzz, with that loop as the bf16 default."""
    if "avx512_bf16" in build.load().bf16_products():
        pytest.skip("the dot-product loop already runs in this process's tests (the CPU has it, or it is emulated)")
    files = [__file__, str(Path(__file__).with_name("test_fuzz.py"))]
    select = "fuzz or edges or bf16 or low_precision or decode or same_bits"
    report = _tests_pass_on_another_build({build.EMULATE_ENV: "avx512_bf16"}, files, select)
    assert "avx512_bf16 do not run here" not in report, report[-3000:]
