"""The npu backend's translation onto torch_npu's fused attention ops, against the float64 oracle.

Here the ops are the CPU interface model of ``tests/npu_model.py`` (installed as ``torch_npu`` by a fixture,
with the backend pointed at CPU tensors), which checks every call against the real op schemas and the
documented constraints. With ``PACKATTN_TEST_DEVICE=npu`` on an Ascend machine the same tests run on the
real torch_npu with npu tensors; the tests that read the model's call log then do not apply.
"""

from __future__ import annotations

import subprocess
import sys
from types import SimpleNamespace
from typing import Any

import pytest
import torch

import packattn
from packattn import dispatch
from packattn.backends import npu
from packattn.testing import assert_close_to_oracle, attention_naive

from . import npu_model
from .helpers import DEVICE, case_inputs, check_backward, check_forward, make_case, point_at

REAL = DEVICE.type == "npu"
model_only = pytest.mark.skipif(REAL, reason="reads the CPU interface model's call log")


@pytest.fixture(autouse=True)
def ops(monkeypatch: pytest.MonkeyPatch) -> npu_model.Model | None:
    """The interface model in place of torch_npu (None on a real Ascend device)."""
    if REAL:
        return None
    return _install(monkeypatch)


def _install(monkeypatch: pytest.MonkeyPatch, **stack: Any) -> npu_model.Model:
    """A fresh interface model as torch_npu (see ``npu_model.Model`` for ``stack``), probed, its log cleared."""
    model, module = npu_model.module(**stack)
    monkeypatch.setitem(sys.modules, "torch_npu", module)
    point_at(monkeypatch, npu.BACKEND, "cpu")
    npu.stack("cpu")
    model.calls.clear()
    return model


def calls(model: npu_model.Model, op: str) -> list[dict]:
    return [a for name, a in model.calls if name == op]


FA, FIA, GRAD = "npu_fusion_attention", "npu_fused_infer_attention_score", "npu_fusion_attention_grad"
PATTERNS = {
    "equal": ([7, 13, 5], [7, 13, 5]),
    "design_example": ([5, 0, 7], [9, 8, 8]),
    "empty_k_side": ([4, 6, 3], [5, 0, 3]),
    "empty_both": ([0, 5, 0], [0, 5, 0]),
    "no_keys_at_all": ([4, 2], [0, 0]),
    "no_queries_at_all": ([0, 0], [3, 5]),
    "lq_gt_lk": ([9, 17], [4, 3]),
    "length_one": ([1, 1, 2], [1, 3, 1]),
}
MASKS = {
    "full": {},
    "causal": {"causal": True},
    "window": {"window_size": (3, 2)},
    "left_only": {"window_size": (2, -1)},
    "right_band": {"window_size": (-1, 1)},
    "scale": {"softmax_scale": 0.3},
}


@pytest.mark.parametrize("mask", MASKS)
@pytest.mark.parametrize("pattern", PATTERNS)
def test_patterns_match_the_oracle(pattern, mask):
    lens_q, lens_k = PATTERNS[pattern]
    check_forward("npu", make_case(lens_q, lens_k, hq=4, hkv=2, d=32, dv=16), **MASKS[mask])


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("mask", ["full", "causal", "window"])
def test_dtypes(dtype, mask):
    case = make_case([37, 0, 64, 130], [50, 9, 64, 100], hq=4, hkv=1, d=64, dtype=dtype, seed=3)
    check_forward("npu", case, **MASKS[mask])


def test_seed_example_one_call_without_the_empty_sequence(ops):
    """cu_q = [0, 5, 5, 12], cu_k = [0, 9, 17, 25]: the middle sequence has keys but no queries."""
    case = make_case([5, 0, 7], [9, 8, 8], hq=4, hkv=2, d=64, dtype=torch.float16)
    check_forward("npu", case, causal=True)
    if ops is not None:
        (a,) = calls(ops, FA)
        assert a["actual_seq_qlen"] == [5, 12] and a["actual_seq_kvlen"] == [9, 17]
        assert a["query"].shape == (12, 4, 64) and a["key"].shape == (17, 2, 64)
        assert (a["sparse_mode"], a["head_num"], a["input_layout"]) == (3, 4, "TND")
        assert a["scale"] == 64**-0.5 and a["keep_prob"] == 1.0


