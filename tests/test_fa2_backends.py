"""The ``flash_attn`` and ``torch_varlen`` adapters against models of their kernels' interfaces, on CPU.

Neither kernel runs without a CUDA GPU. These tests install, for the test only, an interface model of each
(not the library): a function with the library's signature that checks what flash-attention-2-style kernels
require of their arguments (int32 contiguous offsets on the tensors' device, ``max_seqlen`` covering every
length, fp16/bf16, ``D == Dv <= 256`` a multiple of 8 (flash-attn's Python function pads, ``varlen_attn`` does
not), unit last-dim stride and 16-byte aligned rows), reads the window as their ``mha_varlen_fwd`` does, computes
with the float64 oracle and answers in the library's conventions (LSE ``(Hq, Tq)`` float32, **+inf** for rows that
see no key). What is tested is the
adapters' translation: offsets, maxima, options, the LSE convention, refusals and the exact backward.
With ``PACKATTN_TEST_DEVICE=cuda`` on a GPU machine the ordinary backend tests run the real kernels.
"""

from __future__ import annotations

import itertools
import re
import subprocess
import sys
import types
from dataclasses import replace

import pytest
import torch
from torch.nn.attention import varlen as torch_varlen_module

import packattn
from packattn import dispatch
from packattn.backends import fa2_convention, flash_attn, torch_varlen
from packattn.compat.flash_attn import flash_attn_varlen_func
from packattn.testing import oracle

from .helpers import assert_matches_oracle, case_inputs, check_backward, make_case, point_at

CALLS: list[dict[str, object]] = []
FIND_FLASH_ATTN_BACKWARD = flash_attn._varlen_backward  # the fixture below replaces it


def kernel_window(left, right, max_k):
    """The window flash-attn 2's ``mha_varlen_fwd`` applies: bounds ``>= max_seqlen_k`` dropped, then a window
    bounded on one side only gets ``max_seqlen_k`` on the other."""
    left, right = (-1 if b >= max_k else b for b in (left, right))
    if left < 0 <= right:
        left = max_k
    if right < 0 <= left:
        right = max_k
    return left, right


def _loadable(*tensors):
    """The kernels' 16-byte vector loads: unit last stride, aligned base and row strides."""
    return all(
        t.stride(-1) == 1 and t.data_ptr() % 16 == 0 and all(s % 8 == 0 for s in t.stride()[:-1]) for t in tensors
    )


def _model(q, k, v, cu_q, cu_k, max_q, max_k, *, scale, window, softcap=0.0):
    """The interface both kernels share, computed with the float64 oracle."""
    assert q.dtype in (torch.float16, torch.bfloat16) and k.dtype == v.dtype == q.dtype
    assert q.shape[2] == k.shape[2] == v.shape[2] <= 256
    assert q.shape[2] % 8 == 0, "head_size must be a multiple of 8, this is ensured by padding!"
    assert _loadable(q, k, v), "last dim contiguous, rows 16-byte aligned"
    for cu, t in ((cu_q, q), (cu_k, k)):
        assert cu.dtype == torch.int32 and cu.is_contiguous() and cu.device == q.device and cu.dim() == 1
        assert int(cu[-1]) == t.shape[0]
    assert cu_q.numel() == cu_k.numel() >= 2, "batch size must be positive"
    host_q, host_k = cu_q.tolist(), cu_k.tolist()
    assert max_q == max(b - a for a, b in itertools.pairwise(host_q)), "max_seqlen_q must be the longest query side"
    assert max_k == max(b - a for a, b in itertools.pairwise(host_k)), "max_seqlen_k must be the longest key side"
    CALLS.append({"max": (max_q, max_k), "window": tuple(window), "scale": scale, "softcap": softcap})
    window = kernel_window(*window, max_k)
    out, lse = oracle(q, k, v, host_q, host_k, softmax_scale=scale, window_size=window, softcap=softcap)
    # FA2 writes +inf where the softmax sum is 0 (no key) or NaN (a NaN or +inf score).
    return out.to(q.dtype), lse.float().masked_fill(torch.isneginf(lse) | torch.isnan(lse), float("inf"))


