"""What a user would run instead of packattn, each written the way its documentation suggests.

``prepare(workload, q, k, v)`` returns a zero-argument callable that computes the packed output
``(Tq, Hq, D)`` on the device of ``q`` (differentiably: ``packattn bench --backward`` times forward and
backward), plus setup timings (mask building, compilation) that are reported apart. A peer that cannot run a
workload raises :class:`Unsupported` with the reason.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

import packattn
from packattn import dispatch
from packattn.inputs import MaskSpec, check_mask, needs_grad
from packattn.ops import _inputs

from .workloads import Workload

Run = Callable[[], torch.Tensor]


class Unsupported(Exception):
    pass


# SDPA takes grouped K/V heads itself from torch 2.5 on (``enable_gqa``); before, they are repeated.
SDPA_GQA = torch.torch_version.TorchVersion(torch.__version__) >= "2.5"


def _sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, **options: object) -> torch.Tensor:
    """SDPA on ``(..., H, L, D)`` with ``Hq`` a multiple of ``Hkv`` (grouped heads)."""
    g = q.shape[-3] // k.shape[-3]
    if g > 1 and SDPA_GQA:
        return F.scaled_dot_product_attention(q, k, v, enable_gqa=True, **options)  # type: ignore[arg-type]
    if g > 1:
        k, v = k.repeat_interleave(g, -3), v.repeat_interleave(g, -3)
    return F.scaled_dot_product_attention(q, k, v, **options)  # type: ignore[arg-type]


def _bottom_right(lq: int, lk: int, device: torch.device) -> torch.Tensor:
    return MaskSpec(1.0, -1, 0).visible(torch.arange(lq, device=device), torch.arange(lk, device=device), lq, lk)


def per_sequence_sdpa(wl: Workload, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[Run, dict]:
    """A loop over sequences calling SDPA (``enable_gqa`` for grouped heads). The sequences are taken with
    ``split``, whose backward assembles the gradient once (a slice per sequence would add a zero-padded
    gradient of the whole tensor per sequence)."""
    masks = {}
    for lq, lk in zip(wl.lens_q, wl.lens_k):
        if wl.causal and lq != lk and lq > 1 and (lq, lk) not in masks:
            masks[lq, lk] = _bottom_right(lq, lk, q.device)

    def run() -> torch.Tensor:
        outs = []
        for qs, ks, vs in zip(q.split(wl.lens_q), k.split(wl.lens_k), v.split(wl.lens_k), strict=True):
            # 4-D (1, H, L, D) views: PyTorch's fused CPU kernel takes them without copies (3-D falls to math).
            qb, kb, vb = (t.transpose(0, 1)[None] for t in (qs, ks, vs))
            lq, lk = qb.shape[2], kb.shape[2]
            causal = wl.causal and lq == lk
            outs.append(_sdpa(qb, kb, vb, attn_mask=masks.get((lq, lk)), is_causal=causal)[0].transpose(0, 1))
        return torch.cat(outs)

    return run, {}


def padded_sdpa(wl: Workload, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[Run, dict]:
    """Pad to ``(B, H, Lmax, D)`` and call SDPA once with a boolean mask (padding + causal)."""
    b, lq_max, lk_max = len(wl.lens_q), max(wl.lens_q), max(wl.lens_k)
    need = b * wl.heads_q * lq_max * lk_max * 4 * 3
    if need > 8 * 2**30:
        raise Unsupported(f"the padded score matrices would need {need / 2**30:.0f} GiB")
    dev = q.device
    lens_q, lens_k = torch.tensor(wl.lens_q, device=dev), torch.tensor(wl.lens_k, device=dev)
    i, j = torch.arange(lq_max, device=dev), torch.arange(lk_max, device=dev)
    q_idx = (torch.tensor(wl.cu_q[:-1], device=dev)[:, None] + i).clamp(max=max(q.shape[0] - 1, 0))
    k_idx = (torch.tensor(wl.cu_k[:-1], device=dev)[:, None] + j).clamp(max=max(k.shape[0] - 1, 0))
    q_ok = i[None, :] < lens_q[:, None]
    mask = (j[None, None, :] < lens_k[:, None, None]).expand(b, lq_max, lk_max)
    if wl.causal:
        mask = mask & (j[None, None, :] <= i[None, :, None] + (lens_k - lens_q)[:, None, None])
    mask = mask[:, None]

    def run() -> torch.Tensor:
        qp = q[q_idx].transpose(1, 2)
        kp = k[k_idx].transpose(1, 2)
        vp = v[k_idx].transpose(1, 2)
        return _sdpa(qp, kp, vp, attn_mask=mask).transpose(1, 2)[q_ok]

    return run, {}


def nested_jagged_sdpa(wl: Workload, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[Run, dict]:
    """SDPA on nested jagged tensors (``torch.nested``, layout=torch.jagged)."""
    if wl.causal:
        raise Unsupported("SDPA on nested jagged tensors rejects is_causal=True")
    g = wl.heads_q // wl.heads_kv
    off_q, off_k = torch.tensor(wl.cu_q, device=q.device), torch.tensor(wl.cu_k, device=q.device)

    def run() -> torch.Tensor:
        # Nested jagged SDPA takes no enable_gqa: grouped K/V heads are repeated.
        kk, vv = (k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)) if g > 1 else (k, v)
        nq = torch.nested.nested_tensor_from_jagged(q, off_q).transpose(1, 2)
        nk = torch.nested.nested_tensor_from_jagged(kk, off_k).transpose(1, 2)
        nv = torch.nested.nested_tensor_from_jagged(vv, off_k).transpose(1, 2)
        return F.scaled_dot_product_attention(nq, nk, nv).transpose(1, 2).values()

    try:
        run()
    except Exception as e:
        raise Unsupported(f"{type(e).__name__}: {str(e).splitlines()[0][:120]}") from None
    return run, {}


def flex_attention(wl: Workload, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[Run, dict]:
    """Compiled FlexAttention with a document ``BlockMask`` over the packed batch (B=1)."""
    try:
        from torch.nn.attention.flex_attention import create_block_mask
        from torch.nn.attention.flex_attention import flex_attention as flex
    except ImportError as e:
        raise Unsupported(f"torch {torch.__version__} has no FlexAttention ({e})") from None
    dev = q.device
    doc_q = torch.repeat_interleave(torch.arange(len(wl.lens_q), device=dev), torch.tensor(wl.lens_q, device=dev))
    doc_k = torch.repeat_interleave(torch.arange(len(wl.lens_k), device=dev), torch.tensor(wl.lens_k, device=dev))
    start_q, start_k = torch.tensor(wl.cu_q[:-1], device=dev), torch.tensor(wl.cu_k[:-1], device=dev)
    shift = torch.tensor(wl.lens_k, device=dev) - torch.tensor(wl.lens_q, device=dev)
    causal = wl.causal

    def document(b, h, qi, kj):
        same = doc_q[qi] == doc_k[kj]
        if not causal:
            return same
        d = doc_q[qi]
        return same & (kj - start_k[d] <= qi - start_q[d] + shift[d])

    t0 = time.perf_counter()
    try:
        block_mask = create_block_mask(document, None, None, q.shape[0], k.shape[0], device=str(dev))
    except Exception as e:
        raise Unsupported(f"create_block_mask failed: {type(e).__name__}: {str(e)[:120]}") from None
    t_mask = time.perf_counter() - t0
    compiled = torch.compile(flex, dynamic=False)
    gqa = wl.heads_q != wl.heads_kv

    def run() -> torch.Tensor:
        o = compiled(
            q.transpose(0, 1)[None],
            k.transpose(0, 1)[None],
            v.transpose(0, 1)[None],
            block_mask=block_mask,
            enable_gqa=gqa,
        )
        return o[0].transpose(0, 1)

    t0 = time.perf_counter()
    try:
        run()
    except Exception as e:
        raise Unsupported(f"compile/run failed: {type(e).__name__}: {str(e).splitlines()[0][:120]}") from None
    return run, {"mask_s": t_mask, "compile_s": time.perf_counter() - t0}


def _device_offsets(wl: Workload, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    return (
        torch.tensor(wl.cu_q, dtype=torch.int32, device=device),
        torch.tensor(wl.cu_k, dtype=torch.int32, device=device),
    )


def flash_attn_varlen(wl: Workload, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[Run, dict]:
    """flash-attn 2's ``flash_attn_varlen_func``, called directly (CUDA, fp16/bf16)."""
    try:
        from flash_attn import flash_attn_varlen_func
    except ImportError as e:
        raise Unsupported(f"flash_attn does not import ({e})") from None
    if q.device.type != "cuda" or q.dtype == torch.float32:
        raise Unsupported("flash_attn runs fp16/bf16 on CUDA only")
    cu_q, cu_k = _device_offsets(wl, q.device)
    max_q, max_k = max(wl.lens_q), max(wl.lens_k)
    return lambda: flash_attn_varlen_func(q, k, v, cu_q, cu_k, max_q, max_k, causal=wl.causal), {}