@model_only
@pytest.mark.parametrize(
    ("mask", "sparse"),
    [
        ({}, (0, None, 2**31 - 1, 2**31 - 1)),
        ({"causal": True}, (3, (2048, 2048), 2**31 - 1, 2**31 - 1)),
        ({"window_size": (3, 2)}, (4, (2048, 2048), 3, 2)),
        ({"window_size": (-1, 1)}, (4, (2048, 2048), 2**31 - 1, 1)),
        ({"window_size": (5, 0)}, (4, (2048, 2048), 5, 0)),
    ],
    ids=["full", "causal", "window", "right_band", "left_causal"],
)
def test_masks_become_documented_sparse_modes(ops, mask, sparse):
    check_forward("npu", make_case([6, 3], [8, 3]), **mask)
    (a,) = calls(ops, FA)
    shape = None if a["atten_mask"] is None else tuple(a["atten_mask"].shape)
    assert (a["sparse_mode"], shape, a["pre_tockens"], a["next_tockens"]) == sparse


def test_rows_the_mask_hides_are_zero_and_minus_inf_and_left_out(ops):
    """Lq = 6 > Lk = 2 causal: the first 4 rows see no key; the second sequence has no keys at all."""
    case = make_case([6, 3, 2], [2, 0, 5])
    out, lse = packattn.varlen_attention(
        case.q, case.k, case.v, *case.tensors(), causal=True, return_lse=True, backend="npu"
    )
    hidden = torch.tensor([1] * 4 + [0] * 2 + [1] * 3 + [0] * 2, dtype=torch.bool)
    assert torch.all(out[hidden] == 0) and torch.all(lse[:, hidden] == float("-inf"))
    assert torch.isfinite(lse[:, ~hidden]).all()
    if ops is not None:
        (a,) = calls(ops, FA)
        assert a["actual_seq_qlen"] == [2, 4] and a["actual_seq_kvlen"] == [2, 7]


def test_gqa_and_mqa_pass_both_head_counts(ops):
    for hq, hkv in ((8, 2), (6, 1)):
        check_forward("npu", make_case([12, 1, 30], [12, 19, 30], hq=hq, hkv=hkv, d=32, dv=16), causal=True)
    if ops is not None:
        assert [(a["head_num"], a["key"].shape[1]) for a in calls(ops, FA)] == [(8, 2), (6, 1)]


FIA_CASE = {"hq": 8, "hkv": 8, "d": 192, "dv": 128, "dtype": torch.bfloat16}


@pytest.mark.parametrize("mask", ["full", "window", "right_band"])
def test_inference_within_fia_limits_runs_fia(ops, mask):
    case = make_case([5, 0, 7, 3], [9, 8, 8, 0], seed=2, **FIA_CASE)
    check_forward("npu", case, **MASKS[mask])
    if ops is not None:
        (a,) = calls(ops, FIA)
        assert a["actual_seq_lengths"] == [5, 12] and a["actual_seq_lengths_kv"] == [9, 17]
        assert (a["num_heads"], a["num_key_value_heads"], a["input_layout"]) == (8, 8, "TND")
        assert a["softmax_lse_flag"] and a["scale"] == 192**-0.5 and not calls(ops, FA)


@model_only
def test_fia_skips_the_lse_unless_asked(ops):
    case = make_case([5, 7], [9, 8], **FIA_CASE)
    packattn.varlen_attention(case.q, case.k, case.v, *case.tensors(), backend="npu")
    assert calls(ops, FIA)[0]["softmax_lse_flag"] is False


