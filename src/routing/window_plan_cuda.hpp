// A window of a call's tokens seen through the call's routing plan, so that the fused engine
// can run the expert MLPs on [t0, t0 + rows) alone with workspace sized by the window, not by
// the call. Tokens ascend within each expert's range of the plan (validate_plan's rule), so the
// window's positions of expert e are one contiguous run, found by binary search: the window is
// itself a plan of rows * k rows, in expert order, that points back into the call's plan.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "core/memory_layout.hpp"
#include "util/align.hpp"

namespace moeblaze {
inline namespace v0 {
namespace routing {

struct WindowPlan {
  int32_t* offsets = nullptr;          // [E + 1] the window's expert ranges (window rows)
  int32_t* call_row = nullptr;         // [W k] the call position of each window row
  int32_t* token = nullptr;            // [W k] the token (x or dy row) of each window row
  float* gate = nullptr;               // [W k] the gate of each window row
  int32_t* token_index_map = nullptr;  // [W k] slot (t - t0) k + j -> window row, -1 if none
  int32_t* scratch = nullptr;          // [2 E + 1]
  // [E] the call position of each expert's first window row (in scratch): expert e's window rows
  // [offsets[e], offsets[e+1]) are its call positions expert_call_row[e] + (r - offsets[e]),
  // consecutive, and below the call's L k.
  int32_t* expert_call_row = nullptr;
};

// Appends a window plan for windows of at most `window` tokens to a carve.
WindowPlan carve_window_plan(Carver& c, int64_t num_experts, int64_t window, int64_t k);

// Fills w for tokens [t0, t0 + rows) of the call's plan (L tokens). Reads only the plan's [L k]
// and [E + 1] arrays and keeps every index in bounds whatever they hold: a plan that breaks
// validate_plan's rules (flagged by validate_plan_cuda) gives a wrong window, never a stray
// access. Rows that no expert range covers get call_row 0, token -1 and gate 0.
void build_window_plan_cuda(const RoutingPlan& plan, int64_t L, int64_t k, int64_t num_experts, int64_t t0,
                            int64_t rows, const WindowPlan& w, cudaStream_t s);

}  // namespace routing
}  // namespace v0
}  // namespace moeblaze
