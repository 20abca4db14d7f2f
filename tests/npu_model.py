"""An interface model of three torch_npu attention ops, on CPU, for contract tests. NOT torch_npu.

It stands in for ``torch_npu`` (a pytest fixture puts :func:`module` in ``sys.modules``) so that the npu
backend's calls can be checked where no Ascend device exists. Each call is bound against the op's real
schema (``tests/data/torch_npu_schemas.txt``, copied from the torch-npu 2.13.0 wheel) with
``torch._C.parse_schema``, checked against the documented constraints the backend relies on (Ascend
op-plugin docs in ``torch_npu/_op_plugin_docs.py``), and computed with the float64 oracle of
``packattn.testing`` in the documented semantics. Output shapes follow the wheel's meta registrations.
What the backend never uses (quantisation, pse, prefix, dropout, other layouts) is not modelled and raises.
"""

from __future__ import annotations

import importlib.machinery
import itertools
import math
import types
from pathlib import Path
from typing import Any

import torch

from packattn.testing import attention_naive

SCHEMA_FILE = Path(__file__).parent / "data" / "torch_npu_schemas.txt"
UNBOUNDED = 2**31 - 1


class ModelError(RuntimeError):
    """A call that the real op would reject (or that this model does not cover)."""


def load_schemas() -> dict[str, torch._C.FunctionSchema]:
    lines = [x.strip() for x in SCHEMA_FILE.read_text().splitlines() if x.strip() and not x.startswith("#")]
    return {s.name: s for s in map(torch._C.parse_schema, lines)}


def _type_ok(value: object, typ: str) -> bool:
    optional = typ.startswith("Optional[")
    if value is None:
        return optional
    base = typ[len("Optional[") : -1] if optional else typ
    if base == "Tensor":
        return isinstance(value, torch.Tensor)
    if base == "List[int]":
        return isinstance(value, (list, tuple)) and all(isinstance(x, int) and not isinstance(x, bool) for x in value)
    scalar = {"int": int, "float": (int, float), "str": str, "bool": bool}[base]
    return isinstance(value, scalar) and (base == "bool" or not isinstance(value, bool))


def bind(schema: torch._C.FunctionSchema, args: tuple, kwargs: dict[str, Any]) -> tuple[dict[str, Any], set[str]]:
    """Python values of every argument (defaults filled in) and the names the caller passed, or TypeError."""
    params = list(schema.arguments)
    positional = [a for a in params if not a.kwarg_only]
    if len(args) > len(positional):
        raise TypeError(f"{schema.name}: {len(args)} positional arguments, at most {len(positional)}")
    given = dict(zip((a.name for a in positional), args))
    for name, value in kwargs.items():
        if name not in {a.name for a in params}:
            raise TypeError(f"{schema.name}: unexpected keyword argument {name!r}")
        if name in given:
            raise TypeError(f"{schema.name}: {name!r} given twice")
        given[name] = value
    bound = {}
    for a in params:
        if a.name in given:
            value = given[a.name]
        elif a.has_default_value():
            value = a.default_value
        else:
            raise TypeError(f"{schema.name}: missing required argument {a.name!r}")
        if not _type_ok(value, str(a.type)):
            raise TypeError(f"{schema.name}: {a.name} must be {a.type}, got {type(value).__name__}")
        bound[a.name] = value
    return bound, set(given)


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise ModelError(message)


def _lengths(ends: list[int] | None, total: int, name: str, max_batch: int) -> list[int]:
    """Per-sequence lengths from cumulative ends without the leading 0, checked as documented."""
    _require(ends is not None, f"{name} is required for input_layout='TND'")
    assert ends is not None
    _require(1 <= len(ends) <= max_batch, f"{name}: 1..{max_batch} entries, got {len(ends)}")
    _require(ends[0] != 0, f"{name} starts with 0: pass cumulative ends without the leading 0, got {ends}")
    _require(all(b >= a >= 0 for a, b in itertools.pairwise(ends)), f"{name} must be non-decreasing, got {ends}")
    _require(ends[-1] == total, f"{name} must end at the tensor's T ({total}), got {ends[-1]}")
    return [b - a for a, b in zip([0, *ends[:-1]], ends)]


