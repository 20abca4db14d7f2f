// Backward, flash-attention 2 style: the probabilities are recomputed from the LSE, tile by tile, in fp32.
// With enough (sequence, KV head) pairs, one item per pair loops over its key tiles and, for each, the query
// blocks that see it: dK and dV of the tile, and the tile's share of dQ added to per-block accumulators.
// Else two passes split a sequence between threads: dK and dV from one item per (sequence, KV head, key
// block), dQ from one item per (sequence, KV head, query block). Each gradient element has one writer, so no
// reduction across threads.
#include "kernel.h"

namespace packattn_kernel {
namespace {

using namespace detail;

constexpr int64_t kBwdRows = 64;  // target G x block_q rows

template <typename E>  // tile element: float, or BFloat16 (on AMX or the dot-product kernel)
struct BwdWork {
  std::vector<at::Tensor> keep;
  Bf16Products how;
  float *lse, *delta, *s, *ds, *acc, *acc2, *dq = nullptr;
  E *half, *st, *tmp, *scratch;
  TileCache<E> queries;    // per query block: Q and dO as A operands, then (bf16) as packed B operands
  TileCache<E> kt, vt, k;  // per key tile: K^T, V^T and K as B operands
};

template <typename T>
struct BwdArgs {
  const std::vector<Seq>& seqs;
  Mask mask;
  Shape sh;
  Rows<T> q, k, v, dout;
  const float *lse, *delta;
  T *dq, *dk, *dv;  // in the inputs' dtype
  int64_t tq, hq, block_q;
  Bf16Products how;  // of bf16 inputs
  bool stream;       // dq, dk and dv are stored with non-temporal stores (see stream_outputs)
};

// The query side of rows [i0, i0 + bq) (x G heads): the cached slot holds Q [mp, dp] and dO [mp, dvp] as A
// operands and, for bf16, their packed B forms after them; the LSE and delta rows go to w.lse, w.delta.
template <typename E>
struct QuerySide {
  const E *q, *dout;
  BOperand q_b, dout_b;
};

template <typename E, typename T>
QuerySide<E> query_side(BwdWork<E>& w, const BwdArgs<T>& a, const Seq& s, int64_t b, int64_t block, int64_t h) {
  const Shape& sh = a.sh;
  const int64_t i0 = block * a.block_q, bq = std::min(s.lq, i0 + a.block_q) - i0, mp = pad16(sh.g * bq);
  const int64_t dp = tile_width<E>(sh.d), dvp = tile_width<E>(sh.dv), mpmax = pad16(sh.g * a.block_q);
  const E* slot = w.queries.get(b, h, block, [&](E* p) {
    E *q = p, *dout = p + mpmax * dp;
    load_group(a.q, s, i0, bq, h, sh.g, sh.d, dp, q);
    load_group(a.dout, s, i0, bq, h, sh.g, sh.dv, dvp, dout);
    if constexpr (!std::is_same_v<E, float>) {
      prepare_b(q, mp, dp, dp, dout + mpmax * dvp);
      prepare_b(dout, mp, dvp, dvp, dout + mpmax * (dvp + dp));
    }
  });
  for (int64_t gi = 0; gi < sh.g; ++gi) {
    for (int64_t ii = 0; ii < bq; ++ii) {
      const int64_t idx = (h * sh.g + gi) * a.tq + s.q0 + i0 + ii;
      w.lse[gi * bq + ii] = a.lse[idx];
      w.delta[gi * bq + ii] = a.delta[idx];
    }
  }
  const E *q = slot, *dout = slot + mpmax * dp;
  if constexpr (std::is_same_v<E, float>) return {q, dout, b_operand(q, mp, dp), b_operand(dout, mp, dvp)};
  const E *q_packed = dout + mpmax * dvp, *dout_packed = q_packed + mpmax * dp;
  return {q, dout, b_operand(q_packed, mp, dp), b_operand(dout_packed, mp, dvp)};
}

// K^T, V^T and (with rows) K of key tile `tile` as B operands; no K^T where the scores are row_dots.
template <typename E, typename T>
std::tuple<BOperand, BOperand, BOperand> key_side(BwdWork<E>& w, const BwdArgs<T>& a, const Seq& s, int64_t b,
                                                  int64_t tile, int64_t h, bool rows) {
  const int64_t j0 = tile * kKeyTile, bk = std::min(s.lk, j0 + kKeyTile) - j0, kp = pad16(bk);
  const int64_t d = a.sh.d, dv = a.sh.dv, dp = tile_width<E>(d), dvp = tile_width<E>(dv);
  const auto prepared = [&](TileCache<E>& cache, const Rows<T>& x, int64_t width, int64_t width_pad, bool t) {
    return cache.get(b, h, tile,
                     [&](E* p) { prepare_keys(x, s.k0 + j0, bk, h, width, width_pad, t, p, w.tmp, w.scratch); });
  };
  const BOperand kt =
      scores_by_row_dots<E>(a.sh, s) ? BOperand{nullptr, 0} : b_operand(prepared(w.kt, a.k, d, dp, true), dp, kp);
  const E* vt = prepared(w.vt, a.v, dv, dvp, true);
  const BOperand kr = rows ? b_operand(prepared(w.k, a.k, d, dp, false), kp, dp) : BOperand{nullptr, 0};
  return {kt, b_operand(vt, dvp, kp), kr};
}

// Query rows [i0, i0 + bq) (x G heads) of KV head h against keys [j0, j0 + bk): leaves P in w.s and dS (the
// gradient of the raw scores q.k) in w.ds, both [pad16(rows), pad16(bk)] with zeros wherever a pair is hidden
// or padding. The scores are the forward's, bit for bit: the same product (kernel.h).
template <typename E, typename T>
void grad_tile(BwdWork<E>& w, const BwdArgs<T>& a, const Seq& s, int64_t h, int64_t i0, int64_t bq, int64_t j0,
               int64_t bk, const QuerySide<E>& qs, BOperand kt, BOperand vt) {
  const Mask& mask = a.mask;
  const Shape& sh = a.sh;
  const int64_t rows = sh.g * bq, mp = pad16(rows), kp = pad16(bk);
  const int64_t dp = tile_width<E>(sh.d), dvp = tile_width<E>(sh.dv);
  const bool dots = scores_by_row_dots<E>(sh, s);
  if constexpr (std::is_same_v<E, float>) {
    if (dots) {
      row_dots(a.k, s.k0 + j0, bk, h, sh.d, qs.q, dp, rows, w.s, kp, w.scratch);
      std::fill(w.s + rows * kp, w.s + mp * kp, 0.f);  // the padding rows, which the products below read
    }
  }
  if (!dots) mm(w.how, mp, kp, dp, qs.q, dp, kt, w.s, kp, false);
  mm(w.how, mp, kp, dvp, qs.dout, dvp, vt, w.ds, kp, false);
  const bool full = tile_fully_visible(mask, s, i0, i0 + bq, j0, j0 + bk);
  const Scores score(mask);
  const Vec scale(mask.scale), one(1.f);
  for (int64_t r = 0; r < rows; ++r) {
    float *p = w.s + r * kp, *ds = w.ds + r * kp;
    auto [c0, c1] = visible_cols(mask, s, i0 + r % bq, j0, bk, full);
    if (c1 <= c0 || w.lse[r] == kNegInf) c0 = c1 = 0;
    const Vec lse(w.lse[r]), delta(w.delta[r]);
    for (int64_t c = c0; c < c1; c += kVec) {  // p = exp(score - lse), ds = p (dp - delta) d(score)/d(q.k)
      const int64_t cnt = std::min(kVec, c1 - c);
      Vec t;
      const Vec pv = exp_softmax(score(Vec::loadu(p + c, cnt), &t) - lse);
      Vec dsv = pv * (Vec::loadu(ds + c, cnt) - delta) * scale;
      if (score.capped) dsv = dsv * (one - t * t);
      pv.store(p + c, cnt);
      dsv.store(ds + c, cnt);
    }
    zero_outside(p, c0, c1, kp);
    zero_outside(ds, c0, c1, kp);
  }
}

// Rows of fp32 gradient sums into the gradient tensor, in its dtype.
template <typename T>
void store_rows(const float* src, int64_t n, int64_t width, int64_t ld_src, T* dst, int64_t ld_dst, bool stream) {
  for (int64_t r = 0; r < n; ++r) store_row(dst + r * ld_dst, src + r * ld_src, width, stream);
}

// dK and dV of key tile `tile` of (sequence b, KV head h): the sum over the query blocks that see it. With
// dq (the fp32 [query block][pad16(G x block_q)][dp] accumulators of the whole sequence), also adds the
// tile's share of dQ to every block: the same products, in the same order, as dq_item.
template <typename E, typename T>
void key_tile_grads(BwdWork<E>& w, const BwdArgs<T>& a, int64_t b, int64_t h, int64_t tile, float* dq) {
  const Seq& s = a.seqs[b];
  const Shape& sh = a.sh;
  const int64_t j0 = tile * kKeyTile, bk = std::min(s.lk, j0 + kKeyTile) - j0, kp = pad16(bk);
  const int64_t dp = tile_width<E>(sh.d), dvp = tile_width<E>(sh.dv), mpmax = pad16(sh.g * a.block_q);
  const auto [kt, vt, kr] = key_side(w, a, s, b, tile, h, dq != nullptr);
  float *dk = w.acc, *dv = w.acc2;
  std::fill(dk, dk + kp * dp, 0.f);
  std::fill(dv, dv + kp * dvp, 0.f);
  const int64_t last = a.mask.last_row(s, j0 + bk);
  for (int64_t block = a.mask.first_row(s, j0) / a.block_q; block * a.block_q < last; ++block) {
    const int64_t i0 = block * a.block_q, bq = std::min(s.lq, i0 + a.block_q) - i0, mp = pad16(sh.g * bq);
    const QuerySide<E> qs = query_side(w, a, s, b, block, h);
    grad_tile(w, a, s, h, i0, bq, j0, bk, qs, kt, vt);
    transpose(as_tile(w.s, mp * kp, w.half), mp, kp, kp, w.st, mp, mp);  // P^T
    mm(w.how, kp, dvp, mp, w.st, mp, qs.dout_b, dv, dvp, true);
    const E* ds = as_tile(w.ds, mp * kp, w.half);
    transpose(ds, mp, kp, kp, w.st, mp, mp);  // dS^T
    mm(w.how, kp, dp, mp, w.st, mp, qs.q_b, dk, dp, true);
    if (dq) mm(w.how, mp, dp, kp, ds, kp, kr, dq + block * mpmax * dp, dp, true);
  }
  const int64_t hkv = sh.hkv, row0 = (s.k0 + j0) * hkv + h;
  store_rows(dk, bk, sh.d, dp, a.dk + row0 * sh.d, hkv * sh.d, a.stream);
  store_rows(dv, bk, sh.dv, dvp, a.dv + row0 * sh.dv, hkv * sh.dv, a.stream);
}

template <typename E, typename T>
void store_dq(const BwdArgs<T>& a, const Seq& s, int64_t h, int64_t i0, int64_t bq, const float* dq) {
  const int64_t dp = tile_width<E>(a.sh.d);
  for (int64_t gi = 0; gi < a.sh.g; ++gi) {
    T* dst = a.dq + ((s.q0 + i0) * a.hq + h * a.sh.g + gi) * a.sh.d;
    store_rows(dq + gi * bq * dp, bq, a.sh.d, dp, dst, a.hq * a.sh.d, a.stream);
  }
}

// Every gradient of one (sequence, KV head), in one pass over its key tiles.
template <typename E, typename T>
void sequence_item(const Item& it, BwdWork<E>& w, const BwdArgs<T>& a) {
  const Seq& s = a.seqs[it.b];
  const int64_t mpmax = pad16(a.sh.g * a.block_q), dp = tile_width<E>(a.sh.d);
  const int64_t blocks = (s.lq + a.block_q - 1) / a.block_q;
  std::fill(w.dq, w.dq + blocks * mpmax * dp, 0.f);
  for (int64_t tile = 0; tile * kKeyTile < s.lk; ++tile) key_tile_grads(w, a, it.b, it.h, tile, w.dq);
  for (int64_t block = 0; block < blocks; ++block) {
    const int64_t i0 = block * a.block_q;
    store_dq<E>(a, s, it.h, i0, std::min(s.lq, i0 + a.block_q) - i0, w.dq + block * mpmax * dp);
  }
}

template <typename E, typename T>
void dkdv_item(const Item& it, BwdWork<E>& w, const BwdArgs<T>& a) {
  key_tile_grads<E>(w, a, it.b, it.h, it.r0 / kKeyTile, nullptr);
}

// dQ of one query block: the sum over the key tiles it sees.
template <typename E, typename T>
void dq_item(const Item& it, BwdWork<E>& w, const BwdArgs<T>& a) {
  const Seq& s = a.seqs[it.b];
  const Shape& sh = a.sh;
  const int64_t i0 = it.r0, bq = it.r1 - it.r0, mp = pad16(sh.g * bq), dp = tile_width<E>(sh.d);
  const QuerySide<E> qs = query_side(w, a, s, it.b, i0 / a.block_q, it.h);
  float* dq = w.acc;
  std::fill(dq, dq + mp * dp, 0.f);
  const int64_t lo = a.mask.lo(s, i0), hi = a.mask.hi(s, it.r1 - 1);
  for (int64_t tile = lo / kKeyTile; tile * kKeyTile < hi; ++tile) {
    const int64_t j0 = tile * kKeyTile, bk = std::min(s.lk, j0 + kKeyTile) - j0, kp = pad16(bk);
    const auto [kt, vt, kr] = key_side(w, a, s, it.b, tile, it.h, true);
    grad_tile(w, a, s, it.h, i0, bq, j0, bk, qs, kt, vt);
    mm(w.how, mp, dp, kp, as_tile(w.ds, mp * kp, w.half), kp, kr, dq, dp, true);
  }
  store_dq<E>(a, s, it.h, i0, bq, dq);
}

template <typename E, typename T>
void run_backward(const BwdArgs<T>& a) {
  const Shape& sh = a.sh;
  const int64_t mp = pad16(sh.g * a.block_q), dp = tile_width<E>(sh.d), dvp = tile_width<E>(sh.dv);
  const bool bf16 = !std::is_same_v<E, float>, amx = bf16 && a.how == Bf16Products::kAmx;
  const int64_t key_tiles = max_blocks(a.seqs, kKeyTile, true), query_blocks = max_blocks(a.seqs, a.block_q, false);
  auto make = [&] {
    BwdWork<E> w;
    w.how = a.how;
    w.lse = buffer(w.keep, mp);
    w.delta = buffer(w.keep, mp);
    w.s = buffer(w.keep, mp * kKeyTile);
    w.ds = buffer(w.keep, mp * kKeyTile);
    w.acc = buffer(w.keep, std::max(mp, kKeyTile) * dp);
    w.acc2 = buffer(w.keep, kKeyTile * dvp);
    w.scratch = buffer<E>(w.keep, kKeyTile * std::max(dp, dvp));
    w.st = buffer<E>(w.keep, mp * kKeyTile);
    w.tmp = bf16 ? buffer<E>(w.keep, kKeyTile * std::max(dp, dvp)) : nullptr;
    w.half = bf16 ? buffer<E>(w.keep, mp * kKeyTile) : nullptr;
    w.queries.init(w.keep, query_blocks, mp * (dp + dvp) * (bf16 ? 2 : 1));
    w.kt.init(w.keep, key_tiles, kKeyTile * dp);
    w.vt.init(w.keep, key_tiles, kKeyTile * dvp);
    w.k.init(w.keep, key_tiles, kKeyTile * dp);
    return w;
  };
  // One pass per (sequence, KV head) when there are enough of them to keep every thread busy: 5 products per
  // (query block, key tile). Else two passes, over key tiles (dK, dV) and query blocks (dQ), which split
  // one sequence between threads at the price of recomputing Q K^T and dO V^T (7 products). Both give the
  // same bits.
  const Plan whole = make_plan(a.seqs, a.mask, sh, 0, true, true);
  if ((int64_t)whole.items.size() >= 4 * at::get_num_threads()) {
    const auto fused = [&] {
      BwdWork<E> w = make();
      w.dq = buffer(w.keep, query_blocks * mp * dp);
      return w;
    };
    run_plan(whole, amx, fused, [&](const Item& it, int64_t, BwdWork<E>& w) { sequence_item(it, w, a); }, stream_fence);
    return;
  }
  run_plan(
      make_plan(a.seqs, a.mask, sh, kKeyTile, true), amx, make,
      [&](const Item& it, int64_t, BwdWork<E>& w) { dkdv_item(it, w, a); }, stream_fence);
  run_plan(
      make_plan(a.seqs, a.mask, sh, a.block_q, false), amx, make,
      [&](const Item& it, int64_t, BwdWork<E>& w) { dq_item(it, w, a); }, stream_fence);
}

}  // namespace

at::Tensor attention_delta(const at::Tensor& out, const at::Tensor& dout) {
  constexpr const char* kWhere = "packattn cpu_kernel delta";
  check_delta_inputs(kWhere, out, dout);
  const int64_t tq = out.size(0), hq = out.size(1), dv = out.size(2);
  auto delta = at::empty({hq, tq}, out.options().dtype(at::kFloat));
  float* d = delta.data_ptr<float>();
  PACKATTN_DISPATCH(out.scalar_type(), "packattn_delta", [&] {
    const Rows<scalar_t> o = rows_of<scalar_t>(out), g = rows_of<scalar_t>(dout);
    at::parallel_for(0, tq, 64, [&](int64_t t0, int64_t t1) {
      std::vector<float> x(dv), y(dv);  // one row of each in fp32
      for (int64_t t = t0; t < t1; ++t) {
        for (int64_t h = 0; h < hq; ++h) {
          load_row(o.at(t, h), o.s2, dv, x.data());
          load_row(g.at(t, h), g.s2, dv, y.data());
          d[h * tq + t] = dot(x.data(), y.data(), dv);
        }
      }
    });
  });
  return delta;
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> attention_backward(const at::Tensor& q, const at::Tensor& k,
                                                                  const at::Tensor& v, const at::Tensor& dout,
                                                                  const at::Tensor& lse, const at::Tensor& delta,
                                                                  const at::Tensor& cu_q, const at::Tensor& cu_k,
                                                                  double scale, double softcap, int64_t left,
                                                                  int64_t right, const std::string& bf16_products) {
  constexpr const char* kWhere = "packattn cpu_kernel backward";
  check_inputs(kWhere, q, k, v, cu_q, cu_k, scale, softcap, left, right);
  const Bf16Products how = chosen_bf16_products(kWhere, bf16_products);
  check_grad_inputs(kWhere, q, v, dout, lse, delta);
  const int64_t tq = q.size(0), hq = q.size(1), tk = k.size(0), hkv = k.size(1);
  const Shape sh{hkv, hq / hkv, q.size(2), v.size(2)};
  const Mask mask{(float)scale, (float)softcap, left, right};
  const auto seqs = sequences(cu_q, cu_k);
  auto dq = empty_output({tq, hq, sh.d}, q.options()), dk = empty_output({tk, hkv, sh.d}, q.options()),
       dv = empty_output({tk, hkv, sh.dv}, q.options());
  const int64_t block_q = std::max<int64_t>(1, kBwdRows / sh.g);
  PACKATTN_DISPATCH(q.scalar_type(), "packattn_backward", [&] {
    const BwdArgs<scalar_t> a{seqs,
                              mask,
                              sh,
                              rows_of<scalar_t>(q),
                              rows_of<scalar_t>(k),
                              rows_of<scalar_t>(v),
                              rows_of<scalar_t>(dout),
                              lse.data_ptr<float>(),
                              delta.data_ptr<float>(),
                              dq.data_ptr<scalar_t>(),
                              dk.data_ptr<scalar_t>(),
                              dv.data_ptr<scalar_t>(),
                              tq,
                              hq,
                              block_q,
                              how,
                              stream_outputs({dq, dk, dv})};
    if constexpr (std::is_same_v<scalar_t, at::BFloat16>) {
      if (how != Bf16Products::kFp32) return run_backward<at::BFloat16>(a);
    }
    run_backward<float>(a);
  });
  return {dq, dk, dv};
}

}  // namespace packattn_kernel
