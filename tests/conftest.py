"""Test-session setup: on CPU, Triton kernels run under Triton's interpreter, so the ``triton`` backend is
covered by every backend test. ``TRITON_INTERPRET`` must be set before the kernels are first imported."""

import os

if os.environ.get("PACKATTN_TEST_DEVICE", "cpu") == "cpu":
    os.environ.setdefault("TRITON_INTERPRET", "1")