def _window(mode: int, mask: torch.Tensor | None, pre: int, nxt: int, allowed: tuple[int, ...]) -> tuple[int, int]:
    """The bottom-right window ``(left, right)`` (-1 unbounded) that a sparse mode and its arguments mean."""
    _require(mode in allowed, f"sparse_mode={mode} is not supported (or not modelled) here; allowed {allowed}")
    if mode == 0:
        _require(mask is None, "sparse_mode=0 with an atten_mask needs a full mask (not used by packattn)")
        return -1, -1
    _require(mask is not None, f"sparse_mode={mode} needs the compressed 2048 x 2048 atten_mask")
    assert mask is not None
    _require(mask.dtype in (torch.bool, torch.uint8, torch.int8), f"atten_mask dtype bool/uint8/int8, got {mask.dtype}")
    _require(mask.shape[-2:] == (2048, 2048) and mask.numel() == 2048 * 2048, f"atten_mask shape {tuple(mask.shape)}")
    upper = torch.ones(2048, 2048, dtype=torch.bool).triu(1)
    _require(torch.equal(mask.reshape(2048, 2048).cpu().bool(), upper), "atten_mask must be triu(ones, 1), 1 = masked")
    if mode == 3:
        return -1, 0
    _require(pre >= 0 and nxt >= 0, f"negative pre/next tokens are not modelled, got {pre}, {nxt}")
    return (-1 if pre >= UNBOUNDED else pre), (-1 if nxt >= UNBOUNDED else nxt)


def _check_rows(lens_q: list[int], lens_k: list[int], right: int, op: str) -> None:
    """No sequence empty on one side; no query row that the mask hides completely (bottom-right masks can
    only hide leading rows, those with ``i + Lk - Lq + right < 0``)."""
    for b, (lq, lk) in enumerate(zip(lens_q, lens_k)):
        _require((lq == 0) == (lk == 0), f"{op}: sequence {b} is empty on one side only (Lq={lq}, Lk={lk})")
        if lq and right >= 0:
            _require(
                lq - lk - right <= 0, f"{op}: sequence {b} has fully masked rows (Lq={lq}, Lk={lk}, right={right})"
            )


def _compute(q, k, v, lens_q, lens_k, scale, window) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(out, lse, row_max)`` in float64; ``row_max`` is the max of the visible scaled scores, ``(T, N)``."""
    cu_q, cu_k = [0, *torch.tensor(lens_q).cumsum(0).tolist()], [0, *torch.tensor(lens_k).cumsum(0).tolist()]
    out, lse = attention_naive(q, k, v, cu_q, cu_k, softmax_scale=scale, window_size=window, dtype=torch.float64)
    g = q.shape[1] // k.shape[1]
    maxes = []
    for b in range(len(lens_q)):
        qb, kb = q[cu_q[b] : cu_q[b + 1]].double(), k[cu_k[b] : cu_k[b + 1]].double().repeat_interleave(g, 1)
        s = scale * torch.einsum("ihd,jhd->ihj", qb, kb)
        i, j = torch.arange(lens_q[b])[:, None], torch.arange(lens_k[b])[None, :]
        ok = torch.ones(lens_q[b], lens_k[b], dtype=torch.bool)
        if window[0] >= 0:
            ok &= j >= i + lens_k[b] - lens_q[b] - window[0]
        if window[1] >= 0:
            ok &= j <= i + lens_k[b] - lens_q[b] + window[1]
        maxes.append(s.masked_fill(~ok[:, None, :], -math.inf).amax(-1))
    return out, lse.transpose(0, 1), torch.cat(maxes)


def _defaults_only(schema: torch._C.FunctionSchema, bound: dict[str, Any], used: set[str]) -> None:
    """Arguments outside ``used`` (quantisation, pse, prefix, dropout seeds, ...) must keep their defaults."""
    for arg in schema.arguments:
        if arg.name not in used and arg.has_default_value():
            value = bound[arg.name]
            _require(value == arg.default_value, f"{schema.name}: {arg.name}={value!r} is not modelled")


FIA_USED = {"query", "key", "value", "atten_mask", "actual_seq_lengths", "actual_seq_lengths_kv", "num_heads"}
FIA_USED |= {"num_key_value_heads", "scale", "pre_tokens", "next_tokens", "input_layout", "sparse_mode"}
FIA_USED |= {"softmax_lse_flag"}
FA_USED = {"query", "key", "value", "head_num", "input_layout", "atten_mask", "scale", "scale_value", "keep_prob"}
FA_USED |= {"pre_tockens", "next_tockens", "actual_seq_qlen", "actual_seq_kvlen", "sparse_mode", "softmax_layout"}
FA_USED |= {"dy", "softmax_max", "softmax_sum", "attention_in"}


def _default_arrangement(x: torch.Tensor, lens: list[int], *, inverse: bool = False) -> torch.Tensor:
    """Token-major ``(T, N, 8)`` lanes in FA's default arrangement (same shape; sequence ``b`` a contiguous
    block of ``N x S_b x 8``), or back with ``inverse``: written here by hand, apart from the adapter's."""
    out = torch.empty_like(x).reshape(-1)
    src = x.reshape(-1)
    n, start = x.shape[1], 0
    for length in lens:
        for t in range(length):
            for h in range(n):
                tnd = ((start + t) * n + h) * 8
                default = start * n * 8 + (h * length + t) * 8
                a, b = (default, tnd) if inverse else (tnd, default)
                out[b : b + 8] = src[a : a + 8]
        start += length
    return out.view(x.shape)


