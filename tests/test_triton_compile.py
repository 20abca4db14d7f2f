"""The ``triton`` backend's kernels compiled ahead of time for real GPUs, with no GPU: every config the
wrapper launches must compile for sm80, sm86, sm89 and sm90 (by default sm86 stands for sm89, see below),
fit the target's shared memory per block, and for fp16/bf16 spill at most :data:`MAX_SPILL_BYTES` per
thread (fp32 and fp64 may spill: the tile lists in ``packattn.backends.triton`` say why); and the wrapper's
own bound of each launch's shared memory (``shared_bytes``, which picks the tiles on any GPU) must be at
least what Triton allocates.

Each case runs the wrapper's own ``forward`` and ``backward`` on meta tensors with the launch replaced by
a recorder, so what is compiled is what would be launched: the same ``launch_config()``, arguments and
Triton's own argument specialization (``JITFunction.run`` without the driver), then ``triton.compile``
for the target. Registers and spills come from ``ptxas -v``: ``local`` is the stack frame, the local
memory per thread (what the driver reports, and Triton's ``n_spills`` is in 4-byte words of it);
``spill`` the bytes of spill stores. Run with ``-s`` for the table; ``PACKATTN_FULL_COMPILE_CHECK=1``
compiles every pair of padded head dims, every mask switch and every target instead of the representative
matrix. That matrix leaves out sm89, which has sm86's shared memory and so its tiles, and keeps bf16 at one
head dim only: compiled for all four targets with bf16 at every head dim of the matrix, sm89 gave sm86's
tiles, registers, spills and shared memory in every case, and bf16 gave fp16's.
Compiles run in worker processes (Triton's interpreter is on in this session), cached under pytest's tmp.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.util
import io
import itertools
import multiprocessing
import os
import re
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from packattn.backends import triton as tri
from packattn.inputs import AttentionInputs, MaskSpec
from packattn.layout import SeqLayout

MAX_SPILL_BYTES = 320  # "a few hundred": the most now is 188, fp16 dK/dV at head dim 128 with softcap on sm80
DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32, "fp64": torch.float64}
FULL = os.environ.get("PACKATTN_FULL_COMPILE_CHECK", "") == "1"


def _cuda_backend_missing() -> str | None:
    # Looked up without importing triton: a worker process imports this module before its initializer
    # runs, and a Triton imported with the interpreter on (this session's setting) cannot compile.
    spec = importlib.util.find_spec("triton")
    if spec is None or spec.origin is None:
        return "triton is not installed"
    if not (Path(spec.origin).parent / "backends" / "nvidia" / "compiler.py").exists():
        return "this Triton has no CUDA backend (triton.backends.nvidia)"
    return None


pytestmark = pytest.mark.skipif(_cuda_backend_missing() is not None, reason=str(_cuda_backend_missing()))


@dataclass(frozen=True)
class Case:
    dtype: str
    d: int
    dv: int
    softcap: bool = False
    left: bool = False
    right: bool = False

    @property
    def id(self) -> str:
        flags = (("-softcap", self.softcap), ("-left", self.left), ("-right", self.right))
        switches = "".join(s for s, on in flags if on)
        return f"{self.dtype}-d{self.d}-dv{self.dv}{switches}"


def _cases() -> list[Case]:
    if FULL:
        dims = [16, 32, 64, 128, 256]
        pairs = [*itertools.product(dims, dims), (72, 72), (200, 200)]  # and head dims no multiple of 16
        switches = [s for s in itertools.product((False, True), repeat=3) if any(s)]
        return [
            *(Case(dt, d, dv) for dt in DTYPES for d, dv in pairs),
            *(Case(dt, 128, 128, *s) for dt in DTYPES for s in switches),
        ]
    return [
        *(Case(dt, d, dv) for dt in DTYPES if dt != "bf16" for d, dv in ((64, 64), (128, 128), (256, 256), (64, 128))),
        Case("bf16", 128, 128),
        Case("fp16", 128, 128, softcap=True, left=True, right=True),
    ]


CASES = _cases()
NAMES = [name for name in tri.TARGETS if FULL or name != "sm89"]


def _inputs(case: Case) -> AttentionInputs:
    """Meta tensors shaped like a contiguous GQA batch (8 query heads over 2 KV heads) of 1024 tokens, with
    gradients asked for."""
    tokens, hq, hkv = 1024, 8, 2
    dtype = DTYPES[case.dtype]
    q = torch.empty(tokens, hq, case.d, dtype=dtype, device="meta")
    k = torch.empty(tokens, hkv, case.d, dtype=dtype, device="meta")
    v = torch.empty(tokens, hkv, case.dv, dtype=dtype, device="meta")
    cu = torch.tensor([0, tokens], dtype=torch.int32)
    mask = MaskSpec(case.d**-0.5, 255 if case.left else -1, 0 if case.right else -1, 30.0 if case.softcap else 0.0)
    layout = SeqLayout.build(cu, cu, tokens, tokens)
    return AttentionInputs(q, k, v, layout, mask, return_lse=True, grad=True)


def _worker_setup(cache: str) -> None:
    os.environ["TRITON_INTERPRET"] = "0"  # compiled kernels: tri._kernels() is first called in this process
    os.environ["TRITON_CACHE_DIR"] = cache
    os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # Triton 3.9's default, without its warning


def _compile(launch: tri.Launch, args: tuple[object, ...], arch: int) -> dict[str, object]:
    """``launch`` compiled for ``sm_<arch>`` as ``JITFunction.run`` would on such a GPU."""
    import triton
    from triton import knobs
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, make_backend
    from triton.runtime.jit import create_function_from_signature

    fn = getattr(tri._kernels(), launch.kernel)
    target = GPUTarget("cuda", arch, 32)
    backend = make_backend(target)
    kwargs = {**launch.constexprs, **launch.options, "debug": fn.debug or knobs.runtime.debug}
    binder = create_function_from_signature(fn.signature, fn.params, backend)
    bound, specialization, options = binder(*args, **kwargs)
    options, signature, constexprs, attrs = fn._pack_args(backend, kwargs, bound, specialization, options)
    log = io.StringIO()
    knobs.nvidia.dump_ptxas_log = True
    with contextlib.redirect_stdout(log):
        kernel = triton.compile(ASTSource(fn, signature, constexprs, attrs), target=target, options=options.__dict__)
    text = log.getvalue()
    regs = re.search(r"Used (\d+) registers", text)
    frame = re.search(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads", text)
    assert regs and frame, text
    return {
        "shared": kernel.metadata.shared,
        "regs": int(regs.group(1)),
        "local": int(frame.group(1)),
        "spill": int(frame.group(2)),
    }


Recorded = list[tuple[tri.Launch, tuple[object, ...]]]


def _record(name: str, case: Case) -> tuple[AttentionInputs, Recorded]:
    """Make this process compile for target ``name`` and record the wrapper's launches instead of running."""
    recorded: Recorded = []
    target = tri.TARGETS[name]
    tri._target = lambda device: target  # type: ignore[assignment]
    tri._launch = lambda launch, grid, *args: recorded.append((launch, args))  # type: ignore[assignment]
    return _inputs(case), recorded


