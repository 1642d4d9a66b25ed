// Launch plumbing shared by the sm_90a persistent kernels: the grid is one CTA per SM (fewer
// when there are fewer tiles, or when the caller caps it), each CTA taking work items
// w = blockIdx.x + i * gridDim.x.
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <atomic>
#include <cstdint>

#include "cuda/cuda_check.hpp"
#include "gemm/sm90/tile_config.hpp"

namespace moeblaze {
inline namespace v0 {
namespace gemm {
namespace sm90 {

// Opts the kernel into smem_bytes of dynamic shared memory and returns its persistent grid
// size for at most max_work work items on the current device: one CTA per SM, or at most
// max_ctas when that is positive.
template <class Kernel>
int persistent_grid(Kernel kernel, int smem_bytes, int64_t max_work, int32_t max_ctas = 0) {
  int dev = 0, sms = 0;
  MOEBLAZE_CUDA_CHECK(cudaGetDevice(&dev));
  MOEBLAZE_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev));
  MOEBLAZE_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem_bytes));
  const int64_t ctas = max_ctas > 0 ? std::min<int64_t>(sms, max_ctas) : sms;
  return static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(ctas, max_work)));
}

// The persistent grid of a kernel launched as clusters of two CTAs (a CTA pair), in pairs: as
// many pairs as can be resident at once (cudaOccupancyMaxActiveClusters, cached per device),
// at most max_pairs, at most max_ctas / 2 when max_ctas is positive. 0: the device cannot
// hold a pair of this kernel.
template <class Kernel>
int persistent_pairs(Kernel kernel, int smem_bytes, int64_t max_pairs, int32_t max_ctas = 0) {
  if (max_ctas == 1) return 0;  // a pair would pass the cap
  constexpr int kDevices = 64;
  static std::atomic<int> resident[kDevices];  // pairs resident per device + 1 (0: not known yet)
  int dev = 0;
  MOEBLAZE_CUDA_CHECK(cudaGetDevice(&dev));
  int pairs = dev < kDevices ? resident[dev].load(std::memory_order_relaxed) - 1 : -1;
  if (pairs < 0) {
    MOEBLAZE_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem_bytes));
    int sms = 0;
    MOEBLAZE_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev));
    cudaLaunchConfig_t cfg = {};
    cudaLaunchAttribute attr;
    attr.id = cudaLaunchAttributeClusterDimension;
    attr.val.clusterDim.x = 2;
    attr.val.clusterDim.y = 1;
    attr.val.clusterDim.z = 1;
    cfg.gridDim = dim3(static_cast<unsigned>(sms - sms % 2));
    cfg.blockDim = dim3(kThreads);
    cfg.dynamicSmemBytes = static_cast<size_t>(smem_bytes);
    cfg.attrs = &attr;
    cfg.numAttrs = 1;
    if (cudaOccupancyMaxActiveClusters(&pairs, kernel, &cfg) != cudaSuccess) {
      (void)cudaGetLastError();  // no cluster of this kernel fits: launch it alone
      pairs = 0;
    }
    if (dev < kDevices) resident[dev].store(pairs + 1, std::memory_order_relaxed);
  } else {
    MOEBLAZE_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem_bytes));
  }
  int64_t n = pairs;
  if (max_ctas > 0) n = std::min<int64_t>(n, max_ctas / 2);
  n = std::min<int64_t>(n, max_pairs);
  return pairs > 0 ? static_cast<int>(std::max<int64_t>(1, n)) : 0;
}

// Launches kernel(args...) as `pairs` clusters of two CTAs of kThreads threads.
template <class Kernel, class... Args>
void launch_pairs(Kernel kernel, int pairs, int smem_bytes, cudaStream_t s, const Args&... args) {
  cudaLaunchConfig_t cfg = {};
  cudaLaunchAttribute attr;
  attr.id = cudaLaunchAttributeClusterDimension;
  attr.val.clusterDim.x = 2;
  attr.val.clusterDim.y = 1;
  attr.val.clusterDim.z = 1;
  cfg.gridDim = dim3(static_cast<unsigned>(2 * pairs));
  cfg.blockDim = dim3(kThreads);
  cfg.dynamicSmemBytes = static_cast<size_t>(smem_bytes);
  cfg.stream = s;
  cfg.attrs = &attr;
  cfg.numAttrs = 1;
  MOEBLAZE_CUDA_CHECK(cudaLaunchKernelEx(&cfg, kernel, args...));
}

inline bool aligned16(const void* ptr) { return reinterpret_cast<uintptr_t>(ptr) % 16 == 0; }

}  // namespace sm90
}  // namespace gemm
}  // namespace v0
}  // namespace moeblaze
