// The saved-buffer layout (forward -> backward), shared by every engine and documented in
// docs/design.md ("Saved buffer") and docs/memory.md.
#pragma once

#include <cstddef>
#include <cstdint>

#include "core/config.hpp"
#include "util/dtype.hpp"

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

// The tokens a call routed: all L, or those a TOKEN_MASK left, whose k picks fill the positions
// [0, offsets[E]); within [0, L] whatever a saved plan holds. The losses are means over them.
MOEBLAZE_HD int64_t routed_tokens(const int32_t* offsets, int64_t L, int64_t E, int64_t k) {
  const int64_t filled = offsets[E] > 0 ? offsets[E] : 0;
  return filled / k < L ? filled / k : L;
}

// The first bytes of every saved buffer, written last by a training forward. Backward checks it
// before it reads anything else in the buffer: a buffer that forward did not write, or wrote
// for another configuration or token count, is rejected instead of misread.
struct SavedHeader {
  uint32_t magic;               // kSavedMagic
  uint32_t layout_version;      // kSavedLayoutVersion: bumped whenever the layout changes
  uint64_t config_fingerprint;  // saved_fingerprint(cfg): what shapes the bytes and their meaning
  int64_t num_tokens;           // L of the forward that wrote it
  int32_t pass;                 // the pass that wrote it (FORWARD_TRAINING)
  int32_t engine;               // EngineKind of the writer
  uint64_t check;               // hash of the fields above: a torn or partly overwritten header fails
};
static_assert(sizeof(SavedHeader) == 40, "SavedHeader is part of the saved layout");
constexpr uint32_t kSavedMagic = 0x5a53424du;  // "MBSZ" in memory order
constexpr uint32_t kSavedLayoutVersion = 1;

uint64_t saved_fingerprint(const LayerConfig& cfg);
SavedHeader make_saved_header(const LayerConfig& cfg, int64_t num_tokens);
// The header a last-use backward leaves (moeblaze_backward_last_use): pass kBackwardLastUse, so
// that a later backward on the buffer is refused, with that reason.
SavedHeader spent_saved_header(const LayerConfig& cfg, int64_t num_tokens);
// Throws Error(kInvalidArgument) naming the first field of `got` that differs from what this
// handle's forward would have written for num_tokens.
void check_saved_header(const SavedHeader& got, const LayerConfig& cfg, int64_t num_tokens);

struct SavedRegions {
  SavedHeader* header = nullptr;  // saved buffer only
  RoutingPlan plan;
  void* preact = nullptr;  // [L*k, g*h] activation dtype, expert order (PREACT, ALL)
  void* act = nullptr;     // [L*k, h] activation dtype, expert order (ALL)
  size_t bytes = 0;
};

// Carves the saved regions from `base` (nullptr: sizes only). Used for the saved buffer of a
// training forward (header, plan, activations), and for the plan alone in the workspace of an
// inference forward or a route (saved_buffer = false).
SavedRegions carve_saved(const LayerConfig& cfg, int64_t num_tokens, void* base, bool saved_buffer = true);

}  // namespace v0
}  // namespace moeblaze
