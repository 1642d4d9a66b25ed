// Whether the fused engine's backward copies dy and x rows into expert order once per window
// (perf/NOTES.md). The copy goes into the window's dx-parts buffer, which is free
// until the dx GEMM, so it costs no workspace: dy's rows feed the dact GEMM and dW_down, then
// x's rows dW_gate_up, each operand by TMA instead of the GEMM producer's 16-byte cp.async
// gathers (which hold the weight-gradient kernel to ~78% of a dense GEMM against ~92% on an
// expert-order copy). The copy moves 2 d bytes per position and tensor twice (read and
// write); the weight gradients it speeds up do 2 d (g h + h) FLOPs per position, so it pays
// where g h + h is large: the break-even estimated from those rates is g h + h ~ 4,600.
// Measured (fwd+bwd, same binary): -3 to -7% at g h + h = 8,192-43,008 (conf2/3/4/6/7 SiLU and
// SwiGLU, Mixtral), even at 6,144 (conf5 SwiGLU, the DeepSeek-V3 slice), +2.5% at 3,072 (OLMoE).
#pragma once

#include <cstdint>

#include "core/config.hpp"

namespace moeblaze {
inline namespace v0 {

// The weight gradients' output columns per model column (gate/up and down) from which the
// copy is made.
constexpr int64_t kPregatherMinColumns = 4608;

inline bool fused_pregather_pays(const LayerConfig& cfg) {
  return cfg.gate_up_cols() + cfg.ffn_hidden >= kPregatherMinColumns;
}

}  // namespace v0
}  // namespace moeblaze
