// The persistent tile schedule of every sm_90a kernel, one type for every warp role: the grid
// is one CTA per SM (gemm/sm90/launch.cuh), and CTA b's j-th work item is b + j * gridDim.x.
// The producer and the consumers of a CTA walk that same sequence (the ping-pong consumers each
// every second item of it), so a tile's k-blocks reach the ring in the order its readers take
// them. What a work item means is the tile space's business:
//   GroupedTiles       the varlen-M grouped GEMM (gemm/grouped_tiles.hpp: experts' row blocks x
//                      column blocks, raster groups), decoded by a warp-wide search;
//   WeightGradTiles    the varlen-K weight gradients: experts x row blocks x column blocks of C_e.
// (The model is FlashAttention-3's StaticPersistentTileScheduler and CUTLASS's
// PersistentTileSchedulerSm90Group.)
#pragma once

#include <cstdint>

#include "gemm/grouped_tiles.hpp"
#include "gemm/sm90/params.hpp"
#include "gemm/sm90/tile_config.hpp"

namespace moeblaze {
inline namespace v0 {
namespace gemm {
namespace sm90 {

// One work item of a CTA's walk: the item and its index j among the CTA's items.
struct TileWork {
  int64_t item;
  uint32_t j;
};

template <class Tiles>
class PersistentTileScheduler {
 public:
  __device__ __forceinline__ explicit PersistentTileScheduler(const Tiles& tiles) : tiles_(tiles), total_(tiles.count()) {}

  struct End {};
  struct Iterator {
    TileWork w;
    int64_t total, item_step;
    uint32_t j_step;
    __device__ __forceinline__ TileWork operator*() const { return w; }
    __device__ __forceinline__ Iterator& operator++() {
      w.item += item_step;
      w.j += j_step;
      return *this;
    }
    __device__ __forceinline__ bool operator!=(End) const { return w.item < total; }
  };
  struct Walk {
    Iterator first;
    __device__ __forceinline__ Iterator begin() const { return first; }
    __device__ __forceinline__ End end() const { return {}; }
  };

  // The CTA's items j = first, first + step, ... (ping-pong: warpgroup w walks (w, 2)).
  __device__ __forceinline__ Walk walk(uint32_t first = 0, uint32_t step = 1) const {
    const int64_t stride = gridDim.x;
    return {{{blockIdx.x + first * stride, first}, total_, step * stride, step}};
  }
  __device__ __forceinline__ int64_t total() const { return total_; }
  __device__ __forceinline__ decltype(auto) decode(const TileWork& w) const { return tiles_.decode(w.item); }

 private:
  Tiles tiles_;
  int64_t total_;
};

// The varlen-M grouped GEMM's tiles (gemm/grouped_tiles.hpp) for BN-wide column blocks.
struct GroupedTiles {
  Schedule sched;
  int32_t col_blocks;

  __device__ __forceinline__ int64_t count() const { return total_tiles(sched.rb_prefix, sched.num_experts, col_blocks); }

  // decode_tile for a whole warp (every lane calls it): the last expert whose tiles start at or
  // before `work`, found by a 32-way search (each lane tests one candidate, a ballot picks the
  // last that holds) in ceil(log32 E) dependent loads instead of log2 E: 2 round trips to L2 for
  // E <= 1024, then the expert's offsets.
  __device__ __forceinline__ TileCoord decode(int64_t work) const {
    const int32_t* prefix = sched.rb_prefix;
    const int32_t num_experts = sched.num_experts;
    const int lane = threadIdx.x & 31;
    int32_t lo = 0, span = num_experts;  // the answer lies in [lo, lo + span); prefix[lo] * col_blocks <= work
    while (span > 1) {
      const int32_t step = (span + 31) / 32, e = lo + lane * step;
      const bool at_or_before = e < lo + span && static_cast<int64_t>(__ldg(prefix + e)) * col_blocks <= work;
      const int last = 31 - __clz(__ballot_sync(0xffffffffu, at_or_before));  // lane 0's candidate, lo, always holds
      lo += last * step;
      span = min(step, num_experts - lo);
    }
    return expert_tile(work, lo, sched.offsets, prefix, kBlockM, col_blocks, sched.raster_group);
  }
};

// A weight-gradient tile: rows [m0, m0 + kBlockM) and columns [n0, n0 + BN) of C_e, reduced
// over the expert's positions [p0, p1).
struct WeightGradTile {
  int32_t expert;
  int32_t m0, n0;
  int32_t p0, p1;
  __device__ __forceinline__ int k_blocks() const { return (p1 - p0 + kBlockK - 1) / kBlockK; }
};

// Work item w in [0, E * mb * nb): experts slowest, so neighbouring CTAs of the persistent grid
// reduce over the same positions while they are hot in L2; row blocks fastest.
template <int BN>
struct WeightGradTiles {
  const int32_t* offsets;  // [E + 1], sanitised
  int32_t num_experts, m, n;

  __device__ __forceinline__ int32_t row_blocks() const { return (m + kBlockM - 1) / kBlockM; }
  __device__ __forceinline__ int64_t count() const {
    return static_cast<int64_t>(num_experts) * row_blocks() * ((n + BN - 1) / BN);
  }
  __device__ __forceinline__ WeightGradTile decode(int64_t w) const {
    const int32_t mb = row_blocks(), nb = (n + BN - 1) / BN;
    const int64_t per_expert = static_cast<int64_t>(mb) * nb;
    WeightGradTile t;
    t.expert = static_cast<int32_t>(w / per_expert);
    const int32_t local = static_cast<int32_t>(w % per_expert);
    t.m0 = (local % mb) * kBlockM;
    t.n0 = (local / mb) * BN;
    t.p0 = offsets[t.expert];
    t.p1 = offsets[t.expert + 1];
    return t;
  }
};

}  // namespace sm90
}  // namespace gemm
}  // namespace v0
}  // namespace moeblaze
