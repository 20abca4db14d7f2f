"""Sequence-parallel overhead: ring, Ulysses and 2-D mesh attention against one process doing the same work.

Each of ``W`` processes runs with 1 thread (gloo on CPU), so ``W`` processes together have ``W`` times the
compute of the single-process baseline, :func:`packattn.varlen_attention` at 1 thread on the whole batch.
The reported **overhead** is ``W * t_parallel / t_single``: the process-seconds spent per unit of work,
relative to one process. 1.0 is perfect scaling; above that is the price of communication, merging,
per-block dispatch and load imbalance. ``t_parallel`` is the slowest rank's time, median over repeats.
Before timing a method, every rank checks its output rows against single-process attention (float64 as
the truth, float32 as the baseline error, with :func:`packattn.testing.assert_close_to_oracle`); a wrong
result raises on every rank instead of being timed. Every mesh ``U x R`` with ``1 < U < W`` (Ulysses inside
groups of ``U`` consecutive ranks, ring across them) is measured too, e.g. ``usp 2x2`` at ``W = 4``.

Launch with torchrun (one process per rank; ``--nproc_per_node`` sets the world size)::

    OMP_NUM_THREADS=1 torchrun --standalone --nproc_per_node 2 -m packattn.bench.distributed

or let it spawn its own gloo processes on this machine::

    python -m packattn.bench.distributed --world-size 2
"""

from __future__ import annotations

import argparse
import functools
import math
import os
import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

import torch
import torch.distributed as dist

from ..api import varlen_attention
from ..distributed import ShardPlan, ring_varlen_attention, ulysses_varlen_attention, usp_varlen_attention
from ..distributed.plan import Balance
from ..testing import assert_close_to_oracle

DEFAULT_LENGTHS = (2048, 1024, 768, 512, 256, 128)
# name -> (attention, whether it exchanges heads over the whole group: the Ulysses degree is W, else 1)
METHODS = {"ring": (ring_varlen_attention, False), "ulysses": (ulysses_varlen_attention, True)}


@dataclass(frozen=True)
class Setting:
    lengths: tuple[int, ...] = DEFAULT_LENGTHS
    heads_q: int = 8
    heads_kv: int = 2
    head_dim: int = 64
    causal: bool = True
    balance: Balance = "zigzag"
    backward: bool = True
    repeats: int = 5

    def describe(self) -> str:
        kind = "causal" if self.causal else "non-causal"
        return (
            f"{len(self.lengths)} seqs, {sum(self.lengths)} tokens, heads {self.heads_q}/{self.heads_kv}, "
            f"D={self.head_dim}, {kind}, fp32, {self.balance}, {'fwd+bwd' if self.backward else 'fwd'}"
        )


@dataclass(frozen=True)
class Result:
    name: str
    world_size: int
    median_ms: float
    overhead: float  # world_size * median_ms / single-process median_ms
    sent_mb: float = 0.0  # bytes each rank sends in one forward call (mean over ranks), MB
    sent_backward_mb: float = 0.0  # the same for one backward call


