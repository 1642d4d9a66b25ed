// The CUDA cuBLASLt engine: the shared GPU router half (engines/cuda_router), row gathers through the plan,
// one cuBLASLt GEMM per expert and pass, activation and combine kernels, the full backward.
// All work is stream-ordered on the caller's stream. Once per forward and once per backward it
// copies the E+1 expert offsets to the host (the per-expert GEMM shapes), which synchronises
// that stream: forward and backward cannot be captured in a CUDA graph, and say so
// (NOT_SUPPORTED) before they enqueue anything, leaving the caller's capture intact. route has
// no host sync and can be captured.
#include <cuda_runtime.h>

#include <algorithm>
#include <memory>
#include <vector>

#include "combine/combine_cuda.hpp"
#include "core/engine.hpp"
#include "core/memory_layout.hpp"
#include "core/needs.hpp"
#include "cuda/cuda_check.hpp"
#include "cuda/device_guard.hpp"
#include "cuda/saved_header_cuda.hpp"
#include "gemm/cublaslt.hpp"
#include "experts/expert_cuda.hpp"
#include "cuda/async_status.hpp"
#include "engines/cuda_router.hpp"
#include "routing/plan_check_cuda.hpp"
#include "routing/router_cuda.hpp"
#include "util/align.hpp"

