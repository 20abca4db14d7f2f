"""Parse and validate ``cu_seqlens`` into one frozen :class:`SeqLayout`, and the plans derived from one."""

from __future__ import annotations

import functools
import operator
from collections import OrderedDict
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass
from typing import TypeVar

import torch

from .errors import InputTypeError

_INDEX_DTYPES = (torch.int32, torch.int64)
T = TypeVar("T")
# Plans of the most recent layouts: a model's layers call attention many times on one batch layout.
_PLANS: OrderedDict[tuple[object, ...], object] = OrderedDict()
PLAN_CACHE_SIZE = 64


@dataclass(frozen=True)
class SeqLayout:
    """Where each sequence of a packed batch lives.

    ``cu_q``/``cu_k`` are the caller's offset tensors (any device); ``host_q``/``host_k`` are the same
    offsets as Python ints, so that planning never waits on the device.
    """

    cu_q: torch.Tensor
    cu_k: torch.Tensor
    host_q: tuple[int, ...]
    host_k: tuple[int, ...]

    @property
    def batch(self) -> int:
        return len(self.host_q) - 1

    @property
    def total_q(self) -> int:
        return self.host_q[-1]

    @property
    def total_k(self) -> int:
        return self.host_k[-1]

    def seqlens_q(self) -> list[int]:
        return list(self._lengths_q)

    def seqlens_k(self) -> list[int]:
        return list(self._lengths_k)

    @functools.cached_property
    def _lengths_q(self) -> tuple[int, ...]:
        return tuple(map(operator.sub, self.host_q[1:], self.host_q))

    @functools.cached_property
    def _lengths_k(self) -> tuple[int, ...]:
        return tuple(map(operator.sub, self.host_k[1:], self.host_k))

    @functools.cached_property
    def max_q(self) -> int:
        return max(self._lengths_q, default=0)

    @functools.cached_property
    def max_k(self) -> int:
        return max(self._lengths_k, default=0)

    def sequences(self) -> list[tuple[int, int, int, int]]:
        """``(q_start, q_end, k_start, k_end)`` for every sequence."""
        hq, hk = self.host_q, self.host_k
        return list(zip(hq, hq[1:], hk, hk[1:], strict=False))

    def plan(self, key: Hashable, build: Callable[[], T]) -> T:
        """``build()``, computed once for these offsets and ``key`` (what else it depends on: the mask, a
        device, a block size) and kept for the next calls on the same layout (a model's other layers); the
        most recent :data:`PLAN_CACHE_SIZE` plans are kept. ``build`` must depend on nothing else."""
        full = (self.host_q, self.host_k, key)
        if full in _PLANS:
            _PLANS.move_to_end(full)
            return _PLANS[full]  # type: ignore[return-value]
        value = build()
        _PLANS[full] = value
        if len(_PLANS) > PLAN_CACHE_SIZE:
            _PLANS.popitem(last=False)
        return value

    @staticmethod
    def build(
        cu_seqlens_q: object,
        cu_seqlens_k: object,
        total_q: int,
        total_k: int,
        *,
        cu_seqlens_q_host: Sequence[int] | None = None,
        cu_seqlens_k_host: Sequence[int] | None = None,
        where: str = "varlen_attention",
    ) -> SeqLayout:
        """Validate the offsets against the token counts and return the layout.

        Without host copies the offsets are read from the device once (a sync); host copies, when given,
        are trusted to equal the device tensors and only checked for consistency with the token counts.
        """
        cu_q = _check_cu(cu_seqlens_q, "cu_seqlens_q", where)
        cu_k = _check_cu(cu_seqlens_k, "cu_seqlens_k", where)
        host_q = _host_offsets(cu_q, cu_seqlens_q_host, "cu_seqlens_q", where)
        host_k = _host_offsets(cu_k, cu_seqlens_k_host, "cu_seqlens_k", where)
        # Name what the offsets were read from: a host copy, when given, is what gets checked and used.
        name_q = "cu_seqlens_q" if cu_seqlens_q_host is None else "cu_seqlens_q_host"
        name_k = "cu_seqlens_k" if cu_seqlens_k_host is None else "cu_seqlens_k_host"
        _check_offsets(host_q, total_q, name_q, "q.shape[0]", where)
        _check_offsets(host_k, total_k, name_k, "k.shape[0]", where)
        if len(host_q) != len(host_k):
            raise ValueError(
                f"{where}: cu_seqlens_q and cu_seqlens_k must describe the same number of sequences, "
                f"got {len(host_q) - 1} and {len(host_k) - 1} (lengths {len(host_q)} and {len(host_k)})"
            )
        return SeqLayout(cu_q, cu_k, host_q, host_k)