def sent_megabytes(s: Setting, world_size: int, ulysses_degree: int, *, backward: bool = False) -> float:
    """Bytes each rank sends in one forward (or, with ``backward``, one backward) call, on average, on a
    ``U x R`` mesh (``U = 1``: the ring; ``U = W``: Ulysses), from the algorithm. Forward: Ulysses sends
    ``(U - 1) / U`` of its rows of q, k, v (KV heads repeated to a multiple of ``U``) and of the output; the
    ring sends its group's keys and values, ``Hkv / U`` of the heads, ``R - 1`` times. Backward: Ulysses
    sends the same shares of dO, dq, dk and dv; the ring sends the keys and values ``R - 1`` times again
    and their fp32 dK/dV accumulators ``R`` times (the last hop returns them to their owner)."""
    u, r, tokens, fp32 = ulysses_degree, world_size // ulysses_degree, sum(s.lengths), 4
    kv_heads = s.heads_kv * (u // math.gcd(s.heads_kv, u))
    a2a = (u - 1) / u * tokens / world_size * (2 * s.heads_q + 2 * kv_heads) * s.head_dim
    hops = (r - 1) + (r if backward and r > 1 else 0)
    ring = hops * tokens / r * kv_heads / u * 2 * s.head_dim
    return (a2a + ring) * fp32 / 1e6


def _tensors(s: Setting) -> tuple[list[int], torch.Tensor, torch.Tensor, torch.Tensor]:
    cu = [0]
    for n in s.lengths:
        cu.append(cu[-1] + n)
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(cu[-1], s.heads_q, s.head_dim, generator=gen)
    k = torch.randn(cu[-1], s.heads_kv, s.head_dim, generator=gen)
    v = torch.randn(cu[-1], s.heads_kv, s.head_dim, generator=gen)
    return cu, q, k, v


def _step(
    fn: Callable[..., torch.Tensor], args: tuple[torch.Tensor, ...], backward: bool, **kw: Any
) -> Callable[[], None]:
    leaves = [a.detach().requires_grad_(backward) for a in args]

    def run() -> None:
        out = fn(*leaves, **kw)
        if backward:
            out.backward(torch.ones_like(out))

    return run


def _time(run: Callable[[], None], repeats: int, *, together: bool) -> float:
    """Median over ``repeats`` of the time in ms; ``together``: every rank starts each repeat at a barrier
    and the slowest rank's time counts."""
    run()  # warm-up: plans, caches, allocator
    times = []
    for _ in range(repeats):
        if together:
            dist.barrier()
        t0 = time.perf_counter()
        run()
        dt = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
        if together:
            dist.all_reduce(dt, op=dist.ReduceOp.MAX)
        times.append(float(dt))
    return 1e3 * statistics.median(times)


def _reference_rows(
    plan: ShardPlan, s: Setting, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's rows of single-process :func:`varlen_attention` in float64 (the truth) and float32."""
    cu = torch.tensor(plan.global_cu_seqlens_q, dtype=torch.int32)
    with torch.no_grad():
        truth = varlen_attention(q.double(), k.double(), v.double(), cu, cu, causal=s.causal)
        plain = varlen_attention(q, k, v, cu, cu, causal=s.causal)
    return plan.shard_q(truth), plan.shard_q(plain)


def _check(name: str, out: torch.Tensor, plan: ShardPlan, reference: tuple[torch.Tensor, torch.Tensor]) -> None:
    """Raise on every rank unless every rank's ``out`` is within twice the float32 single-process error
    of the float64 truth (``reference``, from :func:`_reference_rows`)."""
    error = ""
    try:
        assert_close_to_oracle(out, *reference, name=f"rank {plan.rank} out")
    except AssertionError as e:
        error = str(e)
    flags = [torch.zeros(1, dtype=torch.int64) for _ in range(plan.world_size)]
    dist.all_gather(flags, torch.tensor([int(bool(error))]))
    wrong = [r for r, f in enumerate(flags) if int(f)]
    if wrong:
        raise RuntimeError(
            f"{name} gives a wrong result on ranks {wrong}, so it is not timed: expected "
            "each rank's rows of single-process varlen_attention" + (f"; {error}" if error else "")
        )


Method = tuple[str, Callable[..., torch.Tensor], int, int]  # name, attention, the plan's and the mesh's U


def _meshes(w: int, rank: int) -> list[Method]:
    """Every ``U x R`` mesh with ``1 < U < W``. Collective (new groups)."""
    meshes: list[Method] = []
    for u in (d for d in range(2, w) if w % d == 0):
        r = w // u
        ulysses = [dist.new_group([i * u + j for j in range(u)]) for i in range(r)]
        rings = [dist.new_group([i * u + j for i in range(r)]) for j in range(u)]
        fn = functools.partial(usp_varlen_attention, ulysses_group=ulysses[rank // u], ring_group=rings[rank % u])
        meshes.append((f"usp {u}x{r}", fn, u, u))
    return meshes


def measure(s: Setting) -> list[Result]:
    """Run on every rank of the initialised default group; returns the same results on every rank."""
    torch.set_num_threads(1)
    w, rank = dist.get_world_size(), dist.get_rank()
    cu, q, k, v = _tensors(s)
    single = torch.zeros(1, dtype=torch.float64)
    if rank == 0:
        cu_t = torch.tensor(cu, dtype=torch.int32)
        run = _step(varlen_attention, (q, k, v), s.backward, cu_seqlens_q=cu_t, cu_seqlens_k=cu_t, causal=s.causal)
        single[0] = _time(run, s.repeats, together=False)
    dist.broadcast(single, 0)
    t_single = float(single[0])
    results = [Result("varlen_attention, 1 process", 1, t_single, 1.0)]
    methods: list[Method] = [
        (f"{name}_varlen_attention", fn, 1, w if heads else 1) for name, (fn, heads) in METHODS.items()
    ]
    methods += _meshes(w, rank)
    for name, fn, plan_degree, ulysses_degree in methods:
        plan = ShardPlan.build(cu, cu, world_size=w, rank=rank, balance=s.balance, ulysses_degree=plan_degree)
        local = (plan.shard_q(q), plan.shard_k(k), plan.shard_k(v))
        with torch.no_grad():
            _check(name, fn(*local, plan=plan, causal=s.causal), plan, _reference_rows(plan, s, q, k, v))
        run = _step(fn, local, s.backward, plan=plan, causal=s.causal)
        t = _time(run, s.repeats, together=True)
        sent = (sent_megabytes(s, w, ulysses_degree, backward=b) for b in (False, True))
        results.append(Result(name, w, t, w * t / t_single, *sent))
    return results


def report(s: Setting, results: list[Result]) -> str:
    lines = [f"packattn sequence parallel, gloo, 1 thread per process, torch {torch.__version__}: {s.describe()}"]
    lines.append(
        f"{'implementation':<30}{'ranks':>6}{'median ms':>12}{'speedup':>9}{'overhead':>10}{'fwd MB/rank':>13}"
        f"{'bwd MB/rank':>13}"
    )
    base = results[0].median_ms
    for r in results:
        lines.append(
            f"{r.name:<30}{r.world_size:>6}{r.median_ms:>12.1f}{base / r.median_ms:>9.2f}{r.overhead:>10.2f}"
            f"{r.sent_mb:>13.2f}{r.sent_backward_mb:>13.2f}"
        )
    lines.append("overhead = ranks * median / single-process median (1.00 = perfect scaling)")
    lines.append("fwd/bwd MB/rank = bytes each rank sends in one forward/backward call (mean over ranks)")
    return "\n".join(lines)


def _spawned(rank: int, world_size: int, rendezvous: str, s: Setting, out: Any) -> None:
    dist.init_process_group("gloo", init_method=f"file://{rendezvous}", rank=rank, world_size=world_size)
    try:
        results = measure(s)
        if rank == 0:
            out.put([asdict(r) for r in results])
    finally:
        dist.destroy_process_group()


def run_spawned(s: Setting, world_size: int) -> list[Result]:
    """Spawn ``world_size`` gloo processes on this machine and measure."""
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    out = ctx.SimpleQueue()
    with tempfile.TemporaryDirectory() as tmp:  # a file rendezvous: no free port to race for
        args = (world_size, os.path.join(tmp, "rendezvous"), s, out)
        mp.start_processes(_spawned, args=args, nprocs=world_size, start_method="spawn")
    return [Result(**r) for r in out.get()]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m packattn.bench.distributed", description=(__doc__ or "").split("\n")[0])
    p.add_argument("--world-size", type=int, default=2, help="processes to spawn when not under torchrun")
    p.add_argument("--lengths", default=",".join(map(str, DEFAULT_LENGTHS)), help="comma-separated sequence lengths")
    p.add_argument("--heads", default="8/2", help="query/key-value heads, e.g. 8/2")
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--no-causal", action="store_true")
    p.add_argument("--balance", default="zigzag", choices=["zigzag", "contiguous"])
    p.add_argument("--forward-only", action="store_true")
    p.add_argument("--repeats", type=int, default=5)
    a = p.parse_args(argv)
    hq, hkv = (int(x) for x in a.heads.split("/"))
    s = Setting(
        tuple(int(x) for x in a.lengths.split(",")),
        hq,
        hkv,
        a.head_dim,
        not a.no_causal,
        a.balance,
        not a.forward_only,
        a.repeats,
    )
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:  # under torchrun
        dist.init_process_group("gloo")
        try:
            results = measure(s)
            if dist.get_rank() == 0:
                print(report(s, results))
        finally:
            dist.destroy_process_group()
        return 0
    print(report(s, run_spawned(s, a.world_size)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