def fake_flash_attn_varlen_func(
    q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0, softmax_scale=None,
    causal=False, window_size=(-1, -1), softcap=0.0, alibi_slopes=None, deterministic=False,
    return_attn_probs=False, block_table=None,
):  # fmt: skip
    assert dropout_p == 0.0 and alibi_slopes is None and block_table is None
    d, pad = q.shape[2], -q.shape[2] % 8  # its Python wrapper pads the head dim (2.7+)
    q, k, v = (torch.nn.functional.pad(t, (0, pad)) if pad else t for t in (q, k, v))
    left, right = window_size
    out, lse = _model(
        q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
        scale=softmax_scale, window=(left, 0 if causal else right), softcap=softcap,
    )  # fmt: skip
    out = out[..., :d]
    return (out, lse, None) if return_attn_probs else out


def fake_varlen_attn(
    query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, return_aux=None, scale=None, window_size=(-1, -1),
    enable_gqa=False, seqused_k=None, block_table=None, num_splits=None,
):  # fmt: skip
    assert enable_gqa == (query.shape[1] != key.shape[1]), "enable_gqa must be set exactly for GQA"
    assert seqused_k is None and block_table is None
    out, lse = _model(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, scale=scale, window=window_size)
    return (out, lse) if return_aux is not None and return_aux.lse else out


def _backward_model(dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, *, scale, window, softcap=0.0):
    """The backward interface both kernels share: the forward's tensors and LSE in their convention (+inf for
    rows that see no key), gradients of ``out`` computed with the float64 oracle."""
    assert all(t.dtype == q.dtype for t in (dout, k, v, out)) and _loadable(dout, q, k, v, out), "dtypes / layouts"
    assert dout.shape == out.shape == (q.shape[0], q.shape[1], v.shape[2])
    host_q, host_k = cu_q.tolist(), cu_k.tolist()
    assert cu_q.dtype == cu_k.dtype == torch.int32 and host_q[-1] == q.shape[0] and host_k[-1] == k.shape[0]
    assert (max_q, max_k) == (
        max(b - a for a, b in itertools.pairwise(host_q)),
        max(b - a for a, b in itertools.pairwise(host_k)),
    )
    options = {"softmax_scale": scale, "window_size": kernel_window(*window, max_k), "softcap": softcap}
    xs = [t.detach().double() for t in (q, k, v)]
    # torch.func, not torch.autograd: inside packattn's backward op autograd records nothing.
    (_, want_lse), vjp = torch.func.vjp(lambda *ts: oracle(*ts, host_q, host_k, **options), *xs)
    grads = vjp((dout.double(), torch.zeros_like(want_lse)))
    assert lse.dtype == torch.float32 and lse.shape == (q.shape[1], q.shape[0]) and lse.is_contiguous()
    assert torch.equal(torch.isposinf(lse), torch.isneginf(want_lse)), "rows without keys must have the kernels' +inf"
    seen = torch.isfinite(lse)
    torch.testing.assert_close(lse[seen].double(), want_lse[seen], atol=1e-2, rtol=1e-3)
    BACKWARD_CALLS.append({"window": tuple(window), "scale": scale, "softcap": softcap})
    return tuple(g.to(q.dtype) for g in grads)


BACKWARD_CALLS: list[dict[str, object]] = []


def fake_flash_attn_varlen_backward(
    dout, q, k, v, out, softmax_lse, dq, dk, dv, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p,
    softmax_scale, causal, window_size_left, window_size_right, softcap, alibi_slopes, deterministic, rng_state=None,
):  # fmt: skip
    """``torch.ops.flash_attn._flash_attn_varlen_backward`` (flash_attn >= 2.7): fills dq, dk, dv."""
    assert q.shape[2] % 8 == 0 and v.shape[2] == q.shape[2] <= 256, "head_size should be a multiple of 8"
    assert all(g.shape == t.shape and g.dtype == t.dtype for g, t in ((dq, q), (dk, k), (dv, v)))
    assert dropout_p == 0.0 and alibi_slopes is None and rng_state is None and isinstance(deterministic, bool)
    right = 0 if causal else window_size_right
    grads = _backward_model(
        dout, q, k, v, out, softmax_lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
        scale=softmax_scale, window=(window_size_left, right), softcap=softcap,
    )  # fmt: skip
    BACKWARD_CALLS[-1]["deterministic"] = deterministic
    for dst, g in zip((dq, dk, dv), grads, strict=True):
        dst.copy_(g)
    return torch.empty(q.shape[1], q.shape[0] + 128 * (cu_seqlens_q.numel() - 1))  # softmax_d


