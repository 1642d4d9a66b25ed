// Router kernels: scores, top-k, gates, aux/z-loss, router backward, caller-routing import.
// One group of lanes per token (routing/token_group.cuh); reductions use a fixed lane order and
// fixed token chunks, so results are bitwise reproducible.
#include <cuda_bf16.h>

#include <cmath>
#include <type_traits>

#include "cuda/chained_launch.cuh"
#include "cuda/cuda_check.hpp"
#include "routing/plan_check_cuda.hpp"
#include "routing/router_cuda.hpp"
#include "routing/score_order.hpp"
#include "routing/selection.hpp"
#include "routing/token_group.cuh"
#include "util/align.hpp"
#include "util/dtype.hpp"

namespace moeblaze {
inline namespace v0 {
namespace routing {
namespace {

constexpr int kWarpsPerBlock = 8;

__device__ __forceinline__ bool masked(const TokenMask& m, int64_t t) {
  if (!m.data) return false;
  return m.i64 ? static_cast<const int64_t*>(m.data)[t * m.stride] == 0
               : static_cast<const int32_t*>(m.data)[t * m.stride] == 0;
}

__device__ __forceinline__ float score(ScoreFn fn, float l, float lse) {
  return fn == ScoreFn::kSoftmax ? expf(l - lse) : 1.f / (1.f + expf(-l));
}

__global__ void logits_to_f32_kernel(const char* src, DType t, int64_t stride, int64_t L, int64_t E, float* out) {
  cuda::wait_for_prior_grids();
  cuda::allow_next_grid();
  int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (i >= L * E) return;
  int64_t row = i / E, col = i % E;
  out[i] = load_f32(src + row * stride * static_cast<int64_t>(dtype_size(t)), t, col);
}

// The selection values of the routing options (routing/selection.hpp): each lane's experts'
// selection scores, plus the bias when there is one. The same bits as the CPU engine's.
template <int kPer, class Logit>
__device__ __forceinline__ auto selection_values(const TokenGroup& g, ScoreFn fn, const float* bias, int64_t E,
                                                 const Logit& logit) {
  float m = -INFINITY;
  double S = 0.0;
  if (fn == ScoreFn::kSoftmax) {
    for_each_expert<kPer>(g, E, [&](int i, int64_t e) { m = max_skipping_nan(m, logit(i, e)); });
    m = group_max(m, g.width);
    for_each_expert<kPer>(g, E, [&](int i, int64_t e) { S += static_cast<double>(exp_portable(logit(i, e) - m)); });
    S = group_sum(S, g.width);
  }
  return lane_values<kPer>(g, E, [=](int i, int64_t e) {
    const float v = fn == ScoreFn::kSoftmax ? softmax_selection(exp_portable(logit(i, e) - m), S)
                                            : sigmoid_selection(logit(i, e));
    return bias ? v + bias[e] : v;
  });
}

// Group-limited routing's cut (routing/router.cpp, group_cut): each group's score, the sum of
// its two best values, goes to smem as a rank key (key[q] for group q); returns the key of the
// worst open group, so expert e is open when key[e / size] >= the returned key. The top two of
// a group come from an xor butterfly over rank keys (a strict order, so every lane agrees); the
// cut from the same sorted-candidate pops as the top-k, over at most kGroupSlots groups per lane.
template <int kPer, class Value>
__device__ __forceinline__ uint64_t group_cut(const TokenGroup& g, int64_t E, int64_t groups, int64_t keep,
                                              const Value& value, uint64_t* key) {
  const int64_t size = E / groups;
  int lane_group[kPer > 0 ? kPer : 1];  // 32-bit division, once per expert (E <= 65536)
  for_each_expert<kPer>(g, E, [&](int i, int64_t e) { lane_group[i] = static_cast<int>(e) / static_cast<int>(size); });
  for (int64_t q = 0; q < groups; ++q) {
    uint64_t k1 = 0, k2 = 0;
    auto offer = [&](uint64_t c) {
      if (c > k1) {
        k2 = k1;
        k1 = c;
      } else if (c > k2) {
        k2 = c;
      }
    };
    if constexpr (kPer > 0) {
      for_each_expert<kPer>(g, E, [&](int i, int64_t e) {
        if (lane_group[i] == q) offer(rank_key(value(i, e), e));
      });
    } else {  // only this lane's experts of group q: e = sub (mod width) in [q size, (q + 1) size)
      const int64_t first = q * size + ((g.sub - q * size) % g.width + g.width) % g.width;
      for (int64_t e = first; e < (q + 1) * size; e += g.width) offer(rank_key(value(0, e), e));
    }
#pragma unroll
    for (int o = g.width / 2; o > 0; o >>= 1) {
      const uint64_t o1 = __shfl_xor_sync(0xffffffffu, k1, o), o2 = __shfl_xor_sync(0xffffffffu, k2, o);
      const uint64_t n2 = k1 > o1 ? (k2 > o1 ? k2 : o1) : (k1 > o2 ? k1 : o2);
      k1 = k1 > o1 ? k1 : o1;
      k2 = n2;
    }
    const float sum = size >= 2 ? rank_key_value(k1) + rank_key_value(k2) : rank_key_value(k1);
    if (g.sub == 0) key[q] = rank_key(sum, q);
  }
  __syncwarp();
  SortedCandidates<kGroupSlots> cand;
#pragma unroll
  for (int i = 0; i < kGroupSlots; ++i) {
    const int64_t q = g.sub + static_cast<int64_t>(i) * g.width;
    cand.key[i] = q < groups ? key[q] : 0;
  }
  cand.sort();
  uint64_t cut = 0;
  for (int64_t j = 0; j < keep; ++j) cut = cand.pop_key(g.width);
  return cut;
}

// The token's top k among the allowed experts under rank(i, e) (a strict order with the ids),
// and their gates: the scores, normalised when asked and times the route scale; writes ids,
// gates and lse_out[t] (routing/router.cpp, route_tokens).
template <int kPer, class Rank, class Allowed>
__device__ __forceinline__ void pick_top_k(const TokenGroup& g, ScoreFn fn, int64_t E, int64_t k, const float* row,
                                           float lse, const Rank& rank, const Allowed& allowed, int64_t t,
                                           int32_t* ids, float* gates, bool normalize, float scale, bool empty,
                                           float* lse_out) {
  // Pick j is kept by lane j % width of the group (k <= 64 and k <= E, so at most two picks per
  // lane), which computes its score from the row once the picks are known; the group writes its
  // k ids and gates at the end as k consecutive stores.
  int kept_id[2] = {-1, -1};
  auto emit = [&](int j, int best_i) {
    if ((j & (g.width - 1)) == g.sub) {  // constant indices: the two slots stay in registers
      if (j < g.width) kept_id[0] = best_i;
      else kept_id[1] = best_i;
    }
  };
  if constexpr (kPer > 0) {
    SortedCandidates<kPer> cand;
#pragma unroll
    for (int i = 0; i < kPer; ++i) {
      const int64_t e = g.sub + static_cast<int64_t>(i) * g.width;
      cand.key[i] = e < E && allowed(e) ? rank_key(rank(i, e), e) : 0;
    }
    cand.sort();
    for (int j = 0; j < static_cast<int>(k); ++j) emit(j, rank_key_id(cand.pop_key(g.width)));
  } else {
    float prev = 0.f;  // the previous pick's rank value
    int prev_i = -1;
    for (int j = 0; j < static_cast<int>(k); ++j) {
      float best = 0.f;
      int best_i = -1;
      for_each_expert<kPer>(g, E, [&](int i, int64_t e) {
        if (!allowed(e)) return;
        const float r = rank(i, e);
        if (j > 0 && !ranks_before(prev, prev_i, r, e)) return;
        if (ranks_before(r, e, best, best_i)) {
          best = r;
          best_i = static_cast<int>(e);
        }
      });
      group_best(best, best_i, g.width);
      emit(j, best_i);
      prev = best;
      prev_i = best_i;
    }
  }
  // The picks' scores, the CPU engine's bits (score of the row's logit); the norm sums them in
  // pick order, as the CPU engine does.
  float kept_gate[2];
#pragma unroll
  for (int second = 0; second < 2; ++second) {
    const int id = kept_id[second];
    kept_gate[second] = g.live && id >= 0 ? score(fn, row[id], lse) : 0.f;
  }
  float norm = 0.f;
  if (normalize) {
    const int base = (threadIdx.x % 32) & ~(g.width - 1);  // the group's first lane
    for (int j = 0; j < static_cast<int>(k); ++j)
      norm += __shfl_sync(0xffffffffu, j < g.width ? kept_gate[0] : kept_gate[1], base + (j & (g.width - 1)));
  }
  if (!g.live) return;
#pragma unroll
  for (int second = 0; second < 2; ++second) {
    const int j = g.sub + second * g.width;
    if (j < k) {  // an empty (masked) token: id -1, gate 0
      ids[t * k + j] = empty ? -1 : kept_id[second];
      gates[t * k + j] = empty ? 0.f : (normalize ? kept_gate[second] / norm : kept_gate[second]) * scale;
    }
  }
  if (g.sub == 0) lse_out[t] = lse;
}

// One token per group of lanes (routing/token_group.cuh). Pick j is the group's best expert
// (by rank_value: the logit, or a NaN score) among those ranked after pick j - 1 (the CPU
// engine's top_k): no taken-list, no shared memory,
// and every lane of the group agrees on each pick. With the logits in registers (kPer > 0) each
// lane sorts its experts' rank keys once and a pick is one integer maximum over the group
// (SortedCandidates: the same order as ranks_before; measured in perf/NOTES.md); only the k
// picks' scores are computed. kOptions: an expert bias (experts ranked by biased selection
// values) or a group limit (experts of closed groups never picked).
template <int kPer, int kWidth, bool kOptions>
__global__ void route_tokens_kernel(ScoreFn fn, bool normalize, RouteOptions opt, const float* logits, int64_t L,
                                    int64_t E, int64_t k, int width, int32_t* ids, float* gates, float* lse_out) {
  cuda::wait_for_prior_grids();
  cuda::allow_next_grid();
  extern __shared__ uint64_t route_group_keys[];  // a group limit: [tokens per block][groups]
  const TokenGroup g = token_group<kWidth>(L, width, kWarpsPerBlock);
  if (!__any_sync(0xffffffffu, g.live)) return;  // the whole warp past the last token
  const float* row = logits + (g.live ? g.token : 0) * E;  // a dead group's lanes read nothing
  const auto logit = lane_values<kPer>(g, E, [=](int, int64_t e) { return g.live ? row[e] : 0.f; });
  const float lse = group_lse<kPer>(g, E, logit);
  const int64_t t = g.token;
  const bool empty = g.live && masked(opt.mask, t);
  // Without options the value ranked is rank_value (the logit, or the score where that is NaN),
  // known without the scores (routing/score_order.hpp); with a bias, the biased selection value;
  // closed groups' experts are left out.
  const bool softmax = fn == ScoreFn::kSoftmax;
  auto rank_of = [&](int i, int64_t e) { return rank_value_of_logit(softmax, logit(i, e), lse); };
  auto open = [](int64_t) { return true; };
  if constexpr (kOptions) {
    const auto value = selection_values<kPer>(g, fn, opt.bias, E, logit);
    uint64_t cut = 0;
    const bool limited = opt.keep > 0 && opt.keep < opt.groups;
    uint64_t* key = route_group_keys + (threadIdx.x / g.width) * (limited ? opt.groups : 0);
    if (limited) cut = group_cut<kPer>(g, E, opt.groups, opt.keep, value, key);
    const int size = static_cast<int>(E / opt.groups);
    auto open_group = [=](int64_t e) { return !limited || key[static_cast<int>(e) / size] >= cut; };
    auto biased = [&](int i, int64_t e) { return opt.bias ? value(i, e) : rank_of(i, e); };
    pick_top_k<kPer>(g, fn, E, k, row, lse, biased, open_group, t, ids, gates, normalize, opt.scale, empty, lse_out);
  } else {
    pick_top_k<kPer>(g, fn, E, k, row, lse, rank_of, open, t, ids, gates, normalize, opt.scale, empty, lse_out);
  }
}

// partial[c * E + e] = sum of scores of expert e over token chunk c; partial_lse[c] = sum lse^2;
// a masked token (ids[t k] = -1) adds nothing.
// A block is kLossExperts experts x kLossRows token rows: row r sums the chunk's tokens r,
// r + kLossRows, ..., and the rows' sums are added in row order (fixed: deterministic). Warp 0
// sums lse^2 over the chunk the same way, lane by lane, then by a fixed butterfly. A block per
// chunk and 32 experts: ceil(E / 32) blocks per chunk to spread over the SMs.
constexpr int kLossExperts = 32, kLossRows = 16;
__global__ void loss_partials_kernel(ScoreFn fn, const float* logits, const float* lse, const int32_t* ids, int64_t L,
                                     int64_t E, int64_t k, float* partial, float* partial_lse) {
  cuda::wait_for_prior_grids();
  cuda::allow_next_grid();
  __shared__ float rows[kLossRows][kLossExperts];
  const int64_t c = blockIdx.x;
  const int64_t t0 = c * kLossChunkCuda, t1 = min(L, t0 + kLossChunkCuda);
  const int tx = threadIdx.x % kLossExperts, ty = threadIdx.x / kLossExperts;
  for (int64_t e0 = blockIdx.y * static_cast<int64_t>(kLossExperts); e0 < E; e0 += gridDim.y * static_cast<int64_t>(kLossExperts)) {
    const int64_t e = e0 + tx;
    float s = 0.f;
    if (e < E)
      for (int64_t t = t0 + ty; t < t1; t += kLossRows)
        if (ids[t * k] >= 0) s += score(fn, logits[t * E + e], lse[t]);  // a masked token counts for nothing
    rows[ty][tx] = s;
    __syncthreads();
    if (ty == 0 && e < E) {
      float sum = 0.f;
#pragma unroll
      for (int r = 0; r < kLossRows; ++r) sum += rows[r][tx];
      partial[c * E + e] = sum;
    }
    __syncthreads();
  }
  if (blockIdx.y == 0 && threadIdx.x < 32) {
    float z = 0.f;
    for (int64_t t = t0 + threadIdx.x; t < t1; t += 32) z += ids[t * k] >= 0 ? lse[t] * lse[t] : 0.f;
    for (int o = 16; o > 0; o >>= 1) z += __shfl_xor_sync(0xffffffffu, z, o);
    if (threadIdx.x == 0) partial_lse[c] = z;
  }
}

// The losses from the partials, all in fixed orders: thread (x, y) of kFinishExperts x
// kFinishSlices sums experts x, x + kFinishExperts, ... over the chunks c = y (mod
// kFinishSlices), each weighted by its expert's pick fraction; thread i sums partial_lse over
// c = i (mod threads); then one tree for each.
constexpr int kFinishExperts = 128, kFinishSlices = 8, kFinishThreads = kFinishExperts * kFinishSlices;
__global__ void loss_finish_kernel(double aux_coeff, double z_coeff, int64_t L, int64_t E, int64_t k, int64_t chunks,
                                   const float* partial, const float* partial_lse, const int32_t* offsets, float* aux_out,
                                   float* z_out) {
  cuda::wait_for_prior_grids();
  cuda::allow_next_grid();
  __shared__ double red_aux[kFinishThreads], red_z[kFinishThreads];
  // The routed tokens: all L, or those a TOKEN_MASK left (their k picks fill the plan's
  // positions [0, offsets[E])).
  L = routed_tokens(offsets, L, E, k);
  const int x = static_cast<int>(threadIdx.x % kFinishExperts), y = static_cast<int>(threadIdx.x / kFinishExperts);
  double acc = 0.0;
  for (int64_t e = x; e < E; e += kFinishExperts) {
    double p = 0.0;
    for (int64_t c = y; c < chunks; c += kFinishSlices) p += partial[c * E + e];
    const double f = static_cast<double>(offsets[e + 1] - offsets[e]) / static_cast<double>(L * k);
    acc += f * (p / static_cast<double>(L));
  }
  double z = 0.0;
  for (int64_t c = threadIdx.x; c < chunks; c += kFinishThreads) z += partial_lse[c];
  red_aux[threadIdx.x] = acc;
  red_z[threadIdx.x] = z;
  __syncthreads();
  for (int s = kFinishThreads / 2; s > 0; s >>= 1) {
    if (threadIdx.x < s) {
      red_aux[threadIdx.x] += red_aux[threadIdx.x + s];
      red_z[threadIdx.x] += red_z[threadIdx.x + s];
    }
    __syncthreads();
  }
  if (threadIdx.x == 0) {
    if (aux_out) *aux_out = L > 0 ? static_cast<float>(aux_coeff * static_cast<double>(E) * red_aux[0]) : 0.f;
    if (z_out) *z_out = L > 0 ? static_cast<float>(z_coeff * red_z[0] / static_cast<double>(L)) : 0.f;
  }
}

// ---- the sequence-wise balance loss (routing/router.cpp, sequence_balance_loss) ----

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
size_t block_counts_bytes(const SequenceBalance& sb, int64_t E) {
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

// *sb.routed: the sequences with a routed token. One block; a warp per sequence, its lanes
// reading 32 tokens' first ids at a time until one is routed (at once without a mask).
constexpr int kRoutedThreads = 1024;
__global__ void routed_sequences_kernel(SequenceBalance sb, int64_t L, int64_t k) {
  cuda::wait_for_prior_grids();
  cuda::allow_next_grid();
  __shared__ int64_t per_warp[kRoutedThreads / 32];
  const int warp = static_cast<int>(threadIdx.x / 32), lane = static_cast<int>(threadIdx.x % 32);
  int64_t n = 0;
  for (int64_t q = warp; q < sb.count; q += kRoutedThreads / 32) {
    // starts from flagged lengths may pass L: clamped, so no id outside the plan is read
    const int64_t a = min(max(sb.starts[q], int64_t{0}), L), b = min(max(sb.starts[q + 1], a), L);
    bool found = false;
    for (int64_t t0 = a; t0 < b && !found; t0 += 32) {
      const int64_t t = t0 + lane;
      found = __any_sync(0xffffffffu, t < b && sb.token_ids[t * k] >= 0);
    }
    n += found ? 1 : 0;
  }
  if (lane == 0) per_warp[warp] = n;
  __syncthreads();
  if (threadIdx.x == 0) {
    int64_t total = 0;
    for (int w = 0; w < kRoutedThreads / 32; ++w) total += per_warp[w];
    *sb.routed = total;
  }
}

// starts[0..B] from the lengths: one block, a chunk of lengths per thread, then a block scan of
// the chunk sums. A length outside [1, L] (clamped there, so starts stay increasing) or a sum
// other than L sets kSequenceLengthsInvalid.
constexpr int kStartsThreads = 1024;
__global__ void sequence_starts_kernel(const char* len, bool i64, int64_t stride, int64_t B, int64_t L, int64_t* starts,
                                       int32_t* flag) {
  cuda::wait_for_prior_grids();
  cuda::allow_next_grid();
  __shared__ int64_t scan[kStartsThreads];
  const int64_t per = (B + kStartsThreads - 1) / kStartsThreads;
  const int64_t q0 = min(B, threadIdx.x * per), q1 = min(B, q0 + per);
  auto length = [&](int64_t q) {
    return i64 ? reinterpret_cast<const int64_t*>(len)[q * stride] : reinterpret_cast<const int32_t*>(len)[q * stride];
  };
  bool bad = false;
  int64_t sum = 0;
  for (int64_t q = q0; q < q1; ++q) {
    const int64_t v = length(q);
    bad |= v < 1 || v > L;
    sum += min(max(v, int64_t{1}), max(L, int64_t{1}));
  }
  scan[threadIdx.x] = sum;
  __syncthreads();
  for (int o = 1; o < kStartsThreads; o *= 2) {
    const int64_t add = threadIdx.x >= o ? scan[threadIdx.x - o] : 0;
    __syncthreads();
    scan[threadIdx.x] += add;
    __syncthreads();
  }
  int64_t at = scan[threadIdx.x] - sum;
  for (int64_t q = q0; q < q1; ++q) {
    starts[q] = at;
    at += min(max(length(q), int64_t{1}), max(L, int64_t{1}));
  }
  if (threadIdx.x == kStartsThreads - 1) {
    starts[B] = scan[threadIdx.x];
    bad |= scan[threadIdx.x] != L;
  }
  if (__syncthreads_or(bad) && threadIdx.x == 0) atomicOr(flag, kSequenceLengthsInvalid);
}

// terms[t] = E / (k T_q^2) sum_e n_qe s'_te for routed token t of sequence q (s' = s, or s / S_t
// for sigmoid; 0 for a masked token), one token per group of lanes; the loss is coeff / B times
// their sum.
template <int kPer, int kWidth>
__global__ void sequence_terms_kernel(ScoreFn fn, const float* logits, const float* lse, int64_t L, int64_t E,
                                      int64_t k, int width, SequenceBalance sb, double* terms) {
  cuda::wait_for_prior_grids();
  cuda::allow_next_grid();
  extern __shared__ int32_t terms_counts[];
  const BlockCounts counts =
      block_counts(sb, static_cast<int64_t>(blockIdx.x) * kWarpsPerBlock * (32 / width), E, terms_counts);
  const TokenGroup g = token_group<kWidth>(L, width, kWarpsPerBlock);
  if (!__any_sync(0xffffffffu, g.live)) return;
  const int64_t t = g.live ? g.token : 0;
  const float* row = logits + t * E;
  const float lt = lse[t];
  const auto score_of = lane_values<kPer>(g, E, [=](int, int64_t e) { return score(fn, row[e], lt); });
  double S = 0.0;
  if (fn == ScoreFn::kSigmoid) {
    for_each_expert<kPer>(g, E, [&](int i, int64_t e) { S += static_cast<double>(score_of(i, e)); });
    S = group_sum(S, g.width);
  }
  const float Sf = static_cast<float>(S);
  const int64_t q = sequence_of(sb, t), a = sb.starts[q], b = sb.starts[q + 1];
  double acc = 0.0;
  for_each_expert<kPer>(g, E, [&](int i, int64_t e) {
    const float s = fn == ScoreFn::kSigmoid ? score_of(i, e) / Sf : score_of(i, e);
    acc += static_cast<double>(counts.picks(sb, e, a, b)) * static_cast<double>(s);
  });
  acc = group_sum(acc, g.width);
  const bool any_masked = plan_has_masked(routed_tokens(sb.offsets, L, E, k), L);
  const double T = static_cast<double>(sequence_tokens<kPer>(sb, counts, g, E, k, a, b, any_masked));
  const bool masked = sb.token_ids[t * k] < 0;
  if (g.live && g.sub == 0)
    terms[t] = masked || T <= 0.0 ? 0.0 : acc * static_cast<double>(E) / (static_cast<double>(k) * T * T);
}

// *aux_out = coeff / B * sum_t terms[t] (B: the sequences with a routed token), summed in a
// fixed order (a strided pass per thread, then a tree); NaN when the lengths were flagged.
constexpr int kTermThreads = 1024;
__global__ void sequence_loss_finish_kernel(double coeff, const int64_t* routed, int64_t L, const double* terms,
                                            const int32_t* flag, float* aux_out) {
  cuda::wait_for_prior_grids();
  cuda::allow_next_grid();
  const int64_t B = *routed;
  __shared__ double red[kTermThreads];
  double acc = 0.0;
  for (int64_t t = threadIdx.x; t < L; t += kTermThreads) acc += terms[t];
  red[threadIdx.x] = acc;
  __syncthreads();
  for (int o = kTermThreads / 2; o > 0; o >>= 1) {
    if (threadIdx.x < o) red[threadIdx.x] += red[threadIdx.x + o];
    __syncthreads();
  }
  if (threadIdx.x == 0)
    *aux_out = (*flag & kSequenceLengthsInvalid) ? NAN
               : B > 0                              ? static_cast<float>(coeff * red[0] / static_cast<double>(B))
                                                    : 0.f;
}

// One token per group of lanes (routing/token_group.cuh). Pick j is loaded by lane j % width,
// which passes its gradient on to the pick's expert through the token's ds row in shared
// memory (E <= 32 * kMaxExpertsPerLane; larger E scans the picks per expert). Up to four experts
// per lane, four blocks per SM (at most 64 registers, no spills): the kernel is bound by issue.
template <int kPer, int kWidth>
__global__ void __launch_bounds__(32 * kWarpsPerBlock, kPer > 4 ? 1 : 4)
    router_backward_kernel(ScoreFn fn, bool normalize, float aux_coeff, float z_coeff, float scale, const float* logits,
                           int64_t rows, int64_t L, int64_t E, int64_t k, int width, const int32_t* ids,
                           const float* dgates, const float* grad_aux, const float* grad_z, const int32_t* offsets,
                           SequenceBalance sb, float* dlogits, __nv_bfloat16* dlogits_pair) {
  cuda::wait_for_prior_grids();
  cuda::allow_next_grid();
  // [tokens per block][k] ids, then [tokens per block][k] values, then (kPer > 0) the tokens'
  // [E] ds rows, then BlockCounts' [E]
  extern __shared__ float picks_smem[];
  const TokenGroup g = token_group<kWidth>(rows, width, kWarpsPerBlock);
  const int tokens_per_block = kWarpsPerBlock * (32 / g.width);
  const int64_t ds_floats = kPer > 0 ? tokens_per_block * E : 0;
  const BlockCounts counts = block_counts(sb, sb.t0 + static_cast<int64_t>(blockIdx.x) * tokens_per_block, E,
                                          reinterpret_cast<int32_t*>(picks_smem + 2 * tokens_per_block * k + ds_floats));
  if (!__any_sync(0xffffffffu, g.live)) return;
  const int64_t t = g.token;
  const int slot = static_cast<int>(threadIdx.x / g.width);  // the group's token within the block
  int* sel = reinterpret_cast<int*>(picks_smem) + slot * k;
  float* dsel = picks_smem + tokens_per_block * k + slot * k;
  float* ds_row = picks_smem + 2 * tokens_per_block * k + slot * E;  // kPer > 0 only
  // Pick j is held by lane j % width. Its id (from a saved plan; one out of [0, E), flagged on the
  // device by the fused engine's plan check, is clamped so that nothing is read outside the
  // logits row) and d gate are loaded before the logits, so that the two loads' latencies overlap.
  int pick_id[2] = {0, 0};
  float pick_dg[2] = {0.f, 0.f};
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    const int64_t j = g.sub + half * g.width;
    if (g.live && j < k) {
      pick_id[half] = min(max(ids[t * k + j], 0), static_cast<int32_t>(E - 1));
      pick_dg[half] = dgates[t * k + j] * scale;
    }
  }
  const bool empty = g.live && ids[t * k] < 0;
  const float* row = logits + (g.live ? g.token : 0) * E;  // a dead group's lanes read nothing
  const auto logit = lane_values<kPer>(g, E, [=](int, int64_t e) { return g.live ? row[e] : 0.f; });
  // Gradients need no bit-identical scores: the log-sum-exp in fp32 (the forward's picks and
  // gates use fp64, routing/router.cpp)
  const float lse = group_lse<kPer, float>(g, E, logit);
  const auto score_of = lane_values<kPer>(g, E, [=](int i, int64_t e) { return score(fn, logit(i, e), lse); });
  const float gaux = grad_aux ? *grad_aux : 1.f, gz = grad_z ? *grad_z : 1.f;
  // The losses are means over the routed tokens; a masked token (its ids -1) gets zero d logits.
  const int64_t routed = routed_tokens(offsets, L, E, k);
  const bool any_masked = plan_has_masked(routed, L);
  L = max(routed, int64_t{1});
  const float aux_scale = aux_coeff * gaux * static_cast<float>(E) / (static_cast<float>(L) * static_cast<float>(L * k));
  const float z_scale = z_coeff * gz * 2.f / static_cast<float>(L);
  // The gates are scale * (renormalised) scores: the lane of pick j turns its d gate into a d
  // score; the norm and <d gate, gate> are group sums.
  float pick_s[2] = {0.f, 0.f};
  float norm = 0.f;
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    const int64_t j = g.sub + half * g.width;
    if (g.live && j < k) {
      sel[j] = pick_id[half];
      pick_s[half] = score(fn, row[pick_id[half]], lse);
      norm += pick_s[half];
    }
  }
  norm = group_sum(norm, g.width);
  float dot_g = 0.f;
#pragma unroll
  for (int half = 0; half < 2; ++half) dot_g += pick_dg[half] * (pick_s[half] / norm);
  dot_g = group_sum(dot_g, g.width);
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    const int64_t j = g.sub + half * g.width;
    if (g.live && j < k) dsel[j] = normalize ? (pick_dg[half] - dot_g) / norm : pick_dg[half];
  }
  // The sequence-wise balance loss (sb.count > 0) in place of the batch-wise one: d aux / d s_te
  // = c n_qe for token t of sequence q, through s' = s / S_t for sigmoid (routing/router.cpp,
  // sequence_balance_backward).
  const bool by_sequence = sb.count > 0 && aux_coeff > 0.f;
  double seq_c = 0.0, seq_S = 1.0, seq_dot = 0.0;
  int64_t qa = 0, qb = 0;
  if (by_sequence) {
    const int64_t q = sequence_of(sb, sb.t0 + t);
    qa = sb.starts[q];
    qb = sb.starts[q + 1];
    const double T = static_cast<double>(sequence_tokens<kPer>(sb, counts, g, E, k, qa, qb, any_masked));
    const double B = static_cast<double>(*sb.routed);
    seq_c = T > 0.0 && B > 0.0
                ? static_cast<double>(aux_coeff) * gaux * static_cast<double>(E) / (B * static_cast<double>(k) * T * T)
                : 0.0;
    if (fn == ScoreFn::kSigmoid) {
      double S = 0.0;
      for_each_expert<kPer>(g, E, [&](int i, int64_t e) { S += static_cast<double>(score_of(i, e)); });
      seq_S = group_sum(S, g.width);
      for_each_expert<kPer>(g, E, [&](int i, int64_t e) {
        seq_dot += static_cast<double>(counts.picks(sb, e, qa, qb)) * (score_of(i, e) / seq_S);
      });
      seq_dot = group_sum(seq_dot, g.width);
    }
  }
  auto seq_ds = [&](int64_t e) {
    const double n = static_cast<double>(counts.picks(sb, e, qa, qb));
    return static_cast<float>(fn == ScoreFn::kSoftmax ? seq_c * n : seq_c * (n - seq_dot) / seq_S);
  };
  // ds_e = the loss term + the pick's d score when e was picked.
  auto loss_ds = [&](int64_t e) {
    return by_sequence        ? seq_ds(e)
           : aux_coeff > 0.f ? aux_scale * static_cast<float>(offsets[e + 1] - offsets[e])
                             : 0.f;
  };
  auto scanned_ds = [&](int64_t e) {  // E > 32 * kMaxExpertsPerLane: the picks scanned per expert
    if (!g.live) return 0.f;  // a dead group's picks were never loaded
    float ds = loss_ds(e);
    for (int64_t j = 0; j < k; ++j) ds += sel[j] == e ? dsel[j] : 0.f;
    return ds;
  };
  if constexpr (kPer > 0) {  // the loss terms into the token's ds row, then each pick's lane adds its d score
    for_each_expert<kPer>(g, E, [&](int, int64_t e) { ds_row[e] = g.live ? loss_ds(e) : 0.f; });
    __syncwarp();
    // A routed token's picks are distinct experts, so each entry takes at most one add (the same
    // bits as a plain add). Only a plan that breaks the rules repeats one (its outputs are
    // poisoned); the adds are shared atomics so that its lanes never race on an entry.
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const int64_t j = g.sub + half * g.width;
      if (g.live && !empty && j < k) atomicAdd(&ds_row[sel[j]], dsel[j]);
    }
  }
  __syncwarp();
  const auto ds_at = lane_values<kPer>(g, E, [&](int, int64_t e) { return kPer > 0 ? ds_row[e] : scanned_ds(e); });
  double dot = 0.0;
  float shift = 0.f;
  // Softmax: dl = s (ds' - <s, ds'>) with ds shifted by its value at the top score
  // (shift-invariant, and no fp32 cancellation when that score is near 1); the top score is
  // found under the ranking rule of routing/score_order.hpp.
  if (fn == ScoreFn::kSoftmax) {
    uint64_t best = 0;  // the largest rank key (routing/score_order.hpp): the same order as ranks_before
    for_each_expert<kPer>(g, E, [&](int i, int64_t e) {
      const uint64_t key = rank_key(score_of(i, e), e);
      best = key > best ? key : best;
    });
    const int best_i = rank_key_id(group_max_key(best, g.width));
    if constexpr (kPer > 0) shift = g.live ? ds_row[best_i] : 0.f;
    else shift = scanned_ds(best_i);
    for_each_expert<kPer>(g, E, [&](int i, int64_t e) {
      dot += static_cast<double>((ds_at(i, e) - shift) * score_of(i, e));
    });
    dot = group_sum(dot, g.width);
  }
  if (!g.live) return;
  for_each_expert<kPer>(g, E, [&](int i, int64_t e) {
    const float l = logit(i, e), ds = ds_at(i, e), s = score_of(i, e);
    float dl = fn == ScoreFn::kSoftmax ? s * ((ds - shift) - static_cast<float>(dot)) : ds * s * (1.f / (1.f + expf(l)));
    if (z_coeff > 0.f) dl += z_scale * lse * expf(l - lse);
    if (empty) dl = 0.f;
    if (dlogits) dlogits[t * E + e] = dl;
    if (dlogits_pair) {  // [hi | lo] per row (routing/router_cuda.hpp)
      const __nv_bfloat16 hi = __float2bfloat16_rn(dl);
      dlogits_pair[t * 2 * E + e] = hi;
      dlogits_pair[t * 2 * E + E + e] = __float2bfloat16_rn(dl - __bfloat162float(hi));
    }
  });
}

__global__ void import_routing_kernel(const char* ids, bool i64, int64_t id_stride, const char* w, DType wt,
                                      int64_t w_stride, int64_t L, int64_t k, int64_t E, bool empty_slots,
                                      TokenMask mask, int32_t* out_ids, float* out_gates, int32_t* error_flag) {
  cuda::wait_for_prior_grids();
  cuda::allow_next_grid();
  const int64_t t = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (t >= L) return;
  if (masked(mask, t)) {  // a masked token: k empty slots, whatever the caller's ids and gates
    for (int64_t j = 0; j < k; ++j) {
      out_ids[t * k + j] = -1;
      out_gates[t * k + j] = 0.f;
    }
    return;
  }
  bool bad = false;
  for (int64_t j = 0; j < k; ++j) {
    const int64_t id = i64 ? reinterpret_cast<const int64_t*>(ids)[t * id_stride + j]
                           : reinterpret_cast<const int32_t*>(ids)[t * id_stride + j];
    if (empty_slots && id == -1) {  // an empty slot: no expert, and a zero gate whatever was given
      out_ids[t * k + j] = -1;
      out_gates[t * k + j] = 0.f;
      continue;
    }
    bool ok = id >= 0 && id < E;
    for (int64_t q = 0; q < j && ok; ++q) ok = out_ids[t * k + q] != id;
    bad |= !ok;
    // A bad id is replaced by an unused valid one, so the plan kernels stay in bounds.
    int64_t safe = id;
    if (!ok) {
      for (safe = 0; safe < E; ++safe) {
        bool used = false;
        for (int64_t q = 0; q < j; ++q) used |= out_ids[t * k + q] == safe;
        if (!used) break;
      }
    }
    out_ids[t * k + j] = static_cast<int32_t>(safe);
    out_gates[t * k + j] = load_f32(w + t * w_stride * static_cast<int64_t>(dtype_size(wt)), wt, j);
  }
  if (bad) atomicOr(error_flag, kCallerIdsInvalid);
}

__global__ void write_topk_kernel(const int32_t* ids, const float* gates, int64_t L, int64_t k, char* ids_out, bool i64,
                                  int64_t id_stride, char* w_out, DType wt, int64_t w_stride) {
  cuda::wait_for_prior_grids();
  cuda::allow_next_grid();
  const int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (i >= L * k) return;
  const int64_t t = i / k, j = i % k;
  if (ids_out) {
    if (i64) reinterpret_cast<int64_t*>(ids_out)[t * id_stride + j] = ids[i];
    else reinterpret_cast<int32_t*>(ids_out)[t * id_stride + j] = ids[i];
  }
  if (w_out) store_f32(w_out + t * w_stride * static_cast<int64_t>(dtype_size(wt)), wt, j, gates[i]);
}

__global__ void tokens_per_expert_kernel(const int32_t* offsets, int64_t E, char* out, bool i64, int64_t stride) {
  cuda::wait_for_prior_grids();
  cuda::allow_next_grid();
  const int64_t e = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (e >= E) return;
  const int32_t n = offsets[e + 1] - offsets[e];
  if (i64) reinterpret_cast<int64_t*>(out)[e * stride] = n;
  else reinterpret_cast<int32_t*>(out)[e * stride] = n;
}

unsigned blocks_for(int64_t n, int threads) { return static_cast<unsigned>(ceil_div(n, threads)); }

// f(per, width) as integral constants for E experts (token_group.cuh): the experts cached per
// lane, and the lanes per token when it is a whole warp (32), else 0 (known at run time; only
// one expert per lane has fewer than 32 lanes).
template <class F>
void with_group_shape(int64_t E, F&& f) {
  using std::integral_constant;
  const int width = token_group_width(E);
  switch (experts_per_lane(E, width)) {
    case 1:
      if (width == 32) f(integral_constant<int, 1>{}, integral_constant<int, 32>{});
      else f(integral_constant<int, 1>{}, integral_constant<int, 0>{});
      break;
    case 2: f(integral_constant<int, 2>{}, integral_constant<int, 32>{}); break;
    case 4: f(integral_constant<int, 4>{}, integral_constant<int, 32>{}); break;
    case 8: f(integral_constant<int, 8>{}, integral_constant<int, 32>{}); break;
    default: f(integral_constant<int, 0>{}, integral_constant<int, 32>{}); break;
  }
}

}  // namespace

