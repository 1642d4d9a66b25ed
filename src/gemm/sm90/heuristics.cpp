#include "gemm/sm90/heuristics.hpp"
#include "gemm/sm90/tile_config.hpp"
#include "util/align.hpp"

#include <algorithm>
#include <cstdlib>
#include <cstring>

namespace moeblaze {
inline namespace v0 {
namespace gemm {
namespace sm90 {
namespace {

// The value of an environment knob, or "" (read once by each caller's static).
const char* knob(const char* name) {
  const char* v = std::getenv(name);
  return v ? v : "";
}

}  // namespace

// Both engines in one H100 session, bf16 fwd+bwd (moeblaze-bench, perf/NOTES.md): the fused
// engine was the faster on every benchmarked layer, from the coarse conf4 (E = 16, h = 8192:
// 61.07 vs 62.80 ms SwiGLU) and conf2 to the fine-grained ones (Qwen3-30B-A3B-like 14.29 vs
// 18.54 ms) and the DeepSeek-V3-like slice (29.76 vs 31.32 ms), up to Mixtral's h = 14,336
// (51.90 vs 52.01 ms, equal within noise, at a fraction of cuBLASLt's workspace). Wider experts
// than any measured keep cuBLASLt.
bool fused_engine_auto(int64_t, int64_t ffn_hidden, int64_t, int64_t) { return ffn_hidden <= 16384; }

bool ep_overlap(int32_t P, int64_t E, int64_t k, int64_t gate_up_cols, int64_t es, int32_t send_ctas, int32_t sms) {
  static const int forced = [] {  // 0: by the rule, 1: always, -1: never
    const char* v = knob("MOEBLAZE_EP_OVERLAP");
    return !std::strcmp(v, "1") ? 1 : !std::strcmp(v, "0") ? -1 : 0;
  }();
  if (forced) return forced > 0;
  if (P < 2 || E <= 0 || k <= 0 || gate_up_cols <= 0 || static_cast<int64_t>(send_ctas) * 4 > sms) return false;
  double none_here = 1.0;  // C(E - E/P, k) / C(E, k): a token reaches none of a rank's experts
  for (int64_t i = 0; i < k; ++i) none_here *= static_cast<double>(E - E / P - i) / static_cast<double>(E - i);
  const double ranks = P * (1.0 - std::max(none_here, 0.0));
  return ranks * static_cast<double>(es) / (2.0 * static_cast<double>(k) * static_cast<double>(gate_up_cols)) >= 2e-4;
}

bool ep_returns_from_combine() {
  static const bool on = std::strcmp(knob("MOEBLAZE_EP_RETURN"), "kernel") != 0;
  return on;
}

bool pregather(int64_t gate_up_cols, int64_t ffn_hidden) {
  static const int forced = [] {  // 0: by the rule, 1: always, -1: never
    const char* v = knob("MOEBLAZE_FUSED_PREGATHER");
    return !std::strcmp(v, "always") ? 1 : !std::strcmp(v, "never") ? -1 : 0;
  }();
  return forced ? forced > 0 : gate_up_cols + ffn_hidden >= 4608;
}

static ConsumerSchedule schedule_override() {
  static const ConsumerSchedule forced = [] {
    const char* v = knob("MOEBLAZE_SM90_SCHEDULE");
    if (!std::strcmp(v, "cooperative")) return ConsumerSchedule::kCooperative;
    if (!std::strcmp(v, "pingpong")) return ConsumerSchedule::kPingPong;
    if (!std::strcmp(v, "epilogue-warpgroup")) return ConsumerSchedule::kEpilogueWarpgroup;
    return ConsumerSchedule::kAuto;
  }();
  return forced;
}

// Where the epilogue warps' dact GEMM beats the separate pass (and the in-ring epilogue): dy
// gathered with 1024 < K <= 2048, or in expert order with K > 2048 (its producer is one TMA warp,
// so the two gathering warps the epilogue warps leave are no cost there), from 256 columns.
static bool epilogue_warps_win(const GroupedGemmParams& dact) {
  if (dact.n < kActBackwardWarpgroupBlockN) return false;
  return dact.a_index ? dact.k > 1024 && dact.k <= 2048 : dact.k > 2048;
}

// Gated activations' in-ring tiles at short K (choose_kernel's comment).
static bool narrow_gated_ring(const GroupedGemmParams& dact, bool gated) { return gated && dact.k <= 768; }

KernelChoice choose_kernel(const GroupedGemmParams& p, const EpilogueParams& e, KernelChoice kc) {
  if (kc.schedule == ConsumerSchedule::kAuto) kc.schedule = schedule_override();
  if (e.kind == EpilogueKind::kActivationBackward) {
    // The epilogue warps store dpre and g act 16 bytes at a time.
    const bool vector_outputs = aligned16(e.c) && aligned16(e.act) && e.ldc % 8 == 0 && e.ld_act % 8 == 0;
    const bool warps = vector_outputs && (kc.schedule == ConsumerSchedule::kEpilogueWarpgroup ||
                                          (kc.schedule != ConsumerSchedule::kCooperative && epilogue_warps_win(p)));
    if (warps) return {kActBackwardWarpgroupBlockN, ConsumerSchedule::kEpilogueWarpgroup};
    const int bn = kc.block_n ? kc.block_n : (narrow_gated_ring(p, is_gated(e.activation)) || p.n < 256) ? 128 : 256;
    return {bn, ConsumerSchedule::kCooperative};
  }
  // The epilogue warps serve the activation backward only.
  if (kc.schedule == ConsumerSchedule::kEpilogueWarpgroup) kc.schedule = ConsumerSchedule::kCooperative;
  if (kc.schedule == ConsumerSchedule::kAuto) kc.schedule = ConsumerSchedule::kCooperative;
  if (kc.schedule == ConsumerSchedule::kPingPong) kc.block_n = 128;
  if (kc.block_n == 0) kc.block_n = (p.gated ? 2 * p.n : p.n) >= 256 ? 256 : 128;
  kc.deferred_activation = e.kind == EpilogueKind::kActivation && kc.schedule == ConsumerSchedule::kCooperative &&
                           kc.block_n == 256 && activation_epilogue_deferred(e.activation) &&
                           (p.gated != 0) == is_gated(e.activation) && staged_epilogue_allowed() &&
                           deferred_epilogue_allowed();
  return kc;
}

bool act_backward_in_epilogue(const GroupedGemmParams& dact, bool gated) {
  static const int forced = [] {  // 0: by the rule, 1: epilogue, -1: separate
    const char* v = knob("MOEBLAZE_SM90_ACT_BACKWARD");
    return !std::strcmp(v, "separate") ? -1 : !std::strcmp(v, "epilogue") ? 1 : 0;
  }();
  if (forced) return forced > 0;
  const bool in_ring = dact.k <= (dact.a_index ? 1024 : 2048) && (!gated || dact.n >= 2048 || narrow_gated_ring(dact, gated));
  return in_ring || epilogue_warps_win(dact);
}

int32_t raster_group() {
  static const int32_t group = [] {
    const char* v = knob("MOEBLAZE_SM90_RASTER");
    return *v ? static_cast<int32_t>(std::max(0L, std::strtol(v, nullptr, 10))) : kRasterRowBlocks;
  }();
  return group;
}

bool a_by_tma_allowed() {
  static const bool allowed = std::strcmp(knob("MOEBLAZE_SM90_A_LOAD"), "cp.async") != 0;
  return allowed;
}

bool staged_epilogue_allowed() {
  static const bool allowed = std::strcmp(knob("MOEBLAZE_SM90_EPILOGUE"), "registers") != 0 &&
                              std::strcmp(knob("MOEBLAZE_SANITIZER_INIT_GEMM_OUTPUTS"), "1") != 0;
  return allowed;
}

bool token_order_stores_allowed() {
  static const bool allowed = std::strcmp(knob("MOEBLAZE_FUSED_TOKEN_ORDER_STORES"), "0") != 0;
  return allowed;
}

bool deferred_epilogue_allowed() {
  static const bool allowed = std::strcmp(knob("MOEBLAZE_SM90_EPILOGUE"), "staged") != 0;
  return allowed;
}

}  // namespace sm90
}  // namespace gemm
}  // namespace v0
}  // namespace moeblaze
