// The router's losses on the device: the aux and z losses from per-chunk partial sums, and the
// sequence-wise balance loss. Every sum runs in a fixed order over fixed token chunks, so the
// losses are bitwise reproducible.
#include "cuda/chained_launch.cuh"
#include "cuda/cuda_check.hpp"
#include "routing/plan_check_cuda.hpp"
#include "routing/router_cuda.hpp"
#include "routing/router_kernels.cuh"
#include "routing/selection.hpp"
#include "routing/sequence_balance.cuh"
#include "routing/token_group.cuh"
#include "util/align.hpp"
#include "util/dtype.hpp"

namespace moeblaze {
inline namespace v0 {
namespace routing {
namespace {

using namespace router_detail;

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
  if (coeff != 0.0)  // the terms were not computed
    for (int64_t t = threadIdx.x; t < L; t += kTermThreads) acc += terms[t];
  red[threadIdx.x] = acc;
  __syncthreads();
  for (int o = kTermThreads / 2; o > 0; o >>= 1) {
    if (threadIdx.x < o) red[threadIdx.x] += red[threadIdx.x + o];
    __syncthreads();
  }
  if (threadIdx.x == 0)
    *aux_out = (*flag & kSequenceLengthsInvalid) ? NAN
               : B > 0 && coeff != 0.0              ? static_cast<float>(coeff * red[0] / static_cast<double>(B))
                                                    : 0.f;
}

}  // namespace

size_t router_loss_scratch_floats(int64_t L, int64_t E) {
  return static_cast<size_t>(ceil_div(L, kLossChunkCuda) * (E + 1));
}

void router_losses_cuda(const LayerConfig& cfg, const float* logits, const float* lse, const int32_t* ids, int64_t L,
                        const int32_t* offsets, float* scratch, float* aux_out, float* z_out, cudaStream_t s) {
  // A loss whose coefficient is 0 reads 0 whatever the scores (routing::finish_losses alike), so
  // the pass over the logits runs only for a loss that counts.
  float* const aux_sum = cfg.balance_coeff() != 0.0 ? aux_out : nullptr;
  float* const z_sum = cfg.z_loss_coeff != 0.0 ? z_out : nullptr;
  for (float* zero : {aux_out == aux_sum ? nullptr : aux_out, z_out == z_sum ? nullptr : z_out})
    if (zero) MOEBLAZE_CUDA_CHECK(cudaMemsetAsync(zero, 0, sizeof(float), s));
  aux_out = aux_sum;
  z_out = z_sum;
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
  if (L > 0 && cfg.aux_loss_coeff != 0.0)  // a zero coefficient reads 0: no terms
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

}  // namespace routing
}  // namespace v0
}  // namespace moeblaze
