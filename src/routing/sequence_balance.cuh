// The sequence-wise balance loss's device pieces (routing/router.cpp, sequence_balance_loss),
// shared by its terms (router_loss_cuda.cu) and its gradient (router_backward_cuda.cu): a token's
// sequence, an expert's picks in a sequence from the plan, and those counts in shared memory.
#pragma once

#include <cstddef>
#include <cstdint>

#include "routing/router_cuda.hpp"
#include "routing/token_group.cuh"

namespace moeblaze {
inline namespace v0 {
namespace routing {
namespace router_detail {

// The sequence holding token t: the last q with starts[q] <= t.
__device__ __forceinline__ int64_t sequence_of(const SequenceBalance& sb, int64_t t) {
  int64_t lo = 0, hi = sb.count - 1;
  while (lo < hi) {
    const int64_t mid = (lo + hi + 1) / 2;
    if (sb.starts[mid] <= t) lo = mid;
    else hi = mid - 1;
  }
  return lo;
}

// The first position of expert e's range whose token is >= t (tokens ascend within a range).
__device__ __forceinline__ int64_t first_token_at(const int32_t* tokens, int64_t lo, int64_t hi, int64_t t) {
  while (lo < hi) {
    const int64_t mid = (lo + hi) / 2;
    if (tokens[mid] < t) lo = mid + 1;
    else hi = mid;
  }
  return lo;
}

// n_qe: expert e's picks among tokens [a, b), from the plan by two binary searches. The range
// is clamped to [0, L k], so a saved plan's bytes never send a read out of bounds.
__device__ __forceinline__ int64_t picks_in(const SequenceBalance& sb, int64_t e, int64_t a, int64_t b) {
  const int64_t lo = min(max(static_cast<int64_t>(sb.offsets[e]), int64_t{0}), sb.picks);
  const int64_t hi = min(max(static_cast<int64_t>(sb.offsets[e + 1]), lo), sb.picks);
  return first_token_at(sb.expert_tokens, lo, hi, b) - first_token_at(sb.expert_tokens, lo, hi, a);
}

// A block's tokens mostly lie in one sequence: the picks of the sequence holding the block's
// first token are counted once into shared memory (for E <= kSharedCountsMax), and a token of
// that sequence reads them there instead of searching the plan per expert.
constexpr int64_t kSharedCountsMax = 4096;
struct BlockCounts {
  const int32_t* count = nullptr;  // [E] in shared memory, or null
  int64_t a = -1;                  // the sequence's first token
  __device__ __forceinline__ int64_t picks(const SequenceBalance& sb, int64_t e, int64_t qa, int64_t qb) const {
    return count && qa == a ? count[e] : picks_in(sb, e, qa, qb);
  }
};
// Every thread of the block calls it, before any returns (it synchronises the block).
__device__ __forceinline__ BlockCounts block_counts(const SequenceBalance& sb, int64_t first, int64_t E, int32_t* smem) {
  BlockCounts c;
  if (sb.count == 0 || E > kSharedCountsMax) return c;
  const int64_t q = sequence_of(sb, first), a = sb.starts[q], b = sb.starts[q + 1];
  for (int64_t e = threadIdx.x; e < E; e += blockDim.x) smem[e] = static_cast<int32_t>(picks_in(sb, e, a, b));
  __syncthreads();
  c.count = smem;
  c.a = a;
  return c;
}
inline size_t block_counts_bytes(const SequenceBalance& sb, int64_t E) {
  return sb.count > 0 && E <= kSharedCountsMax ? sizeof(int32_t) * static_cast<size_t>(E) : 0;
}

// T_q, the routed tokens of the sequence [a, b): b - a, or, when a TOKEN_MASK left some tokens
// out (uniform across the block: the plan holds fewer than L k picks), the sequence's picks / k.
// Every lane of the group calls it.
template <int kPer>
__device__ __forceinline__ int64_t sequence_tokens(const SequenceBalance& sb, const BlockCounts& counts,
                                                  const TokenGroup& g, int64_t E, int64_t k, int64_t a, int64_t b,
                                                  bool any_masked) {
  if (!any_masked) return b - a;
  double picks = 0.0;
  for_each_expert<kPer>(g, E, [&](int, int64_t e) { picks += static_cast<double>(counts.picks(sb, e, a, b)); });
  return static_cast<int64_t>(group_sum(picks, g.width)) / k;
}

// Whether a TOKEN_MASK left tokens out of this call's plan (`routed`: routed_tokens of it).
__device__ __forceinline__ bool plan_has_masked(int64_t routed, int64_t L) { return routed < L; }

}  // namespace router_detail
}  // namespace routing
}  // namespace v0
}  // namespace moeblaze