class Model:
    """The three ops plus a log of every call: ``calls`` holds ``(op name, bound arguments)``."""

    def __init__(self, version: str = "2.8.0", cann: str = "8.3.RC1", split_fuse: bool = False) -> None:
        """``version``: the torch_npu modelled. Before 2.8 the FA ops have no ``softmax_layout`` (passing it is
        a TypeError, as for any unknown keyword) and return softmax_max/sum in the default arrangement.
        ``cann``: what ``torch_npu.npu.utils.get_cann_version()`` answers ("" before CANN 8.1); it selects FIA's
        TND limits: none before 8.1 (FIA takes TND from 8.1 on), 8.1's documented ones (no band mode) before
        8.3, 8.3's from then on, and with ``split_fuse`` (newer kernels) fp16, equal head dims up to 256 and
        grouped heads at every head dim. FA's ``softmax_layout`` needs CANN 8.3's V4 var-len kernels: before
        8.3 torch_npu raises for it."""
        self.version, self.cann, self.split_fuse = version, cann, split_fuse
        self.layout_keyword = tuple(int(x) for x in version.split(".")[:2]) >= (2, 8)
        self.schemas = load_schemas()
        if not self.layout_keyword:
            for name in ("npu_fusion_attention", "npu_fusion_attention_grad"):
                schema = self.schemas[name]
                text = str(schema).replace(', str softmax_layout=""', "")
                self.schemas[name] = torch._C.parse_schema(text)
        self.calls: list[tuple[str, dict[str, Any]]] = []

    def module(self) -> types.ModuleType:
        m = types.ModuleType("torch_npu", "Interface model of torch_npu's attention ops (tests only).")
        m.__spec__ = importlib.machinery.ModuleSpec("torch_npu", None)
        m.__version__ = self.version
        m.npu = types.SimpleNamespace(utils=types.SimpleNamespace(get_cann_version=self.get_cann_version))
        for name in self.schemas:
            setattr(m, name, getattr(self, name))
        return m

    def get_cann_version(self, module: str = "CANN") -> str:
        return self.cann if module == "CANN" else ""

    def _cann(self) -> tuple[int, int]:
        return (int(self.cann.split(".")[0]), int(self.cann.split(".")[1])) if self.cann else (0, 0)

    def _fia_tnd_limits(self, op: str, q: torch.Tensor, n: int, nkv: int, dims: tuple[int, int, int]) -> bool:
        """FIA's TND limits on the modelled CANN; returns whether causal needs Lq < Lk (else Lq <= Lk)."""
        cann = self._cann()
        _require(cann >= (8, 1), f"{op}: input_layout='TND' needs CANN 8.1 or later, got {self.cann or 'older'}")
        if self.split_fuse:
            _require(q.dtype in (torch.float16, torch.bfloat16), f"{op}: TND takes float16/bfloat16, got {q.dtype}")
            equal = dims[0] == dims[1] == dims[2] and dims[0] % 16 == 0 and dims[0] <= 256
            _require(equal or dims == (192, 192, 128), f"{op}: TND head dims equal (16-aligned, <= 256), got {dims}")
        else:
            _require(q.dtype == torch.bfloat16, f"{op}: TND takes bfloat16 only, got {q.dtype}")
            ok = {(192, 192, 128), (192, 192, 192)} | ({(64, 64, 64), (128, 128, 128)} if cann >= (8, 3) else set())
            _require(dims in ok, f"{op}: TND head dims {sorted(ok)}, got {dims}")
        if cann < (8, 3) and not self.split_fuse:
            _require(n in (8, 16, 32, 64, 128), f"{op}: num_heads must be in 8..128 (powers of 2), got {n}")
            _require(nkv == n, f"{op}: TND needs equal query and key/value heads")
            return True
        _require(1 <= n <= 128 and n % nkv == 0 and n // nkv <= 64, f"{op}: heads {n} / {nkv} not taken")
        _require(nkv == n or self.split_fuse or dims[2] != 192, f"{op}: GQA does not support value D 192")
        return False

    def _bind(self, op: str, args: tuple, kwargs: dict[str, Any]) -> tuple[dict[str, Any], set[str]]:
        bound, given = bind(self.schemas[op], args, kwargs)
        self.calls.append((op, bound))
        return bound, given

    def npu_fused_infer_attention_score(self, *args: Any, **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        op = "npu_fused_infer_attention_score"
        a, given = self._bind(op, args, kwargs)
        q, k, v = a["query"], a["key"], a["value"]
        _require("scale" in given, f"{op}: scale not passed (its default is 1.0, not 1/sqrt(D))")
        _require(a["input_layout"] == "TND", f"{op}: only input_layout='TND' is modelled, got {a['input_layout']!r}")
        _defaults_only(self.schemas[op], a, FIA_USED)
        _require(all(t.is_contiguous() for t in (q, k, v)), f"{op}: query/key/value must be contiguous")
        _require(q.dim() == k.dim() == v.dim() == 3, f"{op}: TND tensors are 3-D")
        _require(q.dtype == k.dtype == v.dtype, f"{op}: query, key and value must have one dtype")
        n, nkv = a["num_heads"], a["num_key_value_heads"] or a["num_heads"]
        _require(n == q.shape[1] and nkv == k.shape[1] == v.shape[1], f"{op}: num_heads / num_key_value_heads")
        causal_needs_fewer = self._fia_tnd_limits(op, q, n, nkv, (q.shape[2], k.shape[2], v.shape[2]))
        _require(max(q.shape[0], k.shape[0]) <= 65536, f"{op}: TND takes T <= 65536")
        lens_q = _lengths(a["actual_seq_lengths"], q.shape[0], "actual_seq_lengths", 4096)
        lens_k = _lengths(a["actual_seq_lengths_kv"], k.shape[0], "actual_seq_lengths_kv", 4096)
        _require(len(lens_q) == len(lens_k), f"{op}: both length lists give the batch size")
        _require(min(lens_q + lens_k) > 0, f"{op}: TND does not take empty sequences")
        mode = a["sparse_mode"]
        modes = (0, 3, 4) if self._cann() >= (8, 3) else (0, 3)  # 8.1/8.2: "sparse=0 ... or sparse=3"
        left, right = _window(mode, a["atten_mask"], a["pre_tokens"], a["next_tokens"], modes)
        if mode == 3 and causal_needs_fewer:
            _require(all(x < y for x, y in zip(lens_q, lens_k)), f"{op}: sparse_mode=3 needs Lq < Lk per sequence")
        if mode == 3:
            _require(all(x <= y for x, y in zip(lens_q, lens_k)), f"{op}: sparse_mode=3 needs Lq <= Lk per sequence")
        _require(mode != 4 or v.shape[2] in (64, 128), f"{op}: sparseMode = 4 only supports value D 64/128 (CANN 8.3)")
        _check_rows(lens_q, lens_k, right, op)
        out, lse, _ = _compute(q, k, v, lens_q, lens_k, a["scale"], (left, right))
        lse_out = lse[..., None].float() if a["softmax_lse_flag"] else torch.empty(0)
        return out.to(q.dtype), lse_out

    def _fa_common(self, op: str, a: dict[str, Any], given: set[str], scale_name: str):
        q, k, v = a["query"], a["key"], a["value"]
        _require(scale_name in given, f"{op}: {scale_name} not passed (its default is 1.0, not 1/sqrt(D))")
        _require(a["input_layout"] == "TND", f"{op}: only input_layout='TND' is modelled, got {a['input_layout']!r}")
        _defaults_only(self.schemas[op], a, FA_USED)
        _require(a["keep_prob"] == 1.0, f"{op}: dropout is not modelled (keep_prob={a['keep_prob']})")
        _require(q.dtype in (torch.float16, torch.bfloat16, torch.float32), f"{op}: dtype {q.dtype} not supported")
        _require(q.dtype == k.dtype == v.dtype, f"{op}: query, key and value must have one dtype")
        _require(q.dim() == k.dim() == v.dim() == 3, f"{op}: TND tensors are 3-D")
        n, nkv = a["head_num"], k.shape[1]
        _require(n == q.shape[1] and 1 <= n <= 256, f"{op}: head_num must be q's N (1..256), got {n}")
        _require(v.shape[1] == nkv and n % nkv == 0, f"{op}: Nq / Nkv must be an integer, got {n} / {nkv}")
        _require(q.shape[2] == k.shape[2] >= v.shape[2] and q.shape[2] <= 768, f"{op}: needs Dq = Dk >= Dv, <= 768")
        _require(1 <= q.shape[0] <= 2**20 and 1 <= k.shape[0] <= 2**20, f"{op}: varlen T must be in 1..1M")
        lens_q = _lengths(a["actual_seq_qlen"], q.shape[0], "actual_seq_qlen", 1024)
        lens_k = _lengths(a["actual_seq_kvlen"], k.shape[0], "actual_seq_kvlen", 1024)
        _require(len(lens_q) == len(lens_k), f"{op}: both length lists give the batch size")
        _require(a.get("softmax_layout", "") in ("", "TND"), f"{op}: softmax_layout must be '' or 'TND'")
        _require(
            a.get("softmax_layout", "") == "" or self._cann() >= (8, 3),
            f"{op}: The param softmax_layout is not supported (needs CANN 8.3, got {self.cann or 'older'})",
        )
        left, right = _window(a["sparse_mode"], a["atten_mask"], a["pre_tockens"], a["next_tockens"], (0, 3, 4))
        _check_rows(lens_q, lens_k, right, op)
        return lens_q, lens_k, (left, right)

    def npu_fusion_attention(self, *args: Any, **kwargs: Any) -> tuple[Any, ...]:
        op = "npu_fusion_attention"
        a, given = self._bind(op, args, kwargs)
        q, k, v = a["query"], a["key"], a["value"]
        lens_q, lens_k, window = self._fa_common(op, a, given, "scale")
        out, lse, row_max = _compute(q, k, v, lens_q, lens_k, a["scale"], window)
        row_sum = torch.exp(lse - row_max)
        lanes = [x.float()[..., None].expand(*x.shape, 8).contiguous() for x in (row_max, row_sum)]
        if (
            a.get("softmax_layout", "") == ""
        ):  # the default arrangement: shape (T, N, 8), a block N x S_b x 8 per sequence
            lanes = [_default_arrangement(x, lens_q) for x in lanes]
        return out.to(q.dtype), lanes[0], lanes[1], torch.empty(0, dtype=q.dtype), 0, 0, 0

    def npu_fusion_attention_grad(self, *args: Any, **kwargs: Any) -> tuple[Any, ...]:
        op = "npu_fusion_attention_grad"
        a, given = self._bind(op, args, kwargs)
        q, k, v, dy = a["query"], a["key"], a["value"], a["dy"]
        lens_q, lens_k, window = self._fa_common(op, a, given, "scale_value")
        expect = (q.shape[0], q.shape[1], 8)
        for name in ("softmax_max", "softmax_sum"):
            t = a[name]
            _require(t is not None and t.shape == expect and t.dtype == torch.float32, f"{op}: {name} {expect} fp32")
        _require(a["attention_in"] is not None and a["attention_in"].shape == dy.shape, f"{op}: attention_in like dy")
        sm_max, sm_sum = a["softmax_max"], a["softmax_sum"]
        if a.get("softmax_layout", "") == "":
            sm_max, sm_sum = (_default_arrangement(x, lens_q, inverse=True) for x in (sm_max, sm_sum))
        sm_max, sm_sum = sm_max[..., 0].double(), sm_sum[..., 0].double()
        _, lse, _ = _compute(q, k, v, lens_q, lens_k, a["scale_value"], window)
        given_lse = sm_max + torch.log(sm_sum)
        _require(
            torch.allclose(given_lse, lse, atol=1e-3, rtol=1e-4), f"{op}: softmax_max/sum do not match the forward"
        )
        cu_q, cu_k = [0, *torch.tensor(lens_q).cumsum(0).tolist()], [0, *torch.tensor(lens_k).cumsum(0).tolist()]

        def out_of(*xs: torch.Tensor) -> torch.Tensor:
            return attention_naive(*xs, cu_q, cu_k, softmax_scale=a["scale_value"], window_size=window)[0]

        # torch.func, not torch.autograd: packattn calls this from inside its backward custom op, where
        # autograd records nothing.
        _, vjp = torch.func.vjp(out_of, *(t.detach().double() for t in (q, k, v)))
        grads = vjp(dy.double())
        return grads[0].to(q.dtype), grads[1].to(q.dtype), grads[2].to(q.dtype), None, torch.empty(0)


def module(version: str = "2.8.0", cann: str = "8.3.RC1", split_fuse: bool = False) -> tuple[Model, types.ModuleType]:
    """A fresh model (see :class:`Model`) and the module object to put in ``sys.modules['torch_npu']``."""
    model = Model(version, cann, split_fuse)
    return model, model.module()
