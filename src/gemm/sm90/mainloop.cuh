// The grouped GEMM's warp-specialised mainloop: a producer warpgroup fills a ring of shared-memory
// stages (128-byte swizzled) with A rows and B tiles (the expert's weights); two consumer
// warpgroups run wgmma on them. B comes by TMA (one elected producer thread, 64-wide boxes of
// the weights' tensor map). Gathered A (through the routing plan's index list) comes by 16-byte
// cp.async from all 128 producer threads: full[s] completes when their copies have landed
// (cp.async.mbarrier.arrive.noinc) and the B bytes have arrived (expect_tx by the elected thread,
// its 129th arrival). A in expert order comes by TMA too, and full[s] waits for that one
// thread's expect_tx of both operands. empty[s] completes when the consumer warps that read the
// stage are done (all 8 when the two warpgroups share a tile, the 4 of its warpgroup under
// ping-pong).
// Producer and consumers walk the same persistent tile sequence. The producer, which decodes
// each tile anyway (a search over the expert offsets: a chain of dependent global loads),
// also leaves its coordinates in a shared-memory slot that the consumers read once the tile's
// first stage is full, so that chain of loads never stalls the MMAs.
#pragma once

#include <cuda/ptx>

#include "cuda/row_arrival.cuh"
#include "gemm/grouped_tiles.hpp"
#include "gemm/sm90/params.hpp"
#include "gemm/sm90/pipeline.cuh"
#include "gemm/sm90/ptx.cuh"
#include "gemm/sm90/tile_config.hpp"
#include "gemm/sm90/tile_scheduler.cuh"
#include "gemm/sm90/wgmma.cuh"

