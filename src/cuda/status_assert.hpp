// moeblaze_assert_status on a CUDA handle: a device-side assertion, in stream order, when a STATUS
// scalar holds an error. Declared without CUDA types so the layer needs no #ifdef (builds
// without CUDA link device_stub.cpp, which refuses).
#pragma once

#include <cstdint>

namespace moeblaze {
inline namespace v0 {
namespace cuda {

enum class StatusSite : int32_t { kForward = 0, kBackward = 1, kRoute = 2 };

// Enqueues on `stream` (a cudaStream_t) one thread that reads *status and, when it is not 0,
// fails an assertion naming the site's cause (core/device_errors.hpp).
void assert_status(const int32_t* status, StatusSite site, int32_t device_id, void* stream);

}  // namespace cuda
}  // namespace v0
}  // namespace moeblaze
