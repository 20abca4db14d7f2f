"""Backend registry, dispatch and its "why not" errors, ``packattn.info()`` and ``python -m packattn info``."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

import packattn
from packattn import cli, dispatch
from packattn.backends import ALL
from packattn.backends.base import Backend
from packattn.inputs import AttentionInputs
from packattn.testing import assert_close_to_oracle, attention_naive, oracle

from .helpers import Case, backend_reasons, case_inputs, make_case


def fake_backend(backend_name: str, *, missing: str | None = None, refuse: list[str] | None = None) -> Backend:
    """A backend that is not installed (``missing``) or refuses every input (``refuse``); it never runs."""

    class Fake(Backend):
        name = backend_name

        def unavailable_reason(self) -> str | None:
            return missing

        def special_reasons(self, inp: AttentionInputs) -> list[str]:
            return list(refuse or [])

        def forward(self, inp: AttentionInputs) -> tuple[torch.Tensor, torch.Tensor | None]:
            raise AssertionError(f"{backend_name} ran")

    return Fake()


NOT_INSTALLED = fake_backend("fake_npu", missing="torch_npu is not installed")
REFUSES = fake_backend("fake_gpu", refuse=["the inputs are on cpu, not on a GPU", "head_dim=16 is too small"])


@pytest.fixture
def fakes_first(monkeypatch: pytest.MonkeyPatch) -> tuple[object, ...]:
    """Registry with two backends that cannot run ahead of the real ones."""
    backends = (NOT_INSTALLED, REFUSES, *ALL)
    monkeypatch.setattr(dispatch, "ALL", backends)
    monkeypatch.setattr(dispatch, "BACKENDS", {b.name: b for b in backends})
    monkeypatch.setitem(dispatch.PRIORITY, "cpu", ("fake_npu", "fake_gpu", *dispatch.PRIORITY["cpu"]))
    return backends


@pytest.fixture
def ran(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Names of the real backends that dispatch ran, in order (not counting one backend calling another)."""
    calls: list[str] = []
    depth = [0]
    for backend in ALL:

        def spy(inp, _backend=backend, _forward=backend.forward):
            if depth[0] == 0:
                calls.append(_backend.name)
            depth[0] += 1
            try:
                return _forward(inp)
            finally:
                depth[0] -= 1

        monkeypatch.setattr(backend, "forward", spy)
    return calls


CASE = make_case([5, 0, 7], [9, 8, 8], hq=4, hkv=2, d=16, dv=8)


def run(case: Case = CASE, **kwargs: object) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    return packattn.varlen_attention(case.q, case.k, case.v, *case.tensors(), **kwargs)


# info ---------------------------------------------------------------------------------------------------


def test_info_lists_every_backend_in_priority_order():
    rows = packattn.info()
    assert [r.name for r in rows] == [b.name for b in ALL]
    assert sorted(r.name for r in rows) == sorted(dispatch.BACKENDS)
    for row, backend in zip(rows, ALL, strict=True):
        assert isinstance(row, packattn.BackendInfo)
        assert row.available is (backend.unavailable_reason() is None)
        assert row.reason == backend.unavailable_reason()
    by_name = {r.name: r for r in rows}
    assert by_name["reference"].available and by_name["sdpa"].available


def test_info_explains_unavailable_backends(fakes_first):
    rows = {r.name: r for r in packattn.info()}
    assert rows["fake_npu"] == packattn.BackendInfo("fake_npu", False, "torch_npu is not installed")
    assert rows["fake_gpu"].available and rows["fake_gpu"].reason is None
    assert list(rows) == [b.name for b in fakes_first]


def _assert_info_output(out: str, names: list[str]) -> list[tuple[str, str]]:
    """Check ``packattn info``'s table against ``packattn.info()``: one row per backend with its state,
    followed by an indented line of its details when it has any."""
    lines = out.splitlines()
    assert lines[0].startswith(f"packattn on torch {torch.__version__}")
    rows = {r.name: r for r in packattn.info()}
    states: list[tuple[str, str]] = []
    body = iter(lines[1:])
    for line in body:
        assert line.startswith("  ") and not line.startswith("   "), line
        name, state = line.split(maxsplit=1)
        row = rows[name]
        assert state == ("available" if row.available else f"unavailable: {row.reason}")
        if row.details:
            assert next(body).strip() == row.details
        states.append((name, state))
    assert [name for name, _ in states] == names
    return states


def test_cli_info_prints_every_backend(fakes_first, capsys):
    assert cli.main(["info"]) == 0
    states = _assert_info_output(capsys.readouterr().out, [b.name for b in fakes_first])
    assert states[0][1] == "unavailable: torch_npu is not installed"


def test_python_m_packattn_info():
    res = subprocess.run(
        [sys.executable, "-m", "packattn", "info"], capture_output=True, text=True, timeout=120, check=False
    )
    assert res.returncode == 0, res.stderr
    _assert_info_output(res.stdout, [b.name for b in ALL])


# default dispatch --------------------------------------------------------------------------------------


