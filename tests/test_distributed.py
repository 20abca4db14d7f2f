"""Sequence parallelism (ring and Ulysses) against single-process attention, on CPU with real spawned gloo
processes.

One group of 4 worker processes serves the whole module; sub-groups of it give world sizes 1 to 4 (and
one whose group ranks differ from the global ranks). Every case runs on every member rank, and each rank
checks its own rows against the float64 oracle of the gathered batch with the core tolerance: at most
2x the error of plain PyTorch in the same dtype. Planning and scheduling, which need no processes, are in
test_distributed_plan.py.
"""

from __future__ import annotations

import functools
import re
import traceback
from datetime import timedelta
from pathlib import Path
from typing import Any
from unittest import mock

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import packattn
from packattn import dispatch
from packattn.backends import reference
from packattn.backends.base import Backend
from packattn.bench import distributed as bench
from packattn.bench.distributed import Setting, measure
from packattn.distributed import (
    ShardPlan,
    joint_varlen_attention,
    ring_varlen_attention,
    ulysses_varlen_attention,
    usp_varlen_attention,
)
from packattn.testing import assert_close_to_oracle, attention_naive, oracle

from .helpers import make_case, offsets

WORKERS = 4
TIMEOUT_S = 120
# group name -> global ranks; torch orders a group's ranks, so "ranks123" has group rank 0 = global rank 1.
GROUPS = {
    "ws1": [0],
    "ws2": [0, 1],
    "ws3": [0, 1, 2],
    "ws4": None,
    "ranks123": [1, 2, 3],
    **{f"pair{a}{b}": [a, b] for a, b in ((0, 1), (2, 3), (0, 2), (1, 3), (0, 3), (1, 2))},
}
# Meshes: name -> (the group of all its ranks, {global rank: (Ulysses group, ring group)}); None: that
# dimension has one rank. Under u2r2, global rank g is Ulysses rank g % 2 of ring rank g // 2.
MESHES: dict[str, tuple[str, dict[int, tuple[str | None, str | None]]]] = {
    "u2r2": (
        "ws4",
        {0: ("pair01", "pair02"), 1: ("pair01", "pair13"), 2: ("pair23", "pair02"), 3: ("pair23", "pair13")},
    ),
    "u2r1": ("ws2", {0: ("ws2", None), 1: ("ws2", None)}),
    "u1r2": ("ws2", {0: (None, "ws2"), 1: (None, "ws2")}),
    "u4r1": ("ws4", dict.fromkeys(range(4), ("ws4", None))),
}

# One batch with every awkward case: lengths not divisible by W or 2W, shorter than W, 1 query against
# 6 keys (most ranks hold keys but no queries of it), no queries, no keys, Lq < Lk and Lq > Lk.
LENS_Q = [13, 1, 0, 3, 9, 24, 2, 5, 7]
LENS_K = [13, 6, 4, 3, 0, 24, 2, 11, 3]
MASKS: dict[str, dict[str, Any]] = {
    "full": {},
    "causal": {"causal": True},
    "window": {"window_size": (3, 2)},
    "causal_window_softcap": {"causal": True, "window_size": (5, -1), "softcap": 3.0},
}
METHODS = {"ring": ring_varlen_attention, "ulysses": ulysses_varlen_attention}
GROUP_OBJECTS: dict[str, Any] = {}  # in a worker: group name -> its ProcessGroup (None: the default group)


# ---------------------------------------------------------------- the worker pool


def _worker(rank: int, rendezvous: str, tasks: Any, results: Any) -> None:
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"file://{rendezvous}", rank=rank, world_size=WORKERS, timeout=timedelta(seconds=60)
    )
    GROUP_OBJECTS.update({name: None if ranks is None else dist.new_group(ranks) for name, ranks in GROUPS.items()})
    while (task := tasks.get()) is not None:
        name, group_name, kwargs = task
        members = GROUPS[group_name]
        if members is not None and rank not in members:
            results.put((rank, None))
            continue
        try:
            CASES[name](GROUP_OBJECTS[group_name], **kwargs)
            results.put((rank, None))
        except BaseException:
            results.put((rank, traceback.format_exc()))
    dist.destroy_process_group()


class Cluster:
    def __init__(self, tmp: Path) -> None:
        ctx = mp.get_context("spawn")
        rendezvous = str(tmp / "rendezvous")  # a file in a fresh directory: no free port to race for
        self.tasks = [ctx.Queue() for _ in range(WORKERS)]
        self.results = ctx.Queue()
        self.procs = [
            ctx.Process(target=_worker, args=(r, rendezvous, self.tasks[r], self.results), daemon=True)
            for r in range(WORKERS)
        ]
        for p in self.procs:
            p.start()
        self.broken = ""

    def run(self, case: str, group: str, **kwargs: Any) -> None:
        """Run ``CASES[case]`` on every rank of ``group``; fail with the message of any rank that raised."""
        if self.broken:
            pytest.fail(f"the worker pool is unusable after an earlier case: {self.broken}")
        for q in self.tasks:
            q.put((case, group, kwargs))
        errors = []
        for _ in range(WORKERS):
            try:
                rank, err = self.results.get(timeout=TIMEOUT_S)
            except Exception:
                self.broken = f"{case} on {group} timed out after {TIMEOUT_S} s"
                pytest.fail(self.broken)
            if err:
                errors.append(f"--- rank {rank}:\n{err}")
        if errors:
            pytest.fail("\n".join(errors), pytrace=False)

    def close(self) -> None:
        for q in self.tasks:
            q.put(None)
        for p in self.procs:
            p.join(timeout=20)
            if p.is_alive():
                p.terminate()


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    c = Cluster(tmp_path_factory.mktemp("cluster"))
    yield c
    c.close()


# ---------------------------------------------------------------- cases run inside the workers


def _plan(group: Any, lens_q: list[int], lens_k: list[int], balance: str) -> ShardPlan:
    return ShardPlan.build(
        offsets(lens_q),
        offsets(lens_k),
        world_size=dist.get_world_size(group),
        rank=dist.get_rank(group),
        balance=balance,  # type: ignore[arg-type]
    )


