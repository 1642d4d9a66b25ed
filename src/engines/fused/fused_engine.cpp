// The CUDA fused engine (sm_90a): the shared GPU router half (engines/cuda_router), then the
// paper's structure on the sm_90a grouped GEMMs (gemm/sm90), which read the expert ranges from
// the device offsets of a routing plan. The expert MLPs run on windows of the call's tokens
// (engines/fused/window.hpp), each seen through the call's plan (routing/window_plan_cuda), so
// the per-row workspace is sized by the window:
//   forward, per window:  up GEMM gathering x rows, activation (and the save policy's pre, at
//             the call's positions) in its epilogue; down GEMM with the gate in its epilogue;
//             deterministic combine of the window's tokens (top-1: the down GEMM stores y's
//             rows at their tokens, and the dx GEMM dx's likewise; no combine).
//   backward, per window: dact GEMM gathering dy rows; the activation backward (dg, dpre,
//             g * act) in its epilogue (plain activations, d <= 1024 or 2048) or as a pass;
//             varlen-K weight gradients gathering x and dy (summed over the windows in fp32,
//             rounded once); dx GEMM; router backward of the window's tokens; combine.
//             Wide experts copy dy's and x's rows into expert order first, so that these GEMMs
//             read them by TMA (the rule: gemm/sm90/heuristics.hpp).
// Nothing synchronises the host and nothing allocates: every call can be captured in a CUDA
// graph. Bad caller ids and saved buffers that fail their checks are found on the device; the
// call then fills its outputs with NaN and reports through STATUS (docs/errors.md).
#include <cuda_runtime.h>

#include <algorithm>
#include <cstring>
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
#include "engines/fused/window.hpp"
#include "experts/expert_cuda.hpp"
#include "gemm/cublaslt.hpp"
#include "gemm/sm90/grouped_gemm.hpp"
#include "gemm/sm90/heuristics.hpp"
#include "gemm/sm90/weight_grad.hpp"
#include "routing/plan_check_cuda.hpp"
#include "routing/window_plan_cuda.hpp"
#include "util/align.hpp"

