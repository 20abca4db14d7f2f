"""The README's Python examples run and assert what they claim."""

from __future__ import annotations

import os
import re
import socket
from pathlib import Path
from unittest import mock

import pytest

README = Path(__file__).resolve().parents[1] / "README.md"
BLOCKS = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)


def _free_port() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return str(s.getsockname()[1])


def test_readme_has_examples():
    assert len(BLOCKS) >= 2


@pytest.mark.parametrize("index", range(len(BLOCKS)))
def test_readme_python_block_runs(index):
    # A torchrun script runs here as rank 0 of a world of one, with the variables torchrun would set.
    env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": _free_port(), "RANK": "0", "WORLD_SIZE": "1"}
    with mock.patch.dict(os.environ, env):
        exec(compile(BLOCKS[index], f"{README}:block{index}", "exec"), {})