def _mesh(name: str) -> tuple[Any, Any, int, int]:
    """This rank's (Ulysses group, ring group, Ulysses degree, plan rank) on mesh ``name``."""
    names = MESHES[name][1][dist.get_rank()]
    groups = [None if n is None else GROUP_OBJECTS[n] or dist.group.WORLD for n in names]
    size = [1 if g is None else dist.get_world_size(g) for g in groups]
    rank = [0 if g is None else dist.get_rank(g) for g in groups]
    return groups[0], groups[1], size[0], rank[1] * size[0] + rank[0]


def _mesh_plan(name: str, lens_q: list[int], lens_k: list[int], balance: str) -> ShardPlan:
    _, _, u, rank = _mesh(name)
    world = dist.get_world_size(GROUP_OBJECTS[MESHES[name][0]])
    return ShardPlan.build(
        offsets(lens_q),
        offsets(lens_k),
        world_size=world,
        rank=rank,
        balance=balance,
        ulysses_degree=u,  # type: ignore[arg-type]
    )


def case_matches_single_process(
    group: Any,
    *,
    method: str,
    balance: str,
    mask: str,
    hq: int = 12,
    hkv: int = 2,
    dtype: str = "float32",
    backend: str | None = None,
    lens: tuple[list[int], list[int]] = (LENS_Q, LENS_K),
    with_lse: bool = True,
    mesh: str | None = None,
) -> None:
    """Forward (out, LSE) and backward (dq, dk, dv through out and, if ``with_lse``, the LSE) of this
    rank's rows vs the oracle. ``method="usp"`` runs on ``mesh``."""
    opts = MASKS[mask]
    c = make_case(*lens, hq=hq, hkv=hkv, d=16, dv=8, dtype=getattr(torch, dtype), seed=3)
    if mesh is None:
        plan = _plan(group, *lens, balance)
        attend = functools.partial(METHODS[method], group=group)
    else:
        plan = _mesh_plan(mesh, *lens, balance)
        uly, ring, _, _ = _mesh(mesh)
        attend = functools.partial(usp_varlen_attention, ulysses_group=uly, ring_group=ring)
    gen = torch.Generator().manual_seed(4)
    dout = torch.randn(c.q.shape[0], hq, 8, generator=gen, dtype=torch.float64)
    dlse = torch.randn(hq, c.q.shape[0], generator=gen, dtype=torch.float64)

    def loss(out: torch.Tensor, lse: torch.Tensor, d_out: torch.Tensor, d_lse: torch.Tensor) -> torch.Tensor:
        total = (out.double() * d_out).sum()
        return total + (lse.double().nan_to_num(0.0, 0.0, 0.0) * d_lse).sum() if with_lse else total

    def reference_run(dt: torch.dtype | None) -> tuple[torch.Tensor, ...]:
        xs = [t.detach().clone().requires_grad_() for t in (c.q, c.k, c.v)]
        o, lse = attention_naive(*xs, c.cu_q, c.cu_k, dtype=dt, **opts)
        return (o, lse, *torch.autograd.grad(loss(o, lse, dout, dlse), xs))

    expected, plain = reference_run(torch.float64), reference_run(None)
    leaves = [plan.shard_q(c.q), plan.shard_k(c.k), plan.shard_k(c.v)]
    leaves = [t.detach().requires_grad_() for t in leaves]
    out, lse = attend(*leaves, plan, return_lse=True, backend=backend, **opts)
    lse_dtype = torch.float64 if c.q.dtype == torch.float64 else torch.float32
    assert out.dtype == c.q.dtype and lse.dtype == lse_dtype and lse.shape == (hq, plan.local_q)
    assert out.is_contiguous() and lse.is_contiguous()
    got = (out, lse, *torch.autograd.grad(loss(out, lse, plan.shard_q(dout), plan.shard_q(dlse.T).T), leaves))
    select = [plan.shard_q, lambda t: plan.shard_q(t.T).T, plan.shard_q, plan.shard_k, plan.shard_k]
    for name, g, e, p, sel in zip(["out", "lse", "dq", "dk", "dv"], got, expected, plain, select, strict=True):
        floor = 1e-5 if name == "lse" else None
        assert_close_to_oracle(g, sel(e), sel(p), name=f"rank {plan.rank} {name}", floor=floor)


def case_no_grad_and_unshard(group: Any, *, method: str) -> None:
    """Without autograd the result is the same; unshard_q / unshard_k gather rows back to the global order
    (and unshard's gradient is the sum over ranks of the gathered tensor's gradient)."""
    c = make_case(LENS_Q, LENS_K, hq=6, hkv=2, d=16, seed=5)
    plan = _plan(group, LENS_Q, LENS_K, "zigzag")
    args = (plan.shard_q(c.q), plan.shard_k(c.k), plan.shard_k(c.v), plan)
    with torch.no_grad():
        a = METHODS[method](*args, group=group, causal=True)
    b = METHODS[method](*(t.requires_grad_() for t in args[:3]), plan, group=group, causal=True)
    assert torch.equal(a, b.detach())
    full = plan.unshard_q(a, group=group)
    ref_out, _ = oracle(c.q, c.k, c.v, c.cu_q, c.cu_k, causal=True)
    plain, _ = attention_naive(c.q, c.k, c.v, c.cu_q, c.cu_k, causal=True)
    assert_close_to_oracle(full, ref_out, plain, name="unshard_q(out)")
    x = plan.shard_k(c.k).requires_grad_()
    weights = torch.randn(c.k.shape, generator=torch.Generator().manual_seed(0))
    (plan.unshard_k(x, group=group) * weights).sum().backward()
    # Every rank's loss reads the gathered tensor, so each row gathers W copies of its gradient.
    assert x.grad is not None and torch.allclose(x.grad, plan.world_size * plan.shard_k(weights))


