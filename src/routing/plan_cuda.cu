// The routing plan on the GPU, the paper's three atomic-free passes with no sort, over tiles of
// T = 32 G tokens (G groups of 32):
//   1. token-expert map: per tile, a bitmap in shared memory, one 32-bit word per (expert,
//      group) holding which of the group's 32 tokens chose the expert (the lanes of a warp
//      that hold the same expert combine their bits by match_any; the lowest writes the word),
//      then per-expert counts (popcounts);
//   2. one exclusive scan of the counts in (expert, tile) order: expert offsets and the base of
//      every (tile, expert) block;
//   3. location map: the tile's bitmap is rebuilt and each expert column's word prefixes are
//      scanned from the block's base; expert_token_indices is written word by word in expert
//      order, token_index_map slot by slot (prefix + popcount of the marks below the token in
//      its word), so both are written in order.
// The map never leaves shared memory, so scratch is O((L / T) E), bounded for large E; with
// more experts than the map holds, a tile takes them in passes.
// A CUB radix-sort build sits beside it as the baseline of perf/plan-bench.
#include <algorithm>
#include <cub/device/device_radix_sort.cuh>

#include "cuda/chained_launch.cuh"
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
// Map words per tile and pass; the place pass keeps as many int32 prefixes beside them: 66 KiB
// of shared memory, three blocks per SM. 8,448 = 256 experts x (32 groups + 1 pad word).
constexpr int64_t kPlanMapWords = 8448;

// Experts per pass of a tile with G groups: all of them unless the map would overflow.
__host__ __device__ inline int64_t plan_experts_per_pass(int64_t G, int64_t E) {
  return E < kPlanMapWords / (G + 1) ? E : kPlanMapWords / (G + 1);
}

// Word of (expert e, group g) in a pass's map: expert-major, each column padded by a word, so
// that threads walking one group across experts, or consecutive words, hit distinct banks.
__device__ __forceinline__ int32_t map_word(int32_t e, int32_t g, int32_t G) { return e * (G + 1) + g; }

// The tile's map for experts [e0, e0 + ec): bit b of map_word(e - e0, g) = token 32 g + b of the
// tile chose e. A warp owns whole groups, so no word is shared between warps; within one slot j
// a token's experts are distinct, so the words written are distinct, and __syncwarp orders the
// k rounds. No atomics. Ids outside the pass (or outside [0, E)) mark nothing.
__device__ void mark_tile(const int32_t* ids, int64_t t0, int32_t rows, int32_t k, int64_t e0, int32_t ec, int32_t G,
                          uint32_t* bits) {
  const int32_t words = ec * (G + 1);
  for (int32_t i = threadIdx.x; i < words / 4; i += blockDim.x) reinterpret_cast<uint4*>(bits)[i] = make_uint4(0, 0, 0, 0);
  for (int32_t i = words / 4 * 4 + threadIdx.x; i < words; i += blockDim.x) bits[i] = 0;
  __syncthreads();
  const int32_t warp = threadIdx.x / 32, lane = threadIdx.x % 32, warps = blockDim.x / 32;
  // A lane reads its token's k ids: 16 bytes at a time where rows are 16-byte aligned, so each
  // sector comes from L2 once or twice, not k times.
  const bool vec = k % 4 == 0 && reinterpret_cast<uintptr_t>(ids) % 16 == 0;
  for (int32_t g = warp; g * 32 < rows; g += warps) {
    const int32_t r = g * 32 + lane;
    const int32_t* row = ids + (t0 + r) * k;
    const auto mark = [&](int32_t id) {
      int64_t e = r < rows ? id - e0 : -1;
      if (e < 0 || e >= ec) e = -1;
      const unsigned same = __match_any_sync(0xffffffffu, static_cast<int32_t>(e));
      if (e >= 0 && lane == __ffs(same) - 1) bits[map_word(static_cast<int32_t>(e), g, G)] |= same;
      __syncwarp();
    };
    if (vec) {
      for (int32_t j = 0; j < k; j += 4) {
        const int4 v = r < rows ? *reinterpret_cast<const int4*>(row + j) : make_int4(-1, -1, -1, -1);
        mark(v.x);
        mark(v.y);
        mark(v.z);
        mark(v.w);
      }
    } else {
      for (int32_t j = 0; j < k; ++j) mark(r < rows ? row[j] : -1);
    }
  }
  __syncthreads();
}

