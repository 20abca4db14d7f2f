// How operands reach the matrix products: rows of the (tokens, heads, dim) tensors loaded, converted,
// transposed and padded into tiles, B operands prepared once (packed to VNNI for bf16) and kept per
// (sequence, KV head) in a TileCache, and the products themselves: on ATen's batch-reduce GEMM
// (cpublas::brgemm: oneDNN, else MKL), which picks its instructions at run time, or for bf16 tiles without
// matrix units on the dot-product kernel of bf16_dot.h.
#pragma once

#include <ATen/ATen.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <ATen/native/CPUBlas.h>

#include <algorithm>
#include <cstdint>
#include <initializer_list>
#include <type_traits>
#include <vector>

#include "bf16_dot.h"
#include "mask.h"
#include "vec_math.h"

namespace packattn_kernel::detail {

template <typename T>
struct Rows {  // a (tokens, heads, dim) tensor with any strides
  const T* data;
  int64_t s0, s1, s2;
  const T* at(int64_t t, int64_t h) const { return data + t * s0 + h * s1; }
  int64_t span_bytes(int64_t width) const { return ((width - 1) * s2 + 1) * (int64_t)sizeof(T); }  // of a row
};

template <typename T>
Rows<T> rows_of(const at::Tensor& x) {
  return {x.data_ptr<T>(), x.stride(0), x.stride(1), x.stride(2)};
}

template <typename U = float>
U* buffer(std::vector<at::Tensor>& keep, int64_t n) {  // 64-byte aligned scratch
  keep.push_back(at::empty({std::max<int64_t>(n, 1)}, c10::CppTypeToScalarType<U>::value));
  return keep.back().data_ptr<U>();
}

// Whether outputs are stored past the caches (stream_row): rows of whole 64-byte lines, and more output per
// thread than a core's L2 keeps beside the tiles (1 MiB), which a consumer would read from memory anyway.
// W3 (70 MB of fp32 output, and of each gradient): forward 1.10-1.13x faster, 1.09x with the output read
// right after the call; backward 1.12-1.24x.
inline bool stream_outputs(std::initializer_list<at::Tensor> outputs) {
  constexpr int64_t kStreamBytesPerThread = int64_t(1) << 20;
  int64_t bytes = 0;
  for (const at::Tensor& t : outputs) {
    const bool lines = t.size(-1) * t.element_size() % 64 == 0 && reinterpret_cast<uintptr_t>(t.data_ptr()) % 64 == 0;
    if (!lines) return false;
    bytes += t.nbytes();
  }
  return bytes >= kStreamBytesPerThread * at::get_num_threads();
}

// src[0, n) as fp32. ATen's at::vec::convert has no vectorized bf16/fp16 -> fp32 loop: it converts one
// element at a time, which made fp16 inputs 1.3-1.5x slower on short sequences.
template <typename T>
void widen(const T* src, float* dst, int64_t n) {
  using Narrow = at::vec::Vectorized<T>;  // twice the lanes of Vec
  int64_t i = 0;
  for (; i + Narrow::size() <= n; i += Narrow::size()) {
    const auto [a, b] = at::vec::convert_to_float<T>(Narrow::loadu(src + i));
    a.store(dst + i);
    b.store(dst + i + kVec);
  }
  if (i < n) {
    const int64_t cnt = n - i;
    const auto [a, b] = at::vec::convert_to_float<T>(Narrow::loadu(src + i, cnt));
    a.store(dst + i, std::min(cnt, kVec));
    if (cnt > kVec) b.store(dst + i + kVec, cnt - kVec);
  }
}

template <typename T, typename U>
void load_row(const T* src, int64_t stride, int64_t n, U* dst) {  // converted to U (fp32, or T itself)
  if (stride == 1) {
    if constexpr (std::is_same_v<U, float> && !std::is_same_v<T, float>) {
      widen(src, dst, n);
    } else {
      at::vec::convert(src, dst, n);
    }
  } else {
    for (int64_t i = 0; i < n; ++i) dst[i] = static_cast<U>(src[i * stride]);
  }
}

inline int64_t pad16(int64_t n) { return (n + 15) / 16 * 16; }

// Rows of one head lie a token stride apart (4 KiB in W6's fp32 decode), where the hardware prefetchers fetch
// little ahead, and loading them waited on memory (86% of the conversion's samples in a W6 bf16 profile).
// So the loops fetch the rows they read next: a row-by-row load (of K/V tiles, of query and dO groups) the
// row kFetchRows on, a blocked transpose the next block's rows. W6 forward 1.12-1.37x fp32, 1.07-1.12x bf16,
// 1.05-1.09x fp16; W4 backward 1.06x bf16, 1.02x fp32; the rest within noise (0.96-1.08x).
constexpr int64_t kFetchRows = 8;

inline void fetch_bytes(const void* p, int64_t bytes) {
  for (int64_t b = 0; b < bytes; b += 64) __builtin_prefetch(static_cast<const char*>(p) + b);
}

// Rows [t0, t0 + n) of head h as a [npad, ld] tile: columns from width on and rows from n on are zero.
template <typename T, typename U>
void load_tile(const Rows<T>& x, int64_t t0, int64_t n, int64_t npad, int64_t h, int64_t width, int64_t ld, U* dst) {
  const int64_t row_bytes = x.span_bytes(width);
  for (int64_t r = 0; r < n; ++r) {
    const T* row = x.at(t0 + r, h);
    if (r + kFetchRows < n) fetch_bytes(row + kFetchRows * x.s0, row_bytes);
    load_row(row, x.s2, width, dst + r * ld);
    std::fill(dst + r * ld + width, dst + (r + 1) * ld, U(0));
  }
  std::fill(dst + n * ld, dst + npad * ld, U(0));
}

// src [m, n] (ld_src) -> dst [n, m_pad] (ld_dst), rows m to m_pad of dst zero; m <= m_pad and n at most
// one block (16 fp32, 32 bf16). fp32 on vec_math.h's transpose16.
template <typename E>
void transpose_block(const E* src, int64_t ld_src, E* dst, int64_t ld_dst, int m, int m_pad, int n) {
  if constexpr (std::is_same_v<E, float>) {
    transpose16(src, ld_src, dst, ld_dst, m, m_pad, n);
  } else {
    // ATen's transpose_mxn<BFloat16> makes its masks as (1 << count) - 1 in int, which overflows (undefined
    // behaviour) at a count of 31: 31 columns or rows go as 16 and 15.
    if (n == 31) {
      transpose_block(src, ld_src, dst, ld_dst, m, m_pad, 16);
      return transpose_block(src + 16, ld_src, dst + 16 * ld_dst, ld_dst, m, m_pad, 15);
    }
    if (m == 31) {
      at::vec::transpose_mxn<E>(src, ld_src, dst, ld_dst, 16, n);
      at::vec::transpose_mxn<E>(src + 16 * ld_src, ld_src, dst + 16, ld_dst, 15, n);
    } else if (m > 0) {
      at::vec::transpose_mxn<E>(src, ld_src, dst, ld_dst, m, n);
    }
    for (int j = 0; j < n; ++j) std::fill(dst + j * ld_dst + m, dst + j * ld_dst + m_pad, E(0));
  }
}

// [rows, cols] (ld_src) -> [cols, rows_pad] (ld_dst), columns from rows to rows_pad zero, in blocks of 64-byte
// rows. fetch: src is a tensor's rows of one head (see kFetchRows).
template <typename E>
void transpose(const E* src, int64_t rows, int64_t cols, int64_t ld_src, E* dst, int64_t ld_dst, int64_t rows_pad,
               bool fetch = false) {
  constexpr int64_t kB = std::is_same_v<E, float> ? 16 : 32;
  for (int64_t r = 0; r < rows_pad; r += kB) {
    const int m = (int)std::clamp<int64_t>(rows - r, 0, kB), m_pad = (int)std::min(kB, rows_pad - r);
    for (int64_t c = 0; c < cols; c += kB) {
      for (int64_t i = r + kB; fetch && i < std::min(rows, r + 2 * kB); ++i) __builtin_prefetch(src + i * ld_src + c);
      transpose_block(src + r * ld_src + c, ld_src, dst + c * ld_dst + r, ld_dst, m, m_pad,
                      (int)std::min(kB, cols - c));
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
      transpose(x.at(t0, h), n, width, x.s0, dst, npad, npad, true);
    } else {
      load_tile(x, t0, n, n, h, width, width, scratch);
      transpose(scratch, n, width, width, dst, npad, npad);
    }
  } else {
    load_tile(x, t0, n, n, h, width, width, scratch);
    transpose(scratch, n, width, width, dst, npad, npad);
  }
  std::fill(dst + width * npad, dst + width_pad * npad, U(0));
}

// The G x bq rows of a query-side tensor (q or dout) for KV head h as a [pad16(G x bq), ld] tile: row
// gi * bq + ii is query row i0 + ii of query head h * G + gi; padding rows and columns are zero.
template <typename T, typename U>
void load_group(const Rows<T>& x, const Seq& s, int64_t i0, int64_t bq, int64_t h, int64_t g, int64_t width, int64_t ld,
                U* dst) {
  const int64_t row_bytes = x.span_bytes(width);
  for (int64_t gi = 0; gi < g; ++gi) {
    for (int64_t ii = 0; ii < bq; ++ii) {
      if (ii + kFetchRows < bq) fetch_bytes(x.at(s.q0 + i0 + ii + kFetchRows, h * g + gi), row_bytes);
      U* row = dst + (gi * bq + ii) * ld;
      load_row(x.at(s.q0 + i0 + ii, h * g + gi), x.s2, width, row);
      std::fill(row + width, row + ld, U(0));
    }
  }
  std::fill(dst + g * bq * ld, dst + pad16(g * bq) * ld, U(0));
}

// Scores of a decoded item's few query rows as dot products with K's rows, where transposing K for a product
// took 40% of a decode's time: s[r * lds + j] = q_r . k_{t0 + j} for rows r < m of q (ldq apart) and keys
// j < n of head h, head dim d. Blocks of 4 keys x kVec / 4 rows, summed across lanes by sum_each. fp32 keys
// are read in place, others widened a block at a time into `scratch` (4 x d floats). The rows 16 keys on are
// fetched: 8 on made W6 bf16 1.15x slower, 32 on 1.02x.
template <typename T>
void row_dots(const Rows<T>& k, int64_t t0, int64_t n, int64_t h, int64_t d, const float* q, int64_t ldq, int64_t m,
              float* s, int64_t lds, float* scratch) {
  constexpr int kKeys = 4, kRows = kVec / kKeys;
  const int64_t row_bytes = k.span_bytes(d);
  const bool in_place = std::is_same_v<T, float> && k.s2 == 1;
  for (int64_t j0 = 0; j0 < n; j0 += kKeys) {
    for (int64_t j = j0 + 2 * kFetchRows; j < std::min(n, j0 + 2 * kFetchRows + kKeys); ++j) {
      fetch_bytes(k.at(t0 + j, h), row_bytes);
    }
    const int64_t keys = std::min<int64_t>(kKeys, n - j0);
    const float* kr[kKeys];
    for (int j = 0; j < kKeys; ++j) {  // past n: the last key again
      const int64_t jj = std::min<int64_t>(j, keys - 1);
      if (in_place) {
        kr[j] = reinterpret_cast<const float*>(k.at(t0 + j0 + jj, h));
      } else {
        if (j == jj) load_row(k.at(t0 + j0 + j, h), k.s2, d, scratch + j * d);
        kr[j] = scratch + jj * d;
      }
    }
    for (int64_t r0 = 0; r0 < m; r0 += kRows) {
      const float* qr[kRows];
      for (int i = 0; i < kRows; ++i) qr[i] = q + std::min<int64_t>(r0 + i, m - 1) * ldq;
      Vec acc[kVec];
      for (Vec& a : acc) a = Vec(0.f);
      for (int64_t c = 0; c < d; c += kVec) {
        const int64_t cnt = std::min(kVec, d - c);  // lanes past d load as zeros
        Vec kv[kKeys];
        for (int j = 0; j < kKeys; ++j) kv[j] = cnt == kVec ? Vec::loadu(kr[j] + c) : Vec::loadu(kr[j] + c, cnt);
        for (int i = 0; i < kRows; ++i) {
          const Vec qv = cnt == kVec ? Vec::loadu(qr[i] + c) : Vec::loadu(qr[i] + c, cnt);
          for (int j = 0; j < kKeys; ++j) acc[i * kKeys + j] = at::vec::fmadd(qv, kv[j], acc[i * kKeys + j]);
        }
      }
      float out[kVec];
      sum_each(acc).store(out);
      for (int i = 0; i < kRows && r0 + i < m; ++i) {
        std::copy(out + i * kKeys, out + i * kKeys + keys, s + (r0 + i) * lds + j0);
      }
    }
  }
}

// Zeros in row[0, bk) outside the visible columns [c0, c1).
template <typename E>
void zero_outside(E* row, int64_t c0, int64_t c1, int64_t bk) {
  std::fill(row, row + c0, E(0));
  std::fill(row + std::max(c0, c1), row + bk, E(0));
}

// ---------------------------------------------------------------------------------------------------------
// Products: row-major C[M, N] (+)= A[M, K] @ B[K, N] with fp32 accumulation. fp32 tiles, and bf16 tiles on
// the matrix units (AMX), run on ATen's batch-reduce GEMM; bf16 tiles without them on the dot-product kernel
// of bf16_dot.h. B is prepared once and reused: fp32 as it is; bf16 packed to VNNI in blocks of up to 64
// columns (K even, N a multiple of 16). Tile sizes are multiples of 16, so few distinct shapes get generated
// and cached.

// How bf16 inputs are multiplied. fp16 always goes through fp32 tiles: AVX512_FP16 accumulates in fp16.
enum class Bf16Products : int64_t {
  kFp32 = 0,  // converted to fp32 tiles (never a plain low-precision matmul)
  kDot = 1,   // bf16 tiles on AVX512_BF16's vdpbf16ps
  kAmx = 2,   // bf16 tiles on the matrix units, through ATen's brgemm
};

inline bool available(Bf16Products p) {
  static const bool amx = at::native::cpublas::could_pack(at::kBFloat16);
  static const bool dot = dot_kernel_runs();
  return p == Bf16Products::kFp32 || (p == Bf16Products::kDot && dot) || (p == Bf16Products::kAmx && amx);
}

// What automatic dispatch uses: AMX, else the dot-product kernel where it beats fp32 FMAs, else fp32 tiles.
inline Bf16Products default_bf16_products() {
  if (available(Bf16Products::kAmx)) return Bf16Products::kAmx;
  return available(Bf16Products::kDot) && dot_beats_fma() ? Bf16Products::kDot : Bf16Products::kFp32;
}

// Rows of an A tile of `rows` rows as the products take it: padded to 16 for the matrix units, whose tiles
// are 16 rows; the other kernels run any count (a decode item has only G rows: padding them would be most of
// its work).
template <typename E>
int64_t a_rows(Bf16Products how, int64_t rows) {
  return !std::is_same_v<E, float> && how == Bf16Products::kAmx ? pad16(rows) : rows;
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

struct BOperand {
  const void* data;
  int64_t ld;  // fp32: the row stride; packed bf16: the K the blocks were packed with (each K x block width)
};

// A B operand [k, n] (row stride ld) that prepare_b left at p.
inline BOperand b_operand(const float* p, int64_t, int64_t ld) { return {p, ld}; }
inline BOperand b_operand(const at::BFloat16* p, int64_t k, int64_t) { return {p, k}; }

inline BOperand prepare_b(const float* b, int64_t, int64_t, int64_t ld, float*) { return {b, ld}; }

inline BOperand prepare_b(const at::BFloat16* b, int64_t k, int64_t n, int64_t ld, at::BFloat16* packed) {
  vnni_pack(b, k, n, ld, packed);  // the layout ATen's pack gives oneDNN, so one packing serves both kernels
  return {packed, k};
}

// The first k rows of a prepared B may be used (k even for bf16), and the first n columns (a multiple of
// kPackN, or all of them, for bf16). `how` picks the kernel of bf16 tiles (kDot or kAmx).
inline void mm(Bf16Products, int64_t m, int64_t n, int64_t k, const float* a, int64_t lda, BOperand b, float* c,
               int64_t ldc, bool add) {
  at::native::cpublas::brgemm(m, n, k, lda, b.ld, ldc, add, a, static_cast<const float*>(b.data), c, false);
}

inline void mm(Bf16Products how, int64_t m, int64_t n, int64_t k, const at::BFloat16* a, int64_t lda, BOperand b,
               float* c, int64_t ldc, bool add) {
  const auto* packed = static_cast<const at::BFloat16*>(b.data);
  if (how == Bf16Products::kDot) return dot_mm(m, n, k, a, lda, packed, b.ld, c, ldc, add);
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

// ---------------------------------------------------------------------------------------------------------
// Prepared tiles of one (sequence, KV head)

// Tiles on a fixed grid of blocks, kept while a thread's consecutive items are on the same sequence and
// head: each block is loaded, transposed, converted and packed once per head rather than once per item that
// reads it. O(longest sequence x width) per thread.
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
  template <typename F>
  const E* once(const F& prepare) {  // a tile used once: prepared into the first slot, nothing kept
    b = -1;
    prepare(data);
    return data;
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

}  // namespace packattn_kernel::detail