def case_device_priority(group: Any, *, method: str) -> None:
    """Ring and Ulysses pick each block's backend through the device's dispatch order: a backend put first
    for CPU tensors (as a CUDA or NPU backend is for its device) runs every block, forward and backward."""
    ran: list[str] = []

    def counting(name: str) -> Any:
        def run(*args: Any) -> Any:
            ran.append(name)
            return getattr(reference, name)(*args)

        return run

    class DeviceFirst(Backend):
        name = "device_first"
        forward = staticmethod(counting("forward"))
        backward = staticmethod(counting("backward"))

    fake = DeviceFirst()
    with (
        mock.patch.dict(dispatch.BACKENDS, {"device_first": fake}),
        mock.patch.dict(dispatch.PRIORITY, {"cpu": ("device_first", *dispatch.PRIORITY["cpu"])}),
    ):
        case_matches_single_process(group, method=method, balance="zigzag", mask="causal")
    assert "forward" in ran and "backward" in ran


def case_errors(group: Any) -> None:
    """Bad plans and shapes raise the same clear error on every rank, before any communication."""
    w, r = dist.get_world_size(group), dist.get_rank(group)
    c = make_case(LENS_Q, LENS_K, hq=5, hkv=1, d=16, seed=1)
    plan = _plan(group, LENS_Q, LENS_K, "zigzag")
    q, k, v = plan.shard_q(c.q), plan.shard_k(c.k), plan.shard_k(c.v)
    other_size = ShardPlan.build(c.cu_q, c.cu_k, world_size=w + 1, rank=r)
    other_rank = ShardPlan.build(c.cu_q, c.cu_k, world_size=w, rank=(r + 1) % w)
    for fn in METHODS.values():
        with pytest.raises(ValueError, match=f"plan was built for world_size={w + 1}, but the group has {w} ranks"):
            fn(q, k, v, other_size, group=group)
        with pytest.raises(ValueError, match=f"plan was built for rank {(r + 1) % w}, but this process is rank {r}"):
            fn(q, k, v, other_rank, group=group)
        with pytest.raises(ValueError, match=rf"q must hold this rank's {plan.local_q} q rows .* got {c.q.shape[0]}"):
            fn(c.q, k, v, plan, group=group)
        with pytest.raises(ValueError, match=rf"k must hold this rank's {plan.local_k} k rows"):
            fn(q, c.k, c.v, plan, group=group)
        with pytest.raises(TypeError, match="plan must be a ShardPlan"):
            fn(q, k, v, "plan", group=group)  # type: ignore[call-overload]
    with pytest.raises(TypeError, match=r"unshard_q: x_local must be a torch.Tensor, got list"):
        plan.unshard_q([0.0], group=group)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"unshard_k: x_local must have a row dimension, got a 0-d tensor"):
        plan.unshard_k(torch.tensor(1.0), group=group)
    with pytest.raises(ValueError, match=rf"unshard_k: x_local must hold this rank's {plan.local_k} k rows"):
        plan.unshard_k(c.k, group=group)
    with pytest.raises(ValueError, match=rf"unshard_q: plan was built for rank {(r + 1) % w}"):
        other_rank.unshard_q(q, group=group)
    with pytest.raises(ValueError, match=r"backend='sdpa' cannot run .*returns no LSE"):
        ring_varlen_attention(q, k, v, plan, group=group, backend="sdpa")
    with pytest.raises(
        ValueError, match=rf"query heads \(q.shape\[1\] = 5\) must be divisible by the group size \({w}\)"
    ):
        ulysses_varlen_attention(q, k, v, plan, group=group)


def case_not_a_member(group: Any) -> None:
    """Global rank 0 calls with the group of ranks 1-3, which new_group gave it as a non-member."""
    if dist.get_rank() != 0:
        return
    outside = GROUP_OBJECTS["ranks123"]
    plan = ShardPlan.build([0, 6], [0, 6], world_size=3, rank=0)
    x = torch.randn(plan.local_q, 3, 8)
    match = r"this process \(global rank 0\) is not a member of group"
    for fn in METHODS.values():
        with pytest.raises(ValueError, match=match):
            fn(x, x, x, plan, group=outside)
    with pytest.raises(ValueError, match=match):
        plan.unshard_q(x, group=outside)


def _disagree(fn: Any, item: str, value: object, *args: Any, **kwargs: Any) -> None:
    """``fn`` raises on every rank, naming ``item`` and this rank's ``value`` of it."""
    r, w = dist.get_rank(kwargs["group"]), dist.get_world_size(kwargs["group"])
    same = [w - 1] if r == w - 1 else list(range(w - 1))
    detail = re.escape(f"{item} (this rank, {r}: {value!r}; the same on ranks {same}")
    with pytest.raises(ValueError, match=f"ranks disagree on .*{detail}"):
        fn(*args, **kwargs)


def case_ranks_disagree(group: Any) -> None:
    """The last rank of the group passes something different from the others: every rank raises, naming it.
    Every call checks with one small all-gather before any data moves (and nothing else gathers)."""
    last = dist.get_rank(group) == dist.get_world_size(group) - 1
    c = make_case(LENS_Q, LENS_K, hq=12, hkv=2, d=16, seed=1)  # 12 heads: Ulysses runs at every world size
    plan = _plan(group, LENS_Q, LENS_K, "zigzag")
    q, k, v = plan.shard_q(c.q), plan.shard_k(c.k), plan.shard_k(c.v)
    for fn in METHODS.values():
        _disagree(fn, "causal", last, q, k, v, plan, group=group, causal=last)
        heads = 1 if last else 2
        _disagree(fn, "key/value heads (k.shape[1])", heads, q, k[:, :heads], v[:, :heads], plan, group=group)
    lens_q = [14, *LENS_Q[1:]] if last else LENS_Q
    other = _plan(group, lens_q, LENS_K, "contiguous" if last else "zigzag")
    d = make_case(lens_q, LENS_K, hq=12, hkv=2, d=16, seed=1)
    args = (other.shard_q(d.q), other.shard_k(d.k), other.shard_k(d.v), other)
    _disagree(ring_varlen_attention, "plan.balance", other.balance, *args, group=group)
    _disagree(ring_varlen_attention, "plan.global_cu_seqlens_q", other.global_cu_seqlens_q, *args, group=group)
    fn = METHODS["ulysses" if last else "ring"]
    _disagree(fn, "the function", f"{fn.__name__}", q, k, v, plan, group=group)
    x = q[..., :8] if last else q
    _disagree(plan.unshard_q, "x_local.shape[1:]", tuple(x.shape[1:]), x, group=group)
    with mock.patch("torch.distributed.all_gather", wraps=dist.all_gather) as all_gather:
        for _ in range(3):
            ring_varlen_attention(q, k, v, plan, group=group, window_size=(4, 4))
    assert all_gather.call_count == 3


