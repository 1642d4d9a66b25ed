// The router backward: d logits from the gates' gradient and the losses' gradients, one group
// of lanes per token (routing/token_group.cuh), in a fixed order (bitwise reproducible).
#include <cuda_bf16.h>

#include <cmath>

#include "cuda/chained_launch.cuh"
#include "cuda/cuda_check.hpp"
#include "routing/router_cuda.hpp"
#include "routing/router_kernels.cuh"
#include "routing/score_order.hpp"
#include "routing/selection.hpp"
#include "routing/sequence_balance.cuh"
#include "routing/token_group.cuh"
#include "util/align.hpp"

namespace moeblaze {
inline namespace v0 {
namespace routing {
namespace {

using namespace router_detail;

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

}  // namespace

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

}  // namespace routing
}  // namespace v0
}  // namespace moeblaze