void logits_to_f32_cuda(const View& v, int64_t L, int64_t E, float* out, cudaStream_t s) {
  if (L * E == 0) return;
  cuda::launch_chained(logits_to_f32_kernel, blocks_for(L * E, 256), 256, 0, s, v.data, v.dtype, v.stride[0], L, E,
                       out);
  MOEBLAZE_CUDA_LAUNCH_CHECK("logits_to_f32");
}

void route_tokens_cuda(const LayerConfig& cfg, const float* logits, int64_t L, const float* bias, const TokenMask& mask,
                       int32_t* ids, float* gates, float* lse, cudaStream_t s) {
  if (L == 0) return;
  const int64_t E = cfg.num_experts;
  const int width = token_group_width(E), tokens_per_block = kWarpsPerBlock * (32 / width);
  const unsigned blocks = blocks_for(L, tokens_per_block);
  const RouteOptions opt{bias, cfg.num_expert_groups, cfg.topk_groups, static_cast<float>(cfg.route_scale), mask};
  const bool limited = opt.keep > 0 && opt.keep < opt.groups;
  const bool options = bias || limited;
  const size_t smem = limited ? sizeof(uint64_t) * static_cast<size_t>(tokens_per_block * opt.groups) : 0;
  auto launch = [&](auto kernel) {
    cuda::launch_chained(kernel, blocks, 32 * kWarpsPerBlock, smem, s, cfg.score_fn, cfg.normalize_topk, opt, logits, L,
                         E, cfg.top_k, width, ids, gates, lse);
  };
  with_group_shape(E, [&](auto per, auto lanes) {
    constexpr int kPer = decltype(per)::value, kWidth = decltype(lanes)::value;
    if (options) launch(route_tokens_kernel<kPer, kWidth, true>);
    else launch(route_tokens_kernel<kPer, kWidth, false>);
  });
  MOEBLAZE_CUDA_LAUNCH_CHECK("route_tokens");
}

