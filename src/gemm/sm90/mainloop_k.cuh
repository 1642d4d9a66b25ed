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

// The source row of position pos for one operand, whose index entry (or pos itself, in expert
// order) is q: -1 past the expert's end or for a bad index.
__device__ __forceinline__ int32_t weight_grad_row(int32_t pos, int32_t p1, int32_t q, int32_t rows) {
  return pos < p1 && q >= 0 && q < rows ? q : -1;
}

// Copies a thread's chunk of one position row into every 64-column block of an operand's
// stage: `row` points at the chunk's first element in block 0 (nullptr: a zero row), and bit
// blk of cols_ok says whether the chunk's columns in block blk lie inside the operand (m and n
// are multiples of 8, so a chunk is wholly inside or wholly past). One 64-bit row address per
// position row and stage; the blocks' addresses are constant offsets from it.
template <int Blocks, class T>
__device__ __forceinline__ void copy_row_chunks(uint32_t dst, int r, int chunk, const T* row, uint32_t cols_ok, const T* any) {
#pragma unroll
  for (int blk = 0; blk < Blocks; ++blk) {
    const bool ok = row != nullptr && ((cols_ok >> blk) & 1u);
    cp_async_16(dst + blk * (kBlockK * 128) + sw128_offset(r, chunk), ok ? row + blk * 64 : any, ok ? 16u : 0u);
  }
}

// Bit blk: columns [col0 + 64 blk + 8 chunk, + 8) lie inside [0, cols).
template <int Blocks>
__device__ __forceinline__ uint32_t chunk_columns_ok(int32_t col0, int chunk, int32_t cols) {
  uint32_t ok = 0;
#pragma unroll
  for (int blk = 0; blk < Blocks; ++blk) ok |= (col0 + blk * 64 + chunk * 8 < cols ? 1u : 0u) << blk;
  return ok;
}

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

// One operand of the weight-gradient stages, as one producer thread copies it: thread t (of
// 128) copies chunk t % 8 of position rows t / 8 + 16 i (i < 4) of every 64-column block, so
// eight neighbouring lanes read one 128-byte row segment (coalesced) and a warp four rows.
// Tma: the operand is read in expert order (no index) and comes by TMA in every k-block that
// lies wholly inside the expert; the expert's last, partial block, and every block of a
// gathered operand, come by cp.async, whose zero fill masks the positions past the expert.
// Position rows per producer thread and stage: 128 threads, eight per row, cover 16 rows a pass.
constexpr int kGradRowPasses = kBlockK / 16;

template <class T, int Blocks, bool Tma>
struct GradOperand {
  static constexpr int kRowPasses = kGradRowPasses;
  const T* base;
  int64_t ld;
  const int32_t* index;  // nullptr: position p is row p
  int32_t rows;
  int32_t chunk_col = 0;  // the thread's first column in block 0 (this tile)
  uint32_t cols_ok = 0;   // chunk_columns_ok of this tile
  // The raw indices of the next k-block's rows, loaded while this block's copies go out and
  // checked only when used: a check right after its load made each of the four loads a
  // dependent L2 round trip (ncu: the producer stalled on them and starved the consumers).
  int32_t next[kRowPasses];

  __device__ __forceinline__ void start_tile(int32_t col0, int chunk, int32_t cols) {
    chunk_col = col0 + chunk * 8;
    cols_ok = chunk_columns_ok<Blocks>(col0, chunk, cols);
  }
  __device__ __forceinline__ void fetch(int32_t pos0, int32_t p1, int r0) {
    if constexpr (!Tma) {
#pragma unroll
      for (int i = 0; i < kRowPasses; ++i) {
        const int32_t pos = pos0 + r0 + 16 * i;
        next[i] = index && pos < p1 ? __ldg(index + pos) : pos;
      }
    }
  }
  // The checked source rows of k-block [pos0, pos0 + 64): -1 past the expert or out of range.
  __device__ __forceinline__ void resolve(int32_t pos0, int32_t p1, int r0, int32_t (&q)[kRowPasses]) const {
#pragma unroll
    for (int i = 0; i < kRowPasses; ++i) {
      const int32_t pos = pos0 + r0 + 16 * i;
      q[i] = weight_grad_row(pos, p1, Tma ? pos : next[i], rows);
    }
  }
  __device__ __forceinline__ void copy(uint32_t dst, int r0, int chunk, const int32_t (&q)[kRowPasses]) const {
#pragma unroll
    for (int i = 0; i < kRowPasses; ++i)
      copy_row_chunks<Blocks>(dst, r0 + 16 * i, chunk, q[i] >= 0 ? base + q[i] * ld + chunk_col : nullptr, cols_ok, base);
  }
};

