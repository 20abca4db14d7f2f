// packattn's CPU attention kernel: exact attention over a packed variable-length batch, forward and
// backward, in one call each. The Python wrapper (__init__.py) validates every input before it gets here.
//
// How: the batch is cut into work items of one sequence, one KV head (all G query heads that read it, stacked
// as G x block rows, so every K/V tile is loaded once for the group) and one block of query rows (forward,
// dQ) or keys (dK/dV). Items are split between threads by their count of visible (query, key) pairs, so
// many short sequences and one long causal sequence both keep every thread busy. Within an item, tiles of
// keys that the mask hides entirely are never visited; scores live in one (rows x keys) tile per thread.
// Products run on ATen's CPU GEMMs: fp32 via cpublas::gemm (MKL / oneDNN); bf16/fp16 on CPUs with matrix
// units (AMX) via cpublas::brgemm on VNNI-packed tiles, elsewhere as fp32 tiles. Accumulation is fp32.
// Every output element is written by exactly one item, in an order fixed by the item alone: results are
// the same bits at any thread count.
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <ATen/native/CPUBlas.h>
#include <torch/extension.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <type_traits>
#include <vector>

namespace {

using Vec = at::vec::Vectorized<float>;
constexpr float kNegInf = -std::numeric_limits<float>::infinity();
constexpr int64_t kVec = Vec::size();

// ---------------------------------------------------------------------------------------------------------
// Problem description

struct Seq {  // query rows [q0, q0 + lq) with key rows [k0, k0 + lk)
  int64_t q0, lq, k0, lk;
};

struct Mask {
  float scale, softcap;
  int64_t left, right;  // window bounds, -1 = unbounded; causal is right = 0 (bottom-right aligned)

  // Keys [lo, hi) that query row i of s sees (hi <= lo: none).
  int64_t lo(const Seq& s, int64_t i) const {
    return left < 0 ? 0 : std::clamp<int64_t>(i + s.lk - s.lq - left, 0, s.lk);
  }
  int64_t hi(const Seq& s, int64_t i) const {
    return right < 0 ? s.lk : std::clamp<int64_t>(i + s.lk - s.lq + right + 1, 0, s.lk);
  }
  // Query rows [first, last) that see some key of [j0, j1) (j0 < j1 <= lk).
  int64_t first_row(const Seq& s, int64_t j0) const {
    return right < 0 ? 0 : std::clamp<int64_t>(j0 - (s.lk - s.lq) - right, 0, s.lq);
  }
  int64_t last_row(const Seq& s, int64_t j1) const {
    return left < 0 ? s.lq : std::clamp<int64_t>(j1 - (s.lk - s.lq) + left, 0, s.lq);
  }
};

template <typename T>
struct Rows {  // a (tokens, heads, dim) tensor with any strides
  const T* data;
  int64_t s0, s1, s2;
  const T* at(int64_t t, int64_t h) const { return data + t * s0 + h * s1; }
};

template <typename T>
Rows<T> rows_of(const at::Tensor& x) {
  return {x.data_ptr<T>(), x.stride(0), x.stride(1), x.stride(2)};
}

struct Shape {
  int64_t hkv, g, d, dv;
};

std::vector<Seq> sequences(const at::Tensor& cu_q, const at::Tensor& cu_k) {
  auto q = cu_q.accessor<int64_t, 1>();
  auto k = cu_k.accessor<int64_t, 1>();
  std::vector<Seq> seqs;
  for (int64_t b = 0; b + 1 < cu_q.size(0); ++b) {
    seqs.push_back({q[b], q[b + 1] - q[b], k[b], k[b + 1] - k[b]});
  }
  return seqs;
}

// ---------------------------------------------------------------------------------------------------------
// Work items and their balanced split between threads

struct Item {
  int64_t b, h, r0, r1;  // sequence, KV head, query rows or keys [r0, r1)
};

struct Plan {
  std::vector<Item> items;
  std::vector<double> cost;
};

// Items of `block` query rows (by_keys = false) or keys (by_keys = true), costed by visible pairs.
Plan make_plan(const std::vector<Seq>& seqs, const Mask& mask, const Shape& sh, int64_t block, bool by_keys) {
  Plan plan;
  for (int64_t b = 0; b < (int64_t)seqs.size(); ++b) {
    const Seq& s = seqs[b];
    const int64_t n = by_keys ? s.lk : s.lq;
    for (int64_t r0 = 0; r0 < n; r0 += block) {
      const int64_t r1 = std::min(n, r0 + block);
      double pairs = 0;
      if (!by_keys) {
        for (int64_t i = r0; i < r1; ++i) pairs += std::max<int64_t>(0, mask.hi(s, i) - mask.lo(s, i));
      } else if (s.lq > 0) {
        for (int64_t i = mask.first_row(s, r0); i < mask.last_row(s, r1); ++i) {
          pairs += std::max<int64_t>(0, std::min(r1, mask.hi(s, i)) - std::max(r0, mask.lo(s, i)));
        }
      }
      const double c = sh.g * (pairs + 8.0 * (r1 - r0)) * (sh.d + sh.dv) + 2048.0;  // + fixed cost
      for (int64_t h = 0; h < sh.hkv; ++h) {
        plan.items.push_back({b, h, r0, r1});
        plan.cost.push_back(c);
      }
    }
  }
  return plan;
}

// Runs fn(item, workspace) for every item: thread t gets a contiguous run of items of about 1/threads of
// the total cost. Which thread runs an item never changes what the item computes.
template <typename W, typename F>
void run_plan(const Plan& plan, const W& make_workspace, const F& fn) {
  const int64_t n = plan.items.size();
  if (n == 0) return;
  const int64_t parts = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), n));
  std::vector<double> prefix(n + 1, 0.0);
  for (int64_t i = 0; i < n; ++i) prefix[i + 1] = prefix[i] + plan.cost[i];
  std::vector<int64_t> bound(parts + 1, n);
  for (int64_t t = 0; t < parts; ++t) {
    const double target = prefix[n] * t / parts;
    bound[t] = std::lower_bound(prefix.begin(), prefix.begin() + n, target) - prefix.begin();
  }
  at::parallel_for(0, parts, 1, [&](int64_t t0, int64_t t1) {
    auto ws = make_workspace();
    for (int64_t t = t0; t < t1; ++t) {
      for (int64_t i = bound[t]; i < bound[t + 1]; ++i) fn(plan.items[i], ws);
    }
  });
}

