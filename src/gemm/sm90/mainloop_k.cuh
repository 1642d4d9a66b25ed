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

// Thread t (of 128) copies chunk t % 8 of position rows t / 8 + 16 i (i < 4) of every block, so
// eight neighbouring lanes read one 128-byte row segment (coalesced) and a warp four rows.
template <class T, int BN>
__device__ void produce_weight_grad(const WeightGradParams& p, const StageRing& ring) {
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
    // The source rows change with every k-block: they are looked up one block ahead, so the
    // index loads' latency overlaps the previous block's copies instead of preceding them.
    int32_t qa[kRowPasses], qb[kRowPasses], next_a[kRowPasses], next_b[kRowPasses];
    auto lookup = [&](int kb, int32_t (&ra)[kRowPasses], int32_t (&rb)[kRowPasses]) {
#pragma unroll
      for (int i = 0; i < kRowPasses; ++i) {
        const int32_t pos = tile.p0 + kb * kBlockK + r0 + 16 * i;
        ra[i] = weight_grad_row(pos, tile.p1, p.a_index, p.a_rows);
        rb[i] = weight_grad_row(pos, tile.p1, p.b_index, p.b_rows);
      }
    };
    if (num_kb > 0) lookup(0, next_a, next_b);
    for (int kb = 0; kb < num_kb; ++kb, ++it) {
      const uint32_t s = it % Cfg::kStages;
#pragma unroll
      for (int i = 0; i < kRowPasses; ++i) {
        qa[i] = next_a[i];
        qb[i] = next_b[i];
      }
      if (kb + 1 < num_kb) lookup(kb + 1, next_a, next_b);
      mbar_wait(&ring.empty[s], ((it / Cfg::kStages) & 1) ^ 1);
      const uint32_t a_dst = ring.base + s * Cfg::kStageBytes, b_dst = a_dst + Cfg::kABytes;
#pragma unroll
      for (int i = 0; i < kRowPasses; ++i) {
        const int r = r0 + 16 * i;
#pragma unroll
        for (int blk = 0; blk < kBlockM / 64; ++blk)
          copy_chunk(a_dst + blk * (kBlockK * 128), r, chunk, A, p.lda, qa[i], tile.m0 + blk * 64, p.m);
#pragma unroll
        for (int blk = 0; blk < BN / 64; ++blk)
          copy_chunk(b_dst + blk * (kBlockK * 128), r, chunk, B, p.ldb, qb[i], tile.n0 + blk * 64, p.n);
      }
      cuda::ptx::cp_async_mbarrier_arrive_noinc(&ring.full[s]);
    }
  }
}

}  // namespace sm90
}  // namespace gemm
}  // namespace v0
}  // namespace moeblaze
