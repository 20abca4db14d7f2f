"""Validation (``packattn.inputs``, ``packattn.layout``): every error of the public entry points, its exception
type and message, and no side effects."""

from __future__ import annotations

import math
import sys
from collections.abc import Callable
from typing import Any

import pytest
import torch

import packattn
from packattn.backends import ALL
from packattn.dispatch import BACKENDS

from .helpers import DEVICE_BACKENDS, make_case, supported

Args = dict[str, Any]


def valid_args() -> Args:
    """The DESIGN example: 3 sequences, the second with 0 queries and 8 keys; GQA 4/2, D=16, Dv=8."""
    gen = torch.Generator().manual_seed(0)
    return {
        "q": torch.randn(12, 4, 16, generator=gen),
        "k": torch.randn(25, 2, 16, generator=gen),
        "v": torch.randn(25, 2, 8, generator=gen),
        "cu_seqlens_q": torch.tensor([0, 5, 5, 12], dtype=torch.int32),
        "cu_seqlens_k": torch.tensor([0, 9, 17, 25], dtype=torch.int64),
    }


def with_(**changes: object) -> Callable[[Args], None]:
    return lambda a: a.update(changes)


def retensor(name: str, fn: Callable[[torch.Tensor], object]) -> Callable[[Args], None]:
    def apply(a: Args) -> None:
        a[name] = fn(a[name])

    return apply


def assert_input_error(error: BaseException, exc_type: type[Exception]) -> None:
    """Bad types raise packattn's InputTypeError (both TypeError and ValueError), bad values ValueError: so
    ``except ValueError`` catches every bad input."""
    assert type(error) is (packattn.InputTypeError if exc_type is TypeError else exc_type)
    assert isinstance(error, ValueError)


def check_rejects(
    fn: Callable[..., object],
    args: Args,
    change: Callable[[Args], None],
    exc_type: type[Exception],
    fragments: list[str],
) -> None:
    """``fn(**args)`` after ``change`` raises ``exc_type`` with a message that starts with the function's name
    and holds every fragment, and leaves its inputs as they were."""
    change(args)
    snap = snapshot(args)
    with pytest.raises(exc_type) as info:
        fn(**args)
    assert_input_error(info.value, exc_type)
    message = str(info.value)
    assert message.startswith(f"{fn.__name__}: "), message
    for fragment in fragments:
        assert fragment in message, f"{fragment!r} not in {message!r}"
    assert_unchanged(snap)


def cu(*values: int, dtype: torch.dtype = torch.int64) -> torch.Tensor:
    return torch.tensor(values, dtype=dtype)


