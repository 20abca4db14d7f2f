"""Backends: modules with ``NAME``, ``NATIVE_AUTOGRAD``, ``unavailable_reason()``, ``supports(inp)``,
``forward(inp) -> (out, lse)`` and, unless ``NATIVE_AUTOGRAD``, ``backward(inp, out, lse, dout, dlse)``.

They are listed in dispatch priority order; each one's ``supports`` rejects the devices it does not serve.
"""

from . import cpu, reference, sdpa

ALL = (cpu, sdpa, reference)
