"""The ``triton`` backend beyond the generic backend tests: sequences across many tiles (16 x 16 tiles under
the interpreter), every dtype with GQA and ``Dv != D``, gradients through the LSE, determinism, its refusals
and its tile choices. On CPU the kernels run in Triton's interpreter (tests/conftest.py sets it)."""

from __future__ import annotations

import dataclasses
import subprocess
import sys

import pytest
import torch

import packattn
from packattn.backends import PRIORITY
from packattn.backends import triton as tri
from packattn.inputs import AttentionInputs, MaskSpec
from packattn.layout import SeqLayout

from .helpers import (
    DEVICE,
    FAKE_DEVICE,
    STRIDES,
    case_inputs,
    check_backward,
    check_forward,
    interpreted,
    make_case,
    restride,
)

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16, "fp64": torch.float64}
MASKS = {
    "full": {},
    "causal": {"causal": True},
    "window": {"window_size": (19, 7)},
    "window_causal": {"window_size": (21, -1), "causal": True},
    "right_band": {"window_size": (-1, 3)},
    "softcap": {"softcap": 2.5},
}
# Several 16-row tiles per sequence; Lq > Lk and Lq < Lk; empty query side, key side and both.
LENS_Q = [37, 0, 64, 5, 70, 0, 1]
LENS_K = [50, 9, 64, 0, 41, 0, 18]


