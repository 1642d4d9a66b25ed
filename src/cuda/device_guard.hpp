// Makes a handle's device current for the duration of a call, then restores the caller's.
#pragma once

#include <cuda_runtime.h>

#include "cuda/cuda_check.hpp"

namespace moeblaze {
inline namespace v0 {
namespace cuda {

class DeviceGuard {
 public:
  explicit DeviceGuard(int device) {
    MOEBLAZE_CUDA_CHECK(cudaGetDevice(&previous_));
    if (previous_ != device) MOEBLAZE_CUDA_CHECK(cudaSetDevice(device));
    switched_ = previous_ != device;
  }
  ~DeviceGuard() {
    if (switched_) cudaSetDevice(previous_);
  }
  DeviceGuard(const DeviceGuard&) = delete;
  DeviceGuard& operator=(const DeviceGuard&) = delete;

 private:
  int previous_ = 0;
  bool switched_ = false;
};

}  // namespace cuda
}  // namespace v0
}  // namespace moeblaze
