// The CUDA fused engine (sm_90a): the shared GPU router half (engines/cuda_router), then the
// paper's structure on the sm_90a grouped GEMMs (gemm/sm90), which read the expert ranges from
// the device offsets of the routing plan:
//   forward:  up GEMM gathering x rows, activation (and the save policy's pre) in its epilogue;
//             down GEMM with the gate in its epilogue; deterministic combine through the plan.
//   backward: dact GEMM gathering dy rows; the fused activation backward (dg, dpre, g * act);
//             varlen-K weight gradients gathering x and dy; dx GEMM; router backward; combine.
// Nothing synchronises the host and nothing allocates: every call can be captured in a CUDA
// graph. Bad caller ids and saved buffers that fail their checks are found on the device; the
// call then fills its outputs with NaN and reports through STATUS (docs/errors.md).
#include <cuda_runtime.h>

#include <memory>

#include "combine/combine_cuda.hpp"
#include "core/engine.hpp"
#include "core/memory_layout.hpp"
#include "core/needs.hpp"
#include "cuda/async_status.hpp"
#include "cuda/cuda_check.hpp"
#include "cuda/device_guard.hpp"
#include "cuda/saved_header_cuda.hpp"
#include "engines/cuda_router.hpp"
#include "experts/expert_cuda.hpp"
#include "gemm/cublaslt.hpp"
#include "gemm/sm90/grouped_gemm.hpp"
#include "gemm/sm90/weight_grad.hpp"
#include "routing/plan_check_cuda.hpp"
#include "util/align.hpp"

