"""packattn's own Triton flash-attention kernels for packed batches (CUDA; CPU under Triton's interpreter).

What runs (``kernels.py`` says how): one forward launch over every query block of every sequence and every
query head computes ``out`` and the LSE with an online softmax, accumulating in fp32 (fp64 for fp64 inputs),
visiting only the key blocks the mask can make visible. The backward recomputes the probabilities from the
LSE: ``delta = rowsum(dout * out) - dlse`` first, then one launch for dK/dV (one program per key block and
KV head, summing the ``G`` query heads that share it: no K/V copies for GQA/MQA) and one for dQ. No atomics,
so gradients are bit-identical run to run. fp32 inputs multiply in IEEE fp32 (no TF32).

Every option of the contract runs: all four dtypes, ``Dv != D`` (head dims padded to powers of two and
masked, up to 256), windows, bottom-right causal, softcap, empty sides, any strides. CPU tensors run only
when ``TRITON_INTERPRET=1`` is set (Triton's interpreter, for tests); ``import triton`` happens at first use.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
from dataclasses import dataclass
from types import ModuleType

import torch

from ...inputs import AttentionInputs, compute_dtype
from .. import reference
from ..base import Backend, Capabilities, Grads

# (query block, key block) under the interpreter, where each tile operation costs Python overhead.
INTERPRETER_BLOCKS = (128, 64)


def _interpreting() -> bool:
    """Whether Triton runs kernels in its interpreter (read at call time: kernels.py is imported lazily)."""
    return os.environ.get("TRITON_INTERPRET", "").strip().lower() in ("1", "true", "on")


_KERNELS: ModuleType | None = None


def _kernels() -> ModuleType:
    global _KERNELS
    if _KERNELS is None:
        from . import kernels

        _KERNELS = kernels
    return _KERNELS


@dataclass(frozen=True)
class Blocks:
    """Tile sizes (powers of two >= 16) and launch options of one kernel."""

    m: int  # query rows per tile
    n: int  # keys per tile
    warps: int = 4
    stages: int = 2


def blocks(stage: str, dtype: torch.dtype, head_dim: int) -> Blocks:
    """Tiles for ``stage`` ("forward" or "backward") by dtype and the larger head dim: big tiles for 16-bit
    inputs (tensor cores, half the bytes), smaller for fp32 and fp64 (registers and shared memory)."""
    if _interpreting():
        return Blocks(*INTERPRETER_BLOCKS)
    wide = head_dim > 128
    if dtype == torch.float64:
        return Blocks(16, 16, 4, 1) if wide else Blocks(32, 32, 4, 1)
    if dtype == torch.float32:
        if stage == "forward":
            return Blocks(32, 32, 4, 1) if wide else Blocks(64, 32 if head_dim > 64 else 64, 4, 2)
        return Blocks(16, 32, 4, 1) if wide else Blocks(32, 32, 4, 1)
    if stage == "forward":
        return Blocks(64, 32, 4, 2) if wide else Blocks(128, 64, 8 if head_dim > 64 else 4, 3)
    return Blocks(32, 32, 4, 1) if wide else Blocks(64, 64, 8 if head_dim > 64 else 4, 2)


def _table(inp: AttentionInputs, block: int, *, by_keys: bool) -> torch.Tensor:
    """The kernels' work table on q's device: ``scale, softcap`` as two float64, then one int32 row
    ``(q_start, Lq, k_start, Lk, block_start)`` per query (or key) block, the longest work first."""
    mask = inp.mask
    rows = []
    for qs, qe, ks, ke in inp.layout.sequences():
        lq, lk = qe - qs, ke - ks
        for start in range(0, lk if by_keys else lq, block):
            if by_keys:
                lo, hi = mask.query_range(start, min(lk, start + block), lq, lk)
            else:
                lo, hi = mask.key_range(start, min(lq, start + block), lq, lk)
            rows.append((hi - lo, (qs, lq, ks, lk, start)))
    rows.sort(key=lambda r: -r[0])  # stable: equal work keeps the packed order
    header = torch.tensor([mask.scale, mask.softcap], dtype=torch.float64).view(torch.int32)
    body = torch.tensor([r[1] for r in rows], dtype=torch.int32).reshape(-1)
    return torch.cat([header, body]).to(inp.q.device)


def _on_device(device: torch.device) -> contextlib.AbstractContextManager[object]:
    """Triton launches on the current CUDA device: make it the tensors' one."""
    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()


