// The cooperative tile's staged stores, deferred into the next tile's mainloop. Without it a
// tile's boxes are staged (stmatrix, the warpgroup's barrier, the wait for the previous box's
// TMA read) while no MMA runs: both warpgroups of a cooperative tile are in their epilogue at
// once. Deferred, a full tile's outputs are rounded and packed into registers as soon as its
// MMAs finish (one 32-bit pair per two accumulators: 64 registers for a 64 x 256 fragment), and
// one box is staged and stored right after each of the next tile's k-blocks has been issued,
// under its MMAs. Same values, same stores, same order per warpgroup: only the time they happen
// moves. Used by the varlen-M store epilogue (C = scale * acc, epilogue.cuh's store_pair) and
// the activation epilogue, whose act boxes are computed from the kept pre pairs when they are
// staged, so that the nonlinearity's arithmetic runs under the MMAs too; the weight gradients'
// consumer keeps more state beside its accumulators and spilled with it, and gained nothing
// measurable (perf/NOTES.md).
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

// A deferred fragment's kept words: v[b][2 g + half] = pair(b, g, half), box b's packed pair
// (g, half) in epilogue_tma.cuh's order.
template <int Boxes, class Pair>
__device__ __forceinline__ void fill_boxes(uint32_t (&v)[Boxes][16], Pair&& pair) {
#pragma unroll
  for (int b = 0; b < Boxes; ++b)
#pragma unroll
    for (int g = 0; g < 8; ++g)
#pragma unroll
      for (int half = 0; half < 2; ++half) v[b][2 * g + half] = pair(b, g, half);
}

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
    fill_boxes(v, pair);
  }

  // Nothing pending, and every register written: called after an epilogue that did not defer,
  // so that the registers are dead (free for that epilogue) until then.
  __device__ __forceinline__ void clear() {
    fill_boxes(v, [](int, int, int) { return 0u; });
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

// The activation epilogue's full tile, fragment by fragment, for one nonlinearity A (plain:
// ReLU or SiLU; GELU's erf spilled here) and gating: pre's packed pairs are kept (box b = the fragment's columns
// [64 b, 64 b + 64); gated, boxes [0, kHalf) the gate half and the rest the up half) and act
// box b is computed from them as epilogue_activation_staged_as computes it (act_of of the
// rounded pre), half a box per k-block so that its arithmetic stays under that k-block's MMAs.
// Box b takes two turns: the first stages the pre boxes act box b reads, then overwrites the
// first half of box b's kept pairs with act's; the second does the other half and stages act
// box b.
template <class T, int BN, Activation A, bool Gated>
struct DeferredActivation {
  static constexpr int kBoxes = BN / 64;                    // pre's boxes
  static constexpr int kHalf = Gated ? BN / 128 : BN / 64;  // act's boxes
  static constexpr uint32_t kTurns = (1u << (2 * kHalf)) - 1, kPre = 1u << 16, kAct = 1u << 17;
  uint32_t v[kBoxes][16];  // v[b][2 g + half]: pre's packed pair (g, half) of box b, then act's
  uint32_t pending = 0;    // bit 2 b + t: turn t of box b still to run; kPre, kAct: the outputs kept
  int32_t col = 0;         // the tile's first column in act and in each half of pre
  int32_t act_row = 0, pre_row = 0;  // the fragment's first row in each output

  __device__ __forceinline__ void keep(const GroupedGemmParams& p, const EpilogueParams& e, const TileCoord& tc,
                                       int frag, const float (&acc)[BN / 2]) {
    col = tc.col_block * (Gated ? BN / 2 : BN);
    const int32_t pos = tc.row0 + frag * 64;
    uint32_t bits = 0;
#pragma unroll
    for (int b = 0; b < kHalf; ++b)
      if (col + 64 * b < p.n) bits |= 3u << (2 * b);  // a box past n has nothing to store
    if (e.act) {
      act_row = static_cast<int32_t>(placed_row(p, e.act_expert_row, tc, pos));
      bits |= kAct;
    }
    if (e.pre) {
      pre_row = static_cast<int32_t>(placed_row(p, e.pre_expert_row, tc, pos));
      bits |= kPre;
    }
    pending = bits;
    fill_boxes(v, [&](int b, int g, int half) {
      const int q = staged_acc(b, g, half);
      return Elem<T>::pack2(acc[q], acc[q + 1]);
    });
  }

  // Nothing pending, and every register written (as DeferredBoxes::clear).
  __device__ __forceinline__ void clear() {
    fill_boxes(v, [](int, int, int) { return 0u; });
    pending = 0;
  }

  // The next pending turn (after one of the next tile's k-blocks has been issued).
  __device__ __forceinline__ void stage_next(const EpilogueMaps& maps, TileStore& ts) {
    if (pending & kTurns) turn(Number<0>{}, __ffs(pending & kTurns) - 1, maps, ts);
  }

  // Every turn still pending (a next tile of fewer k-blocks than turns, or the last tile).
  __device__ __forceinline__ void flush(const EpilogueMaps& maps, TileStore& ts) {
    while (pending & kTurns) stage_next(maps, ts);
  }

 private:
  template <int I>
  using Number = std::integral_constant<int, I>;

  // Act's pairs of column groups [4 H, 4 H + 4) of box B, in place of pre's.
  template <int B, int H>
  __device__ __forceinline__ void compute_half() {
#pragma unroll
    for (int i = 8 * H; i < 8 * H + 8; ++i) {
      const float2 a = act_of<T, A, Gated>(v[B][i], Gated ? v[B + kHalf][i] : 0u);
      v[B][i] = Elem<T>::pack2(a.x, a.y);
    }
  }

  // Turn s, a run-time value turned into the constant I (so v stays in registers).
  template <int I>
  __device__ __forceinline__ void turn(Number<I>, int s, const EpilogueMaps& maps, TileStore& ts) {
    if constexpr (I < 2 * kHalf) {
      if (s != I) return turn(Number<I + 1>{}, s, maps, ts);
      constexpr int B = I / 2;
      if constexpr (I % 2 == 0) {
        if (pending & kPre) {
          if constexpr (Gated) {  // pre [rows][2][n]: the gate box, then the up box
            ts.box(maps.pre, {col + 64 * B, 0, pre_row}, [&](int g, int half) { return v[B][2 * g + half]; });
            ts.box(maps.pre, {col + 64 * B, 1, pre_row}, [&](int g, int half) { return v[B + kHalf][2 * g + half]; });
          } else {
            ts.box(maps.pre, {col + 64 * B, pre_row}, [&](int g, int half) { return v[B][2 * g + half]; });
          }
        }
        if (pending & kAct) compute_half<B, 0>();
      } else if (pending & kAct) {
        compute_half<B, 1>();
        ts.box(maps.out, {col + 64 * B, act_row}, [&](int g, int half) { return v[B][2 * g + half]; });
      }
      pending &= ~(1u << I);
    }
  }
};

}  // namespace sm90
}  // namespace gemm
}  // namespace v0
}  // namespace moeblaze