def fake_varlen_attn_backward(
    grad_out, query, key, value, out, lse, cu_seq_q, cu_seq_k, max_q, max_k, is_causal, rng_state, scale=None,
    window_size=None,
):  # fmt: skip
    """``torch.ops.torch_attn._varlen_attn_backward``: the op ``varlen_attn``'s own autograd calls."""
    assert rng_state.dtype == torch.uint64 and rng_state.shape == (2,)
    assert not is_causal and isinstance(window_size, list) and len(window_size) == 2
    return _backward_model(
        grad_out, query, key, value, out, lse, cu_seq_q, cu_seq_k, max_q, max_k, scale=scale, window=window_size
    )


@pytest.fixture
def models(monkeypatch):
    """Both kernels' interface models in place of the libraries, taking CPU tensors."""
    fake = types.ModuleType("flash_attn")
    fake.flash_attn_varlen_func = fake_flash_attn_varlen_func  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "flash_attn", fake)
    monkeypatch.setattr(torch_varlen_module, "varlen_attn", fake_varlen_attn)
    monkeypatch.setattr(flash_attn, "_varlen_backward", lambda: fake_flash_attn_varlen_backward)
    monkeypatch.setattr(torch_varlen, "_varlen_backward", lambda: fake_varlen_attn_backward)
    for backend in (flash_attn.BACKEND, torch_varlen.BACKEND):
        point_at(monkeypatch, backend, "cpu")
    for cached in (flash_attn._varlen_func, torch_varlen._module):
        cached.cache_clear()
    CALLS.clear()
    BACKWARD_CALLS.clear()
    yield
    for cached in (flash_attn._varlen_func, torch_varlen._module):
        cached.cache_clear()


BACKENDS = ["flash_attn", "torch_varlen"]
MASKS = {
    "full": {},
    "causal": {"causal": True},
    "window": {"window_size": (3, 2)},
    "right_band": {"window_size": (-1, 1)},
    "scale": {"softmax_scale": 0.3},
}
# Empty sides, Lq > Lk (causal rows with no key: +inf from the kernel), one query, GQA.
LENS = ([5, 0, 7, 4, 9, 1], [9, 8, 8, 0, 3, 6])


def attention(name, case, **mask):
    cu_q, cu_k = case.tensors()
    return packattn.varlen_attention(case.q, case.k, case.v, cu_q, cu_k, backend=name, return_lse=True, **mask)


@pytest.mark.parametrize("mask", MASKS)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("name", BACKENDS)
def test_forward_matches_oracle_with_our_lse_convention(models, name, dtype, mask):
    case = make_case(*LENS, hq=4, hkv=2, d=16, dtype=dtype, seed=5)
    out, lse = attention(name, case, **MASKS[mask])
    assert_matches_oracle(case, out, lse, **MASKS[mask])
    assert torch.isneginf(lse[:, 12:16]).all()  # the sequence with no keys: -inf, never the kernel's +inf
    assert not (lse == float("inf")).any()
    call = CALLS[-1]
    assert call["max"] == (max(LENS[0]), max(LENS[1]))
    assert call["scale"] == MASKS[mask].get("softmax_scale", 16**-0.5)


def test_flash_attn_passes_softcap(models):
    case = make_case(*LENS, hq=4, hkv=1, d=16, dtype=torch.bfloat16, seed=6)
    out, lse = attention("flash_attn", case, softcap=2.0, causal=True)
    assert_matches_oracle(case, out, lse, softcap=2.0, causal=True)
    assert CALLS[-1]["softcap"] == 2.0 and CALLS[-1]["window"] == (-1, 0)


