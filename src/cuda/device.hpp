// CUDA device discovery. Compiled from device.cu when the build has CUDA, else from
// device_stub.cpp (which reports no devices), so the rest of the library needs no #ifdefs.
#pragma once

#include <cstdint>

namespace moeblaze {
inline namespace v0 {
namespace cuda {

struct DeviceInfo {
  int32_t id;
  int32_t sm_major, sm_minor;
  int32_t multiprocessors;
  int64_t global_memory_bytes;
  char name[256];
};

bool built_with_cuda();
// Number of usable CUDA devices; 0 when there is no driver, no device, or no CUDA in the build.
int32_t device_count();
// The calling thread's current device (0 when none is set).
int32_t current_device();
// Properties of a device; throws Error(kArchMismatch) if it does not exist.
DeviceInfo device_info(int32_t id);
// True when this build carries kernels that run on sm_major.sm_minor.
bool has_kernels_for(int32_t sm_major, int32_t sm_minor);

}  // namespace cuda
}  // namespace v0
}  // namespace moeblaze