// ---------------------------------------------------------------------------------------------------------
// Tiles

template <typename U = float>
U* buffer(std::vector<at::Tensor>& keep, int64_t n) {  // 64-byte aligned scratch
  keep.push_back(at::empty({std::max<int64_t>(n, 1)}, c10::CppTypeToScalarType<U>::value));
  return keep.back().data_ptr<U>();
}

template <typename T, typename U>
void load_row(const T* src, int64_t stride, int64_t n, U* dst) {  // converted to U (fp32, or T itself)
  if (stride == 1) {
    at::vec::convert(src, dst, n);
  } else {
    for (int64_t i = 0; i < n; ++i) dst[i] = static_cast<U>(src[i * stride]);
  }
}

inline int64_t pad16(int64_t n) { return (n + 15) / 16 * 16; }

// Rows [t0, t0 + n) of head h as a [npad, ld] tile: columns from width on and rows from n on are zero.
template <typename T, typename U>
void load_tile(const Rows<T>& x, int64_t t0, int64_t n, int64_t npad, int64_t h, int64_t width, int64_t ld, U* dst) {
  for (int64_t r = 0; r < n; ++r) {
    load_row(x.at(t0 + r, h), x.s2, width, dst + r * ld);
    std::fill(dst + r * ld + width, dst + (r + 1) * ld, U(0));
  }
  std::fill(dst + n * ld, dst + npad * ld, U(0));
}

