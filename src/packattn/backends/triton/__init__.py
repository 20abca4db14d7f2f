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


# Tiles to try, best first, by stage, dtype family and padded head dim (the larger of D and Dv): the first
# whose shared memory (shared_bytes) fits the GPU is launched. The lists were chosen by compiling them for
# sm80/86/89/90 (tests/test_triton_compile.py): 16-bit inputs get large tiles with at most a few hundred
# bytes of register spills per thread. fp32 and fp64 keep small tiles, and their dQ/dK/dV may still spill
# at head dims above 64: the fp32/fp64 accumulators of a dQ or dK/dV tile exceed the register file.
_16BIT = {
    ("forward", 64): [(128, 64, 4, 3), (64, 64, 4, 2), (64, 32, 4, 2), (32, 32, 4, 1)],
    ("forward", 128): [(128, 64, 8, 3), (128, 64, 8, 2), (64, 64, 4, 2), (64, 32, 4, 2), (32, 32, 4, 1)],
    ("forward", 256): [(128, 64, 8, 2), (64, 64, 4, 2), (64, 32, 4, 2), (32, 32, 4, 1)],
    ("dkdv", 64): [(64, 64, 8, 2), (32, 32, 4, 2), (16, 16, 4, 1)],
    ("dkdv", 128): [(64, 32, 4, 2), (32, 32, 4, 2), (16, 16, 4, 1)],
    ("dkdv", 256): [(32, 32, 8, 2), (16, 16, 4, 1)],
    ("dq", 64): [(64, 64, 8, 2), (32, 32, 4, 2), (16, 16, 4, 1)],
    ("dq", 128): [(64, 64, 8, 2), (32, 64, 4, 2), (32, 32, 4, 2), (16, 16, 4, 1)],
    ("dq", 256): [(64, 64, 8, 2), (32, 32, 4, 2), (16, 16, 4, 1)],
}
_FP32 = {
    "forward": [(32, 32, 4, 2), (32, 32, 4, 1), (16, 32, 4, 1), (16, 16, 4, 1)],
    "dkdv": [(32, 16, 4, 1), (16, 16, 4, 1)],
    "dq": [(32, 32, 4, 2), (16, 16, 4, 1)],
}
_FP64 = {
    "forward": [(32, 32, 4, 2), (32, 32, 4, 1), (16, 32, 4, 1), (16, 16, 4, 1)],
    "dkdv": [(16, 16, 4, 1)],
    "dq": [(32, 32, 4, 2), (16, 16, 4, 1)],
}


def padded(head_dim: int) -> int:
    """A head dim as the kernels hold it: the next power of two, at least 16."""
    return max(16, 1 << (head_dim - 1).bit_length())


def shared_bytes(stage: str, blocks: Blocks, dtype: torch.dtype, head_dim: int, head_dim_v: int) -> int:
    """An upper bound of the shared memory one program of ``stage`` uses: its pipelined K/V (forward, dQ) or
    Q/dO (dK/dV) tiles, the tiles it keeps, a tile of scores, and per-row statistics. (Checked against
    what Triton allocates for every config the compile check builds.)"""
    m, n, st = blocks.m, blocks.n, blocks.stages
    both = padded(head_dim) + padded(head_dim_v)
    size = dtype.itemsize
    if stage == "forward":
        tiles = st * n * both + m * padded(head_dim) + m * n
    elif stage == "dq":
        tiles = m * both + st * n * both + m * n
    else:  # dK/dV stage Q and dO double-buffered even with one stage
        tiles = n * both + max(st, 2) * m * both + m * n
    return tiles * size + 8 * m


def candidates(stage: str, dtype: torch.dtype, head_dim: int, head_dim_v: int) -> list[Blocks]:
    """The tiles :func:`blocks` tries for these inputs, best first."""
    if dtype in (torch.float32, torch.float64):
        table = (_FP32 if dtype == torch.float32 else _FP64)[stage]
    else:
        table = _16BIT[stage, min(256, max(64, padded(max(head_dim, head_dim_v))))]
    return [Blocks(*c) for c in table]


