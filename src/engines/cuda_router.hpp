// The GPU router half of a step, shared by the CUDA engines: logits (given, or x W_g^T: through
// the narrow kernel for up to 8 experts, 16 at d <= 1024, else cuBLASLt), scores and top-k, or the caller's
// routing imported and checked on the device; the atomic-free routing plan; the router outputs
// and losses; and the router backward (d logits, dW_g, and dx's router part). Everything is
// enqueued on the caller's stream; nothing here synchronises, so a sync-free engine can use it
// as it is.
#pragma once

#include <cuda_runtime.h>

#include "combine/combine_cuda.hpp"
#include "core/args.hpp"
#include "core/config.hpp"
#include "core/memory_layout.hpp"
#include "core/needs.hpp"
#include "engines/router_window_rows.hpp"
#include "gemm/cublaslt.hpp"
#include "routing/router_cuda.hpp"
#include "util/align.hpp"

namespace moeblaze {
inline namespace v0 {

// The router's scratch in a call's workspace (nullptr where the pass needs none).
struct RouterWork {
  float* logits = nullptr;        // [L, E] fp32
  int32_t* error_flag = nullptr;  // [1] routing::kCallerIdsInvalid | routing::kPlanInvalid
  int64_t* seq_routed = nullptr;  // [1] SEQUENCE_LENGTHS' sequences with a routed token
  int64_t* seq_starts = nullptr;  // [L + 1]  SEQUENCE_LENGTHS' token starts
  double* seq_terms = nullptr;    // [L]       forward, route: the sequence-wise loss's per-token terms
  float* lse = nullptr;           // [L]       forward, route
  float* loss_scratch = nullptr;  //           forward, route
  void* plan_scratch = nullptr;   //           forward, route
  float* dlogits = nullptr;       // [L, E]    backward
  float* pick_dl = nullptr;       // [L, k]    backward from the gates alone: the picks' d logits (in logits' place)
  // Backward with ROUTER_WEIGHT (W: the tokens of one window). bf16 layers: the router GEMMs on
  // tensor cores, d logits as a bf16 hi/lo pair against W_g stacked twice; other dtypes: in fp32.
  void* dlogits_pair = nullptr;   // [W, 2E] bf16
  void* wg_pair = nullptr;        // [2E, d] bf16
  float* x_f32 = nullptr;         // [W, d]    fp32 path
  float* wg_f32 = nullptr;        // [E, d]    fp32 path
  float* router_dx = nullptr;     // [W, d]    fp32 path
  float* dwg_f32 = nullptr;       // [E, d]    summed over the windows
  void* gemm_ws = nullptr;        // cuBLASLt workspace, shared with the engine
};

class CudaRouter {
 public:
  CudaRouter(const LayerConfig& cfg, const gemm::CublasLtGemm& gemm) : cfg_(cfg), gemm_(gemm) {}

  // Appends the router's regions for `pass` to a carve (the engine's workspace layout); the
  // backward's per-window regions serve windows of at most `window` tokens. With
  // own_window_rows false they are left out (null) for the engine to place (place_window_rows).
  RouterWork carve(Carver& c, Pass pass, int64_t L, int64_t window, void* gemm_ws, bool own_window_rows = true) const;
  // The head of every CUDA engine's workspace (base: its start, or null to measure): the
  // cuBLASLt workspace (router.gemm_ws, shared with the engine's own cuBLASLt GEMMs), the
  // router's regions and, for inference and route (no saved buffer), the plan.
  RouterWork carve_head(Carver& c, Pass pass, int64_t L, int64_t window, void* base, RoutingPlan& plan,
                        bool own_window_rows = true) const;
  // The backward's per-window rows (the d-logit pairs, or dx's router part and the x rows in
  // fp32): live only inside backward_window, the combine and add_router_dx that follow it, so
  // an engine may place them in memory its window is done with. Their bytes for windows of `window`
  // tokens, and their placement from `at` (256-byte aligned; null measures).
  size_t window_rows_bytes(int64_t window) const;
  void place_window_rows(RouterWork& w, int64_t window, void* at) const;

  // Zeroes the error flag, routes (or imports and checks the caller's ids) into plan's ids and
  // gates, and builds the plan.
  void route_and_plan(const CallArgs& a, RoutingPlan& plan, const RouterWork& w, cudaStream_t s) const;
  // SEQUENCE_LENGTHS (when given) into w.seq_starts, checked on the device: a bad one sets
  // routing::kSequenceLengthsInvalid in the error flag, which the caller has zeroed.
  // route_and_plan and backward_begin call it; an engine that reads the flag at a host sync
  // before the router backward calls it first.
  void sequence_starts(const CallArgs& a, const RouterWork& w, cudaStream_t s) const;
  // TOPK_INDICES / TOPK_WEIGHTS / AUX_LOSS / Z_LOSS when routed, and TOKENS_PER_EXPERT.
  void write_outputs(const CallArgs& a, const RoutingPlan& plan, const RouterWork& w, cudaStream_t s) const;
  // The router backward from the gate gradients dg_tok [L k] (token order): d logits, dW_g, and
  // dx's router part: returned as the terms the dx combine adds (the picks' rows of W_g where d
  // logits follow from the gates, routing::grads_from_gates; d logits W_g into w.router_dx on
  // the fp32 path), or none, where add_router_dx adds it after the combine (tensor-core path).
  combine::TokenTerms backward(const CallArgs& a, const Needs& needs, const RoutingPlan& plan, const float* dg_tok,
                               const RouterWork& w, cudaStream_t s) const;
  // The same in token windows: begin once, then one call per window [t0, t0 + rows) in order
  // (dg_tok and router_dx are the window's; `first` starts the dW_g sum), then finish.
  void backward_begin(const CallArgs& a, const Needs& needs, const RouterWork& w, cudaStream_t s) const;
  combine::TokenTerms backward_window(const CallArgs& a, const Needs& needs, const RoutingPlan& plan, int64_t t0,
                                      int64_t rows, const float* dg_tok, bool first, const RouterWork& w,
                                      cudaStream_t s) const;
  void backward_finish(const CallArgs& a, const Needs& needs, const RouterWork& w, cudaStream_t s) const;
  // Whether backward_window (with rows) returns terms for the dx combine, known before the
  // window's kernels are enqueued: a layer whose GEMM stores dx at its tokens runs the combine
  // when it does.
  bool router_dx_for_combine(const CallArgs& a, const Needs& needs) const;
  // Tensor-core path (bf16 layers) with dense d logits: dx's router part added to dx's rows of
  // the last window (backward) or of the call, after the combine wrote them. Nothing otherwise.
  void add_router_dx(const CallArgs& a, const Needs& needs, const View& dx_rows, const RouterWork& w,
                     cudaStream_t s) const;

 private:
  void take_window_rows(Carver& c, RouterWork& w, int64_t window) const;
  void logits(const CallArgs& a, const RouterWork& w, cudaStream_t s) const;
  // The sequence-wise loss's device view (count 0 without SEQUENCE_LENGTHS); t0: a window's start.
  routing::SequenceBalance sequences(const CallArgs& a, const RoutingPlan& plan, const RouterWork& w, int64_t t0) const;
  // The backward's router GEMMs run on tensor cores (bf16 x and W_g).
  bool tensor_core_backward() const;
  // d logits from the saved gates (routing::grads_from_gates), and dx's router part as the
  // picks' rows of W_g in the dx combine (W_g in dx's dtype).
  bool from_gates() const;
  // The router's part of dx is wanted: x W_g^T routing with the router's gradient into dx.
  static bool router_part_of_dx(const CallArgs& a, const Needs& needs);
  bool dx_from_picks(const CallArgs& a, const Needs& needs) const;
  void gemm(int64_t M, int64_t N, int64_t K, const gemm::GemmOperand& A, const gemm::GemmOperand& B, float* C,
            const RouterWork& w, cudaStream_t s, float beta = 0.f) const;

  const LayerConfig& cfg_;
  const gemm::CublasLtGemm& gemm_;
};

}  // namespace v0
}  // namespace moeblaze
