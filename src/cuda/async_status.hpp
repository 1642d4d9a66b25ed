// The end of a sync-free call (docs/errors.md, "Asynchronous status"): the engine's device error
// flag decides, on the device and in stream order, whether the call's outputs stand or are
// replaced by NaN, and what the caller's optional STATUS scalar reads.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "core/view.hpp"

namespace moeblaze {
inline namespace v0 {
namespace cuda {

// Fills every element of a floating-point view with NaN when *flag != 0 (nothing otherwise).
void poison_if_flagged(const int32_t* flag, const View& out, cudaStream_t s);

// STATUS = INVALID_ARGUMENT when *flag != 0, else 0 (status absent: nothing); INSUFFICIENT_WORKSPACE
// when the flag holds one of insufficient_bits (a bound set at create that a call overran);
// INTERNAL_ERROR when it holds one of internal_bits (another GPU's rows never came).
void write_status(const int32_t* flag, const View& status, cudaStream_t s, int32_t insufficient_bits = 0,
                  int32_t internal_bits = 0);

// *flag |= bit when a nested call's STATUS scalar reads nonzero.
void flag_if_status(const int32_t* status, int32_t* flag, int32_t bit, cudaStream_t s);

}  // namespace cuda
}  // namespace v0
}  // namespace moeblaze
