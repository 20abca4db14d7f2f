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
import functools
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
class Target:
    """What the tile choice needs to know of a GPU."""

    capability: int  # major * 10 + minor: 86 for sm86
    shared: int  # bytes of shared memory one block may use (the opt-in maximum)


# The GPUs the compile check (tests/test_triton_compile.py) builds every launchable config for.
TARGETS = {
    "sm80": Target(80, 163 * 1024),  # A100, A30
    "sm86": Target(86, 99 * 1024),  # A10, A40, RTX 3090
    "sm89": Target(89, 99 * 1024),  # L4, L40, RTX 4090
    "sm90": Target(90, 227 * 1024),  # H100, H200
}
STAGES = ("forward", "dkdv", "dq")


@dataclass(frozen=True)
class Blocks:
    """Tile sizes (powers of two >= 16) and launch options of one kernel."""

    m: int  # query rows per tile
    n: int  # keys per tile
    warps: int = 4
    stages: int = 2


def blocks(stage: str, dtype: torch.dtype, head_dim: int, head_dim_v: int, target: Target | None) -> Blocks:
    """Tiles and launch options of ``stage`` ("forward", "dkdv" or "dq") on ``target`` (None: Triton's
    interpreter, which gets :data:`INTERPRETER_BLOCKS`)."""
    if target is None:
        return Blocks(*INTERPRETER_BLOCKS)
    head_dim = max(head_dim, head_dim_v)
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


@dataclass(frozen=True)
class Launch:
    """Everything one launch compiles for: the kernel (a name in ``kernels.py``), its tiles and launch
    options, and its compile-time arguments."""

    kernel: str
    blocks: Blocks
    constexprs: dict[str, object]

    @property
    def options(self) -> dict[str, int]:
        return {"num_warps": self.blocks.warps, "num_stages": self.blocks.stages}


def launch_config(
    stage: str,
    dtype: torch.dtype,
    head_dim: int,
    head_dim_v: int,
    *,
    softcap: bool,
    has_left: bool,
    has_right: bool,
    target: Target | None,
) -> Launch:
    """The launch of ``stage`` for these inputs on ``target`` (None: Triton's interpreter): what the
    wrapper launches and what the compile check builds."""
    import triton
    import triton.language as tl

    cfg = blocks(stage, dtype, head_dim, head_dim_v, target)
    dot = {torch.float16: tl.float16, torch.bfloat16: tl.bfloat16, torch.float32: tl.float32}.get(dtype, tl.float64)
    if dtype == torch.bfloat16 and target is None:
        dot = tl.float32  # the interpreter's dot reads bf16 storage as integers
    constexprs: dict[str, object] = {
        "SOFTCAP": softcap,
        "HAS_LEFT": has_left,
        "HAS_RIGHT": has_right,
        "BLOCK_M": cfg.m,
        "BLOCK_N": cfg.n,
        "BLOCK_D": max(16, triton.next_power_of_2(head_dim)),
        "BLOCK_DV": max(16, triton.next_power_of_2(head_dim_v)),
        "ACC": tl.float64 if dtype == torch.float64 else tl.float32,
        "DOT": dot,
        "PRECISION": "ieee" if dtype in (torch.float32, torch.float64) else "tf32",
    }
    return Launch(f"{stage}_kernel", cfg, constexprs)


@functools.cache
def _device_target(index: int) -> Target:
    props = torch.cuda.get_device_properties(index)
    capability = props.major * 10 + props.minor
    # Older torch lacks the opt-in maximum: the static 48 KB per block is what a launch can surely use.
    shared = getattr(props, "shared_memory_per_block_optin", 0) or getattr(props, "shared_memory_per_block", 48 * 1024)
    return Target(capability, int(shared))


def _target(device: torch.device) -> Target | None:
    """The GPU of ``device`` (None under Triton's interpreter)."""
    if _interpreting():
        return None
    return _device_target(torch.cuda.current_device() if device.index is None else device.index)


def _launch_config(stage: str, inp: AttentionInputs) -> Launch:
    mask = inp.mask
    switches = {"softcap": mask.softcap > 0, "has_left": mask.left >= 0, "has_right": mask.right >= 0}
    return launch_config(stage, inp.q.dtype, inp.head_dim, inp.head_dim_v, **switches, target=_target(inp.q.device))


def _launch(launch: Launch, grid: tuple[int, int], *args: object) -> None:
    getattr(_kernels(), launch.kernel)[grid](*args, **launch.constexprs, **launch.options)


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


def _bounds(inp: AttentionInputs) -> tuple[int, ...]:
    """The kernels' last runtime arguments: mask bounds, query heads per KV head and head dims."""
    return inp.mask.left, inp.mask.right, inp.heads_q // inp.heads_kv, inp.head_dim, inp.head_dim_v


def forward(inp: AttentionInputs) -> tuple[torch.Tensor, torch.Tensor]:
    """``out (Tq, Hq, Dv)`` in q's dtype and ``lse (Hq, Tq)`` (float32; float64 for float64 inputs)."""
    q, k, v = inp.q.detach(), inp.k.detach(), inp.v.detach()
    tq, hq = q.shape[:2]
    out = torch.empty(tq, hq, v.shape[2], dtype=q.dtype, device=q.device)
    lse = torch.empty(hq, tq, dtype=compute_dtype(q.dtype), device=q.device)
    if out.numel() == 0:
        return out, lse
    launch = _launch_config("forward", inp)
    table = _table(inp, launch.blocks.m, by_keys=False)
    strides = (*q.stride(), *k.stride(), *v.stride(), *out.stride(), lse.stride(0))
    with _on_device(q.device):
        _launch(launch, ((table.numel() - 4) // 5, hq), q, k, v, out, lse, table, *strides, *_bounds(inp))
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
    common = (*q.stride(), *k.stride(), *v.stride(), *dout.stride(), lse.stride(0))
    with _on_device(q.device):
        launch = _launch_config("dkdv", inp)
        table = _table(inp, launch.blocks.n, by_keys=True)
        _launch(
            launch, ((table.numel() - 4) // 5, inp.heads_kv),
            q, k, v, dout, lse, delta, dk, dv, table, *common, *dk.stride(), *dv.stride(), *_bounds(inp),
        )  # fmt: skip
        launch = _launch_config("dq", inp)
        table = _table(inp, launch.blocks.m, by_keys=False)
        _launch(
            launch, ((table.numel() - 4) // 5, inp.heads_q),
            q, k, v, dout, lse, delta, dq, table, *common, *dq.stride(), *_bounds(inp),
        )  # fmt: skip
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
