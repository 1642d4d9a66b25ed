// The end of a sync-free call (docs/errors.md, "Asynchronous status"): the engine's device error
// flag decides, on the device and in stream order, whether the call's outputs stand or are
// replaced by NaN, and what the caller's optional STATUS scalar reads.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "core/memory_layout.hpp"
#include "core/view.hpp"

namespace moeblaze {
inline namespace v0 {
namespace cuda {

// STATUS = INVALID_ARGUMENT when *flag != 0, else 0 (status absent: nothing); INSUFFICIENT_WORKSPACE
// when the flag holds one of insufficient_bits (a bound set at create that a call overran);
// INTERNAL_ERROR when it holds one of internal_bits (another GPU's rows never came).
void write_status(const int32_t* flag, const View& status, cudaStream_t s, int32_t insufficient_bits = 0,
                  int32_t internal_bits = 0);

// The end of a forward or backward in one launch: when *flag != 0 every element of each present
// floating-point output is NaN; write_status's STATUS; and the saved header written (while *flag == 0 only, when
// header_unless_flag: a forward that found bad input leaves the buffer vouching for nothing).
struct CallEnd {
  static constexpr int kMaxOutputs = 6;
  const View* outputs[kMaxOutputs] = {};  // null entries are skipped
  View status;
  int32_t insufficient_bits = 0, internal_bits = 0;
  SavedHeader* header_dst = nullptr;  // null: no header
  SavedHeader header{};
  bool header_unless_flag = true;
};
void end_call(const int32_t* flag, const CallEnd& end, cudaStream_t s);

// *flag |= bit when a nested call's STATUS scalar reads nonzero.
void flag_if_status(const int32_t* status, int32_t* flag, int32_t bit, cudaStream_t s);

}  // namespace cuda
}  // namespace v0
}  // namespace moeblaze