@pytest.fixture(autouse=True)
def small_tiles(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(tri, "INTERPRETER_BLOCKS", (16, 16))


# On a GPU every dtype with every mask. Under the interpreter (~0.1 s a launch), where the masks' arithmetic
# is the same Python in every dtype: every dtype with the full mask, every mask in fp32 and one other dtype.
FORWARD = (
    [(dt, m) for dt in DTYPES for m in MASKS]
    if not interpreted("triton")
    else [
        *((dt, "full") for dt in DTYPES),
        *(("fp32", m) for m in MASKS if m != "full"),
        ("bf16", "causal"),
        ("fp16", "window"),
        ("fp64", "window_causal"),
        ("bf16", "right_band"),
        ("fp16", "softcap"),
    ]
)


@pytest.mark.parametrize(("dtype", "mask"), [pytest.param(*p, id="-".join(p)) for p in FORWARD])
def test_forward_across_tiles(dtype, mask):
    case = make_case(LENS_Q, LENS_K, hq=3, hkv=1, d=24, dv=40, dtype=DTYPES[dtype], seed=21)
    check_forward("triton", case, **MASKS[mask])


BACKWARD = [
    *(("fp32", m) for m in ("full", "causal", "window", "right_band", "softcap")),
    *(("fp64", m) for m in ("full", "window", "softcap")),
    ("bf16", "causal"),
]


@pytest.mark.parametrize(("dtype", "mask"), [pytest.param(*p, id="-".join(p)) for p in BACKWARD])
def test_backward_with_lse_gradient_across_tiles(dtype, mask):
    """dq, dk, dv through out and the LSE (MQA: one KV head sums the gradients of both query heads)."""
    case = make_case(LENS_Q, LENS_K, hq=2, hkv=1, d=40, dv=24, dtype=DTYPES[dtype], seed=22, requires_grad=True)
    check_backward("triton", case, **MASKS[mask])


@pytest.mark.parametrize("strides", STRIDES)
def test_strides_forward_and_backward(strides):
    shape = {"hq": 4, "hkv": 2, "d": 16, "dv": 8, "seed": 23}
    check_forward("triton", restride(make_case([20, 0, 33], [17, 5, 40], **shape), strides), causal=True)
    if strides != "kv_broadcast":  # an expanded view is not a view of the leaves check_backward differentiates
        case = make_case([20, 0, 33], [17, 5, 40], **shape, requires_grad=True)
        check_backward("triton", restride(case, strides), window_size=(9, 2))


def test_runs_are_bit_identical():
    case = make_case(LENS_Q, LENS_K, hq=2, hkv=1, d=32, seed=24, requires_grad=True)
    cu_q, cu_k = case.tensors()
    results = []
    for _ in range(2):
        out, lse = packattn.varlen_attention(
            case.q, case.k, case.v, cu_q, cu_k, causal=True, return_lse=True, backend="triton"
        )
        grads = torch.autograd.grad((out * out).sum() + lse.nan_to_num(0.0, 0.0, 0.0).sum(), (case.q, case.k, case.v))
        results.append((out, lse, *grads))
    for a, b in zip(*results):
        assert torch.equal(a, b)


def test_rows_without_keys_get_zero_gradients_and_no_nan():
    """Lq > Lk under causal hides the first rows; the second sequence has no keys at all."""
    case = make_case([40, 20], [8, 0], hq=2, hkv=1, d=16, seed=25, requires_grad=True)
    cu_q, cu_k = case.tensors()
    out, lse = packattn.varlen_attention(case.q, case.k, case.v, cu_q, cu_k, causal=True, return_lse=True)
    hidden = torch.tensor([True] * 32 + [False] * 8 + [True] * 20)
    assert torch.all(out[hidden] == 0) and torch.all(lse[:, hidden] == float("-inf"))
    dq, dk, dv = torch.autograd.grad(out.sum(), (case.q, case.k, case.v))
    assert torch.all(dq[hidden] == 0)
    assert all(torch.isfinite(g).all() for g in (dq, dk, dv))


@pytest.mark.skipif(FAKE_DEVICE is not None, reason="checks the real declarations, which the fake device replaces")
def test_refusals_name_the_reason(monkeypatch):
    case = make_case([3, 2], [4, 1], hq=2, hkv=1, d=8)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    if DEVICE.type == "cpu":
        assert tri.BACKEND.supports(case_inputs(case)) == [
            "CPU tensors run only under Triton's interpreter (set TRITON_INTERPRET=1)"
        ]
    wide = make_case([3], [4], d=264)
    assert "triton takes head dims up to 256, got D=264 and Dv=264" in tri.BACKEND.supports(case_inputs(wide))
    meta = case_inputs(case)
    meta = type(meta)(meta.q.to("meta"), meta.k.to("meta"), meta.v.to("meta"), meta.layout, meta.mask)
    assert tri.BACKEND.supports(meta) == ["triton runs on CUDA or CPU tensors only, got meta"]


@pytest.mark.skipif(FAKE_DEVICE is not None, reason="checks the real declarations, which the fake device replaces")
def test_dispatch_tries_it_on_cuda_only():
    assert "triton" not in PRIORITY["cpu"]
    cuda = PRIORITY["cuda"]
    assert cuda.index("triton") < cuda.index("sdpa")


@pytest.mark.parametrize("dtype", DTYPES)
def test_gpu_tiles_are_powers_of_two_at_least_16(dtype):
    for stage in tri.STAGES:
        for head_dim in (1, 16, 64, 96, 128, 192, 256):
            for cfg in tri.candidates(stage, DTYPES[dtype], head_dim, head_dim):
                for size in (cfg.m, cfg.n):
                    assert size >= 16 and size & (size - 1) == 0, (stage, head_dim, cfg)


@pytest.mark.parametrize("dtype", DTYPES)
def test_tiles_follow_the_gpus_shared_memory(dtype):
    """The first candidate that fits is chosen: more shared memory never gives smaller tiles, and a GPU
    with too little for every candidate gets None (the backend then declines, see below)."""
    dt = DTYPES[dtype]
    for stage in tri.STAGES:
        for head_dim in (64, 128, 256):
            order = tri.candidates(stage, dt, head_dim, head_dim)
            chosen = [tri.blocks(stage, dt, head_dim, head_dim, tri.Target(80, kb * 1024)) for kb in (48, 99, 163, 227)]
            ranks = [order.index(c) if c else len(order) for c in chosen]
            assert ranks == sorted(ranks, reverse=True), (stage, head_dim, chosen)
            for c, kb in zip(chosen, (48, 99, 163, 227)):
                assert c is None or tri.shared_bytes(stage, c, dt, head_dim, head_dim) <= kb * 1024
    assert tri.blocks("forward", dt, 64, 64, tri.Target(80, 4 * 1024)) is None


def test_declines_what_no_tile_fits_on_the_gpu():
    """fp64 at head dim 256 with gradients needs more than sm86's 99 KB: declined with the reason; forward
    only, or on sm90, it runs."""
    q = torch.empty(8, 2, 256, dtype=torch.float64, device="meta")
    cu = torch.tensor([0, 8])
    inp = AttentionInputs(q, q, q, SeqLayout.build(cu, cu, 8, 8), MaskSpec(0.1), grad=True)
    (reason,) = tri.tile_reasons(inp, tri.TARGETS["sm86"])
    assert reason == "no dkdv/dq tiles for torch.float64 at head dims (256, 256) fit this GPU's 99 KB of shared memory"
    assert tri.tile_reasons(dataclasses.replace(inp, grad=False), tri.TARGETS["sm86"]) == []
    assert tri.tile_reasons(inp, tri.TARGETS["sm90"]) == []
    assert tri.tile_reasons(inp, None) == []  # the interpreter takes any tile


@pytest.mark.skipif(
    torch.cuda.is_available(),
    reason="with a CUDA device, torch_varlen's check imports torch.nn.attention.varlen, whose import loads Triton",
)
def test_importing_packattn_does_not_import_triton():
    code = "import sys, packattn; packattn.info(); assert 'triton' not in sys.modules, 'triton imported'"
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False)
    assert res.returncode == 0, res.stderr


def test_more_query_heads_than_a_launch_grid_holds_are_declined():
    many = case_inputs(make_case([1], [1], hq=65536, hkv=1, d=8))
    assert "triton takes at most 65535 query heads, got 65536" in tri.BACKEND.supports(many)
    assert not any(
        "query heads" in r for r in tri.BACKEND.supports(case_inputs(make_case([1], [1], hq=65535, hkv=1, d=8)))
    )
