// Router kernels: scores, top-k, gates, aux/z-loss, router backward, caller-routing import.
// One warp per token; reductions use a fixed lane order and fixed token chunks, so results
// are bitwise reproducible.
#include "cuda/cuda_check.hpp"
#include "routing/plan_check_cuda.hpp"
#include "routing/router_cuda.hpp"
#include "routing/score_order.hpp"
#include "util/align.hpp"
#include "util/dtype.hpp"

namespace moeblaze {
inline namespace v0 {
namespace routing {
namespace {

constexpr int kWarpsPerBlock = 8;
constexpr int kMaxTopK = 64;

__device__ __forceinline__ double warp_sum(double v) {
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}
// The warp's first (v, i) under ranks_before (routing/score_order.hpp), in every lane: a strict
// total order, so the butterfly gives all lanes the same winner whatever the values.
__device__ __forceinline__ void warp_best(float& v, int& i) {
  for (int o = 16; o > 0; o >>= 1) {
    const float ov = __shfl_xor_sync(0xffffffffu, v, o);
    const int oi = __shfl_xor_sync(0xffffffffu, i, o);
    if (ranks_before(ov, oi, v, i)) { v = ov; i = oi; }
  }
}

// logsumexp of one row; every lane gets it.
__device__ float row_lse(const float* l, int64_t E, int lane) {
  float m = -INFINITY;
  for (int64_t e = lane; e < E; e += 32) m = max_skipping_nan(m, l[e]);
  for (int o = 16; o > 0; o >>= 1) m = max_skipping_nan(m, __shfl_xor_sync(0xffffffffu, m, o));
  double s = 0.0;  // E-term reduction in fp64 (see routing/router.cpp)
  for (int64_t e = lane; e < E; e += 32) s += exp(static_cast<double>(l[e] - m));
  s = warp_sum(s);
  return m + static_cast<float>(log(s));
}

__device__ __forceinline__ float score(ScoreFn fn, float l, float lse) {
  return fn == ScoreFn::kSoftmax ? expf(l - lse) : 1.f / (1.f + expf(-l));
}

__global__ void logits_to_f32_kernel(const char* src, DType t, int64_t stride, int64_t L, int64_t E, float* out) {
  int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (i >= L * E) return;
  int64_t row = i / E, col = i % E;
  out[i] = load_f32(src + row * stride * static_cast<int64_t>(dtype_size(t)), t, col);
}

// One warp per token. Pick j is the warp's best expert among those ranked after pick j - 1
// (the CPU engine's top_k): no taken-list, no shared memory, and every lane agrees on each pick.
// Lane 0 writes the raw scores as gates, then rescales its own writes when normalising.
__global__ void route_tokens_kernel(ScoreFn fn, bool normalize, const float* logits, int64_t L, int64_t E, int64_t k,
                                    int32_t* ids, float* gates, float* lse_out) {
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int64_t t = blockIdx.x * static_cast<int64_t>(kWarpsPerBlock) + warp;
  if (t >= L) return;
  const float* l = logits + t * E;
  const float lse = row_lse(l, E, lane);
  float prev = 0.f, norm = 0.f;
  int prev_i = -1;
  for (int64_t j = 0; j < k; ++j) {
    float best = 0.f;
    int best_i = -1;
    for (int64_t e = lane; e < E; e += 32) {
      const float s = score(fn, l[e], lse);
      if (j > 0 && !ranks_before(prev, prev_i, s, e)) continue;
      if (ranks_before(s, e, best, best_i)) { best = s; best_i = static_cast<int>(e); }
    }
    warp_best(best, best_i);
    if (lane == 0) {
      ids[t * k + j] = best_i;
      gates[t * k + j] = best;
    }
    norm += best;
    prev = best;
    prev_i = best_i;
  }
  if (lane == 0) {
    if (normalize)
      for (int64_t j = 0; j < k; ++j) gates[t * k + j] = gates[t * k + j] / norm;
    lse_out[t] = lse;
  }
}

// partial[c * E + e] = sum of scores of expert e over token chunk c; partial_lse[c] = sum lse^2.
__global__ void loss_partials_kernel(ScoreFn fn, const float* logits, const float* lse, int64_t L, int64_t E,
                                     float* partial, float* partial_lse) {
  const int64_t c = blockIdx.x;
  const int64_t t0 = c * kLossChunkCuda, t1 = min(L, t0 + kLossChunkCuda);
  for (int64_t e = blockIdx.y * static_cast<int64_t>(blockDim.x) + threadIdx.x; e < E; e += gridDim.y * static_cast<int64_t>(blockDim.x)) {
    float s = 0.f;
    for (int64_t t = t0; t < t1; ++t) s += score(fn, logits[t * E + e], lse[t]);
    partial[c * E + e] = s;
  }
  if (blockIdx.y == 0 && threadIdx.x == 0) {
    float z = 0.f;
    for (int64_t t = t0; t < t1; ++t) z += lse[t] * lse[t];
    partial_lse[c] = z;
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

__global__ void router_backward_kernel(ScoreFn fn, bool normalize, float aux_coeff, float z_coeff, const float* logits,
                                       int64_t rows, int64_t L, int64_t E, int64_t k, const int32_t* ids, const float* dgates,
                                       const float* grad_aux, const float* grad_z, const int32_t* offsets,
                                       float* dlogits) {
  __shared__ int sel[kWarpsPerBlock][kMaxTopK];
  __shared__ float dsel[kWarpsPerBlock][kMaxTopK];
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int64_t t = blockIdx.x * static_cast<int64_t>(kWarpsPerBlock) + warp;
  if (t >= rows) return;
  const float* l = logits + t * E;
  const float lse = row_lse(l, E, lane);
  const float gaux = grad_aux ? *grad_aux : 1.f, gz = grad_z ? *grad_z : 1.f;
  const float aux_scale = aux_coeff * gaux * static_cast<float>(E) / (static_cast<float>(L) * static_cast<float>(L * k));
  const float z_scale = z_coeff * gz * 2.f / static_cast<float>(L);
  if (lane == 0) {
    // Ids come from a saved plan; one out of [0, E) (flagged on the device by the fused engine's
    // plan check) is clamped so that nothing is read outside the logits row.
    auto id = [&](int64_t j) { return min(max(ids[t * k + j], 0), static_cast<int32_t>(E - 1)); };
    float norm = 0.f, dot = 0.f;
    for (int64_t j = 0; j < k; ++j) norm += score(fn, l[id(j)], lse);
    for (int64_t j = 0; j < k; ++j) dot += dgates[t * k + j] * (score(fn, l[id(j)], lse) / norm);
    for (int64_t j = 0; j < k; ++j) {
      sel[warp][j] = id(j);
      dsel[warp][j] = normalize ? (dgates[t * k + j] - dot) / norm : dgates[t * k + j];
    }
  }
  __syncwarp();
  // ds_e = selected contribution + aux term. Softmax: dl = s (ds' - <s, ds'>) with ds shifted
  // by its value at the top score (shift-invariant, and no fp32 cancellation when that score
  // is near 1); the top score is found under the ranking rule of routing/score_order.hpp.
  auto ds_of = [&](int64_t e) {
    float ds = aux_coeff > 0.f ? aux_scale * static_cast<float>(offsets[e + 1] - offsets[e]) : 0.f;
    for (int64_t j = 0; j < k; ++j) ds += sel[warp][j] == e ? dsel[warp][j] : 0.f;
    return ds;
  };
  double dot = 0.0;
  float shift = 0.f;
  if (fn == ScoreFn::kSoftmax) {  // the top score under the router's ranking rule
    float best = 0.f;
    int best_i = -1;
    for (int64_t e = lane; e < E; e += 32) {
      const float v = score(fn, l[e], lse);
      if (ranks_before(v, e, best, best_i)) { best = v; best_i = static_cast<int>(e); }
    }
    warp_best(best, best_i);
    shift = ds_of(best_i);
    for (int64_t e = lane; e < E; e += 32) dot += static_cast<double>((ds_of(e) - shift) * score(fn, l[e], lse));
    dot = warp_sum(dot);
  }
  for (int64_t e = lane; e < E; e += 32) {
    const float ds = ds_of(e);
    const float s = score(fn, l[e], lse);
    float dl = fn == ScoreFn::kSoftmax ? s * ((ds - shift) - static_cast<float>(dot)) : ds * s * (1.f / (1.f + expf(l[e])));
    if (z_coeff > 0.f) dl += z_scale * lse * expf(l[e] - lse);
    dlogits[t * E + e] = dl;
  }
}

__global__ void import_routing_kernel(const char* ids, bool i64, int64_t id_stride, const char* w, DType wt,
                                      int64_t w_stride, int64_t L, int64_t k, int64_t E, int32_t* out_ids,
                                      float* out_gates, int32_t* error_flag) {
  const int64_t t = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (t >= L) return;
  bool bad = false;
  for (int64_t j = 0; j < k; ++j) {
    const int64_t id = i64 ? reinterpret_cast<const int64_t*>(ids)[t * id_stride + j]
                           : reinterpret_cast<const int32_t*>(ids)[t * id_stride + j];
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

}  // namespace

void logits_to_f32_cuda(const View& v, int64_t L, int64_t E, float* out, cudaStream_t s) {
  if (L * E == 0) return;
  logits_to_f32_kernel<<<blocks_for(L * E, 256), 256, 0, s>>>(v.data, v.dtype, v.stride[0], L, E, out);
  MOEBLAZE_CUDA_LAUNCH_CHECK("logits_to_f32");
}

void route_tokens_cuda(const LayerConfig& cfg, const float* logits, int64_t L, int32_t* ids, float* gates, float* lse,
                       cudaStream_t s) {
  if (L == 0) return;
  route_tokens_kernel<<<blocks_for(L, kWarpsPerBlock), 32 * kWarpsPerBlock, 0, s>>>(
      cfg.score_fn, cfg.normalize_topk, logits, L, cfg.num_experts, cfg.top_k, ids, gates, lse);
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
    dim3 grid(static_cast<unsigned>(chunks), static_cast<unsigned>(std::min<int64_t>(ceil_div(E, 128), 64)));
    loss_partials_kernel<<<grid, 128, 0, s>>>(cfg.score_fn, logits, lse, L, E, partial, partial_lse);
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
  router_backward_kernel<<<blocks_for(rows, kWarpsPerBlock), 32 * kWarpsPerBlock, 0, s>>>(
      cfg.score_fn, cfg.normalize_topk, static_cast<float>(cfg.aux_loss_coeff), static_cast<float>(cfg.z_loss_coeff),
      logits, rows, L, cfg.num_experts, cfg.top_k, ids, dgates, grad_aux, grad_z, offsets, dlogits);
  MOEBLAZE_CUDA_LAUNCH_CHECK("router_backward");
}

void import_routing_cuda(const View& ids, const View& w, int64_t L, int64_t k, int64_t E, int32_t* out_ids,
                         float* out_gates, int32_t* error_flag, cudaStream_t s) {
  if (L == 0) return;
  import_routing_kernel<<<blocks_for(L, 128), 128, 0, s>>>(ids.data, ids.dtype == DType::kI64, ids.stride[0], w.data,
                                                          w.dtype, w.stride[0], L, k, E, out_ids, out_gates, error_flag);
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