@pytest.mark.parametrize("name", BACKENDS)
def test_nothing_to_compute_never_calls_the_kernel(models, name):
    for lens in (([0, 0], [3, 4]), ([2, 3], [0, 0])):
        case = make_case(*lens, hq=2, hkv=2, d=8, dtype=torch.float16)
        out, lse = attention(name, case)
        assert_matches_oracle(case, out, lse)
    assert CALLS == []


@pytest.mark.parametrize("name", BACKENDS)
def test_backward_is_exact_and_takes_the_lse_gradient(models, name):
    case = make_case(*LENS, hq=4, hkv=2, d=16, dtype=torch.bfloat16, seed=7, requires_grad=True)
    cu_q, cu_k = case.tensors()
    dout = torch.randn(case.q.shape[0], 4, 16, dtype=torch.float64)
    dlse = torch.randn(4, case.q.shape[0], dtype=torch.float64)
    out, lse = packattn.varlen_attention(case.q, case.k, case.v, cu_q, cu_k, backend=name, causal=True, return_lse=True)
    got = torch.autograd.grad((out.double() * dout).sum() + (lse.double().nan_to_num(0, 0, 0) * dlse).sum(),
                              (case.q, case.k, case.v))  # fmt: skip
    xs = [t.detach().double().requires_grad_() for t in (case.q, case.k, case.v)]
    o, l_ = oracle(*xs, case.cu_q, case.cu_k, causal=True)
    want = torch.autograd.grad((o * dout).sum() + (l_.nan_to_num(0, 0, 0) * dlse).sum(), xs)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g.double(), w, atol=0.05, rtol=0.05)
    check_backward(name, make_case(*LENS, hq=4, hkv=2, d=16, dtype=torch.float16, seed=8, requires_grad=True))


@pytest.mark.parametrize("mask", MASKS)
@pytest.mark.parametrize("name", BACKENDS)
def test_gradients_of_out_alone_run_on_the_librarys_backward(models, name, mask):
    # D = 20: flash-attn's backward kernel takes multiples of 8, so the adapter pads (as its autograd does).
    case = make_case(*LENS, hq=4, hkv=2, d=20, dtype=torch.float16, seed=9, requires_grad=True)
    check_backward(name, case, **MASKS[mask])  # out and LSE in the loss: packattn's backward
    assert BACKWARD_CALLS == []
    out, _ = attention(name, case, **MASKS[mask])
    dout = torch.randn(out.shape, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    got = torch.autograd.grad((out.double() * dout).sum(), (case.q, case.k, case.v))
    assert len(BACKWARD_CALLS) == 1  # the LSE has no gradient: the library's kernel
    xs = [t.detach().double().requires_grad_() for t in (case.q, case.k, case.v)]
    want = torch.autograd.grad((oracle(*xs, case.cu_q, case.cu_k, **MASKS[mask])[0] * dout).sum(), xs)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g.double(), w, atol=0.02, rtol=0.02)


def test_deterministic_reaches_flash_attn_and_passes_torch_varlen_over(models, monkeypatch):
    monkeypatch.setitem(dispatch.PRIORITY, "cpu", ("flash_attn", "reference"))  # as on CUDA
    case = make_case(*LENS, hq=4, hkv=2, d=16, dtype=torch.bfloat16, seed=10, requires_grad=True)
    cu_q, cu_k = case.tensors()
    for deterministic in (False, True):
        out = flash_attn_varlen_func(
            case.q, case.k, case.v, cu_q.int(), cu_k.int(), max(LENS[0]), max(LENS[1]), causal=True,
            deterministic=deterministic,
        )  # fmt: skip
        out.float().sum().backward()
        assert BACKWARD_CALLS[-1]["deterministic"] is deterministic
    inp = replace(case_inputs(case), grad=True, deterministic=True)
    assert dispatch.backward(torch_varlen.BACKEND, inp, lse_grad=False, where="t") != torch_varlen.BACKEND.backward


