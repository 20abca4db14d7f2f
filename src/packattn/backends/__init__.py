"""Backends: modules with ``NAME``, ``NATIVE_AUTOGRAD``, ``unavailable_reason()``, ``supports(inp)``,
``forward(inp) -> (out, lse)`` and, unless ``NATIVE_AUTOGRAD``, ``backward(inp, out, lse, dout, dlse)``;
optionally ``declines(inp) -> str | None``: why automatic dispatch should pass inputs that the backend can
run on to the next one (measured slower there; by name it still runs them).

``ALL`` is every backend, in the order ``packattn info`` lists them. ``PRIORITY`` is the order in which
dispatch tries them for tensors of each device type (the first that supports the inputs wins); a backend
outside a device's list runs there only when asked for by name (``backend="..."``).
"""

from . import cpu, cpu_kernel, flash_attn, npu, reference, sdpa, torch_varlen, triton

ALL = (cpu_kernel, cpu, npu, flash_attn, torch_varlen, triton, sdpa, reference)

PRIORITY: dict[str, tuple[str, ...]] = {
    # cpu_kernel: 1.1-3x the per-sequence SDPA loop, forward and backward (benchmarks/README.md); it declines
    # decode batches, float64 is not its own: both go to cpu.
    "cpu": ("cpu_kernel", "cpu", "sdpa", "reference"),
    "cuda": ("flash_attn", "torch_varlen", "triton", "sdpa", "reference"),
    "npu": ("npu", "reference"),
}
OTHER_DEVICES = ("sdpa", "reference")  # mps, xpu, ...: what runs on every device
