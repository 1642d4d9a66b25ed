// Expert placement on the device (docs/ep.md, "Model"): rank q owns experts [q E_loc, (q + 1) E_loc).
#pragma once

#include <cstdint>

namespace moeblaze {
inline namespace v0 {
namespace ep {

// The owner of expert e, or -1 outside [0, P E_loc): an id from a saved buffer that failed its
// checks (the call is flagged and poisoned) sends nothing and is written nowhere.
__device__ __forceinline__ int32_t owner_of(int32_t e, int32_t P, int32_t experts_per_rank) {
  return e >= 0 && e / experts_per_rank < P ? e / experts_per_rank : -1;
}

}  // namespace ep
}  // namespace v0
}  // namespace moeblaze
