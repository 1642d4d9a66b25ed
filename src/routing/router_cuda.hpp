// Router and routing-plan kernels for the CUDA engines (launchers; device code in .cu files).
// Same math as routing/router.hpp and routing/plan.hpp; every reduction has a fixed order.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

#include "core/view.hpp"
#include "core/config.hpp"
#include "core/memory_layout.hpp"

namespace moeblaze {
inline namespace v0 {
namespace routing {

// logits (any float dtype, strided rows) -> fp32 [L, E].
void logits_to_f32_cuda(const View& logits, int64_t L, int64_t E, float* out, cudaStream_t s);

// TOKEN_MASK on the device: token t is routed unless its entry is 0 (docs/routing.md).
struct TokenMask {
  const void* data = nullptr;  // null: every token is routed
  bool i64 = false;
  int64_t stride = 1;
};
inline TokenMask token_mask(const View& v) {
  return v.present ? TokenMask{v.data, v.dtype == DType::kI64, v.stride[0]} : TokenMask{};
}

// The routing options a top-k kernel applies (docs/routing.md).
struct RouteOptions {
  const float* bias;  // [E] expert score bias (selection only), or null
  int64_t groups;     // expert groups (NUM_EXPERT_GROUPS)
  int64_t keep;       // open groups (TOPK_GROUPS; 0 or groups: no limit)
  float scale;        // ROUTE_SCALE, times the gates
  TokenMask mask;     // a masked token's k slots are written empty: id -1, gate 0
};
// Per token: scores, top-k (ties to the lower id), gates; writes ids/gates (token order) and
// lse[t]. One warp per token. bias: EXPERT_BIAS [E] fp32, or null; groups and the route scale
// from cfg. The picks are the CPU engine's, bit for bit (routing/selection.hpp). A masked token
// gets k empty slots (id -1, gate 0).
void route_tokens_cuda(const LayerConfig& cfg, const float* logits, int64_t L, const float* bias, const TokenMask& mask,
                       int32_t* ids, float* gates, float* lse, cudaStream_t s);

constexpr int64_t kLossChunkCuda = 256;
// Scratch floats for router_losses_cuda: ceil(L / 256) * (E + 1).
size_t router_loss_scratch_floats(int64_t L, int64_t E);
// aux and z losses (fp32 device scalars; either pointer may be null), deterministic.
// ids: the plan's token_expert_indices; a token whose ids are -1 (masked) is left out, and the
// losses are means over the routed tokens.
void router_losses_cuda(const LayerConfig& cfg, const float* logits, const float* lse, const int32_t* ids, int64_t L,
                        const int32_t* offsets, float* scratch, float* aux_out, float* z_out, cudaStream_t s);

// The sequence-wise balance loss on the device (docs/routing.md, SEQUENCE_LENGTHS): the
// sequences' token starts, and the plan's per-expert token lists, from which each sequence's
// picks of an expert come by binary search (no [B, E] table, whatever B).
// A TOKEN_MASK leaves masked tokens out: a sequence's T is its routed tokens (its picks / k),
// and the mean is over the sequences with a routed token (*routed, from routed_sequences_cuda).
struct SequenceBalance {
  const int64_t* starts = nullptr;         // [count + 1]
  int64_t count = 0;                       // the sequences; 0: the batch-wise loss
  int64_t* routed = nullptr;               // device scalar: the sequences with a routed token
  const int32_t* token_ids = nullptr;      // plan.token_expert_indices (a masked token's are -1)
  const int32_t* expert_tokens = nullptr;  // plan.expert_token_indices
  const int32_t* offsets = nullptr;        // plan.expert_token_offsets
  int64_t picks = 0;                       // L k
  int64_t t0 = 0;                          // backward: the window's first token
};
// starts [B + 1] from SEQUENCE_LENGTHS (i32/i64 [B], 1 <= B <= L checked by the caller); a length
// outside [1, L] or a sum other than L sets routing::kSequenceLengthsInvalid in *flag.
void sequence_starts_cuda(const View& lengths, int64_t L, int64_t* starts, int32_t* flag, cudaStream_t s);
// *sb.routed: the sequences with at least one routed token (all of them without a TOKEN_MASK).
// After sequence_starts_cuda and the plan.
void routed_sequences_cuda(const SequenceBalance& sb, int64_t L, int64_t k, cudaStream_t s);
// AUX_LOSS as the sequence-wise loss (fp32 device scalar; NaN when the lengths were flagged),
// deterministic. terms: [L] doubles of scratch.
void sequence_balance_loss_cuda(const LayerConfig& cfg, const float* logits, const float* lse, int64_t L,
                                const SequenceBalance& sb, double* terms, const int32_t* flag, float* aux_out,
                                cudaStream_t s);

// d logits for `rows` consecutive tokens of a call of L tokens, from dgates (token order),
// aux/z gradient scalars (device pointers, or null for 1.0) and the expert offsets (the losses
// are means over the call: a window of its tokens passes its own rows and the call's L;
// logits, ids, dgates and the outputs point at the window's first token). One group of lanes
// per token. Written as fp32 [rows, E] into dlogits and/or as bf16 [rows, 2E] pairs into
// dlogits_pair (either may be null): columns [0, E) the rounded value hi, [E, 2E) the rounded
// remainder lo = v - hi, so a bf16 tensor-core GEMM over the pair (K doubled) sums hi + lo to
// about 16 significant bits instead of bf16's 8.
// sb.count > 0: the sequence-wise balance loss's gradient in place of the batch-wise one's.
void router_backward_cuda(const LayerConfig& cfg, const float* logits, int64_t rows, int64_t L, const int32_t* ids,
                          const float* dgates, const float* grad_aux, const float* grad_z, const int32_t* offsets,
                          const SequenceBalance& sb, float* dlogits, void* dlogits_pair, cudaStream_t s);

// Whether d logits follow from the saved gates alone: softmax scores renormalised over the
// picks, with no balance or z loss. Then they are zero off the picks, and the router backward
// needs neither the logits nor a pass over E experts per token.
bool grads_from_gates(const LayerConfig& cfg);
// That backward for `rows` tokens (ids, gates and dgates in token order from the window's first
// token): d l_tj = g_tj (dg_tj - <dg_t, g_t> / ROUTE_SCALE) at the picks. Writes any of: the
// dense fp32 rows [rows, E], the bf16 [hi | lo] pairs [rows, 2E] (as router_backward_cuda), and
// the picks' d logits [rows, k] (0 for an empty slot) for a combine that adds sum_j dl_tj W_g[id_tj].
void router_backward_gates_cuda(const LayerConfig& cfg, int64_t rows, const int32_t* ids, const float* gates,
                                const float* dgates, float* dlogits, void* dlogits_pair, float* pick_dl,
                                cudaStream_t s);

// Caller routing: ids (i32/i64 strided) -> int32 token_expert_indices, gates -> fp32. Bad ids
// (out of range or repeated within a token) set *error_flag to 1 and are replaced by a safe id
// so later kernels stay in bounds; the engine reads the flag before writing any output. With
// empty_slots, an id of -1 is an empty slot: imported as -1 with a zero gate.
// A masked token's slots are imported empty whatever the caller gave.
void import_routing_cuda(const View& ids, const View& weights, int64_t L, int64_t k, int64_t E, bool empty_slots,
                         const TokenMask& mask, int32_t* out_ids, float* out_gates, int32_t* error_flag,
                         cudaStream_t s);

// Router outputs: ids / gates to the caller's dtypes and strides, tokens per expert.
void write_topk_cuda(const int32_t* ids, const float* gates, int64_t L, int64_t k, const View& ids_out,
                     const View& weights_out, cudaStream_t s);
void write_tokens_per_expert_cuda(const int32_t* offsets, int64_t E, const View& out, cudaStream_t s);

// ---- routing plan: three atomic-free passes, no sort ----
struct PlanGeometryCuda {
  int64_t tile_tokens;  // T = 32 G tokens: the tile's (G + 1) x E bitmap fits in shared memory
  int64_t num_tiles;
  size_t smem_bytes;    // the place pass's (map and prefixes; the count pass uses half)
};
PlanGeometryCuda plan_geometry_cuda(int64_t L, int64_t E);
size_t plan_scratch_bytes_cuda(int64_t L, int64_t E);
void build_plan_cuda(RoutingPlan& plan, int64_t L, int64_t k, int64_t E, void* scratch, cudaStream_t s);

// Baseline for perf/: the same plan from a CUB radix sort of (expert, slot) keys.
size_t sort_plan_scratch_bytes_cuda(int64_t L, int64_t k, int64_t E);
void build_plan_sort_cuda(RoutingPlan& plan, int64_t L, int64_t k, int64_t E, void* scratch, cudaStream_t s);

}  // namespace routing
}  // namespace v0
}  // namespace moeblaze