STACKS = {
    "cann_unknown": {"cann": ""},
    "cann_8_2": {"cann": "8.2.RC1"},
    "cann_8_3": {"cann": "8.3.RC1"},
    "split_fuse": {"cann": "8.5.0", "split_fuse": True},
}
# (case change, mask, lengths) -> which kernel runs on each stack above, in STACKS' order
FIA_CASES = {
    "d192_dv128": ({}, {}, "FA FIA FIA FIA"),
    "d192_dv192": ({"dv": 192}, {}, "FA FIA FIA FIA"),
    "d128": ({"d": 128, "dv": 128}, {}, "FA FA FIA FIA"),
    "d64_causal": ({"d": 64, "dv": 64}, {"causal": True}, "FA FA FIA FIA"),
    "d96": ({"d": 96, "dv": 96}, {}, "FA FA FA FIA"),
    "d256": ({"d": 256, "dv": 256}, {}, "FA FA FA FIA"),
    "gqa": ({"hkv": 2}, {}, "FA FA FIA FIA"),
    "gqa_dv192": ({"hkv": 2, "dv": 192}, {}, "FA FA FA FIA"),
    "heads4": ({"hq": 4, "hkv": 4}, {}, "FA FA FIA FIA"),
    "fp16": ({"dtype": torch.float16}, {}, "FA FA FA FIA"),
    "fp16_d256_mqa": ({"dtype": torch.float16, "d": 256, "dv": 256, "hkv": 1}, {}, "FA FA FA FIA"),
    "fp32": ({"dtype": torch.float32}, {}, "FA FA FA FA"),
    "causal_lq_lt_lk": ({}, {"causal": True}, "FA FIA FIA FIA"),
    "causal_lq_eq_lk": ({}, {"causal": True, "lens_k": [5, 8]}, "FA FA FIA FIA"),
    "window_dv128": ({}, {"window_size": (3, 1)}, "FA FA FIA FIA"),
    "window_dv192": ({"dv": 192}, {"window_size": (3, 1)}, "FA FA FA FA"),
}


@model_only
@pytest.mark.parametrize("stack", STACKS)
@pytest.mark.parametrize("case_name", FIA_CASES)
def test_inference_runs_fia_where_the_probed_stack_takes_it(monkeypatch, stack, case_name):
    """Each stack's model rejects any FIA call outside its limits, so a wrong gate fails here, not only a
    missed FIA; every case matches the oracle."""
    model = _install(monkeypatch, **STACKS[stack])
    change, mask, kernels = FIA_CASES[case_name]
    mask = dict(mask)
    lens_k = mask.pop("lens_k", [9, 8])
    check_forward("npu", make_case([5, 7], lens_k, seed=4, **{**FIA_CASE, **change}), **mask)
    expected = kernels.split()[list(STACKS).index(stack)]
    assert [len(calls(model, FIA)), len(calls(model, FA))] == ([1, 0] if expected == "FIA" else [0, 1])


@model_only
@pytest.mark.parametrize("stack", STACKS)
def test_the_stack_is_probed_once(monkeypatch, stack):
    model, module = npu_model.module(**STACKS[stack])
    monkeypatch.setitem(sys.modules, "torch_npu", module)
    point_at(monkeypatch, npu.BACKEND, "cpu")
    for seed in range(3):
        check_forward("npu", make_case([5, 7], [9, 8], seed=seed, **FIA_CASE))
    trials = [a for a in calls(model, FIA) if a["query"].shape == (3, 2, 256)]
    assert len(trials) == (1 if stack in ("cann_8_3", "split_fuse") else 0)  # only CANN 8.3+ may be split-fuse
    found = npu.stack("cpu")
    assert found.cann == STACKS[stack]["cann"]
    assert found.softmax_layout == (stack in ("cann_8_3", "split_fuse"))  # torch_npu 2.8 and CANN 8.3
    expected = {"cann_unknown": npu.FIA_NONE, "cann_8_2": npu.FIA_CANN_8_1, "cann_8_3": npu.FIA_CANN_8_3}
    assert found.fia is expected.get(stack, npu.FIA_SPLIT_FUSE)


