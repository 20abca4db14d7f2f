"""The device-portable tests (what ``benchmarks/gpu_check.sh`` runs on a GPU) select their backends by what
each declares, so that a run on another device has no failures caused by CPU-only names. Shown here by
running them with the CPU declared to be a CUDA device (``PACKATTN_TEST_FAKE_DEVICE``, see conftest.py): the
CPU-only backends then refuse, and Triton (under its interpreter), sdpa and the reference serve."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from .helpers import FAKE_DEVICE

# The files gpu_check.sh runs with PACKATTN_TEST_DEVICE=cuda.
PORTABLE = ["test_contract.py", "test_contract_properties.py", "test_mask.py", "test_triton.py", "test_nonfinite.py"]


@pytest.mark.skipif(FAKE_DEVICE is not None, reason="already on the fake device")
def test_portable_tests_pass_on_a_fake_cuda_device():
    here = Path(__file__).parent
    env = {**os.environ, "PACKATTN_TEST_FAKE_DEVICE": "cuda"}
    # Left out for time, as they run the same computation as in this session's run: the contract cases of
    # the triton backend, and test_triton's across-tile cases (each names its backend and checks one case).
    files = [str(here / f) for f in PORTABLE]
    select = "not (triton and not test_triton) and not (test_triton and across_tiles)"
    args = ["-q", "-p", "no:cacheprovider", "-k", select, *files]
    res = subprocess.run(
        [sys.executable, "-m", "pytest", *args], capture_output=True, text=True, timeout=900, env=env, check=False
    )
    assert res.returncode == 0, res.stdout[-6000:] + res.stderr[-2000:]
    assert " passed" in res.stdout and "failed" not in res.stdout, res.stdout[-2000:]
