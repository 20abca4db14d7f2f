// bf16 products on the AVX512_BF16 dot-product instruction (vdpbf16ps: 16 fp32 lanes, each += the dot
// product of two bf16 pairs), for CPUs that have it but no matrix units (AMD Zen 4 and later): twice the
// multiply-adds of an fp32 FMA per instruction, fp32 accumulation. ATen's brgemm runs bf16 below fp32 speed
// there, and its VNNI packing is refused without AMX.
//
// B operands are packed to VNNI, in blocks of up to kPackN columns: block n0 holds [k / 2][nc][2], the two
// values of a pair of rows next to each other (what ATen packs for AMX too). vdpbf16ps treats denormal bf16
// inputs as zero and flushes denormal results: values below 1e-38, which the softmax never gets near.
#pragma once

#include <ATen/ATen.h>

#include <algorithm>
#include <cstdint>
#include <cstring>

#if defined(CPU_CAPABILITY_AVX512)
#include <cpuid.h>
#include <immintrin.h>
#endif

namespace packattn_kernel::detail {

constexpr int64_t kPackN = 64;

// b [k, n] (row stride ld, k even) -> packed, VNNI blocks of kPackN columns.
inline void vnni_pack(const at::BFloat16* b, int64_t k, int64_t n, int64_t ld, at::BFloat16* packed) {
  const auto* src = reinterpret_cast<const uint16_t*>(b);
  auto* dst = reinterpret_cast<uint32_t*>(packed);  // one (row 2i, row 2i + 1) pair per 32 bits
  for (int64_t n0 = 0; n0 < n; n0 += kPackN) {
    const int64_t nc = std::min(kPackN, n - n0);
    for (int64_t i = 0; i < k / 2; ++i) {
      const uint16_t *even = src + 2 * i * ld + n0, *odd = even + ld;
      uint32_t* out = dst + (n0 * k) / 2 + i * nc;
      for (int64_t j = 0; j < nc; ++j) out[j] = uint32_t(even[j]) | (uint32_t(odd[j]) << 16);
    }
  }
}

#if defined(CPU_CAPABILITY_AVX512) && defined(PACKATTN_EMULATE_AVX512_BF16)

// A build of its own (build.py, PACKATTN_KERNEL_EMULATE=avx512_bf16) for CPUs without the instruction: this
// path's tests run here with vdpbf16ps done in AVX-512F instructions, and it is the default, as on AMD.
#define PACKATTN_DOT_TARGET "avx512f"
inline bool dot_kernel_runs() { return true; }
inline bool dot_beats_fma() { return true; }

// Denormals as zero (sign kept), as vdpbf16ps takes its inputs and flushes its results.
inline __m512 flush_denormals(__m512 x) {
  const __m512i bits = _mm512_castps_si512(x);
  const __mmask16 normal = _mm512_test_epi32_mask(bits, _mm512_set1_epi32(0x7f800000));
  const __m512i sign = _mm512_and_si512(bits, _mm512_set1_epi32(int(0x80000000u)));
  return _mm512_castsi512_ps(_mm512_mask_mov_epi32(sign, normal, bits));
}

// Per fp32 lane: acc += a.odd * b.odd, then acc += a.even * b.even (the bf16 halves), each rounded to nearest:
// the order the instruction is specified in. A product of two bf16 values is exact in fp32, so one FMA is
// the rounded addition.
inline __m512 dot_pairs(__m512 acc, __m512i a, __m512i b) {
  const __m512i high = _mm512_set1_epi32(int(0xffff0000u));
  const auto odd = [&](__m512i x) { return flush_denormals(_mm512_castsi512_ps(_mm512_and_si512(x, high))); };
  const auto even = [&](__m512i x) { return flush_denormals(_mm512_castsi512_ps(_mm512_slli_epi32(x, 16))); };
  acc = flush_denormals(_mm512_fmadd_ps(odd(a), odd(b), acc));
  return flush_denormals(_mm512_fmadd_ps(even(a), even(b), acc));
}

#elif defined(CPU_CAPABILITY_AVX512)

#define PACKATTN_DOT_TARGET "avx512f,avx512bf16"

// Whether this CPU has the instruction (and AVX-512 state enabled: the capability ATen detected).
inline bool dot_kernel_runs() { return __builtin_cpu_supports("avx512bf16"); }

// Whether vdpbf16ps gives more multiply-adds per second than fp32 FMAs: on AMD, whose Zen 4 and later issue
// it as fast as an FMA (bf16 torch.mm runs at twice the fp32 rate there), not on Intel: a Sapphire Rapids
// issues it at a quarter of the FMA rate (measured: 1.3 G/s against 5.4 G/s on zmm, one core), half the
// fp32 multiply-adds, and its other CPUs with AVX512_BF16 (except Cooper Lake) have AMX.
inline bool dot_beats_fma() {
  unsigned eax = 0, ebx = 0, ecx = 0, edx = 0;
  if (!__get_cpuid(0, &eax, &ebx, &ecx, &edx)) return false;
  return ebx == 0x68747541 && edx == 0x69746e65 && ecx == 0x444d4163;  // "AuthenticAMD"
}

__attribute__((target(PACKATTN_DOT_TARGET))) inline __m512 dot_pairs(__m512 acc, __m512i a, __m512i b) {
  return _mm512_dpbf16_ps(acc, (__m512bh)a, (__m512bh)b);
}

#endif

#if defined(CPU_CAPABILITY_AVX512)

// c[R, 16 C] (+)= a[R, k] b for one packed block of nc = 16 C columns: R x C accumulators in registers, each
// pair of k a load of every B vector and a broadcast of every row's pair.
template <int R, int C>
__attribute__((target(PACKATTN_DOT_TARGET))) void dot_block(int64_t k, const at::BFloat16* a, int64_t lda,
                                                            const at::BFloat16* b, float* c, int64_t ldc, bool add) {
  __m512 acc[R][C];
  for (int r = 0; r < R; ++r) {
    for (int j = 0; j < C; ++j) acc[r][j] = add ? _mm512_loadu_ps(c + r * ldc + 16 * j) : _mm512_setzero_ps();
  }
  for (int64_t p = 0; p < k; p += 2) {
    __m512i bv[C];
    for (int j = 0; j < C; ++j) bv[j] = _mm512_loadu_si512(b + p * 16 * C + 32 * j);
    for (int r = 0; r < R; ++r) {
      int32_t pair;
      std::memcpy(&pair, a + r * lda + p, sizeof(pair));
      const __m512i av = _mm512_set1_epi32(pair);
      for (int j = 0; j < C; ++j) acc[r][j] = dot_pairs(acc[r][j], av, bv[j]);
    }
  }
  for (int r = 0; r < R; ++r) {
    for (int j = 0; j < C; ++j) _mm512_storeu_ps(c + r * ldc + 16 * j, acc[r][j]);
  }
}

constexpr int kDotRows = 6;  // 6 x 4 accumulators, 4 B vectors and a broadcast: 29 of the 32 registers

template <int C>
void dot_columns(int64_t m, int64_t k, const at::BFloat16* a, int64_t lda, const at::BFloat16* b, float* c, int64_t ldc,
                 bool add) {
  int64_t i = 0;
  for (; i + kDotRows <= m; i += kDotRows) dot_block<kDotRows, C>(k, a + i * lda, lda, b, c + i * ldc, ldc, add);
  const auto rest = [&](auto rows) {
    dot_block<decltype(rows)::value, C>(k, a + i * lda, lda, b, c + i * ldc, ldc, add);
  };
  switch (m - i) {
    case 1:
      return rest(std::integral_constant<int, 1>{});
    case 2:
      return rest(std::integral_constant<int, 2>{});
    case 3:
      return rest(std::integral_constant<int, 3>{});
    case 4:
      return rest(std::integral_constant<int, 4>{});
    case 5:
      return rest(std::integral_constant<int, 5>{});
    default:
      return;
  }
}

// c[m, n] (+)= a[m, k] @ B, B packed by vnni_pack with k_packed rows (k <= k_packed, both even; n a multiple
// of 16). One block of columns at a time, so that its B stays in L1 while every row strip passes over it.
inline void dot_mm(int64_t m, int64_t n, int64_t k, const at::BFloat16* a, int64_t lda, const at::BFloat16* packed,
                   int64_t k_packed, float* c, int64_t ldc, bool add) {
  for (int64_t n0 = 0; n0 < n; n0 += kPackN) {
    const at::BFloat16* b = packed + n0 * k_packed;
    float* cb = c + n0;
    switch (std::min(kPackN, n - n0) / 16) {
      case 1:
        dot_columns<1>(m, k, a, lda, b, cb, ldc, add);
        break;
      case 2:
        dot_columns<2>(m, k, a, lda, b, cb, ldc, add);
        break;
      case 3:
        dot_columns<3>(m, k, a, lda, b, cb, ldc, add);
        break;
      default:
        dot_columns<4>(m, k, a, lda, b, cb, ldc, add);
        break;
    }
  }
}

#else

// Only the AVX512 build has the kernel.
inline bool dot_kernel_runs() { return false; }
inline bool dot_beats_fma() { return false; }

inline void dot_mm(int64_t, int64_t, int64_t, const at::BFloat16*, int64_t, const at::BFloat16*, int64_t, float*,
                   int64_t, bool) {
  TORCH_CHECK(false, "packattn cpu_kernel: the bf16 dot-product kernel is not in this build");
}

#endif

}  // namespace packattn_kernel::detail
