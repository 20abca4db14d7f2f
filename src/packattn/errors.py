"""The exception classes of packattn's input checks."""

from __future__ import annotations

__all__ = ["InputTypeError"]


class InputTypeError(TypeError, ValueError):
    """A bad input's type (an argument of the wrong type or dtype). Both a ``TypeError`` and a ``ValueError``,
    so that ``except ValueError`` catches every bad input of every entry point, as callers of the kernels
    packattn replaces expect (sglang's raises ``ValueError`` for those), and ``except TypeError`` still works."""