// The producer warpgroup. TmaA / TmaB: that operand is read in expert order and has a tensor
// map (GradOperand). Thread 0 issues the TMA boxes with expect_tx on full[s] (the barrier's
// 129th arrival). Specialised per operand kind at compile time: the production case (A
// gathered, B by TMA) keeps one operand's copies and no run-time branches per stage.
template <class T, int BN, bool TmaA, bool TmaB>
__device__ void produce_weight_grad(const WeightGradParams& p, const WeightGradMaps& maps,
                                    const StageRing<TileConfig<BN>>& ring) {
  using Cfg = TileConfig<BN>;
  const int t = threadIdx.x, chunk = t & 7, r0 = t >> 3;
  GradOperand<T, kBlockM / 64, TmaA> a{static_cast<const T*>(p.a), p.lda, p.a_index, p.a_rows};
  GradOperand<T, BN / 64, TmaB> b{static_cast<const T*>(p.b), p.ldb, p.b_index, p.b_rows};
  const PersistentTileScheduler<WeightGradTiles<BN>> sched({p.sched.offsets, p.sched.num_experts, p.m, p.n});
  typename StageRing<Cfg>::State st;
  for (const TileWork w : sched.walk()) {
    const WeightGradTile tile = sched.decode(w);
    const int num_kb = tile.k_blocks();
    a.start_tile(tile.m0, chunk, p.m);
    b.start_tile(tile.n0, chunk, p.n);
    if (num_kb > 0) {
      a.fetch(tile.p0, tile.p1, r0);
      b.fetch(tile.p0, tile.p1, r0);
    }
    for (int kb = 0; kb < num_kb; ++kb, st.advance()) {
      const int32_t pos0 = tile.p0 + kb * kBlockK;
      const bool whole = pos0 + kBlockK <= tile.p1;
      const bool tma_a = TmaA && whole, tma_b = TmaB && whole;
      ring.pipe.acquire(st);
      int32_t qa[kGradRowPasses], qb[kGradRowPasses];
      if (!tma_a) a.resolve(pos0, tile.p1, r0, qa);
      if (!tma_b) b.resolve(pos0, tile.p1, r0, qb);
      if (kb + 1 < num_kb) {
        a.fetch(pos0 + kBlockK, tile.p1, r0);
        b.fetch(pos0 + kBlockK, tile.p1, r0);
      }
      const uint32_t a_dst = ring.stage_addr(st), b_dst = a_dst + Cfg::kABytes;
      if (t == 0) {
        ring.pipe.arrive_expect_tx(st, (tma_a ? Cfg::kABytes : 0) + (tma_b ? Cfg::kBBytes : 0));
        uint8_t* stage = ring.stage_ptr(st);
        if (tma_a) tma_k_block(maps.a, stage, kBlockM / 64, tile.m0, pos0, ring.pipe.full_barrier(st));
        if (tma_b) tma_k_block(maps.b, stage + Cfg::kABytes, BN / 64, tile.n0, pos0, ring.pipe.full_barrier(st));
      }
      if (!tma_a) a.copy(a_dst, r0, chunk, qa);
      if (!tma_b) b.copy(b_dst, r0, chunk, qb);
      ring.pipe.arrive_cp_async(st);
    }
  }
}

}  // namespace sm90
}  // namespace gemm
}  // namespace v0
}  // namespace moeblaze
