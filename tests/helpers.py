"""Shared builders for the tests: packed cases with NaN around every tensor's real storage."""

from __future__ import annotations

import os
from dataclasses import dataclass, replace

import pytest
import torch

import packattn
from packattn import dispatch
from packattn.backends.base import Backend
from packattn.inputs import AttentionInputs, check_mask, compute_dtype
from packattn.layout import SeqLayout
from packattn.testing import assert_close_to_oracle, attention_naive, oracle

# Where the backend tests put their tensors: CPU here; PACKATTN_TEST_DEVICE=cuda (or npu) on such a machine.
DEVICE = torch.device(os.environ.get("PACKATTN_TEST_DEVICE", "cpu"))
# Set when the backends are re-declared as if the CPU were this device (see conftest.py).
FAKE_DEVICE = os.environ.get("PACKATTN_TEST_FAKE_DEVICE")


def point_at(monkeypatch: pytest.MonkeyPatch, backend: Backend, device_type: str) -> None:
    """Declare ``backend`` to run on ``device_type`` for one test: interface models of device kernels take
    CPU tensors."""
    monkeypatch.setattr(backend, "capabilities", replace(backend.capabilities, devices=(device_type,)))


def offsets(lengths: list[int]) -> list[int]:
    cu = [0]
    for n in lengths:
        cu.append(cu[-1] + n)
    return cu


def poisoned(
    shape: tuple[int, ...], dtype: torch.dtype, gen: torch.Generator, *, requires_grad: bool = False
) -> torch.Tensor:
    """A random tensor of ``shape`` viewed out of a larger NaN buffer (extra rows and a wider last dim),
    so any read outside the described rows or head dim turns the result into NaN. With ``requires_grad``
    the buffer is a leaf that requires grad and the result a strided view of it, as a caller's slice is."""
    t, h, d = shape
    buf = torch.full((t + 3, h, d + 5), float("nan"), dtype=torch.float64)
    buf[2 : 2 + t, :, :d] = torch.randn(t, h, d, generator=gen, dtype=torch.float64)
    return buf.to(DEVICE, dtype).requires_grad_(requires_grad)[2 : 2 + t, :, :d]


@dataclass
class Case:
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    cu_q: list[int]
    cu_k: list[int]

    def tensors(self) -> tuple[torch.Tensor, torch.Tensor]:
        return (
            torch.tensor(self.cu_q, dtype=torch.int32, device=self.q.device),
            torch.tensor(self.cu_k, dtype=torch.int64, device=self.q.device),
        )


def make_case(
    lens_q: list[int],
    lens_k: list[int],
    *,
    hq: int = 4,
    hkv: int = 2,
    d: int = 32,
    dv: int | None = None,
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
    requires_grad: bool = False,
) -> Case:
    gen = torch.Generator().manual_seed(seed)
    cu_q, cu_k = offsets(lens_q), offsets(lens_k)
    q = poisoned((cu_q[-1], hq, d), dtype, gen, requires_grad=requires_grad)
    k = poisoned((cu_k[-1], hkv, d), dtype, gen, requires_grad=requires_grad)
    v = poisoned((cu_k[-1], hkv, dv or d), dtype, gen, requires_grad=requires_grad)
    return Case(q, k, v, cu_q, cu_k)


def _heads_major(x: torch.Tensor) -> torch.Tensor:
    """``x`` stored as ``(H, T, D)`` (with NaN rows around it) and permuted back to ``(T, H, D)``."""
    t, h, d = x.shape
    buf = torch.full((h, t + 2, d), float("nan"), dtype=x.dtype, device=x.device)
    buf[:, 1 : t + 1] = x.transpose(0, 1)
    return buf[:, 1 : t + 1].transpose(0, 1)


def _last_dim_stride_2(x: torch.Tensor) -> torch.Tensor:
    """``x`` as every other element of a NaN buffer twice as wide: last-dim stride 2."""
    buf = torch.full((*x.shape[:2], 2 * x.shape[2]), float("nan"), dtype=x.dtype, device=x.device)
    buf[..., ::2] = x
    return buf[..., ::2]