@pytest.mark.parametrize("return_lse", [False, True], ids=["out", "out_and_lse"])
@pytest.mark.parametrize(
    "mask",
    [{}, {"causal": True}, {"softcap": 4.0}, {"window_size": (3, 1)}],
    ids=["full", "causal", "softcap", "window"],
)
def test_default_dispatch_picks_first_backend_that_can_run(mask, return_lse, ran):
    chosen = dispatch.select(case_inputs(CASE, return_lse, **mask), None, "test")
    assert chosen.unavailable_reason() is None
    assert backend_reasons(chosen.name, CASE, return_lse, **mask) == []
    tried = dispatch.candidates(CASE.q.device)
    for earlier in tried[: tried.index(chosen)]:
        assert dispatch.passed_over(earlier, case_inputs(CASE, return_lse, **mask))
    res = run(return_lse=return_lse, **mask)
    assert ran == [chosen.name]
    out = res[0] if return_lse else res
    ref_out, _ = oracle(CASE.q, CASE.k, CASE.v, CASE.cu_q, CASE.cu_k, **mask)
    pt_out, _ = attention_naive(CASE.q, CASE.k, CASE.v, CASE.cu_q, CASE.cu_k, **mask)
    assert_close_to_oracle(out, ref_out, pt_out)


def test_default_dispatch_skips_backends_that_cannot_run(fakes_first, ran):
    tried = dispatch.candidates(CASE.q.device)
    assert tried[:2] == [NOT_INSTALLED, REFUSES]
    plain = dispatch.select(case_inputs(CASE), None, "test")
    assert plain is next(b for b in tried if not dispatch.passed_over(b, case_inputs(CASE)))
    with_lse = dispatch.select(case_inputs(CASE, True), None, "test")
    assert with_lse is next(b for b in tried if not dispatch.passed_over(b, case_inputs(CASE, True)))
    run()
    assert ran == [plain.name]


def test_no_backend_can_run_lists_every_backend_tried_and_why(fakes_first, monkeypatch):
    for backend in ALL:
        monkeypatch.setattr(backend, "supports", lambda inp, _n=backend.name: [f"{_n} refuses for this test"])
    tried = dispatch.candidates(CASE.q.device)
    with pytest.raises(ValueError) as info:
        run(causal=True)
    lines = str(info.value).splitlines()
    assert lines[0] == "varlen_attention: no backend can run these inputs on cpu:"
    expected = [
        "  fake_npu: torch_npu is not installed",
        "  fake_gpu: the inputs are on cpu, not on a GPU; head_dim=16 is too small",
        *[f"  {b.name}: {b.unavailable_reason() or f'{b.name} refuses for this test'}" for b in tried[2:]],
    ]
    others = [b.name for b in fakes_first if b not in tried]
    assert lines[1:] == expected + ([f"(not tried on cpu, only by name: {', '.join(others)})"] if others else [])


def test_priority_names_registered_backends_once_per_device():
    for device, names in (*dispatch.PRIORITY.items(), ("other", dispatch.OTHER_DEVICES)):
        assert len(set(names)) == len(names), device
        assert set(names) <= set(dispatch.BACKENDS), device
        assert names[-1] == "reference", f"{device}: the exact reference path must be the last resort"
    assert [b.name for b in dispatch.candidates(torch.device("cpu"))] == list(dispatch.PRIORITY["cpu"])
    assert [b.name for b in dispatch.candidates(torch.device("meta"))] == list(dispatch.OTHER_DEVICES)


# explicit backend ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(dispatch.BACKENDS))
def test_explicit_backend_is_never_replaced(name, ran):
    why = backend_reasons(name, CASE, False, causal=True)
    if why:
        with pytest.raises(ValueError, match=f"backend={name!r} cannot run these inputs"):
            run(backend=name, causal=True)
        assert ran == []
    else:
        res = run(backend=name, causal=True)
        assert ran == [name]
        assert res.shape == (CASE.q.shape[0], 4, 8)


def test_explicit_backend_that_cannot_run_raises_with_its_reasons(ran):
    with pytest.raises(ValueError) as info:
        run(backend="sdpa", softcap=5.0, return_lse=True)
    message = str(info.value)
    why = backend_reasons("sdpa", CASE, True, softcap=5.0)
    assert len(why) == 2
    assert message == "varlen_attention: backend='sdpa' cannot run these inputs: " + "; ".join(why)
    assert ran == []


def test_explicit_unavailable_backend_raises_instead_of_falling_back(monkeypatch, ran):
    monkeypatch.setattr(dispatch.BACKENDS["sdpa"], "unavailable_reason", lambda: "sdpa is disabled for this test")
    with pytest.raises(ValueError, match=r"backend='sdpa' cannot run these inputs: sdpa is disabled for this test$"):
        run(backend="sdpa")
    assert ran == []


def test_explicit_fake_backend_raises_with_its_reasons(fakes_first):
    with pytest.raises(ValueError) as info:
        run(backend="fake_gpu")
    assert str(info.value) == (
        "varlen_attention: backend='fake_gpu' cannot run these inputs: "
        "the inputs are on cpu, not on a GPU; head_dim=16 is too small"
    )
    with pytest.raises(ValueError, match=r"backend='fake_npu' cannot run these inputs: torch_npu is not installed$"):
        run(backend="fake_npu")


def test_explicit_backend_is_kept_for_gradients(ran):
    leaves = [t.detach().clone().requires_grad_() for t in (CASE.q, CASE.k, CASE.v)]
    grad_case = Case(*leaves, CASE.cu_q, CASE.cu_k)
    out = run(grad_case, backend="reference", causal=True)
    out.sum().backward()
    assert ran == ["reference"]
    assert all(t.grad is not None and torch.isfinite(t.grad).all() for t in leaves)