def compile_case(job: tuple[str, Case]) -> dict[str, dict[str, object]]:
    """The three launches of ``case`` compiled for target ``name``: ``{stage: measurements or error}``, or
    ``{"declined": {"reason": ...}}`` where the backend declines the case on that target."""
    name, case = job
    inp, recorded = _record(name, case)
    declined = tri.tile_reasons(inp, tri.TARGETS[name])
    if declined:
        return {"declined": {"reason": "; ".join(declined)}}
    out, lse = tri.forward(inp)
    tri.backward(inp, out, lse, torch.empty_like(out), None)
    arch = tri.TARGETS[name].capability
    return {ln.kernel.removesuffix("_kernel"): compile_launch(ln, args, arch, case) for ln, args in recorded}


def compile_launch(launch: tri.Launch, args: tuple[object, ...], arch: int, case: Case) -> dict[str, object]:
    """Measurements of one launch compiled for ``sm_<arch>`` with the wrapper's bound of its shared memory,
    or the compile error."""
    cfg = launch.blocks
    stage = launch.kernel.removesuffix("_kernel")
    row: dict[str, object] = {
        "blocks": f"{cfg.m}x{cfg.n} w{cfg.warps} s{cfg.stages}",
        "bound": tri.shared_bytes(stage, cfg, DTYPES[case.dtype], case.d, case.dv),
    }
    try:
        row.update(_compile(launch, args, arch))
    except Exception as e:  # reported by the test of this config
        row["error"] = f"{type(e).__name__}: {e}"[:2000]
    return row


