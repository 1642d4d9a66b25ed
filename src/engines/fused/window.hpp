// The fused engine's token windows: the expert MLPs of a call run on consecutive windows of its
// tokens, so that the per-row workspace (activations, dpre, per-position outputs) is sized by
// the window, not by the call. A pure function of the configuration and L (workspace sizes
// are shape-only queries); docs/memory.md gives the formula.
#pragma once

#include <algorithm>
#include <cstdint>

#include "core/config.hpp"
#include "engines/router_window_rows.hpp"
#include "gemm/sm90/heuristics.hpp"
#include "gemm/sm90/tile_config.hpp"
#include "util/align.hpp"
#include "util/dtype.hpp"

namespace moeblaze {
inline namespace v0 {

// dg per position: fp32 partial sums, one per column block of the dact GEMM's activation
// backward (gemm/sm90/tile_config.hpp).
inline int64_t fused_dg_parts(const LayerConfig& cfg) { return gemm::sm90::act_backward_dg_parts(cfg.ffn_hidden); }

// Backward rows that live in memory a window is done with (the fused engine's carve). The dx
// parts take g * act's rows unless dy's and x's rows are copied into them (the pregather rule):
// dW_down reads g * act for the last time before the dx GEMM writes them.
inline bool fused_dx_parts_in_act(const LayerConfig& cfg) {
  return !gemm::sm90::pregather(cfg.gate_up_cols(), cfg.ffn_hidden) && cfg.hidden <= cfg.ffn_hidden;
}
// The router backward's rows (engines/router_window_rows.hpp) take dpre's where they fit: the
// dx GEMM reads dpre for the last time before the window's router backward.
inline bool fused_router_rows_in_dpre(const LayerConfig& cfg) {
  return router_window_row_bytes_per_token(cfg) <=
         cfg.top_k * cfg.gate_up_cols() * static_cast<int64_t>(dtype_size(cfg.act_dtype));
}

// Bytes of a backward window's row buffers per token: g * act, dpre (over the recomputed pre
// with RECOMPUTE_UP), the dx parts (unless in g * act's rows) and the dg partial sums per
// position, the window plan, and the router backward's rows (unless in dpre's).
inline int64_t fused_window_bytes_per_token(const LayerConfig& cfg) {
  const int64_t es = static_cast<int64_t>(dtype_size(cfg.act_dtype)), gh = cfg.gate_up_cols();
  const int64_t rows = cfg.ffn_hidden + gh + (fused_dx_parts_in_act(cfg) ? 0 : cfg.hidden);
  return cfg.top_k * (rows * es + 4 * 4 + 4 * fused_dg_parts(cfg)) +
         (fused_router_rows_in_dpre(cfg) ? 0 : router_window_row_bytes_per_token(cfg));
}

struct FusedWindows {
  int64_t tokens;  // tokens per window (the last may hold fewer); >= 1
  int64_t count;   // windows of the call; >= 1 (a call of no tokens runs one empty window)
};

// Several windows sum the weight gradients in fp32 across them: [E, d, g h] and [E, h, d].
inline int64_t fused_weight_grad_sum_bytes(const LayerConfig& cfg) {
  return 4 * cfg.num_experts * cfg.hidden * (cfg.gate_up_cols() + cfg.ffn_hidden);
}

// WINDOW_TOKENS when set; else windows of the budget, unless one window of the whole call
// needs no more than gemm::sm90::kOneWindowBytes, or no more than those windows plus twice the
// fp32 sums they bring: every window but the last reads and writes the sums, so windows that
// save less memory than the sums take trade 2 x sums of traffic per window for it (an
// expert-parallel layer's local experts at EP 4 ran 2.4x slower in nine such windows). Either
// way the row buffers stay below max(gemm::sm90::kOneWindowBytes, budget + 2 sums), a bound
// independent of L.
// WINDOW_BYTES: one window when the call's rows fit the budget, else windows whose rows and the
// fp32 sums fit it together, of at least gemm::sm90::kMinWindowTokens tokens.
inline FusedWindows fused_windows(const LayerConfig& cfg, int64_t L) {
  int64_t w = cfg.window_tokens;
  if (w == 0 && cfg.window_bytes > 0) {
    const int64_t per_token = fused_window_bytes_per_token(cfg);
    const int64_t left = cfg.window_bytes - fused_weight_grad_sum_bytes(cfg);
    w = L * per_token <= cfg.window_bytes ? L : std::max(gemm::sm90::kMinWindowTokens, left / per_token);
  } else if (w == 0) {
    const int64_t per_token = fused_window_bytes_per_token(cfg);
    w = std::max(gemm::sm90::kMinWindowTokens, gemm::sm90::kWindowBudgetBytes / per_token);
    if (L * per_token <= std::max(gemm::sm90::kOneWindowBytes, w * per_token + 2 * fused_weight_grad_sum_bytes(cfg)))
      w = L;
  }
  w = std::max<int64_t>(1, std::min(w, L));
  return {w, std::max<int64_t>(1, ceil_div(L, w))};
}

// A last-use backward (moeblaze_backward_last_use) writes dpre over the saved pre when the
// policy saves pre and one window covers the call: dpre's window rows are then the saved pre's
// rows (the call's plan positions), and the activation backward reads each pre element before
// it writes that element's dpre. Several windows keep dpre in the workspace (their rows are a
// window's, not the call's).
inline bool fused_dpre_over_saved_pre(const LayerConfig& cfg, int64_t L, const FusedWindows& windows) {
  return cfg.save_policy != SavePolicy::kRecomputeUp && windows.count == 1 && windows.tokens == L;
}

}  // namespace v0
}  // namespace moeblaze