// The same rows transposed: a [width_pad, npad] tile, columns from n on and rows from width on zero.
template <typename T, typename U>
void load_tile_t(const Rows<T>& x, int64_t t0, int64_t n, int64_t npad, int64_t h, int64_t width, int64_t width_pad,
                 U* dst) {
  for (int64_t r = 0; r < n; ++r) {
    const T* src = x.at(t0 + r, h);
    for (int64_t c = 0; c < width; ++c) dst[c * npad + r] = static_cast<U>(src[c * x.s2]);
  }
  for (int64_t c = 0; c < width; ++c) std::fill(dst + c * npad + n, dst + (c + 1) * npad, U(0));
  std::fill(dst + width * npad, dst + width_pad * npad, U(0));
}

// The G x bq rows of a query-side tensor (q or dout) for KV head h as a [pad16(G x bq), ld] tile: row
// gi * bq + ii is query row i0 + ii of query head h * G + gi; padding rows and columns are zero.
template <typename T, typename U>
void load_group(const Rows<T>& x, const Seq& s, int64_t i0, int64_t bq, int64_t h, int64_t g, int64_t width,
                int64_t ld, U* dst) {
  for (int64_t gi = 0; gi < g; ++gi) {
    for (int64_t ii = 0; ii < bq; ++ii) {
      U* row = dst + (gi * bq + ii) * ld;
      load_row(x.at(s.q0 + i0 + ii, h * g + gi), x.s2, width, row);
      std::fill(row + width, row + ld, U(0));
    }
  }
  std::fill(dst + g * bq * ld, dst + pad16(g * bq) * ld, U(0));
}

void transpose(const float* src, int64_t rows, int64_t cols, float* dst) {  // [rows, cols] -> [cols, rows]
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t c = 0; c < cols; ++c) dst[c * rows + r] = src[r * cols + c];
  }
}

// Row-major C[M, N] (+)= A[M, K] @ B[K, N] on ATen's batch-reduce GEMM (oneDNN, else MKL / native). The
// tile sizes are multiples of 16, so few distinct shapes get generated and cached.
inline void mm(int64_t m, int64_t n, int64_t k, const float* a, int64_t lda, const float* b, int64_t ldb, float* c,
               int64_t ldc, bool add) {
  at::native::cpublas::brgemm(m, n, k, lda, ldb, ldc, add, a, b, c, false);
}

constexpr int64_t kPackN = 64;  // oneDNN packs B in column blocks of 16, 32, 48 or 64

// The same in bf16 on the CPU's matrix units (AMX): B (K even, N a multiple of 16) is packed to VNNI one
// block of up to 64 columns at a time into `packed` (K x 64) and multiplied; accumulation in fp32.
inline void mm_amx(int64_t m, int64_t n, int64_t k, const at::BFloat16* a, int64_t lda, const at::BFloat16* b,
                   int64_t ldb, at::BFloat16* packed, float* c, int64_t ldc, bool add) {
  for (int64_t n0 = 0; n0 < n; n0 += kPackN) {
    const int64_t nc = std::min(kPackN, n - n0);
    at::native::cpublas::pack(k, nc, ldb, nc, at::kBFloat16, at::kBFloat16, b + n0, packed);
    at::native::cpublas::brgemm(m, nc, k, lda, nc, ldc, add, a, packed, c + n0, true);
  }
}

bool use_amx(at::ScalarType dtype) { return dtype == at::kBFloat16 && at::native::cpublas::could_pack(dtype); }

// Scaled (and soft-capped) scores in place on x[0, n); with tanh_out, also the tanh of soft-capping.
inline void transform_scores(float* x, int64_t n, const Mask& mask, float* tanh_out) {
  const Vec scale(mask.scale), cap(mask.softcap), inner(mask.scale / std::max(mask.softcap, 1e-30f));
  for (int64_t c = 0; c < n; c += kVec) {
    const int64_t cnt = std::min(kVec, n - c);
    Vec v = Vec::loadu(x + c, cnt);
    if (mask.softcap > 0) {
      Vec t = (v * inner).tanh();
      if (tanh_out) t.store(tanh_out + c, cnt);
      v = t * cap;
    } else {
      v = v * scale;
    }
    v.store(x + c, cnt);
  }
}

