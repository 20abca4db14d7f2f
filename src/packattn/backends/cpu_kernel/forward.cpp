// Forward: one item is one block of query rows (x the G query heads of a KV head) against the key tiles
// its rows see, with an online softmax in fp32 (no score matrix beyond one tile).
#include "kernel.h"

namespace packattn_kernel {
namespace {

using namespace detail;

constexpr int64_t kFwdRows = 256;  // target G x block_q rows of one forward item

template <typename E>  // tile element: float, or BFloat16 (on AMX or the dot-product kernel)
struct FwdWork {
  std::vector<at::Tensor> keep;
  float *s, *acc, *m, *l;
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
};

// Online softmax of one row of raw scores over its visible columns [c0, c1): writes exp(score - m_new) there
// and zeros in the rest of p[0, width) (p may be the row itself), updates the running max m and sum l, and
// returns the factor by which the row's accumulator must be rescaled. Two passes: max, then exp and sum.
template <typename E>
float softmax_row(const float* row, E* p, int64_t c0, int64_t c1, int64_t width, const Scores& score, float& m,
                  float& l) {
  if (c1 <= c0) {
    std::fill(p, p + width, E(0));
    return 1.f;
  }
  const float top = score(row_max(row + c0, c1 - c0));
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
  const float alpha = std::exp(m - m_new);  // 0 when m was -inf
  l = l * alpha + at::vec::vec_reduce_all<float>([](Vec x, Vec y) { return x + y; }, sum);
  m = m_new;
  return alpha;
}

template <typename E, typename T>
void forward_item(const Item& it, FwdWork<E>& w, const FwdArgs<T>& a) {
  const Seq& s = a.seqs[it.b];
  const Mask& mask = a.mask;
  const Shape& sh = a.sh;
  const int64_t i0 = it.r0, i1 = it.r1, bq = i1 - i0, rows = sh.g * bq, mp = a_rows<E>(a.how, rows), d = sh.d, dv = sh.dv;
  const int64_t dp = tile_width<E>(d), ldo = tile_width<E>(dv);
  load_group(a.q, s, i0, bq, it.h, sh.g, d, dp, w.q);
  std::fill(w.m, w.m + rows, kNegInf);
  std::fill(w.l, w.l + rows, 0.f);
  std::fill(w.acc, w.acc + mp * ldo, 0.f);
  const int64_t lo = mask.lo(s, i0), hi = mask.hi(s, i1 - 1);
  const Scores score(mask);
  for (int64_t tile = lo / kKeyTile; tile * kKeyTile < hi; ++tile) {
    const int64_t j0 = tile * kKeyTile, bk = std::min(s.lk, j0 + kKeyTile) - j0;
    const int64_t n = usable_cols<E>(hi - j0, pad16(bk));  // the columns any row of the item sees
    const E* kt = w.kt.get(it.b, it.h, tile, [&](E* slot) {
      prepare_keys(a.k, s.k0 + j0, bk, it.h, d, dp, true, slot, w.tmp, w.scratch);
    });
    mm(a.how, mp, n, dp, w.q, dp, b_operand(kt, dp, pad16(bk)), w.s, n, false);
    const bool full = tile_fully_visible(mask, s, i0, i1, j0, j0 + bk);
    E* p = std::is_same_v<E, float> ? reinterpret_cast<E*>(w.s) : w.p;  // P in place, or as bf16 beside it
    for (int64_t r = 0; r < rows; ++r) {
      auto [c0, c1] = visible_cols(mask, s, i0 + r % bq, j0, bk, full);
      const float alpha = softmax_row(w.s + r * n, p + r * n, c0, c1, n, score, w.m[r], w.l[r]);
      if (alpha != 1.f) {
        const Vec factor(alpha);
        at::vec::map([factor](Vec x) { return x * factor; }, w.acc + r * ldo, w.acc + r * ldo, dv);
      }
    }
    const E* vb = w.v.get(it.b, it.h, tile, [&](E* slot) {
      prepare_keys(a.v, s.k0 + j0, bk, it.h, dv, ldo, false, slot, w.tmp, w.scratch);
    });
    mm(a.how, mp, ldo, n, p, n, b_operand(vb, pad16(bk), ldo), w.acc, ldo, true);
  }
  // A finite max and sum: the softmax is defined. Else a row that sees keys met a NaN or +inf score, or only
  // -inf ones (from infinite inputs): NaN out and LSE; a row that sees no key: 0 and -inf.
  constexpr float kNaN = std::numeric_limits<float>::quiet_NaN();
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t i = i0 + r % bq, t = s.q0 + i, head = it.h * sh.g + r / bq;
    float* acc = w.acc + r * ldo;
    const bool fine = std::isfinite(w.m[r]) && w.l[r] > 0.f, sees = mask.lo(s, i) < mask.hi(s, i);
    if (fine) {
      const Vec inv(1.f / w.l[r]);
      at::vec::map([inv](Vec x) { return x * inv; }, acc, acc, dv);
    } else {
      std::fill(acc, acc + dv, sees ? kNaN : 0.f);
    }
    at::vec::convert(acc, a.out + (t * a.hq + head) * dv, dv);
    if (a.lse) a.lse[head * a.tq + t] = fine ? w.m[r] + std::log(w.l[r]) : sees ? kNaN : kNegInf;
  }
}

template <typename E, typename T>
void run_forward(const FwdArgs<T>& a) {
  const Shape& sh = a.sh;
  const int64_t mp = pad16(sh.g * a.block_q), dp = tile_width<E>(sh.d), ldo = tile_width<E>(sh.dv);
  const bool bf16 = !std::is_same_v<E, float>;
  const int64_t tiles = max_blocks(a.seqs, kKeyTile, true);
  auto make = [&] {
    FwdWork<E> w;
    w.s = buffer(w.keep, mp * kKeyTile);
    w.acc = buffer(w.keep, mp * ldo);
    w.m = buffer(w.keep, mp);
    w.l = buffer(w.keep, mp);
    w.q = buffer<E>(w.keep, mp * dp);
    w.scratch = buffer<E>(w.keep, kKeyTile * std::max(dp, ldo));
    w.tmp = bf16 ? buffer<E>(w.keep, kKeyTile * std::max(dp, ldo)) : nullptr;
    w.p = bf16 ? buffer<E>(w.keep, mp * kKeyTile) : nullptr;
    w.kt.init(w.keep, tiles, kKeyTile * dp);
    w.v.init(w.keep, tiles, kKeyTile * ldo);
    return w;
  };
  const Plan plan = make_plan(a.seqs, a.mask, sh, a.block_q, false);
  run_plan(plan, bf16 && a.how == Bf16Products::kAmx, make,
           [&](const Item& it, FwdWork<E>& w) { forward_item(it, w, a); });
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
                              how};
    if constexpr (std::is_same_v<scalar_t, at::BFloat16>) {
      if (how != Bf16Products::kFp32) return run_forward<at::BFloat16>(a);
    }
    run_forward<float>(a);
  });
  return {out, lse};
}

}  // namespace packattn_kernel
