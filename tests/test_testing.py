"""packattn.testing: the oracle's numbers, and the tolerance check failing where it must."""

from __future__ import annotations

import math
import warnings

import pytest
import torch
import torch.nn.functional as F

from packattn.testing import assert_close_to_oracle, attention_naive, oracle

from .helpers import make_case

# Sequence 1 has no keys, so its rows are 0 / -inf; GQA 4/2.
CASE = make_case([5, 3, 4], [7, 0, 6], hq=4, hkv=2, d=8, seed=1)
ARGS = (CASE.q, CASE.k, CASE.v, CASE.cu_q, CASE.cu_k)


def test_plain_pytorch_passes_and_the_error_is_reported():
    (ref_out, ref_lse), (pt_out, pt_lse) = oracle(*ARGS), attention_naive(*ARGS)
    err = assert_close_to_oracle(pt_out, ref_out, pt_out)
    assert err.ok and err.actual == err.baseline > 0
    assert err.allowed == pytest.approx(2 * err.baseline + 1e-6 * max(1.0, float(ref_out.abs().max())))
    assert torch.isinf(ref_lse[:, 5:8]).all() and torch.isfinite(ref_lse[:, :5]).all()
    assert_close_to_oracle(pt_lse, ref_lse, pt_lse, name="lse")


def test_tensors_that_require_grad_are_compared_quietly():
    """Outputs of a graph (the usual case in a gradient test) compare without autograd's warning about
    converting them to numbers."""
    grad_args = (CASE.q.clone().requires_grad_(), *ARGS[1:])
    (ref_out, _), (pt_out, _) = oracle(*grad_args), attention_naive(*grad_args)
    assert ref_out.requires_grad and pt_out.requires_grad
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert assert_close_to_oracle(pt_out, ref_out, pt_out).ok


def test_fails_on_a_perturbed_output():
    ref_out, _ = oracle(*ARGS)
    pt_out, _ = attention_naive(*ARGS)
    allowed = assert_close_to_oracle(pt_out, ref_out, pt_out).allowed
    bad = pt_out.clone()
    bad[2, 1, 3] += 2 * allowed
    with pytest.raises(AssertionError, match=r"^out: max error .* > allowed .*plain PyTorch in torch.float32"):
        assert_close_to_oracle(bad, ref_out, pt_out)


@pytest.mark.parametrize("row", [2, 6], ids=["finite_row_made_minus_inf", "minus_inf_row_made_finite"])
def test_fails_on_an_lse_infinity_mismatch(row):
    _, ref_lse = oracle(*ARGS)
    _, pt_lse = attention_naive(*ARGS)
    bad = pt_lse.clone()
    bad[1, row] = -math.inf if math.isfinite(bad[1, row]) else 0.0
    with pytest.raises(AssertionError, match=r"^lse: infinities differ from the oracle's$"):
        assert_close_to_oracle(bad, ref_lse, pt_lse, name="lse")


def test_fails_on_nan():
    ref_out, _ = oracle(*ARGS)
    pt_out, _ = attention_naive(*ARGS)
    bad = pt_out.clone()
    bad[0, 0, 0] = math.nan
    with pytest.raises(AssertionError, match=r"^out: contains NaN$"):
        assert_close_to_oracle(bad, ref_out, pt_out)


def test_fails_when_the_baseline_gives_no_tolerance():
    """A NaN baseline must not make the allowed error infinite (anything would pass)."""
    ref_out, _ = oracle(*ARGS)
    pt_out, _ = attention_naive(*ARGS)
    baseline = pt_out.clone()
    baseline[0, 0, 0] = math.nan
    with pytest.raises(AssertionError, match="baseline"):
        assert_close_to_oracle(pt_out + 1.0, ref_out, baseline)


@pytest.mark.parametrize(
    ("lens", "heads", "causal"), [((5, 9), (4, 2), False), ((7, 7), (2, 2), True)], ids=["gqa_lq_lt_lk", "causal"]
)
def test_oracle_matches_torch_sdpa_on_one_sequence(lens, heads, causal):
    case = make_case([lens[0]], [lens[1]], hq=heads[0], hkv=heads[1], d=8, dtype=torch.float64, seed=2)
    out, lse = oracle(case.q, case.k, case.v, case.cu_q, case.cu_k, causal=causal, softmax_scale=0.3)
    q, k, v = (t.transpose(0, 1) for t in (case.q, case.k, case.v))
    want = F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=0.3, enable_gqa=True).transpose(0, 1)
    assert out.dtype == lse.dtype == torch.float64
    torch.testing.assert_close(out, want, rtol=0, atol=1e-12)


# One query, two keys, D = 4 (default scale 1/2), Dv = 1: the scores are 0.5 * 2 * (0, ln 3) = (0, ln 3),
# so the weights are (1/4, 3/4), out = 2/4 + 6 * 3/4 = 5 and LSE = ln(1 + 3) = ln 4. Bottom-right causal
# (Lq=1, Lk=2) lets the query see both keys; window (0, 0) lets it see key 1 only: out 6, LSE ln 3.
TINY = (
    torch.tensor([[[2.0, 0, 0, 0]]], dtype=torch.float64),
    torch.tensor([[[0.0, 0, 0, 0]], [[math.log(3), 0, 0, 0]]], dtype=torch.float64),
    torch.tensor([[[2.0]], [[6.0]]], dtype=torch.float64),
)


@pytest.mark.parametrize(
    ("mask", "out", "lse"),
    [({}, 5.0, math.log(4)), ({"causal": True}, 5.0, math.log(4)), ({"window_size": (0, 0)}, 6.0, math.log(3))],
    ids=["full", "causal_bottom_right", "window_0_0"],
)
def test_oracle_on_a_hand_worked_example(mask, out, lse):
    got_out, got_lse = oracle(*TINY, [0, 1], [0, 2], **mask)
    assert got_out.shape == (1, 1, 1) and got_lse.shape == (1, 1)
    assert got_out.item() == pytest.approx(out, rel=0, abs=1e-14)
    assert got_lse.item() == pytest.approx(lse, rel=0, abs=1e-14)


def test_the_oracle_reads_huge_window_bounds_as_unbounded():
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(n, 2, 8, generator=gen, dtype=torch.float64) for n in (7, 9, 9))
    cu_q, cu_k = [0, 3, 7], [0, 6, 9]
    for huge in (2**60, 2**63 - 1, 2**64):
        for window, same in (((huge, 5), (-1, 5)), ((2, huge), (2, -1)), ((huge, huge), (-1, -1))):
            got, want = oracle(q, k, v, cu_q, cu_k, window_size=window), oracle(q, k, v, cu_q, cu_k, window_size=same)
            assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True)), window