// Columns [c0, c1) of a row of the tile [j0, j0 + bk) that query row i sees.
inline std::pair<int64_t, int64_t> visible_cols(const Mask& mask, const Seq& s, int64_t i, int64_t j0, int64_t bk, bool full) {
  if (full) return {0, bk};
  return {std::clamp<int64_t>(mask.lo(s, i) - j0, 0, bk), std::clamp<int64_t>(mask.hi(s, i) - j0, 0, bk)};
}

inline bool tile_fully_visible(const Mask& mask, const Seq& s, int64_t i0, int64_t i1, int64_t j0, int64_t j1) {
  return mask.lo(s, i1 - 1) <= j0 && mask.hi(s, i0) >= j1;
}

inline void zero_outside(float* row, int64_t c0, int64_t c1, int64_t bk) {
  std::fill(row, row + c0, 0.f);
  std::fill(row + std::max(c0, c1), row + bk, 0.f);
}

// ---------------------------------------------------------------------------------------------------------
// Forward

constexpr int64_t kFwdRows = 128;  // target G x block_q rows of one forward item
constexpr int64_t kFwdKeys = 256;  // keys per score tile

struct FwdWork {
  std::vector<at::Tensor> keep;
  float *q, *s, *kt, *v, *acc, *m, *l;
  at::BFloat16 *qh, *kth, *vh, *ph, *pack;  // bf16 tiles for the matrix units
  bool amx = false;
  ~FwdWork() {
    if (amx) at::native::cpublas::brgemm_release();
  }
};

// Online softmax of one score row over its visible columns [c0, c1): turns them into exp(s - m_new),
// zeroes the rest of the padded row, updates the running max m and sum l; returns the factor by which the
// row's accumulator must be rescaled.
inline float softmax_row(float* row, int64_t c0, int64_t c1, int64_t width, const Mask& mask, float& m, float& l) {
  if (c1 <= c0) {
    std::fill(row, row + width, 0.f);
    return 1.f;
  }
  transform_scores(row + c0, c1 - c0, mask, nullptr);
  const float mx = at::vec::reduce_all<float>([](Vec a, Vec b) { return at::vec::maximum(a, b); }, row + c0, c1 - c0);
  const float m_new = std::max(m, mx);
  const Vec shift(m_new);
  at::vec::map([shift](Vec x) { return (x - shift).exp_u20(); }, row + c0, row + c0, c1 - c0);
  const float sum = at::vec::reduce_all<float>([](Vec a, Vec b) { return a + b; }, row + c0, c1 - c0);
  zero_outside(row, c0, c1, width);
  const float alpha = std::exp(m - m_new);  // 0 when m was -inf
  l = l * alpha + sum;
  m = m_new;
  return alpha;
}

