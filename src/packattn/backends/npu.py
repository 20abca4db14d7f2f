"""Ascend NPU attention through ``torch_npu``'s fused kernels, in the packed TND layout.

Two documented kernels run a packed batch in one call each:

* ``torch_npu.npu_fused_infer_attention_score`` (FIA) for inference, when its TND limits hold. They depend
  on the generation of CANN's kernels, probed once per process (:func:`stack`) from CANN's version
  (``torch_npu.npu.utils.get_cann_version``) and, from CANN 8.3 on, one trial call of the newer split-fuse
  kernels (fp16, grouped heads, head dim 256), checked against a plain computation:

  - before CANN 8.1, or of unknown version (``get_cann_version`` answers "" before 8.1): FIA is not used,
    its TND layout came with 8.1;
  - CANN 8.1 and 8.2: bfloat16, Q/K head dim 192 with V head dim 128 or 192, equal query and key/value
    heads in {8, 16, 32, 64, 128}, no mask or causal (``sparse_mode`` 0 or 3, no band mode), causal only
    where every sequence has fewer queries than keys;
  - CANN 8.3: bfloat16, head dims (64, 64), (128, 128) or 192 with V 128/192, up to 128 query heads,
    grouped heads (at most 64 per KV head) except with V head dim 192, causal where no sequence has more
    queries than keys, windows (band mode) only with V head dim 64 or 128. The documentation of 8.3 lists
    head dims 128 and 192 and causal with fewer queries than keys; the kernels' tiling checks
    (``prompt_flash_attention_tiling.cpp`` in CANN's ops-transformer) also take head dim 64 and as many
    queries as keys, the common causal prefill;
  - split-fuse kernels: as 8.3, and float16, equal head dims 16..256 (multiples of 16), grouped heads at
    every head dim.

  Always: at most 65536 tokens and 4096 sequences per call. Its LSE ``(T, N, 1)``
  (``softmax_lse_flag=True``) becomes ``(Hq, Tq)``.
* ``torch_npu.npu_fusion_attention`` (FA) for everything else it takes, and for inputs that require grad:
  fp16/bf16/fp32, ``D <= 768`` with ``Dv <= D``, up to 256 query heads (GQA/MQA by head ratio), at most
  1024 sequences and 1M tokens per call. Its LSE is ``softmax_max + log(softmax_sum)`` (both
  ``(T, N, 8)``, every lane equal), as torch_npu's own context-parallel attention derives it: with
  ``softmax_layout="TND"`` (token-major) where torch_npu takes that keyword (2.8 on) and CANN has the
  var-len kernels that read it (8.3 on; before, torch_npu raises for it), else in the default
  arrangement (a block of ``N x S_b x 8`` per sequence), converted per sequence both ways. Its backward
  ``npu_fusion_attention_grad`` gets ``softmax_max = LSE`` and
  ``softmax_sum = 1``, which give the same probabilities ``exp(s - max) / sum``. The fused grad op has no
  input for a gradient of the LSE: when one is given, the exact reference backward runs instead.

Offsets go to both kernels as cumulative ends without the leading 0 (``actual_seq_lengths`` /
``actual_seq_qlen``), built from the host copies (no device sync); ``scale`` is always passed (its default
is 1.0). Masks use the documented bottom-right modes: causal is ``sparse_mode=3``, a window
``(left, right)`` is band mode ``sparse_mode=4`` with ``pre_tokens=left`` and ``next_tokens=right``
(``2**31 - 1`` for unbounded), both with the compressed ``2048 x 2048`` upper-triangular mask (True =
masked). What the kernels cannot express is handled around them: sequences without keys give out 0 and
LSE ``-inf`` and are left out of the call, as are sequences without queries and the leading query rows
that a bottom-right mask hides completely (varlen masks must not hide a whole row); batches beyond a
kernel's limits are split into several calls. Soft-capping, float64, ``Dv > D`` and the other limits
above are refused in :func:`supports` with the reason, so dispatch falls back to the reference path.

FA's documentation places it in training; its forward serves here the inference cases that FIA's TND path
does not take. The call translation is checked against an interface model of the documented semantics
(``tests/npu_model.py``); the same tests run on Ascend hardware with ``PACKATTN_TEST_DEVICE=npu``.

Sources (torch_npu 2.13.0 wheel and the Ascend op-plugin documentation it embeds):
``torch_npu/_op_plugin_docs.py`` (``npu_fused_infer_attention_score``: "TND场景下query、key、value输入的
综合限制"; ``npu_fusion_attention``: parameters, sparse_mode table and "约束说明"),
``torch_npu/csrc/aten/npu_native_functions_by_codegen.yaml`` (op schemas),
``torch_npu/op_plugin/meta/_meta_registrations.py`` (output shapes),
``torch_npu/distributed/tensor/experimental/_context_parallel/_npu_attention.py`` (LSE from
softmax_max/sum); https://gitee.com/ascend/op-plugin (docs of both ops; the TND limits of CANN 8.3's
FIA in ``docs/context/torch_npu-npu_fused_infer_attention_score.md``, the version query in
``torch_npu-utils-get_cann_version.md``).
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

from ..inputs import AttentionInputs, MaskSpec
from .base import OWN_WITHOUT_LSE_GRAD, Backend, Capabilities, Grads, backward_of

UNBOUNDED = 2**31 - 1  # pre_tokens / next_tokens default: no bound
MASK_SIDE = 2048  # the compressed causal mask the bottom-right sparse modes take
FIA_MAX_BATCH, FIA_MAX_TOKENS = 4096, 65536
FA_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
FA_MAX_DIM, FA_MAX_HEADS = 768, 256
FA_MAX_BATCH, FA_MAX_TOKENS = 1024, 2**20


def _ops() -> Any:
    return importlib.import_module("torch_npu")


def _version(text: str) -> tuple[int, int]:
    """``major, minor`` of a version string such as ``2.8.0.post2`` or ``8.3.RC1`` ((0, 0) if unreadable)."""
    parts = text.split(".")
    try:
        return int(parts[0]), int(parts[1])
    except (IndexError, ValueError):
        return 0, 0


@dataclass(frozen=True)
class FiaLimits:
    """What FIA's TND path takes with one generation of CANN's kernels (beyond the per-call limits)."""

    name: str
    dtypes: tuple[torch.dtype, ...]
    dims: frozenset[tuple[int, int]]  # (D, Dv)
    heads_q: frozenset[int]
    grouped_dims_v: frozenset[int]  # V head dims with which Hq != Hkv is taken
    causal_needs_fewer_queries: bool  # sparse_mode=3 only where Lq < Lk (else Lq <= Lk)
    band: bool  # sparse_mode=4 (windows) is taken, with V head dim 64 or 128
    summary: str

    def takes(self, inp: AttentionInputs) -> bool:
        if inp.q.dtype not in self.dtypes or (inp.head_dim, inp.head_dim_v) not in self.dims:
            return False
        hq, hkv = inp.heads_q, inp.heads_kv
        if hq not in self.heads_q or hq % hkv or hq // hkv > FIA_MAX_GROUP:
            return False
        return hq == hkv or inp.head_dim_v in self.grouped_dims_v


FIA_MAX_GROUP = 64  # query heads per KV head
_SPLIT_FUSE_DIMS = range(16, 257, 16)
FIA_NONE = FiaLimits(
    "no FIA in the TND layout (CANN before 8.1, or of unknown version)",
    (),
    frozenset(),
    frozenset(),
    frozenset(),
    True,
    False,
    "no case",
)
FIA_CANN_8_1 = FiaLimits(
    "CANN 8.1/8.2's FIA limits",
    (torch.bfloat16,),
    frozenset({(192, 128), (192, 192)}),
    frozenset({8, 16, 32, 64, 128}),
    frozenset(),
    True,
    False,
    "bf16, D=192 (Dv 128/192), equal heads 8-128, no mask or causal where Lq < Lk, no windows",
)
FIA_CANN_8_3 = FiaLimits(
    "CANN 8.3's FIA limits",
    (torch.bfloat16,),
    frozenset({(64, 64), (128, 128), (192, 128), (192, 192)}),
    frozenset(range(1, 129)),
    frozenset({64, 128}),
    False,
    True,
    "bf16, D=Dv in {64, 128} or D=192 (Dv 128/192), GQA except Dv=192, causal where Lq <= Lk, windows with Dv 64/128",
)
FIA_SPLIT_FUSE = FiaLimits(
    "split-fuse FIA kernels (trial call passed)",
    (torch.float16, torch.bfloat16),
    frozenset({(d, d) for d in _SPLIT_FUSE_DIMS} | {(192, 128)}),
    frozenset(range(1, 129)),
    frozenset(_SPLIT_FUSE_DIMS),
    False,
    True,
    "fp16/bf16, D=Dv in 16..256 (multiples of 16) or D=192 (Dv 128), GQA, causal where Lq <= Lk, "
    "windows with Dv 64/128",
)


@dataclass(frozen=True)
class Stack:
    """What was found of the installed Ascend stack, once per process and device type."""

    torch_npu: str
    cann: str  # "" where torch_npu cannot tell (CANN before 8.1 answers "")
    softmax_layout: bool  # FA and its grad take ``softmax_layout`` (torch_npu 2.8 on, with CANN 8.3 on)
    fia: FiaLimits


def _cann_version(ops: Any) -> str:
    get = getattr(getattr(getattr(ops, "npu", None), "utils", None), "get_cann_version", None)
    try:
        found = get(module="CANN") if get is not None else getattr(torch.version, "cann", None)
    except (RuntimeError, OSError, ValueError):
        found = None
    return str(found or "")


def _split_fuse_trial(ops: Any, device_type: str) -> bool:
    """One FIA call that only the split-fuse kernels take (fp16, 2 query heads on 1 KV head, D=256), checked
    against a plain computation: whether those kernels are there and right. A refusal is a RuntimeError."""
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(n, h, 256, generator=gen).half() for n, h in ((3, 2), (5, 1), (5, 1)))
    probs = torch.softmax(torch.einsum("ihd,jd->hij", q.float(), k[:, 0].float()) / 16, dim=-1)
    expect = torch.einsum("hij,jd->ihd", probs, v[:, 0].float())
    try:
        out, _ = ops.npu_fused_infer_attention_score(
            *(x.to(device_type) for x in (q, k, v)),
            actual_seq_lengths=[3],
            actual_seq_lengths_kv=[5],
            num_heads=2,
            num_key_value_heads=1,
            scale=1 / 16,
            input_layout="TND",
        )
    except (RuntimeError, TypeError, ValueError):
        return False
    return bool(torch.allclose(out.float().cpu(), expect, atol=1e-2, rtol=1e-2))


@functools.lru_cache(maxsize=8)
def _probe(ops: Any, device_type: str) -> Stack:
    version, cann = str(getattr(ops, "__version__", "")), _cann_version(ops)
    fia = FIA_NONE if _version(cann) < (8, 1) else FIA_CANN_8_1
    if _version(cann) >= (8, 3):
        fia = FIA_SPLIT_FUSE if _split_fuse_trial(ops, device_type) else FIA_CANN_8_3
    # The keyword came with torch_npu 2.8; torch_npu raises for it where CANN lacks the V4 var-len kernels.
    return Stack(version, cann, _version(version) >= (2, 8) and _version(cann) >= (8, 3), fia)


def stack(device_type: str = "npu") -> Stack:
    """The installed stack as probed on its first use (cached per torch_npu module and device type)."""
    return _probe(_ops(), device_type)


def _from_default(x: torch.Tensor, lens: list[int]) -> torch.Tensor:
    """softmax_max/sum ``(T, N, 8)`` from FA's default arrangement, in which sequence ``b`` holds a block of
    ``N x S_b x 8`` floats, to the TND one (row ``t`` is token ``t``). A plain ``.view`` would mix tokens."""
    n, flat, parts, start = x.shape[1], x.reshape(-1), [], 0
    for length in lens:
        parts.append(flat[start * n * 8 : (start + length) * n * 8].view(n, length, 8).transpose(0, 1))
        start += length
    return torch.cat(parts)


def _to_default(x: torch.Tensor, lens: list[int]) -> torch.Tensor:
    """The inverse of :func:`_from_default`: TND ``(T, N, 8)`` to FA's default arrangement."""
    parts, start = [], 0
    for length in lens:
        parts.append(x[start : start + length].transpose(0, 1).reshape(-1))
        start += length
    return torch.cat(parts).view(x.shape)


