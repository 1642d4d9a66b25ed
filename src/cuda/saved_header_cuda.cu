#include "cuda/chained_launch.cuh"
#include "cuda/cuda_check.hpp"
#include "cuda/saved_header_cuda.hpp"

namespace moeblaze {
inline namespace v0 {
namespace cuda {
namespace {

__global__ void store_saved_header_kernel(SavedHeader header, SavedHeader* dst) {
  cuda::wait_for_prior_grids();
  cuda::allow_next_grid();
  *dst = header;
}

__global__ void check_saved_header_kernel(SavedHeader want, const SavedHeader* got, int32_t* flag, int32_t bit) {
  cuda::wait_for_prior_grids();
  cuda::allow_next_grid();
  const uint32_t* a = reinterpret_cast<const uint32_t*>(&want);
  const uint32_t* b = reinterpret_cast<const uint32_t*>(got);
  bool same = true;
  for (size_t i = 0; i < sizeof(SavedHeader) / 4; ++i) same &= a[i] == b[i];
  if (!same) atomicOr(flag, bit);
}

}  // namespace

void store_saved_header(const SavedHeader& header, SavedHeader* dst, cudaStream_t s) {
  cuda::launch_chained(store_saved_header_kernel, 1, 1, 0, s, header, dst);
  MOEBLAZE_CUDA_LAUNCH_CHECK("store_saved_header");
}

void check_saved_header_cuda(const SavedHeader& want, const SavedHeader* got, int32_t* flag, int32_t bit, cudaStream_t s) {
  cuda::launch_chained(check_saved_header_kernel, 1, 1, 0, s, want, got, flag, bit);
  MOEBLAZE_CUDA_LAUNCH_CHECK("check_saved_header");
}

}  // namespace cuda
}  // namespace v0
}  // namespace moeblaze
