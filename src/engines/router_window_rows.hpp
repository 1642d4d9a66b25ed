// The router backward's per-window rows, as engines/cuda_router.cpp lays them out: bf16 layers
// run its GEMMs on tensor cores from [W, 2E] bf16 d-logit pairs, other dtypes from [W, d] fp32
// x rows; both write dx's router part as [W, d] fp32 rows. A pure function of the shape, so the
// fused engine's window rule (engines/fused/window.hpp) can count them without a GPU.
#pragma once

#include <cstdint>

#include "core/config.hpp"

namespace moeblaze {
inline namespace v0 {

inline bool router_backward_on_tensor_cores(const LayerConfig& cfg) {
  return cfg.act_dtype == DType::kBF16 && cfg.weight_dtype == DType::kBF16;
}

inline int64_t router_window_row_bytes_per_token(const LayerConfig& cfg) {
  return router_backward_on_tensor_cores(cfg) ? 2 * 2 * cfg.num_experts : 4 * cfg.hidden + 4 * cfg.hidden;
}

}  // namespace v0
}  // namespace moeblaze