# id -> (change to the valid call, exception type, fragments the message must contain)
CASES: dict[str, tuple[Callable[[Args], None], type[Exception], list[str]]] = {
    # q, k, v
    "q_not_tensor": (retensor("q", lambda t: t.tolist()), TypeError, ["q must be a torch.Tensor", "got list"]),
    "k_none": (with_(k=None), TypeError, ["k must be a torch.Tensor", "got NoneType"]),
    "v_float": (with_(v=1.0), TypeError, ["v must be a torch.Tensor", "got float"]),
    "q_2d": (
        retensor("q", lambda t: t[:, 0]),
        ValueError,
        ["q must be 3-D (tokens, heads, head_dim)", "got shape (12, 16)"],
    ),
    "k_4d": (retensor("k", lambda t: t[None]), ValueError, ["k must be 3-D", "got shape (1, 25, 2, 16)"]),
    "v_1d": (retensor("v", lambda t: t.flatten()), ValueError, ["v must be 3-D", "got shape (400,)"]),
    "q_head_dim_0": (
        retensor("q", lambda t: t[..., :0]),
        ValueError,
        ["q must have head_dim > 0", "got shape (12, 4, 0)"],
    ),
    "k_head_dim_0": (
        retensor("k", lambda t: t[..., :0]),
        ValueError,
        ["k must have head_dim > 0", "got shape (25, 2, 0)"],
    ),
    "v_head_dim_0": (
        retensor("v", lambda t: t[..., :0]),
        ValueError,
        ["v must have head_dim > 0", "got shape (25, 2, 0)"],
    ),
    "k_other_device": (
        retensor("k", lambda t: t.to("meta")),
        ValueError,
        ["k must be on the same device as q (cpu)", "got meta"],
    ),
    "v_other_device": (
        retensor("v", lambda t: t.to("meta")),
        ValueError,
        ["v must be on the same device as q (cpu)", "got meta"],
    ),
    "k_other_dtype": (
        retensor("k", lambda t: t.double()),
        TypeError,
        ["k must have the same dtype as q (torch.float32)", "got torch.float64"],
    ),
    "v_other_dtype": (
        retensor("v", lambda t: t.half()),
        TypeError,
        ["v must have the same dtype as q (torch.float32)", "got torch.float16"],
    ),
    "qkv_int": (
        lambda a: a.update({n: a[n].long() for n in "qkv"}),
        TypeError,
        ["q must be float32, float16, bfloat16 or float64", "got torch.int64"],
    ),
    "qkv_complex": (
        lambda a: a.update({n: a[n].to(torch.complex64) for n in "qkv"}),
        TypeError,
        ["q must be float32, float16, bfloat16 or float64", "got torch.complex64"],
    ),
    "k_int_q_float": (
        retensor("k", lambda t: t.int()),
        TypeError,
        ["k must have the same dtype as q (torch.float32)", "got torch.int32"],
    ),
    "kv_token_count": (
        retensor("v", lambda t: t[:24]),
        ValueError,
        ["k and v must have the same number of tokens", "got 25 and 24"],
    ),
    "kv_head_count": (
        retensor("v", lambda t: t[:, :1]),
        ValueError,
        ["k and v must have the same number of heads", "got 2 and 1"],
    ),
    "qk_head_dim": (
        lambda a: a.update(k=a["k"][..., :12]),
        ValueError,
        [
            "q and k must have the same head_dim",
            "because scores are q @ k^T",
            "got 16 and 12",
            "v's head_dim may differ",
        ],
    ),
    "hq_not_multiple_of_hkv": (
        retensor("q", lambda t: t[:, :3]),
        ValueError,
        ["query heads (q.shape[1] = 3)", "must be a multiple of", "key/value heads (k.shape[1] = 2)"],
    ),
    "kv_zero_heads": (
        lambda a: a.update(k=a["k"][:, :0], v=a["v"][:, :0]),
        ValueError,
        ["k must have at least one head, got shape (25, 0, 16)"],
    ),
    # 0 % Hkv == 0: without its own check this reached the kernels (and divided by zero in the C++ one)
    "q_zero_heads": (retensor("q", lambda t: t[:, :0]), ValueError, ["q must have at least one head", "(12, 0, 16)"]),
    # cu_seqlens
    "cu_q_none": (with_(cu_seqlens_q=None), TypeError, ["cu_seqlens_q is required", "1-D int32/int64", "got None"]),
    "cu_k_list": (
        with_(cu_seqlens_k=[0, 9, 17, 25]),
        TypeError,
        ["cu_seqlens_k must be a torch.Tensor of int32/int64 offsets", "got list"],
    ),
    "cu_q_2d": (
        retensor("cu_seqlens_q", lambda t: t[None]),
        ValueError,
        ["cu_seqlens_q must be 1-D (B + 1 offsets)", "got shape (1, 4)"],
    ),
    "cu_k_0d": (with_(cu_seqlens_k=torch.tensor(25)), ValueError, ["cu_seqlens_k must be 1-D", "got shape ()"]),
    "cu_k_float": (
        retensor("cu_seqlens_k", lambda t: t.float()),
        TypeError,
        ["cu_seqlens_k must have dtype int32 or int64", "got torch.float32"],
    ),
    "cu_q_int16": (
        retensor("cu_seqlens_q", lambda t: t.short()),
        TypeError,
        ["cu_seqlens_q must have dtype int32 or int64", "got torch.int16"],
    ),
    "cu_q_one_entry": (
        with_(cu_seqlens_q=cu(12)),
        ValueError,
        ["cu_seqlens_q must have at least 2 entries (B + 1 with B >= 1)", "got 1"],
    ),
    "cu_k_empty": (with_(cu_seqlens_k=cu()), ValueError, ["cu_seqlens_k must have at least 2 entries", "got 0"]),
    "cu_q_start": (with_(cu_seqlens_q=cu(1, 5, 5, 12)), ValueError, ["cu_seqlens_q must start at 0, got 1"]),
    "cu_k_decreasing": (
        with_(cu_seqlens_k=cu(0, 9, 8, 25)),
        ValueError,
        ["cu_seqlens_k must be non-decreasing, got 9 then 8 at positions 1 and 2"],
    ),
    "cu_k_end_design_example": (
        with_(cu_seqlens_k=cu(0, 9, 17, 24)),
        ValueError,
        ["varlen_attention: cu_seqlens_k must end at k.shape[0] (25), got 24"],
    ),
    "cu_k_on_meta_without_host": (
        retensor("cu_seqlens_k", lambda t: t.to("meta")),
        ValueError,
        ["cu_seqlens_k is on the meta device and holds no values", "pass cu_seqlens_k_host"],
    ),
    "cu_q_end": (
        with_(cu_seqlens_q=cu(0, 5, 5, 13)),
        ValueError,
        ["cu_seqlens_q must end at q.shape[0] (12), got 13"],
    ),
    "batch_sizes_differ": (
        with_(cu_seqlens_q=cu(0, 5, 12)),
        ValueError,
        ["cu_seqlens_q and cu_seqlens_k must describe the same number of sequences", "got 2 and 3"],
    ),
    # host copies
    "host_q_length": (
        with_(cu_seqlens_q_host=[0, 5, 12]),
        ValueError,
        ["cu_seqlens_q_host must have the same length as cu_seqlens_q (4)", "got 3"],
    ),
    "host_k_tensor": (
        with_(cu_seqlens_k_host=cu(0, 9, 17, 25)),
        TypeError,
        ["cu_seqlens_k_host must be a list/tuple of Python ints", "got a torch.Tensor"],
    ),
    "host_q_floats": (
        with_(cu_seqlens_q_host=[0, 5.0, 5, 12]),
        TypeError,
        ["cu_seqlens_q_host must hold only Python ints", "got (0, 5.0, 5, 12)"],
    ),
    "host_k_bools": (
        with_(cu_seqlens_k_host=[0, True, 17, 25]),
        TypeError,
        ["cu_seqlens_k_host must hold only Python ints", "got (0, True, 17, 25)"],
    ),
    "host_q_not_iterable": (
        with_(cu_seqlens_q_host=12),
        TypeError,
        ["cu_seqlens_q_host must be a list/tuple of ints", "got int"],
    ),
    "host_k_end": (
        with_(cu_seqlens_k_host=[0, 9, 17, 24]),
        ValueError,
        ["cu_seqlens_k_host must end at k.shape[0] (25), got 24"],
    ),
    "host_q_start": (with_(cu_seqlens_q_host=(2, 5, 5, 12)), ValueError, ["cu_seqlens_q_host must start at 0, got 2"]),
    "host_k_decreasing": (
        with_(cu_seqlens_k_host=[0, 17, 9, 25]),
        ValueError,
        ["cu_seqlens_k_host must be non-decreasing, got 17 then 9 at positions 1 and 2"],
    ),
    # mask options
    "window_three_entries": (
        with_(window_size=(1, 2, 3)),
        ValueError,
        ["window_size must be a pair (left, right)", "got 3 entries: (1, 2, 3)"],
    ),
    "window_one_entry": (with_(window_size=[4]), ValueError, ["window_size must be a pair", "got 1 entries: [4]"]),
    "window_int": (with_(window_size=3), TypeError, ["window_size must be a pair of ints (left, right), got 3"]),
    "window_float": (
        with_(window_size=(2.0, 1)),
        TypeError,
        ["window_size must be a pair of ints (left, right), got (2.0, 1)"],
    ),
    "window_bool": (
        with_(window_size=(True, 0)),
        TypeError,
        ["window_size must be a pair of ints (left, right), got (True, 0)"],
    ),
    "window_left_below_minus_one": (
        with_(window_size=(-2, 0)),
        ValueError,
        ["window_size entries must be >= 0, or -1 for unbounded, got (-2, 0)"],
    ),
    "window_right_below_minus_one": (
        with_(window_size=(3, -5)),
        ValueError,
        ["window_size entries must be >= 0, or -1 for unbounded, got (3, -5)"],
    ),
    "causal_with_right_window": (
        with_(causal=True, window_size=(4, 2)),
        ValueError,
        ["causal=True means window_size right = 0", "got window_size=(4, 2)", "pass causal=False"],
    ),
    "softcap_negative": (
        with_(softcap=-1.0),
        ValueError,
        ["softcap must be a finite float >= 0 (0 disables it), got -1.0"],
    ),
    "softcap_nan": (with_(softcap=math.nan), ValueError, ["softcap must be a finite float >= 0", "got nan"]),
    "softcap_inf": (with_(softcap=math.inf), ValueError, ["softcap must be a finite float >= 0", "got inf"]),
    "softcap_str": (with_(softcap="1.0"), TypeError, ["softcap must be a float, got str"]),
    "softcap_rounds_to_zero": (
        with_(softcap=1e-46),
        ValueError,
        ["softcap must be representable in float32, the compute dtype of torch.float32 inputs", "got 1e-46"],
    ),
    "scale_rounds_to_inf": (
        with_(softmax_scale=1e39),
        ValueError,
        ["softmax_scale must be representable in float32", "got 1e+39"],
    ),
    "softcap_bool": (with_(softcap=True), TypeError, ["softcap must be a float, got bool"]),
    "scale_zero": (with_(softmax_scale=0.0), ValueError, ["softmax_scale must be finite and > 0, got 0.0"]),
    "scale_negative": (with_(softmax_scale=-0.25), ValueError, ["softmax_scale must be finite and > 0, got -0.25"]),
    "scale_nan": (with_(softmax_scale=math.nan), ValueError, ["softmax_scale must be finite and > 0, got nan"]),
    "scale_inf": (with_(softmax_scale=math.inf), ValueError, ["softmax_scale must be finite and > 0, got inf"]),
    "scale_tensor": (
        with_(softmax_scale=torch.tensor(0.5)),
        TypeError,
        ["softmax_scale must be a float or None, got Tensor"],
    ),
    "causal_int": (with_(causal=1), TypeError, ["causal must be a bool, got int"]),
    "causal_str": (with_(causal="yes"), TypeError, ["causal must be a bool, got str"]),
    "return_lse_int": (with_(return_lse=1), TypeError, ["return_lse must be a bool, got int"]),
    "return_lse_none": (with_(return_lse=None), TypeError, ["return_lse must be a bool, got NoneType"]),
    # backends
    "backend_unknown": (
        with_(backend="flash"),
        ValueError,
        ["unknown backend 'flash'", f"expected None or one of {sorted(BACKENDS)}"],
    ),
    "backend_not_str": (with_(backend=["sdpa"]), TypeError, ["backend must be a str or None, got list"]),
    "sdpa_with_lse": (
        with_(backend="sdpa", return_lse=True),
        ValueError,
        ["backend='sdpa' cannot run these inputs", "returns no LSE (return_lse=True)"],
    ),
    "sdpa_with_softcap_and_window": (
        with_(backend="sdpa", softcap=5.0, window_size=(3, 1)),
        ValueError,
        [
            "backend='sdpa' cannot run these inputs: ",
            "no soft-capping (softcap=5.0); ",
            "no sliding window (window_size=(3, 1))",
        ],
    ),
}


