"""Sequence-parallel planning and scheduling without processes (``packattn.distributed.plan`` and
``schedule``): shards partition the batch, local offsets, plan validation, and the ring schedule computes
every visible (query, key) pair exactly once while skipping hidden blocks."""

from __future__ import annotations

import random
from collections import Counter

import pytest
import torch
import torch.distributed as dist

from packattn.distributed import ShardPlan, ring_varlen_attention, ulysses_varlen_attention
from packattn.distributed.schedule import ring_schedule

from .helpers import offsets


def test_uninitialised_process_group():
    assert not dist.is_initialized()
    plan = ShardPlan.build([0, 4], [0, 4], world_size=1, rank=0)
    x = torch.randn(4, 2, 8)
    for fn in (ring_varlen_attention, ulysses_varlen_attention):
        with pytest.raises(RuntimeError, match="default process group is not initialised"):
            fn(x, x, x, plan)
    with pytest.raises(RuntimeError, match="not initialised"):
        plan.unshard_q(x)


def test_local_cu_seqlens():
    plans = [ShardPlan.build([0, 8, 11], [0, 5, 9], world_size=2, rank=r) for r in range(2)]
    got = [[t.tolist() for t in p.local_cu_seqlens()] for p in plans]
    assert got == [[[0, 4, 5], [0, 3, 5]], [[0, 4, 6], [0, 2, 4]]]
    assert all(t.dtype == torch.int32 for p in plans for t in p.local_cu_seqlens("cpu"))
    assert [p.cu_seqlens_q_host for p in plans] == [(0, 4, 5), (0, 4, 6)]
    assert plans[0].local_cu_seqlens()[0] is plans[0].local_cu_seqlens()[0]  # cached, no copy per call


def test_zigzag_and_contiguous_chunks():
    rows = {
        b: [
            ShardPlan.build([0, 8], [0, 8], world_size=2, rank=r, balance=b).shard_q(torch.arange(8)).tolist()
            for r in range(2)
        ]
        for b in ("zigzag", "contiguous")
    }
    assert rows == {"zigzag": [[0, 1, 6, 7], [2, 3, 4, 5]], "contiguous": [[0, 1, 2, 3], [4, 5, 6, 7]]}


@pytest.mark.parametrize("balance", ["zigzag", "contiguous"])
@pytest.mark.parametrize("world_size", [1, 2, 3, 4, 7])
def test_shards_partition_the_batch(world_size, balance):
    cu_q, cu_k = offsets([13, 1, 0, 3, 24]), offsets([13, 6, 4, 0, 24])
    plans = [ShardPlan.build(cu_q, cu_k, world_size=world_size, rank=r, balance=balance) for r in range(world_size)]
    for side, total in (("q", cu_q[-1]), ("k", cu_k[-1])):
        rows = torch.cat([getattr(p, f"shard_{side}")(torch.arange(total)) for p in plans])
        assert sorted(rows.tolist()) == list(range(total))
    for p in plans:
        assert p.cu_seqlens_q_host[-1] == p.local_q and p.cu_seqlens_k_host[-1] == p.local_k
        assert len(p.cu_seqlens_q_host) == len(p.cu_seqlens_k_host) == len(cu_q)
    # Chunks differ by at most one token, so ranks hold near-equal parts of each sequence.
    per_rank = [p.cu_seqlens_q_host[1] for p in plans]  # rows of the 13-token sequence
    assert max(per_rank) - min(per_rank) <= (1 if balance == "contiguous" else 2)


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        (
            {"cu_seqlens_q_host": torch.tensor([0, 4])},
            TypeError,
            r"cu_seqlens_q_host must be a list/tuple .* pass .tolist\(\)",
        ),
        ({"cu_seqlens_k_host": [0, 5, 4]}, ValueError, "cu_seqlens_k_host must be non-decreasing, got 5 then 4"),
        ({"cu_seqlens_k_host": [0, 4, 6]}, ValueError, "same number of sequences, got 1 and 2"),
        ({"cu_seqlens_q_host": [1, 4]}, ValueError, "cu_seqlens_q_host must start at 0, got 1"),
        ({"world_size": 0}, ValueError, "world_size must be >= 1, got 0"),
        ({"rank": 2}, ValueError, r"rank must be in \[0, world_size\) = \[0, 2\), got 2"),
        ({"rank": 1.0}, TypeError, "rank must be an int, got float"),
        ({"balance": "striped"}, ValueError, "balance must be one of .* got 'striped'"),
    ],
    ids=["tensor", "decreasing", "batch_mismatch", "start", "world_size", "rank_range", "rank_type", "balance"],
)
def test_plan_validation(kwargs, error, match):
    args = {"cu_seqlens_q_host": [0, 4], "cu_seqlens_k_host": [0, 4], "world_size": 2, "rank": 0, **kwargs}
    with pytest.raises(error, match=match):
        ShardPlan.build(args.pop("cu_seqlens_q_host"), args.pop("cu_seqlens_k_host"), **args)


