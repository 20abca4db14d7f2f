"""The rule for NaN and infinities in q, k, v, on every backend (README, "Non-finite inputs"):

* every element of out, LSE, dQ, dK and dV that depends on a non-finite input through a visible (query, key)
  pair is non-finite: never a finite number, and never the 0 / -inf of a row that sees no key;
* everything outside that input's sequence and KV-head group is bit for bit what it is without it (within
  them, elements that do not depend on it may turn NaN too: a product over a tile multiplies it by 0);
* rows that see no key stay 0 and -inf.
"""

from __future__ import annotations

import functools

import pytest
import torch

import packattn

from .helpers import DEVICE, DEVICE_BACKENDS, make_case, supported

LENS_Q, LENS_K = [5, 9, 4], [6, 11, 4]  # the bad value goes into sequence 1
HQ, HKV, D = 4, 2, 8
MASKS = {"full": {}, "causal": {"causal": True}, "window": {"window_size": (2, 1)}}
# (tensor, row inside sequence 1, head, value): head is a query head for q, a KV head for k and v.
PLACES = {
    "nan_q": ("q", 6, 1, float("nan")),
    "inf_q": ("q", 6, 1, float("inf")),
    "nan_k": ("k", 4, 0, float("nan")),
    "neg_inf_k": ("k", 4, 0, float("-inf")),
    "nan_v": ("v", 4, 0, float("nan")),
    "inf_v": ("v", 4, 0, float("inf")),
}


def _visible(mask: dict, lq: int, lk: int) -> torch.Tensor:
    i, j = torch.arange(lq)[:, None], torch.arange(lk)[None, :]
    off = lk - lq
    left, right = mask.get("window_size", (-1, -1))
    if mask.get("causal"):
        right = 0
    ok = torch.ones(lq, lk, dtype=torch.bool)
    if left >= 0:
        ok &= j >= i + off - left
    if right >= 0:
        ok &= j <= i + off + right
    return ok


def _run(backend: str, q, k, v, mask: dict) -> tuple[torch.Tensor, ...]:
    q, k, v = (x.detach().clone().requires_grad_() for x in (q, k, v))
    cu_q = torch.tensor([0, 5, 14, 18], dtype=torch.int32, device=DEVICE)
    cu_k = torch.tensor([0, 6, 17, 21], dtype=torch.int32, device=DEVICE)
    lse_ok = supported(backend, return_lse=True, **mask)
    res = packattn.varlen_attention(q, k, v, cu_q, cu_k, backend=backend, return_lse=lse_ok, **mask)
    out, lse = res if lse_ok else (res, None)
    dout = torch.ones_like(out)
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), dout)
    return out.detach(), lse, dq, dk, dv


@functools.cache
def _clean(backend: str, mask: str) -> tuple[torch.Tensor, ...]:
    """The run without a planted value, once per backend and mask (each test only reads it)."""
    case = make_case(LENS_Q, LENS_K, hq=HQ, hkv=HKV, d=D, seed=3)
    return _run(backend, case.q, case.k, case.v, MASKS[mask])


def _expected(name: str, mask: dict, q, k, v) -> dict[str, torch.Tensor]:
    """Which elements must be non-finite (rows of out/lse/dq per (token, query head), dk/dv per (key, KV
    head)) with the value of PLACES[name] planted in ``q, k, v``: from the IEEE scores of sequence 1."""
    g = HQ // HKV
    seen = _visible(mask, LENS_Q[1], LENS_K[1])  # (queries, keys) of sequence 1
    qs, ks = q[5:14].double().cpu(), k[6:17].double().cpu().repeat_interleave(g, 1)
    s = torch.einsum("ihd,jhd->hij", qs, ks).masked_fill(~seen, float("-inf"))  # (HQ, Lq, Lk)
    visible = seen.expand_as(s)
    undefined = (s.isnan() | (s == float("inf"))) & visible
    bad = undefined.any(-1) | ((s == float("-inf")) | ~visible).all(-1) & visible.any(-1)  # (HQ, Lq)
    if PLACES[name][0] == "v":  # the rows that see the bad value: their out and dQ (through dP and delta)
        vbad = ~torch.isfinite(v[6:17].cpu()).all(-1).repeat_interleave(g, 1).transpose(0, 1)  # (HQ, Lk)
        via_v = (visible & vbad[:, None, :]).any(-1)
    else:
        via_v = torch.zeros_like(bad)
    rows = torch.zeros(sum(LENS_Q), HQ, dtype=torch.bool)
    rows[5:14] = (bad | via_v).transpose(0, 1)
    lse_rows = torch.zeros_like(rows)
    lse_rows[5:14] = bad.transpose(0, 1)
    # dK and dV of every key a bad row sees; dK (not dV) of every key a row sees whose out is non-finite
    keys = torch.zeros(sum(LENS_K), HKV, dtype=torch.bool)
    dv_keys = torch.zeros_like(keys)
    keys[6:17] = (visible & (bad | via_v)[..., None]).any(1).view(HKV, g, -1).any(1).transpose(0, 1)
    dv_keys[6:17] = (visible & bad[..., None]).any(1).view(HKV, g, -1).any(1).transpose(0, 1)
    return {"out": rows, "lse": lse_rows, "dq": rows, "dk": keys, "dv": dv_keys}