def case_ring_skips_hidden_blocks(group: Any) -> None:
    """The backend never runs a block that the causal mask hides: on a contiguous split rank r's queries
    see the keys of ranks 0..r only, so forward and backward compute r + 1 blocks per sequence, not W."""
    entries: dict[str, list[int]] = {"forward": [], "backward": []}

    def counting(name: str, fn: Any) -> Any:
        def run(inp: Any, *args: Any) -> Any:
            entries[name].append(sum((qe - qs) * (ke - ks) for qs, qe, ks, ke in inp.layout.sequences()))
            return fn(inp, *args)

        return run

    class Counting(Backend):
        name = "counting"
        forward = staticmethod(counting("forward", reference.forward))
        backward = staticmethod(counting("backward", reference.backward))

    spy = Counting()
    w, r = dist.get_world_size(group), dist.get_rank(group)
    plan = ShardPlan.build([0, 64, 128], [0, 64, 128], world_size=w, rank=r, balance="contiguous")
    x = torch.randn(plan.local_q, 2, 8, requires_grad=True)
    dispatch.BACKENDS["counting"] = spy  # type: ignore[assignment]
    try:
        ring_varlen_attention(x, x, x, plan, group=group, causal=True, backend="counting").sum().backward()
    finally:
        del dispatch.BACKENDS["counting"]
    block = (64 // w) ** 2
    assert sum(entries["forward"]) == sum(entries["backward"]) == 2 * (r + 1) * block, entries


def case_benchmark_rejects_a_wrong_result(group: Any) -> None:
    """A method that is wrong on one rank is not timed: every rank raises, naming that rank."""

    def off_on_rank_1(*args: Any, **kwargs: Any) -> torch.Tensor:
        out = ring_varlen_attention(*args, **kwargs)
        return out * 1.01 if dist.get_rank() == 1 else out

    wrong = r"ring_varlen_attention gives a wrong result on ranks \[1\], so it is not timed"
    with mock.patch.dict(bench.METHODS, {"ring": (off_on_rank_1, False)}), pytest.raises(RuntimeError, match=wrong):
        measure(Setting(lengths=(64, 40), repeats=1))


def case_benchmark_runs(group: Any) -> None:
    """The distributed benchmark's measurement, tiny, on the default group."""
    results = measure(Setting(lengths=(64, 40), repeats=1))
    assert [(r.name, r.world_size) for r in results][1:] == [
        ("ring_varlen_attention", WORKERS),
        ("ulysses_varlen_attention", WORKERS),
        ("usp 2x2", WORKERS),
    ]
    assert all(r.median_ms > 0 and r.overhead > 0 for r in results)


def case_usp_with_one_dimension_is_ring_or_ulysses(group: Any, *, mesh: str) -> None:
    """usp on a 1 x R mesh is the ring, on U x 1 Ulysses: the same bits, forward and backward."""
    uly, ring, _, _ = _mesh(mesh)
    c = make_case(LENS_Q, LENS_K, hq=6, hkv=2, d=16, seed=5)
    plan = _mesh_plan(mesh, LENS_Q, LENS_K, "zigzag")
    same = (
        functools.partial(ring_varlen_attention, group=ring)
        if uly is None
        else functools.partial(ulysses_varlen_attention, group=uly)
    )
    results = []
    for fn in (same, functools.partial(usp_varlen_attention, ulysses_group=uly, ring_group=ring)):
        leaves = [x.detach().requires_grad_() for x in (plan.shard_q(c.q), plan.shard_k(c.k), plan.shard_k(c.v))]
        out, lse = fn(*leaves, plan, causal=True, return_lse=True)
        results.append((out, lse, *torch.autograd.grad((out * out).sum() + lse.sum(), leaves)))
    for a, b in zip(*results, strict=True):
        assert torch.equal(a, b)


TEXT = [3, 0, 2, 5, 1, 4]  # joint tokens per sequence (one sequence has none)
IMAGE = [13, 1, 0, 9, 24, 5]  # sharded tokens per sequence (one has none)


def case_joint_matches_single_process(group: Any, *, mesh: str, dtype: str = "float32", softcap: float = 0.0) -> None:
    """Joint attention (text on every rank, image sharded) against the float64 oracle of the joint
    sequences [text, image]: outputs and LSE, image gradients per rank, and text gradients summed over ranks
    (each rank passing its own share of the text outputs' gradient)."""
    uly, ring, _, rank = _mesh(mesh)
    members = GROUP_OBJECTS[MESHES[mesh][0]]
    world = dist.get_world_size(members)
    joint_lens = [t + i for t, i in zip(TEXT, IMAGE, strict=True)]
    c = make_case(joint_lens, joint_lens, hq=4, hkv=2, d=16, dv=8, dtype=getattr(torch, dtype), seed=7)
    cu = offsets(joint_lens)
    text_rows = torch.cat([torch.arange(cu[b], cu[b] + t) for b, t in enumerate(TEXT)])
    image_rows = torch.cat([torch.arange(cu[b] + t, cu[b + 1]) for b, t in enumerate(TEXT)])
    plan = _mesh_plan(mesh, IMAGE, IMAGE, "zigzag")
    gen = torch.Generator().manual_seed(8)
    dout = torch.randn(cu[-1], 4, 8, generator=gen, dtype=torch.float64)
    dlse = torch.randn(4, cu[-1], generator=gen, dtype=torch.float64)
    share = (rank + 1) / (world * (world + 1) / 2)  # this rank's share of the text rows' upstream gradient

    def reference_run(dt: torch.dtype | None) -> list[torch.Tensor]:
        xs = [t.detach().clone().requires_grad_() for t in (c.q, c.k, c.v)]
        o, lse = attention_naive(*xs, c.cu_q, c.cu_k, dtype=dt, softcap=softcap)
        loss = (o.double() * dout).sum() + (lse.double() * dlse).sum()
        return [o, lse, *torch.autograd.grad(loss, xs)]

    expected, plain = reference_run(torch.float64), reference_run(None)
    image = [plan.shard_q(x.index_select(0, image_rows)).detach().requires_grad_() for x in (c.q, c.k, c.v)]
    text = [x.index_select(0, text_rows).detach().requires_grad_() for x in (c.q, c.k, c.v)]
    out, joint_out, lse, joint_lse = joint_varlen_attention(
        *image, *text, offsets(TEXT), plan, ulysses_group=uly, ring_group=ring, softcap=softcap, return_lse=True
    )
    assert all(t.is_contiguous() for t in (out, joint_out, lse, joint_lse))
    img_dout, img_dlse = plan.shard_q(dout[image_rows]), plan.shard_q(dlse[:, image_rows].T).T
    loss = (out.double() * img_dout).sum() + (lse.double() * img_dlse).sum()
    loss = loss + share * (
        (joint_out.double() * dout[text_rows]).sum() + (joint_lse.double() * dlse[:, text_rows]).sum()
    )
    grads = torch.autograd.grad(loss, [*image, *text])
    text_grads = [g.clone() for g in grads[3:]]
    for g in text_grads:
        dist.all_reduce(g, group=members)
    checks = {
        "out": (out, lambda t: plan.shard_q(t[image_rows])),
        "lse": (lse, lambda t: plan.shard_q(t[:, image_rows].T).T),
        "joint_out": (joint_out, lambda t: t[text_rows]),
        "joint_lse": (joint_lse, lambda t: t[:, text_rows]),
    }
    for name, (got, sel) in checks.items():
        i = 0 if "out" in name else 1
        assert_close_to_oracle(
            got, sel(expected[i]), sel(plain[i]), name=f"rank {rank} {name}", floor=1e-5 if "lse" in name else None
        )
    for j, name in enumerate(["dq", "dk", "dv"]):
        e, p = expected[2 + j], plain[2 + j]
        assert_close_to_oracle(
            grads[j], plan.shard_q(e[image_rows]), plan.shard_q(p[image_rows]), name=f"rank {rank} image {name}"
        )
        assert_close_to_oracle(text_grads[j], e[text_rows], p[text_rows], name=f"rank {rank} text {name} (summed)")


def case_mesh_errors_and_one_bad_rank(group: Any) -> None:
    """On the 2 x 2 mesh: local errors before any exchange, one rank's bad input or disagreement raises on
    every rank of the mesh (through both groups' checks), then a good call works; a DeviceMesh gives the
    same result as the two groups."""
    from torch.distributed.device_mesh import init_device_mesh

    uly, ring, _, rank = _mesh("u2r2")
    c = make_case(LENS_Q, LENS_K, hq=4, hkv=2, d=16, seed=2)
    plan = _mesh_plan("u2r2", LENS_Q, LENS_K, "zigzag")
    q, k, v = plan.shard_q(c.q), plan.shard_k(c.k), plan.shard_k(c.v)
    usp = functools.partial(usp_varlen_attention, ulysses_group=uly, ring_group=ring)
    with pytest.raises(ValueError, match=r"pass mesh= .* or ulysses_group= and/or ring_group="):
        usp_varlen_attention(q, k, v, plan)
    wrong = ShardPlan.build(c.cu_q, c.cu_k, world_size=4, rank=(rank + 1) % 4, ulysses_degree=2)
    with pytest.raises(ValueError, match=rf"build it with world_size=4, ulysses_degree=2, rank={rank} "):
        usp(q, k, v, wrong)
    with pytest.raises(
        ValueError, match=r"query heads \(q.shape\[1\] = 3\) must be a multiple|divisible by the Ulysses"
    ):
        usp(q[:, :3], k[:, :1], v[:, :1], plan)
    # Rank 3 passes a short shard: it raises its own error, every other rank names it.
    bad = q[:-1] if rank == 3 else q
    with pytest.raises(ValueError) as err:
        usp(bad, k, v, plan)
    if rank == 3:
        assert "q must hold this rank's" in str(err.value)
    else:
        assert "rejected its input" in str(err.value) and "q must hold this rank's" in str(err.value)
    # Rank 3 disagrees on an option: every rank raises.
    with pytest.raises(ValueError, match="ranks disagree on causal"):
        usp(q, k, v, plan, causal=rank == 3)
    whole = packattn.varlen_attention(c.q, c.k, c.v, *c.tensors(), causal=True)
    torch.testing.assert_close(usp(q, k, v, plan, causal=True), plan.shard_q(whole))
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("ring", "ulysses"))
    assert torch.equal(usp_varlen_attention(q, k, v, plan, mesh=mesh, causal=True), usp(q, k, v, plan, causal=True))
    with pytest.raises(ValueError, match="not both"):
        usp_varlen_attention(q, k, v, plan, mesh=mesh, ring_group=ring)
    text = c.q[:5]
    with pytest.raises(TypeError, match="cu_seqlens_joint_host must be a list/tuple of Python ints"):
        joint_varlen_attention(q, k, v, text, text[:, :2], text[:, :2], torch.tensor([0, 5]), plan, mesh=mesh)
    with pytest.raises(ValueError, match="cu_seqlens_joint_host must be the non-decreasing offsets"):
        joint_varlen_attention(q, k, v, text, text[:, :2], text[:, :2], [0, 5], plan, mesh=mesh)
    with pytest.raises(ValueError, match=r"joint_k must have the heads, head dim, dtype and device of k"):
        joint_varlen_attention(q, k, v, text, text, text, [0] * len(LENS_Q) + [5], plan, mesh=mesh)


