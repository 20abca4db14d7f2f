"""Backend registry, dispatch of forwards and of gradient routes with aggregated "why not" errors, :func:`info`."""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from .backends import ALL, OTHER_DEVICES, PRIORITY
from .backends.base import Backend, BackwardFn, Route, autograd_backward
from .errors import InputTypeError
from .inputs import AttentionInputs

__all__ = ["ALL", "BACKENDS", "OTHER_DEVICES", "PRIORITY", "BackendInfo", "backward", "candidates", "info", "select"]

BACKENDS: dict[str, Backend] = {b.name: b for b in ALL}


@dataclass(frozen=True)
class BackendInfo:
    name: str
    available: bool
    reason: str | None
    details: str | None = None  # when available: what was found here (see Backend.details)


def info() -> list[BackendInfo]:
    """Every backend (in the order of ``packattn.backends.ALL``, not a device's priority), with whether it can
    run here and, if not, why."""
    out = []
    for b in ALL:
        reason = b.unavailable_reason()
        out.append(BackendInfo(b.name, reason is None, reason, b.details() if reason is None else None))
    return out


def reasons(backend: Backend, inp: AttentionInputs) -> list[str]:
    """Why ``backend`` cannot run ``inp`` (empty when it can); with ``inp.grad``, that includes having no
    gradient route that serves ``inp`` (an LSE gradient is possible when ``inp.return_lse``)."""
    missing = backend.unavailable_reason()
    if missing:
        return [missing]
    why = backend.supports(inp)
    if not why and inp.grad:
        route, problems = _route(backend, inp, inp.return_lse)
        if route is None:
            why = ["no gradient route serves these inputs: " + "; ".join(problems)]
    return why


def passed_over(backend: Backend, inp: AttentionInputs) -> list[str]:
    """Why automatic dispatch passes ``backend`` over for ``inp``: it cannot run them, or it declines them."""
    why = reasons(backend, inp)
    declined = None if why else backend.declines(inp)
    return [declined] if declined else why


def check_backend_name(name: object, where: str) -> None:
    if name is None:
        return
    if not isinstance(name, str):
        raise InputTypeError(f"{where}: backend must be a str or None, got {type(name).__name__}")
    if name not in BACKENDS:
        raise ValueError(f"{where}: unknown backend {name!r}; expected None or one of {sorted(BACKENDS)}")


def candidates(device: torch.device) -> list[Backend]:
    """The backends dispatch tries for tensors on ``device``, in priority order."""
    return [BACKENDS[n] for n in PRIORITY.get(device.type, OTHER_DEVICES)]


def select(inp: AttentionInputs, name: str | None, where: str) -> Backend:
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
        report.append(f"  {backend.name}: " + "; ".join(why))
    others = [b.name for b in ALL if b not in tried]
    hint = f"\n(not tried on {inp.q.device.type}, only by name: {', '.join(others)})" if others else ""
    raise ValueError(f"{where}: no backend can run these inputs on {inp.q.device.type}:\n" + "\n".join(report) + hint)


def _route_problem(backend: Backend, route: Route, inp: AttentionInputs, lse_grad: bool) -> str | None:
    """Why ``route`` cannot give ``backend``'s gradients for ``inp`` (None when it can)."""
    what = route.describe(backend.name)
    if lse_grad and not route.lse_grad:
        return f"{what} takes no gradient of the LSE (return_lse=True)"
    target = BACKENDS.get(route.name) if route.kind == "backend" else backend
    if target is None:
        return f"{what}: no backend {route.name!r} is registered"
    if route.kind == "backend":
        why = reasons(target, replace(inp, return_lse=True, grad=False))
        if why:
            return f"{what} cannot run them: " + "; ".join(why)
    elif route.kind == "own":
        why = backend.own_backward_reasons(inp)
        if why:
            return f"{what} cannot run them: " + "; ".join(why)
    if inp.deterministic and not target.capabilities.deterministic:
        return f"{what} is not deterministic (deterministic=True)"
    return None


def _route(backend: Backend, inp: AttentionInputs, lse_grad: bool) -> tuple[Route | None, list[str]]:
    problems: list[str] = []
    for route in backend.gradients:
        problem = _route_problem(backend, route, inp, lse_grad)
        if problem is None:
            return route, problems
        problems.append(problem)
    return None, problems


def uses_autograd(backend: Backend, inp: AttentionInputs) -> bool:
    """Whether ``backend``'s gradients for ``inp`` come from PyTorch's autograd through its forward."""
    route, _ = _route(backend, inp, inp.return_lse)
    return route is not None and route.kind == "autograd"


def backward(backend: Backend, inp: AttentionInputs, *, lse_grad: bool, where: str) -> BackwardFn:
    """The function that computes ``backend``'s gradients for ``inp``: the first of its routes that serves
    them (``lse_grad``: the LSE has a gradient), or a ValueError listing why none does."""
    route, problems = _route(backend, inp, lse_grad)
    if route is None:
        raise ValueError(
            f"{where}: no gradient route of backend {backend.name!r} serves these inputs: " + "; ".join(problems)
        )
    if route.kind == "autograd":
        return autograd_backward(backend)
    return (BACKENDS[route.name] if route.kind == "backend" else backend).backward