@dataclass(frozen=True)
class _Seq:
    """The part of one sequence a kernel computes: query rows ``[qs, qe)`` against key rows ``[ks, ke)``."""

    qs: int
    qe: int
    ks: int
    ke: int


def _visible_part(inp: AttentionInputs) -> list[_Seq]:
    """Every sequence's query rows that see at least one key, with its keys; the rest is 0 / -inf.

    Bottom-right masks only ever hide leading rows: row ``i`` sees no key iff ``i + Lk - Lq + right < 0``.
    Dropping them keeps the alignment, since ``Lk - Lq`` grows by the number dropped.
    """
    seqs = []
    for qs, qe, ks, ke in inp.layout.sequences():
        hidden = inp.mask.visible_rows(qe - qs, ke - ks)[0]
        if qs + hidden < qe:
            seqs.append(_Seq(qs + hidden, qe, ks, ke))
    return seqs


def _runs(ranges: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """``ranges`` with adjacent ones merged (fewer slices to copy)."""
    runs: list[tuple[int, int]] = []
    for a, b in ranges:
        if runs and runs[-1][1] == a:
            runs[-1] = (runs[-1][0], b)
        elif b > a:
            runs.append((a, b))
    return runs


def _gather(x: torch.Tensor, ranges: list[tuple[int, int]]) -> torch.Tensor:
    """The rows ``ranges`` of ``x``, packed and contiguous (the kernels take no strided tensors)."""
    runs = _runs(ranges)
    if len(runs) == 1:
        return x[runs[0][0] : runs[0][1]].contiguous()
    return torch.cat([x[a:b] for a, b in runs]).contiguous()


def _scatter(dst: torch.Tensor, src: torch.Tensor, ranges: list[tuple[int, int]], dim: int = 0) -> None:
    """Inverse of :func:`_gather`: write the packed rows ``src`` back to ``ranges`` of ``dst`` along ``dim``."""
    at = 0
    for a, b in _runs(ranges):
        dst.narrow(dim, a, b - a).copy_(src.narrow(dim, at, b - a))
        at += b - a


def _calls(seqs: list[_Seq], max_batch: int, max_tokens: int) -> Iterator[list[_Seq]]:
    """Consecutive groups of ``seqs`` within a kernel's per-call limits on sequences and tokens."""
    group: list[_Seq] = []
    tq = tk = 0
    for s in seqs:
        lq, lk = s.qe - s.qs, s.ke - s.ks
        if group and (len(group) == max_batch or tq + lq > max_tokens or tk + lk > max_tokens):
            yield group
            group, tq, tk = [], 0, 0
        group.append(s)
        tq, tk = tq + lq, tk + lk
    if group:
        yield group


def _ends(lengths: list[int]) -> list[int]:
    """Cumulative ends without the leading 0: ``[2, 3]`` -> ``[2, 5]``."""
    out, total = [], 0
    for n in lengths:
        total += n
        out.append(total)
    return out


_MASKS: dict[torch.device, torch.Tensor] = {}


@dataclass(frozen=True)
class _Sparse:
    """The documented sparse-mode arguments for our bottom-right mask."""

    mode: int
    pre: int
    next: int

    @staticmethod
    def of(mask: MaskSpec) -> _Sparse:
        if mask.left < 0 and mask.right < 0:
            return _Sparse(0, UNBOUNDED, UNBOUNDED)
        if mask.left < 0 and mask.right == 0:
            return _Sparse(3, UNBOUNDED, UNBOUNDED)
        pre = UNBOUNDED if mask.left < 0 else mask.left
        return _Sparse(4, pre, UNBOUNDED if mask.right < 0 else mask.right)

    def atten_mask(self, device: torch.device) -> torch.Tensor | None:
        if self.mode == 0:
            return None
        if device not in _MASKS:
            _MASKS[device] = torch.ones(MASK_SIDE, MASK_SIDE, dtype=torch.bool, device=device).triu_(1)
        return _MASKS[device]


def _fia_fits(inp: AttentionInputs, seqs: list[_Seq], sparse: _Sparse) -> bool:
    """Whether FIA's TND limits on the probed stack hold (sequences/tokens per call are split to fit)."""
    limits = stack(inp.q.device.type).fia
    if not limits.takes(inp) or any(max(s.qe - s.qs, s.ke - s.ks) > FIA_MAX_TOKENS for s in seqs):
        return False
    if sparse.mode == 4 and not (limits.band and inp.head_dim_v in (64, 128)):
        return False
    if sparse.mode == 3 and limits.causal_needs_fewer_queries:
        return all(s.qe - s.qs < s.ke - s.ks for s in seqs)
    return sparse.mode != 3 or all(s.qe - s.qs <= s.ke - s.ks for s in seqs)


def _fia(inp: AttentionInputs, q, k, v, group: list[_Seq], sparse: _Sparse, with_lse: bool):
    out, lse = _ops().npu_fused_infer_attention_score(
        q,
        k,
        v,
        atten_mask=sparse.atten_mask(q.device),
        actual_seq_lengths=_ends([s.qe - s.qs for s in group]),
        actual_seq_lengths_kv=_ends([s.ke - s.ks for s in group]),
        num_heads=inp.heads_q,
        num_key_value_heads=inp.heads_kv,
        scale=inp.mask.scale,
        pre_tokens=sparse.pre,
        next_tokens=sparse.next,
        input_layout="TND",
        sparse_mode=sparse.mode,
        softmax_lse_flag=with_lse,
    )
    return out, (lse[..., 0] if with_lse else None)


def _fa_args(inp: AttentionInputs, group: list[_Seq], sparse: _Sparse, device: torch.device) -> dict[str, Any]:
    """The keyword arguments that forward and backward share."""
    return {
        "atten_mask": sparse.atten_mask(device),
        "keep_prob": 1.0,
        "pre_tockens": sparse.pre,
        "next_tockens": sparse.next,
        "actual_seq_qlen": _ends([s.qe - s.qs for s in group]),
        "actual_seq_kvlen": _ends([s.ke - s.ks for s in group]),
        "sparse_mode": sparse.mode,
        **({"softmax_layout": "TND"} if stack(device.type).softmax_layout else {}),
    }


def _fa(inp: AttentionInputs, q, k, v, group: list[_Seq], sparse: _Sparse, with_lse: bool):
    res = _ops().npu_fusion_attention(
        q, k, v, inp.heads_q, "TND", scale=inp.mask.scale, **_fa_args(inp, group, sparse, q.device)
    )
    sm_max, sm_sum = res[1], res[2]
    if with_lse and not stack(q.device.type).softmax_layout:
        lens = [s.qe - s.qs for s in group]
        sm_max, sm_sum = _from_default(sm_max, lens), _from_default(sm_sum, lens)
    lse = sm_max[..., 0] + torch.log(sm_sum[..., 0]) if with_lse else None
    return res[0], lse


def forward(inp: AttentionInputs) -> tuple[torch.Tensor, torch.Tensor | None]:
    q, v = inp.q, inp.v
    seqs, sparse = _visible_part(inp), _Sparse.of(inp.mask)
    use_fia = not inp.grad and _fia_fits(inp, seqs, sparse)
    run, limits = (_fia, (FIA_MAX_BATCH, FIA_MAX_TOKENS)) if use_fia else (_fa, (FA_MAX_BATCH, FA_MAX_TOKENS))
    groups = list(_calls(seqs, *limits))
    if len(groups) == 1 and _runs([(s.qs, s.qe) for s in seqs]) == [(0, q.shape[0])]:
        # Every query row is computed in one call: the kernel's results are the answer.
        kc, vc = _gather(inp.k, [(s.ks, s.ke) for s in seqs]), _gather(v, [(s.ks, s.ke) for s in seqs])
        o, group_lse = run(inp, q.contiguous(), kc, vc, seqs, sparse, inp.return_lse)
        return o, (None if group_lse is None else group_lse.transpose(0, 1).float().contiguous())
    out = torch.zeros(q.shape[0], q.shape[1], v.shape[2], dtype=q.dtype, device=q.device)
    lse = None
    if inp.return_lse:
        lse = torch.full((q.shape[1], q.shape[0]), float("-inf"), dtype=torch.float32, device=q.device)
    for group in groups:
        rows, keys = [(s.qs, s.qe) for s in group], [(s.ks, s.ke) for s in group]
        o, group_lse = run(inp, _gather(q, rows), _gather(inp.k, keys), _gather(v, keys), group, sparse, inp.return_lse)
        _scatter(out, o, rows)
        if lse is not None and group_lse is not None:
            _scatter(lse, group_lse.transpose(0, 1).float(), rows, dim=1)
    return out, lse


def backward(
    inp: AttentionInputs,
    out: torch.Tensor,
    lse: torch.Tensor,
    dout: torch.Tensor,
    dlse: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients through ``npu_fusion_attention_grad``, which takes no gradient of the LSE (``dlse`` is None)."""
    q, k, v = inp.q, inp.k, inp.v
    dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    sparse = _Sparse.of(inp.mask)
    for group in _calls(_visible_part(inp), FA_MAX_BATCH, FA_MAX_TOKENS):
        rows, keys = [(s.qs, s.qe) for s in group], [(s.ks, s.ke) for s in group]
        row_lse = _gather(lse.transpose(0, 1), rows).float()  # (T, N)
        sm_max = row_lse[..., None].expand(*row_lse.shape, 8).contiguous()
        sm_sum = torch.ones(*row_lse.shape, 8, dtype=torch.float32, device=q.device)
        if not stack(q.device.type).softmax_layout:
            lens = [s.qe - s.qs for s in group]
            sm_max, sm_sum = _to_default(sm_max, lens), _to_default(sm_sum, lens)
        grads = _ops().npu_fusion_attention_grad(
            _gather(q, rows),
            _gather(k, keys),
            _gather(v, keys),
            _gather(dout, rows),
            inp.heads_q,
            "TND",
            softmax_max=sm_max,
            softmax_sum=sm_sum,
            attention_in=_gather(out, rows),
            scale_value=inp.mask.scale,
            **_fa_args(inp, group, sparse, q.device),
        )
        _scatter(dq, grads[0], rows)
        _scatter(dk, grads[1], keys)
        _scatter(dv, grads[2], keys)
    return dq, dk, dv


class Npu(Backend):
    name = "npu"
    label = "npu_fusion_attention"
    capabilities = Capabilities(
        devices=("npu",),
        dtypes=FA_DTYPES,
        max_head_dim=FA_MAX_DIM,
        head_dim_v="at_most",
        softcap=False,
        deterministic=False,  # not documented as deterministic
        max_heads_q=FA_MAX_HEADS,
        max_seqlen=FA_MAX_TOKENS,
    )
    # The fused grad op has no input for a gradient of the LSE: with one, the exact reference backward.
    gradients = (OWN_WITHOUT_LSE_GRAD, backward_of("reference"))

    def unavailable_reason(self) -> str | None:
        if importlib.util.find_spec("torch_npu") is None:
            return "torch_npu is not installed"
        return None

    def details(self) -> str | None:
        found = stack((self.capabilities.devices or ("npu",))[0])
        cann = f"CANN {found.cann}" if found.cann else "CANN of unknown version"
        stats = "softmax_layout='TND'" if found.softmax_layout else "default softmax layout, converted per sequence"
        return (
            f"torch_npu {found.torch_npu or '(no version)'}, {cann}, {found.fia.name}: "
            f"FIA for inference in {found.fia.summary}; FA ({stats}) for the rest and training"
        )

    def forward(self, inp: AttentionInputs) -> tuple[torch.Tensor, torch.Tensor | None]:
        return forward(inp)

    def backward(
        self, inp: AttentionInputs, out: torch.Tensor, lse: torch.Tensor, dout: torch.Tensor, dlse: torch.Tensor | None
    ) -> Grads:
        return backward(inp, out, lse, dout, dlse)


BACKEND = Npu()