// One forward item. kAmx: bf16 tiles on the matrix units (T is BFloat16), else fp32 tiles.
template <bool kAmx, typename T>
void forward_item(const Item& it, FwdWork& w, const std::vector<Seq>& seqs, const Mask& mask, const Shape& sh,
                  const Rows<T>& q, const Rows<T>& k, const Rows<T>& v, T* out, float* lse, int64_t hq, int64_t tq) {
  const Seq& s = seqs[it.b];
  const int64_t i0 = it.r0, i1 = it.r1, bq = i1 - i0, rows = sh.g * bq, mp = pad16(rows), d = sh.d, dv = sh.dv;
  const int64_t dp = kAmx ? (d + 1) / 2 * 2 : d, ldo = kAmx ? pad16(dv) : dv;  // VNNI: even K, N in 16s
  if constexpr (kAmx) {
    load_group(q, s, i0, bq, it.h, sh.g, d, dp, w.qh);
  } else {
    load_group(q, s, i0, bq, it.h, sh.g, d, d, w.q);
  }
  std::fill(w.m, w.m + rows, kNegInf);
  std::fill(w.l, w.l + rows, 0.f);
  std::fill(w.acc, w.acc + mp * ldo, 0.f);
  const int64_t lo = mask.lo(s, i0), hi = mask.hi(s, i1 - 1);
  for (int64_t j0 = lo; j0 < hi; j0 += kFwdKeys) {
    const int64_t j1 = std::min(hi, j0 + kFwdKeys), bk = j1 - j0, kp = pad16(bk);
    if constexpr (kAmx) {
      load_tile_t(k, s.k0 + j0, bk, kp, it.h, d, dp, w.kth);
      mm_amx(mp, kp, dp, w.qh, dp, w.kth, kp, w.pack, w.s, kp, false);
    } else {
      load_tile_t(k, s.k0 + j0, bk, kp, it.h, d, d, w.kt);
      mm(mp, kp, d, w.q, d, w.kt, kp, w.s, kp, false);
    }
    const bool full = tile_fully_visible(mask, s, i0, i1, j0, j1);
    for (int64_t r = 0; r < rows; ++r) {
      auto [c0, c1] = visible_cols(mask, s, i0 + r % bq, j0, bk, full);
      const float alpha = softmax_row(w.s + r * kp, c0, c1, kp, mask, w.m[r], w.l[r]);
      if (alpha != 1.f) {
        const Vec a(alpha);
        at::vec::map([a](Vec x) { return x * a; }, w.acc + r * ldo, w.acc + r * ldo, dv);
      }
    }
    if constexpr (kAmx) {
      at::vec::convert(w.s, w.ph, mp * kp);
      load_tile(v, s.k0 + j0, bk, kp, it.h, dv, ldo, w.vh);
      mm_amx(mp, ldo, kp, w.ph, kp, w.vh, ldo, w.pack, w.acc, ldo, true);
    } else {
      load_tile(v, s.k0 + j0, bk, kp, it.h, dv, dv, w.v);
      mm(mp, dv, kp, w.s, kp, w.v, dv, w.acc, dv, true);
    }
  }
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t t = s.q0 + i0 + r % bq, head = it.h * sh.g + r / bq;
    float* acc = w.acc + r * ldo;
    const bool seen = w.l[r] > 0.f;
    const Vec inv(seen ? 1.f / w.l[r] : 0.f);
    at::vec::map([inv](Vec x) { return x * inv; }, acc, acc, dv);
    at::vec::convert(acc, out + (t * hq + head) * dv, dv);
    if (lse) lse[head * tq + t] = seen ? w.m[r] + std::log(w.l[r]) : kNegInf;
  }
}

#define PACKATTN_DISPATCH(TYPE, NAME, ...)                                                  \
  AT_DISPATCH_SWITCH(TYPE, NAME, AT_DISPATCH_CASE(at::kFloat, __VA_ARGS__)                  \
                                     AT_DISPATCH_CASE(at::kBFloat16, __VA_ARGS__)            \
                                         AT_DISPATCH_CASE(at::kHalf, __VA_ARGS__))

std::tuple<at::Tensor, at::Tensor> attention_forward(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                                     const at::Tensor& cu_q, const at::Tensor& cu_k, double scale,
                                                     double softcap, int64_t left, int64_t right, bool with_lse) {
  const int64_t tq = q.size(0), hq = q.size(1), hkv = k.size(1);
  const Shape sh{hkv, hq / hkv, q.size(2), v.size(2)};
  const Mask mask{(float)scale, (float)softcap, left, right};
  const auto seqs = sequences(cu_q, cu_k);
  auto out = at::empty({tq, hq, sh.dv}, q.options());
  auto lse = with_lse ? at::empty({hq, tq}, q.options().dtype(at::kFloat)) : at::Tensor();
  const int64_t block_q = std::max<int64_t>(1, kFwdRows / sh.g), mp = pad16(sh.g * block_q);
  const Plan plan = make_plan(seqs, mask, sh, block_q, false);
  PACKATTN_DISPATCH(q.scalar_type(), "packattn_forward", [&] {
    const auto qr = rows_of<scalar_t>(q), kr = rows_of<scalar_t>(k), vr = rows_of<scalar_t>(v);
    scalar_t* o = out.data_ptr<scalar_t>();
    float* l = with_lse ? lse.data_ptr<float>() : nullptr;
    const bool amx = use_amx(q.scalar_type());
    const int64_t dp = sh.d + 1, dvp = pad16(sh.dv);
    auto make = [&] {
      FwdWork w;
      w.s = buffer(w.keep, mp * kFwdKeys);
      w.acc = buffer(w.keep, mp * dvp);
      w.m = buffer(w.keep, mp);
      w.l = buffer(w.keep, mp);
      if (amx) {
        w.amx = true;
        w.qh = buffer<at::BFloat16>(w.keep, mp * dp);
        w.kth = buffer<at::BFloat16>(w.keep, kFwdKeys * dp);
        w.vh = buffer<at::BFloat16>(w.keep, kFwdKeys * dvp);
        w.ph = buffer<at::BFloat16>(w.keep, mp * kFwdKeys);
        w.pack = buffer<at::BFloat16>(w.keep, std::max(dp, kFwdKeys) * kPackN);
      } else {
        w.q = buffer(w.keep, mp * sh.d);
        w.kt = buffer(w.keep, kFwdKeys * sh.d);
        w.v = buffer(w.keep, kFwdKeys * sh.dv);
      }
      return w;
    };
    if constexpr (std::is_same_v<scalar_t, at::BFloat16>) {
      if (amx) {
        run_plan(plan, make, [&](const Item& it, FwdWork& w) {
          forward_item<true>(it, w, seqs, mask, sh, qr, kr, vr, o, l, hq, tq);
        });
        return;
      }
    }
    run_plan(plan, make, [&](const Item& it, FwdWork& w) {
      forward_item<false>(it, w, seqs, mask, sh, qr, kr, vr, o, l, hq, tq);
    });
  });
  return {out, lse};
}

