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

// The source row of position pos for one operand, or -1 (past the expert, or a bad index).
__device__ __forceinline__ int32_t weight_grad_row(int32_t pos, int32_t p1, const int32_t* index, int32_t rows) {
  if (pos >= p1) return -1;
  const int32_t q = index ? __ldg(index + pos) : pos;
  return q >= 0 && q < rows ? q : -1;
}

// 8 chunks of 16 bytes: columns [col0, col0 + 64) of source row `row` into one swizzled block row.
template <class T>
__device__ __forceinline__ void copy_block_row(uint32_t dst_block, int r, const T* base, int64_t ld, int32_t row,
                                               int32_t col0, int32_t cols) {
#pragma unroll
  for (int c = 0; c < 8; ++c) {
    const int32_t col = col0 + c * 8;
    const bool ok = row >= 0 && col < cols;
    const T* src = ok ? base + static_cast<int64_t>(row) * ld + col : base;
    cp_async_16(dst_block + sw128_offset(r, c), src, ok ? 16u : 0u);
  }
}

// Thread t (of 128) fills position row t / 2 of each stage: A block t % 2 and B blocks
// (BN / 128) * (t % 2) onwards.
template <class T, int BN>
__device__ void produce_weight_grad(const WeightGradParams& p, const StageRing& ring) {
  using Cfg = TileConfig<BN>;
  constexpr int kBBlocksPerThread = BN / 128;
  const int t = threadIdx.x, r = t >> 1, half = t & 1;
  const T* A = static_cast<const T*>(p.a);
  const T* B = static_cast<const T*>(p.b);
  const int32_t mb = (p.m + kBlockM - 1) / kBlockM, nb = (p.n + BN - 1) / BN;
  const int64_t total = static_cast<int64_t>(p.sched.num_experts) * mb * nb;
  uint32_t it = 0;
  for (int64_t w = blockIdx.x; w < total; w += gridDim.x) {
    const WeightGradTile tile = decode_weight_grad_tile<BN>(p, w);
    const int num_kb = weight_grad_k_blocks(tile);
    for (int kb = 0; kb < num_kb; ++kb, ++it) {
      const uint32_t s = it % Cfg::kStages;
      mbar_wait(&ring.empty[s], ((it / Cfg::kStages) & 1) ^ 1);
      const uint32_t a_dst = ring.base + s * Cfg::kStageBytes, b_dst = a_dst + Cfg::kABytes;
      const int32_t pos = tile.p0 + kb * kBlockK + r;
      const int32_t qa = weight_grad_row(pos, tile.p1, p.a_index, p.a_rows);
      const int32_t qb = weight_grad_row(pos, tile.p1, p.b_index, p.b_rows);
      copy_block_row(a_dst + half * (kBlockK * 128), r, A, p.lda, qa, tile.m0 + half * 64, p.m);
#pragma unroll
      for (int i = 0; i < kBBlocksPerThread; ++i) {
        const int blk = half * kBBlocksPerThread + i;
        copy_block_row(b_dst + blk * (kBlockK * 128), r, B, p.ldb, qb, tile.n0 + blk * 64, p.n);
      }
      cuda::ptx::cp_async_mbarrier_arrive_noinc(&ring.full[s]);
    }
  }
}

}  // namespace sm90
}  // namespace gemm
}  // namespace v0
}  // namespace moeblaze
