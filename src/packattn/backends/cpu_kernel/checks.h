// What the entry points accept. The Python wrapper validates every input first; these checks are the second
// line, so that a direct call with bad arguments raises (RuntimeError in Python) instead of reading out of
// bounds or dividing by zero. Strides of q, k, v and dout are free; offsets, LSE and delta are contiguous.
#pragma once

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <cmath>
#include <cstdint>
#include <utility>
#include <vector>

namespace packattn_kernel::detail {

inline void check_cpu(const char* where, const char* name, const at::Tensor& t) {
  TORCH_CHECK(t.defined(), where, ": expected a tensor for ", name, ", got None");
  TORCH_CHECK(t.device().is_cpu(), where, ": expected ", name, " on the CPU, got ", t.device());
}

// q (Tq, Hq, D), k (Tk, Hkv, D) and v (Tk, Hkv, Dv) of one dtype among float32, bfloat16 and float16, with
// Hq a multiple of Hkv > 0, Hq > 0 and D, Dv > 0.
inline void check_qkv(const char* where, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v) {
  const std::pair<const char*, const at::Tensor*> named[] = {{"q", &q}, {"k", &k}, {"v", &v}};
  for (const auto& [name, t] : named) {
    check_cpu(where, name, *t);
    TORCH_CHECK(t->dim() == 3, where, ": expected ", name, " of 3 dims (tokens, heads, head_dim), got shape ",
                t->sizes());
  }
  const at::ScalarType dtype = q.scalar_type();
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16 || dtype == at::kHalf, where,
              ": expected q of dtype Float, BFloat16 or Half, got ", dtype);
  TORCH_CHECK(k.scalar_type() == dtype && v.scalar_type() == dtype, where, ": expected k and v of q's dtype (", dtype,
              "), got ", k.scalar_type(), " and ", v.scalar_type());
  const int64_t hq = q.size(1), hkv = k.size(1);
  TORCH_CHECK(hq > 0 && hkv > 0 && hq % hkv == 0, where,
              ": expected query heads a positive multiple of key/value heads > 0, got ", hq, " and ", hkv);
  TORCH_CHECK(v.size(0) == k.size(0) && v.size(1) == hkv, where,
              ": expected k and v with the same tokens and heads, got shapes ", k.sizes(), " and ", v.sizes());
  TORCH_CHECK(k.size(2) == q.size(2), where, ": expected q and k of one head_dim, got ", q.size(2), " and ", k.size(2));
  TORCH_CHECK(q.size(2) > 0 && v.size(2) > 0, where, ": expected head dims > 0, got ", q.size(2), " (q, k) and ",
              v.size(2), " (v)");
}

// Offsets of B + 1 sequences' starts: int64, 1-D, contiguous, from 0, non-decreasing, ending at `tokens`.
inline void check_offsets(const char* where, const char* name, const at::Tensor& cu, int64_t tokens) {
  check_cpu(where, name, cu);
  TORCH_CHECK(cu.scalar_type() == at::kLong, where, ": expected ", name, " of dtype Long, got ", cu.scalar_type());
  TORCH_CHECK(cu.dim() == 1 && cu.size(0) >= 1, where, ": expected ", name, " 1-D with B + 1 >= 1 entries, got shape ",
              cu.sizes());
  TORCH_CHECK(cu.is_contiguous(), where, ": expected ", name, " contiguous, got strides ", cu.strides());
  const int64_t* p = cu.data_ptr<int64_t>();
  const int64_t n = cu.size(0);
  TORCH_CHECK(p[0] == 0, where, ": expected ", name, " to start at 0, got ", p[0]);
  for (int64_t b = 1; b < n; ++b) {
    TORCH_CHECK(p[b] >= p[b - 1], where, ": expected ", name, " non-decreasing, got ", p[b - 1], " then ", p[b],
                " at entry ", b);
  }
  TORCH_CHECK(p[n - 1] == tokens, where, ": expected ", name, " to end at the token count ", tokens, ", got ",
              p[n - 1]);
}

