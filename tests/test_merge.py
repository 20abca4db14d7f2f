"""merge_attention_states: split-key attention merged back equals the whole, and -inf rows are safe."""

from __future__ import annotations

import math

import pytest
import torch

import packattn
from packattn.testing import assert_close_to_oracle, attention_naive, oracle

from .helpers import Case, make_case, offsets

NEG_INF = -math.inf
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp64": torch.float64}
MASKS = {"full": {}, "softcap": {"softcap": 3.0}, "scale": {"softmax_scale": 0.7}}


def split_keys(case: Case, gen: torch.Generator) -> tuple[Case, Case]:
    """Split the keys of every sequence at a random point into a prefix part and a suffix part.

    The first sequence gives all its keys to the suffix and the second all to the prefix, so both parts
    hold sequences with no keys at all.
    """
    rows: tuple[list[int], list[int]] = ([], [])
    lens: tuple[list[int], list[int]] = ([], [])
    for seq in range(len(case.cu_k) - 1):
        ks, ke = case.cu_k[seq], case.cu_k[seq + 1]
        if seq == 0:
            cut = ks
        elif seq == 1:
            cut = ke
        else:
            cut = ks + int(torch.randint(0, ke - ks + 1, (1,), generator=gen))
        for side, (lo, hi) in enumerate(((ks, cut), (cut, ke))):
            rows[side].extend(range(lo, hi))
            lens[side].append(hi - lo)

    def part(side: int) -> Case:
        idx = torch.tensor(rows[side], dtype=torch.long)
        return Case(case.q, case.k[idx], case.v[idx], case.cu_q, offsets(lens[side]))

    return part(0), part(1)


def attend(case: Case, **mask: object) -> tuple[torch.Tensor, torch.Tensor]:
    cu_q, cu_k = case.tensors()
    return packattn.varlen_attention(case.q, case.k, case.v, cu_q, cu_k, return_lse=True, **mask)


def random_state(t: int, h: int, dv: int, seed: int, empty: float = 0.3) -> tuple[torch.Tensor, torch.Tensor]:
    """A partial result in float32: random out, and an LSE with a fraction ``empty`` of -inf rows (out 0)."""
    gen = torch.Generator().manual_seed(seed)
    out = torch.randn(t, h, dv, generator=gen)
    lse = 3 * torch.randn(h, t, generator=gen)
    hidden = torch.rand(h, t, generator=gen) < empty
    lse[hidden] = NEG_INF
    out[hidden.T] = 0.0
    return out, lse


@pytest.mark.parametrize("mask", MASKS, ids=list(MASKS))
@pytest.mark.parametrize("dtype", DTYPES, ids=list(DTYPES))
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_merged_halves_equal_whole(seed, dtype, mask):
    gen = torch.Generator().manual_seed(100 + seed)
    lens_q = [int(x) for x in torch.randint(0, 20, (6,), generator=gen)]
    lens_k = [int(x) for x in torch.randint(0, 30, (6,), generator=gen)]
    lens_k[0], lens_k[1] = max(lens_k[0], 3), max(lens_k[1], 3)
    lens_q[0], lens_q[1] = max(lens_q[0], 2), max(lens_q[1], 2)
    lens_k[2] = 0  # empty on both sides of the split
    case = make_case(lens_q, lens_k, hq=4, hkv=2, d=16, dv=12, dtype=DTYPES[dtype], seed=seed)
    part_a, part_b = split_keys(case, gen)
    out_a, lse_a = attend(part_a, **MASKS[mask])
    out_b, lse_b = attend(part_b, **MASKS[mask])
    out, lse = packattn.merge_attention_states(out_a, lse_a, out_b, lse_b)

    ref_out, ref_lse = oracle(case.q, case.k, case.v, case.cu_q, case.cu_k, **MASKS[mask])
    pt_out, pt_lse = attention_naive(case.q, case.k, case.v, case.cu_q, case.cu_k, **MASKS[mask])
    assert out.dtype == case.q.dtype and out.is_contiguous() and lse.is_contiguous()
    assert lse.dtype == (torch.float64 if case.q.dtype == torch.float64 else torch.float32)
    assert_close_to_oracle(out, ref_out, pt_out, name="out")
    assert_close_to_oracle(lse, ref_lse, pt_lse, name="lse", floor=1e-5 if lse.dtype == torch.float32 else None)
    # Sequence 2 has no keys: its rows are 0 / -inf; sequences 0 and 1 took every key from one side.
    rows = slice(case.cu_q[2], case.cu_q[3])
    assert torch.all(out[rows] == 0) and torch.all(lse[:, rows] == NEG_INF)
    assert torch.isinf(lse_a[:, : case.cu_q[1]]).all() and torch.isinf(lse_b[:, case.cu_q[1] : case.cu_q[2]]).all()