def test_shard_rejects_a_local_tensor():
    plan = ShardPlan.build([0, 8], [0, 8], world_size=2, rank=0)
    with pytest.raises(ValueError, match=r"x must be the global tensor with 8 rows .* got shape \(4, 3\)"):
        plan.shard_q(torch.zeros(4, 3))


def _covered(plans: list[ShardPlan], left: int, right: int) -> Counter:
    """Every (global query row, global key row) that some rank's ring computes, with multiplicity,
    reconstructed from the calls with varlen_attention's bottom-right window rule."""
    seen: Counter = Counter()
    for plan in plans:
        q_rows = plan.shards_q[plan.rank].global_rows().tolist()
        for step in ring_schedule(plan, left, right):
            k_rows = plan.shards_k[step.source].global_rows().tolist()
            for call in step.calls:
                wl, wr = call.window
                for (qa, qb), ranges in zip(call.q_rows, call.k_rows, strict=True):
                    keys = [j for a, b in ranges for j in range(a, b)]
                    m, n = qb - qa, len(keys)
                    for i in range(m):
                        for jj, j in enumerate(keys):
                            d = jj - i - (n - m)
                            if (wl < 0 or d >= -wl) and (wr < 0 or d <= wr):
                                seen[q_rows[qa + i], k_rows[j]] += 1
    return seen


def _visible(cu_q: list[int], cu_k: list[int], left: int, right: int) -> set[tuple[int, int]]:
    out = set()
    for b in range(len(cu_q) - 1):
        lq, lk = cu_q[b + 1] - cu_q[b], cu_k[b + 1] - cu_k[b]
        for i in range(lq):
            for j in range(lk):
                d = j - i - (lk - lq)
                if (left < 0 or d >= -left) and (right < 0 or d <= right):
                    out.add((cu_q[b] + i, cu_k[b] + j))
    return out


@pytest.mark.parametrize("seed", range(4))
def test_ring_schedule_computes_every_visible_pair_exactly_once(seed):
    """The chunk-pair window algebra, on random batches, masks, world sizes and balances."""
    rng = random.Random(seed)
    for _ in range(12):
        w, n = rng.randint(1, 5), rng.randint(1, 4)
        lens_q = [rng.choice([0, 1, 2, 3, 5, 8, 13, 20]) for _ in range(n)]
        lens_k = [x if rng.random() < 0.6 else rng.choice([0, 1, 4, 9, 16]) for x in lens_q]
        left, right = rng.choice([-1, -1, 0, 1, 3, 6]), rng.choice([-1, 0, 0, 1, 4])
        cu_q, cu_k = offsets(lens_q), offsets(lens_k)
        balance = rng.choice(["zigzag", "contiguous"])
        plans = [ShardPlan.build(cu_q, cu_k, world_size=w, rank=r, balance=balance) for r in range(w)]  # type: ignore[arg-type]
        seen = _covered(plans, left, right)
        case = f"W={w} lens_q={lens_q} lens_k={lens_k} window=({left}, {right}) {balance}"
        assert max(seen.values(), default=1) == 1, f"a pair is computed twice: {case}"
        assert set(seen) == _visible(cu_q, cu_k, left, right), case


