// The routing plan on the GPU, the paper's three atomic-free passes with no sort:
//   1. dense map: per tile of T tokens, a T x E byte map in shared memory (each (t, e) pair is
//      written by one thread: a token's experts are distinct), then per-expert column counts
//      (one warp per column: ballot + popcount);
//   2. one exclusive scan of the counts in (expert, tile) order: expert offsets and the base of
//      every (tile, expert) block;
//   3. location map: the tile's map is rebuilt and each expert's column scanned in token order
//      by one warp (ballot + prefix popcount), writing expert_token_indices and token_index_map.
// The dense map never leaves shared memory, so scratch is O((L / T) E), bounded for large E.
// A CUB radix-sort build sits beside it as the baseline of perf/plan-bench.
#include <algorithm>

#include <cub/device/device_radix_sort.cuh>

#include "cuda/cuda_check.hpp"
#include "routing/router_cuda.hpp"
#include "routing/scan_cuda.hpp"
#include "util/align.hpp"

// CUB lives in a private namespace (CUB_WRAPPED_NAMESPACE); CUB_NS_QUALIFIER names it.
namespace cubw = CUB_NS_QUALIFIER;

namespace moeblaze {
inline namespace v0 {
namespace routing {
namespace {

constexpr int kPlanThreads = 256;
constexpr int64_t kDenseMapBytes = 32768;

// The tile's map is stored expert-major (dense[e T + r]), so a warp reading 32 consecutive
// rows of one expert's column touches 32 consecutive bytes: no shared-memory bank conflicts.
__device__ void fill_dense(const int32_t* ids, int64_t t0, int64_t rows, int64_t T, int64_t k, int64_t E, uint8_t* dense) {
  const int64_t bytes = T * E;
  for (int64_t i = threadIdx.x; i < bytes / 16; i += blockDim.x) reinterpret_cast<uint4*>(dense)[i] = make_uint4(0, 0, 0, 0);
  for (int64_t i = bytes / 16 * 16 + threadIdx.x; i < bytes; i += blockDim.x) dense[i] = 0;
  __syncthreads();
  for (int64_t i = threadIdx.x; i < rows * k; i += blockDim.x) {
    const int64_t r = i / k, j = i % k;
    dense[ids[(t0 + r) * k + j] * T + r] = static_cast<uint8_t>(j + 1);
  }
  __syncthreads();
}

// Each warp owns expert columns; 32 rows at a time it ballots the column's marks: counts by
// popcount, no atomics.
__global__ void plan_count_kernel(const int32_t* ids, int64_t L, int64_t k, int64_t E, int64_t T, int64_t tiles,
                                  int32_t* counts) {
  extern __shared__ __align__(16) uint8_t dense[];
  const int64_t tile = blockIdx.x, t0 = tile * T, rows = min(T, L - t0);
  fill_dense(ids, t0, rows, T, k, E, dense);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, warps = blockDim.x / 32;
  for (int64_t e = warp; e < E; e += warps) {
    int32_t n = 0;
    for (int64_t r0 = 0; r0 < rows; r0 += 32) {
      const int64_t r = r0 + lane;
      n += __popc(__ballot_sync(0xffffffffu, r < rows && dense[e * T + r] != 0));
    }
    if (lane == 0) counts[e * tiles + tile] = n;
  }
}

__global__ void plan_offsets_kernel(const int32_t* counts, const int32_t* bases, int64_t E, int64_t tiles,
                                    int32_t* offsets) {
  const int64_t e = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (e < E) offsets[e] = tiles > 0 ? bases[e * tiles] : 0;
  if (e == E) offsets[E] = tiles > 0 ? bases[E * tiles - 1] + counts[E * tiles - 1] : 0;
}

// The location map: a warp walks its expert's column 32 rows at a time; each marked row's
// destination is the block base + the marks before it (ballot prefix popcount).
__global__ void plan_place_kernel(const int32_t* ids, int64_t L, int64_t k, int64_t E, int64_t T, int64_t tiles,
                                  const int32_t* bases, int32_t* expert_token, int32_t* token_index_map) {
  extern __shared__ __align__(16) uint8_t dense[];
  const int64_t tile = blockIdx.x, t0 = tile * T, rows = min(T, L - t0);
  fill_dense(ids, t0, rows, T, k, E, dense);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, warps = blockDim.x / 32;
  const unsigned below = (1u << lane) - 1u;
  for (int64_t e = warp; e < E; e += warps) {
    int32_t cursor = bases[e * tiles + tile];
    for (int64_t r0 = 0; r0 < rows; r0 += 32) {
      const int64_t r = r0 + lane;
      const uint8_t slot = r < rows ? dense[e * T + r] : 0;
      const unsigned marks = __ballot_sync(0xffffffffu, slot != 0);
      if (slot) {
        const int32_t pos = cursor + __popc(marks & below);
        expert_token[pos] = static_cast<int32_t>(t0 + r);
        token_index_map[(t0 + r) * k + (slot - 1)] = pos;
      }
      cursor += __popc(marks);
    }
  }
}

// ---- sort baseline ----
__global__ void iota_kernel(int32_t* v, int64_t n) {
  const int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (i < n) v[i] = static_cast<int32_t>(i);
}
__global__ void sort_scatter_kernel(const int32_t* slots, int64_t n, int64_t k, int32_t* expert_token,
                                    int32_t* token_index_map) {
  const int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (i >= n) return;
  expert_token[i] = slots[i] / static_cast<int32_t>(k);
  token_index_map[slots[i]] = static_cast<int32_t>(i);
}
__global__ void sort_offsets_kernel(const int32_t* keys, int64_t n, int64_t E, int32_t* offsets) {
  const int64_t e = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (e > E) return;
  int64_t lo = 0, hi = n;  // first position with key >= e
  while (lo < hi) {
    const int64_t mid = (lo + hi) / 2;
    if (keys[mid] < e) lo = mid + 1; else hi = mid;
  }
  offsets[e] = static_cast<int32_t>(lo);
}

int end_bit(int64_t E) {
  int b = 1;
  while ((int64_t{1} << b) < E) ++b;
  return b;
}

}  // namespace

PlanGeometryCuda plan_geometry_cuda(int64_t L, int64_t E) {
  // Tiles of T tokens: the T x E map fits in 32 KiB of shared memory, and there are enough
  // tiles (about two per SM of a large GPU) to fill the chip; T is a multiple of 32 where it can be.
  int64_t T = std::clamp<int64_t>(kDenseMapBytes / std::max<int64_t>(E, 1), 1, 1024);
  const int64_t fill = std::max<int64_t>(32, ceil_div(ceil_div(L, 264), 32) * 32);
  if (T > fill) T = fill;
  return {T, ceil_div(L, T), static_cast<size_t>(T * E)};
}

size_t plan_scratch_bytes_cuda(int64_t L, int64_t E) {
  const PlanGeometryCuda g = plan_geometry_cuda(L, E);
  const int64_t n = std::max<int64_t>(g.num_tiles * E, 1);
  Carver c;
  c.take<int32_t>(static_cast<size_t>(n));
  c.take<int32_t>(static_cast<size_t>(n));
  c.take<char>(exclusive_scan_scratch_bytes(n));
  return c.size();
}

void build_plan_cuda(RoutingPlan& plan, int64_t L, int64_t k, int64_t E, void* scratch, cudaStream_t s) {
  const PlanGeometryCuda g = plan_geometry_cuda(L, E);
  const int64_t n = std::max<int64_t>(g.num_tiles * E, 1);
  Carver c(scratch);
  int32_t* counts = c.take<int32_t>(static_cast<size_t>(n));
  int32_t* bases = c.take<int32_t>(static_cast<size_t>(n));
  void* scan_tmp = c.take<char>(exclusive_scan_scratch_bytes(n));
  if (g.smem_bytes > 48 * 1024) {
    MOEBLAZE_CUDA_CHECK(cudaFuncSetAttribute(plan_count_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(g.smem_bytes)));
    MOEBLAZE_CUDA_CHECK(cudaFuncSetAttribute(plan_place_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(g.smem_bytes)));
  }
  if (g.num_tiles > 0) {
    plan_count_kernel<<<static_cast<unsigned>(g.num_tiles), kPlanThreads, g.smem_bytes, s>>>(
        plan.token_expert_indices, L, k, E, g.tile_tokens, g.num_tiles, counts);
    MOEBLAZE_CUDA_LAUNCH_CHECK("plan_count");
    exclusive_scan_cuda(counts, bases, g.num_tiles * E, scan_tmp, s);
  }
  plan_offsets_kernel<<<static_cast<unsigned>(ceil_div(E + 1, 256)), 256, 0, s>>>(counts, bases, E, g.num_tiles,
                                                                                   plan.expert_token_offsets);
  MOEBLAZE_CUDA_LAUNCH_CHECK("plan_offsets");
  if (g.num_tiles > 0) {
    plan_place_kernel<<<static_cast<unsigned>(g.num_tiles), kPlanThreads, g.smem_bytes, s>>>(
        plan.token_expert_indices, L, k, E, g.tile_tokens, g.num_tiles, bases, plan.expert_token_indices,
        plan.token_index_map);
    MOEBLAZE_CUDA_LAUNCH_CHECK("plan_place");
  }
}

size_t sort_plan_scratch_bytes_cuda(int64_t L, int64_t k, int64_t E) {
  const int n = static_cast<int>(std::max<int64_t>(L * k, 1));
  size_t cub_bytes = 0;
  cubw::DeviceRadixSort::SortPairs(nullptr, cub_bytes, static_cast<const int32_t*>(nullptr), static_cast<int32_t*>(nullptr),
                                  static_cast<const int32_t*>(nullptr), static_cast<int32_t*>(nullptr), n, 0, end_bit(E));
  Carver c;
  c.take<int32_t>(static_cast<size_t>(n));
  c.take<int32_t>(static_cast<size_t>(n));
  c.take<int32_t>(static_cast<size_t>(n));
  c.take<char>(cub_bytes);
  return c.size();
}

void build_plan_sort_cuda(RoutingPlan& plan, int64_t L, int64_t k, int64_t E, void* scratch, cudaStream_t s) {
  const int64_t n = L * k;
  const int ni = static_cast<int>(std::max<int64_t>(n, 1));
  size_t cub_bytes = 0;
  cubw::DeviceRadixSort::SortPairs(nullptr, cub_bytes, static_cast<const int32_t*>(nullptr), static_cast<int32_t*>(nullptr),
                                  static_cast<const int32_t*>(nullptr), static_cast<int32_t*>(nullptr), ni, 0, end_bit(E));
  Carver c(scratch);
  int32_t* slots_in = c.take<int32_t>(static_cast<size_t>(ni));
  int32_t* keys_out = c.take<int32_t>(static_cast<size_t>(ni));
  int32_t* slots_out = c.take<int32_t>(static_cast<size_t>(ni));
  void* cub_tmp = c.take<char>(cub_bytes);
  if (n > 0) {
    iota_kernel<<<static_cast<unsigned>(ceil_div(n, 256)), 256, 0, s>>>(slots_in, n);
    MOEBLAZE_CUDA_CHECK(cubw::DeviceRadixSort::SortPairs(cub_tmp, cub_bytes, plan.token_expert_indices, keys_out, slots_in,
                                                        slots_out, ni, 0, end_bit(E), s));
    sort_scatter_kernel<<<static_cast<unsigned>(ceil_div(n, 256)), 256, 0, s>>>(slots_out, n, k, plan.expert_token_indices,
                                                                                plan.token_index_map);
    MOEBLAZE_CUDA_LAUNCH_CHECK("sort_scatter");
  }
  sort_offsets_kernel<<<static_cast<unsigned>(ceil_div(E + 1, 256)), 256, 0, s>>>(keys_out, n, E, plan.expert_token_offsets);
  MOEBLAZE_CUDA_LAUNCH_CHECK("sort_offsets");
}

}  // namespace routing
}  // namespace v0
}  // namespace moeblaze