inline void check_mask(const char* where, double scale, double softcap, int64_t left, int64_t right) {
  TORCH_CHECK(std::isfinite(scale) && scale > 0, where, ": expected a finite scale > 0, got ", scale);
  TORCH_CHECK(std::isfinite(softcap) && softcap >= 0, where, ": expected a finite softcap >= 0 (0: none), got ",
              softcap);
  TORCH_CHECK(left >= -1 && right >= -1, where, ": expected window bounds >= -1 (-1: unbounded), got left ", left,
              " and right ", right);
}

// Everything both entry points take.
inline void check_inputs(const char* where, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                         const at::Tensor& cu_q, const at::Tensor& cu_k, double scale, double softcap, int64_t left,
                         int64_t right) {
  check_qkv(where, q, k, v);
  check_offsets(where, "cu_q", cu_q, q.size(0));
  check_offsets(where, "cu_k", cu_k, k.size(0));
  TORCH_CHECK(cu_q.size(0) == cu_k.size(0), where, ": expected cu_q and cu_k of one length, got ", cu_q.size(0),
              " and ", cu_k.size(0));
  check_mask(where, scale, softcap, left, right);
}

// out and dout (Tq, Hq, Dv) of one shape and one dtype among float32, bfloat16 and float16, any strides.
inline void check_delta_inputs(const char* where, const at::Tensor& out, const at::Tensor& dout) {
  check_cpu(where, "out", out);
  check_cpu(where, "dout", dout);
  TORCH_CHECK(out.dim() == 3, where, ": expected out of 3 dims (tokens, heads, head_dim), got shape ", out.sizes());
  TORCH_CHECK(dout.sizes() == out.sizes(), where, ": expected dout of out's shape ", out.sizes(), ", got ",
              dout.sizes());
  const at::ScalarType dtype = out.scalar_type();
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16 || dtype == at::kHalf, where,
              ": expected out of dtype Float, BFloat16 or Half, got ", dtype);
  TORCH_CHECK(dout.scalar_type() == dtype, where, ": expected dout of out's dtype (", dtype, "), got ",
              dout.scalar_type());
}

// The backward's own inputs: dout (Tq, Hq, Dv) of q's dtype; lse and delta float32 (Hq, Tq), contiguous.
inline void check_grad_inputs(const char* where, const at::Tensor& q, const at::Tensor& v, const at::Tensor& dout,
                              const at::Tensor& lse, const at::Tensor& delta) {
  check_cpu(where, "dout", dout);
  TORCH_CHECK(dout.scalar_type() == q.scalar_type(), where, ": expected dout of q's dtype (", q.scalar_type(),
              "), got ", dout.scalar_type());
  const std::vector<int64_t> out_shape{q.size(0), q.size(1), v.size(2)}, row_shape{q.size(1), q.size(0)};
  TORCH_CHECK(dout.sizes() == at::IntArrayRef(out_shape), where, ": expected dout of shape (Tq, Hq, Dv) ",
              at::IntArrayRef(out_shape), ", got ", dout.sizes());
  const std::pair<const char*, const at::Tensor*> named[] = {{"lse", &lse}, {"delta", &delta}};
  for (const auto& [name, t] : named) {
    check_cpu(where, name, *t);
    TORCH_CHECK(t->scalar_type() == at::kFloat, where, ": expected ", name, " of dtype Float, got ", t->scalar_type());
    TORCH_CHECK(t->sizes() == at::IntArrayRef(row_shape), where, ": expected ", name, " of shape (Hq, Tq) ",
                at::IntArrayRef(row_shape), ", got ", t->sizes());
    TORCH_CHECK(t->is_contiguous(), where, ": expected ", name, " contiguous, got strides ", t->strides());
  }
}

}  // namespace packattn_kernel::detail
