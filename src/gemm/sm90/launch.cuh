// Launch plumbing shared by the sm_90a persistent kernels: the grid is one CTA per SM (fewer
// when there are fewer tiles, or when the caller caps it), each CTA taking work items
// w = blockIdx.x + i * gridDim.x.
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>

#include "cuda/cuda_check.hpp"
#include "util/align.hpp"

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

}  // namespace sm90
}  // namespace gemm
}  // namespace v0
}  // namespace moeblaze