size_t router_loss_scratch_floats(int64_t L, int64_t E) {
  return static_cast<size_t>(ceil_div(L, kLossChunkCuda) * (E + 1));
}

void router_losses_cuda(const LayerConfig& cfg, const float* logits, const float* lse, const int32_t* ids, int64_t L,
                        const int32_t* offsets, float* scratch, float* aux_out, float* z_out, cudaStream_t s) {
  if (!aux_out && !z_out) return;
  const int64_t E = cfg.num_experts, chunks = ceil_div(L, kLossChunkCuda);
  float* partial = scratch;
  float* partial_lse = scratch + chunks * E;
  if (chunks > 0) {
    dim3 grid(static_cast<unsigned>(chunks), static_cast<unsigned>(std::min<int64_t>(ceil_div(E, kLossExperts), 64)));
    cuda::launch_chained(loss_partials_kernel, grid, kLossExperts * kLossRows, 0, s, cfg.score_fn, logits, lse, ids, L,
                         E, cfg.top_k, partial, partial_lse);
    MOEBLAZE_CUDA_LAUNCH_CHECK("loss_partials");
  }
  cuda::launch_chained(loss_finish_kernel, 1, kFinishThreads, 0, s, cfg.balance_coeff(), cfg.z_loss_coeff, L, E,
                       cfg.top_k, chunks, partial, partial_lse, offsets, aux_out, z_out);
  MOEBLAZE_CUDA_LAUNCH_CHECK("loss_finish");
}

