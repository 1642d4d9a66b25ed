// The saved-buffer layout (forward -> backward), shared by every engine and documented in
// docs/design.md ("Saved buffer") and docs/memory.md.
#pragma once

#include <cstddef>
#include <cstdint>

#include "core/config.hpp"

namespace moeblaze {
inline namespace v0 {

// The paper's four index lists plus the gates; int32 because MAX_TOKENS * TOP_K < 2^31.
struct RoutingPlan {
  int32_t* token_expert_indices = nullptr;  // [L*k] expert of (t, j) = top-k ids, token order
  float* gates = nullptr;                   // [L*k] gate weight of (t, j), token order
  int32_t* expert_token_indices = nullptr;  // [L*k] token ids grouped by expert
  int32_t* token_index_map = nullptr;       // [L*k] position of (t, j) in expert_token_indices
  int32_t* expert_token_offsets = nullptr;  // [E+1] exclusive prefix sum of tokens per expert
};

struct SavedRegions {
  RoutingPlan plan;
  void* preact = nullptr;  // [L*k, g*h] activation dtype, expert order (PREACT, ALL)
  void* act = nullptr;     // [L*k, h] activation dtype, expert order (ALL)
  size_t bytes = 0;
};

// Carves the saved regions from `base` (nullptr: sizes only). Used for the saved buffer of a
// training forward, and for the plan in the workspace of an inference forward (with_acts=false).
SavedRegions carve_saved(const LayerConfig& cfg, int64_t num_tokens, void* base, bool with_acts = true);

}  // namespace v0
}  // namespace moeblaze
