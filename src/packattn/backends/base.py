"""What a backend is: a name, declared capabilities, a forward, and how its gradients are computed.

A backend states what it takes once, in :class:`Capabilities`; :func:`standard_reasons` turns that into
the refusal sentences that dispatch errors, ``packattn info`` and the tests show. A backend adds only
reasons of its own (:meth:`Backend.special_reasons`). How its gradients are computed is a list of
:class:`Route` s, tried in order; :mod:`packattn.dispatch` resolves them with reasons, as it does forwards.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Literal

import torch

from ..inputs import FLOAT_DTYPES, AttentionInputs

Grads = tuple[torch.Tensor, torch.Tensor, torch.Tensor]
BackwardFn = Callable[[AttentionInputs, torch.Tensor, torch.Tensor, torch.Tensor, "torch.Tensor | None"], Grads]

_DEVICE_NAMES = {"cpu": "CPU", "cuda": "CUDA"}
_DTYPE_NAMES = {
    torch.float32: "float32",
    torch.float16: "float16",
    torch.bfloat16: "bfloat16",
    torch.float64: "float64",
}


@dataclass(frozen=True)
class Capabilities:
    """What a backend runs. Everything here is checked by :func:`standard_reasons`."""

    devices: tuple[str, ...] | None = None  # device types; None: any
    dtypes: tuple[torch.dtype, ...] = FLOAT_DTYPES
    max_head_dim: int | None = None  # of q/k and of v
    head_dim_v: Literal["any", "equal", "at_most"] = "any"  # v's head dim against q's
    softcap: bool = True
    windows: bool = True  # False: no mask or bottom-right causal only
    lse: bool = True  # returns the LSE when asked
    deterministic: bool = True  # its own backward gives the same bits run to run
    max_heads_q: int | None = None
    max_seqlen: int | None = None  # tokens of one sequence, on either side
    max_tokens: int | None = None  # tokens of one call, on either side


def _either(names: list[str]) -> str:
    return names[0] if len(names) == 1 else ", ".join(names[:-1]) + " or " + names[-1]


def standard_reasons(label: str, caps: Capabilities, inp: AttentionInputs) -> list[str]:
    """Why a backend (called ``label`` in the sentences) with ``caps`` cannot run ``inp``; empty when it can."""
    why = []
    device, mask, layout = inp.q.device, inp.mask, inp.layout
    if caps.devices is not None and device.type not in caps.devices:
        devices = _either([_DEVICE_NAMES.get(d, d) for d in caps.devices])
        why.append(f"{label} runs on {devices} tensors only, got {device}")
    if inp.q.dtype not in caps.dtypes:
        why.append(f"{label} takes {_either([_DTYPE_NAMES[d] for d in caps.dtypes])} only, got {inp.q.dtype}")
    d, dv = inp.head_dim, inp.head_dim_v
    if caps.head_dim_v == "equal" and dv != d:
        why.append(f"{label} needs v's head_dim equal to q's, got D={d} and Dv={dv}")
    elif caps.head_dim_v == "at_most" and dv > d:
        why.append(f"{label} needs v's head_dim at most q's, got D={d} and Dv={dv}")
    if caps.max_head_dim is not None and max(d, dv) > caps.max_head_dim:
        why.append(f"{label} takes head dims up to {caps.max_head_dim}, got D={d} and Dv={dv}")
    if caps.max_heads_q is not None and inp.heads_q > caps.max_heads_q:
        why.append(f"{label} takes at most {caps.max_heads_q} query heads, got {inp.heads_q}")
    if caps.max_seqlen is not None and (longest := max(layout.max_q, layout.max_k)) > caps.max_seqlen:
        why.append(f"{label} takes sequences of at most {caps.max_seqlen} tokens, got one of {longest}")
    if caps.max_tokens is not None and (total := max(layout.total_q, layout.total_k)) > caps.max_tokens:
        why.append(f"{label} takes at most {caps.max_tokens} tokens per call, got {total}")
    if not caps.softcap and mask.softcap > 0:
        why.append(f"{label} has no soft-capping (softcap={mask.softcap})")
    if not caps.windows and (mask.left >= 0 or mask.right > 0):
        why.append(f"{label} has no sliding window (window_size=({mask.left}, {mask.right})); only causal or none")
    if not caps.lse and inp.return_lse:
        why.append(f"{label} returns no LSE (return_lse=True)")
    return why


@dataclass(frozen=True)
class Route:
    """One way of computing a backend's gradients.

    ``kind="own"``: the backend's :meth:`Backend.backward`; ``"backend"``: the backward of the backend
    called ``name``, when that one runs the inputs; ``"autograd"``: PyTorch's autograd through the
    forward. ``lse_grad=False``: the route takes no gradient of the LSE, so it serves only calls where
    the LSE has none.
    """

    kind: Literal["own", "backend", "autograd"]
    name: str = ""
    lse_grad: bool = True

    def describe(self, owner: str) -> str:
        return {"own": f"{owner}'s own backward", "backend": f"the {self.name} backward", "autograd": "autograd"}[
            self.kind
        ]


OWN = Route("own")
OWN_WITHOUT_LSE_GRAD = Route("own", lse_grad=False)
AUTOGRAD = Route("autograd", lse_grad=False)


def backward_of(name: str) -> Route:
    """The route through backend ``name``'s backward."""
    return Route("backend", name)


