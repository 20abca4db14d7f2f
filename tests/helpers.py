"""Shared builders for the tests: packed cases with NaN around every tensor's real storage."""

from __future__ import annotations

from dataclasses import dataclass

import torch

import packattn
from packattn.dispatch import BACKENDS, reasons
from packattn.inputs import AttentionInputs, check_mask
from packattn.layout import SeqLayout
from packattn.testing import assert_close_to_oracle, attention_naive, oracle


def offsets(lengths: list[int]) -> list[int]:
    cu = [0]
    for n in lengths:
        cu.append(cu[-1] + n)
    return cu


def poisoned(shape: tuple[int, ...], dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    """A random tensor of ``shape`` viewed out of a larger NaN buffer (extra rows and a wider last dim),
    so any read outside the described rows or head dim turns the result into NaN."""
    t, h, d = shape
    buf = torch.full((t + 3, h, d + 5), float("nan"), dtype=torch.float64)
    buf[2 : 2 + t, :, :d] = torch.randn(t, h, d, generator=gen, dtype=torch.float64)
    return buf.to(dtype)[2 : 2 + t, :, :d]


@dataclass
class Case:
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    cu_q: list[int]
    cu_k: list[int]

    def tensors(self) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.tensor(self.cu_q, dtype=torch.int32), torch.tensor(self.cu_k, dtype=torch.int64)


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
) -> Case:
    gen = torch.Generator().manual_seed(seed)
    cu_q, cu_k = offsets(lens_q), offsets(lens_k)
    q = poisoned((cu_q[-1], hq, d), dtype, gen)
    k = poisoned((cu_k[-1], hkv, d), dtype, gen)
    v = poisoned((cu_k[-1], hkv, dv or d), dtype, gen)
    return Case(q, k, v, cu_q, cu_k)


def backend_reasons(name: str, case: Case, return_lse: bool, **mask: object) -> list[str]:
    spec = check_mask(
        case.q,
        where="test",
        **{"softmax_scale": None, "causal": False, "window_size": (-1, -1), "softcap": 0.0, **mask},
    )  # type: ignore[arg-type]
    layout = SeqLayout.build(*case.tensors(), case.q.shape[0], case.k.shape[0])
    return reasons(BACKENDS[name], AttentionInputs(case.q, case.k, case.v, layout, spec, return_lse))


def check_forward(name: str, case: Case, **mask: object) -> None:
    """Run backend ``name`` (with LSE when it can) and compare with the oracle and plain PyTorch."""
    return_lse = not backend_reasons(name, case, True, **mask)
    cu_q, cu_k = case.tensors()
    q0, k0, v0 = case.q.clone(), case.k.clone(), case.v.clone()
    res = packattn.varlen_attention(case.q, case.k, case.v, cu_q, cu_k, return_lse=return_lse, backend=name, **mask)
    out, lse = res if return_lse else (res, None)
    for a, b in ((case.q, q0), (case.k, k0), (case.v, v0)):
        assert torch.equal(a.nan_to_num(7.0), b.nan_to_num(7.0)), "inputs were modified"
    ref_out, ref_lse = oracle(case.q, case.k, case.v, case.cu_q, case.cu_k, **mask)
    pt_out, pt_lse = attention_naive(case.q, case.k, case.v, case.cu_q, case.cu_k, **mask)
    assert out.dtype == case.q.dtype and out.is_contiguous()
    assert_close_to_oracle(out, ref_out, pt_out, name="out")
    if lse is not None:
        expected_dtype = torch.float64 if case.q.dtype == torch.float64 else torch.float32
        assert lse.dtype == expected_dtype and lse.shape == (case.q.shape[1], case.q.shape[0])
        assert_close_to_oracle(lse, ref_lse, pt_lse, name="lse", floor=1e-5 if lse.dtype == torch.float32 else None)


def check_backward(name: str, case: Case, *, with_lse: bool = True, **mask: object) -> None:
    """Gradients of q, k, v (through out and, if ``with_lse``, LSE) against the oracle's."""
    cu_q, cu_k = case.tensors()
    gen = torch.Generator().manual_seed(1)
    leaves = [t.detach().clone().requires_grad_() for t in (case.q, case.k, case.v)]
    dout = torch.randn(case.q.shape[0], case.q.shape[1], case.v.shape[2], generator=gen, dtype=torch.float64)
    dlse = torch.randn(case.q.shape[1], case.q.shape[0], generator=gen, dtype=torch.float64)

    def loss(out: torch.Tensor, lse: torch.Tensor | None) -> torch.Tensor:
        total = (out.double() * dout).sum()
        if with_lse and lse is not None:
            total = total + (lse.double().nan_to_num(0.0, 0.0, 0.0) * dlse).sum()
        return total

    res = packattn.varlen_attention(*leaves, cu_q, cu_k, return_lse=with_lse, backend=name, **mask)
    out, lse = res if with_lse else (res, None)
    got = torch.autograd.grad(loss(out, lse), leaves)

    def grads(dtype: torch.dtype | None) -> tuple[torch.Tensor, ...]:
        xs = [t.detach().clone().requires_grad_() for t in (case.q, case.k, case.v)]
        o, lse_ = attention_naive(*xs, case.cu_q, case.cu_k, dtype=dtype, **mask)  # type: ignore[arg-type]
        return torch.autograd.grad(loss(o, lse_), xs, allow_unused=True)

    for n, g, r, b in zip("qkv", got, grads(torch.float64), grads(None)):
        assert g.shape == r.shape and g.dtype == case.q.dtype
        assert_close_to_oracle(g, r, b, name=f"d{n}")