def _options(inp: AttentionInputs, cfg: Blocks) -> dict[str, object]:
    """Mask bounds, dims and compile-time switches shared by the three kernels."""
    import triton
    import triton.language as tl

    dtype = inp.q.dtype
    dot = {torch.float16: tl.float16, torch.bfloat16: tl.bfloat16, torch.float32: tl.float32}.get(dtype, tl.float64)
    if dtype == torch.bfloat16 and _interpreting():
        dot = tl.float32  # the interpreter's dot reads bf16 storage as integers
    return {
        "left": inp.mask.left,
        "right": inp.mask.right,
        "G": inp.heads_q // inp.heads_kv,
        "D": inp.head_dim,
        "DV": inp.head_dim_v,
        "SOFTCAP": inp.mask.softcap > 0,
        "HAS_LEFT": inp.mask.left >= 0,
        "HAS_RIGHT": inp.mask.right >= 0,
        "BLOCK_M": cfg.m,
        "BLOCK_N": cfg.n,
        "BLOCK_D": max(16, triton.next_power_of_2(inp.head_dim)),
        "BLOCK_DV": max(16, triton.next_power_of_2(inp.head_dim_v)),
        "ACC": tl.float64 if dtype == torch.float64 else tl.float32,
        "DOT": dot,
        "PRECISION": "ieee" if dtype in (torch.float32, torch.float64) else "tf32",
        "num_warps": cfg.warps,
        "num_stages": cfg.stages,
    }


def forward(inp: AttentionInputs) -> tuple[torch.Tensor, torch.Tensor]:
    """``out (Tq, Hq, Dv)`` in q's dtype and ``lse (Hq, Tq)`` (float32; float64 for float64 inputs)."""
    q, k, v = inp.q.detach(), inp.k.detach(), inp.v.detach()
    tq, hq = q.shape[:2]
    out = torch.empty(tq, hq, v.shape[2], dtype=q.dtype, device=q.device)
    lse = torch.empty(hq, tq, dtype=compute_dtype(q.dtype), device=q.device)
    if out.numel() == 0:
        return out, lse
    cfg = blocks("forward", q.dtype, max(inp.head_dim, inp.head_dim_v))
    table = _table(inp, cfg.m, by_keys=False)
    grid = ((table.numel() - 4) // 5, hq)
    with _on_device(q.device):
        _kernels().forward_kernel[grid](
            q, k, v, out, lse, table, *q.stride(), *k.stride(), *v.stride(), *out.stride(), lse.stride(0),
            **_options(inp, cfg),
        )  # fmt: skip
    return out, lse


def backward(
    inp: AttentionInputs,
    out: torch.Tensor,
    lse: torch.Tensor,
    dout: torch.Tensor,
    dlse: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients of ``q, k, v`` through ``out`` (and the LSE when ``dlse`` is given), in the inputs' dtype."""
    q, k, v = inp.q.detach(), inp.k.detach(), inp.v.detach()
    delta, lse = reference.delta(out, dout, dlse).contiguous(), lse.contiguous()
    dq, dk, dv = (torch.empty(t.shape, dtype=t.dtype, device=t.device) for t in (q, k, v))
    if q.numel() == 0 or k.numel() == 0:
        return dq.zero_(), dk.zero_(), dv.zero_()
    cfg = blocks("backward", q.dtype, max(inp.head_dim, inp.head_dim_v))
    options = _options(inp, cfg)
    common = (*q.stride(), *k.stride(), *v.stride(), *dout.stride(), lse.stride(0))
    kernels = _kernels()
    with _on_device(q.device):
        table = _table(inp, cfg.n, by_keys=True)
        kernels.dkdv_kernel[((table.numel() - 4) // 5, inp.heads_kv)](
            q, k, v, dout, lse, delta, dk, dv, table, *common, *dk.stride(), *dv.stride(), **options
        )
        table = _table(inp, cfg.m, by_keys=False)
        kernels.dq_kernel[((table.numel() - 4) // 5, inp.heads_q)](
            q, k, v, dout, lse, delta, dq, table, *common, *dq.stride(), **options
        )
    return dq, dk, dv


class Triton(Backend):
    name = "triton"
    # CPU tensors only under Triton's interpreter (tests); offsets travel as int32 in the kernels.
    capabilities = Capabilities(devices=("cuda", "cpu"), max_head_dim=256, max_tokens=2**31 - 1)

    def unavailable_reason(self) -> str | None:
        if importlib.util.find_spec("triton") is None:
            return "triton is not installed"
        if torch.version.cuda is None and torch.version.hip is None and not _interpreting():
            return f"torch {torch.__version__} is built without CUDA (CPU tensors run under TRITON_INTERPRET=1)"
        return None

    def special_reasons(self, inp: AttentionInputs) -> list[str]:
        if inp.q.device.type != "cpu":
            return []
        if not _interpreting():
            return ["CPU tensors run only under Triton's interpreter (set TRITON_INTERPRET=1)"]
        if importlib.util.find_spec("numpy") is None:
            return ["Triton's interpreter needs numpy, which is not installed"]
        return []

    def forward(self, inp: AttentionInputs) -> tuple[torch.Tensor, torch.Tensor]:
        return forward(inp)

    def backward(
        self, inp: AttentionInputs, out: torch.Tensor, lse: torch.Tensor, dout: torch.Tensor, dlse: torch.Tensor | None
    ) -> Grads:
        return backward(inp, out, lse, dout, dlse)


BACKEND = Triton()