def snapshot(args: Args) -> list[tuple[str, torch.Tensor, torch.Tensor | None, int]]:
    """Every tensor argument with a copy of its values (None on the meta device) and its version counter."""
    return [
        (name, t, None if t.is_meta else t.clone(), t._version)
        for name, t in args.items()
        if isinstance(t, torch.Tensor)
    ]


def assert_unchanged(snap: list[tuple[str, torch.Tensor, torch.Tensor | None, int]]) -> None:
    for name, t, copy, version in snap:
        assert t._version == version, f"{name} was modified in place"
        if copy is not None:
            assert torch.equal(t.nan_to_num(7.0), copy.nan_to_num(7.0)), f"{name} values changed"


@pytest.fixture
def no_backend_runs(monkeypatch: pytest.MonkeyPatch) -> None:
    """Validation errors must come before any backend computes anything."""

    def refuse(inp: object) -> None:
        raise AssertionError("a backend's forward ran on invalid inputs")

    for backend in ALL:
        monkeypatch.setattr(backend, "forward", refuse)


def test_valid_args_run():
    args = valid_args()
    out = packattn.varlen_attention(**args)
    assert out.shape == (12, 4, 8)


@pytest.mark.usefixtures("no_backend_runs")
@pytest.mark.parametrize("case", CASES, ids=list(CASES))
def test_varlen_attention_rejects(case):
    check_rejects(packattn.varlen_attention, valid_args(), *CASES[case])