namespace moeblaze {
inline namespace v0 {
namespace {

namespace sm90 = gemm::sm90;

struct FusedWork {
  RouterWork router;              // logits, error flag, plan scratch; router backward scratch
  RoutingPlan plan;               // inference / route: the plan lives in the workspace
  FusedWindows windows{1, 1};
  routing::WindowPlan win;        // the current window's plan
  void* sched = nullptr;          // the GEMMs' schedule (sm90::schedule_bytes)
  void* pre = nullptr;            // backward, RECOMPUTE_UP: [W k, g h]
  void* act = nullptr;            // forward: [W k, h] unless saved; backward: g * act
  void* out = nullptr;            // forward: [W k, d] gate-scaled expert outputs
  void* dpre = nullptr;           // backward: [W k, g h]
  // dpre written over the pre it is computed from, which the activation
  // backward reads last, element by element, before it writes dpre there: the recomputed pre in
  // the workspace, or on a last-use backward the saved pre (dpre_in_saved: set by backward).
  bool dpre_over_pre = false;
  bool dpre_in_saved = false;
  bool router_in_dpre = false;    // the router backward's window rows lie in dpre's
  void* dx_part = nullptr;        // backward: [W k, d]
  float* dg_pos = nullptr;        // backward: [fused_dg_parts, W k] partial sums (the separate pass: row 0)
  float* dg_tok = nullptr;        // backward: [L k]
  float* dw_gate_up32 = nullptr;  // backward, several windows: [E, d, g h] fp32 partial sums
  float* dw_down32 = nullptr;     // backward, several windows: [E, d, h] (dW_down transposed)
  size_t bytes = 0;
};

// A per-call layout the kernels cannot take (strides or alignment of the caller's tensors) is
// refused before anything is enqueued.
void require(const char* why, const char* gemm) {
  if (why)
    fail(Status::kNotSupported,
         "the fused engine's %s cannot take these tensors: %s (a handle with MOEBLAZE_ENGINE_CUDA_CUBLASLT can)", gemm, why);
}

// A grouped GEMM whose A rows are a[index[p]] (index given) or a[p], times the expert weights w
// read as `major` (kMN: w's logical [K, N]; kK: its transpose), with N = n and K = k. A weight
// stored column-major (View::transposed) is the other major of the same kernel, not a copy.
sm90::GroupedGemmParams expert_gemm(const void* a, int64_t lda, const int32_t* index, int64_t a_rows, const View& w,
                                    sm90::Major major, int64_t n, int64_t k) {
  sm90::GroupedGemmParams p;
  p.n = static_cast<int32_t>(n);
  p.k = static_cast<int32_t>(k);
  p.b_major = !w.transposed ? major : major == sm90::Major::kMN ? sm90::Major::kK : sm90::Major::kMN;
  p.a = a;
  p.lda = lda;
  p.a_index = index;
  p.a_rows = static_cast<int32_t>(a_rows);
  p.b = w.data;
  p.ldb = w.stride[1];
  p.b_expert_stride = w.stride[0];
  return p;
}

// dW[e] = A^T B over the expert's rows, into the caller's gradient view (or the fp32 sums);
// c_transposed: the kernel's [m, n] result is dW[e]^T (then a column-major dW is stored as is).
sm90::WeightGradParams weight_grad_params(const View& dw, int64_t m, int64_t n, const void* a, int64_t lda,
                                          const int32_t* a_index, int64_t a_rows, const void* b, int64_t ldb,
                                          const int32_t* b_index, int64_t b_rows, float* acc32, int64_t window,
                                          int64_t windows, bool c_transposed) {
  sm90::WeightGradParams p;
  p.c_transposed = c_transposed != dw.transposed;
  p.m = static_cast<int32_t>(m);
  p.n = static_cast<int32_t>(n);
  p.a = a;
  p.lda = lda;
  p.a_index = a_index;
  p.a_rows = static_cast<int32_t>(a_rows);
  p.b = b;
  p.ldb = ldb;
  p.b_index = b_index;
  p.b_rows = static_cast<int32_t>(b_rows);
  p.c = dw.data;
  p.ldc = dw.stride[1];
  p.c_expert_stride = dw.stride[0];
  p.accumulate = dw.accumulate;
  if (windows > 1) {  // fp32 partial sums over the windows; the last one rounds into dW
    p.acc32 = acc32;
    p.acc32_load = window > 0;
    p.acc32_store = window + 1 < windows;
  }
  return p;
}

class FusedEngine final : public Engine {
 public:
  explicit FusedEngine(const LayerConfig& cfg) : cfg_(cfg) {
    cuda::DeviceGuard guard(cfg_.device_id);
    gemm_ = std::make_unique<gemm::CublasLtGemm>();
    router_ = std::make_unique<CudaRouter>(cfg_, *gemm_);
    pregather_ = gemm::sm90::pregather(cfg_.gate_up_cols(), cfg_.ffn_hidden);
  }
  EngineKind kind() const override { return EngineKind::kCudaFused; }
  size_t workspace_size(Pass pass, int64_t L) const override { return carve(pass, L, nullptr).bytes; }
  size_t last_use_workspace_size(int64_t L) const override { return carve(Pass::kBackwardLastUse, L, nullptr).bytes; }
  void forward(Pass pass, const CallArgs& a, void* ws, void* saved, void* stream) const override;
  void backward(const CallArgs& a, void* saved, bool last_use, void* ws, void* stream) const override;
  void route(const CallArgs& a, void* ws, void* stream) const override;

 private:
  FusedWork carve(Pass pass, int64_t L, void* base) const;
  // up: x rows gathered through `token` times W_gate_up[e] ([d, g h]), n = h per half.
  sm90::GroupedGemmParams up_gemm(const CallArgs& a, const int32_t* token) const {
    sm90::GroupedGemmParams p = expert_gemm(a.x.data, a.x.stride[0], token, a.num_tokens, a.w_gate_up, sm90::Major::kMN,
                                            cfg_.ffn_hidden, cfg_.hidden);
    p.gated = is_gated(cfg_.activation);
    return p;
  }
  // pre and act, each at the window's rows or (with a per-expert start, `rows` of them) at the
  // call's positions.
  sm90::EpilogueParams activation_epilogue(void* pre, const int32_t* pre_expert_row, void* act,
                                           const int32_t* act_expert_row, int64_t rows) const {
    sm90::EpilogueParams e;
    e.kind = sm90::EpilogueKind::kActivation;
    e.activation = cfg_.activation;
    e.pre = pre;
    e.ld_pre = cfg_.gate_up_cols();
    e.pre_expert_row = pre_expert_row;
    e.pre_out_rows = pre_expert_row ? static_cast<int32_t>(rows) : 0;
    e.act = act;
    e.ld_act = cfg_.ffn_hidden;
    e.act_expert_row = act_expert_row;
    e.act_out_rows = act_expert_row ? static_cast<int32_t>(rows) : 0;
    return e;
  }
  // Whether a GEMM stores `out`'s rows straight at their tokens (EpilogueParams::c_row) instead
  // of leaving [W, d] rows for the combine: top-1, where the combine would copy each token's one
  // row (the same bits), into an output it does not add to.
  bool stores_token_rows(const View& out) const {
    return cfg_.top_k == 1 && out.present && !out.accumulate && sm90::token_order_stores_allowed();
  }
  // Whether the forward keeps the down GEMM's [W k, d] rows for the combine: always but for a
  // top-1 layer storing y at its tokens; an expert-parallel layer's local call (empty slots)
  // keeps them for the rows it stores into other ranks (CallArgs::out_rows).
  bool forward_rows_for_combine() const {
    return cfg_.top_k != 1 || cfg_.empty_slots || !sm90::token_order_stores_allowed();
  }
  // Window `i`'s plan and GEMM schedule; returns the window's first token and token count.
  sm90::Schedule begin_window(const FusedWork& w, const RoutingPlan& plan, int64_t L, int64_t i, int64_t& t0,
                              int64_t& rows, cudaStream_t s) const;

  LayerConfig cfg_;
  std::unique_ptr<gemm::CublasLtGemm> gemm_;  // the router's logits GEMM
  std::unique_ptr<CudaRouter> router_;
  bool pregather_ = false;  // the backward copies dy and x rows into expert order (gemm/sm90/heuristics.hpp)
};

FusedWork FusedEngine::carve(Pass pass, int64_t L, void* base) const {
  Carver c(base);
  FusedWork w;
  const int64_t d = cfg_.hidden, h = cfg_.ffn_hidden, gh = cfg_.gate_up_cols(), E = cfg_.num_experts, k = cfg_.top_k;
  const size_t es = dtype_size(cfg_.act_dtype);
  w.windows = fused_windows(cfg_, L);
  const size_t Pw = static_cast<size_t>(w.windows.tokens * k);
  const bool backward = pass == Pass::kBackward || pass == Pass::kBackwardLastUse;
  // dpre over pre: the recomputed pre always; the saved pre on its last use when one window
  // covers the call, so that dpre's rows are the saved pre's rows (fused_dpre_over_saved_pre).
  w.dpre_in_saved = pass == Pass::kBackwardLastUse && fused_dpre_over_saved_pre(cfg_, L, w.windows);
  w.dpre_over_pre = backward && (cfg_.save_policy == SavePolicy::kRecomputeUp || w.dpre_in_saved);
  // In the saved buffer dpre has exactly the saved pre's bytes, not rounded up.
  const size_t dpre_bytes = w.dpre_in_saved ? Pw * static_cast<size_t>(gh) * es : align_up(Pw * static_cast<size_t>(gh) * es);
  // Rows in memory the window is done with (window.hpp says when; both checked here exactly).
  w.router_in_dpre = backward && fused_router_rows_in_dpre(cfg_) &&
                     router_->window_rows_bytes(w.windows.tokens) <= dpre_bytes;
  const bool dx_in_act = fused_dx_parts_in_act(cfg_);  // never with pregather_
  w.router = router_->carve_head(c, backward ? Pass::kBackward : pass, L, w.windows.tokens, base, w.plan,
                                 !w.router_in_dpre);
  if (pass == Pass::kRoute) {
    w.bytes = c.size();
    return w;
  }
  w.sched = c.take<char>(sm90::schedule_bytes(E));
  w.win = routing::carve_window_plan(c, E, w.windows.tokens, k);
  if (backward) {
    if (cfg_.save_policy == SavePolicy::kRecomputeUp) w.pre = c.take<char>(dpre_bytes);
    w.act = c.take<char>(Pw * static_cast<size_t>(h) * es);
    if (!w.dpre_over_pre) w.dpre = c.take<char>(dpre_bytes);
    else if (!w.dpre_in_saved) w.dpre = w.pre;
    if (w.router_in_dpre && w.dpre) router_->place_window_rows(w.router, w.windows.tokens, w.dpre);
    w.dx_part = dx_in_act ? w.act : c.take<char>(Pw * static_cast<size_t>(d) * es);
    w.dg_pos = c.take<float>(Pw * static_cast<size_t>(fused_dg_parts(cfg_)));
    w.dg_tok = c.take<float>(static_cast<size_t>(L * k));
    if (w.windows.count > 1) {  // fused_weight_grad_sum_bytes
      w.dw_gate_up32 = c.take<float>(static_cast<size_t>(E * d * gh));
      w.dw_down32 = c.take<float>(static_cast<size_t>(E * h * d));
    }
  } else {
    // act only where nothing saved holds it.
    if (pass != Pass::kForwardTraining || cfg_.save_policy != SavePolicy::kSaveAll)
      w.act = c.take<char>(Pw * static_cast<size_t>(h) * es);
    if (forward_rows_for_combine()) w.out = c.take<char>(Pw * static_cast<size_t>(d) * es);
  }
  w.bytes = c.size();
  return w;
}

sm90::Schedule FusedEngine::begin_window(const FusedWork& w, const RoutingPlan& plan, int64_t L, int64_t i, int64_t& t0,
                                         int64_t& rows, cudaStream_t s) const {
  t0 = i * w.windows.tokens;
  rows = std::min(w.windows.tokens, L - t0);
  routing::build_window_plan_cuda(plan, L, cfg_.top_k, cfg_.num_experts, t0, rows, w.win, s);
  return sm90::make_schedule(w.win.offsets, cfg_.num_experts, rows * cfg_.top_k, w.sched, s);
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
  const int64_t L = a.num_tokens, k = cfg_.top_k, d = cfg_.hidden, h = cfg_.ffn_hidden;
  const DType dt = cfg_.act_dtype;
  FusedWork w = carve(pass, L, ws);
  SavedRegions sv;
  if (pass == Pass::kForwardTraining) {
    sv = carve_saved(cfg_, L, saved);
    w.plan = sv.plan;
  }
  const RoutingPlan& plan = w.plan;
  const routing::WindowPlan& win = w.win;
  // The saved pre and act lie at the call's positions; the window's own act at its rows.
  sm90::GroupedGemmParams up = up_gemm(a, win.token);
  up.arrival = a.arrival;  // x's rows may still be arriving (an expert-parallel local call)
  up.max_ctas = a.arrival.max_ctas;
  const sm90::EpilogueParams up_epi =
      sv.act ? activation_epilogue(sv.preact, win.expert_call_row, sv.act, win.expert_call_row, L * k)
             : activation_epilogue(sv.preact, win.expert_call_row, w.act, nullptr, L * k);
  sm90::GroupedGemmParams down = sv.act ? expert_gemm(sv.act, h, win.call_row, L * k, a.w_down, sm90::Major::kMN, d, h)
                                        : expert_gemm(w.act, h, nullptr, w.windows.tokens * k, a.w_down, sm90::Major::kMN, d, h);
  sm90::EpilogueParams down_epi;
  down_epi.c = w.out;
  down_epi.ldc = d;
  down_epi.row_scale = win.gate;  // the gate, applied before rounding
  // Top-1: y's rows straight from the down GEMM; a token without a slot (masked) gets zeros.
  const bool y_direct = stores_token_rows(a.y) && !a.out_rows;
  if (!y_direct && !w.out)
    fail(Status::kNotSupported,
         "this top-1 layer stores y at its tokens: rows stored into other ranks need a layer with empty slots");
  const bool unrouted_tokens = a.token_mask.present || cfg_.empty_slots;
  if (y_direct) {
    down_epi.c = a.y.data;
    down_epi.ldc = a.y.stride[0];
    down_epi.c_row = win.token;
    down_epi.c_rows = static_cast<int32_t>(L);
  }
  require(sm90::unsupported_reason(dt, up, up_epi), "up GEMM");
  require(sm90::unsupported_reason(dt, down, down_epi), "down GEMM");

  if (sv.header)  // until this forward completes, the buffer vouches for nothing
    MOEBLAZE_CUDA_CHECK(cudaMemsetAsync(sv.header, 0, sizeof(SavedHeader), s));
  router_->route_and_plan(a, w.plan, w.router, s);
  router_->write_outputs(a, plan, w.router, s);
  for (int64_t i = 0; i < w.windows.count; ++i) {
    int64_t t0, rows;
    up.sched = down.sched = begin_window(w, plan, L, i, t0, rows, s);
    sm90::grouped_gemm(dt, up, up_epi, {}, s);
    sm90::grouped_gemm(dt, down, down_epi, {}, s);
    if (!y_direct)
      combine::combine_rows_cuda(win.token_index_map, nullptr, rows, k, d, w.out, {}, a.y.rows(t0, rows), s,
                                 a.out_rows ? a.out_rows + t0 : nullptr, a.out_rows_first, t0);
    else if (unrouted_tokens)
      combine::zero_unrouted_rows_cuda(win.token_index_map, rows, k, d, a.y.rows(t0, rows), s);
  }
  cuda::CallEnd end;
  end.outputs[0] = &a.y;
  end.status = a.status;
  end.header_dst = sv.header;
  end.header = make_saved_header(cfg_, L);
  cuda::end_call(w.router.error_flag, end, s);
}

void FusedEngine::backward(const CallArgs& a, void* saved, bool last_use, void* ws, void* stream) const {
  cuda::DeviceGuard guard(cfg_.device_id);
  cudaStream_t s = static_cast<cudaStream_t>(stream);
  const int64_t L = a.num_tokens, E = cfg_.num_experts, k = cfg_.top_k, d = cfg_.hidden, h = cfg_.ffn_hidden;
  const int64_t gh = cfg_.gate_up_cols();
  const DType dt = cfg_.act_dtype;
  FusedWork w = carve(last_use ? Pass::kBackwardLastUse : Pass::kBackward, L, ws);
  const SavedRegions sv = carve_saved(cfg_, L, saved);
  if (w.dpre_in_saved) {
    w.dpre = sv.preact;
    if (w.router_in_dpre) router_->place_window_rows(w.router, w.windows.tokens, w.dpre);
  }
  const RoutingPlan& plan = sv.plan;
  const routing::WindowPlan& win = w.win;
  const Needs needs = needs_of(cfg_, Pass::kBackward, a);
  int32_t* flag = w.router.error_flag;

  // The window's pre: the saved one at the call's positions, or recomputed (RECOMPUTE_UP).
  void* pre = sv.preact ? sv.preact : w.pre;
  const int32_t* pre_rows = sv.preact ? win.call_row : nullptr;
  sm90::GroupedGemmParams up = up_gemm(a, win.token);
  const sm90::EpilogueParams up_epi = activation_epilogue(w.pre, nullptr, nullptr, nullptr, 0);
  // The rows of dy or x at the window's positions: gathered through its tokens, or, with the
  // copy (gemm/sm90/heuristics.hpp), in expert order in dx_part (free until the dx GEMM), read by TMA.
  const int64_t W = w.windows.tokens * k;
  struct PositionRows {
    const void* data;
    int64_t ld;
    const int32_t* index;
    int64_t rows;
  };
  auto position_rows = [&](const View& v) {
    return pregather_ ? PositionRows{w.dx_part, d, nullptr, W} : PositionRows{v.data, v.stride[0], win.token, L};
  };
  const PositionRows dy_rows = position_rows(a.dy), x_rows = position_rows(a.x);
  // dact = dy W_down^T into the first h columns of dpre.
  sm90::GroupedGemmParams dact =
      expert_gemm(dy_rows.data, dy_rows.ld, dy_rows.index, dy_rows.rows, a.w_down, sm90::Major::kK, h, d);
  if (!pregather_) {  // dy's rows may still be arriving: the dact GEMM (or the copy) waits for them
    dact.arrival = a.arrival;
    dact.max_ctas = a.arrival.max_ctas;
  }
  // dact lands in dpre's first h columns, or, where dpre lies over pre (which the separate pass
  // still reads), in g * act's rows, which the pass then writes in place.
  sm90::EpilogueParams dact_epi;
  dact_epi.c = w.dpre_over_pre ? w.act : w.dpre;
  dact_epi.ldc = w.dpre_over_pre ? h : gh;
  // ... or with the activation backward in its epilogue (dpre in place of dact, g * act, dg
  // partial sums per column block) where that is faster and the kernel takes these tensors
  // (gemm/sm90/grouped_gemm.hpp).
  sm90::EpilogueParams act_epi;
  act_epi.kind = sm90::EpilogueKind::kActivationBackward;
  act_epi.activation = cfg_.activation;
  act_epi.c = w.dpre;
  act_epi.ldc = gh;
  act_epi.act = w.act;
  act_epi.ld_act = h;
  act_epi.row_scale = win.gate;
  act_epi.pre = pre;
  act_epi.ld_pre = gh;
  act_epi.pre_expert_row = sv.preact ? win.expert_call_row : nullptr;
  act_epi.pre_out_rows = sv.preact ? static_cast<int32_t>(L * k) : 0;
  act_epi.dg = w.dg_pos;
  act_epi.ld_dg = W;
  const bool act_in_epilogue =
      sm90::act_backward_in_epilogue(dact, is_gated(cfg_.activation)) && !sm90::unsupported_reason(dt, dact, act_epi);
  // dx parts = dpre W_gate_up^T, per window row.
  sm90::GroupedGemmParams dxg = expert_gemm(w.dpre, gh, nullptr, W, a.w_gate_up, sm90::Major::kK, d, gh);
  sm90::EpilogueParams dx_epi;
  dx_epi.c = w.dx_part;
  dx_epi.ldc = d;
  // Top-1: dx's rows straight from its GEMM (the router's part added after it in place), and
  // zeros for the tokens the saved plan leaves without a slot (masked).
  const bool dx_direct = stores_token_rows(a.dx) && !router_->router_dx_for_combine(a, needs);
  if (dx_direct) {
    dx_epi.c = a.dx.data;
    dx_epi.ldc = a.dx.stride[0];
    dx_epi.c_row = win.token;
    dx_epi.c_rows = static_cast<int32_t>(L);
  }
  // dW_down[e] = (g act)^T dy and dW_gate_up[e] = x^T dpre over the expert's window rows.
  // dW_down is computed as (dy^T (g act))^T: the gathered dy on the tile's 128-wide side halves
  // its copies per FLOP (perf/NOTES.md, weight-gradient kernel).
  auto dwd = [&](int64_t i) {
    return weight_grad_params(a.d_w_down, d, h, dy_rows.data, dy_rows.ld, dy_rows.index, dy_rows.rows, w.act, h,
                              nullptr, W, w.dw_down32, i, w.windows.count, true);
  };
  auto dwgu = [&](int64_t i) {
    return weight_grad_params(a.d_w_gate_up, d, gh, x_rows.data, x_rows.ld, x_rows.index, x_rows.rows, w.dpre, gh,
                              nullptr, W, w.dw_gate_up32, i, w.windows.count, false);
  };
  if (needs.recompute_up) require(sm90::unsupported_reason(dt, up, up_epi), "recomputed up GEMM");
  if (!act_in_epilogue) require(sm90::unsupported_reason(dt, dact, dact_epi), "dact GEMM");
  if (a.dx.present) require(sm90::unsupported_reason(dt, dxg, dx_epi), "dx GEMM");
  if (a.d_w_down.present) require(sm90::weight_grad_unsupported_reason(dt, dwd(0)), "dW_down GEMM");
  if (a.d_w_gate_up.present) require(sm90::weight_grad_unsupported_reason(dt, dwgu(0)), "dW_gate_up GEMM");

  // The saved buffer is the caller's: its header and plan are checked on the device; every
  // kernel below keeps its indices in bounds whatever the plan holds, and a failed check turns
  // the outputs into NaN at the end.
  MOEBLAZE_CUDA_CHECK(cudaMemsetAsync(flag, 0, sizeof(int32_t), s));
  cuda::check_saved_header_cuda(make_saved_header(cfg_, L), sv.header, flag, routing::kSavedHeaderInvalid, s);
  routing::validate_plan_cuda(plan, L, k, E, /*empty_slots=*/true, flag, s);  // a TOKEN_MASK leaves empty slots
  router_->backward_begin(a, needs, w.router, s);
  // With work for a side lane once dx is final (an expert-parallel layer's local call sending
  // its dx rows back): the last window's dx GEMM and combine before its weight gradients, and the
  // lane's work beside them, which leave the lane's SMs free. Not with the copy (dx_part holds
  // x's rows until the dW_gate_up GEMM reads them).
  const bool after_dx = a.side.present() && a.side.after_dx && a.dx.present;
  const bool dx_first = after_dx && !pregather_;
  bool lane_forked = false;
  for (int64_t i = 0; i < w.windows.count; ++i) {
    int64_t t0, rows;
    const sm90::Schedule sched = begin_window(w, plan, L, i, t0, rows, s);
    up.sched = dact.sched = dxg.sched = sched;
    if (needs.recompute_up) sm90::grouped_gemm(dt, up, up_epi, {}, s);
    // The rows the GEMMs cover: all of them, unless a bad plan's offsets end early.
    const int32_t* rows_done = sched.offsets + cfg_.num_experts;
    if (pregather_) experts::gather_rows_cuda(a.dy, win.token, rows * k, d, w.dx_part, s, a.arrival);
    if (act_in_epilogue) {
      sm90::grouped_gemm(dt, dact, act_epi, {}, s);
    } else {
      sm90::grouped_gemm(dt, dact, dact_epi, {}, s);
      // dg, dpre (in place) and g * act (recomputed from pre) in one pass.
      experts::activation_backward_cuda(cfg_.activation, dt, rows * k, h, pre, pre_rows, win.gate, dact_epi.c,
                                        dact_epi.ldc, w.dpre, w.act, w.dg_pos, s, rows_done);
    }
    // dx: its GEMM, dg in token order (the epilogue's partial sums per column block, or the
    // separate pass's one row), the router's part, the combine.
    auto dx_and_dg = [&] {
      if (a.dx.present) sm90::grouped_gemm(dt, dxg, dx_epi, {}, s);
      float* dg_tok = w.dg_tok + t0 * k;
      combine::to_token_order_cuda(win.token_index_map, rows, k, w.dg_pos, dg_tok, s,
                                   act_in_epilogue ? fused_dg_parts(cfg_) : 1, W, rows_done);
      const combine::TokenTerms router_dx = router_->backward_window(a, needs, plan, t0, rows, dg_tok, i == 0, w.router, s);
      if (a.dx.present) {
        if (dx_direct)
          combine::zero_unrouted_rows_cuda(win.token_index_map, rows, k, d, a.dx.rows(t0, rows), s);
        else
          combine::combine_rows_cuda(win.token_index_map, nullptr, rows, k, d, w.dx_part, router_dx,
                                     a.dx.rows(t0, rows), s);
        router_->add_router_dx(a, needs, a.dx.rows(t0, rows), w.router, s);
      }
    };
    const bool last = i + 1 == w.windows.count;
    if (dx_first && last) {
      dx_and_dg();
      cudaStream_t lane = static_cast<cudaStream_t>(a.side.stream);
      MOEBLAZE_CUDA_CHECK(cudaEventRecord(static_cast<cudaEvent_t>(a.side.fork), s));
      MOEBLAZE_CUDA_CHECK(cudaStreamWaitEvent(lane, static_cast<cudaEvent_t>(a.side.fork), 0));
      a.side.after_dx->enqueue(lane);
      MOEBLAZE_CUDA_CHECK(cudaEventRecord(static_cast<cudaEvent_t>(a.side.join), lane));
      lane_forked = true;
    }
    const int32_t wg_ctas = lane_forked ? a.side.gemm_ctas : 0;
    if (a.d_w_down.present) {
      sm90::WeightGradParams p = dwd(i);
      p.sched = sched;
      p.max_ctas = wg_ctas;
      sm90::weight_grad(dt, p, s);
    }
    if (a.d_w_gate_up.present) {
      if (pregather_) experts::gather_rows_cuda(a.x, win.token, rows * k, d, w.dx_part, s);
      sm90::WeightGradParams p = dwgu(i);
      p.sched = sched;
      p.max_ctas = wg_ctas;
      sm90::weight_grad(dt, p, s);
    }
    if (!(dx_first && last)) dx_and_dg();
  }
  if (lane_forked) MOEBLAZE_CUDA_CHECK(cudaStreamWaitEvent(s, static_cast<cudaEvent_t>(a.side.join), 0));
  else if (after_dx) a.side.after_dx->enqueue(s);
  if (a.d_topk_weights.present) combine::store_f32_rows_cuda(w.dg_tok, L, k, a.d_topk_weights, s);
  router_->backward_finish(a, needs, w.router, s);
  cuda::CallEnd end{{&a.dx, &a.d_w_gate_up, &a.d_w_down, &a.d_topk_weights, &a.d_logits, &a.d_router_weight}, a.status};
  if (last_use) {
    end.header_dst = sv.header;
    end.header = spent_saved_header(cfg_, L);
    end.header_unless_flag = false;
  }
  cuda::end_call(flag, end, s);
}

}  // namespace

// Refusals are per configuration (src/engines/registry.cpp); per-call layouts are checked above.
const char* fused_engine_refuses(const LayerConfig& cfg, int sm_major) {
  if (sm_major != 9) return "it runs on sm_90 (Hopper) GPUs only";
  if (cfg.act_dtype != cfg.weight_dtype) return "it needs activation_dtype == weight_dtype";
  if (cfg.act_dtype != DType::kBF16 && cfg.act_dtype != DType::kF16) return "it takes bf16 or fp16 (fp32 runs on cuBLASLt)";
  if (!gemm::sm90::kernels_built(cfg.act_dtype))
    return "this build left out its kernels for this dtype (CMake option MOEBLAZE_SM90_DTYPES)";
  if (cfg.hidden % 8 || cfg.ffn_hidden % 8) return "it needs hidden and ffn_hidden to be multiples of 8";
  return nullptr;
}

std::unique_ptr<Engine> make_fused_engine(const LayerConfig& cfg) { return std::make_unique<FusedEngine>(cfg); }

}  // namespace v0
}  // namespace moeblaze
