// Router kernels: scores, top-k and gates; the caller's routing imported; the routing outputs.
// One group of lanes per token (routing/token_group.cuh); reductions use a fixed lane order, so
// results are bitwise reproducible.
#include <cmath>

#include "cuda/chained_launch.cuh"
#include "cuda/cuda_check.hpp"
#include "routing/plan_check_cuda.hpp"
#include "routing/router_cuda.hpp"
#include "routing/router_kernels.cuh"
#include "routing/score_order.hpp"
#include "routing/selection.hpp"
#include "routing/token_group.cuh"
#include "util/align.hpp"
#include "util/dtype.hpp"

namespace moeblaze {
inline namespace v0 {
namespace routing {
namespace {

using namespace router_detail;

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