def test_a_library_without_the_backward_op_gets_packattns(models, monkeypatch):
    monkeypatch.setattr(flash_attn, "_varlen_backward", lambda: None)
    case = make_case(*LENS, hq=4, hkv=2, d=16, dtype=torch.float16, seed=11, requires_grad=True)
    inp = replace(case_inputs(case), grad=True)
    assert flash_attn.BACKEND.own_backward_reasons(inp) == [
        "this flash_attn has no torch.ops.flash_attn._flash_attn_varlen_backward of 2.7-2.8's parameters"
    ]
    out, _ = attention("flash_attn", case)
    got = torch.autograd.grad(out.double().sum(), (case.q, case.k, case.v))
    assert BACKWARD_CALLS == []  # packattn's backward served
    xs = [t.detach().double().requires_grad_() for t in (case.q, case.k, case.v)]
    want = torch.autograd.grad(oracle(*xs, case.cu_q, case.cu_k)[0].sum(), xs)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g.double(), w, atol=0.02, rtol=0.02)


REFUSALS = [
    ("fp32", {"dtype": torch.float32}, {}, "takes float16 or bfloat16 only, got torch.float32"),
    ("dv", {"dv": 8}, {}, "needs v's head_dim equal to q's, got D=16 and Dv=8"),
    ("head_dim", {"d": 288}, {}, "takes head dims up to 256, got D=288 and Dv=288"),
]


@pytest.mark.parametrize("name", BACKENDS)
@pytest.mark.parametrize(("case_options", "mask", "fragment"), [r[1:] for r in REFUSALS], ids=[r[0] for r in REFUSALS])
def test_refusals_name_the_limit(models, name, case_options, mask, fragment):
    options = {"hq": 2, "hkv": 2, "d": 16, "dtype": torch.float16, **case_options}
    case = make_case([3, 4], [5, 2], **options)
    with pytest.raises(ValueError, match=f"backend='{name}' cannot run these inputs: .*{re.escape(fragment)}"):
        attention(name, case, **mask)


def test_dispatch_takes_them_first_and_falls_back_past_their_limits(models, monkeypatch):
    monkeypatch.setitem(dispatch.PRIORITY, "cpu", ("flash_attn", "torch_varlen", "reference"))
    half = make_case([3, 4], [5, 2], hq=2, hkv=2, d=16, dtype=torch.float16)
    assert dispatch.select(case_inputs(half), None, "t").name == "flash_attn"
    assert dispatch.select(case_inputs(half, softcap=1.0), None, "t").name == "flash_attn"
    monkeypatch.setattr(flash_attn.BACKEND, "unavailable_reason", lambda: "flash_attn is not installed")
    assert dispatch.select(case_inputs(half), None, "t").name == "torch_varlen"
    assert dispatch.select(case_inputs(half, softcap=1.0), None, "t").name == "reference"
    single = make_case([3, 4], [5, 2], hq=2, hkv=2, d=16, dtype=torch.float32)
    assert dispatch.select(case_inputs(single), None, "t").name == "reference"


def test_torch_varlen_refuses_softcap_and_flash_attn_gqa_decode_bug(models):
    case = make_case([3, 4], [5, 2], hq=2, hkv=2, d=16, dtype=torch.float16)
    with pytest.raises(ValueError, match=r"torch\.nn\.attention\.varlen has no soft-capping"):
        attention("torch_varlen", case, softcap=1.0)
    decode = make_case([1, 0, 1], [5, 2, 3], hq=4, hkv=2, d=16, dtype=torch.float16)
    with pytest.raises(ValueError, match="mishandles GQA batches of at most one query per sequence"):
        attention("flash_attn", decode)


def test_refuse_other_devices_and_say_why_here():
    case = make_case([3], [3], hq=2, hkv=2, d=16, dtype=torch.float16)
    cu_q, cu_k = case.tensors()
    for name in BACKENDS:
        backend = dispatch.BACKENDS[name]
        assert backend.supports(case_inputs(case))[0].endswith("runs on CUDA tensors only, got cpu")
        with pytest.raises(ValueError, match=f"backend='{name}' cannot run these inputs: "):
            packattn.varlen_attention(case.q, case.k, case.v, cu_q, cu_k, backend=name)
    if torch.version.cuda is None:
        rows = {r.name: r for r in packattn.info()}
        no_cuda = f"torch {torch.__version__} is built without CUDA"
        assert rows["flash_attn"].reason == f"{no_cuda}; flash_attn is not installed"
        assert rows["torch_varlen"].reason == f"torch {torch.__version__} is built without CUDA"