// ---------------------------------------------------------------------------------------------------------
// Backward (flash-attention 2 style: probabilities recomputed from the LSE). dK/dV per (sequence, KV head,
// key block) item looping over the query rows that see it; dQ per (sequence, KV head, query block) item.

constexpr int64_t kBwdRows = 64;   // target G x block_q rows
constexpr int64_t kBwdKeys = 128;  // keys per tile

struct BwdWork {
  std::vector<at::Tensor> keep;
  float *q, *dout, *lse, *delta, *s, *ds, *st, *tanh, *kt, *vt, *k, *acc, *acc2;
};

// Rows [i0, i0 + bq) (x G heads) of s are in w.q, w.dout, w.lse, w.delta; keys [j0, j0 + bk) in w.kt, w.vt
// (transposed, padded to kp). Leaves P in w.s and dS (the gradient of the raw scores q.k) in w.ds, both
// [pad16(rows), kp] with zeros wherever a pair is hidden or padding.
void grad_tile(BwdWork& w, const Seq& s, const Mask& mask, const Shape& sh, int64_t i0, int64_t bq, int64_t j0, int64_t bk) {
  const int64_t rows = sh.g * bq, mp = pad16(rows), kp = pad16(bk);
  mm(mp, kp, sh.d, w.q, sh.d, w.kt, kp, w.s, kp, false);
  mm(mp, kp, sh.dv, w.dout, sh.dv, w.vt, kp, w.ds, kp, false);
  const bool full = tile_fully_visible(mask, s, i0, i0 + bq, j0, j0 + bk);
  const bool capped = mask.softcap > 0;
  for (int64_t r = 0; r < rows; ++r) {
    float *p = w.s + r * kp, *ds = w.ds + r * kp, *t = w.tanh;
    auto [c0, c1] = visible_cols(mask, s, i0 + r % bq, j0, bk, full);
    if (c1 <= c0 || w.lse[r] == kNegInf) {
      c0 = c1 = 0;
    } else {
      transform_scores(p + c0, c1 - c0, mask, capped ? t : nullptr);
    }
    const Vec lse(w.lse[r]), delta(w.delta[r]), scale(mask.scale), one(1.f);
    for (int64_t c = c0; c < c1; c += kVec) {
      const int64_t cnt = std::min(kVec, c1 - c);
      const Vec pv = (Vec::loadu(p + c, cnt) - lse).exp_u20();
      Vec dsv = pv * (Vec::loadu(ds + c, cnt) - delta) * scale;
      if (capped) {
        const Vec tv = Vec::loadu(t + (c - c0), cnt);
        dsv = dsv * (one - tv * tv);
      }
      pv.store(p + c, cnt);
      dsv.store(ds + c, cnt);
    }
    zero_outside(p, c0, c1, kp);
    zero_outside(ds, c0, c1, kp);
  }
}