@model_only
def test_a_wrong_split_fuse_answer_is_not_trusted(monkeypatch):
    """A trial call that runs but computes something else leaves CANN 8.3's limits in place."""
    _, module = npu_model.module(cann="8.5.0", split_fuse=True)
    real = module.npu_fused_infer_attention_score
    module.npu_fused_infer_attention_score = lambda *a, **kw: (real(*a, **kw)[0] * 1.1, None)
    monkeypatch.setitem(sys.modules, "torch_npu", module)
    assert npu.stack("cpu").fia is npu.FIA_CANN_8_3


@model_only
def test_batches_beyond_the_limits_are_split(ops, monkeypatch):
    monkeypatch.setattr(npu, "FA_MAX_BATCH", 2)
    monkeypatch.setattr(npu, "FA_MAX_TOKENS", 20)
    case = make_case([5, 0, 7, 3, 12, 9], [9, 8, 8, 4, 12, 2])
    check_forward("npu", case, window_size=(4, 1))
    got = [(a["actual_seq_qlen"], a["actual_seq_kvlen"]) for a in calls(ops, FA)]
    assert got == [([5, 12], [9, 17]), ([3, 15], [4, 16]), ([3], [2])]  # the last: 6 of 9 rows hidden


REFUSED = {
    "softcap": ({}, {"softcap": 2.0}, "no soft-capping (softcap=2.0)"),
    "fp64": ({"dtype": torch.float64}, {}, "takes float16, bfloat16 or float32 only, got torch.float64"),
    "dv_larger": ({"d": 16, "dv": 40}, {}, "needs v's head_dim at most q's, got D=16 and Dv=40"),
    "head_dim": ({"d": 800}, {}, "takes head dims up to 768, got D=800 and Dv=800"),
    "heads": ({"hq": 260, "hkv": 1}, {}, "takes at most 256 query heads, got 260"),
}


@pytest.mark.parametrize("name", REFUSED)
def test_refusals_name_the_reason(name):
    change, mask, fragment = REFUSED[name]
    case = make_case([3, 0], [4, 2], **{"hq": 2, "hkv": 1, "d": 16, **change})
    assert any(fragment in r for r in npu.BACKEND.supports(case_inputs(case, **mask)))
    with pytest.raises(ValueError, match="backend='npu' cannot run these inputs") as info:
        packattn.varlen_attention(case.q, case.k, case.v, *case.tensors(), backend="npu", **mask)
    assert fragment in str(info.value)


@model_only
def test_other_devices_are_refused_and_npu_dispatch_order(monkeypatch):
    point_at(monkeypatch, npu.BACKEND, "npu")
    why = npu.BACKEND.supports(case_inputs(make_case([3], [4])))
    assert why == ["npu_fusion_attention runs on npu tensors only, got cpu"]
    on_npu = SimpleNamespace(type="npu")  # torch.device("npu") exists only once torch_npu is imported
    assert [b.name for b in dispatch.candidates(on_npu)] == ["npu", "reference"]  # type: ignore[arg-type]
    assert npu not in dispatch.candidates(torch.device("cpu"))


def test_unavailable_without_torch_npu(monkeypatch):
    monkeypatch.delitem(sys.modules, "torch_npu", raising=False)
    monkeypatch.setattr(npu.importlib.util, "find_spec", lambda name: None)
    assert npu.BACKEND.unavailable_reason() == "torch_npu is not installed"


def test_importing_packattn_does_not_import_torch_npu():
    # torch may autoload torch_npu itself on an Ascend machine; packattn must not add the import.
    code = "import sys, torch; pre = 'torch_npu' in sys.modules; import packattn; packattn.info(); "
    code += "assert pre or 'torch_npu' not in sys.modules"
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False)
    assert res.returncode == 0, res.stderr


