// CUDA and cuBLASLt error checks that throw the library's Error (caught at the C boundary).
#pragma once

#include <cublasLt.h>
#include <cuda_runtime.h>

#include "util/error.hpp"

#define MOEBLAZE_CUDA_CHECK(call)                                                            \
  do {                                                                                       \
    cudaError_t e_ = (call);                                                                 \
    if (e_ != cudaSuccess)                                                                   \
      ::moeblaze::fail(::moeblaze::Status::kCudaError, "%s failed: %s (%s)", #call,          \
                       cudaGetErrorName(e_), cudaGetErrorString(e_));                        \
  } while (0)

// After a kernel launch: launch-configuration errors surface here, not at the next sync.
#define MOEBLAZE_CUDA_LAUNCH_CHECK(what) MOEBLAZE_CUDA_CHECK(cudaPeekAtLastError())

#define MOEBLAZE_CUBLAS_CHECK(call)                                                          \
  do {                                                                                       \
    cublasStatus_t s_ = (call);                                                              \
    if (s_ != CUBLAS_STATUS_SUCCESS)                                                         \
      ::moeblaze::fail(::moeblaze::Status::kCublasError, "%s failed: cuBLAS status %d", #call, \
                       static_cast<int>(s_));                                                \
  } while (0)