template <typename T>
void load_query_side(BwdWork& w, const Seq& s, int64_t i0, int64_t bq, int64_t h, const Shape& sh, const Rows<T>& q,
                     const Rows<T>& dout, const float* lse, const float* delta, int64_t tq) {
  load_group(q, s, i0, bq, h, sh.g, sh.d, sh.d, w.q);
  load_group(dout, s, i0, bq, h, sh.g, sh.dv, sh.dv, w.dout);
  for (int64_t gi = 0; gi < sh.g; ++gi) {
    for (int64_t ii = 0; ii < bq; ++ii) {
      const int64_t idx = (h * sh.g + gi) * tq + s.q0 + i0 + ii;
      w.lse[gi * bq + ii] = lse[idx];
      w.delta[gi * bq + ii] = delta[idx];
    }
  }
}

void store_rows(const float* src, int64_t n, int64_t width, float* dst, int64_t ld) {
  for (int64_t r = 0; r < n; ++r) std::copy(src + r * width, src + (r + 1) * width, dst + r * ld);
}

template <typename T>
struct BwdArgs {
  const std::vector<Seq>& seqs;
  Mask mask;
  Shape sh;
  Rows<T> q, k, v, dout;
  const float *lse, *delta;
  float *dq, *dk, *dv;
  int64_t tq, hq, block_q;
};

template <typename T>
void dkdv_item(const Item& it, BwdWork& w, const BwdArgs<T>& a) {
  const Seq& s = a.seqs[it.b];
  const Shape& sh = a.sh;
  const int64_t j0 = it.r0, bk = it.r1 - it.r0, kp = pad16(bk);
  load_tile_t(a.k, s.k0 + j0, bk, kp, it.h, sh.d, sh.d, w.kt);
  load_tile_t(a.v, s.k0 + j0, bk, kp, it.h, sh.dv, sh.dv, w.vt);
  float *dk = w.acc, *dv = w.acc2;
  std::fill(dk, dk + kp * sh.d, 0.f);
  std::fill(dv, dv + kp * sh.dv, 0.f);
  const int64_t last = a.mask.last_row(s, it.r1);
  for (int64_t i0 = a.mask.first_row(s, j0); i0 < last; i0 += a.block_q) {
    const int64_t bq = std::min(last, i0 + a.block_q) - i0, mp = pad16(sh.g * bq);
    load_query_side(w, s, i0, bq, it.h, sh, a.q, a.dout, a.lse, a.delta, a.tq);
    grad_tile(w, s, a.mask, sh, i0, bq, j0, bk);
    transpose(w.s, mp, kp, w.st);
    mm(kp, sh.dv, mp, w.st, mp, w.dout, sh.dv, dv, sh.dv, true);
    transpose(w.ds, mp, kp, w.st);
    mm(kp, sh.d, mp, w.st, mp, w.q, sh.d, dk, sh.d, true);
  }
  const int64_t hkv = sh.hkv, row0 = (s.k0 + j0) * hkv + it.h;
  store_rows(dk, bk, sh.d, a.dk + row0 * sh.d, hkv * sh.d);
  store_rows(dv, bk, sh.dv, a.dv + row0 * sh.dv, hkv * sh.dv);
}