def case_groups_that_form_no_mesh(group: Any) -> None:
    """Ulysses groups {0, 3} and {1, 2} across rings {0, 1} and {2, 3}: every rank's plan fits its own
    (Ulysses rank, ring rank), but the groups form no mesh. Every rank raises before any data moves."""
    rank = dist.get_rank()
    uly = GROUP_OBJECTS["pair03" if rank in (0, 3) else "pair12"]
    ring = GROUP_OBJECTS["pair01" if rank in (0, 1) else "pair23"]
    plan_rank = dist.get_rank(ring) * 2 + dist.get_rank(uly)
    c = make_case(LENS_Q, LENS_K, hq=4, hkv=2, d=16, seed=2)
    plan = ShardPlan.build(c.cu_q, c.cu_k, world_size=4, rank=plan_rank, ulysses_degree=2)
    q, k, v = plan.shard_q(c.q), plan.shard_k(c.k), plan.shard_k(c.v)
    with pytest.raises(ValueError, match=r"ranks disagree on the ring rank \(a Ulysses group's members must share"):
        usp_varlen_attention(q, k, v, plan, ulysses_group=uly, ring_group=ring)


def case_outputs_used_on_some_ranks(group: Any, *, method: str) -> None:
    """Rank 0's loss leaves out an output that the other ranks' losses use (the LSE; for joint attention,
    joint_out): every rank's backward still joins the same exchanges. For the LSE, the gradients are those
    of the sum of the ranks' losses."""
    me = dist.get_rank()
    if method == "joint":
        uly, ring, _, _ = _mesh("u2r2")
        c = make_case(IMAGE, IMAGE, hq=4, hkv=2, d=16, seed=9)
        plan = _mesh_plan("u2r2", IMAGE, IMAGE, "zigzag")
        text = [x[: sum(TEXT)].detach().requires_grad_() for x in (c.q, c.k, c.v)]
        image = [plan.shard_q(x).detach().requires_grad_() for x in (c.q, c.k, c.v)]
        out, joint_out = joint_varlen_attention(*image, *text, offsets(TEXT), plan, ulysses_group=uly, ring_group=ring)
        loss = out.sum() if me == 0 else out.sum() + joint_out.sum()
        grads = torch.autograd.grad(loss, [*image, *text])
        assert all(bool(torch.isfinite(g).all()) for g in grads)
        return
    c = make_case(LENS_Q, LENS_K, hq=4, hkv=2, d=16, dtype=torch.float64, seed=6)
    if method == "usp":
        plan = _mesh_plan("u2r2", LENS_Q, LENS_K, "zigzag")
        uly, ring, _, _ = _mesh("u2r2")
        attend = functools.partial(usp_varlen_attention, ulysses_group=uly, ring_group=ring)
    else:
        plan = _plan(group, LENS_Q, LENS_K, "zigzag")
        attend = functools.partial(METHODS[method], group=group)
    others = torch.zeros(c.q.shape[0], dtype=torch.float64)  # the rows of the ranks whose losses use the LSE
    for r in range(1, plan.world_size):
        rows = ShardPlan.build(c.cu_q, c.cu_k, world_size=plan.world_size, rank=r, ulysses_degree=plan.ulysses_degree)
        others[rows.shard_q(torch.arange(c.q.shape[0]))] = 1.0
    xs = [t.detach().clone().requires_grad_() for t in (c.q, c.k, c.v)]
    o, lse = attention_naive(*xs, c.cu_q, c.cu_k, causal=True)
    expected = torch.autograd.grad(o.sum() + (lse * others).sum(), xs)
    leaves = [plan.shard_q(c.q), plan.shard_k(c.k), plan.shard_k(c.v)]
    leaves = [t.detach().requires_grad_() for t in leaves]
    out, lse = attend(*leaves, plan, causal=True, return_lse=True)
    loss = out.sum() if plan.rank == 0 else out.sum() + lse.sum()
    grads = torch.autograd.grad(loss, leaves)
    for name, g, e, sel in zip("qkv", grads, expected, [plan.shard_q, plan.shard_k, plan.shard_k], strict=True):
        torch.testing.assert_close(g, sel(e), rtol=1e-9, atol=1e-9, msg=lambda m, n=name: f"rank {me} d{n}: {m}")


