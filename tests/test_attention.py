"""Every backend against the float64 oracle: dtypes, layouts, masks, gradients."""

from __future__ import annotations

import pytest
import torch

import packattn
from packattn.dispatch import BACKENDS

from .helpers import backend_reasons, check_backward, check_forward, make_case

BACKEND_NAMES = sorted(BACKENDS)
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16, "fp64": torch.float64}

# (query lengths, key lengths): named patterns, empty sides and odd sizes included.
PATTERNS = {
    "equal": ([7, 13, 5], [7, 13, 5]),
    "design_example": ([5, 0, 7], [9, 8, 8]),
    "empty_k_side": ([4, 6, 3], [5, 0, 3]),
    "empty_both": ([0, 5, 0], [0, 5, 0]),
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
    "left_only": {"window_size": (-1, 1)},
    "right_band": {"window_size": (-1, 4)},
    "softcap": {"softcap": 2.5},
    "scale": {"softmax_scale": 0.3},
}


def _run_or_explain(name, case, **mask):
    """A backend either matches the oracle or refuses with its reasons; it never does something else."""
    why = backend_reasons(name, case, False, **mask)
    if why:
        cu_q, cu_k = case.tensors()
        with pytest.raises(ValueError, match=f"backend={name!r} cannot run"):
            packattn.varlen_attention(case.q, case.k, case.v, cu_q, cu_k, backend=name, **mask)
        return False
    check_forward(name, case, **mask)
    return True


@pytest.mark.parametrize("backend", BACKEND_NAMES)
@pytest.mark.parametrize("mask", MASKS, ids=list(MASKS))
@pytest.mark.parametrize("pattern", PATTERNS, ids=list(PATTERNS))
def test_patterns_fp32(backend, pattern, mask):
    lens_q, lens_k = PATTERNS[pattern]
    _run_or_explain(backend, make_case(lens_q, lens_k), **MASKS[mask])


@pytest.mark.parametrize("backend", BACKEND_NAMES)
@pytest.mark.parametrize("dtype", DTYPES, ids=list(DTYPES))
@pytest.mark.parametrize("mask", ["full", "causal", "window", "softcap"])
def test_dtypes(backend, dtype, mask):
    case = make_case([37, 0, 64, 64, 530], [50, 9, 64, 64, 600], hq=4, hkv=1, d=64, dtype=DTYPES[dtype], seed=3)
    _run_or_explain(backend, case, **MASKS[mask])


@pytest.mark.parametrize("backend", BACKEND_NAMES)
@pytest.mark.parametrize("heads", [(4, 4), (8, 2), (6, 1)], ids=["mha", "gqa", "mqa"])
@pytest.mark.parametrize("dims", [(32, 32), (48, 16), (16, 40)], ids=["d32", "dv_smaller", "dv_larger"])
def test_heads_and_dims(backend, heads, dims):
    hq, hkv = heads
    d, dv = dims
    case = make_case([12, 1, 30], [12, 19, 30], hq=hq, hkv=hkv, d=d, dv=dv)
    assert _run_or_explain(backend, case, causal=True)
    assert _run_or_explain(backend, case)


def test_long_sequence_crosses_many_tiles():
    # 700 queries x 1100 keys: several query blocks and key chunks, causal and windowed.
    case = make_case([700], [1100], hq=2, hkv=1, d=16, seed=5)
    for mask in ({"causal": True}, {"window_size": (130, 70)}, {}):
        check_forward("reference", case, **mask)


def test_rows_without_keys_are_zero_and_minus_inf():
    case = make_case([6, 3], [2, 0])
    cu_q, cu_k = case.tensors()
    out, lse = packattn.varlen_attention(case.q, case.k, case.v, cu_q, cu_k, causal=True, return_lse=True)
    # Sequence 0: Lq=6, Lk=2, bottom-right causal: rows 0-3 see nothing. Sequence 1 has no keys at all.
    hidden = torch.tensor([1, 1, 1, 1, 0, 0, 1, 1, 1], dtype=torch.bool)
    assert torch.all(out[hidden] == 0)
    assert torch.all(lse[:, hidden] == float("-inf"))
    assert torch.isfinite(lse[:, ~hidden]).all() and not torch.isnan(out).any()