namespace moeblaze {
inline namespace v0 {
namespace gemm {
namespace sm90 {

// The CTA's shared memory for a TileConfig Cfg: the operand stages and their pipeline, the
// epilogue's staging boxes, the ping-pong turns and the tile slots.
template <class Cfg>
struct StageRing {
  static constexpr int kStages = Cfg::kStages;
  using State = PipelineState<kStages>;
  uint8_t* ptr;     // stage 0 (1024-byte aligned), generic address
  uint32_t base;    // the same, shared address
  StagePipeline<kStages> pipe;
  MmaTurns turns;
  uint8_t* staging; // the epilogue's staging (Cfg::kStagingBytes, 1024-byte aligned)
  // A tile's hand-off from the consumers to epilogue warps through the staging area (one
  // slot: the consumers fill it, the epilogue warps empty it), where a kernel has them.
  StagePipeline<1> handoff;
  TileCoord* tiles; // [kTileSlots] the CTA's j-th tile's coordinates in slot j % kTileSlots

  __device__ __forceinline__ uint8_t* stage_ptr(State st) const { return ptr + st.index() * Cfg::kStageBytes; }
  __device__ __forceinline__ uint32_t stage_addr(State st) const { return base + st.index() * Cfg::kStageBytes; }
};

// Carves the ring from the dynamic shared memory (Cfg::kSmemBytes) and initialises its
// barriers with the given arrival counts (`handoff`: the epilogue hand-off's, where the kernel
// has one). Every thread of the block calls it (it ends with a block barrier).
template <class Cfg>
__device__ __forceinline__ StageRing<Cfg> init_ring(uint8_t* smem_raw, const PipelineArrivals& arrivals,
                                                    const PipelineArrivals& handoff = {}) {
  constexpr int S = Cfg::kStages;
  uint8_t* smem = reinterpret_cast<uint8_t*>((reinterpret_cast<uintptr_t>(smem_raw) + 1023) & ~uintptr_t(1023));
  StageRing<Cfg> ring;
  ring.ptr = smem;
  ring.base = smem_addr(smem);
  ring.staging = smem + S * Cfg::kStageBytes;
  // full[S], empty[S], turn[2], the hand-off's full and empty, the tile slots
  uint64_t* barriers = reinterpret_cast<uint64_t*>(ring.staging + Cfg::kStagingBytes);
  ring.pipe = StagePipeline<S>::init(barriers, arrivals);
  ring.turns = MmaTurns::init(barriers + 2 * S);
  ring.handoff = StagePipeline<1>::init(barriers + 2 * S + 2, handoff);
  ring.tiles = reinterpret_cast<TileCoord*>(barriers + 2 * S + 4);
  static_assert(sizeof(TileCoord) == kTileSlotBytes, "TileConfig sizes the tile slots");
  static_assert((2 * S + 4) * 8 % 16 == 0, "the tile slots are 16-byte aligned (read_tile_slot)");
  if (threadIdx.x == 0) cuda::ptx::fence_mbarrier_init(cuda::ptx::sem_release, cuda::ptx::scope_cluster);
  __syncthreads();
  return ring;
}

// The first B column (kMN) or row (kK) of the 64-wide box `box` of a tile's columns. Gated tiles
// take their first half from the gate columns and their second half from the same up columns;
// a box that reaches past n reads zeros (past the tensor) or up columns (the gate half), and the
// epilogue never stores those columns.
template <int BN>
__device__ __forceinline__ int32_t b_box_start(const GroupedGemmParams& p, int32_t col_block, int box, int box_cols) {
  const int half = p.gated && box * box_cols >= BN / 2;
  return col_block * tile_columns(p.gated, BN) + box * box_cols - half * (BN / 2) + half * p.n;
}

// The CTA's j-th tile's coordinates, from its slot, for a whole warp (every lane calls it):
// lane 0 reads the slot and the other lanes get it by shuffle. The producer rewrites the slot
// kTileSlots tiles later, ordered after the read by the empty-barrier arrivals that lane 0 makes
// after it (TileConfig's kTileSlots comment); a lane that read the slot itself would reach those
// arrivals only through warp convergence, which compute-sanitizer's racecheck does not follow.
__device__ __forceinline__ TileCoord read_tile_slot(const TileCoord* slots, int64_t j) {
  int4 v = make_int4(0, 0, 0, 0);
  if ((threadIdx.x & 31) == 0) v = *reinterpret_cast<const int4*>(slots + j % kTileSlots);
  return {__shfl_sync(0xffffffffu, v.x, 0), __shfl_sync(0xffffffffu, v.y, 0), __shfl_sync(0xffffffffu, v.z, 0),
          __shfl_sync(0xffffffffu, v.w, 0)};
}

// A stage's B boxes for tile tc, k-block k0, by TMA (the elected producer thread): b_ptr is the
// stage's B operand, `bar` its full barrier.
template <int BN, Major BMajor>
__device__ __forceinline__ void issue_b(const GroupedGemmParams& p, const TmaDescriptor& bmap, uint8_t* b_ptr, uint64_t* bar,
                                       const TileCoord& tc, int32_t k0) {
  using namespace cuda::ptx;
  if constexpr (BMajor == Major::kMN) {  // smem [BN/64 boxes][64 k rows][128 B]
#pragma unroll
    for (int box = 0; box < BN / 64; ++box) {
      const int32_t c[3] = {b_box_start<BN>(p, tc.col_block, box, 64), k0, tc.expert};
      cp_async_bulk_tensor(space_cluster, space_global, b_ptr + box * (kBlockK * 128), &bmap, c, bar);
    }
  } else {  // smem [BN n rows][128 B]: one box of BN rows, or two of BN/2 when gated
    const int boxes = p.gated ? 2 : 1, rows = BN / boxes;
    for (int box = 0; box < boxes; ++box) {
      const int32_t c[3] = {k0, b_box_start<BN>(p, tc.col_block, box, rows), tc.expert};
      cp_async_bulk_tensor(space_cluster, space_global, b_ptr + box * rows * 128, &bmap, c, bar);
    }
  }
}

// What a tile's epilogue reads besides its accumulators, loaded by TMA into loads.stages() more
// ring stages after the tile's k-blocks (kBytes each): issue(q, stage, tile, full barrier) by
// the elected producer thread. The consumers take those stages after their MMAs, in ring order,
// and release them like operand stages (gemm/sm90/epilogue_act_backward.cuh: the saved pre).
// Most epilogues read nothing.
struct NoEpilogueLoads {
  static constexpr uint32_t kBytes = 0;
  __device__ int stages() const { return 0; }
  __device__ void issue(int, uint8_t*, const TileCoord&, uint64_t*) const {}
};

// Gathered A (a_index set): the producer's Threads threads (the warpgroup's 128, or its first
// 64 where its other warps are an epilogue) copy A rows with 16-byte cp.async (full[s] counts
// their arrivals + the elected thread's expect_tx: PipelineArrivals' producer_count(true,
// Threads); an epilogue stage, their plain arrivals and its expect_tx).
template <class T, int BN, Major BMajor, class Loads = NoEpilogueLoads, int Threads = kProducerThreads, class Cfg>
__device__ void produce(const GroupedGemmParams& p, const TmaDescriptor& bmap, const StageRing<Cfg>& ring,
                        const Loads& loads = {}) {
  static_assert(Cfg::kBlockN == BN, "the ring's tile width");
  constexpr int kRowStep = Threads / 8, kRows = kBlockM / kRowStep;  // a thread's rows of a tile
  const int t = threadIdx.x;  // 0..Threads - 1
  const T* A = static_cast<const T*>(p.a);
  const int num_kb = (p.k + kBlockK - 1) / kBlockK;
  const PersistentTileScheduler<GroupedTiles> sched({p.sched, column_blocks(p.n, p.gated, BN)});
  const int a_chunk = t & 7, a_row = t >> 3;  // A: rows a_row + kRowStep i, chunk a_chunk
  typename StageRing<Cfg>::State st;
  for (const TileWork w : sched.walk()) {
    const TileCoord tc = sched.decode(w);
    // The tile's source rows of this thread: all loads first, then the checks, so the loads
    // overlap instead of each check waiting for its own L2 round trip.
    int32_t src_row[kRows];
#pragma unroll
    for (int i = 0; i < kRows; ++i) {
      const int r = a_row + kRowStep * i;
      src_row[i] = r >= tc.rows ? -1 : p.a_index ? __ldg(p.a_index + tc.row0 + r) : tc.row0 + r;
    }
#pragma unroll
    for (int i = 0; i < kRows; ++i)
      if (src_row[i] >= p.a_rows) src_row[i] = -1;  // negative stays negative: a zero row
    wait_rows(p.arrival, src_row);
    // Each row's source at this thread's chunk of the next k-block, and its copy size (0: a
    // zero row, which reads nothing and stays at A): the row's address is computed once a tile
    // and then advanced, so a k-block costs the copies and a 64-bit add per row.
    const char* src[kRows];
    uint32_t bytes[kRows];
#pragma unroll
    for (int i = 0; i < kRows; ++i) {
      bytes[i] = src_row[i] >= 0 ? 16u : 0u;
      src[i] = reinterpret_cast<const char*>(src_row[i] >= 0 ? A + static_cast<int64_t>(src_row[i]) * p.lda + a_chunk * 8 : A);
    }
    constexpr uint32_t kStepPer16 = kBlockK * sizeof(T) / 16;  // a k-block's bytes per 16 copied
    for (int kb = 0; kb < num_kb; ++kb, st.advance()) {
      ring.pipe.acquire(st);
      const uint32_t a_dst = ring.stage_addr(st);
      const int32_t k0 = kb * kBlockK;
      if (k0 + a_chunk * 8 < p.k) {
#pragma unroll
        for (int i = 0; i < kRows; ++i) cp_async_16(a_dst + sw128_offset(a_row + kRowStep * i, a_chunk), src[i], bytes[i]);
      } else {  // this chunk is past K (the last k-block of a K that is not a multiple of 64)
#pragma unroll
        for (int i = 0; i < kRows; ++i) cp_async_16(a_dst + sw128_offset(a_row + kRowStep * i, a_chunk), A, 0u);
      }
#pragma unroll
      for (int i = 0; i < kRows; ++i) src[i] += bytes[i] * kStepPer16;
      if (t == 0) {
        // Slot j's readers of kTileSlots tiles ago are done: they read it before starting their
        // next tile, and this stage's acquire waited for a release in that tile or later
        // (TileConfig: kTileSlots - 1 >= kStages).
        if (kb == 0) ring.tiles[w.j % kTileSlots] = tc;
        ring.pipe.arrive_expect_tx(st, Cfg::kBBytes);
        issue_b<BN, BMajor>(p, bmap, ring.stage_ptr(st) + Cfg::kABytes, ring.pipe.full_barrier(st), tc, k0);
      }
      ring.pipe.arrive_cp_async(st);
    }
    for (int q = 0; q < loads.stages(); ++q, st.advance()) {
      ring.pipe.acquire(st);
      if (t == 0) {
        ring.pipe.arrive_expect_tx(st, uint32_t{Loads::kBytes});
        loads.issue(q, ring.stage_ptr(st), tc, ring.pipe.full_barrier(st));
      }
      ring.pipe.arrive(st);
    }
  }
}

// A in expert order (no a_index): one producer warp, whose lane 0 loads A by TMA as two boxes
// of 64 rows x 128 bytes per stage, beside B (full[s] counts that thread's one expect_tx
// arrival: producer_count(false)). A partial tile's rows past its expert read the next
// expert's rows, or zeros past a_rows (TMA's bounds): those accumulator rows are never stored,
// and every row outside [0, a_rows) stays unread. The other producer warps have nothing to do
// and leave.
template <class T, int BN, Major BMajor, class Loads = NoEpilogueLoads, class Cfg>
__device__ void produce_tma_a(const GroupedGemmParams& p, const TmaDescriptor& amap, const TmaDescriptor& bmap,
                              const StageRing<Cfg>& ring, const Loads& loads = {}) {
  static_assert(Cfg::kBlockN == BN, "the ring's tile width");
  if (threadIdx.x >= 32) return;
  const bool leader = threadIdx.x == 0;
  const int num_kb = (p.k + kBlockK - 1) / kBlockK;
  const PersistentTileScheduler<GroupedTiles> sched({p.sched, column_blocks(p.n, p.gated, BN)});
  typename StageRing<Cfg>::State st;
  for (const TileWork w : sched.walk()) {
    const TileCoord tc = sched.decode(w);
    if (leader) {
      using namespace cuda::ptx;
      for (int kb = 0; kb < num_kb; ++kb, st.advance()) {
        ring.pipe.acquire(st);
        const int32_t k0 = kb * kBlockK;
        if (kb == 0) ring.tiles[w.j % kTileSlots] = tc;  // as in produce()
        ring.pipe.arrive_expect_tx(st, Cfg::kABytes + Cfg::kBBytes);
        uint8_t* a_ptr = ring.stage_ptr(st);
#pragma unroll
        for (int h = 0; h < kBlockM / 64; ++h) {
          const int32_t c[2] = {k0, tc.row0 + 64 * h};
          cp_async_bulk_tensor(space_cluster, space_global, a_ptr + h * (64 * 128), &amap, c, ring.pipe.full_barrier(st));
        }
        issue_b<BN, BMajor>(p, bmap, a_ptr + Cfg::kABytes, ring.pipe.full_barrier(st), tc, k0);
      }
      for (int q = 0; q < loads.stages(); ++q, st.advance()) {
        ring.pipe.acquire(st);
        ring.pipe.arrive_expect_tx(st, uint32_t{Loads::kBytes});
        loads.issue(q, ring.stage_ptr(st), tc, ring.pipe.full_barrier(st));
      }
    }
    __syncwarp();
  }
}

// One consumer warpgroup's share of a tile: Frags fragments of 64 rows, rows [64 (frag0 + f),
// 64 (frag0 + f) + 64) x BN columns, accumulated over K into acc[f] (wgmma m64nBN fragments).
// Cooperative: Frags = 1, frag0 = the warpgroup (two warpgroups share a tile); ping-pong:
// Frags = 2, frag0 = 0 (a warpgroup owns a whole tile). st is the warpgroup's pipeline state,
// carried across tiles. A's stage is [128 rows][64 k] K-major (the varlen-M gathers), or
// [2][64 k][64 rows] MN-major (the weight gradients, whose reduction runs over positions);
// either way a fragment's 64 rows start 8 KB after the previous one's. on_first() runs once the
// tile's first stage is full, before any stage is released (the moment to read the tile's slot).
// after_issue(kb) runs once k-block kb's MMAs have been issued, while they run (the deferred
// store epilogue's moment, gemm/sm90/epilogue_deferred.cuh).
struct NoTileInfo {
  __device__ void operator()() const {}
};
struct NoIssueHook {
  __device__ void operator()(int) const {}
};
template <class T, int BN, Major BMajor, Major AMajor = Major::kK, int Frags = 1, class OnFirst = NoTileInfo,
          class AfterIssue = NoIssueHook, class Cfg>
__device__ __forceinline__ void consume_tile(const StageRing<Cfg>& ring, int frag0, int num_kb,
                                             typename StageRing<Cfg>::State& st, float (&acc)[Frags][BN / 2],
                                             OnFirst&& on_first = {}, AfterIssue&& after_issue = {}) {
  static_assert(Cfg::kBlockN == BN, "the ring's tile width");
  constexpr int kTransA = AMajor == Major::kMN ? 1 : 0;
  using Mma = Wgmma<T, BN, kTransA, 0>;   // B K-major
  using MmaT = Wgmma<T, BN, kTransA, 1>;  // B MN-major
  if (num_kb == 0) {  // K = 0: the product is zero
#pragma unroll
    for (int f = 0; f < Frags; ++f)
#pragma unroll
      for (int i = 0; i < BN / 2; ++i) acc[f][i] = 0.f;
  }
  typename StageRing<Cfg>::State prev;
  for (int kb = 0; kb < num_kb; ++kb, st.advance()) {
    ring.pipe.wait(st);
    if (kb == 0) on_first();
    const uint32_t stage = ring.stage_addr(st), a0 = stage + frag0 * (64 * 128), b = stage + Cfg::kABytes;
    // The stage's first descriptors; a k-step moves 16 rows (MN-major) or 32 bytes (K-major).
    const uint64_t da0 = AMajor == Major::kMN ? sw128_desc(a0, kBlockK * 128, 1024) : sw128_desc(a0, 16, 1024);
    const uint64_t db0 = BMajor == Major::kMN ? sw128_desc(b, kBlockK * 128, 1024) : sw128_desc(b, 16, 1024);
    constexpr uint32_t kStepA = AMajor == Major::kMN ? 16 * 128 : 32, kStepB = BMajor == Major::kMN ? 16 * 128 : 32;
#pragma unroll
    for (int f = 0; f < Frags; ++f) fence_accumulators(acc[f]);
    wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < kBlockK / 16; ++kk) {
      const int accumulate = (kb | kk) != 0;
      const uint64_t db = desc_advance(db0, kk * kStepB);
#pragma unroll
      for (int f = 0; f < Frags; ++f) {
        const uint64_t da = desc_advance(da0, f * (64 * 128) + kk * kStepA);
        if constexpr (BMajor == Major::kMN) MmaT::mma(acc[f], da, db, accumulate);
        else Mma::mma(acc[f], da, db, accumulate);
      }
    }
    wgmma_commit();
#pragma unroll
    for (int f = 0; f < Frags; ++f) fence_accumulators(acc[f]);
    after_issue(kb);
    if (kb > 0) {  // the previous stage's MMAs are done: hand it back
      wgmma_wait<1>();
      ring.pipe.release(prev);
    }
    prev = st;
  }
  wgmma_wait<0>();
  if (num_kb > 0) ring.pipe.release(prev);
#pragma unroll
  for (int f = 0; f < Frags; ++f) fence_accumulators(acc[f]);
}

}  // namespace sm90
}  // namespace gemm
}  // namespace v0
}  // namespace moeblaze
