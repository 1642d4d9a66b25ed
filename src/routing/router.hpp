// Router on the CPU: scores (softmax | sigmoid), top-k with optional renormalisation, the
// Switch load-balancing loss and the z-loss, and their backward. Logits arrive as fp32 rows.
#pragma once

#include <cstdint>

#include "core/config.hpp"
#include "core/view.hpp"

namespace moeblaze {
inline namespace v0 {
namespace routing {

// Tokens are reduced in fixed chunks of this many tokens, then the chunk partials in order:
// the aux/z-loss sums do not depend on the thread count.
constexpr int64_t kLossChunk = 256;

// Routes tokens [t0, t1): writes ids[t*k + j] and gates[t*k + j], and adds this token range's
// scores into score_sum[E] and logsumexp^2 into *lse_sq_sum (both fp32, token order).
// bias: the expert score bias [E] for selection (docs/routing.md), or nullptr. Group-limited
// routing and the route scale follow cfg. mask: TOKEN_MASK (when present, a token whose entry is
// 0 gets k empty slots, id -1 and gate 0, and adds nothing to the sums). scratch: 3E floats.
void route_tokens(const LayerConfig& cfg, const float* logits, const float* bias, const View& mask, int64_t t0,
                  int64_t t1, int32_t* ids, float* gates, float* score_sum, float* lse_sq_sum, float* scratch);

struct RouterLosses {
  float aux;  // AUX_LOSS_COEFF * E * sum_e f_e P_e (0 when the coefficient is 0)
  float z;    // Z_LOSS_COEFF * mean_t lse_t^2 (0 when the coefficient is 0)
};
// Combines per-chunk partials (in chunk order) and the expert counts into the two losses;
// num_tokens: the routed tokens (a masked token is not one).
RouterLosses finish_losses(const LayerConfig& cfg, int64_t num_tokens, const float* chunk_score_sums,
                           const float* chunk_lse_sq, int64_t num_chunks, const int32_t* expert_offsets);

// DeepSeek-V3's sequence-wise balance loss (docs/routing.md) over the sequences of `lengths`
// (the caller's SEQUENCE_LENGTHS: lengths.index(q) consecutive tokens each, summing to the call's
// tokens): AUX_LOSS_COEFF / B * sum_q E / (k T_q^2) * sum_e n_qe S_qe, over the B sequences with a
// routed token; T_q: sequence q's routed tokens (a TOKEN_MASK leaves the others out, their ids
// -1), n_qe their picks of expert e and S_qe the sum over them of the scores normalised to sum 1
// per token (sigmoid; softmax scores already do). In fp64, sequences in order. scratch: 3E floats.
float sequence_balance_loss(const LayerConfig& cfg, const float* logits, const int32_t* ids, const View& lengths,
                            float* scratch);
// B above: the sequences of `lengths` with at least one routed token.
int64_t routed_sequences(const int32_t* ids, const View& lengths, int64_t k);
// Adds grad_aux times its gradient to the rows of one sequence (tokens [t0, t0 + T)) of dlogits;
// B: routed_sequences. scratch: 4E floats.
void sequence_balance_backward(const LayerConfig& cfg, const float* logits, const int32_t* ids, int64_t t0, int64_t T,
                               int64_t B, float grad_aux, float* dlogits, float* scratch);

// d logits of tokens [t0, t1) from dgates (token order), aux/z-loss grads and the counts
// (offsets; nullptr leaves the batch-wise balance loss out); num_tokens: the routed tokens, over
// which the losses are means. A masked token (ids -1) gets zero d logits. scratch: 2E floats.
void router_backward(const LayerConfig& cfg, int64_t num_tokens, const float* logits, const int32_t* ids,
                     const float* dgates, float grad_aux, float grad_z, const int32_t* expert_offsets,
                     int64_t t0, int64_t t1, float* dlogits, float* scratch);

}  // namespace routing
}  // namespace v0
}  // namespace moeblaze