namespace moeblaze {
inline namespace v0 {
namespace {

using gemm::GemmOperand;

// Forward and backward copy the expert offsets to the host, which a stream capture forbids (and
// which would invalidate the caller's capture): refuse before enqueuing anything.
void refuse_capture(cudaStream_t s, const char* what) {
  cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
  MOEBLAZE_CUDA_CHECK(cudaStreamIsCapturing(s, &status));
  if (status != cudaStreamCaptureStatusNone)
    fail(Status::kNotSupported,
         "the cuBLASLt engine's %s synchronises the stream once (expert offsets to the host) and cannot be captured "
         "in a CUDA graph; nothing was enqueued and the capture is intact (the fused engine is capturable)", what);
}

// Expert e's weight as a GEMM operand of logical shape [K x N] (transpose = false) or its
// transpose; a weight stored column-major (View::transposed) flips cuBLASLt's op instead of being
// copied.
GemmOperand weight_operand(const View& w, int64_t e, bool transpose) {
  return {w.row(e, 0), w.dtype, w.stride[1], transpose != w.transposed};
}

// STATUS: this engine checks on the host at its sync, so a call that returns reports 0,
// written in stream order after its work.
void report_ok(const CallArgs& a, cudaStream_t s) {
  if (a.status.present) MOEBLAZE_CUDA_CHECK(cudaMemsetAsync(a.status.data, 0, sizeof(int32_t), s));
}

// The host copy of the expert offsets: one buffer per thread that only grows, so a call
// allocates host memory only the first time its thread meets a larger E.
std::vector<int32_t>& thread_offsets(int64_t E) {
  thread_local std::vector<int32_t> offsets;
  if (offsets.size() < static_cast<size_t>(E + 1)) offsets.resize(static_cast<size_t>(E + 1));
  return offsets;
}

// What a call reads back at its one host sync.
struct HostState {
  explicit HostState(std::vector<int32_t>& o) : offsets(o) {}
  std::vector<int32_t>& offsets;  // [E + 1] valid (the calling thread's buffer)
  int32_t error_flag = 0;        // routing::kCallerIdsInvalid | routing::kPlanInvalid
  SavedHeader header{};          // backward: the saved buffer's header
};

struct CublasLtWork {
  RouterWork router;             // logits, flag, plan scratch; router backward scratch
  RoutingPlan plan;              // inference / route: the plan lives in the workspace
  float* gate_pos = nullptr;     // [L k] gate of each position (expert order)
  void* xg = nullptr;            // [L k, d] gathered x
  void* pre = nullptr;           // [L k, g h] when not saved
  void* act = nullptr;           // [L k, h] when not saved
  void* out = nullptr;           // [L k, d] forward expert outputs
  void* dyg = nullptr;           // [L k, d] gathered dy (then scaled by the gate)
  void* dpre = nullptr;          // [L k, g h]
  void* dx_part = nullptr;       // [L k, d] per-slot dx contributions
  float* dg_pos = nullptr;       // [L k]
  float* dg_tok = nullptr;       // [L k]
  void* gemm_ws = nullptr;
  size_t bytes = 0;
};

class CublasLtEngine final : public Engine {
 public:
  explicit CublasLtEngine(const LayerConfig& cfg) : cfg_(cfg) {
    cuda::DeviceGuard guard(cfg_.device_id);
    gemm_ = std::make_unique<gemm::CublasLtGemm>();
    router_ = std::make_unique<CudaRouter>(cfg_, *gemm_);
  }
  EngineKind kind() const override { return EngineKind::kCudaCublasLt; }
  size_t workspace_size(Pass pass, int64_t L) const override { return carve(pass, L, nullptr).bytes; }
  void forward(Pass pass, const CallArgs& a, void* ws, void* saved, void* stream) const override;
  void backward(const CallArgs& a, void* saved, bool last_use, void* ws, void* stream) const override;
  void route(const CallArgs& a, void* ws, void* stream) const override;

 private:
  CublasLtWork carve(Pass pass, int64_t L, void* base) const;
  HostState sync_host(const RoutingPlan& plan, const CublasLtWork& w, const SavedHeader* header, cudaStream_t s) const;
  // pre = x_e W_gate_up[e] for every expert with tokens (xg: gathered x rows).
  void up_projection(const CallArgs& a, const std::vector<int32_t>& off, const char* xg, char* pre, const CublasLtWork& w,
                     cudaStream_t s) const;
  // out[e] = op(A_e)^T B_e over each expert's rows (a weight gradient), or zero for experts
  // without tokens (left alone when accumulating).
  void weight_gradient(const View& out, const std::vector<int32_t>& off, int64_t rows, int64_t cols, const char* a_rows,
                       int64_t a_ld, const char* b_rows, int64_t b_ld, const CublasLtWork& w, cudaStream_t s) const;
  void gemm(int64_t M, int64_t N, int64_t K, const GemmOperand& A, const GemmOperand& B, void* C, DType ct, int64_t ldc,
            float beta, const CublasLtWork& w, cudaStream_t s) const {
    gemm_->gemm(M, N, K, A, B, C, ct, ldc, 1.f, beta, w.gemm_ws, gemm::CublasLtGemm::kWorkspaceBytes, s);
  }

  LayerConfig cfg_;
  std::unique_ptr<gemm::CublasLtGemm> gemm_;
  std::unique_ptr<CudaRouter> router_;
};

CublasLtWork CublasLtEngine::carve(Pass pass, int64_t L, void* base) const {
  Carver c(base);
  CublasLtWork w;
  const int64_t d = cfg_.hidden, h = cfg_.ffn_hidden, gh = cfg_.gate_up_cols();
  const size_t P = static_cast<size_t>(L * cfg_.top_k), es = dtype_size(cfg_.act_dtype);
  w.router = router_->carve_head(c, pass, L, L, base, w.plan);
  w.gemm_ws = w.router.gemm_ws;
  if (pass == Pass::kRoute) {
    w.bytes = c.size();
    return w;
  }
  w.gate_pos = c.take<float>(P);
  w.xg = c.take<char>(P * static_cast<size_t>(d) * es);
  // pre: only where nothing saved holds it; act: the forward's down-GEMM input, or in
  // backward g * act (the dW_down operand).
  if (pass == Pass::kForwardInference || cfg_.save_policy == SavePolicy::kRecomputeUp)
    w.pre = c.take<char>(P * static_cast<size_t>(gh) * es);
  if (pass != Pass::kForwardTraining || cfg_.save_policy != SavePolicy::kSaveAll)
    w.act = c.take<char>(P * static_cast<size_t>(h) * es);
  if (pass != Pass::kBackward) {
    w.out = c.take<char>(P * static_cast<size_t>(d) * es);
  } else {
    w.dyg = c.take<char>(P * static_cast<size_t>(d) * es);
    w.dpre = c.take<char>(P * static_cast<size_t>(gh) * es);
    w.dx_part = c.take<char>(P * static_cast<size_t>(d) * es);
    w.dg_pos = c.take<float>(P);
    w.dg_tok = c.take<float>(P);
  }
  w.bytes = c.size();
  return w;
}

HostState CublasLtEngine::sync_host(const RoutingPlan& plan, const CublasLtWork& w, const SavedHeader* header, cudaStream_t s) const {
  const int64_t E = cfg_.num_experts;
  HostState h(thread_offsets(E));
  MOEBLAZE_CUDA_CHECK(cudaMemcpyAsync(h.offsets.data(), plan.expert_token_offsets, sizeof(int32_t) * (E + 1), cudaMemcpyDeviceToHost, s));
  MOEBLAZE_CUDA_CHECK(cudaMemcpyAsync(&h.error_flag, w.router.error_flag, sizeof(int32_t), cudaMemcpyDeviceToHost, s));
  if (header) MOEBLAZE_CUDA_CHECK(cudaMemcpyAsync(&h.header, header, sizeof(SavedHeader), cudaMemcpyDeviceToHost, s));
  MOEBLAZE_CUDA_CHECK(cudaStreamSynchronize(s));
  return h;
}

// The device's verdict on SEQUENCE_LENGTHS, read at the engine's sync before any output is written.
void check_sequence_flag(int32_t error_flag) {
  if (error_flag & routing::kSequenceLengthsInvalid)
    fail(Status::kInvalidArgument,
         "SEQUENCE_LENGTHS holds a length outside [1, tokens] or does not sum to the call's tokens; nothing was written");
}

// Calls fn(e, first position, rows) for every expert with tokens.
template <class F>
void for_each_expert(const std::vector<int32_t>& off, int64_t E, F&& fn) {
  for (int64_t e = 0; e < E; ++e)
    if (off[e + 1] > off[e]) fn(e, static_cast<int64_t>(off[e]), static_cast<int64_t>(off[e + 1] - off[e]));
}

void CublasLtEngine::up_projection(const CallArgs& a, const std::vector<int32_t>& off, const char* xg, char* pre,
                               const CublasLtWork& w, cudaStream_t s) const {
  const int64_t d = cfg_.hidden, gh = cfg_.gate_up_cols(), es = static_cast<int64_t>(dtype_size(cfg_.act_dtype));
  for_each_expert(off, cfg_.num_experts, [&](int64_t e, int64_t p0, int64_t n) {
    gemm(n, gh, d, {xg + p0 * d * es, cfg_.act_dtype, d, false},
         weight_operand(a.w_gate_up, e, false), pre + p0 * gh * es, cfg_.act_dtype, gh,
         0.f, w, s);
  });
}

void CublasLtEngine::weight_gradient(const View& out, const std::vector<int32_t>& off, int64_t rows, int64_t cols,
                                 const char* a_rows, int64_t a_ld, const char* b_rows, int64_t b_ld, const CublasLtWork& w,
                                 cudaStream_t s) const {
  const DType dt = cfg_.act_dtype;
  const int64_t es = static_cast<int64_t>(dtype_size(dt));
  for (int64_t e = 0; e < cfg_.num_experts; ++e) {
    const int64_t p0 = off[e], n = off[e + 1] - p0;
    if (n == 0) {
      if (!out.accumulate)  // the view's physical rows (row-major or transposed alike)
        MOEBLAZE_CUDA_CHECK(cudaMemset2DAsync(out.row(e, 0), static_cast<size_t>(out.stride[1]) * out.elem(), 0,
                                              static_cast<size_t>(out.shape[2]) * out.elem(),
                                              static_cast<size_t>(out.shape[1]), s));
      continue;
    }
    const GemmOperand A{a_rows + p0 * a_ld * es, dt, a_ld, true}, B{b_rows + p0 * b_ld * es, dt, b_ld, false};
    const float beta = out.accumulate ? 1.f : 0.f;
    if (out.transposed)  // the caller stores out[e]^T = B^T A: swap the operands
      gemm(cols, rows, n, {B.data, dt, b_ld, true}, {A.data, dt, a_ld, false}, out.row(e, 0), out.dtype, out.stride[1], beta,
           w, s);
    else
      gemm(rows, cols, n, A, B, out.row(e, 0), out.dtype, out.stride[1], beta, w, s);
  }
}

void CublasLtEngine::route(const CallArgs& a, void* ws, void* stream) const {
  cuda::DeviceGuard guard(cfg_.device_id);
  cudaStream_t s = static_cast<cudaStream_t>(stream);
  CublasLtWork w = carve(Pass::kRoute, a.num_tokens, ws);
  router_->route_and_plan(a, w.plan, w.router, s);
  router_->write_outputs(a, w.plan, w.router, s);
  cuda::write_status(w.router.error_flag, a.status, s);  // SEQUENCE_LENGTHS, checked on the device
}

void CublasLtEngine::forward(Pass pass, const CallArgs& a, void* ws, void* saved, void* stream) const {
  cuda::DeviceGuard guard(cfg_.device_id);
  cudaStream_t s = static_cast<cudaStream_t>(stream);
  const int64_t L = a.num_tokens, E = cfg_.num_experts, k = cfg_.top_k, d = cfg_.hidden, h = cfg_.ffn_hidden;
  const int64_t gh = cfg_.gate_up_cols(), P = L * k;
  const DType dt = cfg_.act_dtype;
  const int64_t es = static_cast<int64_t>(dtype_size(dt));
  refuse_capture(s, "forward");
  CublasLtWork w = carve(pass, L, ws);
  SavedRegions sv;
  if (pass == Pass::kForwardTraining) {
    sv = carve_saved(cfg_, L, saved);
    w.plan = sv.plan;
    // Until this forward completes, the buffer vouches for nothing.
    MOEBLAZE_CUDA_CHECK(cudaMemsetAsync(sv.header, 0, sizeof(SavedHeader), s));
  }
  RoutingPlan& plan = w.plan;
  router_->route_and_plan(a, plan, w.router, s);
  const HostState host = sync_host(plan, w, nullptr, s);
  const std::vector<int32_t>& off = host.offsets;
  if (host.error_flag & routing::kCallerIdsInvalid)
    fail(Status::kInvalidArgument, "TOPK_INDICES holds an expert id outside [0, %lld) or repeated within a token; nothing was written",
         static_cast<long long>(E));
  check_sequence_flag(host.error_flag);
  router_->write_outputs(a, plan, w.router, s);

  char* pre = static_cast<char*>(sv.preact ? sv.preact : w.pre);
  char* act = static_cast<char*>(sv.act ? sv.act : w.act);
  char* xg = static_cast<char*>(w.xg);
  char* out = static_cast<char*>(w.out);
  experts::gather_rows_cuda(a.x, plan.expert_token_indices, P, d, xg, s);
  up_projection(a, off, xg, pre, w, s);
  experts::activation_forward_cuda(cfg_.activation, dt, P, h, pre, gh, act, s);
  for_each_expert(off, E, [&](int64_t e, int64_t p0, int64_t n) {  // O = act W_down[e]
    gemm(n, d, h, {act + p0 * h * es, dt, h, false}, weight_operand(a.w_down, e, false),
         out + p0 * d * es, dt, d, 0.f, w, s);
  });
  combine::combine_rows_cuda(plan.token_index_map, plan.gates, L, k, d, out, {}, a.y, s);
  if (sv.header) cuda::store_saved_header(make_saved_header(cfg_, L), sv.header, s);
  report_ok(a, s);
}

void CublasLtEngine::backward(const CallArgs& a, void* saved, bool last_use, void* ws, void* stream) const {
  cuda::DeviceGuard guard(cfg_.device_id);
  cudaStream_t s = static_cast<cudaStream_t>(stream);
  const int64_t L = a.num_tokens, E = cfg_.num_experts, k = cfg_.top_k, d = cfg_.hidden, h = cfg_.ffn_hidden;
  const int64_t gh = cfg_.gate_up_cols(), P = L * k;
  const DType dt = cfg_.act_dtype;
  const int64_t es = static_cast<int64_t>(dtype_size(dt));
  refuse_capture(s, "backward");
  CublasLtWork w = carve(Pass::kBackward, L, ws);
  const SavedRegions sv = carve_saved(cfg_, L, saved);
  const RoutingPlan& plan = sv.plan;
  // The saved buffer is the caller's: its header and plan are checked (the plan on the device,
  // reading only in-range indices) and read back at this engine's one sync, before any work
  // that follows an index in it is enqueued.
  MOEBLAZE_CUDA_CHECK(cudaMemsetAsync(w.router.error_flag, 0, sizeof(int32_t), s));
  routing::validate_plan_cuda(plan, L, k, E, /*empty_slots=*/true, w.router.error_flag, s);  // a TOKEN_MASK leaves empty slots
  router_->sequence_starts(a, w.router, s);
  const HostState host = sync_host(plan, w, sv.header, s);
  check_sequence_flag(host.error_flag);
  check_saved_header(host.header, cfg_, L);
  if (host.error_flag & routing::kPlanInvalid)
    fail(Status::kInvalidArgument,
         "saved routing plan is inconsistent (offsets, expert ids or index maps out of range or not a permutation); "
         "the saved buffer was not written by this handle's forward for these inputs");
  const std::vector<int32_t>& off = host.offsets;

  const Needs needs = needs_of(cfg_, Pass::kBackward, a);
  char* xg = static_cast<char*>(w.xg);
  char* pre = static_cast<char*>(sv.preact ? sv.preact : w.pre);
  char* gact = static_cast<char*>(w.act);
  char* dyg = static_cast<char*>(w.dyg);
  char* dx_part = static_cast<char*>(w.dx_part);
  char* dpre = static_cast<char*>(w.dpre);

  experts::gates_to_positions_cuda(plan, L, k, w.gate_pos, s);
  if (needs.recompute_up || a.d_w_gate_up.present) experts::gather_rows_cuda(a.x, plan.expert_token_indices, P, d, xg, s);
  if (needs.recompute_up) up_projection(a, off, xg, pre, w, s);  // the up GEMM again

  // dact = dy W_down^T into the first h columns of each dpre row; then one fused pass gives
  // dg, dpre (in place) and g * act (recomputed from pre, so no saved act is needed).
  experts::gather_rows_cuda(a.dy, plan.expert_token_indices, P, d, dyg, s);
  for_each_expert(off, E, [&](int64_t e, int64_t p0, int64_t n) {
    gemm(n, h, d, {dyg + p0 * d * es, dt, d, false}, weight_operand(a.w_down, e, true),
         dpre + p0 * gh * es, dt, gh, 0.f, w, s);
  });
  experts::activation_backward_cuda(cfg_.activation, dt, P, h, pre, nullptr, w.gate_pos, dpre, gh, dpre, gact, w.dg_pos, s);

  if (a.d_w_down.present) weight_gradient(a.d_w_down, off, h, d, gact, h, dyg, d, w, s);            // (g act)^T dy
  if (a.d_w_gate_up.present) weight_gradient(a.d_w_gate_up, off, d, gh, xg, d, dpre, gh, w, s);     // x^T dpre
  if (a.dx.present)  // per-slot dx contributions
    for_each_expert(off, E, [&](int64_t e, int64_t p0, int64_t n) {
      gemm(n, d, gh, {dpre + p0 * gh * es, dt, gh, false}, weight_operand(a.w_gate_up, e, true),
           dx_part + p0 * d * es, dt, d, 0.f, w, s);
    });

  combine::to_token_order_cuda(plan.token_index_map, L, k, w.dg_pos, w.dg_tok, s);
  if (a.d_topk_weights.present) combine::store_f32_rows_cuda(w.dg_tok, L, k, a.d_topk_weights, s);

  const combine::TokenTerms router_dx = router_->backward(a, needs, plan, w.dg_tok, w.router, s);
  if (a.dx.present) {
    combine::combine_rows_cuda(plan.token_index_map, nullptr, L, k, d, dx_part, router_dx, a.dx, s);
    router_->add_router_dx(a, needs, a.dx, w.router, s);
  }
  if (last_use) cuda::store_saved_header(spent_saved_header(cfg_, L), sv.header, s);
  report_ok(a, s);
}

}  // namespace

std::unique_ptr<Engine> make_cublaslt_engine(const LayerConfig& cfg) {
  if (cfg.act_dtype != cfg.weight_dtype)
    fail(Status::kNotSupported, "the cuBLASLt engine needs activation_dtype == weight_dtype (got %s and %s)",
         dtype_name(cfg.act_dtype), dtype_name(cfg.weight_dtype));
  return std::make_unique<CublasLtEngine>(cfg);
}

}  // namespace v0
}  // namespace moeblaze
