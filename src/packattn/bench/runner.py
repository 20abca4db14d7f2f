"""``packattn bench``: time packattn and its peers in one run, after checking each against the oracle."""

from __future__ import annotations

import json
import os
import platform
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field

import torch

from ..testing import assert_close_to_oracle, attention_naive
from .peers import IMPLEMENTATIONS, Run, Unsupported
from .workloads import Workload, workloads

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass
class Row:
    workload: str
    dtype: str
    impl: str
    status: str = "ok"  # "ok", "skipped: why", "WRONG: why" or "FAILED: why" (it raised)
    backend: str | None = None  # the packattn backend that ran (dispatch's choice for "packattn")
    max_error: float | None = None
    allowed_error: float | None = None
    median_ms: float | None = None
    gflops: float | None = None
    vs_best_peer: float | None = None
    vs_mm_ceiling: float | None = None
    peak_extra_mib: float | None = None
    setup: dict = field(default_factory=dict)


SLOW_S = 5.0  # an implementation whose first run is slower than this is timed by one more run alone
BACKWARD_FLOPS = 3.5  # forward + backward = 2 + 5 matmuls of the forward's 2 (flash-attention's convention)


def synchronize(device: str) -> None:
    """Wait for the device's queued work (timings on an accelerator would otherwise measure launches)."""
    if device != "cpu":
        getattr(torch, device).synchronize()


def median_times(fns: list, min_time: float, max_reps: int = 25, device: str = "cpu") -> list[float]:
    """Median seconds of each of ``fns``, run in turns (one run of each per round) for at least 3 rounds and
    ``min_time`` seconds per function, at most ``max_reps`` rounds. On a shared machine, other work slows
    whatever runs at that moment: in turns it reaches every function alike, so their ratios hold."""
    times: list[list[float]] = [[] for _ in fns]
    start = time.perf_counter()
    rounds = 0
    while rounds < 3 or (time.perf_counter() - start < min_time * len(fns) and rounds < max_reps):
        for fn, ts in zip(fns, times, strict=True):
            t0 = time.perf_counter()
            fn()
            synchronize(device)
            ts.append(time.perf_counter() - t0)
        rounds += 1
    return [statistics.median(ts) for ts in times]


def median_time(fn, min_time: float, max_reps: int = 25, device: str = "cpu") -> float:
    """Median seconds of ``fn`` (:func:`median_times`) after a warm-up run; a warm-up slower than ``SLOW_S``
    is the time itself."""
    t0 = time.perf_counter()
    fn()
    synchronize(device)
    if time.perf_counter() - t0 > SLOW_S:
        return time.perf_counter() - t0
    return median_times([fn], min_time, max_reps, device)[0]


def mm_ceiling(min_time: float, dtype: torch.dtype = torch.float32, device: str = "cpu") -> float:
    """GFLOP/s of a 2048^3 ``torch.mm`` in ``dtype`` on ``device`` in this process, now."""
    a, b = (torch.randn(2048, 2048).to(device, dtype) for _ in range(2))
    return 2 * 2048**3 / median_time(lambda: a @ b, min_time, device=device) / 1e9


