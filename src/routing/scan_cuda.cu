#include <cub/block/block_scan.cuh>

#include "cuda/chained_launch.cuh"
#include "cuda/cuda_check.hpp"
#include "routing/scan_cuda.hpp"
#include "util/align.hpp"

namespace cubw = CUB_NS_QUALIFIER;

namespace moeblaze {
inline namespace v0 {
namespace routing {
namespace {

constexpr int kThreads = 256;
constexpr int kItems = 8;  // per thread
constexpr int64_t kTile = kThreads * kItems;
using BlockScan = cubw::BlockScan<int32_t, kThreads>;

// Exclusive scan of one tile of `in` into `out`; the tile's total into totals[tile] (and the
// running carry, when totals is the last level, is added by the caller's next launch).
__device__ void scan_tile(const int32_t* in, int32_t* out, int64_t n, int64_t tile, int32_t carry_in,
                          int32_t* total, typename BlockScan::TempStorage& tmp) {
  int32_t v[kItems];
  const int64_t base = tile * kTile + static_cast<int64_t>(threadIdx.x) * kItems;
#pragma unroll
  for (int q = 0; q < kItems; ++q) v[q] = base + q < n ? in[base + q] : 0;
  int32_t sum;
  BlockScan(tmp).ExclusiveSum(v, v, sum);
#pragma unroll
  for (int q = 0; q < kItems; ++q)
    if (base + q < n) out[base + q] = v[q] + carry_in;
  if (total && threadIdx.x == 0) *total = sum;
}

__global__ void scan_tiles_kernel(const int32_t* in, int32_t* out, int64_t n, int32_t* totals) {
  cuda::wait_for_prior_grids();
  cuda::allow_next_grid();
  __shared__ typename BlockScan::TempStorage tmp;
  scan_tile(in, out, n, blockIdx.x, 0, &totals[blockIdx.x], tmp);
}

// One block scans the tile totals in place, tile by tile, carrying the running sum.
__global__ void scan_totals_kernel(int32_t* totals, int64_t tiles) {
  cuda::wait_for_prior_grids();
  cuda::allow_next_grid();
  __shared__ typename BlockScan::TempStorage tmp;
  __shared__ int32_t chunk_total;
  int32_t carry = 0;
  for (int64_t c = 0; c * kTile < tiles; ++c) {
    scan_tile(totals, totals, tiles, c, carry, &chunk_total, tmp);
    __syncthreads();
    carry += chunk_total;
    __syncthreads();
  }
}

__global__ void add_tile_base_kernel(int32_t* out, int64_t n, const int32_t* bases) {
  cuda::wait_for_prior_grids();
  cuda::allow_next_grid();
  const int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (i < n) out[i] += bases[i / kTile];
}

}  // namespace

size_t exclusive_scan_scratch_bytes(int64_t n) {
  return align_up(static_cast<size_t>(ceil_div(n, kTile) + 1) * sizeof(int32_t));
}

void exclusive_scan_cuda(const int32_t* in, int32_t* out, int64_t n, void* scratch, cudaStream_t s) {
  if (n <= 0) return;
  const int64_t tiles = ceil_div(n, kTile);
  int32_t* totals = static_cast<int32_t*>(scratch);
  cuda::launch_chained(scan_tiles_kernel, static_cast<unsigned>(tiles), kThreads, 0, s, in, out, n, totals);
  MOEBLAZE_CUDA_LAUNCH_CHECK("scan_tiles");
  if (tiles == 1) return;
  cuda::launch_chained(scan_totals_kernel, 1, kThreads, 0, s, totals, tiles);
  MOEBLAZE_CUDA_LAUNCH_CHECK("scan_totals");
  cuda::launch_chained(add_tile_base_kernel, static_cast<unsigned>(ceil_div(n, 256)), 256, 0, s, out, n, totals);
  MOEBLAZE_CUDA_LAUNCH_CHECK("add_tile_base");
}

}  // namespace routing
}  // namespace v0
}  // namespace moeblaze