__device__ int64_t tile_rows(int64_t L, int64_t T) { return min(T, L - static_cast<int64_t>(blockIdx.x) * T); }

// One thread per expert column: the tile's marks of each expert, by popcount.
__global__ void plan_count_kernel(const int32_t* ids, int64_t L, int64_t k, int64_t E, int64_t T, int64_t tiles,
                                  int32_t* counts) {
  cuda::wait_for_prior_grids();
  cuda::allow_next_grid();
  extern __shared__ __align__(16) uint32_t bits[];
  const int64_t tile = blockIdx.x, t0 = tile * T;
  const int32_t rows = static_cast<int32_t>(tile_rows(L, T)), G = static_cast<int32_t>(T / 32);
  const int32_t ec = static_cast<int32_t>(plan_experts_per_pass(G, E));
  for (int64_t e0 = 0; e0 < E; e0 += ec) {
    const int32_t n_e = static_cast<int32_t>(min(static_cast<int64_t>(ec), E - e0));
    mark_tile(ids, t0, rows, static_cast<int32_t>(k), e0, n_e, G, bits);
    for (int32_t e = threadIdx.x; e < n_e; e += blockDim.x) {
      int32_t n = 0;
      for (int32_t g = 0; g < G; ++g) n += __popc(bits[map_word(e, g, G)]);
      counts[(e0 + e) * tiles + tile] = n;
    }
    __syncthreads();
  }
}

__global__ void plan_offsets_kernel(const int32_t* counts, const int32_t* bases, int64_t E, int64_t tiles,
                                    int32_t* offsets) {
  cuda::wait_for_prior_grids();
  cuda::allow_next_grid();
  const int64_t e = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (e < E) offsets[e] = tiles > 0 ? bases[e * tiles] : 0;
  if (e == E) offsets[E] = tiles > 0 ? bases[E * tiles - 1] + counts[E * tiles - 1] : 0;
}