def case_flux_matches_single_process(group: Any, *, mesh: str, masked: bool) -> None:
    """A tiny Flux transformer with its image tokens sharded over the mesh (PackedJointAttnProcessor with
    parallel=) against the whole batch in one process with diffusers' default processor: each rank's
    output rows, its image-input gradient rows, and the weight and text-input gradients summed over ranks."""
    from packattn.integrations.diffusers import PackedJointAttnProcessor, SequenceParallel

    from . import test_integrations_diffusers as fx

    uly, ring, _, _ = _mesh(mesh)
    side = 4  # 16 image tokens: 4 per rank at world size 4
    lengths = fx.PROMPT_LENGTHS if masked else [5, 5]
    data, ids = fx.Batch.make(lengths, image_tokens=side * side), fx.image_ids(side, side)
    data.image.requires_grad_()
    data.text.requires_grad_()
    weights = torch.randn(data.image.shape, generator=torch.Generator().manual_seed(3))
    reference = fx.flux()
    want = fx.run(reference, data, mask=data.joint_mask[:, None, None] if masked else None, img_ids=ids)
    (want * weights).sum().backward()
    want_image, want_text = data.image.grad, data.text.grad
    data.image.grad = data.text.grad = None

    sp = SequenceParallel.build(len(lengths), side * side, ulysses_group=uly, ring_group=ring)
    model = fx.flux()
    model.set_attn_processor(PackedJointAttnProcessor(parallel=sp))
    text_len = data.text.shape[1]
    local = fx.Batch(
        sp.shard(data.image), data.text, data.pooled, data.timestep, data.joint_mask[:, : text_len + sp.local_tokens]
    )
    got = fx.run(model, local, mask=local.joint_mask if masked else None, img_ids=sp.shard(ids, dim=0))
    torch.testing.assert_close(got, sp.shard(want), **fx.TOL)
    (got * sp.shard(weights)).sum().backward()
    # Each rank's image gradient is its own rows (zero elsewhere); the text gradient is this rank's share.
    for grad, expected in ((data.image.grad, want_image), (data.text.grad, want_text)):
        total = grad.clone()
        dist.all_reduce(total, group=group)
        torch.testing.assert_close(total, expected, **fx.TOL)
    torch.testing.assert_close(sp.shard(data.image.grad), sp.shard(want_image), **fx.TOL)
    ref, checked = dict(reference.named_parameters()), 0
    for name, p in model.named_parameters():
        if ref[name].grad is not None:
            grad = p.grad.clone()
            dist.all_reduce(grad, group=group)
            torch.testing.assert_close(grad, ref[name].grad, **fx.TOL, msg=lambda m, n=name: f"{n}: {m}")
            checked += 1
    assert checked > 20
    with torch.no_grad():
        torch.testing.assert_close(sp.gather(got, group=group), want, **fx.TOL)
        bad = local.joint_mask.clone()
        bad[:, -1] = False
        with pytest.raises(ValueError, match="may mark text padding only"):
            fx.run(model, local, mask=bad, img_ids=sp.shard(ids, dim=0))
        with pytest.raises(ValueError, match="x must have the 16 image tokens along dim 1, got"):
            sp.shard(local.image)
        with pytest.raises(ValueError, match="image_tokens must be >= 1, got 0"):
            SequenceParallel.build(2, 0, ulysses_group=uly, ring_group=ring)
        with pytest.raises(ValueError, match=r"parallel's plan is for \d images of 16 tokens"):
            fx.run(model, data, img_ids=ids)  # not sharded
        first = fx.Batch(*(t[:1] for t in (local.image, local.text, local.pooled, local.timestep, local.joint_mask)))
        with pytest.raises(ValueError, match=r"parallel's plan is for a batch of \d, got 1 \(build it"):
            fx.run(model, first, img_ids=sp.shard(ids, dim=0))