def test_a_cuda_build_without_a_device_says_so_and_imports_nothing():
    """PyPI's default Linux wheel is a CUDA build, on many machines without a GPU: there both kernels are
    unavailable for that reason, found without importing torch.nn.attention.varlen (which loads torch's
    compiler stack and Triton). Run in a fresh interpreter, with a CUDA build and no device simulated."""
    code = (
        "import sys, torch; torch.version.cuda = '13.0'; torch.cuda.is_available = lambda: False; "
        "import packattn; rows = {r.name: r for r in packattn.info()}; "
        "print(rows['torch_varlen'].reason); print(rows['flash_attn'].reason); "
        "print('torch.nn.attention.varlen' in sys.modules, 'triton' in sys.modules)"
    )
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False)
    assert res.returncode == 0, res.stderr
    no_device = f"torch {torch.__version__} finds no CUDA device (torch.cuda.is_available() is False)"
    assert res.stdout.splitlines() == [no_device, f"{no_device}; flash_attn is not installed", "False False"]


# flash-attn 2.7-2.8 register the op with ``torch.library.custom_op(..., mutates_args=("dq", "dk", "dv"))``.
BACKWARD_SCHEMA = (
    "flash_attn::_flash_attn_varlen_backward(Tensor dout, Tensor q, Tensor k, Tensor v, Tensor out, "
    "Tensor softmax_lse, Tensor(a6!)? dq, Tensor(a7!)? dk, Tensor(a8!)? dv, Tensor cu_seqlens_q, "
    "Tensor cu_seqlens_k, SymInt max_seqlen_q, SymInt max_seqlen_k, float dropout_p, float softmax_scale, "
    "bool causal, SymInt window_size_left, SymInt window_size_right, float softcap, Tensor? alibi_slopes, "
    "bool deterministic, Tensor? rng_state=None) -> Tensor"
)


class RegisteredOp:
    """An op as ``torch.ops.<namespace>`` hands it out: callable, with its schema on ``.default``."""

    def __init__(self, schema: str):
        self.default = types.SimpleNamespace(_schema=torch._C.parse_schema(schema))

    def __call__(self, *args):
        return fake_flash_attn_varlen_backward(*args)


def test_flash_attns_backward_op_is_found_in_its_namespace_and_checked(models, monkeypatch):
    op = RegisteredOp(BACKWARD_SCHEMA)
    monkeypatch.setattr(torch.ops, "flash_attn", types.SimpleNamespace(_flash_attn_varlen_backward=op))
    assert FIND_FLASH_ATTN_BACKWARD() is op
    monkeypatch.setattr(flash_attn, "_varlen_backward", FIND_FLASH_ATTN_BACKWARD)
    case = make_case(*LENS, hq=4, hkv=2, d=16, dtype=torch.float16, seed=12, requires_grad=True)
    out, _ = attention("flash_attn", case, causal=True)
    got = torch.autograd.grad(out.double().sum(), (case.q, case.k, case.v))
    assert len(BACKWARD_CALLS) == 1
    xs = [t.detach().double().requires_grad_() for t in (case.q, case.k, case.v)]
    want = torch.autograd.grad(oracle(*xs, case.cu_q, case.cu_k, causal=True)[0].sum(), xs)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g.double(), w, atol=0.02, rtol=0.02)
    # Another signature (a window_size pair, as flash-attn 2.6's Python function has) is not called.
    other = RegisteredOp(
        BACKWARD_SCHEMA.replace("SymInt window_size_left, SymInt window_size_right", "int[] window_size")
    )
    monkeypatch.setattr(torch.ops, "flash_attn", types.SimpleNamespace(_flash_attn_varlen_backward=other))
    assert FIND_FLASH_ATTN_BACKWARD() is None
    monkeypatch.setattr(torch.ops, "flash_attn", types.SimpleNamespace())
    assert FIND_FLASH_ATTN_BACKWARD() is None


# Windows the kernels read otherwise (a bound >= max_seqlen_k dropped, a left-only window bounded by
# max_seqlen_k on the right) where a sequence has more than max_seqlen_k + 1 queries: declined.
MISREAD_WINDOWS = [((-1, 3), "right=3 as unbounded"), ((1, -1), "right=-1 as 2"), ((0, 5), "right=5 as 2")]


