// Writing and checking the saved buffer's header from the stream (a kernel with the header as its argument:
// stream-ordered after the regions it vouches for, and capturable, unlike a pageable memcpy).
#pragma once

#include <cuda_runtime.h>

#include "core/memory_layout.hpp"

namespace moeblaze {
inline namespace v0 {
namespace cuda {

// Writes the header (the sync-free engines write theirs in cuda::end_call, unless the call
// flagged bad input).
void store_saved_header(const SavedHeader& header, SavedHeader* dst, cudaStream_t s);

// The sync-free form of check_saved_header (core/memory_layout.hpp): sets `bit` in *flag unless
// the header at `got` is bitwise the one this handle's forward writes (`want`).
void check_saved_header_cuda(const SavedHeader& want, const SavedHeader* got, int32_t* flag, int32_t bit, cudaStream_t s);

}  // namespace cuda
}  // namespace v0
}  // namespace moeblaze
