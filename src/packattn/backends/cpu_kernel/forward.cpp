// Forward: one item is one block of query rows (x the G query heads of a KV head) against the key tiles
// its rows see, with an online softmax in fp32 (no score matrix beyond one tile).
#include "kernel.h"

namespace packattn_kernel {
namespace {

using namespace detail;

constexpr int64_t kFwdRows = 256;  // target G x block_q rows of one forward item
// A decoded sequence's items (kernel.h's kWholeHeadsRows) take all KV heads at once (a few rows per head
// against long keys: reading K/V is the work), split by key chunks so that a long sequence's keys are shared
// between threads.
constexpr int64_t kChunkKeys = 4 * kKeyTile;
constexpr int64_t kHeadRows = (kWholeHeadsRows + 15) / 16 * 16;  // between KV heads in an all-heads item

template <typename E>  // tile element: float, or BFloat16 (on AMX or the dot-product kernel)
struct FwdWork {
  std::vector<at::Tensor> keep;
  float *s, *acc, *m, *l, *top;
  E *q, *p, *tmp, *scratch;
  TileCache<E> kt, v;  // K^T and V tiles of the current (sequence, KV head)
};

template <typename T>
struct FwdArgs {
  const std::vector<Seq>& seqs;
  Mask mask;
  Shape sh;
  Rows<T> q, k, v;
  T* out;
  float* lse;  // nullptr: no LSE
  int64_t tq, hq, block_q;
  Bf16Products how;  // of bf16 inputs
  bool stream;       // the output rows are stored with non-temporal stores (see stream_outputs)
};

// Online softmax of one row of raw scores over its visible columns [c0, c1): writes exp(score - m_new) there
// and zeros in the rest of p[0, width) (p may be the row itself), updates the running max m and sum l, and
// returns the factor by which the row's accumulator must be rescaled. raw_max: the row's largest raw score
// over [c0, c1). The caller finds the maxima of all the tile's rows in a pass of its own, and this function is
// inlined into its loop, so that the rows' reductions overlap rather than wait on each other (W3 forward
// 1.05-1.08x).
template <typename E>
__attribute__((always_inline)) inline float softmax_row(const float* row, E* p, int64_t c0, int64_t c1, int64_t width,
                                                        float raw_max, const Scores& score, float& m, float& l) {
  if (c1 <= c0) {
    std::fill(p, p + width, E(0));
    return 1.f;
  }
  const float top = score(raw_max);
  const float m_new = std::isnan(top) ? top : std::max(m, top);  // a NaN score makes the row NaN from here on
  if (m_new == kNegInf) {  // every visible score so far -inf (infinite inputs): nothing to add yet
    std::fill(p, p + width, E(0));
    return 1.f;
  }
  const Vec shift(m_new), zero(0.f);
  Vec sum(0.f);
  int64_t c = c0;
  for (; c + 2 * kVec <= c1; c += 2 * kVec) {
    const Vec a = exp_softmax(score(Vec::loadu(row + c)) - shift);
    const Vec b = exp_softmax(score(Vec::loadu(row + c + kVec)) - shift);
    sum = sum + a + b;
    store_pair(p + c, a, b, 2 * kVec);
  }
  if (c < c1) {  // the tail: lanes past c1 are zero
    const int64_t cnt = c1 - c, cnt_a = std::min(cnt, kVec), cnt_b = cnt - cnt_a;
    const Vec a = Vec::set(zero, exp_softmax(score(Vec::loadu(row + c, cnt_a)) - shift), cnt_a);
    const Vec b =
        cnt_b > 0 ? Vec::set(zero, exp_softmax(score(Vec::loadu(row + c + kVec, cnt_b)) - shift), cnt_b) : zero;
    sum = sum + a + b;
    store_pair(p + c, a, b, cnt);
  }
  zero_outside(p, c0, c1, width);
  // While the running max is -inf the accumulator holds zeros (or NaN, 0 x inf from V), which a factor of
  // exp(-inf) = 0 leaves as they are: 1 spares the caller that pass over the row.
  const float alpha = m == kNegInf ? 1.f : std::exp(m - m_new);
  l = l * alpha + at::vec::vec_reduce_all<float>([](Vec x, Vec y) { return x + y; }, sum);
  m = m_new;
  return alpha;
}

// The running softmax of an item's rows against keys [c0, c1) (whole key tiles): for each KV head h of
// [h0, h1), its G x (i1 - i0) query rows' max, sum and unnormalised output in w.m, w.l, w.acc at head offset
// h - h0. Key tiles outside, heads inside: an item of all KV heads reads each K/V row's heads in turn while
// its pages are fresh, instead of one head's 1 / Hkv of every page per pass.
template <typename E, typename T>
void attend(int64_t b, int64_t i0, int64_t i1, int64_t h0, int64_t h1, int64_t c0, int64_t c1, FwdWork<E>& w,
            const FwdArgs<T>& a) {
  const Seq& s = a.seqs[b];
  const Mask& mask = a.mask;
  const Shape& sh = a.sh;
  const int64_t bq = i1 - i0, rows = sh.g * bq, mp = a_rows<E>(a.how, rows), d = sh.d, dv = sh.dv;
  const int64_t dp = tile_width<E>(d), ldo = tile_width<E>(dv), heads = h1 - h0;
  const bool cached = heads == 1;  // one head's tiles serve its next items; a tile of all heads is used once
  const bool dots = scores_by_row_dots<E>(sh, s);
  // fp32 queries with one query head per KV head: Q K^T reads the item's rows in place (a row stride
  // apart), no copy
  bool q_in_place = false;
  if constexpr (std::is_same_v<E, float> && std::is_same_v<T, float>) {
    q_in_place = sh.g == 1 && a.q.s2 == 1 && a.q.s0 >= d;
  }
  if (!q_in_place) {
    for (int64_t h = 0; h < heads; ++h) load_group(a.q, s, i0, bq, h0 + h, sh.g, d, dp, w.q + h * kHeadRows * dp);
  }
  std::fill(w.m, w.m + (heads - 1) * kHeadRows + mp, kNegInf);
  std::fill(w.l, w.l + (heads - 1) * kHeadRows + mp, 0.f);
  const int64_t lo = std::max(c0, mask.lo(s, i0)), hi = std::min(c1, mask.hi(s, i1 - 1));
  // The first tile's P V overwrites the accumulator (its factor is 1): zeros only where no tile comes.
  if (lo >= hi) std::fill(w.acc, w.acc + ((heads - 1) * kHeadRows + mp) * ldo, 0.f);
  const Scores score(mask);
  for (int64_t tile = lo / kKeyTile; tile * kKeyTile < hi; ++tile) {
    const int64_t j0 = tile * kKeyTile, bk = std::min(s.lk, j0 + kKeyTile) - j0;
    const bool add = tile != lo / kKeyTile;
    const int64_t n = usable_cols<E>(hi - j0, pad16(bk));  // the columns any row of the item sees
    const bool full = tile_fully_visible(mask, s, i0, i1, j0, j0 + bk);
    E* p = std::is_same_v<E, float> ? reinterpret_cast<E*>(w.s) : w.p;  // P in place, or as bf16 beside it
    for (int64_t h = 0; h < heads; ++h) {
      float *m = w.m + h * kHeadRows, *l = w.l + h * kHeadRows, *acc = w.acc + h * kHeadRows * ldo;
      const E* qa = q_in_place ? reinterpret_cast<const E*>(a.q.at(s.q0 + i0, h0 + h)) : w.q + h * kHeadRows * dp;
      const int64_t ldq = q_in_place ? a.q.s0 : dp;
      if constexpr (std::is_same_v<E, float>) {
        if (dots) row_dots(a.k, s.k0 + j0, std::min(n, bk), h0 + h, d, qa, ldq, rows, w.s, n, w.scratch);
      }
      if (!dots) {
        const auto keys_t = [&](E* slot) {
          prepare_keys(a.k, s.k0 + j0, bk, h0 + h, d, dp, true, slot, w.tmp, w.scratch);
        };
        const E* kt = cached ? w.kt.get(b, h0, tile, keys_t) : w.kt.once(keys_t);
        mm(a.how, mp, n, dp, qa, ldq, b_operand(kt, dp, pad16(bk)), w.s, n, false);
      }
      for (int64_t r = 0; r < rows; ++r) {
        auto [cs, ce] = visible_cols(mask, s, i0 + r % bq, j0, bk, full);
        w.top[r] = ce > cs ? row_max(w.s + r * n + cs, ce - cs) : kNegInf;
      }
      for (int64_t r = 0; r < rows; ++r) {
        auto [cs, ce] = visible_cols(mask, s, i0 + r % bq, j0, bk, full);
        const float alpha = softmax_row(w.s + r * n, p + r * n, cs, ce, n, w.top[r], score, m[r], l[r]);
        if (alpha != 1.f) {
          const Vec factor(alpha);
          at::vec::map([factor](Vec x) { return x * factor; }, acc + r * ldo, acc + r * ldo, dv);
        }
      }
      if constexpr (std::is_same_v<E, float> && std::is_same_v<T, float>) {
        // fp32 V rows straight from the tensor when no later item reuses the tile: no copy, and the product
        // takes the bk keys (P is zero beyond them, so the sums are the same)
        if (a.v.s2 == 1 && (!cached || s.lq <= a.block_q)) {
          mm(a.how, mp, ldo, std::min(n, bk), p, n, BOperand{a.v.at(s.k0 + j0, h0 + h), a.v.s0}, acc, ldo, add);
          continue;
        }
      }
      const auto values = [&](E* slot) {
        prepare_keys(a.v, s.k0 + j0, bk, h0 + h, dv, ldo, false, slot, w.tmp, w.scratch);
      };
      const E* vb = cached ? w.v.get(b, h0, tile, values) : w.v.once(values);
      mm(a.how, mp, ldo, n, p, n, b_operand(vb, pad16(bk), ldo), acc, ldo, add);
    }
  }
}

// Out and LSE of query rows [i0, i0 + bq) of the G query heads of KV head h, from their running max m, sum l
// and unnormalised output acc (rows of stride ldo; overwritten). A finite max and sum: the softmax
// is defined. Else a row that sees keys met a NaN or +inf score, or only -inf ones (from infinite inputs):
// NaN out and LSE; a row that sees no key: 0 and -inf.
template <typename T>
void store_rows(const Seq& s, int64_t i0, int64_t bq, int64_t h, const float* m, const float* l, float* acc,
                int64_t ldo, const FwdArgs<T>& a) {
  constexpr float kNaN = std::numeric_limits<float>::quiet_NaN();
  const int64_t dv = a.sh.dv;
  for (int64_t r = 0; r < a.sh.g * bq; ++r) {
    const int64_t i = i0 + r % bq, t = s.q0 + i, head = h * a.sh.g + r / bq;
    float* row = acc + r * ldo;
    const bool fine = std::isfinite(m[r]) && l[r] > 0.f, sees = a.mask.lo(s, i) < a.mask.hi(s, i);
    T* dst = a.out + (t * a.hq + head) * dv;
    if (fine) {
      const Vec inv(1.f / l[r]);
      if (std::is_same_v<T, float> && !a.stream) {  // normalised straight into the output (T is float)
        at::vec::map([inv](Vec x) { return x * inv; }, reinterpret_cast<float*>(dst), row, dv);
      } else {
        at::vec::map([inv](Vec x) { return x * inv; }, row, row, dv);
        store_row(dst, row, dv, a.stream);
      }
    } else {
      std::fill(dst, dst + dv, T(sees ? kNaN : 0.f));
    }
    if (a.lse) a.lse[head * a.tq + t] = fine ? m[r] + std::log(l[r]) : sees ? kNaN : kNegInf;
  }
}

// The partial results of decoded sequences' key chunks, per item and KV head: the rows' max, their sum, then
// their dv outputs. Merged in chunk order after every item ran: the same bits at any thread count.
struct Partials {
  float* data = nullptr;
  std::vector<int64_t> at;  // per item: its first float, or -1 (a sequence of one chunk stores directly)
};

template <typename E, typename T>
void forward_item(const Item& it, int64_t index, FwdWork<E>& w, const FwdArgs<T>& a, const Partials& parts) {
  const Seq& s = a.seqs[it.b];
  const int64_t ldo = tile_width<E>(a.sh.dv);
  if (it.h >= 0) {  // rows [r0, r1) of one KV head against all keys they see
    attend(it.b, it.r0, it.r1, it.h, it.h + 1, 0, s.lk, w, a);
    return store_rows(s, it.r0, it.r1 - it.r0, it.h, w.m, w.l, w.acc, ldo, a);
  }
  attend(it.b, 0, s.lq, 0, a.sh.hkv, it.r0, it.r1, w, a);  // every row and KV head against keys [r0, r1)
  const int64_t rows = a.sh.g * s.lq, dv = a.sh.dv;
  for (int64_t h = 0; h < a.sh.hkv; ++h) {
    const float *m = w.m + h * kHeadRows, *l = w.l + h * kHeadRows;
    float* acc = w.acc + h * kHeadRows * ldo;
    if (parts.at[index] < 0) {
      store_rows(s, 0, s.lq, h, m, l, acc, ldo, a);
      continue;
    }
    float* out = parts.data + parts.at[index] + h * rows * (dv + 2);
    std::copy(m, m + rows, out);
    std::copy(l, l + rows, out + rows);
    for (int64_t r = 0; r < rows; ++r) std::copy(acc + r * ldo, acc + r * ldo + dv, out + 2 * rows + r * dv);
  }
}

// Merges the partial results of a sequence's key chunks, items [first, last) of the plan, as the online
// softmax merges tiles, and stores them.
template <typename T>
void merge_chunks(const Plan& plan, int64_t first, int64_t last, const Partials& parts, const FwdArgs<T>& a) {
  const Seq& s = a.seqs[plan.items[first].b];
  const int64_t rows = a.sh.g * s.lq, dv = a.sh.dv;
  std::vector<float> m(rows), l(rows), acc(rows * dv);
  for (int64_t h = 0; h < a.sh.hkv; ++h) {
    std::fill(m.begin(), m.end(), kNegInf);
    std::fill(l.begin(), l.end(), 0.f);
    std::fill(acc.begin(), acc.end(), 0.f);
    for (int64_t i = first; i < last; ++i) {
      const float* part = parts.data + parts.at[i] + h * rows * (dv + 2);
      for (int64_t r = 0; r < rows; ++r) {
        const float mc = part[r];
        if (mc == kNegInf) continue;  // the chunk added nothing to this row
        const float m_new = std::isnan(mc) ? mc : std::max(m[r], mc);
        const float alpha = std::exp(m[r] - m_new), beta = std::exp(mc - m_new);
        l[r] = l[r] * alpha + part[rows + r] * beta;
        float* row = acc.data() + r * dv;
        const float* add = part + 2 * rows + r * dv;
        const Vec va(alpha), vb(beta);
        at::vec::map2([va, vb](Vec x, Vec y) { return x * va + y * vb; }, row, row, add, dv);
        m[r] = m_new;
      }
    }
    store_rows(s, 0, s.lq, h, m.data(), l.data(), acc.data(), dv, a);
  }
}

// The forward's items: rows of one KV head (forward_item's h >= 0) or, for sequences that are decoded, key
// chunks of all KV heads (h = -1, keys [r0, r1)), in sequence order.
Plan forward_plan(const std::vector<Seq>& seqs, const Mask& mask, const Shape& sh, int64_t block_q,
                  std::vector<int64_t>& part_at, int64_t& part_floats) {
  Plan plan;
  part_floats = 0;
  for (int64_t b = 0; b < (int64_t)seqs.size(); ++b) {
    const Seq& s = seqs[b];
    if (s.lq == 0) continue;
    if (sh.g * s.lq > kWholeHeadsRows) {
      add_items(plan, s, b, mask, sh, block_q, false);
      part_at.resize(plan.items.size(), -1);
      continue;
    }
    const int64_t chunks = std::max<int64_t>(1, (s.lk + kChunkKeys - 1) / kChunkKeys);
    for (int64_t c = 0; c < chunks; ++c) {
      const int64_t c0 = c * kChunkKeys, c1 = std::min(s.lk, c0 + kChunkKeys);
      plan.items.push_back({b, -1, c0, c1});
      plan.cost.push_back(item_cost(sh, pairs_of_keys(s, mask, c0, c1), s.lq, sh.hkv));
      part_at.push_back(chunks == 1 ? -1 : part_floats);
      if (chunks > 1) part_floats += sh.hkv * sh.g * s.lq * (sh.dv + 2);
    }
  }
  return plan;
}

template <typename E, typename T>
void run_forward(const FwdArgs<T>& a) {
  const Shape& sh = a.sh;
  const int64_t dp = tile_width<E>(sh.d), ldo = tile_width<E>(sh.dv);
  const bool bf16 = !std::is_same_v<E, float>;
  const int64_t tiles = max_blocks(a.seqs, kKeyTile, true);
  Partials parts;
  int64_t part_floats = 0;
  const Plan plan = forward_plan(a.seqs, a.mask, sh, a.block_q, parts.at, part_floats);
  bool whole_heads = false;
  for (const Item& it : plan.items) whole_heads |= it.h < 0;
  const int64_t mp = pad16(sh.g * a.block_q);  // rows of one head's items; all heads' take kHeadRows each
  const int64_t state_rows = std::max(mp, whole_heads ? sh.hkv * kHeadRows : 0);
  std::vector<at::Tensor> keep;
  parts.data = buffer(keep, part_floats);
  auto make = [&] {
    FwdWork<E> w;
    w.s = buffer(w.keep, mp * kKeyTile);
    w.acc = buffer(w.keep, state_rows * ldo);
    w.m = buffer(w.keep, state_rows);
    w.l = buffer(w.keep, state_rows);
    w.top = buffer(w.keep, state_rows);
    w.q = buffer<E>(w.keep, state_rows * dp);
    w.scratch = buffer<E>(w.keep, kKeyTile * std::max(dp, ldo));
    w.tmp = bf16 ? buffer<E>(w.keep, kKeyTile * std::max(dp, ldo)) : nullptr;
    w.p = bf16 ? buffer<E>(w.keep, mp * kKeyTile) : nullptr;
    w.kt.init(w.keep, tiles, kKeyTile * dp);
    w.v.init(w.keep, tiles, kKeyTile * ldo);
    return w;
  };
  run_plan(
      plan, bf16 && a.how == Bf16Products::kAmx, make,
      [&](const Item& it, int64_t index, FwdWork<E>& w) { forward_item(it, index, w, a, parts); }, stream_fence);
  if (part_floats == 0) return;
  std::vector<std::pair<int64_t, int64_t>> merges;  // items [first, last) of each chunked sequence
  for (int64_t i = 0; i < (int64_t)plan.items.size(); ++i) {
    if (parts.at[i] < 0) continue;
    if (merges.empty() || plan.items[merges.back().first].b != plan.items[i].b) merges.emplace_back(i, i);
    merges.back().second = i + 1;
  }
  at::parallel_for(0, merges.size(), 1, [&](int64_t m0, int64_t m1) {
    for (int64_t m = m0; m < m1; ++m) merge_chunks(plan, merges[m].first, merges[m].second, parts, a);
    stream_fence();
  });
}

}  // namespace

std::tuple<at::Tensor, at::Tensor> attention_forward(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                                     const at::Tensor& cu_q, const at::Tensor& cu_k, double scale,
                                                     double softcap, int64_t left, int64_t right, bool with_lse,
                                                     const std::string& bf16_products) {
  constexpr const char* kWhere = "packattn cpu_kernel forward";
  check_inputs(kWhere, q, k, v, cu_q, cu_k, scale, softcap, left, right);
  const Bf16Products how = chosen_bf16_products(kWhere, bf16_products);
  const int64_t tq = q.size(0), hq = q.size(1), hkv = k.size(1);
  const Shape sh{hkv, hq / hkv, q.size(2), v.size(2)};
  const Mask mask{(float)scale, (float)softcap, left, right};
  const auto seqs = sequences(cu_q, cu_k);
  auto out = empty_output({tq, hq, sh.dv}, q.options());
  auto lse = with_lse ? at::empty({hq, tq}, q.options().dtype(at::kFloat)) : at::Tensor();
  const int64_t block_q = std::max<int64_t>(1, kFwdRows / sh.g);
  PACKATTN_DISPATCH(q.scalar_type(), "packattn_forward", [&] {
    const FwdArgs<scalar_t> a{seqs,
                              mask,
                              sh,
                              rows_of<scalar_t>(q),
                              rows_of<scalar_t>(k),
                              rows_of<scalar_t>(v),
                              out.data_ptr<scalar_t>(),
                              with_lse ? lse.data_ptr<float>() : nullptr,
                              tq,
                              hq,
                              block_q,
                              how,
                              stream_outputs({out})};
    if constexpr (std::is_same_v<scalar_t, at::BFloat16>) {
      if (how != Bf16Products::kFp32) return run_forward<at::BFloat16>(a);
    }
    run_forward<float>(a);
  });
  return {out, lse};
}

}  // namespace packattn_kernel
