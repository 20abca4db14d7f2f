"""Property tests: random layouts and options against the oracle, random malformed offsets rejected."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import packattn
from packattn.testing import assert_close_to_oracle, attention_naive, oracle

from .helpers import COMPILED_LSE_BACKENDS, make_case, offsets, supported
from .strategies import BOUNDED, layouts


@BOUNDED
@given(layouts())
def test_random_layouts_match_oracle(layout):
    case = make_case(
        layout.lens_q, layout.lens_k, hq=layout.hq, hkv=layout.hkv, d=layout.d, dv=layout.dv, seed=layout.seed
    )
    cu_q, cu_k = case.tensors()
    mask = layout.mask
    ref_out, ref_lse = oracle(case.q, case.k, case.v, case.cu_q, case.cu_k, **mask)
    pt_out, pt_lse = attention_naive(case.q, case.k, case.v, case.cu_q, case.cu_k, **mask)

    out = packattn.varlen_attention(case.q, case.k, case.v, cu_q, cu_k, **mask)
    assert out.shape == ref_out.shape and out.dtype == torch.float32 and out.is_contiguous()
    assert_close_to_oracle(out, ref_out, pt_out, name="default dispatch out")

    for backend in (None, *COMPILED_LSE_BACKENDS):
        out, lse = packattn.varlen_attention(
            case.q, case.k, case.v, cu_q, cu_k, return_lse=True, backend=backend, **mask
        )
        assert lse.dtype == torch.float32 and lse.shape == (layout.hq, case.q.shape[0])
        assert_close_to_oracle(out, ref_out, pt_out, name=f"{backend or 'default'} out")
        assert_close_to_oracle(lse, ref_lse, pt_lse, name=f"{backend or 'default'} lse", floor=1e-5)
    if supported("sdpa", **mask):  # no LSE, window or softcap: sdpa takes the rest
        out = packattn.varlen_attention(case.q, case.k, case.v, cu_q, cu_k, backend="sdpa", **mask)
        assert_close_to_oracle(out, ref_out, pt_out, name="sdpa out")


# Malformed offsets ------------------------------------------------------------------------------------

SIDES = {"q": "cu_seqlens_q", "k": "cu_seqlens_k"}


@dataclass(frozen=True)
class Malformed:
    kwargs: dict[str, Any]
    error: type[Exception]  # exactly this type
    expect: str  # a fragment the message must contain besides "varlen_attention:" and "cu_seqlens"


def _mutate_offsets(draw: st.DrawFn, cu: list[int]) -> tuple[object, type[Exception], str]:
    """A malformed replacement for the offsets ``cu`` (device tensor), the expected exception type and
    message fragment."""
    kind = draw(
        st.sampled_from(
            ["decreasing", "start", "end", "sequences", "dtype", "ndim", "too_short", "not_tensor"]
            if len(cu) > 2
            else ["start", "end", "sequences", "dtype", "ndim", "too_short", "not_tensor"]
        )
    )
    dtype = draw(st.sampled_from([torch.int32, torch.int64]))
    cu = list(cu)
    if kind == "decreasing":
        i = draw(st.integers(1, len(cu) - 2))
        cu[i] = cu[i + 1] + draw(st.integers(1, 10))
        return torch.tensor(cu, dtype=dtype), ValueError, "must be non-decreasing"
    if kind == "start":
        cu[0] = draw(st.integers(-10, 10).filter(bool))
        return torch.tensor(cu, dtype=dtype), ValueError, "must start at 0"
    if kind == "end":
        last = cu[-1] - cu[-2]
        cu[-1] += draw(st.integers(-last, 10).filter(bool) if last else st.integers(1, 10))
        return torch.tensor(cu, dtype=dtype), ValueError, "must end at"
    if kind == "sequences":
        # Valid on its own, but describes a different number of sequences than the other side.
        if len(cu) > 2 and draw(st.booleans()):
            del cu[draw(st.integers(1, len(cu) - 2))]
        else:
            cu.insert(draw(st.integers(1, len(cu) - 1)), cu[-1] if draw(st.booleans()) else cu[0])
            cu.sort()
        return torch.tensor(cu, dtype=dtype), ValueError, "must describe the same number of sequences"
    if kind == "dtype":
        bad = draw(st.sampled_from([torch.int16, torch.uint8, torch.int8, torch.float32, torch.float64, torch.bool]))
        return torch.tensor(cu).to(bad), TypeError, "must have dtype int32 or int64"
    if kind == "ndim":
        t = torch.tensor(cu, dtype=dtype)
        bad = draw(st.sampled_from([t[None], t[:, None], t.reshape(1, 1, -1), torch.tensor(cu[-1])]))
        return bad, ValueError, "must be 1-D"
    if kind == "too_short":
        short = torch.tensor(draw(st.sampled_from([[], [cu[-1]]])), dtype=dtype)
        return short, ValueError, "must have at least 2 entries"
    bad = draw(st.sampled_from([cu, tuple(cu), None]))
    return bad, TypeError, "must be a torch.Tensor" if bad is not None else "is required"


def _mutate_host(draw: st.DrawFn, cu: list[int]) -> tuple[object, type[Exception], str]:
    """A malformed host copy of the valid offsets ``cu``, the expected exception type and message fragment."""
    kind = draw(st.sampled_from(["length", "tensor", "not_ints", "end", "start", "decreasing", "not_iterable"]))
    host = list(cu)
    if kind == "length":
        if draw(st.booleans()):
            host.append(host[-1])
        else:
            host.pop(draw(st.integers(1, len(host) - 1)))
        return host, ValueError, "must have the same length as"
    if kind == "tensor":
        return torch.tensor(host), TypeError, "got a torch.Tensor"
    if kind == "not_ints":
        host[draw(st.integers(0, len(host) - 1))] = draw(st.sampled_from([1.0, "3", None, True, 2.5]))
        return host, TypeError, "must hold only Python ints"
    if kind == "end":
        host[-1] += draw(st.integers(1, 10))
        return host, ValueError, "must end at"
    if kind == "start":
        host[0] = draw(st.integers(1, 10))
        return host, ValueError, "must start at 0"
    if kind == "decreasing":
        if len(host) < 3:
            host = [0, host[-1] + 1, host[-1]]
            return host, ValueError, "must have the same length as"
        i = draw(st.integers(1, len(host) - 2))
        host[i] = host[i + 1] + draw(st.integers(1, 10))
        return host, ValueError, "must be non-decreasing"
    return draw(st.sampled_from([7, 3.5, object()])), TypeError, "must be a list/tuple of ints"


@st.composite
def malformed(draw: st.DrawFn) -> Malformed:
    batch = draw(st.integers(1, 5))
    lens = {s: draw(st.lists(st.integers(0, 6), min_size=batch, max_size=batch)) for s in SIDES}
    cus = {s: offsets(lens[s]) for s in SIDES}
    gen = torch.Generator().manual_seed(0)
    kwargs: dict[str, Any] = {
        "q": torch.randn(cus["q"][-1], 2, 8, generator=gen),
        "k": torch.randn(cus["k"][-1], 1, 8, generator=gen),
        "v": torch.randn(cus["k"][-1], 1, 8, generator=gen),
    }
    for s, name in SIDES.items():
        kwargs[name] = torch.tensor(cus[s], dtype=draw(st.sampled_from([torch.int32, torch.int64])))
    side = draw(st.sampled_from(sorted(SIDES)))
    name = SIDES[side]
    other = SIDES["k" if side == "q" else "q"]
    if draw(st.booleans()):
        kwargs[other + "_host"] = list(cus["k" if side == "q" else "q"])
    if draw(st.booleans()):
        kwargs[name], error, expect = _mutate_offsets(draw, cus[side])
        if expect == "must describe the same number of sequences" and draw(st.booleans()):
            kwargs[name + "_host"] = kwargs[name].tolist()
    else:
        kwargs[name + "_host"], error, expect = _mutate_host(draw, cus[side])
    return Malformed(kwargs, error, expect)


@BOUNDED
@given(malformed())
def test_malformed_offsets_are_rejected(case):
    snapshot = {n: t.clone() for n, t in case.kwargs.items() if isinstance(t, torch.Tensor)}
    with pytest.raises(case.error) as info:
        packattn.varlen_attention(**case.kwargs)
    assert type(info.value) is (packattn.InputTypeError if case.error is TypeError else case.error)
    assert isinstance(info.value, ValueError)  # every bad input
    message = str(info.value)
    assert message.startswith("varlen_attention: ") and "cu_seqlens" in message, message
    assert case.expect in message, f"{case.expect!r} not in {message!r}"
    for n, t in snapshot.items():
        assert torch.equal(case.kwargs[n], t), f"{n} was modified"
