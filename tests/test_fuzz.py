"""Differential fuzz: random packed batches through every compiled backend against the float64 oracle.

Each example draws a layout (empty sides on either or both), head dims D and Dv from 1 to 512
independently, MHA/GQA/MQA, the inputs' memory (contiguous, head-major, last-dim stride 2, K/V heads
broadcast with stride 0, V a view overlapping K), a mask (causal, windows with bounds up to ``sys.maxsize``),
softcap, scale and dtype. It checks out, LSE and the gradients of q, k, v (through out and LSE) against the
oracle with the tolerance of plain PyTorch in the same dtype (for dQ and dK, plus what the rounding of out
moves them by in a flash-style backward, computed exactly: see :func:`_out_rounding_in_grads`), and that
the C++ kernel gives the same bits on 1 and 2 threads. ``PACKATTN_FUZZ_EXAMPLES=N`` runs N random examples
instead of CI's fixed few (the long mode); :data:`EDGES` are fixed cases at the limits, which
``tools/sanitize.sh`` also runs under AddressSanitizer.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import packattn
from packattn.inputs import compute_dtype
from packattn.testing import assert_close_to_oracle, attention_naive

from .helpers import COMPILED_LSE_BACKENDS, DEVICE, as_received, offsets, supported

LONG = int(os.environ.get("PACKATTN_FUZZ_EXAMPLES", "0"))
FUZZ = settings(
    max_examples=LONG or 60,
    deadline=None,
    derandomize=not LONG,  # CI: the same examples every run; the long mode: new ones
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
MEMORY = ("contiguous", "heads_major", "last_dim_stride_2", "kv_broadcast", "v_overlaps_k")
HUGE = 2**60  # bounds from here on are unbounded (README)


@dataclass(frozen=True)
class Fuzz:
    lens_q: list[int]
    lens_k: list[int]
    hq: int
    hkv: int
    d: int
    dv: int
    memory: str
    mask: dict[str, Any] = field(default_factory=dict)
    dtype: torch.dtype = torch.float32
    seed: int = 0


def _views(memory: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """q, k, v as the layout ``memory`` holds them, built from leaves (so gradients reach the leaves)."""
    if memory == "heads_major":  # (H, T, D) storage
        return tuple(x.transpose(0, 1).contiguous().transpose(0, 1) for x in (q, k, v))
    if memory == "last_dim_stride_2":
        return tuple(torch.stack([x, torch.zeros_like(x)], -1).flatten(-2)[..., ::2] for x in (q, k, v))
    if memory == "kv_broadcast":  # every KV head reads the first one: stride 0
        return q, k[:, :1].expand_as(k), v[:, :1].expand_as(v)
    if memory == "v_overlaps_k":  # V is the leading Dv columns of K's memory (needs Dv <= D)
        return q, k, k[..., : v.shape[2]] + 0 * v
    return q, k, v


def _oracle_mask(mask: dict[str, Any]) -> dict[str, Any]:
    """The mask as the oracle reads it: bounds from 2**60 on are unbounded."""
    left, right = mask.get("window_size", (-1, -1))
    return {**mask, "window_size": tuple(-1 if b >= HUGE else b for b in (left, right))}


@st.composite
def fuzz_cases(draw: st.DrawFn) -> Fuzz:
    batch = draw(st.integers(1, 5))
    hkv, g = draw(st.integers(1, 3)), draw(st.sampled_from([1, 1, 2, 4]))
    dims = st.one_of(st.integers(1, 72), st.integers(73, 512))
    d, dv = draw(dims), draw(dims)
    longest = 48 if max(d, dv) <= 128 else 12  # bounded work at the largest head dims
    lens = st.lists(st.integers(0, longest), min_size=batch, max_size=batch)
    memory = draw(st.sampled_from(MEMORY if dv <= d else MEMORY[:-1]))
    bound = st.one_of(st.just(-1), st.integers(0, 60), st.sampled_from([HUGE - 1, HUGE, sys.maxsize]))
    causal = draw(st.booleans())
    mask: dict[str, Any] = {"causal": causal, "window_size": (draw(bound), 0 if causal else draw(bound))}
    if draw(st.booleans()):
        mask["softcap"] = draw(st.floats(0.1, 100.0))
    if draw(st.booleans()):
        mask["softmax_scale"] = draw(st.floats(1e-3, 4.0))
    dtype = draw(st.sampled_from([torch.float32, torch.float32, torch.float32, torch.bfloat16, torch.float16]))
    return Fuzz(draw(lens), draw(lens), hkv * g, hkv, d, dv, memory, mask, dtype, draw(st.integers(0, 2**31 - 1)))


def _leaves(case: Fuzz) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(case.seed)
    tq, tk = sum(case.lens_q), sum(case.lens_k)
    shapes = ((tq, case.hq, case.d), (tk, case.hkv, case.d), (tk, case.hkv, case.dv))
    return tuple(torch.randn(s, generator=gen, dtype=torch.float64).to(DEVICE) for s in shapes)


def _run(backend: str, case: Fuzz, leaves: tuple[torch.Tensor, ...], with_lse: bool):
    """``(out, lse, grads of the leaves)`` of ``backend``; the loss reads out and (with_lse) the LSE."""
    xs = [x.to(case.dtype, copy=True).requires_grad_() for x in leaves]
    q, k, v = _views(case.memory, *xs)
    cu_q = torch.tensor(offsets(case.lens_q), dtype=torch.int32, device=DEVICE)
    cu_k = torch.tensor(offsets(case.lens_k), dtype=torch.int64, device=DEVICE)
    res = packattn.varlen_attention(q, k, v, cu_q, cu_k, return_lse=with_lse, backend=backend, **case.mask)
    out, lse = res if with_lse else (res, None)
    grads = _grads(out, lse, xs, case.dtype)
    return out.detach(), None if lse is None else lse.detach(), grads


def _dout(shape: torch.Size, dtype: torch.dtype) -> torch.Tensor:
    """The loss's weights of out, as a backend of ``dtype`` receives them (the same every call)."""
    w = torch.randn(shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    return as_received(w, dtype).to(DEVICE)


def _grads(
    out: torch.Tensor, lse: torch.Tensor | None, xs: list[torch.Tensor], dtype: torch.dtype
) -> tuple[torch.Tensor, ...]:
    """The gradients of the loss, with its weights as the backends of ``dtype`` receive them."""
    loss = (out.double() * _dout(out.shape, dtype)).sum()
    if lse is not None:
        w = torch.randn(lse.shape, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
        loss = loss + (lse.double().nan_to_num(0.0, 0.0, 0.0) * as_received(w, compute_dtype(dtype)).to(DEVICE)).sum()
    return torch.autograd.grad(loss, xs, allow_unused=True, materialize_grads=True)


def _naive(case: Fuzz, leaves: tuple[torch.Tensor, ...], dtype: torch.dtype, with_lse: bool):
    xs = [x.to(dtype, copy=True).requires_grad_() for x in leaves]
    q, k, v = _views(case.memory, *xs)
    out, lse = attention_naive(q, k, v, offsets(case.lens_q), offsets(case.lens_k), **_oracle_mask(case.mask))
    return out.detach(), lse.detach(), _grads(out, lse if with_lse else None, xs, case.dtype)


def _check(case: Fuzz) -> None:
    leaves = _leaves(case)
    rounded = tuple(x.to(case.dtype).double() for x in leaves)  # what the backends get, for the oracle
    ran = 0
    for backend in COMPILED_LSE_BACKENDS:
        if not supported(backend, dtype=case.dtype, **case.mask):
            continue
        ran += 1
        out, lse, grads = _run(backend, case, leaves, with_lse=True)
        ref, base = _naive(case, rounded, torch.float64, True), _naive(case, leaves, case.dtype, True)
        score = _score_floor(case, leaves)
        assert_close_to_oracle(out, ref[0], base[0], name=f"{backend} out", floor=score * _row(leaves[2]) + 1e-6)
        assert_close_to_oracle(lse, ref[1], base[1], name=f"{backend} lse", floor=score + 1e-5)
        dout, cancel = _dout(out.shape, case.dtype), _cancellation_floor(case, leaves)
        # dQ, dK: delta's summation in fp32, and out's own rounding, which delta carries
        dq_shift, dk_shift = _out_rounding_in_grads(case, rounded, dout, out - ref[0])
        floors = {"q": cancel + dq_shift, "k": cancel + dk_shift}
        # dV: a backward whose scores round differently from its forward's (the cpu backend: PyTorch's kernel
        # forward, the reference backward) has p off by ~ the score's rounding, for up to Lq rows.
        floors["v"] = 4 * score * max(case.lens_q) * _largest(dout) + 1e-6
        for n, g, r, b in zip("qkv", grads, ref[2], base[2]):
            assert_close_to_oracle(g, r, b, name=f"{backend} d{n}", floor=floors[n])
        if backend == "cpu_kernel":
            _same_bits_on_one_and_two_threads(lambda: _run("cpu_kernel", case, leaves, with_lse=True))
    assert ran, "no compiled backend ran the case"


def _out_rounding_in_grads(
    case: Fuzz, rounded: tuple[torch.Tensor, ...], dout: torch.Tensor, out_error: torch.Tensor
) -> tuple[float, float]:
    """How much the rounding of a backend's out moves its dQ and dK (largest element of each), exactly.

    Every flash-style backward (flash-attn's, PyTorch's fused kernels', these) takes delta = rowsum(dO * out)
    from out in the inputs' dtype. An error e in out moves delta by rowsum(dO * e) = c, and so the scores'
    gradient P (dP - delta) by -P c: exactly the gradient of -sum(c * LSE). Where a row's softmax is nearly
    one-hot, dQ and dK cancel to small values, and a 16-bit out's rounding leaves them further from the
    oracle than plain PyTorch's own 16-bit backward, which sums P dP instead."""
    xs = [x.clone().requires_grad_() for x in rounded]
    q, k, v = _views(case.memory, *xs)
    _, lse = attention_naive(q, k, v, offsets(case.lens_q), offsets(case.lens_k), **_oracle_mask(case.mask))
    c = (dout * out_error.double()).sum(-1).T  # (Hq, Tq), as the LSE
    dq, dk = torch.autograd.grad((lse.nan_to_num(0.0, 0.0, 0.0) * c).sum(), xs[:2], materialize_grads=True)
    return _largest(dq), _largest(dk)


def _largest(x: torch.Tensor) -> float:
    """The largest magnitude of an element of ``x`` (0 for an empty ``x``)."""
    return float(x.abs().max()) if x.numel() else 0.0


def _row(x: torch.Tensor) -> float:
    """The largest norm of a row (head vector) of ``x``."""
    return float(x.norm(dim=-1).max()) if x.numel() else 0.0


def _score_floor(case: Fuzz, leaves: tuple[torch.Tensor, ...]) -> float:
    """A rounding bound of one fp32 score: a D-term dot product summed in another order than plain PyTorch's
    differs by ~ sqrt(D) eps |q| |k| scale (one example may be luckier than the other by a few times)."""
    q, k, _ = leaves
    return 4 * 2**-24 * case.d**0.5 * case.mask.get("softmax_scale", case.d**-0.5) * _row(q) * _row(k)


def _cancellation_floor(case: Fuzz, leaves: tuple[torch.Tensor, ...]) -> float:
    """A bound of the rounding in dQ and dK that every flash-style backward has and plain autograd has not:
    dS = P (dP - delta) with delta = rowsum(dO * out) in fp32 cancels where dQ or dK is ~0 (e.g. a row that
    sees one key), leaving eps * |dO| (|v| + |out|) per score, times scale, |q| or |k| and up to Lq rows."""
    q, k, v = leaves
    if not q.numel() or not k.numel():
        return 0.0
    dout = _dout(torch.Size((q.shape[0], q.shape[1], v.shape[2])), case.dtype)
    scale = case.mask.get("softmax_scale", case.d**-0.5)
    return 4 * 2**-23 * scale * _row(dout) * 2 * _row(v) * max(_row(q), _row(k)) * max(case.lens_q)


def _same_bits_on_one_and_two_threads(run: Callable[[], tuple[Any, ...]]) -> None:
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = run()
        torch.set_num_threads(2)
        two = run()
    finally:
        torch.set_num_threads(threads)
    flat = [(one[0], two[0]), (one[1], two[1]), *zip(one[2], two[2])]
    for name, (a, b) in zip(("out", "lse", "dq", "dk", "dv"), flat):
        assert torch.equal(a.nan_to_num(7.0), b.nan_to_num(7.0)), f"cpu_kernel {name}: 1 and 2 threads differ"


@FUZZ
@given(fuzz_cases())
def test_fuzz_against_the_oracle(case):
    _check(case)


# At the limits: empty batches and sides, head dims 1 and 512, key tiles' edges (the C++ kernel's 256 keys,
# its 16-column padding), MQA with many query heads, extreme window bounds, tiny and huge softcap and scale.
EDGES = {
    "nothing": Fuzz([0, 0], [0, 0], 2, 1, 8, 8, "contiguous"),
    "keys_only": Fuzz([0, 0, 3], [5, 9, 0], 2, 2, 4, 4, "contiguous"),
    "d1_dv512": Fuzz([3, 1], [4, 7], 2, 1, 1, 512, "heads_major"),
    "d512_dv1": Fuzz([5], [6], 1, 1, 512, 1, "v_overlaps_k"),
    "tile_edges": Fuzz([1, 257, 16], [255, 257, 17], 2, 1, 17, 15, "last_dim_stride_2", {"causal": True}),
    "mqa_8_heads": Fuzz([20, 3], [31, 1], 8, 1, 33, 31, "kv_broadcast", {"window_size": (4, 2)}),
    "window_huge": Fuzz([9, 4], [30, 2], 2, 1, 16, 16, "contiguous", {"window_size": (sys.maxsize, HUGE)}),
    "window_just_below": Fuzz([9], [30], 2, 2, 16, 16, "contiguous", {"window_size": (HUGE - 1, 0)}),
    "softcap_tiny_scale_huge": Fuzz([7], [11], 2, 1, 8, 8, "contiguous", {"softcap": 1e-3, "softmax_scale": 1e3}),
    "bf16_lq_gt_lk": Fuzz([40, 2], [3, 2], 4, 2, 64, 48, "contiguous", {"causal": True}, torch.bfloat16),
    # fp16 rows are widened to fp32 a block of two vectors at a time: 33 and 95 leave tails of one lane and of
    # more than one vector (AVX-512; other widths other tails)
    "fp16_row_tails": Fuzz([37, 5], [29, 66], 4, 2, 33, 95, "contiguous", {"window_size": (20, -1)}, torch.float16),
    # bf16 tiles (AMX, the dot-product loop) are transposed in blocks of 32 x 32: 31 keys and 63 columns leave
    # blocks of 31 rows and of 31 columns, which ATen's own transpose cannot take (tiles.h, transpose_block)
    "bf16_blocks_of_31": Fuzz([5, 31], [31, 40], 2, 2, 63, 31, "contiguous", {}, torch.bfloat16),
}


@pytest.mark.parametrize("name", EDGES)
def test_edges_against_the_oracle(name):
    _check(EDGES[name])
