// Device discovery for builds without CUDA: there are no CUDA devices.
#include "cuda/device.hpp"
#include "cuda/status_assert.hpp"
#include "util/error.hpp"

namespace moeblaze {
inline namespace v0 {
namespace cuda {

bool built_with_cuda() { return false; }
int32_t device_count() { return 0; }
int32_t current_device() { return 0; }
DeviceInfo device_info(int32_t id) {
  fail(Status::kArchMismatch, "CUDA device %d requested, but this build of libmoeblaze has no CUDA support", id);
}
bool has_kernels_for(int32_t, int32_t) { return false; }
void assert_status(const int32_t*, StatusSite, int32_t device_id, void*) {
  fail(Status::kArchMismatch, "CUDA device %d requested, but this build of libmoeblaze has no CUDA support", device_id);
}

}  // namespace cuda
}  // namespace v0
}  // namespace moeblaze
