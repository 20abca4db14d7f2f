// Vector math on fp32 lanes: everything that depends on the CPU capability is behind two switches, one for
// the softmax's exp, bf16 stores, fp32 transposes and lane sums (raw AVX-512, and AVX2 for the transposes
// and the sums; ATen's portable versions for every other capability), one for the streamed stores (the
// widest non-temporal store the build's ISA has; a plain copy off x86). The rest is written on ATen's
// Vectorized<float> and compiles for any capability.
#pragma once

#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <c10/util/BFloat16.h>

#include <algorithm>
#include <cstdint>
#include <limits>

#include "mask.h"

#if defined(__x86_64__)
#include <immintrin.h>
#endif
#include <cstring>

namespace packattn_kernel::detail {

using Vec = at::vec::Vectorized<float>;
constexpr float kNegInf = -std::numeric_limits<float>::infinity();
constexpr int64_t kVec = Vec::size();

// exp_softmax(x): exp(x), for the softmax's x = score - max <= 0 (and slightly above, from rounding). NaN
// stays NaN; -inf gives 0.
// store_pair(dst, a, b, cnt): stores cnt <= 2 x kVec values (a then b) as bf16, rounded to nearest even as
// ATen rounds.
#if defined(CPU_CAPABILITY_AVX512)

// 2^n * 2^f, n = round(x log2 e), 2^f on [-1/2, 1/2] by a degree-5 polynomial fitted for relative error, and
// scalef, which underflows to 0 cleanly: fewer instructions than ATen's exp_u20, and more accurate.
inline Vec exp_softmax(Vec x) {
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
}

// bf16 tiles run only on CPUs with matrix units, which all have AVX512-BF16: its rounding conversion in one
// instruction.
__attribute__((target("avx512bf16"))) inline void store_pair(at::BFloat16* dst, Vec a, Vec b, int64_t cnt) {
  const __m512i pair = reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(b, a));
  _mm512_mask_storeu_epi16(dst, cnt >= 32 ? ~__mmask32(0) : (__mmask32(1) << cnt) - 1, pair);
}

// dst[j * ld_dst + i] = src[i * ld_src + j] for i < m, and 0 for m <= i < m_pad, j < n (m <= m_pad <= 16,
// n <= 16): the rows in registers through four rounds of shuffles. ATen's transpose_mxn<float> zeroes a 1 KiB
// array on the stack (rep stos) at every call and keeps the rows there: with this instead, W3's forward and
// backward run 1.07-1.11x faster.
inline void transpose16(const float* src, int64_t ld_src, float* dst, int64_t ld_dst, int m, int m_pad, int n) {
  const __mmask16 cols = n >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << n) - 1);
  __m512 r[16], t[16];
  for (int i = 0; i < 16; ++i) r[i] = i < m ? _mm512_maskz_loadu_ps(cols, src + i * ld_src) : _mm512_setzero_ps();
  for (int i = 0; i < 16; i += 2) {  // per 128-bit lane: pairs of rows interleaved
    t[i] = _mm512_unpacklo_ps(r[i], r[i + 1]);
    t[i + 1] = _mm512_unpackhi_ps(r[i], r[i + 1]);
  }
  const auto lo = [](__m512 a, __m512 b) {
    return _mm512_castpd_ps(_mm512_unpacklo_pd(_mm512_castps_pd(a), _mm512_castps_pd(b)));
  };
  const auto hi = [](__m512 a, __m512 b) {
    return _mm512_castpd_ps(_mm512_unpackhi_pd(_mm512_castps_pd(a), _mm512_castps_pd(b)));
  };
  for (int i = 0; i < 16; i += 4) {  // r[i + k], lane L: rows i..i+3 of column 4L + k
    r[i] = lo(t[i], t[i + 2]);
    r[i + 1] = hi(t[i], t[i + 2]);
    r[i + 2] = lo(t[i + 1], t[i + 3]);
    r[i + 3] = hi(t[i + 1], t[i + 3]);
  }
  const __mmask16 rows = m_pad >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << m_pad) - 1);
  for (int k = 0; k < 4; ++k) {  // column 4L + k: lane L of r[k], r[4 + k], r[8 + k], r[12 + k]
    const __m512 a = _mm512_shuffle_f32x4(r[k], r[4 + k], 0x44), b = _mm512_shuffle_f32x4(r[8 + k], r[12 + k], 0x44);
    const __m512 c = _mm512_shuffle_f32x4(r[k], r[4 + k], 0xEE), d = _mm512_shuffle_f32x4(r[8 + k], r[12 + k], 0xEE);
    const __m512 col[4] = {_mm512_shuffle_f32x4(a, b, 0x88), _mm512_shuffle_f32x4(a, b, 0xDD),
                           _mm512_shuffle_f32x4(c, d, 0x88), _mm512_shuffle_f32x4(c, d, 0xDD)};
    for (int l = 0; l < 4; ++l) {
      if (4 * l + k < n) _mm512_mask_storeu_ps(dst + (4 * l + k) * ld_dst, rows, col[l]);
    }
  }
}

