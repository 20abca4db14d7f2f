"""Backends: one :class:`~.base.Backend` object per module (``BACKEND``), see :mod:`.base`.

``ALL`` is every backend, in the order ``packattn info`` lists them. ``PRIORITY`` is the order in which
dispatch tries them for tensors of each device type (the first that supports the inputs and does not
decline them wins); a backend outside a device's list runs there only when asked for by name
(``backend="..."``).
"""

from . import cpu, cpu_kernel, flash_attn, npu, reference, sdpa, torch_varlen, triton
from .base import Backend

ALL: tuple[Backend, ...] = tuple(
    m.BACKEND for m in (cpu_kernel, cpu, npu, flash_attn, torch_varlen, triton, sdpa, reference)
)

PRIORITY: dict[str, tuple[str, ...]] = {
    # cpu_kernel leaves float64 (not its dtype) to cpu.
    "cpu": ("cpu_kernel", "cpu", "sdpa", "reference"),
    "cuda": ("flash_attn", "torch_varlen", "triton", "sdpa", "reference"),
    "npu": ("npu", "reference"),
}
OTHER_DEVICES = ("sdpa", "reference")  # mps, xpu, ...: what runs on every device
