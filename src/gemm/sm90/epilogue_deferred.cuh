// The cooperative tile's staged stores, deferred into the next tile's mainloop. Without it a
// tile's boxes are staged (stmatrix, the warpgroup's barrier, the wait for the previous box's
// TMA read) while no MMA runs: both warpgroups of a cooperative tile are in their epilogue at
// once. Deferred, a full tile's outputs are rounded and packed into registers as soon as its
// MMAs finish (one 32-bit pair per two accumulators: 64 registers for a 64 x 256 fragment), and
// box b is staged and stored right after the next tile's k-block b has been issued, under its
// MMAs. Same values, same stores, same order per warpgroup: only the time they happen moves.
// Used by the varlen-M store epilogue (C = scale * acc, epilogue.cuh's store_pair); the weight
// gradients' consumer keeps more state beside its accumulators and spilled with it, and gained
// nothing measurable (perf/NOTES.md).
#pragma once

#include <cstdint>
#include <type_traits>

#include "gemm/grouped_tiles.hpp"
#include "gemm/sm90/epilogue.cuh"
#include "gemm/sm90/epilogue_tma.cuh"
#include "gemm/sm90/params.hpp"
#include "gemm/sm90/tile_config.hpp"
#include "util/vec8.cuh"

namespace moeblaze {
inline namespace v0 {
namespace gemm {
namespace sm90 {

// A fragment's boxes, stored at {col + 64 b, row} of a rank-2 map.
template <int BN>
struct DeferredBoxes {
  static constexpr int kBoxes = BN / 64;
  static_assert(kBoxes <= 6, "the pending bits sit below the column's (a multiple of 64)");
  uint32_t v[kBoxes][16];  // box b's packed pairs: v[b][2 g + half] (epilogue_tma.cuh's pair(g, half))
  // Box 0's column (a multiple of 64; box b is 64 b columns right) with, in its low bits, the
  // boxes still to be staged (bit b: box b; the same in every thread of the warpgroup):
  // registers are scarce beside the accumulators.
  uint32_t col_bits = 0;
  int32_t row = 0;  // the fragment's first row

  __device__ __forceinline__ uint32_t pending() const { return col_bits & ((1u << kBoxes) - 1); }
  __device__ __forceinline__ int32_t col() const { return static_cast<int32_t>(col_bits & ~63u); }

  // Keeps boxes `boxes` (a bit mask) of a fragment: pair(b, g, half) is box b's packed pair.
  template <class Pair>
  __device__ __forceinline__ void keep(int32_t col0, int32_t row0, uint32_t boxes, Pair&& pair) {
    col_bits = static_cast<uint32_t>(col0) | boxes;
    row = row0;
#pragma unroll
    for (int b = 0; b < kBoxes; ++b)
#pragma unroll
      for (int g = 0; g < 8; ++g)
#pragma unroll
        for (int half = 0; half < 2; ++half) v[b][2 * g + half] = pair(b, g, half);
  }

  // Nothing pending, and every register written: called after an epilogue that did not defer,
  // so that the registers are dead (free for that epilogue) until then.
  __device__ __forceinline__ void clear() {
#pragma unroll
    for (int b = 0; b < kBoxes; ++b)
#pragma unroll
      for (int i = 0; i < 16; ++i) v[b][i] = 0u;
    col_bits = 0;
  }

  // After the next tile's k-block kb has been issued: box kb (none past the last box).
  __device__ __forceinline__ void stage_at(int kb, const TmaDescriptor& map, TileStore& ts) {
    if (pending()) stage_box(Number<0>{}, kb, map, ts);
  }

  // Every box still pending (a next tile of fewer k-blocks than boxes, or the last tile).
  __device__ __forceinline__ void flush(const TmaDescriptor& map, TileStore& ts) {
    if (!pending()) return;
#pragma unroll
    for (int b = 0; b < kBoxes; ++b) stage_box(Number<0>{}, b, map, ts);
  }

 private:
  template <int I>
  using Number = std::integral_constant<int, I>;

  // Box B, if still pending (B a constant, so v[B] stays in registers).
  template <int B>
  __device__ __forceinline__ void stage(const TmaDescriptor& map, TileStore& ts) {
    if (!(col_bits & (1u << B))) return;
    ts.box(map, {col() + 64 * B, row}, [&](int g, int half) { return v[B][2 * g + half]; });
    col_bits &= ~(1u << B);
  }
  // stage<b> for a run-time b: the compiler folds the comparisons.
  template <int I>
  __device__ __forceinline__ void stage_box(Number<I>, int b, const TmaDescriptor& map, TileStore& ts) {
    if constexpr (I < kBoxes) {
      if (b == I) stage<I>(map, ts);
      else stage_box(Number<I + 1>{}, b, map, ts);
    }
  }
};

// The varlen-M store epilogue's full tile, fragment frag: C = scale * acc, boxes past n dropped.
template <class T, int BN>
__device__ __forceinline__ void keep_store(DeferredBoxes<BN>& d, const GroupedGemmParams& p, const TileCoord& tc,
                                           int frag, const RowScales& scale, const float (&acc)[BN / 2]) {
  const int32_t col = tc.col_block * BN;
  uint32_t boxes = 0;
#pragma unroll
  for (int b = 0; b < DeferredBoxes<BN>::kBoxes; ++b)
    if (col + 64 * b < p.n) boxes |= 1u << b;
  d.keep(col, tc.row0 + frag * 64, boxes, [&](int b, int g, int half) { return store_pair<T, BN>(scale, acc, b, g, half); });
}

}  // namespace sm90
}  // namespace gemm
}  // namespace v0
}  // namespace moeblaze
