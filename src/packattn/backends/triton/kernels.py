"""Triton kernels of the ``triton`` backend (flash-attention-2 style); ``__init__.py`` says what they compute.

Every kernel reads one row of an int32 work table, ``(q_start, Lq, k_start, Lk, block_start)``: which
sequence the program serves and where its block starts inside it, so one launch covers the whole packed
batch. The table starts with ``scale`` and ``softcap`` as two float64 (4 int32 words), so fp64 inputs get
them unrounded and a call uploads one small tensor. Row indices are widened to int64 before they meet a
stride, and every stride is an argument.

* Scores of a tile are ``scale * q.k`` (soft-capped through ``tanh``, built from ``exp`` so that the
  interpreter runs it too), held in base 2: ``log2(e)`` is folded into the scale (into the cap with
  softcap) once per program, in float64, so the softmax takes ``exp2`` of them, which the GPU computes
  directly, with no multiply per element. The element mask (window bounds, sequence ends) is applied only
  to tiles that are not entirely visible; loops run only over the blocks the window can make visible.
* The forward keeps a running max ``m``, sum ``denom`` and accumulator in ``ACC`` (fp32, fp64 for fp64)
  and stores ``out = acc / denom`` and the natural-log ``lse = (m + log2(denom)) * ln(2)``; rows that see
  no key store 0 and -inf, rows whose softmax is undefined (a NaN or +inf score, or only -inf ones) NaN.
* The backward recomputes ``p = exp(s * ln(2) - lse)``: the score goes to natural units by the same
  rounded product that took the forward's max there, so a row with one dominant key gets exactly
  ``p = 1`` however large its scores (converting the LSE to base 2 instead rounds it, by up to a factor of
  ``2**(|lse| * 2**-23)`` in ``p``: 0.9 at scores ~ 1e6). ``dS`` stays in natural units. dK/dV: one
  program per (key block, KV head) loops over the ``G`` query heads of its group and the query blocks
  that can see its keys; dQ: one program per (query block, query head). Each output element is written
  by one program: no atomics, deterministic.
* ``DOT`` is the dtype of the ``tl.dot`` operands (the input dtype; fp32 for bf16 under the interpreter,
  whose dot reads bf16 as raw integers); ``PRECISION`` is ``"ieee"`` for fp32/fp64 (no TF32).
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _tanh(x):
    a = tl.abs(x)
    e = tl.exp(-2.0 * a)
    t = (1.0 - e) / (1.0 + e)
    t = tl.where(a < 1e-3, a - a * a * a / 3.0, t)  # avoid the cancellation in 1 - e near 0
    return tl.where(x < 0, -t, t)


LOG2E: tl.constexpr = tl.constexpr(1.4426950408889634)
LN2: tl.constexpr = tl.constexpr(0.6931471805599453)


@triton.jit
def _params(TABLE, SOFTCAP: tl.constexpr, ACC: tl.constexpr):
    """From ``scale`` and ``softcap``, two float64 at the head of the table (float scalar arguments are
    fp32): ``scale``, the factor of ``q.k`` (``scale * log2(e)``; ``scale / softcap``, the argument of
    ``tanh``, with softcap) and the base-2 cap ``softcap * log2(e)``, each rounded once to ``ACC``."""
    prm = TABLE.to(tl.pointer_type(tl.float64))
    scale = tl.load(prm)
    softcap = tl.load(prm + 1)
    if SOFTCAP:
        qk_scale = scale / softcap
        cap = softcap * LOG2E
    else:
        qk_scale = scale * LOG2E
        cap = softcap
    return scale.to(ACC), qk_scale.to(ACC), cap.to(ACC)


@triton.jit
def _row(TABLE, pid):
    base = TABLE + 4 + pid * 5
    return tl.load(base), tl.load(base + 1), tl.load(base + 2), tl.load(base + 3), tl.load(base + 4)


@triton.jit
def _key_range(i0, i1, off, lk, left, right, HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr):
    """Keys ``[lo, hi)`` that query rows ``[i0, i1)`` may see."""
    lo = i0 * 0
    hi = lk + lo
    if HAS_LEFT:
        lo = tl.maximum(i0 + off - left, 0)
    if HAS_RIGHT:
        hi = tl.minimum(i1 + off + right, lk)
    return lo, hi


@triton.jit
def _query_range(j0, j1, off, lq, left, right, HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr):
    """Query rows ``[lo, hi)`` that may see keys ``[j0, j1)``."""
    lo = j0 * 0
    hi = lq + lo
    if HAS_RIGHT:
        lo = tl.maximum(j0 - off - right, 0)
    if HAS_LEFT:
        hi = tl.minimum(j1 + left - off, lq)
    return lo, hi


@triton.jit
def _scores(
    qk, i0, j0, i, j, off, lq, lk, qk_scale, cap, left, right,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    SOFTCAP: tl.constexpr, HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr,
):  # fmt: skip
    """Base-2 scores of the tile of rows ``i0 + [0, BLOCK_M)`` and keys ``j0 + [0, BLOCK_N)`` (``i``/``j`` are
    those indices shaped to broadcast to the tile), and ``tanh`` of the soft-capped scores."""
    s = qk * qk_scale
    t = s
    if SOFTCAP:
        t = _tanh(s)
        s = t * cap
    # Only tiles with a hidden or out-of-range pair pay for the element mask.
    masked = (i0 + BLOCK_M > lq) | (j0 + BLOCK_N > lk)
    if HAS_LEFT:
        masked = masked | (j0 < i0 + BLOCK_M - 1 + off - left)
    if HAS_RIGHT:
        masked = masked | (j0 + BLOCK_N - 1 > i0 + off + right)
    if masked:
        ok = (i < lq) & (j < lk)
        if HAS_LEFT:
            ok = ok & (j - i - off >= -left)
        if HAS_RIGHT:
            ok = ok & (j - i - off <= right)
        s = tl.where(ok, s, float("-inf"))
    return s, t


@triton.jit
def _tile(PTR, rows, nrows, s_t, cols, ncols, s_d, TRANSPOSE: tl.constexpr):
    """Load ``(rows, cols)`` of a ``(T, D)`` view (or its transpose) with zeros outside the bounds."""
    r = rows.to(tl.int64)
    if TRANSPOSE:
        ptrs = PTR + r[None, :] * s_t + cols[:, None] * s_d
        ok = (rows[None, :] < nrows) & (cols[:, None] < ncols)
    else:
        ptrs = PTR + r[:, None] * s_t + cols[None, :] * s_d
        ok = (rows[:, None] < nrows) & (cols[None, :] < ncols)
    return tl.load(ptrs, mask=ok, other=0.0)


@triton.jit
def _store(PTR, x, rows, nrows, s_t, cols, ncols, s_d):
    ptrs = PTR + rows.to(tl.int64)[:, None] * s_t + cols[None, :] * s_d
    tl.store(ptrs, x.to(PTR.dtype.element_ty), mask=(rows[:, None] < nrows) & (cols[None, :] < ncols))


@triton.jit
def forward_kernel(
    Q, K, V, OUT, LSE, TABLE,
    sq_t, sq_h, sq_d, sk_t, sk_h, sk_d, sv_t, sv_h, sv_d, so_t, so_h, so_d, sl_h,
    left, right, G, D, DV,
    SOFTCAP: tl.constexpr, HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    ACC: tl.constexpr, DOT: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    h = tl.program_id(1)
    hk = h // G
    _scale, qk_scale, cap = _params(TABLE, SOFTCAP, ACC)
    qs, lq, ks, lk, i0 = _row(TABLE, tl.program_id(0))
    off = lk - lq
    i = i0 + tl.arange(0, BLOCK_M)
    d = tl.arange(0, BLOCK_D)
    dv = tl.arange(0, BLOCK_DV)
    q_ptr = Q + qs.to(tl.int64) * sq_t + h.to(tl.int64) * sq_h
    k_ptr = K + ks.to(tl.int64) * sk_t + hk.to(tl.int64) * sk_h
    v_ptr = V + ks.to(tl.int64) * sv_t + hk.to(tl.int64) * sv_h
    q = _tile(q_ptr, i, lq, sq_t, d, D, sq_d, False).to(DOT)
    m = tl.full([BLOCK_M], float("-inf"), ACC)
    denom = tl.zeros([BLOCK_M], ACC)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], ACC)
    i1 = tl.minimum(i0 + BLOCK_M, lq)
    lo, hi = _key_range(i0, i1, off, lk, left, right, HAS_LEFT, HAS_RIGHT)
    for j0 in range(lo, hi, BLOCK_N):
        j = j0 + tl.arange(0, BLOCK_N)
        kt = _tile(k_ptr, j, lk, sk_t, d, D, sk_d, True).to(DOT)
        qk = tl.dot(q, kt, input_precision=PRECISION, out_dtype=ACC).to(ACC)
        s, _t = _scores(
            qk,
            i0,
            j0,
            i[:, None],
            j[None, :],
            off,
            lq,
            lk,
            qk_scale,
            cap,
            left,
            right,
            BLOCK_M,
            BLOCK_N,
            SOFTCAP,
            HAS_LEFT,
            HAS_RIGHT,
        )
        m_new = tl.maximum(m, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp2(s - m_safe[:, None])
        alpha = tl.exp2(m - m_safe)
        denom = denom * alpha + tl.sum(p, 1)
        vb = _tile(v_ptr, j, lk, sv_t, dv, DV, sv_d, False).to(DOT)
        acc = acc * alpha[:, None] + tl.dot(p.to(DOT), vb, input_precision=PRECISION, out_dtype=ACC).to(ACC)
        m = m_new
    # A finite max and sum: the softmax is defined. Else a row that sees keys met a NaN or +inf score, or only
    # -inf ones (from infinite inputs): NaN out and LSE; a row that sees no key: 0 and -inf.
    fine = (tl.abs(m) < float("inf")) & (denom > 0)
    row_lo, row_hi = _key_range(i, i + 1, off, lk, left, right, HAS_LEFT, HAS_RIGHT)
    sees = row_lo < row_hi
    out = tl.where(fine[:, None], acc / tl.where(fine, denom, 1.0)[:, None], tl.where(sees, float("nan"), 0.0)[:, None])
    o_ptr = OUT + qs.to(tl.int64) * so_t + h.to(tl.int64) * so_h
    _store(o_ptr, out, i, lq, so_t, dv, DV, so_d)
    lse = tl.where(fine, (m + tl.log2(tl.where(fine, denom, 1.0))) * LN2, tl.where(sees, float("nan"), float("-inf")))
    tl.store(LSE + h.to(tl.int64) * sl_h + qs + i, lse, mask=i < lq)


@triton.jit
def dkdv_kernel(
    Q, K, V, DO, LSE, DELTA, DK, DV_OUT, TABLE,
    sq_t, sq_h, sq_d, sk_t, sk_h, sk_d, sv_t, sv_h, sv_d, sdo_t, sdo_h, sdo_d, sl_h,
    sdk_t, sdk_h, sdk_d, sdv_t, sdv_h, sdv_d,
    left, right, G, D, DV,
    SOFTCAP: tl.constexpr, HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    ACC: tl.constexpr, DOT: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    hk = tl.program_id(1)
    scale, qk_scale, cap = _params(TABLE, SOFTCAP, ACC)
    qs, lq, ks, lk, j0 = _row(TABLE, tl.program_id(0))
    off = lk - lq
    j = j0 + tl.arange(0, BLOCK_N)
    d = tl.arange(0, BLOCK_D)
    dv = tl.arange(0, BLOCK_DV)
    k_ptr = K + ks.to(tl.int64) * sk_t + hk.to(tl.int64) * sk_h
    v_ptr = V + ks.to(tl.int64) * sv_t + hk.to(tl.int64) * sv_h
    # K and V transposed, so that scores are the same product, of the same operands, as in the forward and
    # dQ (not K Q^T): the recomputed probabilities are then exactly the forward's.
    kt = _tile(k_ptr, j, lk, sk_t, d, D, sk_d, True).to(DOT)
    vt = _tile(v_ptr, j, lk, sv_t, dv, DV, sv_d, True).to(DOT)
    dk = tl.zeros([BLOCK_N, BLOCK_D], ACC)
    dvacc = tl.zeros([BLOCK_N, BLOCK_DV], ACC)
    j1 = tl.minimum(j0 + BLOCK_N, lk)
    lo, hi = _query_range(j0, j1, off, lq, left, right, HAS_LEFT, HAS_RIGHT)
    for g in range(0, G):
        h = (hk * G + g).to(tl.int64)
        q_ptr = Q + qs.to(tl.int64) * sq_t + h * sq_h
        do_ptr = DO + qs.to(tl.int64) * sdo_t + h * sdo_h
        row_ptr = h * sl_h + qs
        for i0 in range(lo, hi, BLOCK_M):
            i = i0 + tl.arange(0, BLOCK_M)
            qb = _tile(q_ptr, i, lq, sq_t, d, D, sq_d, False).to(DOT)
            qk = tl.dot(qb, kt, input_precision=PRECISION, out_dtype=ACC).to(ACC)
            s, t = _scores(
                qk, i0, j0, i[:, None], j[None, :], off, lq, lk, qk_scale, cap, left, right,
                BLOCK_M, BLOCK_N, SOFTCAP, HAS_LEFT, HAS_RIGHT,
            )  # fmt: skip
            lse = tl.load(LSE + row_ptr + i, mask=i < lq, other=0.0)
            p = tl.exp(s * LN2 - tl.where(lse == float("-inf"), 0.0, lse)[:, None])
            dob = _tile(do_ptr, i, lq, sdo_t, dv, DV, sdo_d, False).to(DOT)
            dvacc += tl.dot(tl.trans(p.to(DOT)), dob, input_precision=PRECISION, out_dtype=ACC).to(ACC)
            dp = tl.dot(dob, vt, input_precision=PRECISION, out_dtype=ACC).to(ACC)
            delta = tl.load(DELTA + row_ptr + i, mask=i < lq, other=0.0)
            ds = p * (dp - delta[:, None])
            if SOFTCAP:
                ds = ds * (1.0 - t * t)
            ds = ds * scale
            dk += tl.dot(tl.trans(ds.to(DOT)), qb, input_precision=PRECISION, out_dtype=ACC).to(ACC)
    dk_ptr = DK + ks.to(tl.int64) * sdk_t + hk.to(tl.int64) * sdk_h
    dv_ptr = DV_OUT + ks.to(tl.int64) * sdv_t + hk.to(tl.int64) * sdv_h
    _store(dk_ptr, dk, j, lk, sdk_t, d, D, sdk_d)
    _store(dv_ptr, dvacc, j, lk, sdv_t, dv, DV, sdv_d)


@triton.jit
def dq_kernel(
    Q, K, V, DO, LSE, DELTA, DQ, TABLE,
    sq_t, sq_h, sq_d, sk_t, sk_h, sk_d, sv_t, sv_h, sv_d, sdo_t, sdo_h, sdo_d, sl_h,
    sdq_t, sdq_h, sdq_d,
    left, right, G, D, DV,
    SOFTCAP: tl.constexpr, HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    ACC: tl.constexpr, DOT: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    h = tl.program_id(1)
    hk = h // G
    scale, qk_scale, cap = _params(TABLE, SOFTCAP, ACC)
    qs, lq, ks, lk, i0 = _row(TABLE, tl.program_id(0))
    off = lk - lq
    i = i0 + tl.arange(0, BLOCK_M)
    d = tl.arange(0, BLOCK_D)
    dv = tl.arange(0, BLOCK_DV)
    q_ptr = Q + qs.to(tl.int64) * sq_t + h.to(tl.int64) * sq_h
    k_ptr = K + ks.to(tl.int64) * sk_t + hk.to(tl.int64) * sk_h
    v_ptr = V + ks.to(tl.int64) * sv_t + hk.to(tl.int64) * sv_h
    do_ptr = DO + qs.to(tl.int64) * sdo_t + h.to(tl.int64) * sdo_h
    qb = _tile(q_ptr, i, lq, sq_t, d, D, sq_d, False).to(DOT)
    dob = _tile(do_ptr, i, lq, sdo_t, dv, DV, sdo_d, False).to(DOT)
    row_ptr = h.to(tl.int64) * sl_h + qs
    lse = tl.load(LSE + row_ptr + i, mask=i < lq, other=0.0)
    lse = tl.where(lse == float("-inf"), 0.0, lse)
    delta = tl.load(DELTA + row_ptr + i, mask=i < lq, other=0.0)
    dq = tl.zeros([BLOCK_M, BLOCK_D], ACC)
    i1 = tl.minimum(i0 + BLOCK_M, lq)
    lo, hi = _key_range(i0, i1, off, lk, left, right, HAS_LEFT, HAS_RIGHT)
    for j0 in range(lo, hi, BLOCK_N):
        j = j0 + tl.arange(0, BLOCK_N)
        kt = _tile(k_ptr, j, lk, sk_t, d, D, sk_d, True).to(DOT)
        qk = tl.dot(qb, kt, input_precision=PRECISION, out_dtype=ACC).to(ACC)
        s, t = _scores(
            qk,
            i0,
            j0,
            i[:, None],
            j[None, :],
            off,
            lq,
            lk,
            qk_scale,
            cap,
            left,
            right,
            BLOCK_M,
            BLOCK_N,
            SOFTCAP,
            HAS_LEFT,
            HAS_RIGHT,
        )
        p = tl.exp(s * LN2 - lse[:, None])
        vt = _tile(v_ptr, j, lk, sv_t, dv, DV, sv_d, True).to(DOT)
        dp = tl.dot(dob, vt, input_precision=PRECISION, out_dtype=ACC).to(ACC)
        ds = p * (dp - delta[:, None])
        if SOFTCAP:
            ds = ds * (1.0 - t * t)
        ds = ds * scale
        dq += tl.dot(ds.to(DOT), tl.trans(kt), input_precision=PRECISION, out_dtype=ACC).to(ACC)
    dq_ptr = DQ + qs.to(tl.int64) * sdq_t + h.to(tl.int64) * sdq_h
    _store(dq_ptr, dq, i, lq, sdq_t, d, D, sdq_d)