def _summed_gradients_match(model: Any, reference: Any, group: Any) -> None:
    """Every parameter gradient of ``model`` summed over ``group`` against ``reference``'s."""
    from . import test_integrations_diffusers as fx

    ref, checked = dict(reference.named_parameters()), 0
    for name, p in model.named_parameters():
        if ref[name].grad is not None:
            grad = p.grad.clone()
            dist.all_reduce(grad, group=group)
            torch.testing.assert_close(grad, ref[name].grad, **fx.TOL, msg=lambda m, n=name: f"{n}: {m}")
            checked += 1
    assert checked > 20


def case_attach_matches_single_process(group: Any, *, mesh: str, model: str, per_token_timestep: bool = False) -> None:
    """SequenceParallel.attach on a tiny Wan (video) or Flux transformer given the whole batch, against
    the same model with diffusers' default processor in one process: the output on every rank, and with the
    same loss on every rank, the input and weight gradients summed over the ranks."""
    from packattn.integrations.diffusers import SequenceParallel

    from . import test_integrations_diffusers as fx

    uly, ring, _, _ = _mesh(mesh)
    gen = torch.Generator().manual_seed(3)
    if model == "wan":
        data, make = fx.Video.make(), fx.wan
        inputs = [data.latents]
        # Wan 2.2's per-token timesteps (B, S), split with the tokens; else one per sample.
        t = torch.rand(2, fx.VIDEO_TOKENS, generator=gen) * 1000 if per_token_timestep else data.timestep
        tokens = fx.VIDEO_TOKENS

        def forward(m: Any) -> torch.Tensor:
            return data.run(m, t)
    else:
        side = 4  # 16 image tokens: 4 per rank at world size 4
        flux, ids, make = fx.Batch.make(fx.PROMPT_LENGTHS, image_tokens=side * side), fx.image_ids(side, side), fx.flux
        inputs = [flux.image, flux.text]
        tokens = side * side

        def forward(m: Any) -> torch.Tensor:  # the mask over [text, the whole image]
            return fx.run(m, flux, mask=flux.joint_mask[:, None, None], img_ids=ids)

    for x in inputs:
        x.requires_grad_()
    reference = make()
    want = forward(reference)
    weights = torch.randn(want.shape, generator=gen)
    (want * weights).sum().backward()
    want_grads = [x.grad for x in inputs]
    for x in inputs:
        x.grad = None

    batch = 2 if model == "wan" else len(fx.PROMPT_LENGTHS)
    sp = SequenceParallel.build(batch, tokens, ulysses_group=uly, ring_group=ring)
    split = make()
    hooks = sp.attach(split, group=group)
    got = forward(split)
    torch.testing.assert_close(got, want, **fx.TOL)
    (got * weights).sum().backward()  # the same loss on every rank
    for x, expected in zip(inputs, want_grads, strict=True):
        total = x.grad.clone()
        dist.all_reduce(total, group=group)
        torch.testing.assert_close(total, expected, **fx.TOL)
    _summed_gradients_match(split, reference, group)

    with torch.no_grad():
        with pytest.raises(TypeError, match="FluxTransformer2DModel or WanTransformer3DModel, got Linear"):
            sp.attach(torch.nn.Linear(2, 2))
        if model == "wan":
            short = fx.Video(data.latents[:, :, :1], data.text, data.timestep)
            with pytest.raises(ValueError, match=f"x must have the {tokens} image tokens along dim 1, got"):
                short.run(split)
        hooks.remove()
        with pytest.raises(ValueError, match=r"attach the model with SequenceParallel\.attach"):
            forward(split)  # the processors stay, and now get every token


CASES = {
    "flux": case_flux_matches_single_process,
    "attach": case_attach_matches_single_process,
    "mesh_errors": case_mesh_errors_and_one_bad_rank,
    "usp_one_dimension": case_usp_with_one_dimension_is_ring_or_ulysses,
    "joint": case_joint_matches_single_process,
    "benchmark": case_benchmark_runs,
    "matches": case_matches_single_process,
    "no_grad_and_unshard": case_no_grad_and_unshard,
    "device_priority": case_device_priority,
    "errors": case_errors,
    "not_a_member": case_not_a_member,
    "disagree": case_ranks_disagree,
    "skips_hidden_blocks": case_ring_skips_hidden_blocks,
    "benchmark_rejects": case_benchmark_rejects_a_wrong_result,
    "no_mesh": case_groups_that_form_no_mesh,
    "some_ranks": case_outputs_used_on_some_ranks,
}


# ---------------------------------------------------------------- tests that use the workers

WORLD_SIZES = ["ws1", "ws2", "ws3", "ws4"]


@pytest.mark.parametrize("mask", MASKS)
@pytest.mark.parametrize("balance", ["zigzag", "contiguous"])
@pytest.mark.parametrize("group", WORLD_SIZES)
def test_ring_matches_single_process(cluster, group, balance, mask):
    cluster.run("matches", group, method="ring", balance=balance, mask=mask)