# Gradients --------------------------------------------------------------------------------------------


def _grads_of_out(case, mask: dict, dout: torch.Tensor) -> tuple[torch.Tensor, ...]:
    out = packattn.varlen_attention(case.q, case.k, case.v, *case.tensors(), backend="npu", **mask)
    return torch.autograd.grad(out, (case.q, case.k, case.v), dout.to(out.dtype))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("mask", ["full", "causal", "window", "right_band"])
def test_backward_through_the_fused_grad_op(ops, dtype, mask):
    case = make_case([9, 0, 20, 3, 6], [14, 6, 20, 0, 2], hq=4, hkv=2, d=16, dv=8, dtype=dtype, requires_grad=True)
    dout = torch.randn(case.q.shape[0], 4, 8, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    dout = dout.to(DEVICE)
    got = _grads_of_out(case, MASKS[mask], dout)

    def grads(dt: torch.dtype) -> tuple[torch.Tensor, ...]:
        xs = [t.detach().to(dt, copy=True).requires_grad_() for t in (case.q, case.k, case.v)]
        o, _ = attention_naive(*xs, case.cu_q, case.cu_k, **MASKS[mask])  # type: ignore[arg-type]
        return torch.autograd.grad(o, xs, dout.to(dt))

    for n, g, r, b in zip("qkv", got, grads(torch.float64), grads(dtype)):
        assert g.dtype == dtype
        assert_close_to_oracle(g, r, b, name=f"d{n}")
    if ops is not None:
        (a,) = calls(ops, GRAD)
        assert a["actual_seq_qlen"] == calls(ops, FA)[0]["actual_seq_qlen"] and a["softmax_layout"] == "TND"


@pytest.mark.parametrize("mask", ["full", "causal", "window"])
def test_backward_with_an_lse_gradient_uses_the_reference_backward(ops, mask):
    case = make_case([9, 0, 20, 3], [14, 6, 20, 0], hq=4, hkv=2, d=16, dv=8, requires_grad=True)
    check_backward("npu", case, **MASKS[mask])
    if ops is not None:
        assert not calls(ops, GRAD) and len(calls(ops, FA)) == 1  # training runs FA forward, never FIA


@model_only
def test_training_forward_runs_fa_even_within_fia_limits(ops):
    case = make_case([5, 7], [9, 8], requires_grad=True, **FIA_CASE)
    check_backward("npu", case)
    assert not calls(ops, FIA) and calls(ops, FA)


# The interface model itself: it must reject what the real ops reject -----------------------------------


def _fa_call(**change: object) -> dict:
    q, k = torch.randn(7, 4, 16), torch.randn(9, 2, 16)
    call = {"query": q, "key": k, "value": k.clone(), "head_num": 4, "input_layout": "TND", "scale": 0.25}
    call |= {"actual_seq_qlen": [3, 7], "actual_seq_kvlen": [5, 9], "softmax_layout": "TND"}
    return {**call, **change}


@model_only
@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"actual_seq_qlen": [0, 3, 7], "actual_seq_kvlen": [0, 5, 9]}, "starts with 0"),
        ({"actual_seq_qlen": [3, 7, 7], "actual_seq_kvlen": [5, 6, 9]}, "empty on one side only"),
        ({"actual_seq_qlen": [3]}, "must end at the tensor's T"),
        ({"actual_seq_qlen": None}, "actual_seq_qlen is required"),
        ({"actual_seq_qlen": [3, 7], "actual_seq_kvlen": [1, 9], "sparse_mode": 3}, "needs the compressed"),
        ({"head_num": 3}, "head_num must be q's N"),
        ({"keep_prob": 0.9}, "dropout is not modelled"),
        ({"sparse_mode": 2}, "sparse_mode=2 is not supported"),
    ],
    ids=["leading_zero", "one_side_empty", "bad_end", "no_lengths", "no_mask", "heads", "dropout", "mode2"],
)
def test_model_rejects_what_the_docs_forbid(ops, change, message):
    with pytest.raises(npu_model.ModelError, match=message):
        sys.modules["torch_npu"].npu_fusion_attention(**_fa_call(**change))


