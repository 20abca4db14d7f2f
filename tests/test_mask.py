"""MaskSpec's geometry (the one Python source of which keys a row sees) against the compiled kernels.

With every score equal (q = 0) and V the identity over keys, output row ``i`` is the uniform average of the
keys row ``i`` sees, so ``out[i, j] > 0`` exactly where the kernel computed pair ``(i, j)``, and the LSE is
-inf exactly on rows that see no key. The C++ and Triton kernels derive their masks and skipped tiles on
their own; these tests hold them to :class:`packattn.inputs.MaskSpec`'s answers.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import packattn
from packattn.inputs import MaskSpec

from .helpers import DEVICE, supported
from .strategies import BOUNDED, geometries


def _visibility(backend: str, lq: int, lk: int, left: int, right: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(computed pairs (Lq, Lk) bool, rows with LSE -inf (Lq,) bool)`` of one sequence on ``backend``."""
    q = torch.zeros(lq, 1, 8, device=DEVICE)
    k = torch.randn(lk, 1, 8, generator=torch.Generator().manual_seed(lq * 97 + lk)).to(DEVICE)
    v = torch.eye(max(lk, 1), device=DEVICE)[:lk, None, :]  # (Lk, 1, Dv): key j -> column j
    cu_q, cu_k = torch.tensor([0, lq]), torch.tensor([0, lk])
    out, lse = packattn.varlen_attention(
        q, k, v, cu_q, cu_k, window_size=(left, right), return_lse=True, backend=backend
    )
    return (out[:, 0, :lk] > 0).cpu(), torch.isneginf(lse[0]).cpu()


def _expected(lq: int, lk: int, left: int, right: int) -> tuple[torch.Tensor, torch.Tensor]:
    mask = MaskSpec(1.0, left, right)
    seen = torch.zeros(lq, lk, dtype=torch.bool)
    for i in range(lq):
        lo, hi = mask.key_range(i, i + 1, lq, lk)
        seen[i, lo:hi] = True
    first, end = mask.visible_rows(lq, lk)
    no_key = torch.ones(lq, dtype=torch.bool)
    no_key[first:end] = False
    return seen, no_key


def _check(backend: str, geometry: tuple[int, int, int, int]) -> None:
    lq, lk, left, right = geometry
    seen, no_key = _visibility(backend, *geometry)
    want_seen, want_no_key = _expected(*geometry)
    assert torch.equal(seen, want_seen), geometry
    assert torch.equal(no_key, want_no_key), geometry
    mask = MaskSpec(1.0, left, right)
    assert int(seen.sum()) == mask.visible_pairs(lq, lk)
    for j0 in range(0, lk, 7):  # key blocks reach exactly the rows query_range names
        j1 = min(lk, j0 + 7)
        rows = torch.nonzero(seen[:, j0:j1].any(1)).flatten().tolist()
        lo, hi = mask.query_range(j0, j1, lq, lk)
        assert rows == list(range(lo, hi)), (geometry, j0)


@pytest.mark.skipif(not supported("cpu_kernel"), reason="the cpu_kernel backend is not available here")
@settings(BOUNDED, max_examples=120)
@given(geometries())
def test_cpu_kernel_computes_exactly_the_pairs_maskspec_names(geometry):
    _check("cpu_kernel", geometry)


@pytest.mark.skipif(not supported("triton"), reason="the triton backend is not available here")
@settings(BOUNDED, max_examples=25)
@given(geometries())
def test_triton_computes_exactly_the_pairs_maskspec_names(geometry):
    _check("triton", geometry)


@settings(BOUNDED, max_examples=300)
@given(geometries(), st.integers(-40, 40))
def test_a_trimmed_box_gets_a_window_with_the_same_pairs(geometry, shift):
    """Ring attention's pieces: rows ``[0, m)`` against keys ``[0, n)`` at another diagonal ``offset``, trimmed to
    the rows and keys that meet, become a plain varlen sequence whose window gives exactly those pairs."""
    m, n, left, right = geometry
    mask, offset = MaskSpec(1.0, left, right), n - m + shift
    lo_d, hi_d = mask.band(m, n, offset)
    pairs = {
        (i, j)
        for i in range(m)
        for j in range(n)
        if (lo_d is None or j - i >= lo_d) and (hi_d is None or j - i <= hi_d)
    }
    r0, r1 = mask.visible_rows(m, n, offset)
    c0, c1 = mask.key_range(r0, r1, m, n, offset)
    assert {i for i, _ in pairs} == set(range(r0, r1)) if pairs else r0 == r1
    if not pairs:
        return
    assert {j for _, j in pairs} == set(range(c0, c1))
    rows, keys = r1 - r0, c1 - c0
    box = MaskSpec(1.0, *mask.window_of_box(rows, keys, offset + r0 - c0))
    assert box.left >= -1 and box.right >= -1
    got = set()
    for i in range(rows):
        lo, hi = box.key_range(i, i + 1, rows, keys)
        got |= {(r0 + i, c0 + j) for j in range(lo, hi)}
    assert got == pairs, (geometry, shift)
