// Token-order reductions through token_index_map, without atomics: each token's k slots are
// summed in slot order by the one worker that owns the token (deterministic).
#pragma once

#include <cstdint>

#include "core/view.hpp"
#include "core/memory_layout.hpp"

namespace moeblaze {
inline namespace v0 {
namespace combine {

// y_t = sum_j gates_tj * O[token_index_map[t k + j]] for t in [t0, t1). O: [L k, d] rows of
// dtype o_dtype in expert order. acc: d floats of scratch, row: d floats.
void combine_outputs(const RoutingPlan& plan, int64_t k, int64_t d, const void* O, DType o_dtype, const View& y,
                     int64_t t0, int64_t t1, float* acc, float* row);

// Gathers per-slot values from expert order to token order: out[t k + j] = v[map[t k + j]].
void to_token_order(const RoutingPlan& plan, int64_t k, const float* v_expert_order, int64_t t0, int64_t t1,
                    float* out_token_order);

}  // namespace combine
}  // namespace v0
}  // namespace moeblaze
