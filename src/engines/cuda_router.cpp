#include "engines/cuda_router.hpp"

#include "combine/combine_cuda.hpp"
#include "cuda/cuda_check.hpp"
#include "routing/narrow_logits_cuda.hpp"
#include "routing/router_cuda.hpp"

namespace moeblaze {
inline namespace v0 {

size_t CudaRouter::window_rows_bytes(int64_t window) const {
  RouterWork w;
  Carver c(nullptr);
  take_window_rows(c, w, window);
  return c.size();
}

void CudaRouter::place_window_rows(RouterWork& w, int64_t window, void* at) const {
  Carver c(at);
  take_window_rows(c, w, window);
}

void CudaRouter::take_window_rows(Carver& c, RouterWork& w, int64_t window) const {
  const int64_t E = cfg_.num_experts, d = cfg_.hidden;
  if (tensor_core_backward()) {
    w.dlogits_pair = c.take<uint16_t>(static_cast<size_t>(window * 2 * E));
    return;
  }
  w.x_f32 = c.take<float>(static_cast<size_t>(window * d));
  w.router_dx = c.take<float>(static_cast<size_t>(window * d));
}

RouterWork CudaRouter::carve(Carver& c, Pass pass, int64_t L, int64_t window, void* gemm_ws, bool own_window_rows) const {
  const int64_t E = cfg_.num_experts, d = cfg_.hidden;
  RouterWork w;
  w.gemm_ws = gemm_ws;
  w.logits = c.take<float>(static_cast<size_t>(L * E));
  int64_t* flags = c.take<int64_t>(2);  // one aligned slot: the error flag, then the routed sequences
  w.error_flag = reinterpret_cast<int32_t*>(flags);
  w.seq_routed = flags ? flags + 1 : nullptr;
  w.seq_starts = c.take<int64_t>(static_cast<size_t>(L + 1));
  if (pass != Pass::kBackward) {
    w.seq_terms = c.take<double>(static_cast<size_t>(L));
    w.lse = c.take<float>(static_cast<size_t>(L));
    w.loss_scratch = c.take<float>(routing::router_loss_scratch_floats(L, E));
    w.plan_scratch = c.take<char>(routing::plan_scratch_bytes_cuda(L, E));
  } else {
    w.dlogits = c.take<float>(static_cast<size_t>(L * E));
    if (from_gates()) w.pick_dl = w.logits;  // [L, k] in the logits' [L, E], which this backward never reads
    if (tensor_core_backward()) w.wg_pair = c.take<uint16_t>(static_cast<size_t>(2 * E * d));
    else w.wg_f32 = c.take<float>(static_cast<size_t>(E * d));
    // bf16 layers: dW_g from the pair as one GEMM, its hi and lo halves [2E, d] added at the end
    w.dwg_f32 = c.take<float>(static_cast<size_t>((tensor_core_backward() ? 2 : 1) * E * d));
    if (own_window_rows) take_window_rows(c, w, window);
  }
  return w;
}

RouterWork CudaRouter::carve_head(Carver& c, Pass pass, int64_t L, int64_t window, void* base, RoutingPlan& plan,
                                  bool own_window_rows) const {
  void* gemm_ws = c.take<char>(gemm::CublasLtGemm::kWorkspaceBytes);
  RouterWork w = carve(c, pass, L, window, gemm_ws, own_window_rows);
  if (pass == Pass::kForwardInference || pass == Pass::kRoute) {
    SavedRegions r = carve_saved(cfg_, L, base ? static_cast<char*>(base) + c.size() : nullptr, false);
    c.take<char>(r.bytes);
    plan = r.plan;
  }
  return w;
}

bool CudaRouter::tensor_core_backward() const { return router_backward_on_tensor_cores(cfg_); }

bool CudaRouter::from_gates() const { return routing::grads_from_gates(cfg_); }

bool CudaRouter::router_part_of_dx(const CallArgs& a, const Needs& needs) {
  return needs.router_grad && needs.router_adds_dx && a.mode == RoutingMode::kRouterWeight;
}

bool CudaRouter::dx_from_picks(const CallArgs& a, const Needs& needs) const {
  return from_gates() && router_part_of_dx(a, needs) && a.router_weight.dtype == a.dx.dtype;
}

void CudaRouter::gemm(int64_t M, int64_t N, int64_t K, const gemm::GemmOperand& A, const gemm::GemmOperand& B, float* C,
                      const RouterWork& w, cudaStream_t s, float beta) const {
  gemm_.gemm(M, N, K, A, B, C, DType::kF32, N, 1.f, beta, w.gemm_ws, gemm::CublasLtGemm::kWorkspaceBytes, s);
}

void CudaRouter::logits(const CallArgs& a, const RouterWork& w, cudaStream_t s) const {
  const int64_t L = a.num_tokens, E = cfg_.num_experts, d = cfg_.hidden;
  if (a.mode == RoutingMode::kLogits) {
    routing::logits_to_f32_cuda(a.logits, L, E, w.logits, s);
  } else if (!routing::narrow_logits_unsupported(a.x, a.router_weight, E, d)) {
    routing::narrow_logits_cuda(a.x, a.router_weight, L, E, d, w.logits, s);
  } else {  // logits = x W_g^T in fp32 output (bf16/fp16 inputs, fp32 accumulation)
    gemm(L, E, d, {a.x.data, a.x.dtype, a.x.stride[0], false},
         {a.router_weight.data, a.router_weight.dtype, a.router_weight.stride[0], true}, w.logits, w, s);
  }
}

void CudaRouter::route_and_plan(const CallArgs& a, RoutingPlan& plan, const RouterWork& w, cudaStream_t s) const {
  const int64_t L = a.num_tokens, E = cfg_.num_experts, k = cfg_.top_k;
  MOEBLAZE_CUDA_CHECK(cudaMemsetAsync(w.error_flag, 0, sizeof(int32_t), s));
  if (a.mode == RoutingMode::kCallerTopK) {
    routing::import_routing_cuda(a.topk_ids, a.topk_weights, L, k, E, cfg_.empty_slots,
                                 routing::token_mask(a.token_mask), plan.token_expert_indices,
                                 plan.gates, w.error_flag, s);
  } else {
    logits(a, w, s);
    const float* bias = a.expert_bias.present ? reinterpret_cast<const float*>(a.expert_bias.data) : nullptr;
    routing::route_tokens_cuda(cfg_, w.logits, L, bias, routing::token_mask(a.token_mask), plan.token_expert_indices,
                               plan.gates, w.lse, s);
  }
  sequence_starts(a, w, s);
  routing::build_plan_cuda(plan, L, k, E, w.plan_scratch, s);
}

void CudaRouter::sequence_starts(const CallArgs& a, const RouterWork& w, cudaStream_t s) const {
  if (a.sequence_lengths.present)
    routing::sequence_starts_cuda(a.sequence_lengths, a.num_tokens, w.seq_starts, w.error_flag, s);
}

routing::SequenceBalance CudaRouter::sequences(const CallArgs& a, const RoutingPlan& plan, const RouterWork& w,
                                               int64_t t0) const {
  routing::SequenceBalance sb;
  if (!a.sequence_lengths.present || a.mode == RoutingMode::kCallerTopK) return sb;
  sb.starts = w.seq_starts;
  sb.count = a.sequence_lengths.shape[0];
  sb.routed = w.seq_routed;
  sb.token_ids = plan.token_expert_indices;
  sb.expert_tokens = plan.expert_token_indices;
  sb.offsets = plan.expert_token_offsets;
  sb.picks = a.num_tokens * cfg_.top_k;
  sb.t0 = t0;
  return sb;
}

void CudaRouter::write_outputs(const CallArgs& a, const RoutingPlan& plan, const RouterWork& w, cudaStream_t s) const {
  const int64_t L = a.num_tokens, E = cfg_.num_experts, k = cfg_.top_k;
  if (a.mode != RoutingMode::kCallerTopK) {
    routing::write_topk_cuda(plan.token_expert_indices, plan.gates, L, k, a.topk_ids, a.topk_weights, s);
    float* aux = a.aux_loss.present ? reinterpret_cast<float*>(a.aux_loss.data) : nullptr;
    const routing::SequenceBalance sb = sequences(a, plan, w, 0);
    routing::router_losses_cuda(cfg_, w.logits, w.lse, plan.token_expert_indices, L, plan.expert_token_offsets,
                                w.loss_scratch,
                                sb.count > 0 ? nullptr : aux,
                                a.z_loss.present ? reinterpret_cast<float*>(a.z_loss.data) : nullptr, s);
    if (sb.count > 0 && aux) routing::routed_sequences_cuda(sb, L, k, s);
    if (sb.count > 0)
      routing::sequence_balance_loss_cuda(cfg_, w.logits, w.lse, L, sb, w.seq_terms, w.error_flag, aux, s);
  }
  routing::write_tokens_per_expert_cuda(plan.expert_token_offsets, E, a.tokens_per_expert, s);
}

combine::TokenTerms CudaRouter::backward(const CallArgs& a, const Needs& needs, const RoutingPlan& plan,
                                         const float* dg_tok, const RouterWork& w, cudaStream_t s) const {
  backward_begin(a, needs, w, s);
  const combine::TokenTerms dx_terms = backward_window(a, needs, plan, 0, a.num_tokens, dg_tok, true, w, s);
  backward_finish(a, needs, w, s);
  return dx_terms;
}

void CudaRouter::backward_begin(const CallArgs& a, const Needs& needs, const RouterWork& w, cudaStream_t s) const {
  if (!needs.router_grad) return;
  if (!from_gates()) logits(a, w, s);
  sequence_starts(a, w, s);
  if (!router_part_of_dx(a, needs) || dx_from_picks(a, needs)) return;
  const int64_t E = cfg_.num_experts, d = cfg_.hidden;
  if (!tensor_core_backward()) {
    routing::logits_to_f32_cuda(a.router_weight, E, d, w.wg_f32, s);
    return;
  }
  // W_g twice, [2E, d]: the dx GEMM's B against the [hi | lo] pair of d logits.
  const size_t row_bytes = sizeof(uint16_t) * static_cast<size_t>(d);
  const size_t pitch = sizeof(uint16_t) * static_cast<size_t>(a.router_weight.stride[0]);
  for (int half = 0; half < 2; ++half)
    MOEBLAZE_CUDA_CHECK(cudaMemcpy2DAsync(static_cast<char*>(w.wg_pair) + half * E * row_bytes, row_bytes,
                                          a.router_weight.data, pitch, row_bytes, static_cast<size_t>(E),
                                          cudaMemcpyDeviceToDevice, s));
}

combine::TokenTerms CudaRouter::backward_window(const CallArgs& a, const Needs& needs, const RoutingPlan& plan,
                                                int64_t t0, int64_t rows, const float* dg_tok, bool first,
                                                const RouterWork& w, cudaStream_t s) const {
  if (!needs.router_grad || rows == 0) return {};
  const int64_t L = a.num_tokens, E = cfg_.num_experts, k = cfg_.top_k, d = cfg_.hidden;
  float* dlogits = w.dlogits + t0 * E;
  // dW_g = dlogits^T x (summed over the windows in order), dx += dlogits W_g.
  const bool weight_grads =
      a.mode == RoutingMode::kRouterWeight && (a.d_router_weight.present || needs.router_adds_dx);
  const bool picks = dx_from_picks(a, needs);
  // The dense d logits feed dW_g, and dx's router part unless the combine takes it by picks.
  const bool dense_gemms = weight_grads && (a.d_router_weight.present || !picks);
  const bool pair = dense_gemms && tensor_core_backward();
  if (from_gates()) {
    routing::router_backward_gates_cuda(cfg_, rows, plan.token_expert_indices + t0 * k, plan.gates + t0 * k, dg_tok,
                                        a.d_logits.present || (dense_gemms && !pair) ? dlogits : nullptr,
                                        pair ? w.dlogits_pair : nullptr, picks ? w.pick_dl + t0 * k : nullptr, s);
  } else {
    const routing::SequenceBalance sb = sequences(a, plan, w, t0);
    if (first && sb.count > 0) routing::routed_sequences_cuda(sb, L, k, s);
    routing::router_backward_cuda(cfg_, w.logits + t0 * E, rows, L, plan.token_expert_indices + t0 * k, dg_tok,
                                  a.grad_aux.present ? reinterpret_cast<const float*>(a.grad_aux.data) : nullptr,
                                  a.grad_z.present ? reinterpret_cast<const float*>(a.grad_z.data) : nullptr,
                                  plan.expert_token_offsets, sb, pair && !a.d_logits.present ? nullptr : dlogits,
                                  pair ? w.dlogits_pair : nullptr, s);
  }
  combine::TokenTerms terms;
  if (picks) {  // sum_j dl_tj W_g[id_tj], added by the dx combine
    terms.rows = a.router_weight.data;
    terms.ld = a.router_weight.stride[0];
    terms.count = E;
    terms.ids = plan.token_expert_indices + t0 * k;
    terms.coef = w.pick_dl + t0 * k;
    terms.picks = k;
  }
  if (!weight_grads) return terms;
  if (pair) {
    const View x = a.x.rows(t0, rows);
    const uint16_t* hi = static_cast<const uint16_t*>(w.dlogits_pair);
    if (a.d_router_weight.present)
      gemm(2 * E, d, rows, {hi, DType::kBF16, 2 * E, true}, {x.data, DType::kBF16, x.stride[0], false}, w.dwg_f32, w, s,
           first ? 0.f : 1.f);
    return terms;  // dx's router part: by picks, or add_router_dx after the combine
  }
  if (a.d_router_weight.present) {
    routing::logits_to_f32_cuda(a.x.rows(t0, rows), rows, d, w.x_f32, s);
    gemm(E, d, rows, {dlogits, DType::kF32, E, true}, {w.x_f32, DType::kF32, d, false}, w.dwg_f32, w, s, first ? 0.f : 1.f);
  }
  if (picks || !router_dx_for_combine(a, needs)) return terms;
  gemm(rows, d, E, {dlogits, DType::kF32, E, false}, {w.wg_f32, DType::kF32, d, false}, w.router_dx, w, s);
  terms.dense_f32 = w.router_dx;
  return terms;
}

bool CudaRouter::router_dx_for_combine(const CallArgs& a, const Needs& needs) const {
  return router_part_of_dx(a, needs) && (dx_from_picks(a, needs) || !tensor_core_backward());
}

void CudaRouter::add_router_dx(const CallArgs& a, const Needs& needs, const View& dx_rows, const RouterWork& w,
                               cudaStream_t s) const {
  const int64_t rows = dx_rows.ndim > 0 ? dx_rows.shape[0] : 0;
  if (rows == 0 || !router_part_of_dx(a, needs) || router_dx_for_combine(a, needs)) return;
  // dx rows (bf16, as the combine rounded them) += [hi | lo] [W_g; W_g], summed in fp32 and
  // rounded once more: in place through beta = 1. The fp32 dx rows this replaces cost 8 d bytes
  // per token of traffic and 4 d of workspace.
  const int64_t E = cfg_.num_experts, d = cfg_.hidden;
  gemm_.gemm(rows, d, 2 * E, {w.dlogits_pair, DType::kBF16, 2 * E, false}, {w.wg_pair, DType::kBF16, d, false},
             dx_rows.data, dx_rows.dtype, dx_rows.stride[0], 1.f, 1.f, w.gemm_ws, gemm::CublasLtGemm::kWorkspaceBytes,
             s);
}

void CudaRouter::backward_finish(const CallArgs& a, const Needs& needs, const RouterWork& w, cudaStream_t s) const {
  if (!needs.router_grad) return;
  const int64_t L = a.num_tokens, E = cfg_.num_experts, d = cfg_.hidden;
  if (a.d_logits.present) combine::store_f32_rows_cuda(w.dlogits, L, E, a.d_logits, s);
  if (a.mode != RoutingMode::kRouterWeight || !a.d_router_weight.present) return;
  const int64_t halves = tensor_core_backward() ? 2 : 1;
  if (L == 0) MOEBLAZE_CUDA_CHECK(cudaMemsetAsync(w.dwg_f32, 0, sizeof(float) * halves * E * d, s));
  combine::store_f32_rows_cuda(w.dwg_f32, E, d, a.d_router_weight, s, halves == 2 ? w.dwg_f32 + E * d : nullptr);
}

}  // namespace v0
}  // namespace moeblaze