// The location map: prefix[map_word(e, g)] = the block's base + the expert's marks in groups
// before g; slot (r, j) of expert e sits at prefix + the marks below token r in its word.
// token_index_map is written slot by slot, in order; expert_token, where the map is sparse, word
// by word in expert-major order, so that a warp's stores continue each other.
__global__ void plan_place_kernel(const int32_t* ids, int64_t L, int64_t k, int64_t E, int64_t T, int64_t tiles,
                                  const int32_t* bases, int32_t* expert_token, int32_t* token_index_map) {
  cuda::wait_for_prior_grids();
  cuda::allow_next_grid();
  extern __shared__ __align__(16) uint32_t bits[];
  const int64_t tile = blockIdx.x, t0 = tile * T;
  const int32_t rows = static_cast<int32_t>(tile_rows(L, T)), G = static_cast<int32_t>(T / 32), k32 = static_cast<int32_t>(k);
  const int32_t ec = static_cast<int32_t>(plan_experts_per_pass(G, E));
  int32_t* prefix = reinterpret_cast<int32_t*>(bits + ec * (G + 1));
  const int32_t* tile_ids = ids + t0 * k;
  for (int64_t e0 = 0; e0 < E; e0 += ec) {
    const int32_t n_e = static_cast<int32_t>(min(static_cast<int64_t>(ec), E - e0));
    mark_tile(ids, t0, rows, k32, e0, n_e, G, bits);
    for (int32_t e = threadIdx.x; e < n_e; e += blockDim.x) {
      int32_t at = bases[(e0 + e) * tiles + tile];
      for (int32_t g = 0; g < G; ++g) {
        prefix[map_word(e, g, G)] = at;
        at += __popc(bits[map_word(e, g, G)]);
      }
    }
    __syncthreads();
    // A sparse map (few marks per word: many experts) writes expert_token word by word; a dense
    // one slot by slot, where each (tile, expert) block is long enough for a warp's stores to
    // land together and a word loop would run long.
    const bool by_slot = rows * k32 >= 4 * n_e * G;
    for (int32_t w = threadIdx.x; !by_slot && w < n_e * G; w += blockDim.x) {
      const int32_t e = w / G, g = w - e * G, at = map_word(e, g, G);
      int32_t pos = prefix[at];
      for (uint32_t m = bits[at]; m != 0; m &= m - 1) expert_token[pos++] = static_cast<int32_t>(t0 + 32 * g + __ffs(m) - 1);
    }
    for (int32_t i = threadIdx.x; i < rows * k32; i += blockDim.x) {
      const int64_t e = tile_ids[i] - e0;
      // An id outside [0, E) (an empty slot, -1) has no position.
      if (e0 == 0 && (tile_ids[i] < 0 || tile_ids[i] >= E)) token_index_map[t0 * k + i] = -1;
      if (e < 0 || e >= n_e) continue;
      const int32_t r = i / k32, at = map_word(static_cast<int32_t>(e), r / 32, G);
      const int32_t pos = prefix[at] + __popc(bits[at] & ((1u << (r % 32)) - 1u));
      token_index_map[t0 * k + i] = pos;
      if (by_slot) expert_token[pos] = static_cast<int32_t>(t0 + r);
    }
    __syncthreads();
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
  // Tiles of G groups of 32 tokens: the (G + 1) x E map fits kPlanMapWords where it can (G = 32,
  // T = 1,024 tokens, up to E = 256), and there are enough tiles (about two per SM of a large
  // GPU) to fill the chip. With more than 4,224 experts a tile is one group and takes them in
  // passes.
  int64_t G = std::clamp<int64_t>(kPlanMapWords / std::max<int64_t>(E, 1) - 1, 1, 32);
  G = std::min(G, std::max<int64_t>(1, ceil_div(L, 264 * 32)));
  const int64_t T = 32 * G;
  return {T, ceil_div(L, T), static_cast<size_t>(2 * 4 * (G + 1) * plan_experts_per_pass(G, std::max<int64_t>(E, 1)))};
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
  // smem_bytes: the place pass's map and prefixes; the count pass needs the map alone.
  if (g.smem_bytes > 48 * 1024)
    MOEBLAZE_CUDA_CHECK(cudaFuncSetAttribute(plan_place_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(g.smem_bytes)));
  if (g.num_tiles > 0) {
    cuda::launch_chained(plan_count_kernel, static_cast<unsigned>(g.num_tiles), kPlanThreads, g.smem_bytes / 2, s,
                         plan.token_expert_indices, L, k, E, g.tile_tokens, g.num_tiles, counts);
    MOEBLAZE_CUDA_LAUNCH_CHECK("plan_count");
    exclusive_scan_cuda(counts, bases, g.num_tiles * E, scan_tmp, s);
  }
  cuda::launch_chained(plan_offsets_kernel, static_cast<unsigned>(ceil_div(E + 1, 256)), 256, 0, s, counts, bases, E,
                       g.num_tiles, plan.expert_token_offsets);
  MOEBLAZE_CUDA_LAUNCH_CHECK("plan_offsets");
  if (g.num_tiles > 0) {
    cuda::launch_chained(plan_place_kernel, static_cast<unsigned>(g.num_tiles), kPlanThreads, g.smem_bytes, s,
                         plan.token_expert_indices, L, k, E, g.tile_tokens, g.num_tiles, bases,
                         plan.expert_token_indices, plan.token_index_map);
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