void router_backward_cuda(const LayerConfig& cfg, const float* logits, int64_t rows, int64_t L, const int32_t* ids,
                          const float* dgates, const float* grad_aux, const float* grad_z, const int32_t* offsets,
                          const SequenceBalance& sb, float* dlogits, void* dlogits_pair, cudaStream_t s) {
  if (rows == 0) return;
  const int64_t E = cfg.num_experts, k = cfg.top_k;
  const int width = token_group_width(E), tokens_per_block = kWarpsPerBlock * (32 / width);
  const int per = experts_per_lane(E, width);
  const size_t smem = 2 * sizeof(float) * static_cast<size_t>(tokens_per_block * k)        // <= 4 KB (k <= min(E, 64))
                      + (per > 0 ? sizeof(float) * static_cast<size_t>(tokens_per_block * E) : 0)  // <= 8 KB
                      + block_counts_bytes(sb, E);                                           // <= 16 KB
  auto launch = [&](auto kernel) {
    cuda::launch_chained(kernel, blocks_for(rows, tokens_per_block), 32 * kWarpsPerBlock, smem, s,
                         // the sequence-wise loss takes the Switch form only (the layer refuses the other), where
                         // balance_coeff() is AUX_LOSS_COEFF
                         cfg.score_fn, cfg.normalize_topk, static_cast<float>(cfg.balance_coeff()),
                         static_cast<float>(cfg.z_loss_coeff), static_cast<float>(cfg.route_scale), logits, rows, L, E,
                         k, width, ids, dgates, grad_aux, grad_z, offsets, sb, dlogits,
                         static_cast<__nv_bfloat16*>(dlogits_pair));
  };
  with_group_shape(E, [&](auto p, auto lanes) {
    launch(router_backward_kernel<decltype(p)::value, decltype(lanes)::value>);
  });
  MOEBLAZE_CUDA_LAUNCH_CHECK("router_backward");
}

