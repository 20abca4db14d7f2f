"""``packattn.ops``, the custom ops, under ``torch.compile``: no graph break (``fullgraph=True``), results and
gradients equal eager, no recompiles for new offsets, value checks at run time, and ``torch.library.opcheck``
on the ops."""

from __future__ import annotations

import time

import pytest
import torch
from torch._dynamo.testing import CompileCounterWithBackend

import packattn
from packattn import ops

from .helpers import DEVICE_BACKENDS, Case, interpreted, make_case, offsets


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    yield
    torch._dynamo.reset()


def compiled(fn, backend: object = "aot_eager", **kwargs):
    """``fn`` compiled with ``fullgraph=True`` (no graph break allowed), on aot_eager unless told."""
    return torch.compile(fn, backend=backend, fullgraph=True, **kwargs)


def attn(q, k, v, cu_q, cu_k, **kwargs):
    return packattn.varlen_attention(q, k, v, cu_q, cu_k, **kwargs)


def leaves(case: Case) -> list[torch.Tensor]:
    return [t.detach().clone().requires_grad_() for t in (case.q, case.k, case.v)]


def assert_same_grads(fn, compiled_fn, case: Case, *args: object) -> None:
    """Forward results and gradients of ``compiled_fn`` equal those of ``fn`` on fresh leaves of ``case``."""
    eager_in, comp_in = leaves(case), leaves(case)
    want, got = fn(*eager_in, *args), compiled_fn(*comp_in, *args)
    want, got = (want, got) if isinstance(want, tuple) else ((want,), (got,))
    for w, g in zip(want, got, strict=True):
        torch.testing.assert_close(g, w, rtol=0, atol=0)
    seed = torch.Generator().manual_seed(3)
    cotangents = [torch.randn(w.shape, generator=seed, dtype=w.dtype) for w in want]
    dw = torch.autograd.grad(want, eager_in, cotangents)
    dg = torch.autograd.grad(got, comp_in, cotangents)
    for w, g in zip(dw, dg, strict=True):
        torch.testing.assert_close(g, w, rtol=0, atol=0)


def no_graph_breaks() -> bool:
    return not torch._dynamo.utils.counters["graph_break"]


def graphs() -> int:
    """Graphs dynamo has compiled since the test began (a recompile adds one)."""
    return torch._dynamo.utils.counters["stats"]["unique_graphs"]


CASE = make_case([5, 0, 7], [9, 8, 8], hq=4, hkv=2, d=16, dv=8)


def tensors(case: Case) -> tuple[torch.Tensor, torch.Tensor]:
    return case.tensors()


@pytest.mark.parametrize(
    "options",
    [{}, {"causal": True}, {"window_size": (3, 1), "softcap": 5.0}, {"return_lse": True, "causal": True}],
    ids=["full", "causal", "window-softcap", "lse"],
)
def test_function_compiles_without_graph_break_and_matches_eager(options):
    def fn(q, k, v, cu_q, cu_k):
        return attn(q, k, v, cu_q, cu_k, **options)

    counter = CompileCounterWithBackend("aot_eager")
    cfn = compiled(fn, counter)
    assert_same_grads(fn, cfn, CASE, *tensors(CASE))
    assert graphs() == 1 and no_graph_breaks()
    ops_in_graph = [n.target for g in counter.graphs for n in g.graph.nodes if n.op == "call_function"]
    assert torch.ops.packattn.varlen_attention_fwd.default in ops_in_graph


class Block(torch.nn.Module):
    """Attention block over a packed batch: q/k/v projections, GQA attention, output projection."""

    def __init__(self, dim: int = 32, heads: int = 4, kv_heads: int = 2, head_dim: int = 8):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, head_dim
        self.q = torch.nn.Linear(dim, heads * head_dim)
        self.kv = torch.nn.Linear(dim, 2 * kv_heads * head_dim)
        self.o = torch.nn.Linear(heads * head_dim, dim)

    def forward(self, x: torch.Tensor, cu: torch.Tensor) -> torch.Tensor:
        t = x.shape[0]
        q = self.q(x).view(t, self.heads, self.head_dim)
        k, v = self.kv(x).view(t, 2, self.kv_heads, self.head_dim).unbind(1)
        return x + self.o(packattn.varlen_attention(q, k, v, cu, cu, causal=True).reshape(t, -1))


def test_module_compiles_without_graph_break_and_matches_eager():
    torch.manual_seed(0)
    block = Block()
    x = torch.randn(20, 32, requires_grad=True)
    cu = torch.tensor(offsets([6, 1, 0, 13]), dtype=torch.int32)
    want = block(x, cu)
    grads = torch.autograd.grad(want.square().sum(), [x, *block.parameters()])
    cblock = compiled(block)
    got = cblock(x, cu)
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    for g, w in zip(torch.autograd.grad(got.square().sum(), [x, *block.parameters()]), grads, strict=True):
        torch.testing.assert_close(g, w, rtol=0, atol=0)
    assert graphs() == 1 and no_graph_breaks()


