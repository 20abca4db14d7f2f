"""packattn's own compiled CPU kernel (the C++ sources beside this file), forward and backward.

One call of the kernel runs the whole packed batch: work items of (sequence, KV head, block of query rows)
balanced between threads by visible (query, key) pairs; the G query heads of a KV head share each K/V tile,
which is transposed and packed once per head; tiles that the mask hides are skipped; the softmax is online
(no ``(L, L)`` scores) in fp32. Decoded sequences (query rows x query heads per KV head <= 16) run as items
of all KV heads over chunks of 1024 keys, so that K/V rows are read whole and a long sequence's keys are
split between threads, and (on fp32 tiles) their few rows' scores are dot products with K's rows where
they lie; the chunks are merged in a fixed order. The backward recomputes the probabilities
from the LSE (flash-attention 2), in one pass per (sequence, KV head) when there are at least 4 of them per
thread, else in two passes (dK/dV per key block, dQ per query block) that split a sequence between threads;
either way every gradient element has one writer: the same bits at any thread count.

Products accumulate in fp32. bf16 inputs are multiplied as bf16 tiles on AMX where the CPU has it, on the
kernel's own AVX512_BF16 dot-product loop on AMD CPUs with that instruction (Zen 4 and later), else as fp32
tiles; fp16 always as fp32 tiles (AVX512_FP16 accumulates in fp16). ``$PACKATTN_CPU_BF16_PRODUCTS``
(``amx``, ``avx512_bf16`` or ``fp32``) picks one of those that run here instead (:func:`bf16_products`).

Outputs (and gradients) of 32 MiB or more are kept when freed, for the next call's outputs of about their
size: fresh pages from the system cost many short sequences a sixth of their time. At most
``$PACKATTN_CPU_OUTPUT_CACHE_MIB`` (default 512; 0 keeps none) are kept; :func:`release_output_cache` frees
them.

Supports fp32, bf16 and fp16 with every mask option (causal, windows, softcap), GQA/MQA, ``Dv != D``,
empty sides and any strides; float64 stays on the ``cpu`` and ``reference`` paths. Compiled on first use
(see :mod:`.build`, or ``packattn build`` ahead of time); when it cannot be built, ``unavailable_reason``
says why and dispatch moves on to the ``cpu`` backend.
"""

from __future__ import annotations

import os

import torch

from ...inputs import AttentionInputs
from ..base import Backend, Capabilities, Grads
from . import build


def _offsets(inp: AttentionInputs) -> tuple[torch.Tensor, torch.Tensor]:
    layout = inp.layout

    def build() -> tuple[torch.Tensor, torch.Tensor]:
        return torch.tensor(layout.host_q, dtype=torch.int64), torch.tensor(layout.host_k, dtype=torch.int64)

    return layout.plan("cpu_kernel offsets", build)


def _mask_args(inp: AttentionInputs) -> tuple[float, float, int, int]:
    m = inp.mask
    return m.scale, m.softcap, m.left, m.right


BF16_PRODUCTS_ENV = "PACKATTN_CPU_BF16_PRODUCTS"


def bf16_products() -> str:
    """How the kernel multiplies bf16 inputs in this call: ``$PACKATTN_CPU_BF16_PRODUCTS`` when set, else
    ``""`` (the CPU's default, the first of ``build.load().bf16_products()``)."""
    choice = os.environ.get(BF16_PRODUCTS_ENV, "").strip()
    if choice:
        runs_here = build.load().bf16_products()
        if choice not in runs_here:
            raise ValueError(f"{BF16_PRODUCTS_ENV}: expected one of {runs_here} on this CPU, got {choice!r}")
    return choice


def release_output_cache() -> int:
    """Frees the outputs the kernel keeps for reuse (see the module's docs); returns their bytes. Like
    ``torch.cuda.empty_cache()``, it frees nothing that a tensor still uses. Nothing to free without a build."""
    module = build.loaded()
    return module.release_output_cache() if module is not None else 0


def forward(inp: AttentionInputs) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Out ``(Tq, Hq, Dv)`` and, when ``inp.return_lse``, the LSE ``(Hq, Tq)`` float32 (else None)."""
    module = build.load()
    args = (*_offsets(inp), *_mask_args(inp), inp.return_lse, bf16_products())
    out, lse = module.forward(inp.q, inp.k, inp.v, *args)
    return out, (lse if inp.return_lse else None)


def backward(
    inp: AttentionInputs,
    out: torch.Tensor,
    lse: torch.Tensor,
    dout: torch.Tensor,
    dlse: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients of ``q, k, v`` in their dtype, through ``out`` and (when given) the LSE."""
    module = build.load()
    delta = module.delta(out, dout)  # (Hq, Tq) float32
    if dlse is not None:
        delta -= dlse.float()
    return module.backward(
        inp.q, inp.k, inp.v, dout, lse.float().contiguous(), delta, *_offsets(inp), *_mask_args(inp), bf16_products()
    )


class CpuKernel(Backend):
    name = "cpu_kernel"
    capabilities = Capabilities(devices=("cpu",), dtypes=(torch.float32, torch.bfloat16, torch.float16))

    def unavailable_reason(self) -> str | None:
        try:
            build.load()
        except RuntimeError as exc:
            return str(exc)
        return None

    def details(self) -> str | None:
        default, *others = build.load().bf16_products()
        built = build.capability() + (f" ({build.emulated()} emulated)" if build.emulated() else "")
        return f"built for {built}; bf16 products: " + ", ".join([f"{default} (default)", *others])

    def forward(self, inp: AttentionInputs) -> tuple[torch.Tensor, torch.Tensor | None]:
        return forward(inp)

    def backward(
        self, inp: AttentionInputs, out: torch.Tensor, lse: torch.Tensor, dout: torch.Tensor, dlse: torch.Tensor | None
    ) -> Grads:
        return backward(inp, out, lse, dout, dlse)


BACKEND = CpuKernel()