def test_default_dispatch_matches_oracle_without_host_copies_and_with():
    case = make_case([5, 0, 7], [9, 8, 8], hq=4, hkv=2, d=64, dv=32)
    cu_q, cu_k = case.tensors()
    a = packattn.varlen_attention(case.q, case.k, case.v, cu_q, cu_k, causal=True)
    b = packattn.varlen_attention(
        case.q, case.k, case.v, cu_q, cu_k, causal=True, cu_seqlens_q_host=case.cu_q, cu_seqlens_k_host=case.cu_k
    )
    assert torch.equal(a, b)
    check_forward("reference", case, causal=True)


@pytest.mark.parametrize("backend", BACKEND_NAMES)
@pytest.mark.parametrize("mask", ["full", "causal", "window", "softcap"])
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_backward_matches_oracle(backend, mask, dtype):
    case = make_case([9, 0, 20, 3], [14, 6, 20, 0], hq=4, hkv=2, d=16, dv=24, dtype=DTYPES[dtype], seed=7)
    if backend_reasons(backend, case, False, **MASKS[mask]):
        pytest.skip(f"{backend} does not run this mask (its refusal is tested in test_patterns_fp32)")
    with_lse = not backend_reasons(backend, case, True, **MASKS[mask])
    check_backward(backend, case, with_lse=with_lse, **MASKS[mask])


@pytest.mark.parametrize("backend", BACKEND_NAMES)
@pytest.mark.parametrize("mask", ["full", "causal", "window", "softcap"])
@pytest.mark.parametrize("dv", [4, 3], ids=["dv_eq_d", "dv_ne_d"])
def test_gradcheck_float64(backend, mask, dv):
    case = make_case([3, 0, 4, 2], [4, 2, 4, 0], hq=2, hkv=1, d=4, dv=dv, dtype=torch.float64, seed=11)
    if backend_reasons(backend, case, False, **MASKS[mask]):
        pytest.skip(f"{backend} does not run this mask (its refusal is tested in test_patterns_fp32)")
    with_lse = not backend_reasons(backend, case, True, **MASKS[mask])
    cu_q, cu_k = case.tensors()
    leaves = tuple(t.detach().clone().requires_grad_() for t in (case.q, case.k, case.v))

    def f(q, k, v):
        res = packattn.varlen_attention(q, k, v, cu_q, cu_k, return_lse=with_lse, backend=backend, **MASKS[mask])
        return (res[0], res[1].nan_to_num(0.0, 0.0, 0.0)) if with_lse else res

    assert torch.autograd.gradcheck(f, leaves)


@pytest.mark.parametrize("backend", ["reference", "cpu"])
def test_memory_grows_linearly_without_score_matrices(backend):
    """Peak memory beyond the output, for one long sequence: no (L, L) score matrix, linear growth."""
    from packattn.bench.runner import peak_extra_mib

    peaks = {}
    for length in (2048, 4096):
        case = make_case([length], [length], hq=4, hkv=4, d=32, seed=2)
        cu_q, cu_k = case.tensors()
        out_bytes = length * 4 * 32 * 4
        peaks[length] = peak_extra_mib(
            lambda c=case, a=cu_q, b=cu_k: packattn.varlen_attention(c.q, c.k, c.v, a, b, backend=backend), out_bytes
        )
    scores_mib = 4 * 4096 * 4096 * 4 / 2**20  # one fp32 score matrix for all heads: 256 MiB
    assert peaks[4096] < scores_mib / 8, peaks
    assert peaks[4096] < 2.5 * max(peaks[2048], 1.0), peaks
