// Launches of the small kernels between a call's GEMMs as programmatic dependent launches
// (sm_90 and newer): the next kernel's blocks are placed while the kernel before it still runs,
// and wait on the device, so the launch gap between two dependent kernels (about a microsecond
// each) mostly goes: on an H200, conf1's step through moeblaze.torch had 69 us of gaps between
// its kernels, 30 us chained.
//
// The contract: a kernel launched by launch_chained calls wait_for_prior_grids() first, before
// any read or write of global memory, on every path (it returns once the kernel before it has
// completed and its writes are visible, as a plain stream order would guarantee; a kernel that
// skipped it could complete before its predecessor, and break the order for the one after it).
// It may call allow_next_grid() right after, so that the next kernel's launch overlaps its work.
// Kernels launched otherwise keep plain stream order on both sides: the GEMMs, cuBLASLt, CUB,
// and kernels of one block per row (the combine): griddepcontrol.wait costs each block, and
// with L blocks it doubled the combine's time (41.7 -> 79.8 us at L = 65,536, H200), launched
// chained or not.
// Under stream capture the launches become programmatic graph edges, the same order.
#pragma once

#include <cuda_runtime.h>

#include <utility>

#include "cuda/cuda_check.hpp"

namespace moeblaze {
inline namespace v0 {
namespace cuda {

__device__ __forceinline__ void wait_for_prior_grids() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

__device__ __forceinline__ void allow_next_grid() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;" :::);
#endif
}

// Whether the current device takes programmatic dependent launches (compute capability 9+).
bool chained_launches_supported();

// kernel<<<grid, block, smem, s>>>(args...), as a programmatic dependent launch where supported.
template <class... Params, class... Args>
void launch_chained(void (*kernel)(Params...), dim3 grid, dim3 block, size_t smem, cudaStream_t s, Args&&... args) {
  cudaLaunchConfig_t cfg{};
  cfg.gridDim = grid;
  cfg.blockDim = block;
  cfg.dynamicSmemBytes = smem;
  cfg.stream = s;
  cudaLaunchAttribute attr{};
  attr.id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr.val.programmaticStreamSerializationAllowed = 1;
  if (chained_launches_supported()) {
    cfg.attrs = &attr;
    cfg.numAttrs = 1;
  }
  MOEBLAZE_CUDA_CHECK(cudaLaunchKernelEx(&cfg, kernel, static_cast<Params>(std::forward<Args>(args))...));
}

}  // namespace cuda
}  // namespace v0
}  // namespace moeblaze
