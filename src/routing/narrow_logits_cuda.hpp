// The router's logits for few experts, logits [L, E] fp32 = x [L, d] W_g [E, d]^T, on tensor
// cores through warp-level MMAs (sm_80 and later): one read of x near the HBM rate. Where it
// serves, cuBLASLt was measured as fast or slower (up to 1.7x at d = 512, E = 4, where it picks
// an sm_80 wmma kernel) and its kernel for E = 8 showed racecheck hazards (perf/NOTES.md).
// Bits fixed by the shapes: every output is the same sum in the same order on every run.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "core/view.hpp"

namespace moeblaze {
inline namespace v0 {
namespace routing {

// The most experts the narrow kernel serves: up to 8 at any hidden size, up to 16 at d <= 1024
// (one or two 8-wide column tiles a warp; past these cuBLASLt was faster, perf/NOTES.md).
constexpr int64_t kNarrowLogitsMaxExperts = 16;

// Why the narrow kernel cannot compute this call's logits (null: it can): x and W_g bf16 or
// fp16 of one dtype, rows of d % 8 == 0 elements at 16-byte aligned addresses, E as above.
// Host-only: reads the views' pointers and strides.
const char* narrow_logits_unsupported(const View& x, const View& router_weight, int64_t E, int64_t d);

// logits [L, E] (dense fp32) = x W_g^T, for a call narrow_logits_unsupported accepts.
void narrow_logits_cuda(const View& x, const View& router_weight, int64_t L, int64_t E, int64_t d, float* logits,
                        cudaStream_t s);

}  // namespace routing
}  // namespace v0
}  // namespace moeblaze