@pytest.mark.parametrize("name", BACKENDS)
@pytest.mark.parametrize(("window", "reading"), MISREAD_WINDOWS)
def test_windows_the_kernels_would_misread_are_declined(models, name, window, reading):
    case = make_case([8, 2], [2, 1], hq=2, hkv=2, d=16, dtype=torch.float16, seed=13)
    inp = case_inputs(case, window_size=window)
    model_out, _ = _model(*case_inputs_for_kernel(inp), scale=inp.mask.scale, window=window)
    want, _ = oracle(case.q, case.k, case.v, case.cu_q, case.cu_k, window_size=window)
    assert not torch.allclose(model_out.double(), want, atol=1e-2), "the kernels' reading would be wrong here"
    with pytest.raises(ValueError, match=f"reads window_size {re.escape(reading)} here \\(max_seqlen_k=2\\)"):
        attention(name, case, window_size=window)
    # With at most max_seqlen_k + 1 queries per sequence the same windows are read exactly, and run.
    exact = make_case([3, 2], [2, 1], hq=2, hkv=2, d=16, dtype=torch.float16, seed=14)
    out, lse = attention(name, exact, window_size=window)
    assert_matches_oracle(exact, out, lse, window_size=window)


def case_inputs_for_kernel(inp):
    cu_q, cu_k = (c.to(torch.int32).contiguous() for c in (inp.layout.cu_q, inp.layout.cu_k))
    return (*fa2_convention._kernel_layout(inp.q, inp.k, inp.v), cu_q, cu_k, inp.layout.max_q, inp.layout.max_k)


@pytest.mark.parametrize("name", BACKENDS)
def test_head_dims_are_padded_and_rows_aligned_for_the_kernels(models, name):
    """D = 12 reaches the kernels padded to 16; views whose rows are not 16-byte aligned are copied."""
    check_backward(name, make_case(*LENS, hq=4, hkv=2, d=12, dtype=torch.float16, seed=15, requires_grad=True))
    case = make_case(*LENS, hq=4, hkv=2, d=16, dtype=torch.bfloat16, seed=16)
    views = [torch.cat([t, t[..., :4]], dim=-1)[..., 2:18] for t in (case.q, case.k, case.v)]  # rows 4 bytes off
    for t, view in zip((case.q, case.k, case.v), views, strict=True):
        view.copy_(t)
    assert not _loadable(*views)
    cu_q, cu_k = case.tensors()
    out, lse = packattn.varlen_attention(*views, cu_q, cu_k, backend=name, return_lse=True, causal=True)
    assert_matches_oracle(case, out, lse, causal=True)


def test_more_sequences_or_heads_than_a_grid_holds_are_declined(models):
    many = make_case([1] * 65536, [1] * 65536, hq=1, hkv=1, d=8, dtype=torch.float16)
    for backend in (flash_attn.BACKEND, torch_varlen.BACKEND):
        assert any(
            "at most 65535 of each, got 65536 sequences" in r for r in backend.special_reasons(case_inputs(many))
        )
        few = make_case([1] * 65535, [1] * 65535, hq=1, hkv=1, d=8, dtype=torch.float16)
        assert not backend.special_reasons(case_inputs(few))


@pytest.mark.parametrize("name", BACKENDS)
def test_a_nan_row_gets_a_nan_lse_not_the_minus_inf_of_a_row_without_keys(models, name):
    """Both kernels write LSE +inf for a NaN softmax sum as for a row without keys; merges would drop the
    former as empty. A NaN in a query row makes its LSE NaN, as on every other backend."""
    case = make_case(*LENS, hq=4, hkv=2, d=16, dtype=torch.float16, seed=17)
    case.q.data[2, 1, 3] = float("nan")
    out, lse = attention(name, case, causal=True)
    assert torch.isnan(lse[1, 2]) and torch.isnan(out[2, 1]).all()
    assert torch.isneginf(lse[:, 12:16]).all()  # the sequence without keys
    others = torch.ones_like(lse, dtype=torch.bool)
    others[1, 2] = False
    assert not torch.isnan(lse[others]).any() and not (lse == float("inf")).any()
