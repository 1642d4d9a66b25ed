// The router backward from the saved gates alone (routing/router_cuda.hpp,
// grads_from_gates): softmax scores renormalised over the picks, no loss terms. The gates are
// g_j = c q_j with q the softmax of the picked logits, so d logits are zero off the picks and
// d l_j = g_j (d g_j - <d g, g> / c) on them: no logits, no E-wide softmax. One warp per token.
#include <cuda_bf16.h>

#include "cuda/chained_launch.cuh"
#include "cuda/cuda_check.hpp"
#include "routing/router_cuda.hpp"
#include "util/align.hpp"

namespace moeblaze {
inline namespace v0 {
namespace routing {
namespace {

constexpr int kTokensPerBlock = 8;  // a warp each
constexpr int kMaxPicks = static_cast<int>(kMaxTopK);  // two per lane

__global__ void __launch_bounds__(32 * kTokensPerBlock)
    router_backward_gates_kernel(int64_t rows, int64_t E, int64_t k, float inv_scale, const int32_t* ids,
                                 const float* gates, const float* dgates, float* dlogits, __nv_bfloat16* dlogits_pair,
                                 float* pick_dl) {
  cuda::wait_for_prior_grids();
  cuda::allow_next_grid();
  __shared__ int32_t s_id[kTokensPerBlock][kMaxPicks];
  __shared__ float s_dl[kTokensPerBlock][kMaxPicks];
  const int lane = threadIdx.x % 32, slot = threadIdx.x / 32;
  const int64_t t = static_cast<int64_t>(blockIdx.x) * kTokensPerBlock + slot;
  if (t >= rows) return;  // the whole warp: no block barrier below
  // A masked token (its first id -1) gets zero d logits; a slot whose id is outside [0, E) (an
  // empty slot, or a bad saved plan, which the engine flags) adds nothing.
  const bool empty = ids[t * k] < 0;
  int32_t id[2];
  float g[2], dg[2], dot = 0.f;
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    const int64_t j = lane + 32 * half;
    const int32_t v = j < k ? ids[t * k + j] : -1;
    const bool live = !empty && v >= 0 && v < E;
    id[half] = live ? v : -1;
    g[half] = live ? gates[t * k + j] : 0.f;
    dg[half] = live ? dgates[t * k + j] : 0.f;
    dot += dg[half] * g[half];
  }
#pragma unroll
  for (int off = 16; off > 0; off /= 2) dot += __shfl_xor_sync(0xffffffffu, dot, off);  // the same tree every run
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    const int64_t j = lane + 32 * half;
    if (j >= k) continue;
    const float dl = g[half] * (dg[half] - dot * inv_scale);
    s_id[slot][j] = id[half];
    s_dl[slot][j] = id[half] >= 0 ? dl : 0.f;
    if (pick_dl) pick_dl[t * k + j] = s_dl[slot][j];
  }
  if (!dlogits && !dlogits_pair) return;
  __syncwarp();
  // The dense rows: each lane its columns, the picks summed in slot order (a plan that repeats an
  // id within a token gets the same sum on every run).
  for (int64_t e = lane; e < E; e += 32) {
    float v = 0.f;
    for (int64_t j = 0; j < k; ++j) v += s_id[slot][j] == e ? s_dl[slot][j] : 0.f;
    if (dlogits) dlogits[t * E + e] = v;
    if (dlogits_pair) {  // [hi | lo] per row (router_backward_cuda)
      const __nv_bfloat16 hi = __float2bfloat16_rn(v);
      dlogits_pair[t * 2 * E + e] = hi;
      dlogits_pair[t * 2 * E + E + e] = __float2bfloat16_rn(v - __bfloat162float(hi));
    }
  }
}

}  // namespace

bool grads_from_gates(const LayerConfig& cfg) {
  return cfg.score_fn == ScoreFn::kSoftmax && cfg.normalize_topk && cfg.balance_coeff() == 0.0 &&
         cfg.z_loss_coeff == 0.0 && cfg.top_k <= kMaxPicks;
}

void router_backward_gates_cuda(const LayerConfig& cfg, int64_t rows, const int32_t* ids, const float* gates,
                                const float* dgates, float* dlogits, void* dlogits_pair, float* pick_dl,
                                cudaStream_t s) {
  if (rows == 0) return;
  const float scale = static_cast<float>(cfg.route_scale);
  // A zero scale makes every gate zero, and so every d logit: 0 in place of 0 / 0.
  const float inv_scale = scale != 0.f ? 1.f / scale : 0.f;
  cuda::launch_chained(router_backward_gates_kernel, static_cast<unsigned>(ceil_div(rows, int64_t{kTokensPerBlock})),
                       32 * kTokensPerBlock, 0, s, rows, cfg.num_experts, cfg.top_k, inv_scale, ids, gates, dgates,
                       dlogits, static_cast<__nv_bfloat16*>(dlogits_pair), pick_dl);
  MOEBLAZE_CUDA_LAUNCH_CHECK("router_backward_gates");
}

}  // namespace routing
}  // namespace v0
}  // namespace moeblaze