namespace moeblaze {
inline namespace v0 {
namespace {

namespace sm90 = gemm::sm90;

struct FusedWork {
  RouterWork router;              // logits, error flag, plan scratch; router backward scratch
  RoutingPlan plan;               // inference / route: the plan lives in the workspace
  void* sched = nullptr;          // the GEMMs' schedule (sm90::schedule_bytes)
  float* gate_pos = nullptr;      // [L k] gate of each position (expert order)
  void* pre = nullptr;            // backward, RECOMPUTE_UP: [L k, g h]
  void* act = nullptr;            // forward: [L k, h] unless saved; backward: g * act
  void* out = nullptr;            // forward: [L k, d] gate-scaled expert outputs
  void* dpre = nullptr;           // backward: [L k, g h]
  void* dx_part = nullptr;        // backward: [L k, d]
  float* dg_pos = nullptr;        // backward: [L k]
  float* dg_tok = nullptr;        // backward: [L k]
  size_t bytes = 0;
};

// A per-call layout the kernels cannot take (strides or alignment of the caller's tensors) is
// refused before anything is enqueued.
void require(const char* why, const char* gemm) {
  if (why)
    fail(Status::kNotSupported,
         "the fused engine's %s cannot take these tensors: %s (a handle with MOEBLAZE_ENGINE_CUDA_CUBLASLT can)", gemm, why);
}

class FusedEngine final : public Engine {
 public:
  explicit FusedEngine(const LayerConfig& cfg) : cfg_(cfg) {
    cuda::DeviceGuard guard(cfg_.device_id);
    gemm_ = std::make_unique<gemm::CublasLtGemm>();
    router_ = std::make_unique<CudaRouter>(cfg_, *gemm_);
  }
  EngineKind kind() const override { return EngineKind::kCudaFused; }
  size_t workspace_size(Pass pass, int64_t L) const override { return carve(pass, L, nullptr).bytes; }
  void forward(Pass pass, const CallArgs& a, void* ws, void* saved, void* stream) const override;
  void backward(const CallArgs& a, const void* saved, void* ws, void* stream) const override;
  void route(const CallArgs& a, void* ws, void* stream) const override;

 private:
  FusedWork carve(Pass pass, int64_t L, void* base) const;
  // up: x rows gathered through the plan times W_gate_up[e] ([d, g h]), n = h per half.
  sm90::GroupedGemmParams up_gemm(const CallArgs& a, const RoutingPlan& plan) const;
  // A [L k, K] in expert order (no gather) times a weight, as grouped-GEMM parameters.
  sm90::GroupedGemmParams expert_order_gemm(const void* a, int64_t lda, int64_t L, const View& w, sm90::Major major,
                                            int64_t n, int64_t k) const;

  LayerConfig cfg_;
  std::unique_ptr<gemm::CublasLtGemm> gemm_;  // the router's logits GEMM
  std::unique_ptr<CudaRouter> router_;
};

FusedWork FusedEngine::carve(Pass pass, int64_t L, void* base) const {
  Carver c(base);
  FusedWork w;
  const int64_t d = cfg_.hidden, h = cfg_.ffn_hidden, gh = cfg_.gate_up_cols();
  const size_t P = static_cast<size_t>(L * cfg_.top_k), es = dtype_size(cfg_.act_dtype);
  void* gemm_ws = c.take<char>(gemm::CublasLtGemm::kWorkspaceBytes);
  w.router = router_->carve(c, pass, L, gemm_ws);
  if (pass == Pass::kForwardInference || pass == Pass::kRoute) {
    SavedRegions r = carve_saved(cfg_, L, base ? static_cast<char*>(base) + c.size() : nullptr, false);
    c.take<char>(r.bytes);
    w.plan = r.plan;
  }
  if (pass == Pass::kRoute) {
    w.bytes = c.size();
    return w;
  }
  w.sched = c.take<char>(sm90::schedule_bytes(cfg_.num_experts));
  w.gate_pos = c.take<float>(P);
  if (pass == Pass::kBackward) {
    if (cfg_.save_policy == SavePolicy::kRecomputeUp) w.pre = c.take<char>(P * static_cast<size_t>(gh) * es);
    w.act = c.take<char>(P * static_cast<size_t>(h) * es);
    w.dpre = c.take<char>(P * static_cast<size_t>(gh) * es);
    w.dx_part = c.take<char>(P * static_cast<size_t>(d) * es);
    w.dg_pos = c.take<float>(P);
    w.dg_tok = c.take<float>(P);
  } else {
    // pre is stored only where the save policy keeps it; act only where nothing saved holds it.
    if (pass != Pass::kForwardTraining || cfg_.save_policy != SavePolicy::kSaveAll)
      w.act = c.take<char>(P * static_cast<size_t>(h) * es);
    w.out = c.take<char>(P * static_cast<size_t>(d) * es);
  }
  w.bytes = c.size();
  return w;
}

sm90::GroupedGemmParams FusedEngine::up_gemm(const CallArgs& a, const RoutingPlan& plan) const {
  sm90::GroupedGemmParams p;
  p.n = static_cast<int32_t>(cfg_.ffn_hidden);
  p.k = static_cast<int32_t>(cfg_.hidden);
  p.gated = is_gated(cfg_.activation);
  p.b_major = sm90::Major::kMN;
  p.a = a.x.data;
  p.lda = a.x.stride[0];
  p.a_index = plan.expert_token_indices;
  p.a_rows = static_cast<int32_t>(a.num_tokens);
  p.b = a.w_gate_up.data;
  p.ldb = a.w_gate_up.stride[1];
  p.b_expert_stride = a.w_gate_up.stride[0];
  return p;
}

sm90::GroupedGemmParams FusedEngine::expert_order_gemm(const void* a, int64_t lda, int64_t L, const View& w,
                                                       sm90::Major major, int64_t n, int64_t k) const {
  sm90::GroupedGemmParams p;
  p.n = static_cast<int32_t>(n);
  p.k = static_cast<int32_t>(k);
  p.b_major = major;
  p.a = a;
  p.lda = lda;
  p.a_rows = static_cast<int32_t>(L * cfg_.top_k);
  p.b = w.data;
  p.ldb = w.stride[1];
  p.b_expert_stride = w.stride[0];
  return p;
}

void FusedEngine::route(const CallArgs& a, void* ws, void* stream) const {
  cuda::DeviceGuard guard(cfg_.device_id);
  cudaStream_t s = static_cast<cudaStream_t>(stream);
  FusedWork w = carve(Pass::kRoute, a.num_tokens, ws);
  router_->route_and_plan(a, w.plan, w.router, s);
  router_->write_outputs(a, w.plan, w.router, s);
  cuda::write_status(w.router.error_flag, a.status, s);
}

void FusedEngine::forward(Pass pass, const CallArgs& a, void* ws, void* saved, void* stream) const {
  cuda::DeviceGuard guard(cfg_.device_id);
  cudaStream_t s = static_cast<cudaStream_t>(stream);
  const int64_t L = a.num_tokens, E = cfg_.num_experts, k = cfg_.top_k, d = cfg_.hidden, h = cfg_.ffn_hidden;
  const int64_t gh = cfg_.gate_up_cols(), P = L * k;
  const DType dt = cfg_.act_dtype;
  FusedWork w = carve(pass, L, ws);
  SavedRegions sv;
  if (pass == Pass::kForwardTraining) {
    sv = carve_saved(cfg_, L, saved);
    w.plan = sv.plan;
  }
  RoutingPlan& plan = w.plan;
  void* act = sv.act ? sv.act : w.act;

  sm90::GroupedGemmParams up = up_gemm(a, plan);
  sm90::EpilogueParams up_epi;
  up_epi.kind = sm90::EpilogueKind::kActivation;
  up_epi.activation = cfg_.activation;
  up_epi.pre = sv.preact;  // null unless the policy saves it: nothing else reads it
  up_epi.ld_pre = gh;
  up_epi.act = act;
  up_epi.ld_act = h;
  sm90::GroupedGemmParams down = expert_order_gemm(act, h, L, a.w_down, sm90::Major::kMN, d, h);
  sm90::EpilogueParams down_epi;
  down_epi.c = w.out;
  down_epi.ldc = d;
  down_epi.row_scale = w.gate_pos;  // the gate, applied before rounding
  require(sm90::unsupported_reason(dt, up, up_epi), "up GEMM");
  require(sm90::unsupported_reason(dt, down, down_epi), "down GEMM");

  if (sv.header)  // until this forward completes, the buffer vouches for nothing
    MOEBLAZE_CUDA_CHECK(cudaMemsetAsync(sv.header, 0, sizeof(SavedHeader), s));
  router_->route_and_plan(a, plan, w.router, s);
  router_->write_outputs(a, plan, w.router, s);
  up.sched = down.sched = sm90::make_schedule(plan.expert_token_offsets, E, P, w.sched, s);
  experts::gates_to_positions_cuda(plan, L, k, w.gate_pos, s);
  sm90::grouped_gemm(dt, up, up_epi, 0, s);
  sm90::grouped_gemm(dt, down, down_epi, 0, s);
  combine::combine_rows_cuda(plan.token_index_map, nullptr, L, k, d, w.out, nullptr, a.y, s);
  if (sv.header) cuda::store_saved_header(make_saved_header(cfg_, L), sv.header, s, w.router.error_flag);
  cuda::poison_if_flagged(w.router.error_flag, a.y, s);
  cuda::write_status(w.router.error_flag, a.status, s);
}

void FusedEngine::backward(const CallArgs& a, const void* saved, void* ws, void* stream) const {
  cuda::DeviceGuard guard(cfg_.device_id);
  cudaStream_t s = static_cast<cudaStream_t>(stream);
  const int64_t L = a.num_tokens, E = cfg_.num_experts, k = cfg_.top_k, d = cfg_.hidden, h = cfg_.ffn_hidden;
  const int64_t gh = cfg_.gate_up_cols(), P = L * k;
  const DType dt = cfg_.act_dtype;
  FusedWork w = carve(Pass::kBackward, L, ws);
  const SavedRegions sv = carve_saved(cfg_, L, const_cast<void*>(saved));
  const RoutingPlan& plan = sv.plan;
  const Needs needs = needs_of(cfg_, Pass::kBackward, a);
  void* pre = sv.preact ? sv.preact : w.pre;
  int32_t* flag = w.router.error_flag;

  // Recomputed pre-activations (RECOMPUTE_UP): the up GEMM again, storing pre only.
  sm90::GroupedGemmParams up = up_gemm(a, plan);
  sm90::EpilogueParams up_epi;
  up_epi.kind = sm90::EpilogueKind::kActivation;
  up_epi.activation = cfg_.activation;
  up_epi.pre = pre;
  up_epi.ld_pre = gh;
  // dact = dy W_down^T (dy rows gathered through the plan) into the first h columns of dpre.
  sm90::GroupedGemmParams dact;
  dact.n = static_cast<int32_t>(h);
  dact.k = static_cast<int32_t>(d);
  dact.b_major = sm90::Major::kK;
  dact.a = a.dy.data;
  dact.lda = a.dy.stride[0];
  dact.a_index = plan.expert_token_indices;
  dact.a_rows = static_cast<int32_t>(L);
  dact.b = a.w_down.data;
  dact.ldb = a.w_down.stride[1];
  dact.b_expert_stride = a.w_down.stride[0];
  sm90::EpilogueParams dact_epi;
  dact_epi.c = w.dpre;
  dact_epi.ldc = gh;
  // dx parts = dpre W_gate_up^T, per position.
  sm90::GroupedGemmParams dxg = expert_order_gemm(w.dpre, gh, L, a.w_gate_up, sm90::Major::kK, d, gh);
  sm90::EpilogueParams dx_epi;
  dx_epi.c = w.dx_part;
  dx_epi.ldc = d;
  // dW_down[e] = (g act)^T dy and dW_gate_up[e] = x^T dpre over the expert's positions.
  sm90::WeightGradParams dwd;
  dwd.m = static_cast<int32_t>(h);
  dwd.n = static_cast<int32_t>(d);
  dwd.a = w.act;
  dwd.lda = h;
  dwd.a_rows = static_cast<int32_t>(P);
  dwd.b = a.dy.data;
  dwd.ldb = a.dy.stride[0];
  dwd.b_index = plan.expert_token_indices;
  dwd.b_rows = static_cast<int32_t>(L);
  dwd.c = a.d_w_down.data;
  dwd.ldc = a.d_w_down.stride[1];
  dwd.c_expert_stride = a.d_w_down.stride[0];
  dwd.accumulate = a.d_w_down.accumulate;
  sm90::WeightGradParams dwgu;
  dwgu.m = static_cast<int32_t>(d);
  dwgu.n = static_cast<int32_t>(gh);
  dwgu.a = a.x.data;
  dwgu.lda = a.x.stride[0];
  dwgu.a_index = plan.expert_token_indices;
  dwgu.a_rows = static_cast<int32_t>(L);
  dwgu.b = w.dpre;
  dwgu.ldb = gh;
  dwgu.b_rows = static_cast<int32_t>(P);
  dwgu.c = a.d_w_gate_up.data;
  dwgu.ldc = a.d_w_gate_up.stride[1];
  dwgu.c_expert_stride = a.d_w_gate_up.stride[0];
  dwgu.accumulate = a.d_w_gate_up.accumulate;
  if (needs.recompute_up) require(sm90::unsupported_reason(dt, up, up_epi), "recomputed up GEMM");
  require(sm90::unsupported_reason(dt, dact, dact_epi), "dact GEMM");
  if (a.dx.present) require(sm90::unsupported_reason(dt, dxg, dx_epi), "dx GEMM");
  if (a.d_w_down.present) require(sm90::weight_grad_unsupported_reason(dt, dwd), "dW_down GEMM");
  if (a.d_w_gate_up.present) require(sm90::weight_grad_unsupported_reason(dt, dwgu), "dW_gate_up GEMM");

  // The saved buffer is the caller's: its header and plan are checked on the device; every
  // kernel below keeps its indices in bounds whatever the plan holds, and a failed check turns
  // the outputs into NaN at the end.
  MOEBLAZE_CUDA_CHECK(cudaMemsetAsync(flag, 0, sizeof(int32_t), s));
  cuda::check_saved_header_cuda(make_saved_header(cfg_, L), sv.header, flag, routing::kSavedHeaderInvalid, s);
  routing::validate_plan_cuda(plan, L, k, E, flag, s);
  const sm90::Schedule sched = sm90::make_schedule(plan.expert_token_offsets, E, P, w.sched, s);
  up.sched = dact.sched = dxg.sched = dwd.sched = dwgu.sched = sched;
  experts::gates_to_positions_cuda(plan, L, k, w.gate_pos, s);
  if (needs.recompute_up) sm90::grouped_gemm(dt, up, up_epi, 0, s);
  sm90::grouped_gemm(dt, dact, dact_epi, 0, s);
  // dg, dpre (in place) and g * act (recomputed from pre) in one pass.
  experts::activation_backward_cuda(cfg_.activation, dt, P, h, pre, w.gate_pos, w.dpre, w.act, w.dg_pos, s);
  if (a.d_w_down.present) sm90::weight_grad(dt, dwd, s);
  if (a.d_w_gate_up.present) sm90::weight_grad(dt, dwgu, s);
  if (a.dx.present) sm90::grouped_gemm(dt, dxg, dx_epi, 0, s);

  combine::to_token_order_cuda(plan, L, k, w.dg_pos, w.dg_tok, s);
  if (a.d_topk_weights.present) combine::store_f32_rows_cuda(w.dg_tok, L, k, a.d_topk_weights, s);
  const bool router_dx = router_->backward(a, needs, plan, w.dg_tok, w.router, s);
  if (a.dx.present)
    combine::combine_rows_cuda(plan.token_index_map, nullptr, L, k, d, w.dx_part, router_dx ? w.router.router_dx : nullptr,
                               a.dx, s);
  for (const View* out : {&a.dx, &a.d_w_gate_up, &a.d_w_down, &a.d_topk_weights, &a.d_logits, &a.d_router_weight})
    cuda::poison_if_flagged(flag, *out, s);
  cuda::write_status(flag, a.status, s);
}

}  // namespace

// Refusals are per configuration (src/engines/registry.cpp); per-call layouts are checked above.
const char* fused_engine_refuses(const LayerConfig& cfg, int sm_major) {
  if (sm_major != 9) return "it runs on sm_90 (Hopper) GPUs only";
  if (cfg.act_dtype != cfg.weight_dtype) return "it needs activation_dtype == weight_dtype";
  if (cfg.act_dtype != DType::kBF16 && cfg.act_dtype != DType::kF16) return "it takes bf16 or fp16 (fp32 runs on cuBLASLt)";
  if (cfg.hidden % 8 || cfg.ffn_hidden % 8) return "it needs hidden and ffn_hidden to be multiples of 8";
  return nullptr;
}

std::unique_ptr<Engine> make_fused_engine(const LayerConfig& cfg) { return std::make_unique<FusedEngine>(cfg); }

}  // namespace v0
}  // namespace moeblaze