def torch_varlen(wl: Workload, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[Run, dict]:
    """PyTorch's ``torch.nn.attention.varlen.varlen_attn``, called directly (CUDA, fp16/bf16)."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError as e:
        raise Unsupported(f"torch {torch.__version__} has no varlen_attn ({e})") from None
    if q.device.type != "cuda" or q.dtype == torch.float32:
        raise Unsupported("varlen_attn runs fp16/bf16 on CUDA only")
    cu_q, cu_k = _device_offsets(wl, q.device)
    max_q, max_k, gqa = max(wl.lens_q), max(wl.lens_k), wl.heads_q != wl.heads_kv
    window = (-1, 0) if wl.causal else (-1, -1)

    def run() -> torch.Tensor:
        out = varlen_attn(q, k, v, cu_q, cu_k, max_q, max_k, window_size=window, enable_gqa=gqa)
        assert isinstance(out, torch.Tensor)  # only return_aux adds the LSE
        return out

    return run, {}


def packattn_backend(name: str | None):
    def prepare(wl: Workload, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[Run, dict]:
        cu_q, cu_k = _device_offsets(wl, q.device)
        host_q, host_k = wl.cu_q, wl.cu_k
        # A compiled backend builds on first use (cpu_kernel: about 30 s): here, not in a timed run.
        for backend in [dispatch.BACKENDS[name]] if name else dispatch.candidates(q.device):
            backend.unavailable_reason()
        mask = check_mask(q, softmax_scale=None, causal=wl.causal, window_size=(-1, -1), softcap=0.0, where="bench")
        inp = _inputs(q, k, v, cu_q, cu_k, host_q, host_k, mask, False, needs_grad(q, k, v), False)
        if name:
            why = dispatch.reasons(dispatch.BACKENDS[name], inp)
            if why:
                raise Unsupported("; ".join(why))
        chosen = name or dispatch.select(inp, None, "bench").name

        def run() -> torch.Tensor:
            return packattn.varlen_attention(
                q,
                k,
                v,
                cu_q,
                cu_k,
                cu_seqlens_q_host=host_q,
                cu_seqlens_k_host=host_k,
                causal=wl.causal,
                backend=name,
            )

        return run, {"backend": chosen}

    return prepare


# Name -> (prepare, is an external peer, device types it is run on by default; None: every device, (): only
# when named). packattn's own backends are timed for context, not as peers.
IMPLEMENTATIONS: dict[str, tuple[Callable[..., tuple[Run, dict]], bool, tuple[str, ...] | None]] = {
    "packattn": (packattn_backend(None), False, None),
    "packattn triton": (packattn_backend("triton"), False, ("cuda",)),
    "packattn cpu_kernel": (packattn_backend("cpu_kernel"), False, ()),  # the CPU default but for float64
    "packattn cpu": (packattn_backend("cpu"), False, ()),
    "flash-attn": (flash_attn_varlen, True, ("cuda",)),
    "torch varlen": (torch_varlen, True, ("cuda",)),
    "per-seq SDPA": (per_sequence_sdpa, True, None),
    "padded SDPA": (padded_sdpa, True, None),
    "flex (compiled)": (flex_attention, True, None),
    "nested SDPA": (nested_jagged_sdpa, True, None),
    "packattn reference": (packattn_backend("reference"), False, ("cpu",)),
}


def default_impls(device: str) -> list[str]:
    return [name for name, (_, _, devices) in IMPLEMENTATIONS.items() if devices is None or device in devices]
