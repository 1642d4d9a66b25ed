// Router kernels: scores, top-k, gates, aux/z-loss, router backward, caller-routing import.
// One group of lanes per token (routing/token_group.cuh); reductions use a fixed lane order and
// fixed token chunks, so results are bitwise reproducible.
#include <cmath>
#include <type_traits>

#include <cuda_bf16.h>

#include "cuda/cuda_check.hpp"
#include "routing/plan_check_cuda.hpp"
#include "routing/router_cuda.hpp"
#include "routing/score_order.hpp"
#include "routing/token_group.cuh"
#include "util/align.hpp"
#include "util/dtype.hpp"

namespace moeblaze {
inline namespace v0 {
namespace routing {
namespace {

constexpr int kWarpsPerBlock = 8;

__device__ __forceinline__ float score(ScoreFn fn, float l, float lse) {
  return fn == ScoreFn::kSoftmax ? expf(l - lse) : 1.f / (1.f + expf(-l));
}

__global__ void logits_to_f32_kernel(const char* src, DType t, int64_t stride, int64_t L, int64_t E, float* out) {
  int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (i >= L * E) return;
  int64_t row = i / E, col = i % E;
  out[i] = load_f32(src + row * stride * static_cast<int64_t>(dtype_size(t)), t, col);
}

__global__ void split_bf16_pair_kernel(const float* src, int64_t rows, int64_t cols, __nv_bfloat16* out) {
  const int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (i >= rows * cols) return;
  const int64_t row = i / cols, col = i % cols;
  const float v = src[i];
  const __nv_bfloat16 hi = __float2bfloat16_rn(v);
  out[row * 2 * cols + col] = hi;
  out[row * 2 * cols + cols + col] = __float2bfloat16_rn(v - __bfloat162float(hi));
}

// One token per group of lanes (routing/token_group.cuh). Pick j is the group's best expert
// (by rank_value: the logit, or a NaN score) among those ranked after pick j - 1 (the CPU
// engine's top_k): no taken-list, no shared memory,
// and every lane of the group agrees on each pick. With the scores in registers (kPer > 0) each
// lane sorts its experts' rank keys once and a pick is one integer maximum over the group
// (SortedCandidates: the same order as ranks_before; measured in perf/NOTES.md); the pick's score
// comes from its lane, bit for bit. The group's lane 0 writes the raw scores as gates, then
// rescales its own writes when normalising.
template <int kPer>
__global__ void route_tokens_kernel(ScoreFn fn, bool normalize, const float* logits, int64_t L, int64_t E, int64_t k,
                                    int width, int32_t* ids, float* gates, float* lse_out) {
  const TokenGroup g = token_group(L, width, kWarpsPerBlock);
  if (!__any_sync(0xffffffffu, g.live)) return;  // the whole warp past the last token
  const float* row = logits + (g.live ? g.token : 0) * E;  // a dead group's lanes read nothing
  const auto logit = lane_values<kPer>(g, E, [=](int, int64_t e) { return g.live ? row[e] : 0.f; });
  const float lse = group_lse<kPer>(g, E, logit);
  const auto score_of = lane_values<kPer>(g, E, [=](int i, int64_t e) { return score(fn, logit(i, e), lse); });
  const int64_t t = g.token;
  // Pick j is kept by lane j % width of the group (k <= 64 and k <= E, so at most two picks per
  // lane), and the group writes its k ids and gates at the end as k consecutive stores, with no
  // re-read of the gates to normalise them.
  float norm = 0.f;
  int kept_id[2] = {0, 0};
  float kept_gate[2] = {0.f, 0.f};
  auto emit = [&](int j, int best_i, float best) {
    if ((j & (g.width - 1)) == g.sub) {  // constant indices: the two slots stay in registers
      if (j < g.width) {
        kept_id[0] = best_i;
        kept_gate[0] = best;
      } else {
        kept_id[1] = best_i;
        kept_gate[1] = best;
      }
    }
    norm += best;
  };
  if constexpr (kPer > 0) {
    SortedCandidates<kPer> cand;
#pragma unroll
    for (int i = 0; i < kPer; ++i) {
      const int64_t e = g.sub + static_cast<int64_t>(i) * g.width;
      cand.score[i] = e < E ? score_of(i, e) : 0.f;
      cand.key[i] = e < E ? rank_key(rank_value(logit(i, e), cand.score[i]), e) : 0;
    }
    cand.sort();
    const int base = (threadIdx.x % 32) & ~(g.width - 1);  // the group's first lane
    for (int j = 0; j < static_cast<int>(k); ++j) {
      float best;
      const int best_i = rank_key_id(cand.pop(g.width, base, best));
      emit(j, best_i, best);
    }
  } else {
    float prev = 0.f;  // the previous pick's rank_value
    int prev_i = -1;
    for (int j = 0; j < static_cast<int>(k); ++j) {
      float best = 0.f;  // rank_value
      int best_i = -1;
      for_each_expert<kPer>(g, E, [&](int i, int64_t e) {
        const float r = rank_value(logit(i, e), score_of(i, e));
        if (j > 0 && !ranks_before(prev, prev_i, r, e)) return;
        if (ranks_before(r, e, best, best_i)) {
          best = r;
          best_i = static_cast<int>(e);
        }
      });
      group_best(best, best_i, g.width);
      emit(j, best_i, g.live && best_i >= 0 ? score(fn, row[best_i], lse) : 0.f);  // as its lane computed it
      prev = best;
      prev_i = best_i;
    }
  }
  if (!g.live) return;
#pragma unroll
  for (int second = 0; second < 2; ++second) {
    const int j = g.sub + second * g.width;
    if (j < k) {
      ids[t * k + j] = kept_id[second];
      gates[t * k + j] = normalize ? kept_gate[second] / norm : kept_gate[second];
    }
  }
  if (g.sub == 0) lse_out[t] = lse;
}

// partial[c * E + e] = sum of scores of expert e over token chunk c; partial_lse[c] = sum lse^2.
// A block is kLossExperts experts x kLossRows token rows: row r sums the chunk's tokens r,
// r + kLossRows, ..., and the rows' sums are added in row order (fixed: deterministic). Warp 0
// sums lse^2 over the chunk the same way, lane by lane, then by a fixed butterfly.
constexpr int kLossExperts = 128, kLossRows = 8;
__global__ void loss_partials_kernel(ScoreFn fn, const float* logits, const float* lse, int64_t L, int64_t E,
                                     float* partial, float* partial_lse) {
  __shared__ float rows[kLossRows][kLossExperts];
  const int64_t c = blockIdx.x;
  const int64_t t0 = c * kLossChunkCuda, t1 = min(L, t0 + kLossChunkCuda);
  const int tx = threadIdx.x % kLossExperts, ty = threadIdx.x / kLossExperts;
  for (int64_t e0 = blockIdx.y * static_cast<int64_t>(kLossExperts); e0 < E; e0 += gridDim.y * static_cast<int64_t>(kLossExperts)) {
    const int64_t e = e0 + tx;
    float s = 0.f;
    if (e < E)
      for (int64_t t = t0 + ty; t < t1; t += kLossRows) s += score(fn, logits[t * E + e], lse[t]);
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
    for (int64_t t = t0 + threadIdx.x; t < t1; t += 32) z += lse[t] * lse[t];
    for (int o = 16; o > 0; o >>= 1) z += __shfl_xor_sync(0xffffffffu, z, o);
    if (threadIdx.x == 0) partial_lse[c] = z;
  }
}

__global__ void loss_finish_kernel(double aux_coeff, double z_coeff, int64_t L, int64_t E, int64_t k, int64_t chunks,
                                   const float* partial, const float* partial_lse, const int32_t* offsets, float* aux_out,
                                   float* z_out) {
  __shared__ double red[256];
  double acc = 0.0;
  for (int64_t e = threadIdx.x; e < E; e += blockDim.x) {
    double p = 0.0;
    for (int64_t c = 0; c < chunks; ++c) p += partial[c * E + e];
    const double f = static_cast<double>(offsets[e + 1] - offsets[e]) / static_cast<double>(L * k);
    acc += f * (p / static_cast<double>(L));
  }
  red[threadIdx.x] = acc;
  __syncthreads();
  for (int s = blockDim.x / 2; s > 0; s >>= 1) {
    if (threadIdx.x < s) red[threadIdx.x] += red[threadIdx.x + s];
    __syncthreads();
  }
  if (threadIdx.x == 0) {
    double z = 0.0;
    for (int64_t c = 0; c < chunks; ++c) z += partial_lse[c];
    if (aux_out) *aux_out = L > 0 ? static_cast<float>(aux_coeff * static_cast<double>(E) * red[0]) : 0.f;
    if (z_out) *z_out = L > 0 ? static_cast<float>(z_coeff * z / static_cast<double>(L)) : 0.f;
  }
}

// One token per group of lanes (routing/token_group.cuh). The group's lanes load the token's k
// picks side by side into shared memory (pick ids, their scores, then the gradient each pick
// passes on); lane 0 sums them in pick order, as the CPU engine does.
template <int kPer>
__global__ void router_backward_kernel(ScoreFn fn, bool normalize, float aux_coeff, float z_coeff, const float* logits,
                                       int64_t rows, int64_t L, int64_t E, int64_t k, int width, const int32_t* ids,
                                       const float* dgates, const float* grad_aux, const float* grad_z,
                                       const int32_t* offsets, float* dlogits) {
  extern __shared__ float picks_smem[];  // [tokens per block][k] ids, then [tokens per block][k] values
  const TokenGroup g = token_group(rows, width, kWarpsPerBlock);
  if (!__any_sync(0xffffffffu, g.live)) return;
  const int64_t t = g.token;
  const int tokens_per_block = kWarpsPerBlock * (32 / width);
  const int slot = static_cast<int>(threadIdx.x / width);  // the group's token within the block
  int* sel = reinterpret_cast<int*>(picks_smem) + slot * k;
  float* dsel = picks_smem + tokens_per_block * k + slot * k;
  const float* row = logits + (g.live ? g.token : 0) * E;  // a dead group's lanes read nothing
  const auto logit = lane_values<kPer>(g, E, [=](int, int64_t e) { return g.live ? row[e] : 0.f; });
  const float lse = group_lse<kPer>(g, E, logit);
  const auto score_of = lane_values<kPer>(g, E, [=](int i, int64_t e) { return score(fn, logit(i, e), lse); });
  const float gaux = grad_aux ? *grad_aux : 1.f, gz = grad_z ? *grad_z : 1.f;
  const float aux_scale = aux_coeff * gaux * static_cast<float>(E) / (static_cast<float>(L) * static_cast<float>(L * k));
  const float z_scale = z_coeff * gz * 2.f / static_cast<float>(L);
  // Ids come from a saved plan; one out of [0, E) (flagged on the device by the fused engine's
  // plan check) is clamped so that nothing is read outside the logits row.
  if (g.live)
    for (int64_t j = g.sub; j < k; j += g.width) {
      const int id = min(max(ids[t * k + j], 0), static_cast<int32_t>(E - 1));
      sel[j] = id;
      dsel[j] = score(fn, row[id], lse);
    }
  __syncwarp();
  if (g.live && g.sub == 0) {
    float norm = 0.f, dot = 0.f;
    for (int64_t j = 0; j < k; ++j) norm += dsel[j];
    for (int64_t j = 0; j < k; ++j) dot += dgates[t * k + j] * (dsel[j] / norm);
    for (int64_t j = 0; j < k; ++j) dsel[j] = normalize ? (dgates[t * k + j] - dot) / norm : dgates[t * k + j];
  }
  __syncwarp();
  // ds_e = selected contribution + aux term. Softmax: dl = s (ds' - <s, ds'>) with ds shifted
  // by its value at the top score (shift-invariant, and no fp32 cancellation when that score
  // is near 1); the top score is found under the ranking rule of routing/score_order.hpp.
  auto ds_of = [&](int64_t e) {
    if (!g.live) return 0.f;  // a dead group's picks were never loaded
    float ds = aux_coeff > 0.f ? aux_scale * static_cast<float>(offsets[e + 1] - offsets[e]) : 0.f;
    for (int64_t j = 0; j < k; ++j) ds += sel[j] == e ? dsel[j] : 0.f;
    return ds;
  };
  const auto ds_at = lane_values<kPer>(g, E, [&](int, int64_t e) { return ds_of(e); });
  double dot = 0.0;
  float shift = 0.f;
  if (fn == ScoreFn::kSoftmax) {  // the top score under the router's ranking rule
    float best = 0.f;
    int best_i = -1;
    for_each_expert<kPer>(g, E, [&](int i, int64_t e) {
      const float v = score_of(i, e);
      if (ranks_before(v, e, best, best_i)) {
        best = v;
        best_i = static_cast<int>(e);
      }
    });
    group_best(best, best_i, g.width);
    shift = ds_of(best_i);
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
    dlogits[t * E + e] = dl;
  });
}

__global__ void import_routing_kernel(const char* ids, bool i64, int64_t id_stride, const char* w, DType wt,
                                      int64_t w_stride, int64_t L, int64_t k, int64_t E, bool empty_slots,
                                      int32_t* out_ids, float* out_gates, int32_t* error_flag) {
  const int64_t t = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (t >= L) return;
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
  const int64_t e = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (e >= E) return;
  const int32_t n = offsets[e + 1] - offsets[e];
  if (i64) reinterpret_cast<int64_t*>(out)[e * stride] = n;
  else reinterpret_cast<int32_t*>(out)[e * stride] = n;
}

unsigned blocks_for(int64_t n, int threads) { return static_cast<unsigned>(ceil_div(n, threads)); }

// f(std::integral_constant<int, per>) for the experts cached per lane (token_group.cuh).
template <class F>
void with_experts_per_lane(int per, F&& f) {
  switch (per) {
    case 1: f(std::integral_constant<int, 1>{}); break;
    case 2: f(std::integral_constant<int, 2>{}); break;
    case 4: f(std::integral_constant<int, 4>{}); break;
    case 8: f(std::integral_constant<int, 8>{}); break;
    default: f(std::integral_constant<int, 0>{}); break;
  }
}

}  // namespace

void logits_to_f32_cuda(const View& v, int64_t L, int64_t E, float* out, cudaStream_t s) {
  if (L * E == 0) return;
  logits_to_f32_kernel<<<blocks_for(L * E, 256), 256, 0, s>>>(v.data, v.dtype, v.stride[0], L, E, out);
  MOEBLAZE_CUDA_LAUNCH_CHECK("logits_to_f32");
}

void split_bf16_pair_cuda(const float* src, int64_t rows, int64_t cols, void* out, cudaStream_t s) {
  if (rows * cols == 0) return;
  split_bf16_pair_kernel<<<blocks_for(rows * cols, 256), 256, 0, s>>>(src, rows, cols,
                                                                       static_cast<__nv_bfloat16*>(out));
  MOEBLAZE_CUDA_LAUNCH_CHECK("split_bf16_pair");
}

void route_tokens_cuda(const LayerConfig& cfg, const float* logits, int64_t L, int32_t* ids, float* gates, float* lse,
                       cudaStream_t s) {
  if (L == 0) return;
  const int64_t E = cfg.num_experts;
  const int width = token_group_width(E);
  const unsigned blocks = blocks_for(L, kWarpsPerBlock * (32 / width));
  auto launch = [&](auto kernel) {
    kernel<<<blocks, 32 * kWarpsPerBlock, 0, s>>>(cfg.score_fn, cfg.normalize_topk, logits, L, E, cfg.top_k, width, ids,
                                                  gates, lse);
  };
  with_experts_per_lane(experts_per_lane(E, width), [&](auto per) { launch(route_tokens_kernel<decltype(per)::value>); });
  MOEBLAZE_CUDA_LAUNCH_CHECK("route_tokens");
}

size_t router_loss_scratch_floats(int64_t L, int64_t E) {
  return static_cast<size_t>(ceil_div(L, kLossChunkCuda) * (E + 1));
}

void router_losses_cuda(const LayerConfig& cfg, const float* logits, const float* lse, int64_t L, const int32_t* offsets,
                        float* scratch, float* aux_out, float* z_out, cudaStream_t s) {
  if (!aux_out && !z_out) return;
  const int64_t E = cfg.num_experts, chunks = ceil_div(L, kLossChunkCuda);
  float* partial = scratch;
  float* partial_lse = scratch + chunks * E;
  if (chunks > 0) {
    dim3 grid(static_cast<unsigned>(chunks), static_cast<unsigned>(std::min<int64_t>(ceil_div(E, kLossExperts), 64)));
    loss_partials_kernel<<<grid, kLossExperts * kLossRows, 0, s>>>(cfg.score_fn, logits, lse, L, E, partial, partial_lse);
    MOEBLAZE_CUDA_LAUNCH_CHECK("loss_partials");
  }
  loss_finish_kernel<<<1, 256, 0, s>>>(cfg.aux_loss_coeff, cfg.z_loss_coeff, L, E, cfg.top_k, chunks, partial,
                                       partial_lse, offsets, aux_out, z_out);
  MOEBLAZE_CUDA_LAUNCH_CHECK("loss_finish");
}

void router_backward_cuda(const LayerConfig& cfg, const float* logits, int64_t rows, int64_t L, const int32_t* ids,
                          const float* dgates, const float* grad_aux, const float* grad_z, const int32_t* offsets,
                          float* dlogits, cudaStream_t s) {
  if (rows == 0) return;
  const int64_t E = cfg.num_experts, k = cfg.top_k;
  const int width = token_group_width(E), tokens_per_block = kWarpsPerBlock * (32 / width);
  const size_t smem = 2 * sizeof(float) * static_cast<size_t>(tokens_per_block * k);  // <= 4 KB (k <= min(E, 64))
  auto launch = [&](auto kernel) {
    kernel<<<blocks_for(rows, tokens_per_block), 32 * kWarpsPerBlock, smem, s>>>(
        cfg.score_fn, cfg.normalize_topk, static_cast<float>(cfg.aux_loss_coeff), static_cast<float>(cfg.z_loss_coeff),
        logits, rows, L, E, k, width, ids, dgates, grad_aux, grad_z, offsets, dlogits);
  };
  with_experts_per_lane(experts_per_lane(E, width), [&](auto per) { launch(router_backward_kernel<decltype(per)::value>); });
  MOEBLAZE_CUDA_LAUNCH_CHECK("router_backward");
}

void import_routing_cuda(const View& ids, const View& w, int64_t L, int64_t k, int64_t E, bool empty_slots,
                         int32_t* out_ids, float* out_gates, int32_t* error_flag, cudaStream_t s) {
  if (L == 0) return;
  import_routing_kernel<<<blocks_for(L, 128), 128, 0, s>>>(ids.data, ids.dtype == DType::kI64, ids.stride[0], w.data,
                                                          w.dtype, w.stride[0], L, k, E, empty_slots, out_ids, out_gates,
                                                          error_flag);
  MOEBLAZE_CUDA_LAUNCH_CHECK("import_routing");
}

void write_topk_cuda(const int32_t* ids, const float* gates, int64_t L, int64_t k, const View& ids_out,
                     const View& w_out, cudaStream_t s) {
  if (L * k == 0 || (!ids_out.present && !w_out.present)) return;
  write_topk_kernel<<<blocks_for(L * k, 256), 256, 0, s>>>(
      ids, gates, L, k, ids_out.present ? ids_out.data : nullptr, ids_out.dtype == DType::kI64, ids_out.stride[0],
      w_out.present ? w_out.data : nullptr, w_out.dtype, w_out.stride[0]);
  MOEBLAZE_CUDA_LAUNCH_CHECK("write_topk");
}

void write_tokens_per_expert_cuda(const int32_t* offsets, int64_t E, const View& out, cudaStream_t s) {
  if (!out.present) return;
  tokens_per_expert_kernel<<<blocks_for(E, 256), 256, 0, s>>>(offsets, E, out.data, out.dtype == DType::kI64,
                                                              out.stride[0]);
  MOEBLAZE_CUDA_LAUNCH_CHECK("tokens_per_expert");
}

}  // namespace routing
}  // namespace v0
}  // namespace moeblaze
