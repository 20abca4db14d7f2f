"""The benchmark workloads: seeded packed batches that stand for real runtimes."""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from ..inputs import MaskSpec


@dataclass(frozen=True)
class Workload:
    name: str
    title: str
    lens_q: tuple[int, ...]
    lens_k: tuple[int, ...]
    heads_q: int
    heads_kv: int
    head_dim: int
    causal: bool

    @property
    def cu_q(self) -> list[int]:
        return _offsets(self.lens_q)

    @property
    def cu_k(self) -> list[int]:
        return _offsets(self.lens_k)

    @property
    def mask(self) -> MaskSpec:
        return MaskSpec(self.head_dim**-0.5, -1, 0 if self.causal else -1)

    def visible_pairs(self) -> int:
        return sum(self.mask.visible_pairs(lq, lk) for lq, lk in zip(self.lens_q, self.lens_k))

    def flops(self) -> int:
        """``4 * D * Hq * visible (q, k) pairs`` (two matmuls of 2 flops per multiply-add)."""
        return 4 * self.head_dim * self.heads_q * self.visible_pairs()

    def describe(self) -> str:
        b = len(self.lens_q)
        heads = f"{self.heads_q}" if self.heads_q == self.heads_kv else f"{self.heads_q}/{self.heads_kv}"
        return (
            f"{b} seqs, {sum(self.lens_q)} q / {sum(self.lens_k)} k tokens, heads {heads}, "
            f"D={self.head_dim}, {'causal' if self.causal else 'non-causal'}"
        )

    def tensors(self, dtype: torch.dtype, seed: int = 0, device: str = "cpu") -> tuple[torch.Tensor, ...]:
        gen = torch.Generator().manual_seed(seed)
        tq, tk = sum(self.lens_q), sum(self.lens_k)
        q = torch.randn(tq, self.heads_q, self.head_dim, generator=gen).to(device, dtype)
        k = torch.randn(tk, self.heads_kv, self.head_dim, generator=gen).to(device, dtype)
        v = torch.randn(tk, self.heads_kv, self.head_dim, generator=gen).to(device, dtype)
        return q, k, v

    def capped(self, length: int, count: int = 8) -> Workload:
        """The first ``count`` sequences with both sides cut to at most ``length``: the same kind of problem,
        small enough for the full float64 oracle (gradients are checked on it)."""
        lq, lk = self.lens_q[:count], self.lens_k[:count]
        return replace(self, lens_q=tuple(min(n, length) for n in lq), lens_k=tuple(min(n, length) for n in lk))


def _offsets(lens: tuple[int, ...]) -> list[int]:
    cu = [0]
    for n in lens:
        cu.append(cu[-1] + n)
    return cu


def _uniform(n: int, lo: int, hi: int, seed: int) -> tuple[int, ...]:
    gen = torch.Generator().manual_seed(seed)
    return tuple(torch.randint(lo, hi + 1, (n,), generator=gen).tolist())


def workloads(quick: bool = False) -> list[Workload]:
    """W1-W6; ``quick`` shrinks every workload (same shapes of problem, less work) for a short run."""
    s = 4 if quick else 1
    w2 = _uniform(32 // s, 16, 1024, seed=2)
    w3 = _uniform(512 // s, 1, 64, seed=3)
    w6 = _uniform(64 // s, 512, 4096, seed=6)
    return [
        Workload("W1", "video diffusion", (4096 // s,) * 2, (4096 // s,) * 2, 24, 24, 128, False),
        Workload("W2", "mixed prefill", w2, w2, 32, 8, 128, True),
        Workload("W3", "many short", w3, w3, 16, 16, 64, False),
        Workload("W4", "cross-attention", (1024 // s,) * 4, (77,) * 4, 16, 16, 64, False),
        Workload("W5", "long causal", (16384 // s,), (16384 // s,), 16, 16, 128, True),
        Workload("W6", "GQA decode", (1,) * len(w6), w6, 32, 8, 128, True),
    ]
