// packattn's CPU attention kernel: what forward.cpp and backward.cpp share. Exact attention over a packed
// variable-length batch, forward and backward, in one call each; the Python wrapper (__init__.py) validates
// every input before it gets here.
//
// How: the batch is cut into work items of one sequence, one KV head (all G query heads that read it, stacked
// as G x block rows, so every K/V tile is loaded once for the group) and one block of query rows (forward,
// dQ) or keys (dK/dV), or the whole sequence (the one-pass backward). Items are split between threads by
// their count of visible (query, key) pairs, so many short sequences and one long causal sequence both keep
// every thread busy; a thread's items come in (sequence, head) order, and the tiles it prepares (K^T, V,
// converted and packed) are kept for the next items of the same head (TileCache). Within an item, tiles of
// keys that the mask hides entirely are never visited; scores live in one (rows x keys) tile per thread.
// Products run on ATen's batch-reduce GEMM (cpublas::brgemm: oneDNN, else MKL): bf16 tiles packed to VNNI
// on CPUs with matrix units (AMX), fp32 tiles everywhere else (fp16, and bf16 without AMX, are converted:
// never a plain low-precision matmul). Accumulation is fp32.
// Every output element is written by exactly one item, in an order fixed by the item alone: results are
// the same bits at any thread count.
#pragma once

#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <ATen/native/CPUBlas.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <type_traits>
#include <vector>