def peak_extra_mib(fn, out_bytes: int, device: str = "cpu") -> float | None:
    """Peak bytes the call allocates beyond its output: the profiler's allocation events on CPU, the caching
    allocator's peak on CUDA (``None`` elsewhere)."""
    if device == "cuda":
        synchronize(device)
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        fn()
        synchronize(device)
        return max(0, torch.cuda.max_memory_allocated() - base - out_bytes) / 2**20
    if device != "cpu":
        return None
    from torch.profiler import ProfilerActivity, profile

    # The profiler's C++ side logs its start and stop on stderr: keep that out of the progress output.
    sys.stderr.flush()
    saved = os.dup(2)
    try:
        with open(os.devnull, "w") as devnull:
            os.dup2(devnull.fileno(), 2)
            with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
                fn()
    finally:
        os.dup2(saved, 2)
        os.close(saved)
    # Replay the allocator's own timeline (allocations > 0, frees < 0). Per-op memory columns would not do:
    # an op implemented in Python (packattn's custom ops) is charged the frees of the ops it calls.
    records = [e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"]
    current = peak = 0
    for e in sorted(records, key=lambda e: e.start_ns()):
        if e.device_type() == torch.autograd.DeviceType.CPU:
            current += e.nbytes()
            peak = max(peak, current)
    return max(0, peak - out_bytes) / 2**20


def machine_busy(seconds: float = 0.5) -> float:
    """Fraction of all CPU time spent busy by anything while this process sleeps (Linux only)."""

    def sample() -> tuple[int, int]:
        with open("/proc/stat") as f:
            vals = [int(x) for x in f.readline().split()[1:]]
        idle = vals[3] + vals[4]
        return sum(vals) - idle, sum(vals)

    try:
        b0, t0 = sample()
        time.sleep(seconds)
        b1, t1 = sample()
    except OSError:
        return 0.0
    return (b1 - b0) / max(1, t1 - t0)


def sampled_rows(wl: Workload, per_seq: int = 6) -> list[int]:
    """Query rows the oracle checks: evenly spaced ones of every sequence (its first and last included), both
    sides of every 64-row boundary of the longest ones (where kernels change tiles), and random ones."""
    gen = torch.Generator().manual_seed(0)
    rows = []
    for start, lq in zip(wl.cu_q, wl.lens_q):
        picks = {0, lq - 1} | {round(i * (lq - 1) / max(1, per_seq - 1)) for i in range(per_seq)}
        if lq > 64:
            edges = range(64, lq, 64 * max(1, lq // (64 * 8)))  # at most about 8 boundaries a sequence
            picks |= {e + d for e in edges for d in (-1, 0)}
            picks |= set(torch.randint(0, lq, (per_seq,), generator=gen).tolist())
        rows += [start + i for i in sorted(picks) if 0 <= i < lq]
    return rows


def oracle_on_rows(wl: Workload, q, k, v, rows: list[int]):
    """Float64 oracle and plain PyTorch (in q's dtype) for a sample of query rows of every sequence.

    Each sampled row becomes a one-query sequence whose keys are those it may see, so the naive oracle
    never builds full score matrices."""
    sel_q, cu_q, cu_k, key_rows = [], [0], [0], []
    for b, (qs, lq, ks, lk) in enumerate(zip(wl.cu_q, wl.lens_q, wl.cu_k, wl.lens_k)):
        for r in rows:
            if qs <= r < qs + lq:
                i = r - qs
                hi = wl.mask.key_range(i, i + 1, lq, lk)[1]
                sel_q.append(r)
                key_rows.append(torch.arange(ks, ks + hi))
                cu_q.append(cu_q[-1] + 1)
                cu_k.append(cu_k[-1] + hi)
        del b
    kidx = torch.cat(key_rows).to(k.device)
    args = (q[sel_q], k[kidx], v[kidx], cu_q, cu_k)
    ref, _ = attention_naive(*args, dtype=torch.float64)
    plain, _ = attention_naive(*args)
    return ref, plain


def _fmt(x: float | None, spec: str) -> str:
    return "-" if x is None else format(x, spec)


def print_table(rows: list[Row], ceilings: dict[str, float]) -> None:
    print(
        "max err: the largest difference from the float64 oracle on the checked rows (allowed: twice plain "
        "PyTorch's in the same dtype); vs best peer: the fastest peer's time / this row's (> 1: faster); vs mm: "
        "this row's GFLOP/s / the fastest torch.mm of fp32 and its dtype; extra MiB: peak memory beyond the output"
    )
    head = f"{'workload':<9}{'dtype':<6}{'impl':<20}{'max err':>9}{'ms':>10}{'GFLOP/s':>9}{'vs best peer':>13}"
    head += f"{'vs mm':>7}{'extra MiB':>10}  note"
    print(head)
    print("-" * len(head))
    for r in rows:
        notes = [] if r.status == "ok" else [r.status]
        notes += [f"backend={r.backend}"] if r.backend and r.impl == "packattn" else []
        notes += [f"{k}={v:.1f}" for k, v in r.setup.items()]
        note = "; ".join(notes)
        print(
            f"{r.workload:<9}{r.dtype:<6}{r.impl:<20}{_fmt(r.max_error, '.1e'):>9}{_fmt(r.median_ms, '.1f'):>10}"
            f"{_fmt(r.gflops, '.1f'):>9}{_fmt(r.vs_best_peer, '.2f'):>13}{_fmt(r.vs_mm_ceiling, '.2f'):>7}"
            f"{_fmt(r.peak_extra_mib, '.0f'):>10}  {note}"
        )
    print("torch.mm ceilings in this run: " + ", ".join(f"{dt} {g:.1f} GFLOP/s" for dt, g in ceilings.items()))


class Progress:
    def __init__(self, total: int) -> None:
        self.total, self.done = total, 0
        self.tty = sys.stderr.isatty()

    def step(self, label: str) -> None:
        self.done += 1
        width = 30
        filled = width * self.done // self.total
        line = f"[{'#' * filled}{'.' * (width - filled)}] {self.done}/{self.total} {label}"
        if self.tty:
            sys.stderr.write("\r" + line[:100].ljust(100))
            if self.done == self.total:
                sys.stderr.write("\n")
        else:
            sys.stderr.write(line + "\n")
        sys.stderr.flush()


def check_gradients(wl: Workload, dtype: str, impl: str, device: str) -> None:
    """Gradients of q, k, v against the float64 oracle's, on a copy of ``wl`` small enough for the oracle."""
    small = wl.capped(128)
    leaves = [t.requires_grad_() for t in small.tensors(DTYPES[dtype], seed=1, device=device)]
    run, _ = IMPLEMENTATIONS[impl][0](small, *leaves)
    dout = torch.randn(leaves[0].shape[0], wl.heads_q, wl.head_dim, generator=torch.Generator().manual_seed(2))
    got = torch.autograd.grad(run(), leaves, dout.to(device, DTYPES[dtype]), allow_unused=True)
    got = tuple(torch.zeros_like(x) if g is None else g for g, x in zip(got, leaves, strict=True))

    def grads(dt: torch.dtype) -> tuple[torch.Tensor, ...]:
        xs = [t.detach().to(dt).requires_grad_() for t in leaves]
        out, _ = attention_naive(xs[0], xs[1], xs[2], small.cu_q, small.cu_k, causal=wl.causal)
        return torch.autograd.grad(out, xs, dout.to(device, dt))

    for name, g, ref, plain in zip("qkv", got, grads(torch.float64), grads(DTYPES[dtype]), strict=True):
        assert_close_to_oracle(g, ref, plain, name=f"{impl} d{name}")


def _failed(e: Exception) -> str:
    return f"FAILED: {type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"


def check_one(
    wl: Workload, dtype: str, impl: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, device: str, backward: bool
) -> tuple[Row, Run | None, float]:
    """Run one implementation once and check it against the oracle: its row, and the step to time (None when
    it was skipped or wrong) with the seconds of that first run."""
    row = Row(wl.name, dtype, impl)
    try:
        run, row.setup = IMPLEMENTATIONS[impl][0](wl, q, k, v)
    except Unsupported as e:
        row.status = f"skipped: {e}"
        return row, None, 0.0
    except Exception as e:
        row.status = _failed(e)
        return row, None, 0.0
    row.backend = row.setup.pop("backend", None)
    step: Run = run
    if backward:
        dout = torch.randn(q.shape[0], q.shape[1], v.shape[2], generator=torch.Generator().manual_seed(1))
        dout = dout.to(device, q.dtype)

        def step() -> torch.Tensor:
            out = run()
            torch.autograd.grad(out, (q, k, v), dout, allow_unused=True)
            return out

    t0 = time.perf_counter()
    try:
        out = step().detach()
    except Exception as e:  # one implementation's failure (out of memory, a bug) is its row, not the run's end
        row.status = _failed(e)
        return row, None, 0.0
    synchronize(device)
    first_s = time.perf_counter() - t0
    rows = sampled_rows(wl)
    ref, plain = oracle_on_rows(wl, q.detach(), k.detach(), v.detach(), rows)
    try:
        err = assert_close_to_oracle(out[rows], ref, plain, name=impl)
        row.max_error, row.allowed_error = err.actual, err.allowed
        if not bool(out.isfinite().all()):  # every row, beyond the checked ones: the inputs are finite
            raise AssertionError(f"{impl}: non-finite values outside the checked rows")
        if backward:
            check_gradients(wl, dtype, impl, device)
    except AssertionError as e:
        row.status = f"WRONG: {e}"
        return row, None, first_s
    except Exception as e:
        row.status = _failed(e)
        return row, None, first_s
    return row, step, first_s


def bench_group(
    wl: Workload,
    dtype: str,
    impls: list[str],
    min_time: float,
    ceiling: float,
    device: str = "cpu",
    backward: bool = False,
    progress: Progress | None = None,
) -> list[Row]:
    """Check each implementation on one workload against the oracle, then time the right ones in turns
    (forward, or forward and backward with ``backward``) on the same inputs. ``ceiling``: the GFLOP/s that
    each row's ``vs_mm_ceiling`` divides by."""
    q, k, v = (t.requires_grad_(backward) for t in wl.tensors(DTYPES[dtype], device=device))
    out_bytes = q.shape[0] * q.shape[1] * v.shape[2] * q.element_size()
    rows, timed = [], []
    for impl in impls:
        row, step, first_s = check_one(wl, dtype, impl, q, k, v, device, backward)
        rows.append(row)
        if step is not None and first_s > SLOW_S:
            # Spend no more minutes on a slow implementation than one more run: the first one (checked, and
            # paying first-touch costs) is not its time, the second, warm one is.
            t0 = time.perf_counter()
            step()
            synchronize(device)
            row.median_ms = (time.perf_counter() - t0) * 1e3
            row.status = f"timed once, warm ({row.median_ms / 1e3:.0f} s a run); memory not profiled"
        elif step is not None:
            timed.append((row, step))
        if progress:
            progress.step(f"{wl.name} {dtype} {impl}")
    for (row, _), sec in zip(timed, median_times([step for _, step in timed], min_time, device=device), strict=True):
        row.median_ms = sec * 1e3
    for row, step in timed:
        row.peak_extra_mib = peak_extra_mib(step, out_bytes, device)
    for row in rows:
        if row.median_ms:
            row.gflops = wl.flops() * (BACKWARD_FLOPS if backward else 1) / row.median_ms / 1e6
            row.vs_mm_ceiling = row.gflops / ceiling
    return rows


def bench_one(
    wl: Workload, dtype: str, impl: str, min_time: float, ceiling: float, device: str = "cpu", backward: bool = False
) -> Row:
    """:func:`bench_group` of one implementation."""
    return bench_group(wl, dtype, [impl], min_time, ceiling, device, backward)[0]


def run_suite(
    *,
    quick: bool,
    names: list[str] | None,
    dtypes: list[str],
    impls: list[str],
    min_time: float,
    device: str = "cpu",
    backward: bool = False,
) -> tuple[list[Row], dict]:
    chosen = [w for w in workloads(quick) if not names or w.name in names]
    busy = machine_busy()
    meta: dict[str, object] = {
        "torch": torch.__version__,
        "python": platform.python_version(),
        "packattn": _version("packattn"),
        "device": device,
        "cpu": _cpu_model(),
        "cpu_flags": _cpu_flags(),
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "cpu_kernel": _kernel_facts() if device == "cpu" else None,
        "min_time_s": min_time,
        "threads": torch.get_num_threads(),
        "quick": quick,
        "backward": backward,
        "busy_before": busy,
        "workloads": {w.name: f"{w.title}: {w.describe()}" for w in chosen},
    }
    print(
        f"packattn bench: torch {torch.__version__} on {device} (CPU capability "
        f"{meta['cpu_capability']}, {torch.get_num_threads()} threads), {'quick' if quick else 'full'} run, "
        f"{'forward + backward' if backward else 'forward'}"
    )
    if busy > 0.15:
        print(f"WARNING: other work keeps the CPUs {busy:.0%} busy; timings (and ratios) may be distorted")
    ceilings = {dt: mm_ceiling(min_time, DTYPES[dt], device) for dt in dict.fromkeys(["fp32", *dtypes])}
    meta["mm_ceiling_gflops"] = ceilings
    # A 16-bit kernel may compute in fp32 tiles: its ceiling is the faster of the two matmuls.
    best = {dt: max(ceilings["fp32"], ceilings[dt]) for dt in dtypes}
    for w in chosen:
        print(f"  {w.name} {w.title}: {w.describe()}")
    progress = Progress(len(chosen) * len(dtypes) * len(impls))
    rows: list[Row] = []
    for w in chosen:
        for dt in dtypes:
            group = bench_group(w, dt, impls, min_time, best[dt], device, backward, progress)
            peers = [r.median_ms for r in group if r.median_ms and IMPLEMENTATIONS[r.impl][1]]
            for r in group:
                if peers and r.median_ms:
                    r.vs_best_peer = min(peers) / r.median_ms
            rows += group
    busy_after = machine_busy()
    meta["busy_after"] = busy_after
    print_table(rows, ceilings)
    if busy_after > 0.15:
        print(f"WARNING: other work kept the CPUs {busy_after:.0%} busy at the end of the run")
    return rows, meta


def _version(package: str) -> str | None:
    from importlib import metadata

    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None


def _cpu_info(key: str) -> str | None:
    """A field of /proc/cpuinfo's first processor (Linux), else None."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.split(":")[0].strip() == key:
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return None


def _cpu_model() -> str:
    return _cpu_info("model name") or platform.processor() or platform.machine()


def _cpu_flags() -> list[str] | None:
    """The CPU's flags that decide the kernels' paths (AVX-512, bf16/fp16 dot products, AMX)."""
    flags = _cpu_info("flags")
    if flags is None:
        return None
    wanted = ("avx2", "fma", "avx512f", "avx512_bf16", "avx512_fp16", "avx512_vnni", "amx_bf16", "amx_fp16")
    return [f for f in flags.split() if f in wanted]


def _kernel_facts() -> str | None:
    from ..backends.cpu_kernel import BACKEND

    return BACKEND.details() if BACKEND.unavailable_reason() is None else BACKEND.unavailable_reason()


def write_json(path: str, rows: list[Row], meta: dict) -> None:
    with open(path, "w") as f:
        json.dump({"meta": meta, "rows": [asdict(r) for r in rows]}, f, indent=1)


def write_plot(path: str, rows: list[Row]) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise SystemExit("--plot needs matplotlib: pip install 'packattn[plot]'") from None
    dtypes = sorted({r.dtype for r in rows})
    impls = list(dict.fromkeys(r.impl for r in rows))
    names = list(dict.fromkeys(r.workload for r in rows))
    fig, axes = plt.subplots(len(dtypes), 1, figsize=(10, 3.5 * len(dtypes)), squeeze=False)
    width = 0.8 / len(impls)
    for ax, dt in zip(axes[:, 0], dtypes):
        for n, impl in enumerate(impls):
            vals = [
                next((r.gflops or 0 for r in rows if r.workload == w and r.dtype == dt and r.impl == impl), 0)
                for w in names
            ]
            ax.bar([i + n * width for i in range(len(names))], vals, width, label=impl)
        ax.set_xticks([i + 0.4 - width / 2 for i in range(len(names))], names)
        ax.set_ylabel(f"GFLOP/s ({dt})")
    axes[0, 0].legend(fontsize=8, ncol=3)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
