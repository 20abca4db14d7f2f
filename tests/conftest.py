"""Test-session setup.

* On CPU, Triton kernels run under Triton's interpreter, so the ``triton`` backend is covered by every
  backend test. ``TRITON_INTERPRET`` must be set before the kernels are first imported.
* ``PACKATTN_TEST_FAKE_DEVICE=cuda`` (or ``npu``) keeps the tensors on the CPU but re-declares every backend
  as if the CPU were that device: backends that run there accept CPU tensors, CPU-only ones refuse them,
  and default dispatch follows that device's order. The device-portable tests then select exactly what
  such a machine runs, which shows on CPU that a GPU run of them has no failures caused by CPU-only names
  (tests/test_device_portable.py runs them so).
"""

import dataclasses
import os

if os.environ.get("PACKATTN_TEST_DEVICE", "cpu") == "cpu":
    os.environ.setdefault("TRITON_INTERPRET", "1")

FAKE = os.environ.get("PACKATTN_TEST_FAKE_DEVICE")
if FAKE:
    from packattn import dispatch

    for backend in dispatch.BACKENDS.values():
        own = backend.capabilities.devices
        if own is None:  # runs on any device
            continue
        devices = (*own, "cpu") if FAKE in own else tuple(d for d in own if d != "cpu") or ("none",)
        backend.capabilities = dataclasses.replace(backend.capabilities, devices=devices)
    dispatch.PRIORITY["cpu"] = dispatch.PRIORITY[FAKE]