def test_backend_unknown_lists_every_name():
    with pytest.raises(ValueError) as info:
        packattn.varlen_attention(**valid_args(), backend="cuda")
    for name in BACKENDS:
        assert repr(name) in str(info.value)


CAUSAL_BACKENDS = [b for b in DEVICE_BACKENDS if supported(b, causal=True)]


@pytest.mark.parametrize("requires_grad", [False, True], ids=["no_grad", "grad"])
@pytest.mark.parametrize("backend", [None, *CAUSAL_BACKENDS], ids=["default", *CAUSAL_BACKENDS])
def test_inputs_never_modified_on_success(backend, requires_grad):
    case = make_case([5, 0, 7], [9, 8, 8], hq=4, hkv=2, d=16, dv=8)
    leaves = [t.detach().clone().requires_grad_(requires_grad) for t in (case.q, case.k, case.v)]
    cu_q, cu_k = case.tensors()
    args: Args = {"q": leaves[0], "k": leaves[1], "v": leaves[2], "cu_seqlens_q": cu_q, "cu_seqlens_k": cu_k}
    snap = snapshot(args)
    host = {"cu_seqlens_q_host": list(case.cu_q), "cu_seqlens_k_host": list(case.cu_k)}
    out = packattn.varlen_attention(**args, **host, causal=True, backend=backend)
    if requires_grad:
        out.sum().backward()
        assert all(t.grad is not None for t in leaves)
    assert_unchanged(snap)
    assert host == {"cu_seqlens_q_host": case.cu_q, "cu_seqlens_k_host": case.cu_k}


