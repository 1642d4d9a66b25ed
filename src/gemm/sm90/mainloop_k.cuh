// The weight-gradient (varlen-K) producer: the reduction runs over an expert's positions, so
// both operands arrive as rows of positions, each gathered through its own index list (x or dy
// through the plan) or read in expert order (dpre, g * act). One stage holds 64 positions:
// A as [2 blocks of 64 columns][64 positions][128 B] and B as [BN/64 blocks][64 positions][128 B],
// MN-major and 128-byte swizzled, the layout the consumers' transposed descriptors read.
// Positions past the expert's end and columns past m or n are zero-filled (both operands, so
// a non-finite value beyond the tile never reaches the sum as 0 * Inf).
#pragma once

#include <cuda/ptx>

#include "gemm/sm90/mainloop.cuh"

namespace moeblaze {
inline namespace v0 {
namespace gemm {
namespace sm90 {

struct WeightGradTile {
  int32_t expert;
  int32_t m0, n0;    // first row and column of C_e
  int32_t p0, p1;    // the expert's positions (the reduction range)
};

// Work item w in [0, E * mb * nb): experts slowest, so neighbouring CTAs of the persistent grid
// reduce over the same positions while they are hot in L2; row blocks fastest.
template <int BN>
__device__ __forceinline__ WeightGradTile decode_weight_grad_tile(const WeightGradParams& p, int64_t w) {
  const int32_t mb = (p.m + kBlockM - 1) / kBlockM, nb = (p.n + BN - 1) / BN;
  const int64_t per_expert = static_cast<int64_t>(mb) * nb;
  WeightGradTile t;
  t.expert = static_cast<int32_t>(w / per_expert);
  const int32_t local = static_cast<int32_t>(w % per_expert);
  t.m0 = (local % mb) * kBlockM;
  t.n0 = (local / mb) * BN;
  t.p0 = p.sched.offsets[t.expert];
  t.p1 = p.sched.offsets[t.expert + 1];
  return t;
}

__device__ __forceinline__ int weight_grad_k_blocks(const WeightGradTile& t) { return (t.p1 - t.p0 + kBlockK - 1) / kBlockK; }

// The source row of position pos for one operand, whose index entry (or pos itself, in expert
// order) is q: -1 past the expert's end or for a bad index.
__device__ __forceinline__ int32_t weight_grad_row(int32_t pos, int32_t p1, int32_t q, int32_t rows) {
  return pos < p1 && q >= 0 && q < rows ? q : -1;
}

// One 16-byte chunk per thread and row: columns [col0 + 8 chunk, + 8) of source row `row` into
// row r of a swizzled 64-column block.
template <class T>
__device__ __forceinline__ void copy_chunk(uint32_t dst_block, int r, int chunk, const T* base, int64_t ld, int32_t row,
                                           int32_t col0, int32_t cols) {
  const int32_t col = col0 + chunk * 8;
  const bool ok = row >= 0 && col < cols;
  const T* src = ok ? base + static_cast<int64_t>(row) * ld + col : base;
  cp_async_16(dst_block + sw128_offset(r, chunk), src, ok ? 16u : 0u);
}

// The weight-gradient operands' TMA descriptors: an operand read in expert order (no index)
// comes by TMA in whole k-blocks, 64 x 64 boxes of its rows_tensor_map; `tma` says which do.
struct WeightGradMaps {
  TmaDescriptor a, b;
  int32_t tma_a = 0, tma_b = 0;
};

// Issues the TMA boxes of one operand's k-block: `blocks` 64-column boxes from column col0 of
// positions [pos, pos + 64) into consecutive 8 KB blocks of the stage.
__device__ __forceinline__ void tma_k_block(const TmaDescriptor& map, uint8_t* dst, int blocks, int32_t col0, int32_t pos,
                                            uint64_t* bar) {
  using namespace cuda::ptx;
  for (int blk = 0; blk < blocks; ++blk) {
    const int32_t c[2] = {col0 + blk * 64, pos};
    cp_async_bulk_tensor(space_cluster, space_global, dst + blk * (kBlockK * 128), &map, c, bar);
  }
}

// Thread t (of 128) copies chunk t % 8 of position rows t / 8 + 16 i (i < 4) of every block, so
// eight neighbouring lanes read one 128-byte row segment (coalesced) and a warp four rows.
// A k-block that lies wholly inside the expert takes its expert-order operand by TMA (thread 0,
// expect_tx on full[s], the barrier's 129th arrival); the expert's last, partial k-block copies
// both operands with cp.async, whose zero fill masks the positions past the expert.
template <class T, int BN>
__device__ void produce_weight_grad(const WeightGradParams& p, const WeightGradMaps& maps, const StageRing& ring) {
  using Cfg = TileConfig<BN>;
  constexpr int kRowPasses = kBlockK / 16;
  const int t = threadIdx.x, chunk = t & 7, r0 = t >> 3;
  const T* A = static_cast<const T*>(p.a);
  const T* B = static_cast<const T*>(p.b);
  const int32_t mb = (p.m + kBlockM - 1) / kBlockM, nb = (p.n + BN - 1) / BN;
  const int64_t total = static_cast<int64_t>(p.sched.num_experts) * mb * nb;
  uint32_t it = 0;
  for (int64_t w = blockIdx.x; w < total; w += gridDim.x) {
    const WeightGradTile tile = decode_weight_grad_tile<BN>(p, w);
    const int num_kb = weight_grad_k_blocks(tile);
    // The source rows change with every k-block. The raw indices of the next block are loaded
    // while this block's copies go out and checked only when used: a check right after its
    // load made each of the four loads a dependent L2 round trip (ncu: the producer stalled on
    // them and starved the consumers).
    int32_t next_a[kRowPasses], next_b[kRowPasses];
    auto fetch = [&](int kb) {
#pragma unroll
      for (int i = 0; i < kRowPasses; ++i) {
        const int32_t pos = tile.p0 + kb * kBlockK + r0 + 16 * i;
        next_a[i] = p.a_index && pos < tile.p1 ? __ldg(p.a_index + pos) : pos;
        next_b[i] = p.b_index && pos < tile.p1 ? __ldg(p.b_index + pos) : pos;
      }
    };
    if (num_kb > 0) fetch(0);
    for (int kb = 0; kb < num_kb; ++kb, ++it) {
      const uint32_t s = it % Cfg::kStages;
      const int32_t pos0 = tile.p0 + kb * kBlockK;
      const bool whole = pos0 + kBlockK <= tile.p1;
      const bool tma_a = whole && maps.tma_a, tma_b = whole && maps.tma_b;
      mbar_wait(&ring.empty[s], ((it / Cfg::kStages) & 1) ^ 1);
      int32_t qa[kRowPasses], qb[kRowPasses];
#pragma unroll
      for (int i = 0; i < kRowPasses; ++i) {
        const int32_t pos = pos0 + r0 + 16 * i;
        qa[i] = weight_grad_row(pos, tile.p1, next_a[i], p.a_rows);
        qb[i] = weight_grad_row(pos, tile.p1, next_b[i], p.b_rows);
      }
      if (kb + 1 < num_kb) fetch(kb + 1);
      const uint32_t a_dst = ring.base + s * Cfg::kStageBytes, b_dst = a_dst + Cfg::kABytes;
      if (t == 0) {
        using namespace cuda::ptx;
        const uint32_t bytes = (tma_a ? Cfg::kABytes : 0) + (tma_b ? Cfg::kBBytes : 0);
        if (bytes == 0) {
          mbarrier_arrive(&ring.full[s]);
        } else {
          mbarrier_arrive_expect_tx(sem_release, scope_cta, space_shared, &ring.full[s], bytes);
          uint8_t* stage = ring.ptr + s * Cfg::kStageBytes;
          if (tma_a) tma_k_block(maps.a, stage, kBlockM / 64, tile.m0, pos0, &ring.full[s]);
          if (tma_b) tma_k_block(maps.b, stage + Cfg::kABytes, BN / 64, tile.n0, pos0, &ring.full[s]);
        }
      }
#pragma unroll
      for (int i = 0; i < kRowPasses; ++i) {
        const int r = r0 + 16 * i;
        if (!tma_a) {
#pragma unroll
          for (int blk = 0; blk < kBlockM / 64; ++blk)
            copy_chunk(a_dst + blk * (kBlockK * 128), r, chunk, A, p.lda, qa[i], tile.m0 + blk * 64, p.m);
        }
        if (!tma_b) {
#pragma unroll
          for (int blk = 0; blk < BN / 64; ++blk)
            copy_chunk(b_dst + blk * (kBlockK * 128), r, chunk, B, p.ldb, qb[i], tile.n0 + blk * 64, p.n);
        }
      }
      cuda::ptx::cp_async_mbarrier_arrive_noinc(&ring.full[s]);
    }
  }
}

}  // namespace sm90
}  // namespace gemm
}  // namespace v0
}  // namespace moeblaze