def compile_planted(name: str) -> dict[str, object]:
    """The fp16 forward at head dim 256 with 128 x 128 tiles in three stages, compiled for ``name``."""
    case = Case("fp16", 256, 256)
    inp, recorded = _record(name, case)
    tri.forward(inp)
    launch, args = recorded[0]
    constexprs = {**launch.constexprs, "BLOCK_M": 128, "BLOCK_N": 128}
    launch = dataclasses.replace(launch, blocks=tri.Blocks(128, 128, 8, 3), constexprs=constexprs)
    return compile_launch(launch, args, tri.TARGETS[name].capability, case)


def problems(name: str, dtype: str, r: dict[str, object]) -> list[str]:
    """Why a compiled launch would fail or crawl on target ``name``: a compile error, more shared memory than
    the GPU has or than the wrapper's bound, heavy register spills for 16-bit inputs."""
    if "error" in r:
        return [str(r["error"])]
    found = []
    shared, limit, bound = int(r["shared"]), tri.TARGETS[name].shared, int(r["bound"])  # type: ignore[call-overload]
    if shared > limit:
        found.append(f"{r['blocks']}: {shared} bytes of shared memory, {name} has {limit}")
    if shared > bound:
        found.append(f"{r['blocks']}: {shared} bytes of shared memory, over shared_bytes() = {bound}")
    spill = max(int(r["local"]), int(r["spill"]))  # type: ignore[call-overload]
    if dtype in ("fp16", "bf16") and spill > MAX_SPILL_BYTES:
        found.append(f"{r['blocks']}: spills {spill} bytes per thread")
    return found


def _pool(cache: str, workers: int) -> ProcessPoolExecutor:
    context = multiprocessing.get_context("spawn")
    return ProcessPoolExecutor(workers, mp_context=context, initializer=_worker_setup, initargs=(cache,))


@pytest.fixture(scope="module")
def compiled(tmp_path_factory: pytest.TempPathFactory) -> dict[tuple[str, str], dict[str, dict[str, object]]]:
    jobs = [(name, case) for name in NAMES for case in CASES]
    with _pool(str(tmp_path_factory.mktemp("triton-cache")), max(1, min(len(jobs), os.cpu_count() or 1))) as pool:
        results = dict(zip(((n, c.id) for n, c in jobs), pool.map(compile_case, jobs)))
    print(f"\n{'target':6} {'stage':7} {'case':28} {'blocks':14} {'shared':>7} {'bound':>7} {'regs':>4} {'spill':>5}")
    for (name, case_id), stages in results.items():
        for stage, r in stages.items():
            if "reason" in r:
                print(f"{name:6} {'-':7} {case_id:28} declined: {r['reason']}")
            elif "error" in r:
                print(f"{name:6} {stage:7} {case_id:28} {r['blocks']:14} error")
            else:
                spill = max(r["local"], r["spill"])  # type: ignore[call-overload]
                print(
                    f"{name:6} {stage:7} {case_id:28} {r['blocks']:14}"
                    f" {r['shared']:7} {r['bound']:7} {r['regs']:4} {spill:5}"
                )
    return results


@pytest.mark.parametrize("stage", tri.STAGES)
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
@pytest.mark.parametrize("name", NAMES)
def test_config_compiles_and_fits(compiled, name, case, stage):
    stages = compiled[name, case.id]
    if "declined" in stages:
        # Only fp64 above head dim 128, where no tile fits (sm90 takes it), goes to another backend.
        assert case.dtype == "fp64" and max(case.d, case.dv) > 128 and name != "sm90", stages
        assert "shared memory" in str(stages["declined"]["reason"])
        return
    assert problems(name, case.dtype, stages[stage]) == []


def test_the_check_catches_an_oversized_tile(tmp_path):
    """A planted tile too big for sm86 fails the same check, so that a passing check means something."""
    with _pool(str(tmp_path), 1) as pool:
        r = pool.submit(compile_planted, "sm86").result()
    assert any("sm86 has" in p for p in problems("sm86", "fp16", r)), r
