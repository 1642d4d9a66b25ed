#include <algorithm>

#include "core/device_errors.hpp"
#include "cuda/async_status.hpp"
#include "cuda/chained_launch.cuh"
#include "cuda/cuda_check.hpp"
#include "cuda/device_guard.hpp"
#include "cuda/status_assert.hpp"
#include "util/align.hpp"
#include "util/error.hpp"

// The CUDA runtime's assertion handler (what assert() calls on the device), declared here
// because <assert.h> leaves it out under NDEBUG; the check must hold in release builds.
extern "C" __device__ void __assert_fail(const char* assertion, const char* file, unsigned int line,
                                         const char* function) noexcept;

namespace moeblaze {
inline namespace v0 {
namespace cuda {
namespace {

__device__ __forceinline__ int32_t status_of(int32_t flag, int32_t insufficient_bits, int32_t internal_bits) {
  return (flag & internal_bits)       ? static_cast<int32_t>(Status::kInternalError)
         : (flag & insufficient_bits) ? static_cast<int32_t>(Status::kInsufficientWorkspace)
         : flag                       ? static_cast<int32_t>(Status::kInvalidArgument)
                                      : 0;
}

__global__ void status_kernel(const int32_t* flag, int32_t* status, int32_t insufficient_bits, int32_t internal_bits) {
  cuda::wait_for_prior_grids();
  cuda::allow_next_grid();
  *status = status_of(*flag, insufficient_bits, internal_bits);
}

// An output of end_call_kernel as 3-D [n0, n1, n2] (strides s0, s1; innermost 1) and its NaN.
struct PoisonTarget {
  char* data;
  int64_t n0, n1, n2, s0, s1;
  int32_t elem_bytes;
  uint32_t nan_bits;
};
struct PoisonTargets {
  PoisonTarget t[CallEnd::kMaxOutputs];
  int32_t count;
};

__global__ void end_call_kernel(const int32_t* flag, PoisonTargets outs, int32_t* status, int32_t insufficient_bits,
                                int32_t internal_bits, SavedHeader* header_dst, SavedHeader header,
                                bool header_unless_flag) {
  cuda::wait_for_prior_grids();
  cuda::allow_next_grid();
  const int32_t f = *flag;
  if (blockIdx.x == 0 && threadIdx.x == 0) {
    if (status) *status = status_of(f, insufficient_bits, internal_bits);
    if (header_dst && (!header_unless_flag || f == 0)) *header_dst = header;
  }
  if (f == 0) return;
  const int64_t first = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  const int64_t step = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int32_t o = 0; o < outs.count; ++o) {
    const PoisonTarget& p = outs.t[o];
    const int64_t total = p.n0 * p.n1 * p.n2;
    for (int64_t i = first; i < total; i += step) {
      const int64_t c = i % p.n2, r = (i / p.n2) % p.n1, a = i / (p.n1 * p.n2);
      char* e = p.data + (a * p.s0 + r * p.s1 + c) * p.elem_bytes;
      if (p.elem_bytes == 4)
        *reinterpret_cast<uint32_t*>(e) = p.nan_bits;
      else
        *reinterpret_cast<uint16_t*>(e) = static_cast<uint16_t>(p.nan_bits);
    }
  }
}

__global__ void flag_if_status_kernel(const int32_t* status, int32_t* flag, int32_t bit) {
  cuda::wait_for_prior_grids();
  cuda::allow_next_grid();
  if (*status != 0) *flag |= bit;
}

__global__ void assert_status_kernel(const int32_t* status, StatusSite site) {
  cuda::wait_for_prior_grids();
  cuda::allow_next_grid();
  if (*status == 0) return;
  const char* cause = *status == static_cast<int32_t>(Status::kInsufficientWorkspace) ? MOEBLAZE_DEVICE_ERROR_EP_RECV_BOUND
                      : *status == static_cast<int32_t>(Status::kInternalError)       ? MOEBLAZE_DEVICE_ERROR_EP_ROWS_LATE
                      : site == StatusSite::kForward    ? MOEBLAZE_DEVICE_ERROR_FORWARD
                      : site == StatusSite::kBackward ? MOEBLAZE_DEVICE_ERROR_BACKWARD
                                                      : MOEBLAZE_DEVICE_ERROR_ROUTE;
  __assert_fail(cause, __FILE__, __LINE__, __func__);
}

}  // namespace

void end_call(const int32_t* flag, const CallEnd& end, cudaStream_t s) {
  PoisonTargets outs{};
  int64_t largest = 0;
  for (const View* v : end.outputs) {
    if (!v || !v->present) continue;
    PoisonTarget& p = outs.t[outs.count++];
    int64_t n[3] = {1, 1, 1}, st[3] = {0, 0, 1};
    for (int i = 0; i < v->ndim; ++i) {
      n[3 - v->ndim + i] = v->shape[i];
      st[3 - v->ndim + i] = v->stride[i];
    }
    p = {v->data,
         n[0],
         n[1],
         n[2],
         st[0],
         st[1],
         static_cast<int32_t>(v->elem()),
         v->dtype == DType::kF32    ? 0x7fc00000u
         : v->dtype == DType::kBF16 ? 0x7fc0u
                                    : 0x7e00u};
    largest = std::max(largest, n[0] * n[1] * n[2]);
  }
  const unsigned blocks = static_cast<unsigned>(std::clamp<int64_t>(ceil_div(largest, 256), 1, 1024));
  cuda::launch_chained(end_call_kernel, blocks, 256, 0, s, flag, outs,
                       end.status.present ? reinterpret_cast<int32_t*>(end.status.data) : nullptr,
                       end.insufficient_bits, end.internal_bits, end.header_dst, end.header, end.header_unless_flag);
  MOEBLAZE_CUDA_LAUNCH_CHECK("end_call");
}

void write_status(const int32_t* flag, const View& status, cudaStream_t s, int32_t insufficient_bits,
                  int32_t internal_bits) {
  if (!status.present) return;
  cuda::launch_chained(status_kernel, 1, 1, 0, s, flag, reinterpret_cast<int32_t*>(status.data), insufficient_bits,
                       internal_bits);
  MOEBLAZE_CUDA_LAUNCH_CHECK("write_status");
}

void flag_if_status(const int32_t* status, int32_t* flag, int32_t bit, cudaStream_t s) {
  cuda::launch_chained(flag_if_status_kernel, 1, 1, 0, s, status, flag, bit);
  MOEBLAZE_CUDA_LAUNCH_CHECK("flag_if_status");
}

void assert_status(const int32_t* status, StatusSite site, int32_t device_id, void* stream) {
  DeviceGuard guard(device_id);
  cuda::launch_chained(assert_status_kernel, 1, 1, 0, static_cast<cudaStream_t>(stream), status, site);
  MOEBLAZE_CUDA_LAUNCH_CHECK("assert_status");
}

}  // namespace cuda
}  // namespace v0
}  // namespace moeblaze