# merge_attention_states -------------------------------------------------------------------------------


def merge_args() -> Args:
    gen = torch.Generator().manual_seed(0)
    return {
        "out_a": torch.randn(5, 2, 4, generator=gen),
        "lse_a": torch.randn(2, 5, generator=gen),
        "out_b": torch.randn(5, 2, 4, generator=gen),
        "lse_b": torch.randn(2, 5, generator=gen),
    }


MERGE_CASES: dict[str, tuple[Callable[[Args], None], type[Exception], list[str]]] = {
    "out_a_list": (retensor("out_a", lambda t: t.tolist()), TypeError, ["out_a must be a torch.Tensor, got list"]),
    "lse_b_none": (with_(lse_b=None), TypeError, ["lse_b must be a torch.Tensor, got NoneType"]),
    "out_b_int": (
        retensor("out_b", lambda t: t.long()),
        TypeError,
        ["out_b must be a floating-point tensor, got torch.int64"],
    ),
    "lse_a_int": (
        retensor("lse_a", lambda t: t.int()),
        TypeError,
        ["lse_a must be a floating-point tensor, got torch.int32"],
    ),
    "out_shapes_differ": (
        retensor("out_b", lambda t: t[..., :3]),
        ValueError,
        ["out_a and out_b must both be (T, H, Dv) of the same shape", "got (5, 2, 4) and (5, 2, 3)"],
    ),
    "out_2d": (
        lambda a: a.update(out_a=a["out_a"][:, 0], out_b=a["out_b"][:, 0]),
        ValueError,
        ["out_a and out_b must both be (T, H, Dv)", "got (5, 4) and (5, 4)"],
    ),
    "lse_a_transposed": (
        retensor("lse_a", lambda t: t.T),
        ValueError,
        ["lse_a must have shape (H, T) = (2, 5), got (5, 2)"],
    ),
    "lse_b_trailing_dim": (
        retensor("lse_b", lambda t: t[..., None]),
        ValueError,
        ["lse_b must have shape (H, T) = (2, 5), got (2, 5, 1)"],
    ),
    "out_dtypes_differ": (
        retensor("out_b", lambda t: t.bfloat16()),
        TypeError,
        ["out_a and out_b must have the same dtype, got torch.float32 and torch.bfloat16"],
    ),
    "lse_dtypes_differ": (
        retensor("lse_b", lambda t: t.double()),
        TypeError,
        ["lse_a and lse_b must have the same dtype, got torch.float32 and torch.float64"],
    ),
    "out_b_other_device": (
        retensor("out_b", lambda t: t.to("meta")),
        ValueError,
        ["out_b must be on the same device as out_a (cpu), got meta"],
    ),
    "lse_a_other_device": (
        retensor("lse_a", lambda t: t.to("meta")),
        ValueError,
        ["lse_a must be on the same device as out_a (cpu), got meta"],
    ),
}


