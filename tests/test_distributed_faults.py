"""Sequence parallelism under faults, with real spawned gloo processes: one rank's bad input makes every rank
raise before any data moves, and a rank that dies mid-ring is an error on the others within the process
group's timeout, never a hang. Every scenario starts its own processes, so a broken group cannot leak into
other tests, and is bounded by its own deadline."""

from __future__ import annotations

import os
import time
import traceback
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import packattn
from packattn.distributed import ShardPlan, comm, ring_varlen_attention, ulysses_varlen_attention

from .helpers import make_case

LENS = [13, 1, 0, 9, 24, 5]
WORLD = 3
GROUP_TIMEOUT_S = 5  # the dead-rank scenario's process-group timeout
DEADLINE_S = 180  # no scenario may take longer than this, whatever happens in its processes


def _init(rendezvous: str, rank: int, world: int, timeout_s: float) -> None:
    dist.init_process_group(
        "gloo", init_method=f"file://{rendezvous}", rank=rank, world_size=world, timeout=timedelta(seconds=timeout_s)
    )


def _outcome(fn: Any) -> tuple[str, str]:
    try:
        fn()
    except Exception as e:
        return type(e).__name__, str(e)
    return "ok", ""


def _batch(rank: int, world: int) -> tuple[Any, ...]:
    c = make_case(LENS, LENS, hq=6, hkv=3, d=16, seed=3)
    plan = ShardPlan.build(c.cu_q, c.cu_k, world_size=world, rank=rank)
    return c, plan, plan.shard_q(c.q), plan.shard_k(c.k), plan.shard_k(c.v)


def _good_call(rank: int, world: int) -> None:
    """A ring and a Ulysses call with good inputs, checked against single-process attention."""
    c, plan, q, k, v = _batch(rank, world)
    whole = packattn.varlen_attention(c.q, c.k, c.v, *c.tensors(), causal=True)
    for fn in (ring_varlen_attention, ulysses_varlen_attention):
        torch.testing.assert_close(fn(q, k, v, plan, causal=True), plan.shard_q(whole))


def _bad_inputs(rank: int) -> dict[str, tuple[str, str]]:
    """One rank at a time gets something wrong; every rank records what it raised."""
    _, plan, q, k, v = _batch(rank, WORLD)
    out = {}
    out["short_shard"] = _outcome(lambda: ring_varlen_attention(q[:-1] if rank == 1 else q, k, v, plan))
    k_bf16 = k.to(torch.bfloat16) if rank == 2 else k
    out["wrong_dtype"] = _outcome(lambda: ulysses_varlen_attention(q, k_bf16, v, plan))
    out["good_after_faults"] = _outcome(lambda: _good_call(rank, WORLD))
    for _ in range(2):  # the same options again: they were agreed before
        ring_varlen_attention(q, k, v, plan, window_size=(4, -1))
    out["options_changed"] = _outcome(
        lambda: ring_varlen_attention(q, k, v, plan, window_size=(4, -1), causal=rank == 0)
    )
    out["unshard_short"] = _outcome(lambda: plan.unshard_q(q[:-1] if rank == 0 else q))
    out["good_at_the_end"] = _outcome(lambda: _good_call(rank, WORLD))
    return out


def _fails_mid_ring(rank: int, rendezvous: str, how: str) -> dict[str, tuple[str, str]]:
    """Rank 2 exits (``dies``) or stops answering (``stuck``) when it would post the ring's second hop; the
    others must raise, then work on a fresh group."""
    _, plan, q, k, v = _batch(rank, WORLD)
    if rank == 2:
        shift, calls = comm.Ring.shift, []

        def fail_on_second_hop(self: Any, send: torch.Tensor, recv: torch.Tensor) -> Any:
            calls.append(1)
            if len(calls) == 2:
                if how == "stuck":
                    time.sleep(3 * GROUP_TIMEOUT_S)
                os._exit(3)
            return shift(self, send, recv)

        comm.Ring.shift = fail_on_second_hop  # type: ignore[method-assign]
    start = time.monotonic()
    out = {"dead_peer": _outcome(lambda: ring_varlen_attention(q, k, v, plan, causal=True))}
    out["elapsed_s"] = ("seconds", f"{time.monotonic() - start:.2f}")
    dist.destroy_process_group()
    _init(rendezvous + "-fresh", rank, 2, 60)  # the survivors, ranks 0 and 1, on a fresh group
    out["fresh_group"] = _outcome(lambda: _good_call(rank, 2))
    return out