def test_gradients_through_merged_halves_equal_whole():
    """Split-KV backward: gradients of the merged result (out and LSE) are those of whole attention."""
    case = make_case([6, 4, 0, 9, 3], [7, 5, 4, 11, 0], hq=4, hkv=2, d=8, dv=6, dtype=torch.float64, seed=4)
    gen = torch.Generator().manual_seed(9)
    dout = torch.randn(case.q.shape[0], 4, 6, generator=gen, dtype=torch.float64)
    dlse = torch.randn(4, case.q.shape[0], generator=gen, dtype=torch.float64)

    def loss(out: torch.Tensor, lse: torch.Tensor) -> torch.Tensor:
        return (out * dout).sum() + (lse.nan_to_num(0.0, 0.0, 0.0) * dlse).sum()

    leaves = [t.detach().clone().requires_grad_() for t in (case.q, case.k, case.v)]
    whole = Case(*leaves, case.cu_q, case.cu_k)
    part_a, part_b = split_keys(whole, gen)
    out, lse = packattn.merge_attention_states(*attend(part_a), *attend(part_b))
    got = torch.autograd.grad(loss(out, lse), leaves)

    xs = [t.detach().clone().requires_grad_() for t in (case.q, case.k, case.v)]
    want = torch.autograd.grad(loss(*oracle(*xs, case.cu_q, case.cu_k)), xs)
    for name, g, w in zip("qkv", got, want, strict=True):
        assert not torch.isnan(g).any(), f"d{name} has NaN"
        torch.testing.assert_close(g, w, rtol=1e-9, atol=1e-10, msg=lambda m, n=name: f"d{n}: {m}")