def test_new_offsets_of_the_same_batch_size_do_not_recompile():
    cfn = compiled(attn)
    for lens_q, lens_k in (([5, 0, 7], [9, 8, 8]), ([0, 12, 0], [3, 0, 22]), ([4, 4, 4], [25, 0, 0])):
        case = make_case(lens_q, lens_k, hq=4, hkv=2, d=16, seed=len(lens_q))
        assert_same_grads(attn, cfn, case, *tensors(case))
    assert graphs() == 1 and no_graph_breaks()


def test_dynamic_new_batch_size_and_totals_do_not_recompile():
    # Sizes chosen so no two dims coincide (duck sizing would tie them together and recompile when they part).
    cfn = compiled(attn, dynamic=True)
    for lens_q, lens_k in (([5, 0, 7], [9, 8, 8]), ([3, 2, 6, 0, 9], [4, 4, 0, 7, 2]), ([30, 7], [2, 40])):
        case = make_case(lens_q, lens_k, hq=8, hkv=2, d=16)
        assert_same_grads(attn, cfn, case, *tensors(case))
    assert graphs() == 1 and no_graph_breaks()


def with_host_lists(q, k, v, cu_q, cu_k, host_q, host_k):
    return attn(q, k, v, cu_q, cu_k, cu_seqlens_q_host=host_q, cu_seqlens_k_host=host_k, causal=True)


def test_host_copies_as_lists():
    """Host lists trace as SymInts with ``dynamic=True``: new offsets do not recompile. A list's length is
    static to the compiler, so a new batch size compiles once more."""
    cfn = compiled(with_host_lists, dynamic=True)
    for lens_q, lens_k in (([5, 0, 7], [9, 8, 8]), ([2, 9, 3], [3, 0, 22]), ([7, 3, 0], [12, 2, 11])):
        case = make_case(lens_q, lens_k, hq=4, hkv=2, d=16)
        assert_same_grads(with_host_lists, cfn, case, *tensors(case), case.cu_q, case.cu_k)
    assert graphs() == 1 and no_graph_breaks()
    for lens_q, lens_k in (([3, 2, 6, 0, 9], [4, 4, 0, 7, 2]), ([2, 2, 8, 2, 6], [9, 0, 3, 3, 2])):
        case = make_case(lens_q, lens_k, hq=4, hkv=2, d=16)
        assert_same_grads(with_host_lists, cfn, case, *tensors(case), case.cu_q, case.cu_k)
    assert graphs() == 2 and no_graph_breaks()


def test_offset_values_are_checked_when_the_op_runs():
    """Checks that need the offsets' values raise the eager messages from inside the compiled call."""
    cfn = compiled(with_host_lists, dynamic=True)
    cu_q, cu_k = tensors(CASE)
    cfn(CASE.q, CASE.k, CASE.v, cu_q, cu_k, CASE.cu_q, CASE.cu_k)
    bad_host = [0, 5, 5, 11]
    message = r"^varlen_attention: cu_seqlens_q_host must end at q.shape\[0\] \(12\), got 11$"
    with pytest.raises(ValueError, match=message):
        cfn(CASE.q, CASE.k, CASE.v, cu_q, cu_k, bad_host, CASE.cu_k)
    ctensor = compiled(attn)
    bad = torch.tensor([0, 6, 5, 12])
    with pytest.raises(ValueError, match=r"cu_seqlens_q must be non-decreasing, got 6 then 5 at positions 1 and 2$"):
        ctensor(CASE.q, CASE.k, CASE.v, bad, cu_k)
    with pytest.raises(ValueError, match=r"^varlen_attention: backend='sdpa' cannot run these inputs: .*softcap"):
        compiled(lambda *a: attn(*a, backend="sdpa", softcap=2.0))(CASE.q, CASE.k, CASE.v, cu_q, cu_k)


