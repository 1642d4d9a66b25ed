// The grouped GEMM's warp-specialised mainloop: a producer warpgroup gathers A rows (through the
// routing plan's index list) and B tiles (the expert's weights) into a ring of shared-memory
// stages with 16-byte cp.async, 128-byte swizzled; two consumer warpgroups run wgmma on them.
// full[s] completes when all 128 producer threads' copies into stage s have landed
// (cp.async.mbarrier.arrive.noinc); empty[s] when all 8 consumer warps are done reading it.
// Producer and consumers walk the same persistent tile sequence, so they never exchange tiles.
#pragma once

#include <cuda/ptx>

#include "gemm/grouped_tiles.hpp"
#include "gemm/sm90/params.hpp"
#include "gemm/sm90/ptx.cuh"
#include "gemm/sm90/tile_config.hpp"
#include "gemm/sm90/wgmma.cuh"

namespace moeblaze {
inline namespace v0 {
namespace gemm {
namespace sm90 {

struct StageRing {
  uint32_t base;    // shared address of stage 0 (1024-byte aligned)
  uint64_t* full;   // [stages]
  uint64_t* empty;  // [stages]
};

// Tile column c (multiple of 8) -> B column, or -1 past the problem's columns. Gated tiles take
// their first half from the gate columns and their second half from the same up columns.
template <int BN>
__device__ __forceinline__ int32_t b_column(const GroupedGemmParams& p, int32_t col_block, int32_t c) {
  if (p.gated) {
    const int32_t half = c >= BN / 2;
    const int32_t j = col_block * (BN / 2) + c - half * (BN / 2);
    return j < p.n ? j + half * p.n : -1;
  }
  const int32_t j = col_block * BN + c;
  return j < p.n ? j : -1;
}

__device__ __forceinline__ int32_t col_blocks_of(const GroupedGemmParams& p, int bn) {
  const int32_t w = p.gated ? bn / 2 : bn;
  return (p.n + w - 1) / w;
}

template <class T, int BN, Major BMajor>
__device__ void produce(const GroupedGemmParams& p, const StageRing& ring) {
  using Cfg = TileConfig<BN>;
  const int t = threadIdx.x;  // 0..127
  const T* A = static_cast<const T*>(p.a);
  const T* B = static_cast<const T*>(p.b);
  const int32_t E = p.sched.num_experts, cb = col_blocks_of(p, BN);
  const int num_kb = (p.k + kBlockK - 1) / kBlockK;
  const int64_t total = total_tiles(p.sched.rb_prefix, E, cb);
  const int a_chunk = t & 7, a_row = t >> 3;  // A: rows a_row + 16 i, chunk a_chunk
  uint32_t it = 0;
  for (int64_t w = blockIdx.x; w < total; w += gridDim.x) {
    const TileCoord tc = decode_tile(w, p.sched.offsets, p.sched.rb_prefix, E, kBlockM, cb);
    int32_t src_row[8];
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      const int r = a_row + 16 * i;
      int32_t q = -1;
      if (r < tc.rows) {
        const int32_t pos = tc.row0 + r;
        q = p.a_index ? __ldg(p.a_index + pos) : pos;
        if (q < 0 || q >= p.a_rows) q = -1;
      }
      src_row[i] = q;
    }
    const T* Be = B + static_cast<int64_t>(tc.expert) * p.b_expert_stride;
    for (int kb = 0; kb < num_kb; ++kb, ++it) {
      const uint32_t s = it % Cfg::kStages;
      mbar_wait(&ring.empty[s], ((it / Cfg::kStages) & 1) ^ 1);
      const uint32_t a_dst = ring.base + s * Cfg::kStageBytes, b_dst = a_dst + Cfg::kABytes;
      const int32_t k0 = kb * kBlockK;
      {
        const int32_t kk = k0 + a_chunk * 8;
#pragma unroll
        for (int i = 0; i < 8; ++i) {
          const bool ok = kk < p.k && src_row[i] >= 0;
          const T* src = ok ? A + static_cast<int64_t>(src_row[i]) * p.lda + kk : A;
          cp_async_16(a_dst + sw128_offset(a_row + 16 * i, a_chunk), src, ok ? 16u : 0u);
        }
      }
      if constexpr (BMajor == Major::kMN) {
        // smem [BN/64 column blocks][64 k rows][128 B]; thread: one column chunk, every
        // (1024/BN)-th k row.
        constexpr int kChunksPerRow = BN / 8, kRowStep = 128 / kChunksPerRow;
        const int cc = t % kChunksPerRow, kr0 = t / kChunksPerRow;
        const int32_t col = b_column<BN>(p, tc.col_block, cc * 8);
#pragma unroll
        for (int i = 0; i < kBlockK / kRowStep; ++i) {
          const int kr = kr0 + kRowStep * i;
          const bool ok = col >= 0 && k0 + kr < p.k;
          const T* src = ok ? Be + static_cast<int64_t>(k0 + kr) * p.ldb + col : B;
          cp_async_16(b_dst + (cc / 8) * (kBlockK * 128) + sw128_offset(kr, cc % 8), src, ok ? 16u : 0u);
        }
      } else {
        // smem [BN n rows][128 B]; thread: chunk t % 8 of rows t / 8 + 16 i. A gated tile's second
        // half starts at a multiple of 16 rows, so each unrolled i knows its half: the row
        // addresses are two bases plus multiples of 16 ldb (few live registers).
        const int ch = t & 7, nr0 = t >> 3;
        const int32_t kk = k0 + ch * 8;
        constexpr int kHalfRows = BN / 32;  // i per half
        const int32_t w = p.gated ? BN / 2 : BN, j0 = tc.col_block * w + nr0;
        const T* row0 = Be + static_cast<int64_t>(j0) * p.ldb + kk;
        const T* row1 = Be + static_cast<int64_t>(j0 + p.n - BN / 2) * p.ldb + kk;  // gated second half
#pragma unroll
        for (int i = 0; i < BN / 16; ++i) {
          const bool second = p.gated && i >= kHalfRows;
          const int32_t j = j0 + 16 * i - (second ? BN / 2 : 0);  // column within its half
          const bool ok = j < p.n && kk < p.k;
          const T* src = ok ? (second ? row1 : row0) + static_cast<int64_t>(16 * i) * p.ldb : B;
          cp_async_16(b_dst + sw128_offset(nr0 + 16 * i, ch), src, ok ? 16u : 0u);
        }
      }
      cuda::ptx::cp_async_mbarrier_arrive_noinc(&ring.full[s]);
    }
  }
}

// One consumer warpgroup's share of a tile: rows [64 wg, 64 wg + 64) x BN columns, accumulated
// over K into acc (the wgmma m64nBN fragment). `it` is the ring position, carried across tiles.
template <class T, int BN, Major BMajor>
__device__ __forceinline__ void consume_tile(const GroupedGemmParams& p, const StageRing& ring, int wg, int num_kb,
                                             uint32_t& it, float (&acc)[BN / 2]) {
  using Cfg = TileConfig<BN>;
  using Mma = Wgmma<T, BN, 0, 0>;   // B K-major
  using MmaT = Wgmma<T, BN, 0, 1>;  // B MN-major
  const bool lane0 = (threadIdx.x & 31) == 0;
  if (num_kb == 0) {  // K = 0: the product is zero
#pragma unroll
    for (int i = 0; i < BN / 2; ++i) acc[i] = 0.f;
  }
  uint32_t prev = 0;
  for (int kb = 0; kb < num_kb; ++kb, ++it) {
    const uint32_t s = it % Cfg::kStages;
    mbar_wait(&ring.full[s], (it / Cfg::kStages) & 1);
    const uint32_t a = ring.base + s * Cfg::kStageBytes + wg * (64 * 128), b = ring.base + s * Cfg::kStageBytes + Cfg::kABytes;
    fence_accumulators(acc);
    wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < kBlockK / 16; ++kk) {
      const uint64_t da = sw128_desc(a + kk * 32, 16, 1024);
      const int accumulate = (kb | kk) != 0;
      if constexpr (BMajor == Major::kMN) MmaT::mma(acc, da, sw128_desc(b + kk * 16 * 128, kBlockK * 128, 1024), accumulate);
      else Mma::mma(acc, da, sw128_desc(b + kk * 32, 16, 1024), accumulate);
    }
    wgmma_commit();
    fence_accumulators(acc);
    if (kb > 0) {  // the previous stage's MMAs are done: hand it back
      wgmma_wait<1>();
      if (lane0) cuda::ptx::mbarrier_arrive(&ring.empty[prev]);
    }
    prev = s;
  }
  wgmma_wait<0>();
  if (num_kb > 0 && lane0) cuda::ptx::mbarrier_arrive(&ring.empty[prev]);
  fence_accumulators(acc);
}

}  // namespace sm90
}  // namespace gemm
}  // namespace v0
}  // namespace moeblaze
