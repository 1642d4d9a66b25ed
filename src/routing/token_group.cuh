// The router kernels' unit of work: one token per group of `width` lanes, width = the smallest
// power of two >= min(E, 32), so 32 / width tokens share a warp when E < 32 (a warp per token
// left most lanes idle and made small-E routing latency-bound). Each lane owns the token's
// experts sub, sub + width, ... and, for E <= 32 * kMaxExpertsPerLane, keeps their logits and
// scores in registers instead of recomputing them for every pick. Group reductions are xor
// butterflies over the group's lanes in a fixed order: results are bitwise reproducible, and
// for one token per warp they are the 32-lane butterflies of a warp-per-token kernel.
#pragma once

#include <cstdint>
#include <type_traits>

#include "routing/score_order.hpp"
#include "routing/selection.hpp"

namespace moeblaze {
inline namespace v0 {
namespace routing {

constexpr int kMaxExpertsPerLane = 8;  // E <= 256 runs from registers

struct TokenGroup {
  int width;      // lanes per token (a power of two <= 32)
  int sub;        // this lane's rank within its token's lanes
  int64_t token;  // the group's token
  bool live;      // token < rows (lanes of a dead group still take part in the warp's shuffles)
};

// Lanes per token for E experts.
inline int token_group_width(int64_t E) { return selection_lanes(E); }

// Experts cached per lane: 1, 2, 4 or 8, or 0 (E > 32 * kMaxExpertsPerLane: read on each use).
inline int experts_per_lane(int64_t E, int width) {
  const int64_t per = (E + width - 1) / width;
  if (per > kMaxExpertsPerLane) return 0;
  int p = 1;
  while (p < per) p *= 2;
  return p;
}

// kWidth: the width when the kernel knows it at compile time (32 for E > 16), 0 when it comes at
// run time. A known width unrolls every butterfly below and lets a whole warp reduce its keys
// with redux instructions instead of shuffle rounds.
template <int kWidth = 0>
__device__ __forceinline__ TokenGroup token_group(int64_t rows, int width, int warps_per_block) {
  if constexpr (kWidth > 0) width = kWidth;
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  TokenGroup g;
  g.width = width;
  g.sub = lane % width;
  g.token = (static_cast<int64_t>(blockIdx.x) * warps_per_block + warp) * (32 / width) + lane / width;
  g.live = g.token < rows;
  return g;
}

// f(i, e) for each of the lane's experts e = sub + i * width < E (i < kPer when kPer > 0).
template <int kPer, class F>
__device__ __forceinline__ void for_each_expert(const TokenGroup& g, int64_t E, F&& f) {
  if constexpr (kPer > 0) {
#pragma unroll
    for (int i = 0; i < kPer; ++i) {
      const int64_t e = g.sub + static_cast<int64_t>(i) * g.width;
      if (e < E) f(i, e);
    }
  } else {
    for (int64_t e = g.sub; e < E; e += g.width) f(0, e);
  }
}

// The group's sum, the same in every lane (a fixed butterfly): double where the sum must match
// the CPU engine's bit for bit, float where it need not.
template <class T>
__device__ __forceinline__ T group_sum(T v, int width) {
#pragma unroll
  for (int o = width / 2; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

__device__ __forceinline__ float group_max(float m, int width) {
#pragma unroll
  for (int o = width / 2; o > 0; o >>= 1) m = max_skipping_nan(m, __shfl_xor_sync(0xffffffffu, m, o));
  return m;
}

// The group's first (v, i) under ranks_before, in every lane of the group: a strict total
// order, so the butterfly gives all lanes the same winner whatever the values.
__device__ __forceinline__ void group_best(float& v, int& i, int width) {
#pragma unroll
  for (int o = width / 2; o > 0; o >>= 1) {
    const float ov = __shfl_xor_sync(0xffffffffu, v, o);
    const int oi = __shfl_xor_sync(0xffffffffu, i, o);
    if (ranks_before(ov, oi, v, i)) {
      v = ov;
      i = oi;
    }
  }
}

// The group's largest 64-bit key (routing/score_order.hpp, rank_key), in every lane of the group.
// A whole warp takes the largest high word, then the largest low word among the keys with that
// high word: two redux instructions in place of five rounds of two shuffles.
__device__ __forceinline__ uint64_t group_max_key(uint64_t key, int width) {
  if (width == 32) {
    const uint32_t key_hi = static_cast<uint32_t>(key >> 32);
    const uint32_t hi = __reduce_max_sync(0xffffffffu, key_hi);
    const uint32_t lo = __reduce_max_sync(0xffffffffu, key_hi == hi ? static_cast<uint32_t>(key) : 0u);
    return (static_cast<uint64_t>(hi) << 32) | lo;
  }
#pragma unroll
  for (int o = width / 2; o > 0; o >>= 1) {
    const uint64_t other = __shfl_xor_sync(0xffffffffu, key, o);
    key = other > key ? other : key;
  }
  return key;
}

// A lane's candidates for top-k: its experts' rank keys, sorted in descending order (an
// odd-even transposition network, once per token). Picks come out in descending key order across
// the group, so the lane whose first key is the group's maximum owns the pick and drops it. Each
// pick is one integer maximum over the group, with no rescans and no ranks_before calls.
template <int kPer>
struct SortedCandidates {
  uint64_t key[kPer];

  __device__ __forceinline__ void sort() {
#pragma unroll
    for (int pass = 0; pass < kPer; ++pass)
#pragma unroll
      for (int i = 0; i + 1 < kPer; ++i)
        if ((i & 1) == (pass & 1) && key[i] < key[i + 1]) {
          const uint64_t k = key[i];
          key[i] = key[i + 1];
          key[i + 1] = k;
        }
  }
  // The group's best remaining candidate's key; its owner drops it.
  __device__ __forceinline__ uint64_t pop_key(int width) {
    const uint64_t best = group_max_key(key[0], width);
    if (key[0] == best) {
#pragma unroll
      for (int i = 0; i + 1 < kPer; ++i) key[i] = key[i + 1];
      key[kPer - 1] = 0;
    }
    return best;
  }
};

// A value per expert of the lane, f(i, e): computed once into registers when kPer > 0, else
// recomputed by f on each use (E > 32 * kMaxExpertsPerLane). Either way the same value.
template <int kPer, class F>
struct LaneValues {
  F f;
  float cached[kPer > 0 ? kPer : 1];

  __device__ __forceinline__ LaneValues(const TokenGroup& g, int64_t E, F fn) : f(fn) {
    if constexpr (kPer > 0) for_each_expert<kPer>(g, E, [&](int i, int64_t e) { cached[i] = f(i, e); });
  }
  __device__ __forceinline__ float operator()(int i, int64_t e) const {
    if constexpr (kPer > 0) return cached[i];
    else return f(i, e);
  }
};
template <int kPer, class F>
__device__ __forceinline__ LaneValues<kPer, F> lane_values(const TokenGroup& g, int64_t E, F f) {
  return LaneValues<kPer, F>(g, E, f);
}

// The row's logsumexp, the same in every lane of the group: the max skips NaN, and the E exp
// terms are summed in Acc: fp64 where scores must match routing/router.cpp bit for bit (the
// picks' gates), fp32 where they need not (gradients). logit(i, e): the lane's logits.
template <int kPer, class Acc = double, class Logit>
__device__ __forceinline__ float group_lse(const TokenGroup& g, int64_t E, const Logit& logit) {
  float m = -INFINITY;
  for_each_expert<kPer>(g, E, [&](int i, int64_t e) { m = max_skipping_nan(m, logit(i, e)); });
  m = group_max(m, g.width);
  if constexpr (std::is_same_v<Acc, double>) {
    double s = 0.0;
    for_each_expert<kPer>(g, E, [&](int i, int64_t e) { s += exp(static_cast<double>(logit(i, e) - m)); });
    s = group_sum(s, g.width);
    return m + static_cast<float>(log(s));
  } else {
    float s = 0.f;
    for_each_expert<kPer>(g, E, [&](int i, int64_t e) { s += expf(logit(i, e) - m); });
    s = group_sum(s, g.width);
    return m + logf(s);
  }
}

}  // namespace routing
}  // namespace v0
}  // namespace moeblaze
