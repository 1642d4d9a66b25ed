// The CPU reference engine: complete (every activation, dtype, save policy and gradient),
// fp32 accumulation, multi-threaded, and bitwise deterministic for any thread count.
// It runs the same pipeline as the GPU engines: route -> plan -> expert tiles that gather
// token rows on the fly -> combine through token_index_map; backward reuses the plan.
#include <algorithm>
#include <cmath>
#include <cstring>

#include "combine/combine.hpp"
#include "core/engine.hpp"
#include "core/memory_layout.hpp"
#include "core/needs.hpp"
#include "experts/expert_mlp.hpp"
#include "routing/plan.hpp"
#include "routing/router.hpp"
#include "util/align.hpp"
#include "util/error.hpp"
#include "util/rows.hpp"
#include "util/thread_pool.hpp"

namespace moeblaze {
inline namespace v0 {
namespace {

constexpr int64_t kTileRows = 32;     // positions of one expert per expert task
constexpr int64_t kTokenBlock = 64;   // tokens per combine / dx / router task
constexpr int64_t kGradRows = 16;     // weight-gradient rows per task

// Pointers into the caller's workspace for one call (nullptr where the pass needs none).
struct Work {
  float* logits = nullptr;        // [L, E] fp32 router logits
  float* dlogits = nullptr;       // [L, E]
  float* chunk_scores = nullptr;  // [chunks, E] per-chunk score sums (aux loss)
  float* chunk_lse = nullptr;     // [chunks]
  void* plan_scratch = nullptr;
  RoutingPlan plan;               // inference / route: the plan lives in the workspace
  int32_t* tiles = nullptr;       // [max_tiles, 2] (expert, first row)
  void* expert_out = nullptr;     // [L k, d] O rows, activation dtype, expert order
  void* act = nullptr;            // [L k, h] backward: act rows (unless saved)
  void* dpre = nullptr;           // [L k, g h] backward: dA/dB or dH rows
  float* dx_part = nullptr;       // [L k, d] backward: per-slot dx contributions
  float* dg_pos = nullptr;        // [L k] expert order
  float* dg_tok = nullptr;        // [L k] token order
  float* per_worker = nullptr;    // workers x worker_floats
  size_t worker_floats = 0;
  size_t bytes = 0;
};

class CpuEngine final : public Engine {
 public:
  explicit CpuEngine(const LayerConfig& cfg)
      : cfg_(cfg), pool_(cfg.num_threads > 0 ? cfg.num_threads : hardware_threads()) {}

  EngineKind kind() const override { return EngineKind::kCpu; }

  size_t workspace_size(Pass pass, int64_t L) const override { return carve(pass, L, nullptr).bytes; }

  void forward(Pass pass, const CallArgs& a, void* ws, void* saved, void* /*stream*/) const override;
  void backward(const CallArgs& a, void* saved, bool last_use, void* ws, void* /*stream*/) const override;
  void route(const CallArgs& a, void* ws, void* /*stream*/) const override;

 private:
  int64_t max_tiles(int64_t L) const { return ceil_div(L * cfg_.top_k, kTileRows) + cfg_.num_experts; }
  size_t worker_floats(Pass pass) const;
  Work carve(Pass pass, int64_t L, void* base) const;

  void compute_logits(const CallArgs& a, float* logits, const Work& w) const;
  // Routes (or imports caller routing) into plan.token_expert_indices / gates, builds the plan.
  void route_and_plan(const CallArgs& a, RoutingPlan& plan, const Work& w) const;
  void write_router_outputs(const CallArgs& a, const RoutingPlan& plan, const Work& w) const;
  int64_t make_tiles(const RoutingPlan& plan, int32_t* tiles) const;
  // fn(e, first position, rows, worker) for every tile of up to kTileRows positions of one
  // expert, in parallel; tiles: the workspace's tile list.
  template <class F>
  void for_each_tile(const RoutingPlan& plan, int32_t* tiles, F&& fn) const {
    pool_.parallel_for(make_tiles(plan, tiles), [&](int64_t ti, int worker) {
      const int64_t e = tiles[2 * ti], p0 = plan.expert_token_offsets[e] + tiles[2 * ti + 1];
      fn(e, p0, std::min<int64_t>(kTileRows, plan.expert_token_offsets[e + 1] - p0), worker);
    });
  }
  float* scratch(const Work& w, int worker) const { return w.per_worker + w.worker_floats * static_cast<size_t>(worker); }
  // The widest row a worker holds: max(kColBlock, d, g h, h, E).
  int64_t widest() const {
    return std::max({experts::kColBlock, cfg_.hidden, cfg_.gate_up_cols(), cfg_.ffn_hidden, cfg_.num_experts});
  }
  // A weight-gradient task's scratch, at the end of its worker's panel: the accumulators
  // [kGradRows, widest], then kOuterRows rows of a values and of g values (accumulate_outer).
  struct GradScratch {
    float *acc, *a, *g;
  };
  int64_t grad_scratch_floats() const { return kGradRows * widest() + experts::kOuterRows * (kGradRows + widest()); }
  GradScratch grad_scratch(const Work& w, int worker) const {
    float* acc = scratch(w, worker) + w.worker_floats - grad_scratch_floats();
    float* a = acc + kGradRows * widest();
    return {acc, a, a + experts::kOuterRows * kGradRows};
  }

  LayerConfig cfg_;
  ThreadPool pool_;  // persistent: started at the first parallel loop, joined with the engine
};

size_t CpuEngine::worker_floats(Pass pass) const {
  const int64_t d = cfg_.hidden, h = cfg_.ffn_hidden, gh = cfg_.gate_up_cols(), E = cfg_.num_experts;
  const int64_t R = kTileRows;
  int64_t n = widest() + 2 * E + 2 * d;  // conversion row, router scratch, token accumulators
  if (pass == Pass::kBackward)
    n += R * (3 * d + 2 * gh + 2 * h) + grad_scratch_floats();
  else if (pass == Pass::kRoute)
    n += R * d;  // x rows for logits = x W_g^T
  else
    n += R * (2 * d + gh + h);
  return static_cast<size_t>(n);
}

Work CpuEngine::carve(Pass pass, int64_t L, void* base) const {
  Carver c(base);
  Work w;
  const int64_t E = cfg_.num_experts, d = cfg_.hidden, Lk = L * cfg_.top_k;
  const size_t slots = static_cast<size_t>(Lk);
  const size_t es = dtype_size(cfg_.act_dtype);
  const int64_t chunks = ceil_div(L, routing::kLossChunk);
  w.logits = c.take<float>(static_cast<size_t>(L * E));
  if (pass == Pass::kBackward) {
    w.dlogits = c.take<float>(static_cast<size_t>(L * E));
    w.tiles = c.take<int32_t>(static_cast<size_t>(2 * max_tiles(L)));
    if (cfg_.save_policy != SavePolicy::kSaveAll) w.act = c.take<char>(slots * static_cast<size_t>(cfg_.ffn_hidden) * es);
    w.dpre = c.take<char>(slots * static_cast<size_t>(cfg_.gate_up_cols()) * es);
    w.dx_part = c.take<float>(slots * static_cast<size_t>(d));
    w.dg_pos = c.take<float>(slots);
    w.dg_tok = c.take<float>(slots);
  } else {
    w.chunk_scores = c.take<float>(static_cast<size_t>(chunks * E));
    w.chunk_lse = c.take<float>(static_cast<size_t>(chunks));
    w.plan_scratch = c.take<char>(routing::plan_scratch_bytes(L, E, pool_.workers()));
    if (pass != Pass::kForwardTraining) {
      SavedRegions r = carve_saved(cfg_, L, base ? static_cast<char*>(base) + c.size() : nullptr, false);
      c.take<char>(r.bytes);
      w.plan = r.plan;
    }
    if (pass != Pass::kRoute) {
      w.tiles = c.take<int32_t>(static_cast<size_t>(2 * max_tiles(L)));
      w.expert_out = c.take<char>(slots * static_cast<size_t>(d) * es);
    }
  }
  w.worker_floats = worker_floats(pass);
  w.per_worker = c.take<float>(w.worker_floats * static_cast<size_t>(pool_.workers()));
  w.bytes = c.size();
  return w;
}

void CpuEngine::compute_logits(const CallArgs& a, float* logits, const Work& w) const {
  const int64_t L = a.num_tokens, E = cfg_.num_experts, d = cfg_.hidden;
  if (a.mode == RoutingMode::kLogits) {
    pool_.parallel_for(ceil_div(L, kTokenBlock), [&](int64_t b, int) {
      for (int64_t t = b * kTokenBlock; t < std::min(L, (b + 1) * kTokenBlock); ++t)
        load_row(a.logits.row(t), a.logits.dtype, E, logits + t * E);
    });
    return;
  }
  // logits = x W_g^T, fp32 output (no rounding: the router is precision-sensitive).
  pool_.parallel_for(ceil_div(L, kTileRows), [&](int64_t b, int worker) {
    float* xf = scratch(w, worker);
    float* row = xf + kTileRows * d;
    const int64_t t0 = b * kTileRows, rows = std::min(kTileRows, L - t0);
    for (int64_t r = 0; r < rows; ++r) load_row(a.x.row(t0 + r), a.x.dtype, d, xf + r * d);
    experts::gemm_nt(rows, E, d, xf, d, a.router_weight.data, a.router_weight.dtype, a.router_weight.stride[0],
                     logits + t0 * E, E, row);
  });
}

void CpuEngine::route_and_plan(const CallArgs& a, RoutingPlan& plan, const Work& w) const {
  const int64_t L = a.num_tokens, E = cfg_.num_experts, k = cfg_.top_k;
  if (a.mode == RoutingMode::kCallerTopK) {
    // Validate every id before anything else is written (a bad id writes nothing).
    routing::import_topk_ids(a.topk_ids.data, a.topk_ids.dtype == DType::kI64, a.topk_ids.stride[0], L, k, E,
                             a.token_mask, plan.token_expert_indices);
    for (int64_t t = 0; t < L; ++t) {
      load_row(a.topk_weights.row(t), a.topk_weights.dtype, k, plan.gates + t * k);
      if (plan.token_expert_indices[t * k] < 0) std::fill(plan.gates + t * k, plan.gates + (t + 1) * k, 0.f);
    }
  } else {
    compute_logits(a, w.logits, w);
    const float* bias = a.expert_bias.present ? reinterpret_cast<const float*>(a.expert_bias.data) : nullptr;
    const int64_t chunks = ceil_div(L, routing::kLossChunk);
    pool_.parallel_for(chunks, [&](int64_t c, int worker) {
      float* sums = w.chunk_scores + c * E;
      std::fill(sums, sums + E, 0.f);
      w.chunk_lse[c] = 0.f;
      routing::route_tokens(cfg_, w.logits, bias, a.token_mask, c * routing::kLossChunk,
                            std::min(L, (c + 1) * routing::kLossChunk),
                            plan.token_expert_indices, plan.gates, sums, &w.chunk_lse[c], scratch(w, worker));
    });
  }
  routing::build_plan(plan, L, k, E, w.plan_scratch, pool_);
}

void CpuEngine::write_router_outputs(const CallArgs& a, const RoutingPlan& plan, const Work& w) const {
  const int64_t L = a.num_tokens, E = cfg_.num_experts, k = cfg_.top_k;
  if (a.mode != RoutingMode::kCallerTopK) {
    if (a.topk_ids.present)
      for (int64_t t = 0; t < L; ++t)
        for (int64_t j = 0; j < k; ++j) {
          const int32_t id = plan.token_expert_indices[t * k + j];
          if (a.topk_ids.dtype == DType::kI64) reinterpret_cast<int64_t*>(a.topk_ids.row(t))[j] = id;
          else reinterpret_cast<int32_t*>(a.topk_ids.row(t))[j] = id;
        }
    if (a.topk_weights.present)
      for (int64_t t = 0; t < L; ++t) store_row(a.topk_weights.row(t), a.topk_weights.dtype, k, plan.gates + t * k, false);
    const int64_t routed = routed_tokens(plan.expert_token_offsets, L, E, k);
    routing::RouterLosses losses = routing::finish_losses(cfg_, routed, w.chunk_scores, w.chunk_lse,
                                                          ceil_div(L, routing::kLossChunk), plan.expert_token_offsets);
    if (a.sequence_lengths.present && a.aux_loss.present)  // the sequence-wise form instead
      losses.aux = routing::sequence_balance_loss(cfg_, w.logits, plan.token_expert_indices, a.sequence_lengths,
                                                  scratch(w, 0));
    if (a.aux_loss.present) *reinterpret_cast<float*>(a.aux_loss.data) = losses.aux;
    if (a.z_loss.present) *reinterpret_cast<float*>(a.z_loss.data) = losses.z;
  }
  if (a.tokens_per_expert.present)
    for (int64_t e = 0; e < E; ++e) {
      const int32_t n = plan.expert_token_offsets[e + 1] - plan.expert_token_offsets[e];
      char* p = a.tokens_per_expert.data + e * a.tokens_per_expert.stride[0] * static_cast<int64_t>(a.tokens_per_expert.elem());
      if (a.tokens_per_expert.dtype == DType::kI64) *reinterpret_cast<int64_t*>(p) = n;
      else *reinterpret_cast<int32_t*>(p) = n;
    }
}

// STATUS: this engine checks everything on the host, so a call that returns reports 0.
void report_ok(const CallArgs& a) {
  if (a.status.present) *reinterpret_cast<int32_t*>(a.status.data) = 0;
}

int64_t CpuEngine::make_tiles(const RoutingPlan& plan, int32_t* tiles) const {
  int64_t n = 0;
  for (int64_t e = 0; e < cfg_.num_experts; ++e) {
    const int32_t count = plan.expert_token_offsets[e + 1] - plan.expert_token_offsets[e];
    for (int32_t r0 = 0; r0 < count; r0 += static_cast<int32_t>(kTileRows)) {
      tiles[2 * n] = static_cast<int32_t>(e);
      tiles[2 * n + 1] = r0;
      ++n;
    }
  }
  return n;
}

void CpuEngine::route(const CallArgs& a, void* ws, void*) const {
  Work w = carve(Pass::kRoute, a.num_tokens, ws);
  route_and_plan(a, w.plan, w);
  write_router_outputs(a, w.plan, w);
  report_ok(a);
}

void CpuEngine::forward(Pass pass, const CallArgs& a, void* ws, void* saved, void*) const {
  const int64_t L = a.num_tokens, k = cfg_.top_k, d = cfg_.hidden, h = cfg_.ffn_hidden, gh = cfg_.gate_up_cols();
  const DType adt = cfg_.act_dtype;
  const int64_t es = static_cast<int64_t>(dtype_size(adt));
  Work w = carve(pass, L, ws);
  SavedRegions sv;
  if (pass == Pass::kForwardTraining) {
    sv = carve_saved(cfg_, L, saved);
    w.plan = sv.plan;
  }
  RoutingPlan& plan = w.plan;
  route_and_plan(a, plan, w);

  // Expert tiles: gather x rows by expert_token_indices, up GEMM, activation, down GEMM.
  for_each_tile(plan, w.tiles, [&](int64_t e, int64_t p0, int64_t rows, int worker) {
    float* xf = scratch(w, worker);
    float* pre = xf + kTileRows * d;
    float* act = pre + kTileRows * gh;
    float* out = act + kTileRows * h;
    float* row = out + kTileRows * d;
    for (int64_t r = 0; r < rows; ++r) load_row(a.x.row(plan.expert_token_indices[p0 + r]), a.x.dtype, d, xf + r * d);
    experts::gemm_weight(rows, gh, d, xf, d, a.w_gate_up, e, false, pre, gh, row);
    for (int64_t i = 0; i < rows * gh; ++i) pre[i] = round_to(adt, pre[i]);
    if (sv.preact)
      for (int64_t r = 0; r < rows; ++r) store_row(static_cast<char*>(sv.preact) + (p0 + r) * gh * es, adt, gh, pre + r * gh, false);
    experts::activation_forward(cfg_.activation, rows, h, pre, act, adt);
    if (sv.act)
      for (int64_t r = 0; r < rows; ++r) store_row(static_cast<char*>(sv.act) + (p0 + r) * h * es, adt, h, act + r * h, false);
    experts::gemm_weight(rows, d, h, act, h, a.w_down, e, false, out, d, row);
    for (int64_t r = 0; r < rows; ++r) store_row(static_cast<char*>(w.expert_out) + (p0 + r) * d * es, adt, d, out + r * d, false);
  });

  // Gate-weighted combine in token order.
  pool_.parallel_for(ceil_div(L, kTokenBlock), [&](int64_t b, int worker) {
    float* acc = scratch(w, worker);
    combine::combine_outputs(plan, k, d, w.expert_out, adt, a.y, b * kTokenBlock, std::min(L, (b + 1) * kTokenBlock),
                             acc, acc + d);
  });
  write_router_outputs(a, plan, w);
  if (sv.header) *sv.header = make_saved_header(cfg_, L);  // last: the buffer is now complete
  report_ok(a);
}

void CpuEngine::backward(const CallArgs& a, void* saved, bool last_use, void* ws, void*) const {
  const int64_t L = a.num_tokens, k = cfg_.top_k, d = cfg_.hidden, h = cfg_.ffn_hidden, gh = cfg_.gate_up_cols();
  const int64_t E = cfg_.num_experts;
  const DType adt = cfg_.act_dtype;
  const int64_t es = static_cast<int64_t>(dtype_size(adt));
  Work w = carve(Pass::kBackward, L, ws);
  const SavedRegions sv = carve_saved(cfg_, L, saved);
  // The saved buffer is the caller's: check its header, then the plan, before following any index.
  check_saved_header(*sv.header, cfg_, L);
  routing::validate_plan(sv.plan, L, k, E);
  const RoutingPlan& plan = sv.plan;
  const char* act_rows = static_cast<const char*>(sv.act ? sv.act : w.act);

  const Needs needs = needs_of(cfg_, Pass::kBackward, a);

  // Phase 1, per expert tile: act (recomputed as the policy says), dact = dy W_down^T,
  // dg = <dact, act>, dpre = activation backward of g * dact, dx_part = dpre W_gate_up^T.
  for_each_tile(plan, w.tiles, [&](int64_t e, int64_t p0, int64_t rows, int worker) {
    float* xf = scratch(w, worker);
    float* pre = xf + kTileRows * d;
    float* act = pre + kTileRows * gh;
    float* dyf = act + kTileRows * h;
    float* dact = dyf + kTileRows * d;
    float* dpre = dact + kTileRows * h;
    float* dxf = dpre + kTileRows * gh;
    float* row = dxf + kTileRows * d;
    float gate[kTileRows];
    for (int64_t r = 0; r < rows; ++r) {
      const int64_t t = plan.expert_token_indices[p0 + r];
      int64_t j = 0;
      while (plan.token_expert_indices[t * k + j] != e) ++j;
      gate[r] = plan.gates[t * k + j];
    }
    const bool need_pre = needs.dpre || !sv.act;
    if (need_pre) {
      if (sv.preact) {
        for (int64_t r = 0; r < rows; ++r)
          load_row(static_cast<const char*>(sv.preact) + (p0 + r) * gh * es, adt, gh, pre + r * gh);
      } else {
        for (int64_t r = 0; r < rows; ++r) load_row(a.x.row(plan.expert_token_indices[p0 + r]), a.x.dtype, d, xf + r * d);
        experts::gemm_weight(rows, gh, d, xf, d, a.w_gate_up, e, false, pre, gh, row);
        for (int64_t i = 0; i < rows * gh; ++i) pre[i] = round_to(adt, pre[i]);
      }
    }
    if (sv.act) {
      for (int64_t r = 0; r < rows; ++r) load_row(static_cast<const char*>(sv.act) + (p0 + r) * h * es, adt, h, act + r * h);
    } else {
      experts::activation_forward(cfg_.activation, rows, h, pre, act, adt);
      for (int64_t r = 0; r < rows; ++r) store_row(static_cast<char*>(w.act) + (p0 + r) * h * es, adt, h, act + r * h, false);
    }
    for (int64_t r = 0; r < rows; ++r) load_row(a.dy.row(plan.expert_token_indices[p0 + r]), a.dy.dtype, d, dyf + r * d);
    experts::gemm_weight(rows, h, d, dyf, d, a.w_down, e, true, dact, h, row);
    for (int64_t r = 0; r < rows; ++r) w.dg_pos[p0 + r] = experts::dot(dact + r * h, act + r * h, h);
    if (!needs.dpre) return;
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t i = 0; i < h; ++i) dact[r * h + i] *= gate[r];
    experts::activation_backward(cfg_.activation, rows, h, pre, dact, dpre, adt);
    for (int64_t r = 0; r < rows; ++r) store_row(static_cast<char*>(w.dpre) + (p0 + r) * gh * es, adt, gh, dpre + r * gh, false);
    if (a.dx.present) {
      experts::gemm_weight(rows, d, gh, dpre, gh, a.w_gate_up, e, true, dxf, d, row);
      std::memcpy(w.dx_part + p0 * d, dxf, static_cast<size_t>(rows * d) * sizeof(float));
    }
  });

  // Phase 2: weight gradients, one task per (expert, block of output rows); each output row
  // sums its expert's positions in ascending order.
  auto weight_grad = [&](const View& out, int64_t nrows, int64_t ncols,
                         FunctionRef<void(int64_t e, int64_t p, int64_t i0, int64_t ib, float* a_vals, float* g_row)> fetch) {
    const int64_t blocks = ceil_div(nrows, kGradRows);
    pool_.parallel_for(E * blocks, [&](int64_t task, int worker) {
      const int64_t e = task / blocks, i0 = (task % blocks) * kGradRows, ib = std::min(kGradRows, nrows - i0);
      const GradScratch g = grad_scratch(w, worker);
      const int64_t p0 = plan.expert_token_offsets[e], n = plan.expert_token_offsets[e + 1] - p0;
      experts::accumulate_outer(
          n, ib, ncols, [&](int64_t p, float* aa, float* gg) { fetch(e, p0 + p, i0, ib, aa, gg); }, g.acc, g.a, g.g);
      // Row i of the gradient; a column of the caller's array when it is stored transposed.
      for (int64_t i = 0; i < ib; ++i) {
        if (out.transposed)
          store_strided(out.row(e, 0) + (i0 + i) * static_cast<int64_t>(out.elem()), out.dtype, ncols, out.stride[1],
                        g.acc + i * ncols, out.accumulate);
        else
          store_row(out.row(e, i0 + i), out.dtype, ncols, g.acc + i * ncols, out.accumulate);
      }
    });
  };
  if (a.d_w_down.present) {  // dW_down[e] = act^T (g dy)
    weight_grad(a.d_w_down, h, d, [&](int64_t e, int64_t p, int64_t i0, int64_t ib, float* av, float* gv) {
      const int64_t t = plan.expert_token_indices[p];
      int64_t j = 0;
      while (plan.token_expert_indices[t * k + j] != e) ++j;
      const float g = plan.gates[t * k + j];
      for (int64_t i = 0; i < ib; ++i) av[i] = load_f32(act_rows + p * h * es, adt, i0 + i);
      load_row(a.dy.row(t), a.dy.dtype, d, gv);
      for (int64_t c = 0; c < d; ++c) gv[c] *= g;
    });
  }
  if (a.d_w_gate_up.present) {  // dW_gate_up[e] = x^T dpre
    weight_grad(a.d_w_gate_up, d, gh, [&](int64_t, int64_t p, int64_t i0, int64_t ib, float* av, float* gv) {
      const char* xr = a.x.row(plan.expert_token_indices[p]);
      for (int64_t i = 0; i < ib; ++i) av[i] = load_f32(xr, a.x.dtype, i0 + i);
      load_row(static_cast<const char*>(w.dpre) + p * gh * es, adt, gh, gv);
    });
  }

  // Gate gradients in token order, then the router backward.
  pool_.parallel_for(ceil_div(L, kTokenBlock), [&](int64_t b, int) {
    combine::to_token_order(plan, k, w.dg_pos, b * kTokenBlock, std::min(L, (b + 1) * kTokenBlock), w.dg_tok);
  });
  if (a.d_topk_weights.present)
    for (int64_t t = 0; t < L; ++t)
      store_row(a.d_topk_weights.row(t), a.d_topk_weights.dtype, k, w.dg_tok + t * k, a.d_topk_weights.accumulate);

  if (needs.router_grad) {
    compute_logits(a, w.logits, w);
    const float gaux = a.grad_aux.present ? *reinterpret_cast<const float*>(a.grad_aux.data) : 1.f;
    const float gz = a.grad_z.present ? *reinterpret_cast<const float*>(a.grad_z.data) : 1.f;
    const bool by_sequence = a.sequence_lengths.present;
    const int64_t routed = routed_tokens(plan.expert_token_offsets, L, E, k);
    pool_.parallel_for(ceil_div(L, kTokenBlock), [&](int64_t b, int worker) {
      routing::router_backward(cfg_, routed, w.logits, plan.token_expert_indices, w.dg_tok, gaux, gz,
                               by_sequence ? nullptr : plan.expert_token_offsets, b * kTokenBlock,
                               std::min(L, (b + 1) * kTokenBlock), w.dlogits, scratch(w, worker));
    });
    if (by_sequence && cfg_.aux_loss_coeff > 0.0) {  // the balance loss's share, sequence by sequence
      const View& n = a.sequence_lengths;
      const int64_t B = routing::routed_sequences(plan.token_expert_indices, n, k);
      int64_t t0 = 0;
      for (int64_t q = 0; q < n.shape[0]; ++q) {
        routing::sequence_balance_backward(cfg_, w.logits, plan.token_expert_indices, t0, n.index(q), B, gaux,
                                           w.dlogits, scratch(w, 0));
        t0 += n.index(q);
      }
    }
    if (a.d_logits.present)
      for (int64_t t = 0; t < L; ++t) store_row(a.d_logits.row(t), a.d_logits.dtype, E, w.dlogits + t * E, a.d_logits.accumulate);
    if (a.d_router_weight.present) {  // dW_g = dlogits^T x, one task per block of experts
      const int64_t blocks = ceil_div(E, kGradRows);
      pool_.parallel_for(blocks, [&](int64_t b, int worker) {
        const int64_t e0 = b * kGradRows, eb = std::min(kGradRows, E - e0);
        const GradScratch g = grad_scratch(w, worker);
        experts::accumulate_outer(
            L, eb, d,
            [&](int64_t t, float* aa, float* gg) {
              for (int64_t i = 0; i < eb; ++i) aa[i] = w.dlogits[t * E + e0 + i];
              load_row(a.x.row(t), a.x.dtype, d, gg);
            },
            g.acc, g.a, g.g);
        for (int64_t i = 0; i < eb; ++i)
          store_row(a.d_router_weight.row(e0 + i), a.d_router_weight.dtype, d, g.acc + i * d,
                    a.d_router_weight.accumulate);
      });
    }
  }

  // dx_t = sum_j dx_part[token_index_map[t k + j]] (+ dlogits_t W_g), slot order.
  if (a.dx.present) {
    pool_.parallel_for(ceil_div(L, kTokenBlock), [&](int64_t b, int worker) {
      float* acc = scratch(w, worker);
      float* row = acc + d;
      for (int64_t t = b * kTokenBlock; t < std::min(L, (b + 1) * kTokenBlock); ++t) {
        std::fill(acc, acc + d, 0.f);
        for (int64_t j = 0; j < k; ++j) {
          if (plan.token_index_map[t * k + j] < 0) continue;  // an empty slot (a masked token)
          const float* part = w.dx_part + static_cast<int64_t>(plan.token_index_map[t * k + j]) * d;
          for (int64_t i = 0; i < d; ++i) acc[i] += part[i];
        }
        if (needs.router_adds_dx)
          for (int64_t e = 0; e < E; ++e) {
            const float dl = w.dlogits[t * E + e];
            load_row(a.router_weight.row(e), a.router_weight.dtype, d, row);
            for (int64_t i = 0; i < d; ++i) acc[i] += dl * row[i];
          }
        store_row(a.dx.row(t), a.dx.dtype, d, acc, a.dx.accumulate);
      }
    });
  }
  if (last_use) *sv.header = spent_saved_header(cfg_, L);
  report_ok(a);
}

}  // namespace

std::unique_ptr<Engine> make_cpu_engine(const LayerConfig& cfg) { return std::make_unique<CpuEngine>(cfg); }

}  // namespace v0
}  // namespace moeblaze