@pytest.mark.parametrize("case", MERGE_CASES, ids=list(MERGE_CASES))
def test_merge_rejects(case):
    check_rejects(packattn.merge_attention_states, merge_args(), *MERGE_CASES[case])


def test_merge_never_modifies_inputs():
    args = merge_args()
    args["lse_a"][0, 1] = -math.inf
    args["out_a"][1, 0] = math.nan
    snap = snapshot(args)
    out, lse = packattn.merge_attention_states(**args)
    assert not torch.isnan(out).any() and out.shape == (5, 2, 4) and lse.shape == (2, 5)
    assert_unchanged(snap)


@pytest.mark.parametrize("backend", [b for b in DEVICE_BACKENDS if supported(b, window_size=(3, 2))])
def test_window_bounds_near_the_int64_limit_are_unbounded(backend):
    """Bounds no sequence can reach mean unbounded: the same bits as -1, for bounds up to past int64 (which
    once overflowed the kernels' mask arithmetic: all-zero rows, or dK = dV = 0)."""
    case = make_case([5, 0, 9], [7, 4, 3], hq=4, hkv=2, d=8, seed=3, requires_grad=True)
    cu_q, cu_k = case.tensors()
    results = []
    for window in [(-1, -1), (-1, sys.maxsize), (2**63, 2**60), (2**60, 2**64)]:
        out, lse = packattn.varlen_attention(
            case.q, case.k, case.v, cu_q, cu_k, window_size=window, return_lse=True, backend=backend
        )
        grads = torch.autograd.grad(out.sum() + lse.nan_to_num(0.0, 0.0, 0.0).sum(), (case.q, case.k, case.v))
        results.append((out, lse, *grads))
    for other in results[1:]:
        for a, b in zip(results[0], other):
            assert torch.equal(a, b)
    causal = packattn.varlen_attention(case.q, case.k, case.v, cu_q, cu_k, causal=True, backend=backend)
    big_left = packattn.varlen_attention(
        case.q, case.k, case.v, cu_q, cu_k, window_size=(sys.maxsize, 0), backend=backend
    )
    assert torch.equal(causal, big_left)