class Backend:
    """One attention implementation. A backend sets ``name``, ``capabilities``, ``gradients`` and
    :meth:`forward`; it overrides :meth:`backward` when ``gradients`` lists :data:`OWN`, and may override
    :meth:`unavailable_reason`, :meth:`special_reasons` and :meth:`declines`."""

    name: str = ""
    label: str = ""  # what its sentences call it (the kernel it wraps); empty: its name
    capabilities: Capabilities = Capabilities()
    gradients: tuple[Route, ...] = (OWN,)

    def __init_subclass__(cls) -> None:
        super().__init_subclass__()
        if AUTOGRAD in cls.gradients and cls.capabilities.lse:
            # Autograd through the forward differentiates the output only; an LSE needs a backward taking its
            # gradient (and ring attention's, which recomputes blocks from the merged LSE).
            raise TypeError(f"backend {cls.name!r}: gradients by autograd need capabilities.lse=False")

    def unavailable_reason(self) -> str | None:
        """Why this backend cannot run at all here (not installed, not built, ...); None when it can."""
        return None

    def details(self) -> str | None:
        """What ``packattn info`` adds when it is available: what was found here and which kernel serves what."""
        return None

    def supports(self, inp: AttentionInputs) -> list[str]:
        """Why it cannot run ``inp`` (readable sentences); empty when it can."""
        return standard_reasons(self.label or self.name, self.capabilities, inp) + self.special_reasons(inp)

    def special_reasons(self, inp: AttentionInputs) -> list[str]:
        """Its reasons beyond what :class:`Capabilities` declares."""
        return []

    def own_backward_reasons(self, inp: AttentionInputs) -> list[str]:
        """Why its own backward (a route of kind ``"own"``) cannot serve ``inp``, e.g. an older library."""
        return []

    def declines(self, inp: AttentionInputs) -> str | None:
        """Why automatic dispatch should pass ``inp``, which it runs, to the next backend (it runs them
        slower than that one); None to take them. By name it still runs them."""
        return None

    def forward(self, inp: AttentionInputs) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``out (Tq, Hq, Dv)`` in q's dtype and the LSE ``(Hq, Tq)``, or None when ``inp.return_lse`` is not set."""
        raise NotImplementedError

    def backward(
        self, inp: AttentionInputs, out: torch.Tensor, lse: torch.Tensor, dout: torch.Tensor, dlse: torch.Tensor | None
    ) -> Grads:
        """Gradients of ``q, k, v`` from the output, the LSE and their gradients (``dlse`` None: none)."""
        raise NotImplementedError(f"backend {self.name!r} has no backward of its own")

    def __repr__(self) -> str:
        return f"<packattn backend {self.name!r}>"


def autograd_backward(backend: Backend) -> BackwardFn:
    """Gradients through the output by autograd of ``backend``'s forward, recomputed. Plain torch.autograd
    records nothing inside a custom op's backward (the dispatcher excludes autograd there); torch.func does."""

    def backward(
        inp: AttentionInputs, out: torch.Tensor, lse: torch.Tensor, dout: torch.Tensor, dlse: torch.Tensor | None
    ) -> Grads:
        def forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            return backend.forward(replace(inp, q=q, k=k, v=v))[0]

        vjp = torch.func.vjp(forward, inp.q, inp.k, inp.v)[1]
        dq, dk, dv = vjp(dout)
        return dq, dk, dv

    return backward