@model_only
def test_model_rejects_fully_masked_rows_and_a_missing_scale(ops):
    mask = torch.ones(2048, 2048, dtype=torch.bool).triu(1)
    call = _fa_call(actual_seq_kvlen=[1, 9], atten_mask=mask, sparse_mode=3)
    with pytest.raises(npu_model.ModelError, match="fully masked rows"):
        sys.modules["torch_npu"].npu_fusion_attention(**call)
    call = _fa_call()
    del call["scale"]
    with pytest.raises(npu_model.ModelError, match="scale not passed"):
        sys.modules["torch_npu"].npu_fusion_attention(**call)


@model_only
def test_model_binds_calls_against_the_schema(ops):
    torch_npu = sys.modules["torch_npu"]
    with pytest.raises(TypeError, match="unexpected keyword argument 'softmax_scale'"):
        torch_npu.npu_fusion_attention(**_fa_call(softmax_scale=0.5))
    with pytest.raises(TypeError, match="head_num must be int"):
        torch_npu.npu_fusion_attention(**_fa_call(head_num=4.0))
    call = _fa_call()
    del call["input_layout"]
    with pytest.raises(TypeError, match="missing required argument 'input_layout'"):
        torch_npu.npu_fusion_attention(**call)
    q = torch.randn(7, 8, 192, dtype=torch.bfloat16)
    with pytest.raises(TypeError, match="positional arguments"):
        torch_npu.npu_fused_infer_attention_score(q, q, q, 8)  # num_heads is keyword-only
    assert set(npu_model.load_schemas()) == {FA, FIA, GRAD}


@model_only
@pytest.mark.parametrize(
    ("stack", "change", "message"),
    [
        ("cann_unknown", {}, "needs CANN 8.1 or later"),
        ("cann_8_3", {"dtype": torch.float16}, "bfloat16 only"),
        ("cann_8_2", {"d": 128}, "TND head dims"),
        ("cann_8_2", {"hkv": 2}, "equal query and key/value heads"),
        ("cann_8_3", {"hkv": 2, "dv": 192}, "GQA does not support value D 192"),
        ("cann_8_3", {"d": 96}, "TND head dims"),
        ("split_fuse", {"d": 272}, "TND head dims equal"),
        ("split_fuse", {"dtype": torch.float32}, "float16/bfloat16"),
    ],
)
def test_model_fia_limits_follow_the_cann_version(monkeypatch, stack, change, message):
    model = _install(monkeypatch, **STACKS[stack])
    d, dtype, hkv = change.get("d", 192), change.get("dtype", torch.bfloat16), change.get("hkv", 8)
    dv = change.get("dv", d if d != 192 else 128)
    q, k, v = (torch.randn(7, h, n, dtype=dtype) for h, n in ((8, d), (hkv, d), (hkv, dv)))
    call = {"num_heads": 8, "num_key_value_heads": hkv, "scale": 0.1, "input_layout": "TND"}
    with pytest.raises(npu_model.ModelError, match=message):
        model.npu_fused_infer_attention_score(q, k, v, actual_seq_lengths=[7], actual_seq_lengths_kv=[7], **call)


