"""The backend seam: declared capabilities become the standard refusals, gradient routes are resolved by
dispatch, and a new backend needs only capabilities, a forward and a route."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch

import packattn
from packattn import dispatch
from packattn.backends import reference
from packattn.backends.base import (
    AUTOGRAD,
    OWN_WITHOUT_LSE_GRAD,
    Backend,
    Capabilities,
    Grads,
    backward_of,
    standard_reasons,
)
from packattn.inputs import AttentionInputs

from .helpers import case_inputs, check_backward, check_forward, make_case


class Plain(Backend):
    """A new backend as a contributor writes one: capabilities, a forward and a declared gradient route."""

    name = "plain"
    capabilities = Capabilities(devices=("cpu",), dtypes=(torch.float32,), head_dim_v="equal", softcap=False)
    gradients = (backward_of("reference"),)

    def forward(self, inp: AttentionInputs) -> tuple[torch.Tensor, torch.Tensor]:
        self.calls = getattr(self, "calls", 0) + 1
        return reference.forward(inp)


@pytest.fixture
def plain(monkeypatch: pytest.MonkeyPatch) -> Plain:
    """``Plain`` registered and first in CPU dispatch."""
    backend = Plain()
    monkeypatch.setitem(dispatch.BACKENDS, backend.name, backend)
    monkeypatch.setitem(dispatch.PRIORITY, "cpu", (backend.name, *dispatch.PRIORITY["cpu"]))
    return backend


def test_a_new_backend_is_dispatched_refused_and_given_gradients(plain):
    case = make_case([5, 0, 3], [4, 6, 0], hq=4, hkv=2, d=16)
    assert dispatch.select(case_inputs(case, True, causal=True), None, "t") is plain
    check_forward("plain", case, causal=True)
    assert plain.calls == 1

    # Refused with the standard sentences, so automatic dispatch moves on.
    odd = make_case([3], [4], hq=2, hkv=2, d=16, dv=8, dtype=torch.float64)
    why = dispatch.reasons(plain, case_inputs(odd, softcap=2.0))
    assert why == [
        "plain takes float32 only, got torch.float64",
        "plain needs v's head_dim equal to q's, got D=16 and Dv=8",
        "plain has no soft-capping (softcap=2.0)",
    ]
    assert dispatch.select(case_inputs(odd, softcap=2.0), None, "t") is not plain
    with pytest.raises(ValueError, match="backend='plain' cannot run these inputs: plain takes float32 only"):
        packattn.varlen_attention(odd.q, odd.k, odd.v, *odd.tensors(), backend="plain")

    # Gradients (the LSE's included) through the declared route: the reference backward.
    check_backward("plain", make_case([5, 0, 3], [4, 6, 0], hq=4, hkv=2, d=16, requires_grad=True), causal=True)


def test_standard_reasons_cover_every_capability():
    case = make_case([3, 9], [4, 2], hq=8, hkv=2, d=32, dv=40)
    inp = case_inputs(case, True, window_size=(2, 1), softcap=1.5)
    caps = Capabilities(
        devices=("cuda", "npu"),
        dtypes=(torch.float16, torch.bfloat16),
        max_head_dim=32,
        head_dim_v="at_most",
        softcap=False,
        windows=False,
        lse=False,
        max_heads_q=4,
        max_seqlen=8,
        max_tokens=10,
    )
    assert standard_reasons("k", caps, inp) == [
        "k runs on CUDA or npu tensors only, got cpu",
        "k takes float16 or bfloat16 only, got torch.float32",
        "k needs v's head_dim at most q's, got D=32 and Dv=40",
        "k takes head dims up to 32, got D=32 and Dv=40",
        "k takes at most 4 query heads, got 8",
        "k takes sequences of at most 8 tokens, got one of 9",
        "k takes at most 10 tokens per call, got 12",
        "k has no soft-capping (softcap=1.5)",
        "k has no sliding window (window_size=(2, 1)); only causal or none",
        "k returns no LSE (return_lse=True)",
    ]
    assert standard_reasons("k", Capabilities(), inp) == []
    causal = case_inputs(case, False, causal=True)
    assert standard_reasons("k", Capabilities(windows=False), causal) == []


class FusedGrad(Backend):
    """Like the npu backend: its own backward takes no LSE gradient, the reference backward does; its own
    backward is not deterministic."""

    name = "fused_grad"
    capabilities = Capabilities(devices=("cpu",), deterministic=False)
    gradients = (OWN_WITHOUT_LSE_GRAD, backward_of("reference"))

    def forward(self, inp: AttentionInputs) -> tuple[torch.Tensor, torch.Tensor]:
        return reference.forward(inp)

    def backward(
        self, inp: AttentionInputs, out: torch.Tensor, lse: torch.Tensor, dout: torch.Tensor, dlse: torch.Tensor | None
    ) -> Grads:
        self.own = getattr(self, "own", 0) + 1
        return reference.backward(inp, out, lse, dout, dlse)


@pytest.fixture
def fused(monkeypatch: pytest.MonkeyPatch) -> FusedGrad:
    backend = FusedGrad()
    monkeypatch.setitem(dispatch.BACKENDS, backend.name, backend)
    return backend


def _grads(case, **options):
    out = packattn.varlen_attention(case.q, case.k, case.v, *case.tensors(), backend="fused_grad", **options)
    loss = out[0].sum() + out[1].nan_to_num(0.0, 0.0, 0.0).sum() if isinstance(out, tuple) else out.sum()
    return torch.autograd.grad(loss, (case.q, case.k, case.v))


def test_routes_are_taken_in_order_by_what_the_call_needs(fused):
    case = make_case([4, 2], [3, 5], requires_grad=True)
    inp = case_inputs(case, False)
    assert dispatch.backward(fused, inp, lse_grad=False, where="t") == fused.backward
    assert dispatch.backward(fused, inp, lse_grad=True, where="t") == reference.BACKEND.backward
    _grads(case)  # no LSE returned: its own backward
    assert fused.own == 1
    _grads(case, return_lse=True)  # the LSE has a gradient: the reference backward
    assert fused.own == 1


def test_deterministic_asks_for_the_capability(fused, monkeypatch):
    case = make_case([4, 2], [3, 5], requires_grad=True)
    inp = case_inputs(case, False)
    det = AttentionInputs(inp.q, inp.k, inp.v, inp.layout, inp.mask, False, True, True)
    # Its own backward is not deterministic; the reference route is, so that one serves.
    assert dispatch.backward(fused, det, lse_grad=False, where="t") == reference.BACKEND.backward
    monkeypatch.setattr(fused, "gradients", (OWN_WITHOUT_LSE_GRAD,))
    assert dispatch.reasons(fused, det) == [
        "no gradient route serves these inputs: fused_grad's own backward is not deterministic (deterministic=True)"
    ]
    assert dispatch.reasons(fused, inp) == []  # no gradients asked for: any route, or none
    with pytest.raises(ValueError, match="fused_grad's own backward takes no gradient of the LSE"):
        dispatch.select(AttentionInputs(inp.q, inp.k, inp.v, inp.layout, inp.mask, True, True), "fused_grad", "t")


def test_a_route_through_a_backend_that_cannot_run_says_why(fused, monkeypatch):
    monkeypatch.setattr(fused, "gradients", (backward_of("cpu_kernel"),))
    case = make_case([4, 2], [3, 5], dtype=torch.float64)
    inp = case_inputs(case, False)
    grad = AttentionInputs(inp.q, inp.k, inp.v, inp.layout, inp.mask, False, True)
    why = dispatch.reasons(fused, grad)
    assert len(why) == 1 and why[0].startswith("no gradient route serves these inputs: the cpu_kernel backward ")
    assert "cannot run them: " in why[0]


def test_autograd_routes_are_for_backends_without_lse():
    with pytest.raises(TypeError, match=r"gradients by autograd need capabilities\.lse=False"):

        class WithLse(Backend):
            name = "with_lse"
            gradients = (AUTOGRAD,)

    assert dispatch.uses_autograd(dispatch.BACKENDS["sdpa"], case_inputs(make_case([2], [3])))


def test_no_backend_imports_dispatch_and_the_core_has_no_import_circle():
    """Backends are registered by dispatch, never the reverse; ``api -> ops -> dispatch -> backends``."""
    root = Path(packattn.__file__).parent
    core = {"api", "ops", "dispatch", "backends"}

    def imports(path: Path) -> set[str]:
        found = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level > 0:
                parts = path.relative_to(root).parts[: -node.level]  # the package the import is relative to
                found.add(".".join([*parts, *(node.module or "").split(".")]).strip(".").split(".")[0])
                found |= {alias.name for alias in node.names if not parts and not node.module}
        return found

    for path in (root / "backends").rglob("*.py"):
        assert "dispatch" not in imports(path), path
    graph = {name: imports(root / f"{name}.py") & core for name in ("api", "ops", "dispatch")}
    graph["backends"] = set().union(*(imports(p) for p in (root / "backends").rglob("*.py"))) & core - {"backends"}
    assert graph == {"api": {"dispatch", "ops"}, "ops": {"dispatch"}, "dispatch": {"backends"}, "backends": set()}