// Lane i of the result: the sum of the lanes of v[i] (i < 16), in rounds of shuffles that halve the vectors.
inline Vec sum_each(const Vec* v) {
  __m512 w[8], x[4];
  for (int i = 0; i < 8; ++i) {  // per 128-bit block: v[2i]'s pair sums in lanes 0 and 2, v[2i + 1]'s in 1 and 3
    const __m512 a = v[2 * i], b = v[2 * i + 1];
    w[i] = _mm512_add_ps(_mm512_unpacklo_ps(a, b), _mm512_unpackhi_ps(a, b));
  }
  for (int i = 0; i < 4; ++i) {  // per 128-bit block: the block's sum of v[4i + j] in lane j
    x[i] =
        _mm512_add_ps(_mm512_shuffle_ps(w[2 * i], w[2 * i + 1], 0x44), _mm512_shuffle_ps(w[2 * i], w[2 * i + 1], 0xEE));
  }
  const auto halves = [](__m512 a, __m512 b) {  // blocks: a's 0 + 2, a's 1 + 3, b's 0 + 2, b's 1 + 3
    return _mm512_add_ps(_mm512_shuffle_f32x4(a, b, 0x44), _mm512_shuffle_f32x4(a, b, 0xEE));
  };
  const __m512 y0 = halves(x[0], x[1]), y1 = halves(x[2], x[3]);
  return _mm512_add_ps(_mm512_shuffle_f32x4(y0, y1, 0x88), _mm512_shuffle_f32x4(y0, y1, 0xDD));
}

#else

inline Vec exp_softmax(Vec x) { return x.exp_u20(); }

#if defined(CPU_CAPABILITY_AVX2)
// transpose16's contract for m <= m_pad <= 8, n <= 8 on 256-bit vectors.
inline void transpose8(const float* src, int64_t ld_src, float* dst, int64_t ld_dst, int m, int m_pad, int n) {
  const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  const __m256i cols = _mm256_cmpgt_epi32(_mm256_set1_epi32(n), lane);
  const __m256i rows = _mm256_cmpgt_epi32(_mm256_set1_epi32(m_pad), lane);
  __m256 r[8], t[8];
  for (int i = 0; i < 8; ++i) r[i] = i < m ? _mm256_maskload_ps(src + i * ld_src, cols) : _mm256_setzero_ps();
  for (int i = 0; i < 8; i += 2) {  // per 128-bit lane: pairs of rows interleaved
    t[i] = _mm256_unpacklo_ps(r[i], r[i + 1]);
    t[i + 1] = _mm256_unpackhi_ps(r[i], r[i + 1]);
  }
  for (int i = 0; i < 8; i += 4) {  // r[i + k], lane L: rows i..i+3 of column 4L + k
    r[i] = _mm256_shuffle_ps(t[i], t[i + 2], 0x44);
    r[i + 1] = _mm256_shuffle_ps(t[i], t[i + 2], 0xEE);
    r[i + 2] = _mm256_shuffle_ps(t[i + 1], t[i + 3], 0x44);
    r[i + 3] = _mm256_shuffle_ps(t[i + 1], t[i + 3], 0xEE);
  }
  for (int k = 0; k < 4; ++k) {  // column k: the low lanes of r[k] and r[4 + k]; column 4 + k: the high lanes
    if (k < n) _mm256_maskstore_ps(dst + k * ld_dst, rows, _mm256_permute2f128_ps(r[k], r[4 + k], 0x20));
    if (4 + k < n) _mm256_maskstore_ps(dst + (4 + k) * ld_dst, rows, _mm256_permute2f128_ps(r[k], r[4 + k], 0x31));
  }
}

// sum_each's contract for 8 lanes.
inline Vec sum_each(const Vec* v) {
  __m256 w[4], x[2];
  for (int i = 0; i < 4; ++i) {
    const __m256 a = v[2 * i], b = v[2 * i + 1];
    w[i] = _mm256_add_ps(_mm256_unpacklo_ps(a, b), _mm256_unpackhi_ps(a, b));
  }
  for (int i = 0; i < 2; ++i) {
    x[i] =
        _mm256_add_ps(_mm256_shuffle_ps(w[2 * i], w[2 * i + 1], 0x44), _mm256_shuffle_ps(w[2 * i], w[2 * i + 1], 0xEE));
  }
  return _mm256_add_ps(_mm256_permute2f128_ps(x[0], x[1], 0x20), _mm256_permute2f128_ps(x[0], x[1], 0x31));
}