def test_shape_and_option_checks_run_at_trace_time():
    """Eager messages; under ``fullgraph=True`` the compiler reports the same exception from tracing."""
    cu_q, cu_k = tensors(CASE)
    cases = [
        ((CASE.q[..., :8], CASE.k, CASE.v, cu_q, cu_k), {}, ValueError, "q and k must have the same head_dim"),
        ((CASE.q, CASE.k, CASE.v, cu_q.float(), cu_k), {}, TypeError, "cu_seqlens_q must have dtype int32 or int64"),
        ((CASE.q, CASE.k, CASE.v, torch.tensor([0, 12]), cu_k), {}, ValueError, "the same number of sequences"),
        ((CASE.q, CASE.k, CASE.v, cu_q, cu_k), {"window_size": (-2, 0)}, ValueError, "window_size entries"),
        ((CASE.q, CASE.k, CASE.v, cu_q, cu_k), {"cu_seqlens_q_host": [0, 12]}, ValueError, "must have the same length"),
    ]
    for args, options, error, message in cases:

        def fn(*a, _o=options):
            return attn(*a, **_o)

        with pytest.raises(error, match=message):
            fn(*args)
        with pytest.raises(error, match=message):
            torch.compile(fn, backend="aot_eager")(*args)
        with pytest.raises((error, torch._dynamo.exc.Unsupported), match=message):  # as is, or wrapped
            compiled(fn)(*args)


@pytest.mark.parametrize("backend", [b for b in DEVICE_BACKENDS if not interpreted(b)])
def test_explicit_backend_under_compile(backend):
    """``backend=`` is honoured in the op; sdpa's gradients come from its own autograd, as in eager."""

    def fn(q, k, v, cu_q, cu_k):
        return attn(q, k, v, cu_q, cu_k, causal=True, backend=backend)

    cfn = compiled(fn)
    assert_same_grads(fn, cfn, CASE, *tensors(CASE))
    assert graphs() == 1 and no_graph_breaks()


def op_args(case: Case, *, need_lse: bool, host: bool) -> tuple[object, ...]:
    """Arguments of the forward op: causal, default dispatch, the LSE returned (and gradients asked for) when
    ``need_lse``, not deterministic."""
    hosts = (case.cu_q, case.cu_k) if host else (None, None)
    scale = case.q.shape[2] ** -0.5
    return (case.q, case.k, case.v, *case.tensors(), *hosts, scale, -1, 0, 0.0, need_lse, need_lse, False, None)


@pytest.mark.parametrize("need_lse", [True, False], ids=["lse", "no-lse"])
@pytest.mark.parametrize("host", [True, False], ids=["host", "device-offsets"])
def test_opcheck_forward(need_lse, host):
    case = make_case([5, 0, 7], [9, 8, 8], hq=4, hkv=2, d=16, dv=8, requires_grad=need_lse)
    torch.library.opcheck(ops.varlen_attention_fwd, op_args(case, need_lse=need_lse, host=host))


def test_opcheck_backward():
    # Default dispatch (the cpu_kernel backend's backward). The autograd route's (sdpa's) backward runs torch.func.vjp
    # inside the op, whose tensor wrappers opcheck's dispatch modes cannot look into; its gradients are
    # compared with eager under compile in test_explicit_backend_under_compile.
    case = make_case([5, 0, 7], [9, 8, 8], hq=4, hkv=2, d=16, dv=8)
    args = op_args(case, need_lse=True, host=True)
    out, lse = ops.varlen_attention_fwd(*args)
    dout = torch.randn(out.shape, generator=torch.Generator().manual_seed(4))
    dlse = torch.randn(lse.shape, generator=torch.Generator().manual_seed(5))
    # The backward op takes the forward's options but ``grad`` (it is the gradient).
    options = (*args[3:12], args[13], None)
    torch.library.opcheck(ops.varlen_attention_bwd, (dout, dlse, *args[:3], out, lse, *options))


def test_inductor_compiles_a_small_function():
    """The default (inductor) backend, once, on a small function around the op."""

    def fn(q, k, v, cu_q, cu_k):
        return attn(q * 2, k, v, cu_q, cu_k, causal=True).relu()

    cfn = torch.compile(fn, fullgraph=True)
    cu_q, cu_k = tensors(CASE)
    start = time.perf_counter()
    got = cfn(CASE.q, CASE.k, CASE.v, cu_q, cu_k)
    print(f"inductor first call: {time.perf_counter() - start:.1f} s")
    torch.testing.assert_close(got, fn(CASE.q, CASE.k, CASE.v, cu_q, cu_k))
    assert no_graph_breaks()


def test_sglang_drop_in_compiles_without_graph_break():
    from packattn.compat.sglang import fused_infer_attention_varlen

    def fn(q, k, v, cu_q, cu_k):
        return fused_infer_attention_varlen(q, k, v, cu_q, cu_k, return_softmax_lse=True)

    assert_same_grads(fn, compiled(fn), CASE, *tensors(CASE))
    assert graphs() == 1 and no_graph_breaks()


def test_double_backward_raises():
    q, k, v = leaves(CASE)
    out = attn(q, k, v, *tensors(CASE))
    (dq,) = torch.autograd.grad(out.square().sum(), q, create_graph=True)
    with pytest.raises(NotImplementedError, match="double backward"):
        dq.sum().backward()