def _check_cu(cu: object, name: str, where: str) -> torch.Tensor:
    if cu is None:
        raise InputTypeError(f"{where}: {name} is required (a 1-D int32/int64 tensor of B + 1 offsets), got None")
    if not isinstance(cu, torch.Tensor):
        raise InputTypeError(f"{where}: {name} must be a torch.Tensor of int32/int64 offsets, got {type(cu).__name__}")
    if cu.dtype not in _INDEX_DTYPES:
        raise InputTypeError(f"{where}: {name} must have dtype int32 or int64, got {cu.dtype}")
    if cu.dim() != 1:
        raise ValueError(f"{where}: {name} must be 1-D (B + 1 offsets), got shape {tuple(cu.shape)}")
    if cu.numel() < 2:
        raise ValueError(f"{where}: {name} must have at least 2 entries (B + 1 with B >= 1), got {cu.numel()}")
    return cu


def _host_offsets(cu: torch.Tensor, host: Sequence[int] | None, name: str, where: str) -> tuple[int, ...]:
    if host is None:
        if cu.device.type == "meta":
            raise ValueError(f"{where}: {name} is on the meta device and holds no values; pass {name}_host")
        return tuple(int(x) for x in cu.tolist())
    return _host_values(cu, host, name, where, (int,))


def _host_values(
    cu: torch.Tensor, host: Sequence[int], name: str, where: str, kinds: tuple[type, ...]
) -> tuple[int, ...]:
    if isinstance(host, torch.Tensor):
        raise InputTypeError(f"{where}: {name}_host must be a list/tuple of Python ints, got a torch.Tensor")
    try:
        values = tuple(host)
    except TypeError:
        raise InputTypeError(f"{where}: {name}_host must be a list/tuple of ints, got {type(host).__name__}") from None
    plain = set(map(type, values)) <= {int}  # the common case, checked without a Python-level loop
    if not plain and not all(isinstance(x, kinds) and not isinstance(x, bool) for x in values):
        raise InputTypeError(f"{where}: {name}_host must hold only Python ints, got {values!r}")
    if len(values) != cu.numel():
        raise ValueError(f"{where}: {name}_host must have the same length as {name} ({cu.numel()}), got {len(values)}")
    return values


def check_traced(
    cu_seqlens_q: object,
    cu_seqlens_k: object,
    cu_seqlens_q_host: Sequence[int] | None,
    cu_seqlens_k_host: Sequence[int] | None,
    where: str,
) -> tuple[list[int] | None, list[int] | None]:
    """The checks of :meth:`SeqLayout.build` that need no offset values (types, dtypes, lengths), for tracing
    under ``torch.compile``; the value checks run when the op does. Returns the host copies as lists, whose
    entries may be ``SymInt`` there."""
    cu_q = _check_cu(cu_seqlens_q, "cu_seqlens_q", where)
    cu_k = _check_cu(cu_seqlens_k, "cu_seqlens_k", where)
    hosts = []
    for cu, host, name in ((cu_q, cu_seqlens_q_host, "cu_seqlens_q"), (cu_k, cu_seqlens_k_host, "cu_seqlens_k")):
        hosts.append(None if host is None else list(_host_values(cu, host, name, where, (int, torch.SymInt))))
    if cu_q.numel() != cu_k.numel():
        raise ValueError(
            f"{where}: cu_seqlens_q and cu_seqlens_k must describe the same number of sequences, "
            f"got {cu_q.numel() - 1} and {cu_k.numel() - 1} (lengths {cu_q.numel()} and {cu_k.numel()})"
        )
    return hosts[0], hosts[1]


def _check_offsets(host: tuple[int, ...], total: int, name: str, total_name: str, where: str) -> None:
    if host[0] != 0:
        raise ValueError(f"{where}: {name} must start at 0, got {host[0]}")
    if not all(map(operator.le, host, host[1:])):
        b = next(b for b in range(len(host) - 1) if host[b + 1] < host[b])
        raise ValueError(
            f"{where}: {name} must be non-decreasing, got {host[b]} then {host[b + 1]} at positions {b} and {b + 1}"
        )
    if host[-1] != total:
        raise ValueError(f"{where}: {name} must end at {total_name} ({total}), got {host[-1]}")
