"""Batched ``(B, L, H, D)`` attention turned into packed calls: plain rows, padded rows, packed rows."""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any, NamedTuple, TypeVar

import torch

from ..api import varlen_attention

T = TypeVar("T")


class Offsets(NamedTuple):
    """Prefix sums of the sequence lengths: on the tensors' device and the same as Python ints."""

    device: torch.Tensor
    host: list[int]


def attend_offsets(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_q: Offsets, cu_k: Offsets, **options: Any
) -> torch.Tensor:
    """Packed ``(T, H, D)`` tensors attended with these offsets."""
    return varlen_attention(
        q, k, v, cu_q.device, cu_k.device, cu_seqlens_q_host=cu_q.host, cu_seqlens_k_host=cu_k.host, **options
    )


def attend_rows(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, **options: Any) -> torch.Tensor:
    """``(B, Lq, H, D)`` with every batch row one sequence: offsets from the shapes only, so no device sync."""
    (batch, lq), lk = q.shape[:2], k.shape[1]
    cu_q, cu_k = (Offsets(_arange(batch, n, q.device), [n * b for b in range(batch + 1)]) for n in (lq, lk))
    out = attend_offsets(q.flatten(0, 1), k.flatten(0, 1), v.flatten(0, 1), cu_q, cu_k, **options)
    return out.view(batch, lq, *out.shape[1:])


Rows = tuple[torch.Tensor, Offsets]  # flat indices of the tokens that take part, and their offsets per row


def attend_padded(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, rows_q: Rows | None, rows_k: Rows, **options: Any
) -> torch.Tensor:
    """``(B, Lq, H, D)`` where only the tokens in ``rows_q`` / ``rows_k`` (see :func:`marked_rows`) take part,
    packed into one sequence per batch row; ``rows_q=None`` means every query. Output rows of queries that do
    not take part are 0."""
    (batch, lq), lk = q.shape[:2], k.shape[1]
    q_flat = q.reshape(batch * lq, *q.shape[2:])
    cu_q = Offsets(_arange(batch, lq, q.device), [lq * b for b in range(batch + 1)]) if rows_q is None else rows_q[1]
    out = attend_offsets(
        q_flat if rows_q is None else q_flat.index_select(0, rows_q[0]),
        k.reshape(batch * lk, *k.shape[2:]).index_select(0, rows_k[0]),
        v.reshape(batch * lk, *v.shape[2:]).index_select(0, rows_k[0]),
        cu_q,
        rows_k[1],
        **options,
    )
    if rows_q is None:
        return out.view(batch, lq, *out.shape[1:])
    full = out.new_zeros(batch * lq, *out.shape[1:]).index_copy(0, rows_q[0], out)
    return full.view(batch, lq, *out.shape[1:])


def marked_rows(mask: torch.Tensor) -> Rows:
    """Flat indices of the True entries of a boolean ``(B, L)`` mask and the offsets of each row's count.
    Reads the device (a sync): call it through :func:`memo`."""
    return mask.reshape(-1).nonzero().reshape(-1), offsets_from_lengths(mask.sum(1))


def offsets_from_lengths(lengths: torch.Tensor) -> Offsets:
    host = [0]
    for n in lengths.tolist():
        host.append(host[-1] + int(n))
    return Offsets(torch.tensor(host, dtype=torch.int32, device=lengths.device), host)


def _arange(batch: int, length: int, device: torch.device) -> torch.Tensor:
    if length == 0:
        return torch.zeros(batch + 1, dtype=torch.int32, device=device)
    return torch.arange(0, batch * length + 1, length, dtype=torch.int32, device=device)


_MEMO: list[tuple[Any, int, tuple[Any, ...], Any]] = []


def memo(fn: Callable[..., T], t: torch.Tensor, *args: Any) -> T:
    """``fn(t, *args)``, reused while ``t`` is the same unmodified tensor object: every layer of one forward
    gets the same mask / positions / offsets tensor, so the device is read once per forward, not per layer.

    "Unmodified" is what PyTorch's version counter and data pointer say: writes through another library
    (a NumPy array sharing the memory) are not seen, as autograd does not see them. Inference tensors have no
    version counter, so under ``torch.inference_mode`` nothing is reused."""
    if torch.compiler.is_compiling() or t.is_inference():
        return fn(t, *args)
    key = (fn, t.data_ptr(), *args)
    for ref, version, k, value in _MEMO:
        if ref() is t and version == t._version and k == key:
            return value
    value = fn(t, *args)
    _MEMO.insert(0, (weakref.ref(t), t._version, key, value))
    del _MEMO[8:]
    return value