def _group(name: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Elements inside the planted value's sequence and KV-head group: (query rows x heads, keys x KV heads)."""
    _, _, head, _ = PLACES[name]
    kv = head // (HQ // HKV) if PLACES[name][0] == "q" else head
    rows = torch.zeros(sum(LENS_Q), HQ, dtype=torch.bool)
    keys = torch.zeros(sum(LENS_K), HKV, dtype=torch.bool)
    g = HQ // HKV
    rows[5:14, kv * g : (kv + 1) * g] = True
    keys[6:17, kv] = True
    return rows, keys


@pytest.mark.parametrize("place", PLACES)
@pytest.mark.parametrize(
    ("backend", "mask"), [(b, m) for b in DEVICE_BACKENDS for m in MASKS if supported(b, **MASKS[m])]
)
def test_non_finite_inputs(backend, place, mask):
    case = make_case(LENS_Q, LENS_K, hq=HQ, hkv=HKV, d=D, seed=3)
    clean = _clean(backend, mask)
    tensor, row, head, value = PLACES[place]
    planted = {"q": case.q, "k": case.k, "v": case.v}
    bad = planted[tensor].detach().clone()
    start = 5 if tensor == "q" else 6
    bad[start + row, head, 2] = value  # one element of the row
    planted[tensor] = bad
    got = _run(backend, planted["q"], planted["k"], planted["v"], MASKS[mask])
    expect = _expected(place, MASKS[mask], *(planted[x] for x in "qkv"))
    rows, keys = _group(place)
    for name, a, b in zip(("out", "lse", "dq", "dk", "dv"), got, clean):
        if a is None:
            continue
        per_row = a if name != "lse" else a.transpose(0, 1)  # (T, H[, D])
        base = b if name != "lse" else b.transpose(0, 1)
        finite = torch.isfinite(per_row) if name == "lse" else torch.isfinite(per_row).all(-1)
        must = expect[name]
        assert not finite[must].any(), f"{name}: finite where it depends on the {place} value: {finite[must]}"
        inside = rows if name in ("out", "lse", "dq") else keys
        outside = ~inside
        assert torch.equal(per_row[outside], base[outside]), f"{name}: changed outside its sequence and head group"


@pytest.mark.parametrize("backend", [b for b in DEVICE_BACKENDS if supported(b, return_lse=True)])
@pytest.mark.parametrize("key", [3, 1100, 2499])  # in the first, a middle and the last of many key tiles
@pytest.mark.parametrize("rows", [4, 40])  # decoded (the C++ kernel's chunks of keys, merged) and prefill
def test_a_nan_key_in_any_tile_of_a_long_row(backend, key, rows):
    """A NaN score reaches every query row that sees it, wherever its key lies among a long row's tiles (one
    in an earlier tile than all finite ones must not be dropped by the running max)."""
    case = make_case([rows, 3], [2500, 5], hq=HQ, hkv=HKV, d=D, seed=4)
    k = case.k.detach().clone()
    k[key, 1, 0] = float("nan")
    out, lse = packattn.varlen_attention(case.q, k, case.v, *case.tensors(), backend=backend, return_lse=True)
    g = HQ // HKV
    assert out[:rows, g:].isnan().all() and lse[g:, :rows].isnan().all()  # the query heads of KV head 1
    assert torch.isfinite(out[:rows, :g]).all() and torch.isfinite(out[rows:]).all()
