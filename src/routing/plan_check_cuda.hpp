// The GPU form of routing::validate_plan (routing/plan.hpp): the same rules, checked on the
// device without a host sync; the result lands in a device flag the engine reads when it may.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "core/memory_layout.hpp"

namespace moeblaze {
inline namespace v0 {
namespace routing {

// Bits of the engines' device error flag.
constexpr int32_t kCallerIdsInvalid = 1;  // caller TOPK_INDICES out of range or repeated
constexpr int32_t kPlanInvalid = 2;       // a saved routing plan failed validate_plan's rules
constexpr int32_t kSavedHeaderInvalid = 4;  // a saved buffer's header is not this handle's forward's
// (8, 16 and 32 are the expert-parallel layer's: src/ep/send_plan.hpp, src/engines/ep/ep_engine.cpp.)
constexpr int32_t kSequenceLengthsInvalid = 64;  // SEQUENCE_LENGTHS: a length outside [1, L], or a sum other than L

// Sets kPlanInvalid in *flag if `plan` breaks any rule of validate_plan. Reads only the plan's
// [L*k] and [E+1] arrays, whatever they hold. With empty_slots (LayerConfig::empty_slots) a slot
// may hold -1 with no position, and the positions end at off[E] <= L*k, each one a slot's.
void validate_plan_cuda(const RoutingPlan& plan, int64_t num_tokens, int64_t k, int64_t num_experts, bool empty_slots,
                        int32_t* flag, cudaStream_t s);

}  // namespace routing
}  // namespace v0
}  // namespace moeblaze