STRIDES = ("heads_major", "last_dim_stride_2", "kv_broadcast")


def restride(case: Case, strides: str) -> Case:
    """``case`` with other strides: one of :data:`STRIDES`. ``kv_broadcast`` replaces K/V by their first
    head expanded along the head axis (stride 0), so its values differ from ``case``'s."""
    if strides == "kv_broadcast":
        k, v = case.k[:, :1].expand_as(case.k), case.v[:, :1].expand_as(case.v)
        return Case(case.q, k, v, case.cu_q, case.cu_k)
    f = {"heads_major": _heads_major, "last_dim_stride_2": _last_dim_stride_2}[strides]
    return Case(f(case.q), f(case.k), f(case.v), case.cu_q, case.cu_k)


def case_inputs(case: Case, return_lse: bool = False, **mask: object) -> AttentionInputs:
    options = {"softmax_scale": None, "causal": False, "window_size": (-1, -1), "softcap": 0.0, **mask}
    spec = check_mask(case.q, where="test", **options)  # type: ignore[arg-type]
    layout = SeqLayout.build(*case.tensors(), case.q.shape[0], case.k.shape[0])
    return AttentionInputs(case.q, case.k, case.v, layout, spec, return_lse)


def backend_reasons(name: str, case: Case, return_lse: bool, **mask: object) -> list[str]:
    return dispatch.reasons(dispatch.BACKENDS[name], case_inputs(case, return_lse, **mask))


_SMALL = make_case([3, 0, 2], [2, 4, 0], hq=2, hkv=1, d=8)


def supported(name: str, *, return_lse: bool = False, dtype: torch.dtype = torch.float32, **mask: object) -> bool:
    """Whether backend ``name`` is available and runs these options on a small case of ``dtype`` on the test
    device, so the backend tests cover exactly the backends this device can run (CI: CPU)."""
    case = _SMALL
    if dtype != case.q.dtype:
        case = Case(case.q.to(dtype), case.k.to(dtype), case.v.to(dtype), case.cu_q, case.cu_k)
    return not dispatch.reasons(dispatch.BACKENDS[name], case_inputs(case, return_lse, **mask))


# The backends the test device can run (on CPU: cpu, cpu_kernel, reference, sdpa, and triton under its
# interpreter), chosen by what each declares, never by name.
DEVICE_BACKENDS = [name for name in sorted(dispatch.BACKENDS) if supported(name)]


def interpreted(name: str) -> bool:
    """Whether backend ``name`` runs through an interpreter here (Triton's, on CPU): each kernel launch costs
    ~0.1 s, so the tests of long sequences leave it out (tests/test_triton.py covers it)."""
    return name == "triton" and DEVICE.type == "cpu"


# The backends that return the LSE, and those of them that run compiled code here.
LSE_BACKENDS = [name for name in DEVICE_BACKENDS if supported(name, return_lse=True)]
COMPILED_LSE_BACKENDS = [name for name in LSE_BACKENDS if not interpreted(name)]


def backend_mask_params(masks: dict[str, dict[str, object]], *, runs: bool = True) -> list[object]:
    """``(backend, mask name)`` parameters for the pairs where the backend runs (``runs``) or refuses the mask."""
    return [
        pytest.param(b, m, id=f"{m}-{b}") for m in masks for b in DEVICE_BACKENDS if supported(b, **masks[m]) == runs
    ]


def assert_matches_oracle(
    case: Case,
    out: torch.Tensor,
    lse: torch.Tensor | None = None,
    **mask: object,
) -> None:
    """``out`` (and ``lse``) against the float64 oracle, allowing twice plain PyTorch's error in q's dtype."""
    args = (case.q, case.k, case.v, case.cu_q, case.cu_k)
    ref_out, ref_lse = oracle(*args, **mask)
    pt_out, pt_lse = attention_naive(*args, **mask)  # type: ignore[arg-type]
    assert out.dtype == case.q.dtype and out.is_contiguous()
    assert_close_to_oracle(out, ref_out, pt_out, name="out")
    if lse is not None:
        lse_dtype = compute_dtype(case.q.dtype)
        assert lse.dtype == lse_dtype and lse.shape == (case.q.shape[1], case.q.shape[0])
        assert_close_to_oracle(lse, ref_lse, pt_lse, name="lse", floor=1e-5 if lse_dtype == torch.float32 else None)