void sequence_starts_cuda(const View& lengths, int64_t L, int64_t* starts, int32_t* flag, cudaStream_t s) {
  cuda::launch_chained(sequence_starts_kernel, 1, kStartsThreads, 0, s, lengths.data, lengths.dtype == DType::kI64,
                       lengths.stride[0], lengths.shape[0], L, starts, flag);
  MOEBLAZE_CUDA_LAUNCH_CHECK("sequence_starts");
}

void routed_sequences_cuda(const SequenceBalance& sb, int64_t L, int64_t k, cudaStream_t s) {
  cuda::launch_chained(routed_sequences_kernel, 1, kRoutedThreads, 0, s, sb, L, k);
  MOEBLAZE_CUDA_LAUNCH_CHECK("routed_sequences");
}

void sequence_balance_loss_cuda(const LayerConfig& cfg, const float* logits, const float* lse, int64_t L,
                                const SequenceBalance& sb, double* terms, const int32_t* flag, float* aux_out,
                                cudaStream_t s) {
  if (!aux_out) return;
  const int64_t E = cfg.num_experts;
  const int width = token_group_width(E), tokens_per_block = kWarpsPerBlock * (32 / width);
  if (L > 0)
    with_group_shape(E, [&](auto per, auto lanes) {
      cuda::launch_chained(sequence_terms_kernel<decltype(per)::value, decltype(lanes)::value>,
                           blocks_for(L, tokens_per_block), 32 * kWarpsPerBlock, block_counts_bytes(sb, E), s,
                           cfg.score_fn, logits, lse, L, E, cfg.top_k, width, sb, terms);
    });
  MOEBLAZE_CUDA_LAUNCH_CHECK("sequence_terms");
  cuda::launch_chained(sequence_loss_finish_kernel, 1, kTermThreads, 0, s, cfg.aux_loss_coeff, sb.routed, L, terms,
                       flag, aux_out);
  MOEBLAZE_CUDA_LAUNCH_CHECK("sequence_loss_finish");
}

