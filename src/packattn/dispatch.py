"""Backend registry, dispatch with aggregated "why not" errors, and :func:`info`."""

from __future__ import annotations

from dataclasses import dataclass
from types import ModuleType

import torch

from .backends import ALL, OTHER_DEVICES, PRIORITY

__all__ = ["ALL", "BACKENDS", "OTHER_DEVICES", "PRIORITY", "BackendInfo", "candidates", "info", "select"]
from .inputs import AttentionInputs

BACKENDS: dict[str, ModuleType] = {b.NAME: b for b in ALL}


@dataclass(frozen=True)
class BackendInfo:
    name: str
    available: bool
    reason: str | None


def info() -> list[BackendInfo]:
    """Every backend in priority order, with whether it can run here and, if not, why."""
    out = []
    for b in ALL:
        reason = b.unavailable_reason()
        out.append(BackendInfo(b.NAME, reason is None, reason))
    return out


def reasons(backend: ModuleType, inp: AttentionInputs) -> list[str]:
    """Why ``backend`` cannot run ``inp`` (empty when it can)."""
    missing = backend.unavailable_reason()
    return [missing] if missing else list(backend.supports(inp))


def passed_over(backend: ModuleType, inp: AttentionInputs) -> list[str]:
    """Why automatic dispatch passes ``backend`` over for ``inp``: it cannot run them, or it declines them."""
    why = reasons(backend, inp)
    declined = None if why or not hasattr(backend, "declines") else backend.declines(inp)
    return [declined] if declined else why


def check_backend_name(name: object, where: str) -> None:
    if name is None:
        return
    if not isinstance(name, str):
        raise TypeError(f"{where}: backend must be a str or None, got {type(name).__name__}")
    if name not in BACKENDS:
        raise ValueError(f"{where}: unknown backend {name!r}; expected None or one of {sorted(BACKENDS)}")


def candidates(device: torch.device) -> list[ModuleType]:
    """The backends dispatch tries for tensors on ``device``, in priority order."""
    return [BACKENDS[n] for n in PRIORITY.get(device.type, OTHER_DEVICES)]


def select(inp: AttentionInputs, name: str | None, where: str) -> ModuleType:
    """The backend to run: ``name`` if given (never replaced), else the first of the device's candidates
    that supports ``inp`` and does not decline it."""
    if name is not None:
        backend = BACKENDS[name]
        why = reasons(backend, inp)
        if why:
            raise ValueError(f"{where}: backend={name!r} cannot run these inputs: " + "; ".join(why))
        return backend
    report = []
    tried = candidates(inp.q.device)
    for backend in tried:
        why = passed_over(backend, inp)
        if not why:
            return backend
        report.append(f"  {backend.NAME}: " + "; ".join(why))
    others = [b.NAME for b in ALL if b not in tried]
    hint = f"\n(not tried on {inp.q.device.type}, only by name: {', '.join(others)})" if others else ""
    raise ValueError(f"{where}: no backend can run these inputs on {inp.q.device.type}:\n" + "\n".join(report) + hint)