def attend(
    name: str | None,
    case: Case,
    *,
    offsets: tuple[torch.Tensor, torch.Tensor] | None = None,
    host: bool = False,
    **mask: object,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(out, lse)`` of backend ``name`` (None: default dispatch) on ``case``; ``lse`` is None when the
    backend returns none. ``offsets`` replace ``case.tensors()``; ``host`` passes the host copies too."""
    with_lse = name is None or supported(name, return_lse=True, dtype=case.q.dtype, **mask)
    copies = {"cu_seqlens_q_host": case.cu_q, "cu_seqlens_k_host": case.cu_k} if host else {}
    res = packattn.varlen_attention(
        case.q, case.k, case.v, *(offsets or case.tensors()), return_lse=with_lse, backend=name, **copies, **mask
    )
    return res if with_lse else (res, None)


def check_forward(name: str, case: Case, **mask: object) -> None:
    """Run backend ``name`` (with LSE when it can) and compare with the oracle and plain PyTorch."""
    q0, k0, v0 = case.q.clone(), case.k.clone(), case.v.clone()
    out, lse = attend(name, case, **mask)
    for a, b in ((case.q, q0), (case.k, k0), (case.v, v0)):
        assert torch.equal(a.nan_to_num(7.0), b.nan_to_num(7.0)), "inputs were modified"
    assert_matches_oracle(case, out, lse, **mask)


def as_received(weights: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A loss's float64 weights of a result in ``dtype``, rounded as the result's gradient reaches a backward
    (out's in the inputs' dtype, the LSE's in float32, float64 for float64): the oracle's backward must start
    from the same dO and dLSE as the backends' (fp16 alone moves each element by up to 2**-11 of it)."""
    return weights.to(dtype).double()


def check_backward(name: str, case: Case, **mask: object) -> None:
    """Gradients of q, k, v (through out and, when the backend returns it, LSE) against the oracle's.

    ``case`` comes from ``make_case(..., requires_grad=True)``: q, k, v are NaN-poisoned strided views of
    leaf buffers that require grad, and the gradients are taken with respect to those views.
    """
    leaves = (case.q, case.k, case.v)
    assert all(t.requires_grad and not t.is_leaf for t in leaves)
    gen = torch.Generator().manual_seed(1)
    dout = torch.randn(case.q.shape[0], case.q.shape[1], case.v.shape[2], generator=gen, dtype=torch.float64).to(DEVICE)
    dlse = torch.randn(case.q.shape[1], case.q.shape[0], generator=gen, dtype=torch.float64).to(DEVICE)
    dout, dlse = as_received(dout, case.q.dtype), as_received(dlse, compute_dtype(case.q.dtype))
    out, lse = attend(name, case, **mask)
    with_lse = lse is not None  # a backend without LSE gets its gradients through out only

    def loss(o: torch.Tensor, o_lse: torch.Tensor) -> torch.Tensor:
        total = (o.double() * dout).sum()
        return total + (o_lse.double().nan_to_num(0.0, 0.0, 0.0) * dlse).sum() if with_lse else total

    got = torch.autograd.grad(loss(out, lse), leaves)

    def grads(dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
        xs = [t.detach().to(dtype, copy=True).requires_grad_() for t in leaves]
        o, lse_ = attention_naive(*xs, case.cu_q, case.cu_k, **mask)  # type: ignore[arg-type]
        return torch.autograd.grad(loss(o, lse_), xs, allow_unused=True)

    for n, g, r, b in zip("qkv", got, grads(torch.float64), grads(case.q.dtype)):
        assert g.shape == r.shape and g.dtype == case.q.dtype
        assert_close_to_oracle(g, r, b, name=f"d{n}")
