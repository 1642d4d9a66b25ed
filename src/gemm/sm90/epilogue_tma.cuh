// The staged epilogue store: a consumer warpgroup writes its 64-row fragment, 64 columns at a time,
// into a shared-memory box (stmatrix, 128-byte swizzled as TMA's SWIZZLE_128B expects) and one of
// its threads stores the box by TMA. The warpgroup then goes on (to the next box, the next tile's
// MMAs) while the store drains: the epilogue's global writes overlap the MMAs instead of holding
// the tensor cores idle, and reach memory as whole 128-byte lines. TMA clips a box at the
// tensor's bounds only, so the caller uses this for tiles whose rows all belong to their expert.
#pragma once

#include <cuda/ptx>

#include <cstdint>

#include "gemm/sm90/params.hpp"
#include "gemm/sm90/ptx.cuh"
#include "gemm/sm90/tile_config.hpp"

namespace moeblaze {
inline namespace v0 {
namespace gemm {
namespace sm90 {

// The address this thread gives ldmatrix_x4 / stmatrix_x4 for column groups g and g + 1 of a
// 64 x 64 swizzled box at `base`: lanes 8 j .. 8 j + 7 address matrix j's rows, the matrices
// being groups g (j = 0, 1) and g + 1 (j = 2, 3), rows 0-7 (j even) and 8-15 (j odd) of the
// warp's 16. Each thread's registers are then its pairs (g, 0), (g, 1), (g + 1, 0), (g + 1, 1).
__device__ __forceinline__ uint32_t box_matrices(uint32_t base, int g) {
  const int lane = threadIdx.x & 31, warp = (threadIdx.x / 32) & 3, j = lane / 8;
  return base + sw128_offset(warp * 16 + (j & 1) * 8 + (lane & 7), g + (j >> 1));
}

// Writes a warpgroup's 64 x 64 box at `base` from its fragment pairs (TileStore::box's pair(g,
// half)): stmatrix's four matrices are groups g and g + 1 (j / 2), rows 0-7 and 8-15 (j % 2) of
// the warp's 16; lane addresses one 16-byte row of matrix j.
template <class Pair>
__device__ __forceinline__ void write_box(uint32_t base, Pair&& pair) {
#pragma unroll
  for (int g = 0; g < 8; g += 2)
    stmatrix_x4(box_matrices(base, g), pair(g, 0), pair(g, 1), pair(g + 1, 0), pair(g + 1, 1));
}

// One consumer warpgroup's two staging boxes. Box b of the warpgroup's sequence (across tiles)
// uses buffer b % 2; before a box's store is issued, the previous box's store has finished
// reading its buffer (cp.async.bulk.wait_group.read 0 by the issuing thread, then the
// warpgroup's barrier), so the buffer written next is free.
struct TileStore {
  uint32_t buf;     // the warpgroup's first box (shared address: one register); the second follows
  uint32_t count;   // boxes staged so far
  uint32_t bar_id;  // the warpgroup's named barrier
  bool leader;      // the thread that issues the stores

  __device__ __forceinline__ static TileStore make(uint8_t* staging, int consumer) {
    return {smem_addr(staging + consumer * 2 * kStagingBoxBytes), 0u, 1u + static_cast<uint32_t>(consumer),
            threadIdx.x % 128 == 0};
  }

  // Stages one 64 x 64 box and stores it at `coords` of `map` (rank 2 or 3, innermost first).
  // pair(g, half) gives this thread's packed pair of column group g (columns 8 g + 2 (lane % 4),
  // +1 of the box) in its row 16 warp + lane / 4 (half 0) or that + 8 (half 1). Transposed, the
  // box holds the fragment's transpose (box row = fragment column), for an output stored
  // column-major.
  template <int Rank, class Pair>
  __device__ __forceinline__ void box(const TmaDescriptor& map, const int32_t (&coords)[Rank], Pair&& pair) {
    stage<false>(map, coords, pair);
  }
  template <int Rank, class Pair>
  __device__ __forceinline__ void box_transposed(const TmaDescriptor& map, const int32_t (&coords)[Rank], Pair&& pair) {
    stage<true>(map, coords, pair);
  }

  // Stages one box of 64 rows x 32 fp32 columns (the fp32 sums of a weight gradient over token
  // windows) and stores it at `coords` of `map` or, Reduce, adds it there (TMA's reduction: the
  // adds happen in L2, each element once per launch, in launch order, so the sum stays
  // deterministic). pair(g, half) gives this thread's fp32 pair of column group g (columns
  // 8 g + 2 (lane % 4), +1 of the box, g < 4) in its row 16 warp + lane / 4 (+ 8 for half 1).
  template <bool Reduce, int Rank, class Pair>
  __device__ __forceinline__ void box_f32(const TmaDescriptor& map, const int32_t (&coords)[Rank], Pair&& pair) {
    const int lane = threadIdx.x & 31, warp = (threadIdx.x / 32) & 3;
    put([&](uint32_t base) {
      // a pair is 8 bytes of a 16-byte chunk; a warp's 8 rows x 32 bytes take two wavefronts
#pragma unroll
      for (int g = 0; g < 4; ++g)
#pragma unroll
        for (int half = 0; half < 2; ++half)
          st_shared_v2(base + sw128_offset(warp * 16 + half * 8 + lane / 4, 2 * g + ((lane & 3) >> 1)) + 8 * (lane & 1),
                       pair(g, half));
    }, [&](const uint8_t* b) {
      if constexpr (Reduce)
        cuda::ptx::cp_reduce_async_bulk_tensor(cuda::ptx::space_global, cuda::ptx::space_shared, cuda::ptx::op_add, &map,
                                               coords, b);
      else cuda::ptx::cp_async_bulk_tensor(cuda::ptx::space_global, cuda::ptx::space_shared, &map, coords, b);
    });
  }

  template <bool Transposed, int Rank, class Pair>
  __device__ __forceinline__ void stage(const TmaDescriptor& map, const int32_t (&coords)[Rank], Pair&& pair) {
    const int lane = threadIdx.x & 31, warp = (threadIdx.x / 32) & 3, j = lane / 8;
    put([&](uint32_t base) {
      if constexpr (Transposed) {  // box row: a fragment column; 16-byte chunk: 8 fragment rows
#pragma unroll
        for (int g = 0; g < 8; g += 2) {
          const uint32_t addr = base + sw128_offset(8 * (g + (j >> 1)) + (lane & 7), 2 * warp + (j & 1));
          stmatrix_x4_trans(addr, pair(g, 0), pair(g, 1), pair(g + 1, 0), pair(g + 1, 1));
        }
      } else {
        write_box(base, pair);
      }
    }, [&](const uint8_t* b) {
      cuda::ptx::cp_async_bulk_tensor(cuda::ptx::space_global, cuda::ptx::space_shared, &map, coords, b);
    });
  }

  // One box: write(shared address of the free buffer) fills it, then the leader issues(buffer)
  // its bulk store once the warpgroup is done writing.
  template <class Write, class Issue>
  __device__ __forceinline__ void put(Write&& write, Issue&& issue) {
    const uint32_t b_shared = buf + (count & 1) * kStagingBoxBytes;
    write(b_shared);
    cuda::ptx::fence_proxy_async(cuda::ptx::space_shared);  // the generic writes, before TMA reads them
    if (leader) cuda::ptx::cp_async_bulk_wait_group_read(cuda::ptx::n32_t<0>{});
    named_barrier_sync(bar_id, 128);
    if (leader) {
      issue(static_cast<const uint8_t*>(__cvta_shared_to_generic(b_shared)));
      cuda::ptx::cp_async_bulk_commit_group();
    }
    ++count;
  }

  // Before the block exits: the stores have completed (their shared-memory reads included).
  __device__ __forceinline__ void drain() const {
    if (leader) cuda::ptx::cp_async_bulk_wait_group(cuda::ptx::n32_t<0>{});
  }
};

}  // namespace sm90
}  // namespace gemm
}  // namespace v0
}  // namespace moeblaze