@model_only
@pytest.mark.parametrize(("version", "cann"), [("2.7.1", "8.3.RC1"), ("2.8.0", "8.2.RC1"), ("2.8.0", "8.3.RC1")])
def test_softmax_layout_only_where_torch_npu_and_cann_take_it(monkeypatch, version, cann):
    """torch_npu before 2.8 has no softmax_layout, and raises for it before CANN 8.3: the adapter then leaves it
    out and converts FA's default arrangement per sequence, for the LSE of the forward and the softmax inputs
    of the grad op."""
    model, module = npu_model.module(version, cann)
    monkeypatch.setitem(sys.modules, "torch_npu", module)
    # Sequences of different lengths, so that a token-major reading of the default arrangement would mix them.
    case = make_case([7, 0, 12, 3], [9, 5, 12, 4], hq=4, hkv=2, d=32, dv=16, seed=6)
    check_forward("npu", case, causal=True)
    grad_case = make_case([7, 0, 12, 3], [9, 5, 12, 4], hq=4, hkv=2, d=32, dv=16, seed=6, requires_grad=True)
    cu_q, cu_k = grad_case.tensors()
    out = packattn.varlen_attention(grad_case.q, grad_case.k, grad_case.v, cu_q, cu_k, causal=True, backend="npu")
    out.float().sum().backward()  # the grad op checks that softmax_max/sum match the forward's, per token
    expected = {"softmax_layout": "TND"} if (version, cann) == ("2.8.0", "8.3.RC1") else {}
    for op in (FA, GRAD):
        assert calls(model, op)
        assert all((a.get("softmax_layout", "") == "TND") == bool(expected) for a in calls(model, op))


@model_only
def test_fia_band_mode_only_for_value_head_dims_64_and_128(ops):
    """CANN 8.3's FIA rejects sparse_mode=4 with Dv = 192: a window at Dv = 192 runs FA, at Dv = 128 FIA."""
    check_forward("npu", make_case([5, 7], [9, 8], **{**FIA_CASE, "dv": 192}), window_size=(3, 1))
    assert not calls(ops, FIA) and len(calls(ops, FA)) == 1
    check_forward("npu", make_case([5, 7], [9, 8], **FIA_CASE), window_size=(3, 1))
    assert [a["sparse_mode"] for a in calls(ops, FIA)] == [4]


@model_only
def test_model_rejects_band_mode_in_fia_before_cann_8_3(monkeypatch):
    """CANN 8.1/8.2's FIA takes TND with sparse_mode 0 (no mask) or 3 only."""
    model = _install(monkeypatch, **STACKS["cann_8_2"])
    q, k, v = (torch.randn(7, 8, n, dtype=torch.bfloat16) for n in (192, 192, 128))
    mask = torch.ones(2048, 2048, dtype=torch.bool).triu(1)
    call = {"num_heads": 8, "num_key_value_heads": 8, "scale": 0.1, "input_layout": "TND", "atten_mask": mask}
    with pytest.raises(npu_model.ModelError, match=r"sparse_mode=4 is not supported"):
        model.npu_fused_infer_attention_score(
            q,
            k,
            v,
            actual_seq_lengths=[7],
            actual_seq_lengths_kv=[7],
            sparse_mode=4,
            pre_tokens=3,
            next_tokens=0,
            **call,
        )


@model_only
@pytest.mark.parametrize(
    "stack",
    [
        {"version": "2.7.1", "cann": ""},
        {"version": "2.8.0", "cann": "8.2.RC1"},
        {"version": "2.8.0"},
        STACKS["split_fuse"],
    ],
)
def test_info_prints_what_was_found(monkeypatch, capsys, stack):
    _install(monkeypatch, **stack)
    from packattn import cli

    cli.main(["info"])
    text = capsys.readouterr().out
    version = stack.get("version", "2.8.0")
    with_keyword = version == "2.8.0" and stack.get("cann") != "8.2.RC1"
    layout = "softmax_layout='TND'" if with_keyword else "default softmax layout, converted per sequence"
    found = npu.stack("cpu")
    cann = f"CANN {found.cann}" if found.cann else "CANN of unknown version"
    assert f"torch_npu {version}, {cann}, {found.fia.name}: FIA for inference in {found.fia.summary}" in text, text
    assert layout in text, text
