// packattn's CPU attention kernel: the two entry points and what they share. Exact attention over a packed
// variable-length batch, forward and backward, in one call each.
//
// How: the batch is cut into work items of one sequence, one KV head (all G query heads that read it, stacked
// as G x block rows, so every K/V tile is loaded once for the group) and one block of query rows (forward,
// dQ) or keys (dK/dV), or the whole sequence (the one-pass backward). Items are split between threads by
// their count of visible (query, key) pairs, so many short sequences and one long causal sequence both keep
// every thread busy; a thread's items come in (sequence, head) order, and the tiles it prepares (K^T, V,
// converted and packed) are kept for the next items of the same head (TileCache). A decoded sequence (G x
// query rows <= 16) is cut by chunks of keys instead, each item taking all KV heads (the forward only); on fp32
// tiles its scores are dot products with K's rows (row_dots), forward and backward. Within an item,
// tiles of keys that the mask hides entirely are never visited; scores live in one (rows x keys) tile per thread.
// Products run on ATen's batch-reduce GEMM, fp32 tiles or bf16 tiles packed to VNNI on CPUs with matrix units
// (AMX); without AMX, bf16 tiles run on an own kernel of AVX512_BF16 dot products where that beats fp32, and
// bf16 is converted to fp32 tiles elsewhere, like fp16 everywhere. Accumulation is fp32.
// Every output element is written by exactly one item, in an order fixed by the item alone: results are
// the same bits at any thread count.
//
// The headers, by concern (all helpers in namespace detail):
//   mask.h      sequences, heads and the mask: which keys each query row sees
//   outputs.h   memory for the outputs: freed blocks of 32 MiB or more kept for the next call
//   plan.h      work items, their costs and their split between threads
//   tiles.h     tiles of the inputs, prepared B operands and their cache, the matrix products
//   bf16_dot.h  the VNNI packing of bf16 B operands and the AVX512_BF16 product kernel
//   vec_math.h  fp32 vector math and streamed stores; the code that depends on the CPU capability or ISA
//   checks.h    the TORCH_CHECKs of the entry points
#pragma once

#include <ATen/ATen.h>
#include <ATen/Dispatch.h>

#include <cstdint>
#include <string>
#include <tuple>
#include <vector>

#include "checks.h"
#include "mask.h"
#include "outputs.h"
#include "plan.h"
#include "tiles.h"
#include "vec_math.h"

// Runs the lambda with scalar_t the input dtype: float, BFloat16 or Half.
#define PACKATTN_DISPATCH_CASES(...)           \
  AT_DISPATCH_CASE(at::kFloat, __VA_ARGS__)    \
  AT_DISPATCH_CASE(at::kBFloat16, __VA_ARGS__) \
  AT_DISPATCH_CASE(at::kHalf, __VA_ARGS__)
#define PACKATTN_DISPATCH(TYPE, NAME, ...) AT_DISPATCH_SWITCH(TYPE, NAME, PACKATTN_DISPATCH_CASES(__VA_ARGS__))

namespace packattn_kernel {
namespace detail {

// Keys per score tile, in the forward and the backward alike: the backward recomputes every score with the
// same product over the same keys as the forward, so exp(score - LSE) is exactly what the forward normalised
// (a one-hot row's probability is exactly 1 however large its scores). Another partition may round a score
// differently, and at |score| ~ 1e6 one ulp is a factor of about 1.06 in the probability.
constexpr int64_t kKeyTile = 256;

// Query rows x query heads per KV head up to which a sequence is decoded: its forward items take all KV heads
// over chunks of keys. On fp32 tiles its scores are row_dots rather than a product with a transposed K tile,
// in the forward and the backward alike, for the reason above.
constexpr int64_t kWholeHeadsRows = 16;

template <typename E>
bool scores_by_row_dots(const Shape& sh, const Seq& s) {
  return std::is_same_v<E, float> && sh.g * s.lq <= kWholeHeadsRows;
}

constexpr const char* kBf16ProductNames[] = {"fp32", "avx512_bf16", "amx"};  // by Bf16Products

// The products of bf16 inputs that a call asks for by name ("" for the default), checked to run here.
inline Bf16Products chosen_bf16_products(const char* where, const std::string& name) {
  if (name.empty()) return default_bf16_products();
  for (int64_t i = 0; i < 3; ++i) {
    if (name != kBf16ProductNames[i]) continue;
    TORCH_CHECK(available(Bf16Products(i)), where, ": bf16 products '", name, "' do not run on this CPU and build");
    return Bf16Products(i);
  }
  TORCH_CHECK(false, where, ": expected bf16 products fp32, avx512_bf16 or amx, got '", name, "'");
}

}  // namespace detail

// Out (Tq, Hq, Dv) in q's dtype and, with with_lse, the LSE (Hq, Tq) in float32 (else an undefined tensor).
// bf16_products: how bf16 inputs are multiplied ("" the default; see bf16_products()).
std::tuple<at::Tensor, at::Tensor> attention_forward(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                                     const at::Tensor& cu_q, const at::Tensor& cu_k, double scale,
                                                     double softcap, int64_t left, int64_t right, bool with_lse,
                                                     const std::string& bf16_products);

// rowsum(dout * out) in float32, (Hq, Tq): the backward's delta before the LSE's gradient is subtracted.
at::Tensor attention_delta(const at::Tensor& out, const at::Tensor& dout);

// dQ, dK, dV in the inputs' dtype, from dout, the forward's LSE and delta = rowsum(dout * out) - dLSE, both
// (Hq, Tq).
std::tuple<at::Tensor, at::Tensor, at::Tensor> attention_backward(const at::Tensor& q, const at::Tensor& k,
                                                                  const at::Tensor& v, const at::Tensor& dout,
                                                                  const at::Tensor& lse, const at::Tensor& delta,
                                                                  const at::Tensor& cu_q, const at::Tensor& cu_k,
                                                                  double scale, double softcap, int64_t left,
                                                                  int64_t right, const std::string& bf16_products);

// The ways of multiplying bf16 inputs that run on this CPU and build, the default first.
inline std::vector<std::string> bf16_products() {
  using detail::Bf16Products;
  const Bf16Products first = detail::default_bf16_products();
  std::vector<std::string> names{detail::kBf16ProductNames[int64_t(first)]};
  for (const Bf16Products p : {Bf16Products::kAmx, Bf16Products::kDot, Bf16Products::kFp32}) {
    if (p != first && detail::available(p)) names.push_back(detail::kBf16ProductNames[int64_t(p)]);
  }
  return names;
}

// Freed outputs kept for reuse (outputs.h): their bytes, and freeing them all (returns the bytes freed).
inline int64_t kept_output_bytes() { return int64_t(detail::OutputMemory::get().kept_bytes()); }
inline int64_t release_output_cache() { return int64_t(detail::OutputMemory::get().release()); }

}  // namespace packattn_kernel
