#include "cuda/async_status.hpp"

#include <algorithm>

#include "core/device_errors.hpp"
#include "cuda/cuda_check.hpp"
#include "cuda/device_guard.hpp"
#include "cuda/status_assert.hpp"
#include "util/align.hpp"
#include "util/error.hpp"
#include "util/vec8.cuh"

// The CUDA runtime's assertion handler (what assert() calls on the device), declared here
// because <assert.h> leaves it out under NDEBUG; the check must hold in release builds.
extern "C" __device__ void __assert_fail(const char* assertion, const char* file, unsigned int line,
                                         const char* function) noexcept;

namespace moeblaze {
inline namespace v0 {
namespace cuda {
namespace {

// One element per iteration of a grid-stride loop over the view's logical index space; the
// flag is read once per thread, so an unflagged call costs one tiny launch.
template <class T>
__global__ void poison_kernel(const int32_t* flag, T* data, int64_t n0, int64_t n1, int64_t n2, int64_t s0, int64_t s1) {
  if (*flag == 0) return;
  const int64_t total = n0 * n1 * n2;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < total;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t c = i % n2, r = (i / n2) % n1, a = i / (n1 * n2);
    Elem<T>::store1(data + a * s0 + r * s1 + c, __int_as_float(0x7fc00000));
  }
}

__global__ void status_kernel(const int32_t* flag, int32_t* status, int32_t insufficient_bits, int32_t internal_bits) {
  *status = (*flag & internal_bits)       ? static_cast<int32_t>(Status::kInternalError)
            : (*flag & insufficient_bits) ? static_cast<int32_t>(Status::kInsufficientWorkspace)
            : *flag                     ? static_cast<int32_t>(Status::kInvalidArgument)
                                        : 0;
}

__global__ void flag_if_status_kernel(const int32_t* status, int32_t* flag, int32_t bit) {
  if (*status != 0) *flag |= bit;
}

__global__ void assert_status_kernel(const int32_t* status, StatusSite site) {
  if (*status == 0) return;
  const char* cause = *status == static_cast<int32_t>(Status::kInsufficientWorkspace) ? MOEBLAZE_DEVICE_ERROR_EP_RECV_BOUND
                      : *status == static_cast<int32_t>(Status::kInternalError)       ? MOEBLAZE_DEVICE_ERROR_EP_ROWS_LATE
                      : site == StatusSite::kForward    ? MOEBLAZE_DEVICE_ERROR_FORWARD
                      : site == StatusSite::kBackward ? MOEBLAZE_DEVICE_ERROR_BACKWARD
                                                      : MOEBLAZE_DEVICE_ERROR_ROUTE;
  __assert_fail(cause, __FILE__, __LINE__, __func__);
}

}  // namespace

void poison_if_flagged(const int32_t* flag, const View& out, cudaStream_t s) {
  if (!out.present) return;
  // As 3-D [n0, n1, n2] with strides s0, s1 (the innermost stride is 1).
  int64_t n[3] = {1, 1, 1}, st[3] = {0, 0, 1};
  for (int i = 0; i < out.ndim; ++i) {
    n[3 - out.ndim + i] = out.shape[i];
    st[3 - out.ndim + i] = out.stride[i];
  }
  const int64_t total = n[0] * n[1] * n[2];
  if (total == 0) return;
  const unsigned blocks = static_cast<unsigned>(std::min<int64_t>(ceil_div(total, 256), 1024));
  MOEBLAZE_DISPATCH_FLOAT(out.dtype, T,
                          poison_kernel<T><<<blocks, 256, 0, s>>>(flag, reinterpret_cast<T*>(out.data), n[0], n[1], n[2],
                                                                  st[0], st[1]));
  MOEBLAZE_CUDA_LAUNCH_CHECK("poison_if_flagged");
}

void write_status(const int32_t* flag, const View& status, cudaStream_t s, int32_t insufficient_bits,
                  int32_t internal_bits) {
  if (!status.present) return;
  status_kernel<<<1, 1, 0, s>>>(flag, reinterpret_cast<int32_t*>(status.data), insufficient_bits, internal_bits);
  MOEBLAZE_CUDA_LAUNCH_CHECK("write_status");
}

void flag_if_status(const int32_t* status, int32_t* flag, int32_t bit, cudaStream_t s) {
  flag_if_status_kernel<<<1, 1, 0, s>>>(status, flag, bit);
  MOEBLAZE_CUDA_LAUNCH_CHECK("flag_if_status");
}

void assert_status(const int32_t* status, StatusSite site, int32_t device_id, void* stream) {
  DeviceGuard guard(device_id);
  assert_status_kernel<<<1, 1, 0, static_cast<cudaStream_t>(stream)>>>(status, site);
  MOEBLAZE_CUDA_LAUNCH_CHECK("assert_status");
}

}  // namespace cuda
}  // namespace v0
}  // namespace moeblaze