@functools.cache  # asked by dispatch (tile_reasons) and again by the launch, on every call
def blocks(stage: str, dtype: torch.dtype, head_dim: int, head_dim_v: int, target: Target | None) -> Blocks | None:
    """Tiles and launch options of ``stage`` ("forward", "dkdv" or "dq") on ``target``: the first candidate
    whose shared memory fits it, None when none does. ``target`` None is Triton's interpreter, which gets
    :data:`INTERPRETER_BLOCKS`."""
    if target is None:
        return Blocks(*INTERPRETER_BLOCKS)
    for cfg in candidates(stage, dtype, head_dim, head_dim_v):
        if shared_bytes(stage, cfg, dtype, head_dim, head_dim_v) <= target.shared:
            return cfg
    return None


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
    import triton.language as tl

    cfg = blocks(stage, dtype, head_dim, head_dim_v, target)
    if cfg is None:  # Triton.special_reasons declines these inputs first
        assert target is not None
        raise ValueError(f"triton: no {stage} tiles fit the GPU's {target.shared // 1024} KB of shared memory")
    dot = {torch.float16: tl.float16, torch.bfloat16: tl.bfloat16, torch.float32: tl.float32}.get(dtype, tl.float64)
    if dtype == torch.bfloat16 and target is None:
        dot = tl.float32  # the interpreter's dot reads bf16 storage as integers
    constexprs: dict[str, object] = {
        "SOFTCAP": softcap,
        "HAS_LEFT": has_left,
        "HAS_RIGHT": has_right,
        "BLOCK_M": cfg.m,
        "BLOCK_N": cfg.n,
        "BLOCK_D": padded(head_dim),
        "BLOCK_DV": padded(head_dim_v),
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


def tile_reasons(inp: AttentionInputs, target: Target | None) -> list[str]:
    """Why these inputs cannot run on ``target``: the stages they need (the backward's with gradients) for
    which no tile fits its shared memory."""
    stages = STAGES if inp.grad else STAGES[:1]
    short = [s for s in stages if blocks(s, inp.q.dtype, inp.head_dim, inp.head_dim_v, target) is None]
    if not short or target is None:
        return []
    dims = f"({inp.head_dim}, {inp.head_dim_v})"
    kb = target.shared // 1024
    return [f"no {'/'.join(short)} tiles for {inp.q.dtype} at head dims {dims} fit this GPU's {kb} KB of shared memory"]


def _launch_config(stage: str, inp: AttentionInputs) -> Launch:
    mask = inp.mask
    switches = {"softcap": mask.softcap > 0, "has_left": mask.left >= 0, "has_right": mask.right >= 0}
    return launch_config(stage, inp.q.dtype, inp.head_dim, inp.head_dim_v, **switches, target=_target(inp.q.device))


def _launch(launch: Launch, grid: tuple[int, int], *args: object) -> None:
    getattr(_kernels(), launch.kernel)[grid](*args, **launch.constexprs, **launch.options)


def _table(inp: AttentionInputs, block: int, *, by_keys: bool) -> torch.Tensor:
    """The kernels' work table on q's device: ``scale, softcap`` as two float64, then one int32 row
    ``(q_start, Lq, k_start, Lk, block_start)`` per query (or key) block, the longest work first. Built
    once per layout, mask, block and device: a model's other layers reuse it (no host loop, no copy)."""
    mask = inp.mask

    def build() -> torch.Tensor:
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

    return inp.layout.plan(("triton table", mask, block, by_keys, inp.q.device), build)


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
    # Query heads run along the launch grid's second axis, at most 65535 on CUDA.
    capabilities = Capabilities(devices=("cuda", "cpu"), max_head_dim=256, max_heads_q=65535, max_tokens=2**31 - 1)

    def unavailable_reason(self) -> str | None:
        if importlib.util.find_spec("triton") is None:
            return "triton is not installed"
        if torch.version.cuda is None and torch.version.hip is None and not _interpreting():
            return f"torch {torch.__version__} is built without CUDA (CPU tensors run under TRITON_INTERPRET=1)"
        return None

    def special_reasons(self, inp: AttentionInputs) -> list[str]:
        if inp.q.device.type == "cuda" and not _interpreting():
            return tile_reasons(inp, _target(inp.q.device))
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
