// How a call's work is cut and spread over threads: work items of (sequence, KV head, block of query rows or
// keys), costed by their visible (query, key) pairs, and a split of the items into one contiguous run of
// about equal cost per thread. Which thread runs an item never changes what the item computes.
#pragma once

#include <ATen/Parallel.h>
#include <ATen/native/CPUBlas.h>

#include <algorithm>
#include <cstdint>
#include <utility>
#include <vector>

#include "mask.h"

namespace packattn_kernel::detail {

struct Item {
  int64_t b, h, r0, r1;  // sequence, KV head (-1: all of them), query rows or keys [r0, r1)
};

struct Plan {
  std::vector<Item> items;
  std::vector<double> cost;
};

// Visible (query, key) pairs of sequence s whose key is in [j0, j1).
inline double pairs_of_keys(const Seq& s, const Mask& mask, int64_t j0, int64_t j1) {
  double pairs = 0;
  if (s.lq == 0 || j1 <= j0) return pairs;
  for (int64_t i = mask.first_row(s, j0); i < mask.last_row(s, j1); ++i) {
    pairs += std::max<int64_t>(0, std::min(j1, mask.hi(s, i)) - std::max(j0, mask.lo(s, i)));
  }
  return pairs;
}

// An item's cost: its visible pairs and rows, for G query heads of `heads` KV heads, plus a fixed cost.
inline double item_cost(const Shape& sh, double pairs, int64_t rows, int64_t heads = 1) {
  return heads * sh.g * (pairs + 8.0 * rows) * (sh.d + sh.dv) + 2048.0;
}

// Items of sequence b (seqs[b]) in `block` query rows (by_keys = false) or keys (by_keys = true), costed by
// visible pairs, in the order (KV head, block): a thread's consecutive items share the sequence's key tiles
// (TileCache). With whole_sequences, one item of all keys per KV head if the sequence has rows on either side.
inline void add_items(Plan& plan, const Seq& s, int64_t b, const Mask& mask, const Shape& sh, int64_t block,
                      bool by_keys, bool whole_sequences = false) {
  const int64_t n = by_keys ? s.lk : s.lq;
  std::vector<std::pair<int64_t, int64_t>> ranges;
  std::vector<double> cost;
  if (whole_sequences) {
    if (s.lq > 0 || s.lk > 0) ranges.emplace_back(0, n);
  } else {
    for (int64_t r0 = 0; r0 < n; r0 += block) ranges.emplace_back(r0, std::min(n, r0 + block));
  }
  for (const auto& [r0, r1] : ranges) {
    double pairs = 0;
    if (!by_keys) {
      for (int64_t i = r0; i < r1; ++i) pairs += std::max<int64_t>(0, mask.hi(s, i) - mask.lo(s, i));
    } else {
      pairs = pairs_of_keys(s, mask, r0, r1);
    }
    cost.push_back(item_cost(sh, pairs, whole_sequences ? s.lq + s.lk : r1 - r0));
  }
  for (int64_t h = 0; h < sh.hkv; ++h) {
    for (size_t r = 0; r < ranges.size(); ++r) {
      plan.items.push_back({b, h, ranges[r].first, ranges[r].second});
      plan.cost.push_back(cost[r]);
    }
  }
}

// add_items for every sequence, in order.
inline Plan make_plan(const std::vector<Seq>& seqs, const Mask& mask, const Shape& sh, int64_t block, bool by_keys,
                      bool whole_sequences = false) {
  Plan plan;
  for (int64_t b = 0; b < (int64_t)seqs.size(); ++b)
    add_items(plan, seqs[b], b, mask, sh, block, by_keys, whole_sequences);
  return plan;
}

// Releases the matrix units' state when a thread's work is done.
struct AmxRelease {
  bool active;
  ~AmxRelease() {
    if (active) at::native::cpublas::brgemm_release();
  }
};

// Runs fn(item, its index in the plan, workspace) for every item: thread t gets a contiguous run of items of about
// 1/threads of the total cost, and one workspace from make_workspace(); then done(), if given, on each thread.
template <typename W, typename F>
void run_plan(const Plan& plan, bool amx, const W& make_workspace, const F& fn, void (*done)() = nullptr) {
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
      for (int64_t i = bound[t]; i < bound[t + 1]; ++i) fn(plan.items[i], i, ws);
    }
    if (done) done();
  });
}

}  // namespace packattn_kernel::detail
