#include "cuda/cuda_check.hpp"
#include "cuda/saved_header_cuda.hpp"

namespace moeblaze {
inline namespace v0 {
namespace cuda {
namespace {

__global__ void store_saved_header_kernel(SavedHeader header, SavedHeader* dst) { *dst = header; }

}  // namespace

void store_saved_header(const SavedHeader& header, SavedHeader* dst, cudaStream_t s) {
  store_saved_header_kernel<<<1, 1, 0, s>>>(header, dst);
  MOEBLAZE_CUDA_LAUNCH_CHECK("store_saved_header");
}

}  // namespace cuda
}  // namespace v0
}  // namespace moeblaze