def test_causal_blocks_are_skipped_and_zigzag_balances_them():
    cu = [0, 64, 128]
    contiguous = [ShardPlan.build(cu, cu, world_size=4, rank=r, balance="contiguous") for r in range(4)]
    zigzag = [ShardPlan.build(cu, cu, world_size=4, rank=r, balance="zigzag") for r in range(4)]

    def visible_work(plan: ShardPlan) -> int:
        return sum(_covered([plan], -1, 0).values())

    # Contiguous: rank 0's queries come first, so every visiting block is hidden and never computed.
    assert all(not st.calls for st in ring_schedule(contiguous[0], -1, 0)[1:])
    assert [visible_work(p) for p in contiguous] == [2 * 136, 2 * 392, 2 * 648, 2 * 904]
    # Zigzag: every rank gets the same causal work (chunk r and chunk 2W - 1 - r of each sequence).
    assert [visible_work(p) for p in zigzag] == [2 * 520] * 4
    # Later steps are one unmasked call each: both sequences' blocks share it.
    assert all(
        len(st.calls) == 1 and st.calls[0].window == (-1, -1) for p in zigzag for st in ring_schedule(p, -1, 0)[1:]
    )


@pytest.mark.parametrize("balance", ["zigzag", "contiguous"])
@pytest.mark.parametrize(("world_size", "ulysses_degree"), [(4, 2), (6, 3), (6, 2), (8, 4)])
def test_mesh_plans_cut_each_ring_part_among_its_ulysses_group(world_size, ulysses_degree, balance):
    """Rank r * U + u holds part u of ring part r: the U members of ring part r together hold exactly its
    rows (every row once), and the whole mesh partitions the batch."""
    cu_q, cu_k = offsets([13, 1, 0, 3, 24, 7]), offsets([13, 6, 4, 0, 24, 2])
    mesh = [
        ShardPlan.build(cu_q, cu_k, world_size=world_size, rank=r, balance=balance, ulysses_degree=ulysses_degree)
        for r in range(world_size)
    ]
    for side, total in (("q", cu_q[-1]), ("k", cu_k[-1])):
        every = torch.cat([getattr(p, f"shard_{side}")(torch.arange(total)) for p in mesh])
        assert sorted(every.tolist()) == list(range(total))
        for p in mesh:
            group = mesh[p.rank - p.rank % ulysses_degree : p.rank - p.rank % ulysses_degree + ulysses_degree]
            held = sorted(torch.cat([getattr(m, f"shard_{side}")(torch.arange(total)) for m in group]).tolist())
            ring_part = getattr(p.ring_level(), f"shard_{side}")(torch.arange(total))
            assert held == sorted(ring_part.tolist())
            assert p.ring_level().world_size == world_size // ulysses_degree
            assert p.ring_level().rank == p.rank // ulysses_degree


@pytest.mark.parametrize("balance", ["zigzag", "contiguous"])
def test_mesh_plans_with_one_dimension_are_todays_plans(balance):
    cu_q, cu_k = offsets([13, 1, 0, 3, 24]), offsets([13, 6, 4, 0, 24])
    for r in range(4):
        plain = ShardPlan.build(cu_q, cu_k, world_size=4, rank=r, balance=balance)
        for u in (1, 4):  # all ring, or all Ulysses
            mesh = ShardPlan.build(cu_q, cu_k, world_size=4, rank=r, balance=balance, ulysses_degree=u)
            assert (mesh.shards_q, mesh.shards_k) == (plain.shards_q, plain.shards_k)


def test_mesh_plan_errors_and_positions():
    with pytest.raises(ValueError, match=r"ulysses_degree must be >= 1 and divide world_size \(4\), got 3"):
        ShardPlan.build([0, 4], [0, 4], world_size=4, rank=0, ulysses_degree=3)
    with pytest.raises(TypeError, match="ulysses_degree must be an int, got float"):
        ShardPlan.build([0, 4], [0, 4], world_size=4, rank=0, ulysses_degree=2.0)  # type: ignore[arg-type]
    plan = ShardPlan.build([0, 8, 11], [0, 8, 11], world_size=2, rank=1)
    assert plan.positions().tolist() == [2, 3, 4, 5, 1, 2]
    assert plan.shard_q(torch.arange(11)).tolist() == [2, 3, 4, 5, 9, 10]
