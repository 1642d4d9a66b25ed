// Writing the saved buffer's header from the stream (a kernel with the header as its argument:
// stream-ordered after the regions it vouches for, and capturable, unlike a pageable memcpy).
#pragma once

#include <cuda_runtime.h>

#include "core/memory_layout.hpp"

namespace moeblaze {
inline namespace v0 {
namespace cuda {

void store_saved_header(const SavedHeader& header, SavedHeader* dst, cudaStream_t s);

}  // namespace cuda
}  // namespace v0
}  // namespace moeblaze