namespace packattn_kernel {

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

inline std::vector<Seq> sequences(const at::Tensor& cu_q, const at::Tensor& cu_k) {
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

// Items of `block` query rows (by_keys = false) or keys (by_keys = true), costed by visible pairs, in the
// order (sequence, KV head, block): a thread's consecutive items share their sequence's key tiles (TileCache).
// With whole_sequences, one item of all keys per (sequence, KV head) that has rows on either side.
inline Plan make_plan(const std::vector<Seq>& seqs, const Mask& mask, const Shape& sh, int64_t block, bool by_keys,
                      bool whole_sequences = false) {
  Plan plan;
  std::vector<std::pair<int64_t, int64_t>> ranges;
  std::vector<double> cost;
  for (int64_t b = 0; b < (int64_t)seqs.size(); ++b) {
    const Seq& s = seqs[b];
    const int64_t n = by_keys ? s.lk : s.lq;
    ranges.clear();
    cost.clear();
    if (whole_sequences) {
      if (s.lq > 0 || s.lk > 0) ranges.emplace_back(0, n);
    } else {
      for (int64_t r0 = 0; r0 < n; r0 += block) ranges.emplace_back(r0, std::min(n, r0 + block));
    }
    for (const auto& [r0, r1] : ranges) {
      double pairs = 0;
      if (!by_keys) {
        for (int64_t i = r0; i < r1; ++i) pairs += std::max<int64_t>(0, mask.hi(s, i) - mask.lo(s, i));
      } else if (s.lq > 0 && r1 > r0) {
        for (int64_t i = mask.first_row(s, r0); i < mask.last_row(s, r1); ++i) {
          pairs += std::max<int64_t>(0, std::min(r1, mask.hi(s, i)) - std::max(r0, mask.lo(s, i)));
        }
      }
      const int64_t rows = whole_sequences ? s.lq + s.lk : r1 - r0;
      cost.push_back(sh.g * (pairs + 8.0 * rows) * (sh.d + sh.dv) + 2048.0);  // + fixed cost
    }
    for (int64_t h = 0; h < sh.hkv; ++h) {
      for (size_t r = 0; r < ranges.size(); ++r) {
        plan.items.push_back({b, h, ranges[r].first, ranges[r].second});
        plan.cost.push_back(cost[r]);
      }
    }
  }
  return plan;
}

// Releases the matrix units' state when a thread's work is done.
struct AmxRelease {
  bool active;
  ~AmxRelease() {
    if (active) at::native::cpublas::brgemm_release();
  }
};

// Runs fn(item, workspace) for every item: thread t gets a contiguous run of items of about 1/threads of
// the total cost. Which thread runs an item never changes what the item computes.
template <typename W, typename F>
void run_plan(const Plan& plan, bool amx, const W& make_workspace, const F& fn) {
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
    const AmxRelease release{amx};
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

// [rows, cols] (ld_src) -> [cols, rows] (ld_dst) in blocks of ATen's vectorized transposes.
template <typename E>
void transpose(const E* src, int64_t rows, int64_t cols, int64_t ld_src, E* dst, int64_t ld_dst) {
  constexpr int64_t kB = std::is_same_v<E, float> ? 16 : 32;
  for (int64_t r = 0; r < rows; r += kB) {
    for (int64_t c = 0; c < cols; c += kB) {
      at::vec::transpose_mxn<E>(src + r * ld_src + c, ld_src, dst + c * ld_dst + r, ld_dst,
                                (int)std::min(kB, rows - r), (int)std::min(kB, cols - c));
    }
  }
}

// The same rows transposed: a [width_pad, npad] tile, columns from n on and rows from width on zero. Read
// straight from the tensor when it already holds U with unit last stride, else through `scratch` ([n, width]).
template <typename T, typename U>
void load_tile_t(const Rows<T>& x, int64_t t0, int64_t n, int64_t npad, int64_t h, int64_t width, int64_t width_pad,
                 U* dst, U* scratch) {
  if constexpr (std::is_same_v<T, U>) {
    if (x.s2 == 1 && x.s0 >= width) {
      transpose(x.at(t0, h), n, width, x.s0, dst, npad);
    } else {
      load_tile(x, t0, n, n, h, width, width, scratch);
      transpose(scratch, n, width, width, dst, npad);
    }
  } else {
    load_tile(x, t0, n, n, h, width, width, scratch);
    transpose(scratch, n, width, width, dst, npad);
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


// Products: row-major C[M, N] (+)= A[M, K] @ B[K, N] on ATen's batch-reduce GEMM, with A and B fp32 tiles, or
// bf16 tiles on the matrix units (AMX). B is prepared once and reused: fp32 as it is; bf16 packed to VNNI
// in blocks of up to 64 columns (what oneDNN packs; K even, N a multiple of 16). Tile sizes are multiples
// of 16, so few distinct shapes get generated and cached.
struct BOperand {
  const void* data;
  int64_t ld;  // fp32: the row stride; packed bf16: the K the blocks were packed with (each K x block width)
};

constexpr int64_t kPackN = 64;

// A B operand [k, n] (row stride ld) that prepare_b left at p.
inline BOperand b_operand(const float* p, int64_t, int64_t ld) { return {p, ld}; }
inline BOperand b_operand(const at::BFloat16* p, int64_t k, int64_t) { return {p, k}; }

inline BOperand prepare_b(const float* b, int64_t, int64_t, int64_t ld, float*) { return {b, ld}; }

inline BOperand prepare_b(const at::BFloat16* b, int64_t k, int64_t n, int64_t ld, at::BFloat16* packed) {
  for (int64_t n0 = 0; n0 < n; n0 += kPackN) {
    const int64_t nc = std::min(kPackN, n - n0);
    at::native::cpublas::pack(k, nc, ld, nc, at::kBFloat16, at::kBFloat16, b + n0, packed + n0 * k);
  }
  return {packed, k};
}

// The first k rows of a prepared B may be used (k even for bf16), and the first n columns (a multiple of
// kPackN, or all of them, for bf16).
inline void mm(int64_t m, int64_t n, int64_t k, const float* a, int64_t lda, BOperand b, float* c, int64_t ldc,
               bool add) {
  at::native::cpublas::brgemm(m, n, k, lda, b.ld, ldc, add, a, static_cast<const float*>(b.data), c, false);
}

inline void mm(int64_t m, int64_t n, int64_t k, const at::BFloat16* a, int64_t lda, BOperand b, float* c,
               int64_t ldc, bool add) {
  const auto* packed = static_cast<const at::BFloat16*>(b.data);
  for (int64_t n0 = 0; n0 < n; n0 += kPackN) {
    const int64_t nc = std::min(kPackN, n - n0);
    at::native::cpublas::brgemm(m, nc, k, lda, nc, ldc, add, a, packed + n0 * b.ld, c + n0, true);
  }
}

// Columns of a prepared B that a product may use when it needs the first `need` of `n`.
template <typename E>
int64_t usable_cols(int64_t need, int64_t n) {
  const int64_t unit = std::is_same_v<E, float> ? 16 : kPackN;
  return std::min(n, (need + unit - 1) / unit * unit);
}

// Prepared tiles of one (sequence, KV head) on a fixed grid of blocks, kept while a thread's consecutive
// items are on the same sequence and head: each block is loaded, transposed, converted and packed once per
// head rather than once per item that reads it. O(longest sequence x width) per thread.
template <typename E>
struct TileCache {
  E* data = nullptr;
  int64_t slot = 0, b = -1, h = -1;
  std::vector<uint8_t> ready;

  void init(std::vector<at::Tensor>& keep, int64_t blocks, int64_t slot_elems);
  template <typename F>
  const E* get(int64_t seq, int64_t head, int64_t block, const F& prepare) {  // prepare(E* slot) fills it
    if (seq != b || head != h) {
      std::fill(ready.begin(), ready.end(), 0);
      b = seq;
      h = head;
    }
    if (!ready[block]) {
      prepare(data + block * slot);
      ready[block] = 1;
    }
    return data + block * slot;
  }
};

// Keys [j0, j0 + bk) of head h as a prepared B in `slot`: transposed ([width_pad, pad16(bk)], for Q K^T) or
// as rows ([pad16(bk), width_pad], for P V and dS K). bf16 tiles are laid out in `tmp` before packing;
// `scratch` holds [bk, width] for the transpose.
template <typename E, typename T>
void prepare_keys(const Rows<T>& x, int64_t j0, int64_t bk, int64_t h, int64_t width, int64_t width_pad,
                      bool transposed, E* slot, E* tmp, E* scratch) {
  const int64_t kp = pad16(bk);
  E* dst = std::is_same_v<E, float> ? slot : tmp;
  if (transposed) {
    load_tile_t(x, j0, bk, kp, h, width, width_pad, dst, scratch);
    prepare_b(dst, width_pad, kp, kp, slot);
  } else {
    load_tile(x, j0, bk, kp, h, width, width_pad, dst);
    prepare_b(dst, kp, width_pad, width_pad, slot);
  }
}

template <typename E>
void TileCache<E>::init(std::vector<at::Tensor>& keep, int64_t blocks, int64_t slot_elems) {
  data = buffer<E>(keep, blocks * slot_elems);
  slot = slot_elems;
  ready.assign(blocks, 0);
}

// Blocks of `block` rows that cover the longest sequence's keys (by_keys) or query rows: a TileCache's size.
inline int64_t max_blocks(const std::vector<Seq>& seqs, int64_t block, bool by_keys) {
  int64_t n = 0;
  for (const Seq& s : seqs) n = std::max(n, by_keys ? s.lk : s.lq);
  return (n + block - 1) / block;
}

// Whether tiles of this dtype run in bf16 on the matrix units (else as fp32 tiles).
inline bool use_amx(at::ScalarType dtype) {
  return dtype == at::kBFloat16 && at::native::cpublas::could_pack(dtype);
}

// Width of a tile dimension: bf16 tiles pad every dimension to 16 (VNNI), fp32 tiles need none.
template <typename E>
int64_t tile_width(int64_t n) {
  return std::is_same_v<E, float> ? n : pad16(n);
}

// An fp32 tile as a tile of E: itself, or converted into buf.
inline const float* as_tile(const float* x, int64_t, float*) { return x; }
inline const at::BFloat16* as_tile(const float* x, int64_t n, at::BFloat16* buf) {
  at::vec::convert(x, buf, n);
  return buf;
}

#define PACKATTN_DISPATCH(TYPE, NAME, ...)                                 \
  AT_DISPATCH_SWITCH(TYPE, NAME, AT_DISPATCH_CASE(at::kFloat, __VA_ARGS__) \
                     AT_DISPATCH_CASE(at::kBFloat16, __VA_ARGS__) AT_DISPATCH_CASE(at::kHalf, __VA_ARGS__))

// exp(x), for the softmax's x = score - max <= 0 (and slightly above, from rounding). With AVX-512: 2^n *
// 2^f, n = round(x log2 e), 2^f on [-1/2, 1/2] by a degree-5 polynomial fitted for relative error (at most
// 2.4e-7, 4 ulp) and scalef, which underflows to 0 cleanly: half the instructions of ATen's exp_u20 (20 ulp),
// which the other capabilities use. NaN stays NaN; -inf gives 0.
inline Vec exp_softmax(Vec x) {
#if defined(CPU_CAPABILITY_AVX512)
  const __m512 v = _mm512_max_ps(_mm512_set1_ps(-200.f), x);  // max(lo, NaN) is NaN
  const __m512 t = _mm512_mul_ps(v, _mm512_set1_ps(1.44269504088896341f));
  const __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(t, n);
  __m512 p = _mm512_fmadd_ps(_mm512_set1_ps(0.001327688223682344f), f, _mm512_set1_ps(0.009675689972937107f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.05550713092088699f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.24022117257118225f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.6931469440460205f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0000001192092896f));
  return _mm512_scalef_ps(p, n);
#else
  return x.exp_u20();
#endif
}

// Largest of x[0, n), n > 0: four independent chains (one is bound by the latency of max).
inline float row_max(const float* x, int64_t n) {
  const auto mx = [](Vec a, Vec b) { return at::vec::maximum(a, b); };
  const Vec lowest(kNegInf);
  Vec m0 = lowest, m1 = lowest, m2 = lowest, m3 = lowest;
  int64_t c = 0;
  for (; c + 4 * kVec <= n; c += 4 * kVec) {
    m0 = mx(m0, Vec::loadu(x + c));
    m1 = mx(m1, Vec::loadu(x + c + kVec));
    m2 = mx(m2, Vec::loadu(x + c + 2 * kVec));
    m3 = mx(m3, Vec::loadu(x + c + 3 * kVec));
  }
  for (; c + kVec <= n; c += kVec) m0 = mx(m0, Vec::loadu(x + c));
  if (c < n) m1 = mx(m1, Vec::set(lowest, Vec::loadu(x + c, n - c), n - c));
  return at::vec::vec_reduce_all<float>(mx, mx(mx(m0, m1), mx(m2, m3)));
}

// The scaled (and soft-capped) scores of raw q.k products; with softcap, also tanh(x * scale / softcap).
struct Scores {
  Vec scale, cap, inner;
  bool capped;
  explicit Scores(const Mask& mask)
      : scale(mask.scale), cap(mask.softcap), inner(mask.scale / std::max(mask.softcap, 1e-30f)),
        capped(mask.softcap > 0) {}
  Vec operator()(Vec x, Vec* tanh_out = nullptr) const {
    if (!capped) return x * scale;
    const Vec t = (x * inner).tanh();
    if (tanh_out) *tanh_out = t;
    return t * cap;
  }
  float operator()(float x) const {  // the same on one value (monotonic: the score of the largest raw product)
    Vec v(x);
    float out[kVec];
    (*this)(v).store(out);
    return out[0];
  }
};

// Stores cnt <= 2 x kVec values (a then b) as E.
inline void store_pair(float* dst, Vec a, Vec b, int64_t cnt) {
  a.store(dst, std::min(cnt, kVec));
  if (cnt > kVec) b.store(dst + kVec, cnt - kVec);
}
#if defined(CPU_CAPABILITY_AVX512)
// bf16 tiles run only on CPUs with matrix units, which all have AVX512-BF16: its rounding conversion (to
// nearest even, as ATen's) in one instruction.
__attribute__((target("avx512bf16"))) inline void store_pair(at::BFloat16* dst, Vec a, Vec b, int64_t cnt) {
  const __m512i pair = reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(b, a));
  _mm512_mask_storeu_epi16(dst, cnt >= 32 ? ~__mmask32(0) : (__mmask32(1) << cnt) - 1, pair);
}
#else
inline void store_pair(at::BFloat16* dst, Vec a, Vec b, int64_t cnt) {
  at::vec::convert_from_float<at::BFloat16>(a, b).store(dst, cnt);
}
#endif

// Columns [c0, c1) of a row of the tile [j0, j0 + bk) that query row i sees.
inline std::pair<int64_t, int64_t> visible_cols(const Mask& mask, const Seq& s, int64_t i, int64_t j0, int64_t bk, bool full) {
  if (full) return {0, bk};
  return {std::clamp<int64_t>(mask.lo(s, i) - j0, 0, bk), std::clamp<int64_t>(mask.hi(s, i) - j0, 0, bk)};
}

inline bool tile_fully_visible(const Mask& mask, const Seq& s, int64_t i0, int64_t i1, int64_t j0, int64_t j1) {
  return mask.lo(s, i1 - 1) <= j0 && mask.hi(s, i0) >= j1;
}

template <typename E>
void zero_outside(E* row, int64_t c0, int64_t c1, int64_t bk) {
  std::fill(row, row + c0, E(0));
  std::fill(row + std::max(c0, c1), row + bk, E(0));
}

std::tuple<at::Tensor, at::Tensor> attention_forward(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                                     const at::Tensor& cu_q, const at::Tensor& cu_k, double scale,
                                                     double softcap, int64_t left, int64_t right, bool with_lse);

std::tuple<at::Tensor, at::Tensor, at::Tensor> attention_backward(
    const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& dout, const at::Tensor& lse,
    const at::Tensor& delta, const at::Tensor& cu_q, const at::Tensor& cu_k, double scale, double softcap,
    int64_t left, int64_t right);

}  // namespace packattn_kernel