def _main(rank: int, scenario: str, rendezvous: str, results: Any) -> None:
    torch.set_num_threads(1)
    try:
        _init(rendezvous, rank, WORLD, 60 if scenario == "bad_inputs" else GROUP_TIMEOUT_S)
        out = _bad_inputs(rank) if scenario == "bad_inputs" else _fails_mid_ring(rank, rendezvous, scenario)
        results.put((rank, out))
    except BaseException:
        results.put((rank, {"crashed": ("traceback", traceback.format_exc())}))


def run_scenario(scenario: str, tmp: Path, ranks: int) -> dict[int, dict[str, tuple[str, str]]]:
    """Start WORLD processes, collect the reports of ``ranks`` of them within the deadline, end them all."""
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    procs = [ctx.Process(target=_main, args=(r, scenario, str(tmp / "rdv"), results)) for r in range(WORLD)]
    for p in procs:
        p.start()
    reports: dict[int, dict[str, tuple[str, str]]] = {}
    end = time.monotonic() + DEADLINE_S
    try:
        while len(reports) < ranks and time.monotonic() < end:
            try:
                rank, out = results.get(timeout=max(0.1, end - time.monotonic()))
            except Exception:
                break
            reports[rank] = out
    finally:
        for rank, p in enumerate(procs):
            p.join(timeout=10 if rank in reports else 0)  # a rank that did not report is not waited for
            if p.is_alive():
                p.kill()
                p.join()
    crashed = {r: o["crashed"][1] for r, o in reports.items() if "crashed" in o}
    assert not crashed, crashed
    assert len(reports) == ranks, f"{scenario}: only ranks {sorted(reports)} reported within {DEADLINE_S} s (a hang)"
    return reports


def test_one_ranks_bad_input_makes_every_rank_raise_before_data_moves(tmp_path):
    reports = run_scenario("bad_inputs", tmp_path, WORLD)
    for rank, out in reports.items():
        kind, msg = out["short_shard"]
        if rank == 1:
            assert kind == "ValueError" and "q must hold this rank's" in msg
        else:
            assert kind == "ValueError" and msg.startswith("ring_varlen_attention: rank 1 of the group rejected")
            assert "rank 1: ValueError: ring_varlen_attention: q must hold this rank's" in msg
        kind, msg = out["wrong_dtype"]
        if rank == 2:
            assert kind == "InputTypeError" and "k must have the same dtype as q (torch.float32)" in msg
        else:
            assert kind == "ValueError" and "rank 2: InputTypeError: ulysses_varlen_attention: k must have" in msg
        kind, msg = out["options_changed"]
        assert kind == "ValueError" and "ranks disagree on causal" in msg, (rank, msg)
        kind, msg = out["unshard_short"]
        if rank == 0:
            assert kind == "ValueError" and "x_local must hold this rank's" in msg
        else:
            assert kind == "ValueError" and "ShardPlan.unshard_q: rank 0 of the group rejected its input" in msg
        assert out["good_after_faults"] == ("ok", "") and out["good_at_the_end"] == ("ok", ""), (rank, out)


@pytest.mark.parametrize("how", ["dies", "stuck"])
def test_a_rank_that_dies_or_hangs_mid_ring_is_an_error_within_the_timeout(tmp_path, how):
    reports = run_scenario(how, tmp_path, WORLD - 1)  # rank 2 never reports
    assert sorted(reports) == [0, 1]
    for rank, out in reports.items():
        kind, msg = out["dead_peer"]
        assert kind == "RuntimeError", (rank, out)
        assert msg.startswith("ring_varlen_attention: the ring hop between rank") and "a peer exited" in msg
        assert float(out["elapsed_s"][1]) < GROUP_TIMEOUT_S + 10, (rank, out["elapsed_s"])
        assert out["fresh_group"] == ("ok", ""), (rank, out)
