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


def _raises(wl, q, k, v):
    def run():
        raise RuntimeError("out of memory")

    return run, {}


def _nan_in_an_unchecked_row(wl, q, k, v):
    run, setup = peers.per_sequence_sdpa(wl, q, k, v)
    unchecked = next(r for r in range(q.shape[0]) if r not in runner.sampled_rows(wl))

    def corrupt():
        out = run().clone()
        out[unchecked] = float("nan")
        return out

    return corrupt, setup


LONG = Workload("L", "long", (300,), (300,), 2, 1, 16, False)


def test_a_failing_or_partly_wrong_implementation_is_its_row_and_the_run_goes_on():
    impls = {
        "raises": (_raises, True, None),
        "nan": (_nan_in_an_unchecked_row, True, None),
        "setup raises": (lambda *args: _raises(*args)[0](), True, None),
    }
    with mock.patch.dict(peers.IMPLEMENTATIONS, impls):
        rows = runner.bench_group(LONG, "fp32", ["raises", "nan", "setup raises", "packattn"], 0.01, 1.0)
    assert rows[0].status == rows[2].status == "FAILED: RuntimeError: out of memory"
    assert rows[1].status == "WRONG: nan: non-finite values outside the checked rows"
    assert rows[3].status == "ok" and rows[3].backend in ("cpu_kernel", "cpu") and rows[3].median_ms
    checked = runner.sampled_rows(LONG)
    assert {63, 64, 127, 128, 255, 256} <= set(checked)  # both sides of the 64-row boundaries


def test_a_packattn_row_that_fails_makes_the_run_fail(capsys):
    argv = ["bench", "--quick", "--workloads", "T", "--dtypes", "fp32", "--impls", "packattn"]
    with (
        mock.patch.object(runner, "workloads", lambda quick: [TINY]),
        mock.patch.object(runner, "mm_ceiling", lambda *a, **k: 100.0),
        mock.patch.dict(peers.IMPLEMENTATIONS, {"packattn": (_raises, False, None)}),
    ):
        assert cli.main(argv) == 1
    assert "1 packattn row(s) WRONG or FAILED" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--workloads", "W9"], "unknown --workloads ['W9']"),
        (["--dtypes", "fp64"], "unknown --dtypes ['fp64']"),
        (["--threads", "0"], "--threads must be at least 1, got 0"),
        (["--device", "nodevice"], "--device nodevice is not usable here"),
        (["--json", "/nonexistent/dir/r.json"], "cannot write /nonexistent/dir/r.json"),
        (["--distributed", "--backward"], "--distributed takes --quick and --world-size only, got --backward"),
        (["--distributed", "--world-size", "0"], "--world-size must be at least 2, got 0"),
    ],
)
def test_options_are_checked_before_any_work(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["bench", *argv])
    assert exit_info.value.code == 2 and message in capsys.readouterr().err


def test_the_loop_peer_takes_grouped_heads_without_copies_and_splits_its_sequences():
    """The per-sequence loop as a careful user writes it: SDPA's enable_gqa where torch has it (copies of K/V
    before), and split (one gradient assembly) rather than slices (a zero-padded full gradient each)."""
    if not peers.SDPA_GQA:
        pytest.skip(f"torch {peers.torch.__version__} has no enable_gqa: the loop repeats K/V")
    wl = Workload("G", "gqa", (3, 5), (6, 5), 4, 1, 8, True)
    q, k, v = (t.requires_grad_() for t in wl.tensors(runner.DTYPES["fp32"]))
    run, _ = peers.per_sequence_sdpa(wl, q, k, v)
    with mock.patch.object(peers.torch.Tensor, "repeat_interleave", side_effect=AssertionError("K/V copied")):
        out = run()
    seen, stack = set(), [out.grad_fn]
    while stack:
        node = stack.pop()
        if node is not None and node not in seen:
            seen.add(node)
            stack += [f for f, _ in node.next_functions]
    names = {node.name() for node in seen}
    assert "SplitWithSizesBackward0" in names and "SliceBackward0" not in names
    assert runner.bench_one(wl, "fp32", "per-seq SDPA", 0.01, 1.0, backward=True).status == "ok"