template <typename T>
void dq_item(const Item& it, BwdWork& w, const BwdArgs<T>& a) {
  const Seq& s = a.seqs[it.b];
  const Shape& sh = a.sh;
  const int64_t i0 = it.r0, bq = it.r1 - it.r0, mp = pad16(sh.g * bq);
  load_query_side(w, s, i0, bq, it.h, sh, a.q, a.dout, a.lse, a.delta, a.tq);
  float* dq = w.acc;
  std::fill(dq, dq + mp * sh.d, 0.f);
  const int64_t lo = a.mask.lo(s, i0), hi = a.mask.hi(s, it.r1 - 1);
  for (int64_t j0 = lo; j0 < hi; j0 += kBwdKeys) {
    const int64_t bk = std::min(hi, j0 + kBwdKeys) - j0, kp = pad16(bk);
    load_tile_t(a.k, s.k0 + j0, bk, kp, it.h, sh.d, sh.d, w.kt);
    load_tile_t(a.v, s.k0 + j0, bk, kp, it.h, sh.dv, sh.dv, w.vt);
    load_tile(a.k, s.k0 + j0, bk, kp, it.h, sh.d, sh.d, w.k);
    grad_tile(w, s, a.mask, sh, i0, bq, j0, bk);
    mm(mp, sh.d, kp, w.ds, kp, w.k, sh.d, dq, sh.d, true);
  }
  for (int64_t gi = 0; gi < sh.g; ++gi) {
    store_rows(dq + gi * bq * sh.d, bq, sh.d, a.dq + ((s.q0 + i0) * a.hq + it.h * sh.g + gi) * sh.d, a.hq * sh.d);
  }
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> attention_backward(
    const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& dout, const at::Tensor& lse,
    const at::Tensor& delta, const at::Tensor& cu_q, const at::Tensor& cu_k, double scale, double softcap,
    int64_t left, int64_t right) {
  const int64_t tq = q.size(0), hq = q.size(1), tk = k.size(0), hkv = k.size(1);
  const Shape sh{hkv, hq / hkv, q.size(2), v.size(2)};
  const Mask mask{(float)scale, (float)softcap, left, right};
  const auto seqs = sequences(cu_q, cu_k);
  const auto f32 = q.options().dtype(at::kFloat);
  auto dq = at::empty({tq, hq, sh.d}, f32), dk = at::empty({tk, hkv, sh.d}, f32), dv = at::empty({tk, hkv, sh.dv}, f32);
  const int64_t block_q = std::max<int64_t>(1, kBwdRows / sh.g), mp = pad16(sh.g * block_q);
  auto make = [&] {
    BwdWork w;
    const int64_t width = std::max(sh.d, sh.dv);
    w.q = buffer(w.keep, mp * sh.d);
    w.dout = buffer(w.keep, mp * sh.dv);
    w.lse = buffer(w.keep, mp);
    w.delta = buffer(w.keep, mp);
    w.s = buffer(w.keep, mp * kBwdKeys);
    w.ds = buffer(w.keep, mp * kBwdKeys);
    w.st = buffer(w.keep, mp * kBwdKeys);
    w.tanh = buffer(w.keep, kBwdKeys);
    w.kt = buffer(w.keep, kBwdKeys * sh.d);
    w.vt = buffer(w.keep, kBwdKeys * sh.dv);
    w.k = buffer(w.keep, kBwdKeys * sh.d);
    w.acc = buffer(w.keep, std::max(mp, kBwdKeys) * width);
    w.acc2 = buffer(w.keep, kBwdKeys * sh.dv);
    return w;
  };
  PACKATTN_DISPATCH(q.scalar_type(), "packattn_backward", [&] {
    const BwdArgs<scalar_t> a{seqs, mask, sh, rows_of<scalar_t>(q), rows_of<scalar_t>(k), rows_of<scalar_t>(v),
                              rows_of<scalar_t>(dout), lse.data_ptr<float>(), delta.data_ptr<float>(),
                              dq.data_ptr<float>(), dk.data_ptr<float>(), dv.data_ptr<float>(), tq, hq, block_q};
    run_plan(make_plan(seqs, mask, sh, kBwdKeys, true), make, [&](const Item& it, BwdWork& w) { dkdv_item(it, w, a); });
    run_plan(make_plan(seqs, mask, sh, block_q, false), make, [&](const Item& it, BwdWork& w) { dq_item(it, w, a); });
  });
  return {dq, dk, dv};
}

bool matrix_units() { return use_amx(at::kBFloat16); }

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("forward", &attention_forward, "packed varlen attention forward -> (out, lse)");
  m.def("backward", &attention_backward, "packed varlen attention backward -> (dq, dk, dv) in fp32");
  m.def("matrix_units", &matrix_units, "whether bf16/fp16 products run on the CPU's matrix units");
}