@pytest.mark.parametrize("mask", MASKS)
@pytest.mark.parametrize("balance", ["zigzag", "contiguous"])
@pytest.mark.parametrize("group", WORLD_SIZES)
def test_ulysses_matches_single_process(cluster, group, balance, mask):
    # hq=12 with hkv=2: at world sizes 3 and 4 the KV heads are repeated (Hkv < W).
    cluster.run("matches", group, method="ulysses", balance=balance, mask=mask)


@pytest.mark.parametrize("method", METHODS)
def test_group_ranks_differ_from_global_ranks(cluster, method):
    cluster.run("matches", "ranks123", method=method, balance="zigzag", mask="causal")


@pytest.mark.parametrize("heads", [(8, 1), (4, 4)], ids=["mqa", "mha"])
@pytest.mark.parametrize("method", METHODS)
def test_head_layouts_at_world_size_4(cluster, method, heads):
    # Gradients through the output only (no LSE gradient reaches the backward).
    opts = {"hq": heads[0], "hkv": heads[1], "with_lse": False}
    cluster.run("matches", "ws4", method=method, balance="zigzag", mask="causal", **opts)


@pytest.mark.parametrize("method", METHODS)
def test_bfloat16(cluster, method):
    cluster.run("matches", "ws3", method=method, balance="zigzag", mask="causal", dtype="bfloat16")


@pytest.mark.parametrize("method", METHODS)
def test_float64(cluster, method):
    # float64 in, float64 out and LSE: merges and gradients accumulate in float64.
    cluster.run("matches", "ws3", method=method, balance="zigzag", mask="causal_window_softcap", dtype="float64")


def test_sequences_all_shorter_than_world_size(cluster):
    lens = ([1, 2, 3, 1, 0], [3, 2, 1, 0, 2])
    cluster.run("matches", "ws4", method="ring", balance="zigzag", mask="causal", lens=lens)
    cluster.run("matches", "ws4", method="ulysses", balance="contiguous", mask="full", lens=lens)


@pytest.mark.parametrize("method", METHODS)
def test_no_grad_and_unshard(cluster, method):
    cluster.run("no_grad_and_unshard", "ws3", method=method)


@pytest.mark.parametrize("method", METHODS)
def test_ring_and_ulysses_use_the_device_dispatch_order(cluster, method):
    cluster.run("device_priority", "ws3", method=method)


@pytest.mark.parametrize("group", ["ws2", "ws4"])
def test_errors(cluster, group):
    cluster.run("errors", group)


def test_not_a_member_of_group(cluster):
    cluster.run("not_a_member", "ws4")


@pytest.mark.parametrize("group", ["ws3", "ranks123"])
def test_ranks_that_disagree_all_raise(cluster, group):
    cluster.run("disagree", group)


def test_ring_never_runs_hidden_blocks(cluster):
    cluster.run("skips_hidden_blocks", "ws4")


def test_benchmark_measures(cluster):
    cluster.run("benchmark", "ws4")


def test_benchmark_rejects_a_wrong_result(cluster):
    cluster.run("benchmark_rejects", "ws4")


MESH_NAMES = list(MESHES)


@pytest.mark.parametrize("mask", MASKS)
@pytest.mark.parametrize("balance", ["zigzag", "contiguous"])
@pytest.mark.parametrize("mesh", MESH_NAMES)
def test_usp_matches_single_process(cluster, mesh, balance, mask):
    # hq=12, hkv=2: with a Ulysses group of 4 the KV heads are repeated (Hkv < U).
    cluster.run("matches", MESHES[mesh][0], method="usp", mesh=mesh, balance=balance, mask=mask)


@pytest.mark.parametrize("case", ["bfloat16", "float64", "mqa"])
def test_usp_dtypes_and_heads(cluster, case):
    opts: dict[str, Any] = {"mqa": {"hq": 8, "hkv": 1}}.get(case, {"dtype": case})
    cluster.run("matches", "ws4", method="usp", mesh="u2r2", balance="zigzag", mask="causal_window_softcap", **opts)


@pytest.mark.parametrize("mesh", ["u1r2", "u2r1"])
def test_usp_with_one_dimension_is_ring_or_ulysses(cluster, mesh):
    cluster.run("usp_one_dimension", MESHES[mesh][0], mesh=mesh)


@pytest.mark.parametrize("mesh", MESH_NAMES)
def test_joint_attention_matches_single_process(cluster, mesh):
    cluster.run("joint", MESHES[mesh][0], mesh=mesh)


@pytest.mark.parametrize("dtype", ["bfloat16", "float64"])
def test_joint_attention_dtypes(cluster, dtype):
    cluster.run("joint", "ws4", mesh="u2r2", dtype=dtype, softcap=2.0)


def test_mesh_errors_and_one_bad_rank(cluster):
    cluster.run("mesh_errors", "ws4")


def test_groups_that_form_no_mesh_raise_on_every_rank(cluster):
    cluster.run("no_mesh", "ws4")


@pytest.mark.parametrize(("method", "group"), [("ulysses", "ws2"), ("usp", "ws4"), ("joint", "ws4")])
def test_an_output_used_on_some_ranks_only(cluster, method, group):
    cluster.run("some_ranks", group, method=method)


def test_ring_output_over_one_sequence_is_contiguous(cluster):
    """One sequence: the ring's jobs cover all local rows, where the merge's head-major strides showed."""
    cluster.run("matches", "ws4", method="ring", balance="zigzag", mask="full", lens=([11], [11]))


@pytest.mark.parametrize(("mesh", "masked"), [("u2r2", True), ("u2r1", False), ("u1r2", True)])
def test_flux_with_sequence_parallel_matches_single_process(cluster, mesh, masked):
    pytest.importorskip("diffusers")
    cluster.run("flux", MESHES[mesh][0], mesh=mesh, masked=masked)


@pytest.mark.parametrize(
    ("model", "mesh", "per_token_timestep"),
    [("wan", "u2r2", False), ("wan", "u2r1", True), ("wan", "u1r2", False), ("flux", "u2r2", False)],
)
def test_attach_splits_a_whole_model(cluster, model, mesh, per_token_timestep):
    pytest.importorskip("diffusers")
    cluster.run("attach", MESHES[mesh][0], mesh=mesh, model=model, per_token_timestep=per_token_timestep)
