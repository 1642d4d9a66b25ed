// CUDA device discovery: device count and properties through the (statically linked)
// CUDA runtime. A missing driver or GPU is not an error here: it is "zero devices".
#include <cuda_runtime.h>

#include <atomic>
#include <cstdlib>
#include <cstring>

#include "cuda/chained_launch.cuh"
#include "cuda/device.hpp"
#include "util/error.hpp"

namespace moeblaze {
inline namespace v0 {
namespace cuda {

bool built_with_cuda() { return true; }

int32_t device_count() {
  int n = 0;
  cudaError_t e = cudaGetDeviceCount(&n);
  if (e != cudaSuccess) {
    cudaGetLastError();  // clear the sticky-free error so later calls start clean
    return 0;
  }
  return n;
}

int32_t current_device() {
  int d = 0;
  if (cudaGetDevice(&d) != cudaSuccess) {
    cudaGetLastError();
    return 0;
  }
  return d;
}

DeviceInfo device_info(int32_t id) {
  int32_t n = device_count();
  if (id < 0 || id >= n)
    fail(Status::kArchMismatch, "CUDA device %d does not exist (%d CUDA device(s) visible)", id, n);
  cudaDeviceProp p;
  cudaError_t e = cudaGetDeviceProperties(&p, id);
  if (e != cudaSuccess) fail(Status::kCudaError, "cudaGetDeviceProperties(%d): %s", id, cudaGetErrorName(e));
  DeviceInfo info;
  info.id = id;
  info.sm_major = p.major;
  info.sm_minor = p.minor;
  info.multiprocessors = p.multiProcessorCount;
  info.global_memory_bytes = static_cast<int64_t>(p.totalGlobalMem);
  std::strncpy(info.name, p.name, sizeof info.name - 1);
  info.name[sizeof info.name - 1] = '\0';
  return info;
}

// The fatbin holds sm_80 and sm_90a SASS: sm_80 code runs on any 8.x/9.x part, sm_90a only on 9.0.
// Machine code for sm_80 (runs on sm_8x) and sm_90a (sm_90 only), plus compute_80 PTX that the
// driver JIT-compiles for anything newer: every device from sm_80 on has kernels. (The fused
// sm_90a engine, once built, is chosen only on sm_90: the registry asks the device.)
bool has_kernels_for(int32_t sm_major, int32_t sm_minor) {
  (void)sm_minor;
  return sm_major >= 8;
}

bool chained_launches_supported() {
  static const bool allowed = [] {
    const char* v = std::getenv("MOEBLAZE_CHAINED_LAUNCHES");
    return !(v && std::strcmp(v, "0") == 0);
  }();
  if (!allowed) return false;
  constexpr int kDevices = 64;
  static std::atomic<int8_t> known[kDevices];  // 0: not asked yet, 1: no, 2: yes
  int dev = 0;
  if (cudaGetDevice(&dev) != cudaSuccess || dev < 0 || dev >= kDevices) {
    cudaGetLastError();
    return false;
  }
  int8_t v = known[dev].load(std::memory_order_relaxed);
  if (v == 0) {
    int major = 0;
    if (cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev) != cudaSuccess) cudaGetLastError();
    v = major >= 9 ? 2 : 1;
    known[dev].store(v, std::memory_order_relaxed);
  }
  return v == 2;
}

}  // namespace cuda
}  // namespace v0
}  // namespace moeblaze
