"""``packattn bench`` checks before it times: forward rows and, with ``--backward``, gradients."""

from __future__ import annotations

from unittest import mock

import pytest

from packattn import cli
from packattn.bench import peers, runner
from packattn.bench.workloads import Workload

TINY = Workload("T", "tiny", (5, 0, 9, 1), (7, 3, 9, 4), 4, 2, 16, True)


def test_capped_keeps_the_problem_and_shrinks_it():
    small = Workload("W", "w", (300, 5, 700), (300, 9, 20), 8, 2, 64, True).capped(128, count=2)
    assert (small.lens_q, small.lens_k, small.heads_q, small.causal) == ((128, 5), (128, 9), 8, True)


def test_forward_and_backward_rows_are_checked_then_timed():
    fwd = runner.bench_one(TINY, "fp32", "packattn", 0.01, 1.0)
    both = runner.bench_one(TINY, "fp32", "packattn", 0.01, 1.0, backward=True)
    for row in (fwd, both):
        assert row.status == "ok" and row.median_ms and row.max_error is not None
    assert both.gflops * both.median_ms == pytest.approx(TINY.flops() * runner.BACKWARD_FLOPS / 1e6)


def _wrong_gradient(wl, q, k, v):
    """Right output, wrong gradients: k and v get none."""
    run, setup = peers.per_sequence_sdpa(wl, q, k, v)
    return (lambda: run().detach() + 0 * q.sum()), setup


def test_a_wrong_gradient_is_reported_not_timed():
    with mock.patch.dict(peers.IMPLEMENTATIONS, {"wrong": (_wrong_gradient, True, None)}):
        fwd = runner.bench_one(TINY, "fp32", "wrong", 0.01, 1.0)
        both = runner.bench_one(TINY, "fp32", "wrong", 0.01, 1.0, backward=True)
    assert fwd.status == "ok"
    assert both.status.startswith("WRONG: wrong d") and both.median_ms is None


def test_device_defaults_leave_out_cuda_only_peers(capsys):
    assert "flash-attn" not in peers.default_impls("cpu") and "packattn triton" not in peers.default_impls("cpu")
    assert {"flash-attn", "torch varlen", "packattn triton"} <= set(peers.default_impls("cuda"))
    argv = ["bench", "--quick", "--workloads", "T", "--dtypes", "fp32", "--impls", "packattn", "--backward"]
    with (
        mock.patch.object(runner, "workloads", lambda quick: [TINY]),
        mock.patch.object(runner, "mm_ceiling", lambda *a, **k: 100.0),
    ):
        assert cli.main(argv) == 0
    out = capsys.readouterr().out
    assert "forward + backward" in out and "torch.mm ceilings in this run: fp32 100.0 GFLOP/s" in out


def test_distributed_bytes_sent_per_rank():
    """The printed communication volume, by hand for the bench batch (4736 tokens, heads 8/2, D=64, fp32) at
    W = 4: the ring sends its keys and values 3 times; Ulysses three quarters of its q, k (2 KV
    heads repeated to 4), v and output rows; the 2 x 2 mesh half of them over 2 ranks, then the 2-head
    group keys once around the ring of 2."""
    from packattn.bench.distributed import Setting, sent_megabytes

    s, rows = Setting(), 4736 // 4
    assert sent_megabytes(s, 4, 1) == pytest.approx(3 * rows * 2 * 2 * 64 * 4 / 1e6)
    assert sent_megabytes(s, 4, 4) == pytest.approx(0.75 * rows * (8 + 4 + 4 + 8) * 64 * 4 / 1e6)
    uly, ring = 0.5 * rows * (8 + 2 + 2 + 8) * 64, 1 * (4736 // 2) * 1 * 2 * 64
    assert sent_megabytes(s, 4, 2) == pytest.approx((uly + ring) * 4 / 1e6)
    assert sent_megabytes(s, 1, 1) == 0
    # Backward: the same all-to-all shares (dO, dq, dk, dv); the ring's keys and values 3 more times and
    # their dK/dV 4 times.
    assert sent_megabytes(s, 4, 1, backward=True) == pytest.approx(7 * rows * 2 * 2 * 64 * 4 / 1e6)
    assert sent_megabytes(s, 4, 4, backward=True) == sent_megabytes(s, 4, 4)
    assert sent_megabytes(s, 4, 2, backward=True) == pytest.approx((uly + 3 * ring) * 4 / 1e6)
    assert sent_megabytes(s, 1, 1, backward=True) == 0
