"""The README's Python examples run and assert what they claim."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from datetime import timedelta
from pathlib import Path
from unittest import mock

import pytest
import torch.distributed as dist

README = Path(__file__).resolve().parents[1] / "README.md"
BLOCKS = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)
TORCHRUN_BLOCKS = [i for i, block in enumerate(BLOCKS) if "init_process_group" in block]


def test_readme_has_examples():
    assert len(BLOCKS) >= 2 and TORCHRUN_BLOCKS


@pytest.mark.parametrize("index", range(len(BLOCKS)))
def test_readme_python_block_runs(index):
    # A torchrun script runs here as rank 0 of a world of one, with the variables torchrun would set. The
    # test holds the rendezvous store (as torchrun's agent does), so no free port is looked up and lost.
    store = dist.TCPStore("127.0.0.1", 0, 1, is_master=True, timeout=timedelta(seconds=60))
    env = {
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(store.port),
        "TORCHELASTIC_USE_AGENT_STORE": "True",
        "RANK": "0",
        "WORLD_SIZE": "1",
    }
    with mock.patch.dict(os.environ, env):
        exec(compile(BLOCKS[index], f"{README}:block{index}", "exec"), {})


@pytest.mark.parametrize("index", TORCHRUN_BLOCKS)
def test_readme_script_at_world_size_2(index, tmp_path):
    # The README's own launch command, `torchrun --standalone --nproc_per_node 2 script.py`.
    script = tmp_path / "script.py"
    script.write_text(BLOCKS[index])
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", str(script)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=180, check=False)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]


def test_ci_runs_the_readme_test_command():
    """CI runs exactly the Quick start's second command line (the one that sets up and runs the tests)."""
    quick_start = README.read_text().split("## Quick start", 1)[1]
    readme_line = re.search(r"```bash\n(.*?)```", quick_start, flags=re.S).group(1).splitlines()[1]
    script = (README.parent / ".ci" / "run").read_text().splitlines()
    ci_line = [line for line in script if line.strip() and not line.startswith("#")][-1]
    assert ci_line == readme_line
    assert "pytest" in ci_line
