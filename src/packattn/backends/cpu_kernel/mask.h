// Which keys each query row sees: the sequences of the packed batch (Seq), its heads and head dims (Shape),
// and the mask (Mask) as ranges of keys per query row and of query rows per block of keys.
#pragma once

#include <ATen/ATen.h>

#include <algorithm>
#include <cstdint>
#include <utility>
#include <vector>

namespace packattn_kernel::detail {

struct Seq {  // query rows [q0, q0 + lq) with key rows [k0, k0 + lk)
  int64_t q0, lq, k0, lk;
};

struct Shape {  // KV heads, query heads per KV head, head dim of q and k, head dim of v
  int64_t hkv, g, d, dv;
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

// The sequences of the offsets cu_q and cu_k (int64, B + 1 entries each, checked by the entry points).
inline std::vector<Seq> sequences(const at::Tensor& cu_q, const at::Tensor& cu_k) {
  auto q = cu_q.accessor<int64_t, 1>();
  auto k = cu_k.accessor<int64_t, 1>();
  std::vector<Seq> seqs;
  for (int64_t b = 0; b + 1 < cu_q.size(0); ++b) {
    seqs.push_back({q[b], q[b + 1] - q[b], k[b], k[b + 1] - k[b]});
  }
  return seqs;
}

// Columns [c0, c1) of a row of the tile [j0, j0 + bk) that query row i sees.
inline std::pair<int64_t, int64_t> visible_cols(const Mask& mask, const Seq& s, int64_t i, int64_t j0, int64_t bk,
                                                bool full) {
  if (full) return {0, bk};
  return {std::clamp<int64_t>(mask.lo(s, i) - j0, 0, bk), std::clamp<int64_t>(mask.hi(s, i) - j0, 0, bk)};
}

// Whether query rows [i0, i1) all see all keys [j0, j1): the tile needs no per-row bounds.
inline bool tile_fully_visible(const Mask& mask, const Seq& s, int64_t i0, int64_t i1, int64_t j0, int64_t j1) {
  return mask.lo(s, i1 - 1) <= j0 && mask.hi(s, i0) >= j1;
}

}  // namespace packattn_kernel::detail