void import_routing_cuda(const View& ids, const View& w, int64_t L, int64_t k, int64_t E, bool empty_slots,
                         const TokenMask& mask, int32_t* out_ids, float* out_gates, int32_t* error_flag,
                         cudaStream_t s) {
  if (L == 0) return;
  cuda::launch_chained(import_routing_kernel, blocks_for(L, 128), 128, 0, s, ids.data, ids.dtype == DType::kI64,
                       ids.stride[0], w.data, w.dtype, w.stride[0], L, k, E, empty_slots, mask, out_ids, out_gates,
                       error_flag);
  MOEBLAZE_CUDA_LAUNCH_CHECK("import_routing");
}

void write_topk_cuda(const int32_t* ids, const float* gates, int64_t L, int64_t k, const View& ids_out,
                     const View& w_out, cudaStream_t s) {
  if (L * k == 0 || (!ids_out.present && !w_out.present)) return;
  cuda::launch_chained(write_topk_kernel, blocks_for(L * k, 256), 256, 0, s, ids, gates, L, k,
                       ids_out.present ? ids_out.data : nullptr, ids_out.dtype == DType::kI64, ids_out.stride[0],
                       w_out.present ? w_out.data : nullptr, w_out.dtype, w_out.stride[0]);
  MOEBLAZE_CUDA_LAUNCH_CHECK("write_topk");
}

void write_tokens_per_expert_cuda(const int32_t* offsets, int64_t E, const View& out, cudaStream_t s) {
  if (!out.present) return;
  cuda::launch_chained(tokens_per_expert_kernel, blocks_for(E, 256), 256, 0, s, offsets, E, out.data,
                       out.dtype == DType::kI64, out.stride[0]);
  MOEBLAZE_CUDA_LAUNCH_CHECK("tokens_per_expert");
}

}  // namespace routing
}  // namespace v0
}  // namespace moeblaze