// transpose16 as four blocks of 8 x 8. ATen's transpose_mxn<float> with sizes known only at run time is a
// scalar loop in this build.
inline void transpose16(const float* src, int64_t ld_src, float* dst, int64_t ld_dst, int m, int m_pad, int n) {
  for (int i = 0; i < m_pad; i += 8) {
    for (int j = 0; j < n; j += 8) {
      transpose8(src + i * ld_src + j, ld_src, dst + j * ld_dst + i, ld_dst, std::clamp(m - i, 0, 8),
                 std::min(m_pad - i, 8), std::min(n - j, 8));
    }
  }
}

#else

inline Vec sum_each(const Vec* v) {
  float out[kVec];
  for (int i = 0; i < kVec; ++i) out[i] = at::vec::vec_reduce_all<float>([](Vec a, Vec b) { return a + b; }, v[i]);
  return Vec::loadu(out);
}

// transpose16 on ATen's portable transpose, then the zero rows.
inline void transpose16(const float* src, int64_t ld_src, float* dst, int64_t ld_dst, int m, int m_pad, int n) {
  if (m > 0) at::vec::transpose_mxn<float>(src, ld_src, dst, ld_dst, m, n);
  for (int j = 0; j < n; ++j) std::fill(dst + j * ld_dst + m, dst + j * ld_dst + m_pad, 0.f);
}

#endif

inline void store_pair(at::BFloat16* dst, Vec a, Vec b, int64_t cnt) {
  at::vec::convert_from_float<at::BFloat16>(a, b).store(dst, cnt);
}

#endif

// The same as fp32.
inline void store_pair(float* dst, Vec a, Vec b, int64_t cnt) {
  a.store(dst, std::min(cnt, kVec));
  if (cnt > kVec) b.store(dst + kVec, cnt - kVec);
}

// Non-temporal stores, for output rows that nothing in the call reads again: the line goes to memory without
// the read for ownership of an ordinary store and without evicting the working tiles from the caches.
// stream_line writes 64 bytes to a 64-byte aligned dst; stream_fence orders the writer's streamed lines
// before its later stores (each thread calls it before the threads join).
inline void stream_line(void* dst, const void* src) {
#if defined(__AVX512F__)
  _mm512_stream_si512(static_cast<__m512i*>(dst), _mm512_loadu_si512(src));
#elif defined(__AVX__)
  for (int i = 0; i < 2; ++i) {
    _mm256_stream_si256(static_cast<__m256i*>(dst) + i, _mm256_loadu_si256(static_cast<const __m256i*>(src) + i));
  }
#elif defined(__x86_64__)
  for (int i = 0; i < 4; ++i) {
    _mm_stream_si128(static_cast<__m128i*>(dst) + i, _mm_loadu_si128(static_cast<const __m128i*>(src) + i));
  }
#else
  std::memcpy(dst, src, 64);
#endif
}

inline void stream_fence() {
#if defined(__x86_64__)
  _mm_sfence();
#endif
}

// dst[0, n) = x[0, n) in dst's type, streamed: n x sizeof(T) a multiple of 64, dst 64-byte aligned.
template <typename T>
void stream_row(T* dst, const float* x, int64_t n) {
  constexpr int64_t kLine = 64 / sizeof(T);
  for (int64_t c = 0; c < n; c += kLine) {
    if constexpr (std::is_same_v<T, float>) {
      stream_line(dst + c, x + c);
    } else {
      alignas(64) T line[kLine];
      at::vec::convert(x + c, line, kLine);
      stream_line(dst + c, line);
    }
  }
}

// dst[0, n) = x[0, n) in dst's type, streamed (as stream_row) or with ordinary stores.
template <typename T>
void store_row(T* dst, const float* x, int64_t n, bool stream) {
  if (stream) return stream_row(dst, x, n);
  at::vec::convert(x, dst, n);
}

// Sum of x[i] y[i] over [0, n).
inline float dot(const float* x, const float* y, int64_t n) {
  Vec acc(0.f);
  int64_t i = 0;
  for (; i + kVec <= n; i += kVec) acc = at::vec::fmadd(Vec::loadu(x + i), Vec::loadu(y + i), acc);
  if (i < n) acc = at::vec::fmadd(Vec::loadu(x + i, n - i), Vec::loadu(y + i, n - i), acc);  // zeros past n
  return at::vec::vec_reduce_all<float>([](Vec a, Vec b) { return a + b; }, acc);
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
      : scale(mask.scale),
        cap(mask.softcap),
        inner(mask.scale / std::max(mask.softcap, 1e-30f)),
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

}  // namespace packattn_kernel::detail