def test_three_way_split_both_orders_equal_whole():
    case = make_case([5, 9, 1], [12, 20, 7], hq=2, hkv=1, d=16, dv=8, dtype=torch.float64, seed=2)
    gen = torch.Generator().manual_seed(3)
    first, rest = split_keys(case, gen)
    second, third = split_keys(rest, gen)
    a, b, c = attend(first), attend(second), attend(third)
    left = packattn.merge_attention_states(*packattn.merge_attention_states(*a, *b), *c)
    right = packattn.merge_attention_states(*a, *packattn.merge_attention_states(*b, *c))
    ref_out, ref_lse = oracle(case.q, case.k, case.v, case.cu_q, case.cu_k)
    for out, lse in (left, right):
        torch.testing.assert_close(out, ref_out, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(lse, ref_lse, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("empty", [0.0, 0.3, 0.8], ids=["no_empty_rows", "some_empty_rows", "mostly_empty_rows"])
def test_associative_to_fp32_rounding(empty):
    a, b, c = (random_state(40, 3, 8, seed, empty) for seed in (1, 2, 3))
    left_out, left_lse = packattn.merge_attention_states(*packattn.merge_attention_states(*a, *b), *c)
    right_out, right_lse = packattn.merge_attention_states(*a, *packattn.merge_attention_states(*b, *c))
    assert not torch.isnan(left_out).any() and not torch.isnan(right_out).any()
    torch.testing.assert_close(left_lse, right_lse, rtol=4e-7, atol=4e-7)
    torch.testing.assert_close(left_out, right_out, rtol=4e-6, atol=4e-6)
    all_empty = torch.isneginf(a[1]) & torch.isneginf(b[1]) & torch.isneginf(c[1])
    assert torch.equal(torch.isneginf(left_lse), all_empty) and torch.equal(torch.isneginf(right_lse), all_empty)


def test_commutative_exactly():
    a, b = random_state(30, 2, 5, 7), random_state(30, 2, 5, 8)
    ab, ba = packattn.merge_attention_states(*a, *b), packattn.merge_attention_states(*b, *a)
    assert torch.equal(ab[0], ba[0]) and torch.equal(ab[1], ba[1])


def test_matches_formula_in_float64():
    (out_a, lse_a), (out_b, lse_b) = random_state(25, 3, 4, 5, 0.0), random_state(25, 3, 4, 6, 0.0)
    out, lse = packattn.merge_attention_states(out_a, lse_a, out_b, lse_b)
    la, lb = lse_a.double(), lse_b.double()
    want_lse = torch.logaddexp(la, lb)
    want = (
        out_a.double() * torch.exp(la - want_lse).T[..., None] + out_b.double() * torch.exp(lb - want_lse).T[..., None]
    )
    torch.testing.assert_close(lse, want_lse.float(), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(out, want.float(), rtol=1e-5, atol=1e-6)


def test_both_sides_empty_gives_zero_and_minus_inf():
    out_a = torch.full((4, 2, 3), math.nan)
    out_b = torch.full((4, 2, 3), math.inf)
    lse = torch.full((2, 4), NEG_INF)
    out, merged = packattn.merge_attention_states(out_a, lse, out_b, lse.clone())
    assert torch.equal(out, torch.zeros(4, 2, 3))
    assert torch.equal(merged, lse)


@pytest.mark.parametrize("garbage", [math.nan, math.inf, 1e30], ids=["nan", "inf", "huge"])
@pytest.mark.parametrize("empty_side", ["a", "b"])
def test_empty_side_is_ignored_even_if_its_out_is_garbage(empty_side, garbage):
    full_out, full_lse = random_state(10, 2, 4, 11, 0.0)
    junk_out, junk_lse = torch.full((10, 2, 4), garbage), torch.full((2, 10), NEG_INF)
    if empty_side == "a":
        out, lse = packattn.merge_attention_states(junk_out, junk_lse, full_out, full_lse)
    else:
        out, lse = packattn.merge_attention_states(full_out, full_lse, junk_out, junk_lse)
    assert torch.equal(out, full_out)
    assert torch.equal(lse, full_lse)


@pytest.mark.parametrize("nan_side", ["a", "b"])
def test_a_nan_lse_makes_the_row_nan(nan_side):
    """A NaN LSE (a row whose softmax was undefined: NaN or infinite inputs) is not an empty side."""
    (out_a, lse_a), (out_b, lse_b) = random_state(6, 2, 4, 12, 0.0), random_state(6, 2, 4, 13, 0.0)
    lse_a, lse_b = lse_a.clone(), lse_b.clone()
    (lse_a if nan_side == "a" else lse_b)[1, 3] = math.nan
    out, lse = packattn.merge_attention_states(out_a, lse_a, out_b, lse_b)
    bad = torch.zeros(2, 6, dtype=torch.bool)
    bad[1, 3] = True
    assert torch.isnan(lse[bad]).all() and torch.isfinite(lse[~bad]).all()
    assert torch.isnan(out[3, 1]).all() and torch.isfinite(out[~bad.transpose(0, 1)]).all()


def test_mixed_rows_each_ignore_their_empty_side():
    out_a, lse_a = random_state(16, 2, 3, 20, 0.0)
    out_b, lse_b = random_state(16, 2, 3, 21, 0.0)
    lse_a[0, :4] = NEG_INF
    out_a[:4, 0] = math.nan
    lse_b[1, 4:8] = NEG_INF
    out_b[4:8, 1] = math.nan
    out, lse = packattn.merge_attention_states(out_a, lse_a, out_b, lse_b)
    assert not torch.isnan(out).any()
    assert torch.equal(out[:4, 0], out_b[:4, 0]) and torch.equal(lse[0, :4], lse_b[0, :4])
    assert torch.equal(out[4:8, 1], out_a[4:8, 1]) and torch.equal(lse[1, 4:8], lse_a[1, 4:8])


def _masked_states(seed: int) -> tuple[torch.Tensor, ...]:
    """float64 leaves, and -inf masks with rows empty on side a, on side b and on both."""
    gen = torch.Generator().manual_seed(seed)
    leaves = [torch.randn(shape, generator=gen, dtype=torch.float64) for shape in ((6, 2, 3), (2, 6)) * 2]
    empty_a = torch.zeros(2, 6, dtype=torch.bool)
    empty_b = torch.zeros(2, 6, dtype=torch.bool)
    empty_a[0, 0] = empty_a[1, 2] = True
    empty_b[0, 1] = empty_b[1, 3] = True
    empty_a[0, 4] = empty_b[0, 4] = empty_a[1, 5] = empty_b[1, 5] = True
    return (*leaves, empty_a, empty_b)


def test_gradcheck_float64_with_minus_inf_rows():
    out_a, lse_a, out_b, lse_b, empty_a, empty_b = _masked_states(0)

    def f(out_a, lse_a, out_b, lse_b):
        out, lse = packattn.merge_attention_states(
            out_a, lse_a.masked_fill(empty_a, NEG_INF), out_b, lse_b.masked_fill(empty_b, NEG_INF)
        )
        return out, lse.masked_fill(torch.isinf(lse), 0.0)

    leaves = tuple(t.requires_grad_() for t in (out_a, lse_a, out_b, lse_b))
    assert torch.autograd.gradcheck(f, leaves)


def test_gradients_at_minus_inf_entries_are_zero_not_nan():
    """An LSE entry of -inf has weight 0, so the merge's gradient with respect to it is 0, never NaN.

    Ring attention feeds these gradients back into the backward of the partial results.
    """
    out_a, lse_a, out_b, lse_b, empty_a, empty_b = _masked_states(1)
    lse_a = lse_a.masked_fill(empty_a, NEG_INF).requires_grad_()
    lse_b = lse_b.masked_fill(empty_b, NEG_INF).requires_grad_()
    out_a.requires_grad_()
    out_b.requires_grad_()
    out, lse = packattn.merge_attention_states(out_a, lse_a, out_b, lse_b)
    gen = torch.Generator().manual_seed(2)
    loss = (out * torch.randn(out.shape, generator=gen, dtype=torch.float64)).sum()
    loss = (
        loss + (lse.masked_fill(torch.isinf(lse), 0.0) * torch.randn(lse.shape, generator=gen, dtype=lse.dtype)).sum()
    )
    loss.backward()
    for t in (lse_a, lse_b, out_a, out_b):
        assert t.grad is not None and not torch.isnan(t.grad).any()
    assert torch.all(lse_a.grad[empty_a] == 0) and torch.all(lse_b.grad[empty_b] == 0)
    assert torch.all(out_a.grad.transpose(0, 1)[empty_a] == 0) and torch.all(out_b.grad.transpose(0, 1)[empty_b] == 0)


@pytest.mark.parametrize(
    "dtypes",
    [
        (torch.bfloat16, torch.float32, torch.float32),
        (torch.float16, torch.float32, torch.float32),
        (torch.float32, torch.float32, torch.float32),
        (torch.float64, torch.float64, torch.float64),
        (torch.float32, torch.float64, torch.float64),
    ],
    ids=["bf16_out", "fp16_out", "fp32", "fp64", "fp32_out_fp64_lse"],
)
def test_dtypes_and_compute_precision(dtypes):
    out_dtype, lse_dtype, want_lse_dtype = dtypes
    (oa, la), (ob, lb) = random_state(20, 2, 8, 30), random_state(20, 2, 8, 31)
    oa, ob, la, lb = oa.to(out_dtype), ob.to(out_dtype), la.to(lse_dtype), lb.to(lse_dtype)
    out, lse = packattn.merge_attention_states(oa, la, ob, lb)
    assert out.dtype == out_dtype and lse.dtype == want_lse_dtype
    # Computed in (at least) the LSE's precision from the given values, rounded once to out's dtype.
    ref_out, ref_lse = packattn.merge_attention_states(oa.to(want_lse_dtype), la, ob.to(want_lse_dtype), lb)
    assert torch.equal(out, ref_out.to(out_dtype))
    assert torch.equal(lse, ref_lse)
