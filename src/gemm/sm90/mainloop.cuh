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

#include "gemm/grouped_tiles.hpp"
#include "gemm/sm90/params.hpp"
#include "gemm/sm90/ptx.cuh"
#include "gemm/sm90/tile_config.hpp"
#include "gemm/sm90/wgmma.cuh"

namespace moeblaze {
inline namespace v0 {
namespace gemm {
namespace sm90 {

template <int Stages>
struct StageRing {
  static constexpr int kStages = Stages;
  uint8_t* ptr;     // stage 0 (1024-byte aligned), generic address
  uint32_t base;    // the same, shared address
  uint64_t* full;   // [stages]
  uint64_t* empty;  // [stages]
  uint64_t* turn;   // [2] ping-pong: warpgroup w may start its next tile's MMAs when turn[w] completes
  uint8_t* staging; // the epilogue's staging boxes (TileConfig::kStagingBytes, 1024-byte aligned)
  TileCoord* tiles; // [kTileSlots] the CTA's j-th tile's coordinates in slot j % kTileSlots
  uint32_t release; // the arrivals on empty[s] that a consumer warp's lane 0 makes for its warp
};

// Carves the ring from the dynamic shared memory (Cfg::kSmemBytes, Cfg a TileConfig) and
// initialises its barriers: full[s] expects full_arrivals arrivals, empty[s] empty_arrivals
// warps' (lane 0 of each consumer warp that reads a stage, arriving `release` times), turn[w]
// one. release = 32 counts threads, so that a stage whose bytes every consumer thread read
// (an epilogue's loads) can be released by each thread's own arrival: compute-sanitizer's
// racecheck orders a thread's accesses before the producer's refill only through that
// thread's arrival. Every thread of the block calls it (it ends with a block barrier).
template <class Cfg, int S = Cfg::kStages>
__device__ __forceinline__ StageRing<S> init_ring(uint8_t* smem_raw, uint32_t full_arrivals, uint32_t empty_arrivals = 8,
                                                  uint32_t release = 1) {
  uint8_t* smem = reinterpret_cast<uint8_t*>((reinterpret_cast<uintptr_t>(smem_raw) + 1023) & ~uintptr_t(1023));
  StageRing<S> ring;
  ring.ptr = smem;
  ring.base = smem_addr(smem);
  ring.staging = smem + S * Cfg::kStageBytes;
  ring.full = reinterpret_cast<uint64_t*>(ring.staging + Cfg::kStagingBytes);
  ring.empty = ring.full + S;
  ring.turn = ring.empty + S;
  ring.tiles = reinterpret_cast<TileCoord*>(ring.turn + 2);
  ring.release = release;
  static_assert(sizeof(TileCoord) == kTileSlotBytes, "TileConfig sizes the tile slots");
  static_assert((2 * S + 2) * 8 % 16 == 0, "the tile slots are 16-byte aligned (read_tile_slot)");
  if (threadIdx.x == 0) {
    for (int s = 0; s < S; ++s) {
      cuda::ptx::mbarrier_init(&ring.full[s], full_arrivals);
      cuda::ptx::mbarrier_init(&ring.empty[s], empty_arrivals * release);
    }
    cuda::ptx::mbarrier_init(&ring.turn[0], 1);
    cuda::ptx::mbarrier_init(&ring.turn[1], 1);
    cuda::ptx::fence_mbarrier_init(cuda::ptx::sem_release, cuda::ptx::scope_cluster);
  }
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

// decode_tile (gemm/grouped_tiles.hpp) for a whole warp: the same tile, found by a 32-way search
// (each lane tests one candidate expert, a ballot picks the last whose tiles start at or before
// `work`) in ceil(log32 E) dependent loads instead of log2 E: 2 round trips to L2 for
// E <= 1024, then the expert's offsets. Every lane of the warp calls it.
__device__ __forceinline__ TileCoord decode_tile_warp(int64_t work, const Schedule& sc, int32_t col_blocks) {
  const int32_t* prefix = sc.rb_prefix;
  const int32_t num_experts = sc.num_experts;
  const int lane = threadIdx.x & 31;
  int32_t lo = 0, span = num_experts;  // the answer lies in [lo, lo + span); prefix[lo] * col_blocks <= work
  while (span > 1) {
    const int32_t step = (span + 31) / 32, e = lo + lane * step;
    const bool at_or_before = e < lo + span && static_cast<int64_t>(__ldg(prefix + e)) * col_blocks <= work;
    const int last = 31 - __clz(__ballot_sync(0xffffffffu, at_or_before));  // lane 0's candidate, lo, always holds
    lo += last * step;
    span = min(step, num_experts - lo);
  }
  return expert_tile(work, lo, sc.offsets, prefix, kBlockM, col_blocks, sc.raster_group);
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

// Stage s's B boxes for tile tc, k-block k0, by TMA (the elected producer thread).
template <int BN, Major BMajor, int S>
__device__ __forceinline__ void issue_b(const GroupedGemmParams& p, const TmaDescriptor& bmap, const StageRing<S>& ring,
                                       uint32_t s, const TileCoord& tc, int32_t k0) {
  using namespace cuda::ptx;
  uint8_t* b_ptr = ring.ptr + s * TileConfig<BN>::kStageBytes + TileConfig<BN>::kABytes;
  if constexpr (BMajor == Major::kMN) {  // smem [BN/64 boxes][64 k rows][128 B]
#pragma unroll
    for (int box = 0; box < BN / 64; ++box) {
      const int32_t c[3] = {b_box_start<BN>(p, tc.col_block, box, 64), k0, tc.expert};
      cp_async_bulk_tensor(space_cluster, space_global, b_ptr + box * (kBlockK * 128), &bmap, c, &ring.full[s]);
    }
  } else {  // smem [BN n rows][128 B]: one box of BN rows, or two of BN/2 when gated
    const int boxes = p.gated ? 2 : 1, rows = BN / boxes;
    for (int box = 0; box < boxes; ++box) {
      const int32_t c[3] = {k0, b_box_start<BN>(p, tc.col_block, box, rows), tc.expert};
      cp_async_bulk_tensor(space_cluster, space_global, b_ptr + box * rows * 128, &bmap, c, &ring.full[s]);
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

// Gathered A (a_index set): the producer warpgroup's 128 threads copy A rows with 16-byte
// cp.async (full[s] counts their 128 arrivals + the elected thread's expect_tx; an epilogue
// stage, their plain arrivals and its expect_tx).
template <class T, int BN, Major BMajor, class Loads = NoEpilogueLoads, int S>
__device__ void produce(const GroupedGemmParams& p, const TmaDescriptor& bmap, const StageRing<S>& ring,
                        const Loads& loads = {}) {
  using Cfg = TileConfig<BN>;
  const int t = threadIdx.x;  // 0..127
  const T* A = static_cast<const T*>(p.a);
  const int32_t E = p.sched.num_experts, cb = column_blocks(p.n, p.gated, BN);
  const int num_kb = (p.k + kBlockK - 1) / kBlockK;
  const int64_t total = total_tiles(p.sched.rb_prefix, E, cb);
  const int a_chunk = t & 7, a_row = t >> 3;  // A: rows a_row + 16 i, chunk a_chunk
  uint32_t it = 0, j = 0;
  for (int64_t w = blockIdx.x; w < total; w += gridDim.x, ++j) {
    const TileCoord tc = decode_tile_warp(w, p.sched, cb);
    // The tile's eight source rows per thread: all loads first, then the checks, so the loads
    // overlap instead of each check waiting for its own L2 round trip.
    int32_t src_row[8];
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      const int r = a_row + 16 * i;
      src_row[i] = r >= tc.rows ? -1 : p.a_index ? __ldg(p.a_index + tc.row0 + r) : tc.row0 + r;
    }
#pragma unroll
    for (int i = 0; i < 8; ++i)
      if (src_row[i] >= p.a_rows) src_row[i] = -1;  // negative stays negative: a zero row
    for (int kb = 0; kb < num_kb; ++kb, ++it) {
      const uint32_t s = it % S;
      mbar_wait(&ring.empty[s], ((it / S) & 1) ^ 1);
      const uint32_t a_dst = ring.base + s * Cfg::kStageBytes;
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
      if (t == 0) {
        // Slot j's readers of kTileSlots tiles ago are done: they read it before starting their
        // next tile, and this stage's empty barrier waited for a release in that tile or later
        // (TileConfig: kTileSlots - 1 >= kStages).
        if (kb == 0) ring.tiles[j % kTileSlots] = tc;
        cuda::ptx::mbarrier_arrive_expect_tx(cuda::ptx::sem_release, cuda::ptx::scope_cta, cuda::ptx::space_shared,
                                             &ring.full[s], Cfg::kBBytes);
        issue_b<BN, BMajor>(p, bmap, ring, s, tc, k0);
      }
      cuda::ptx::cp_async_mbarrier_arrive_noinc(&ring.full[s]);
    }
    for (int q = 0; q < loads.stages(); ++q, ++it) {
      const uint32_t s = it % S;
      mbar_wait(&ring.empty[s], ((it / S) & 1) ^ 1);
      if (t == 0) {
        cuda::ptx::mbarrier_arrive_expect_tx(cuda::ptx::sem_release, cuda::ptx::scope_cta, cuda::ptx::space_shared,
                                             &ring.full[s], uint32_t{Loads::kBytes});
        loads.issue(q, ring.ptr + s * Cfg::kStageBytes, tc, &ring.full[s]);
      }
      cuda::ptx::mbarrier_arrive(&ring.full[s]);
    }
  }
}

// A in expert order (no a_index): one producer warp, whose lane 0 loads A by TMA as two boxes
// of 64 rows x 128 bytes per stage, beside B (full[s] counts that thread's one expect_tx
// arrival). A partial tile's rows past its expert read the next expert's rows, or zeros past
// a_rows (TMA's bounds): those accumulator rows are never stored, and every row outside
// [0, a_rows) stays unread. The other producer warps have nothing to do and leave.
template <class T, int BN, Major BMajor, class Loads = NoEpilogueLoads, int S>
__device__ void produce_tma_a(const GroupedGemmParams& p, const TmaDescriptor& amap, const TmaDescriptor& bmap,
                              const StageRing<S>& ring, const Loads& loads = {}) {
  using Cfg = TileConfig<BN>;
  if (threadIdx.x >= 32) return;
  const bool leader = threadIdx.x == 0;
  const int32_t E = p.sched.num_experts, cb = column_blocks(p.n, p.gated, BN);
  const int num_kb = (p.k + kBlockK - 1) / kBlockK;
  const int64_t total = total_tiles(p.sched.rb_prefix, E, cb);
  uint32_t it = 0, j = 0;
  for (int64_t w = blockIdx.x; w < total; w += gridDim.x, ++j) {
    const TileCoord tc = decode_tile_warp(w, p.sched, cb);
    if (leader) {
      using namespace cuda::ptx;
      for (int kb = 0; kb < num_kb; ++kb, ++it) {
        const uint32_t s = it % S;
        mbar_wait(&ring.empty[s], ((it / S) & 1) ^ 1);
        const int32_t k0 = kb * kBlockK;
        if (kb == 0) ring.tiles[j % kTileSlots] = tc;  // as in produce()
        mbarrier_arrive_expect_tx(sem_release, scope_cta, space_shared, &ring.full[s], Cfg::kABytes + Cfg::kBBytes);
        uint8_t* a_ptr = ring.ptr + s * Cfg::kStageBytes;
#pragma unroll
        for (int h = 0; h < kBlockM / 64; ++h) {
          const int32_t c[2] = {k0, tc.row0 + 64 * h};
          cp_async_bulk_tensor(space_cluster, space_global, a_ptr + h * (64 * 128), &amap, c, &ring.full[s]);
        }
        issue_b<BN, BMajor>(p, bmap, ring, s, tc, k0);
      }
      for (int q = 0; q < loads.stages(); ++q, ++it) {
        const uint32_t s = it % S;
        mbar_wait(&ring.empty[s], ((it / S) & 1) ^ 1);
        mbarrier_arrive_expect_tx(sem_release, scope_cta, space_shared, &ring.full[s], uint32_t{Loads::kBytes});
        loads.issue(q, ring.ptr + s * Cfg::kStageBytes, tc, &ring.full[s]);
      }
    }
    __syncwarp();
  }
}

// One consumer warpgroup's share of a tile: Frags fragments of 64 rows, rows [64 (frag0 + f),
// 64 (frag0 + f) + 64) x BN columns, accumulated over K into acc[f] (wgmma m64nBN fragments).
// Cooperative: Frags = 1, frag0 = the warpgroup (two warpgroups share a tile); ping-pong:
// Frags = 2, frag0 = 0 (a warpgroup owns a whole tile). `it` is the ring position, carried
// across tiles. A's stage is [128 rows][64 k] K-major (the varlen-M gathers), or
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
          class AfterIssue = NoIssueHook, int S>
__device__ __forceinline__ void consume_tile(const StageRing<S>& ring, int frag0, int num_kb, uint32_t& it,
                                             float (&acc)[Frags][BN / 2], OnFirst&& on_first = {},
                                             AfterIssue&& after_issue = {}) {
  using Cfg = TileConfig<BN>;
  constexpr int kTransA = AMajor == Major::kMN ? 1 : 0;
  using Mma = Wgmma<T, BN, kTransA, 0>;   // B K-major
  using MmaT = Wgmma<T, BN, kTransA, 1>;  // B MN-major
  const bool lane0 = (threadIdx.x & 31) == 0;
  if (num_kb == 0) {  // K = 0: the product is zero
#pragma unroll
    for (int f = 0; f < Frags; ++f)
#pragma unroll
      for (int i = 0; i < BN / 2; ++i) acc[f][i] = 0.f;
  }
  uint32_t prev = 0;
  for (int kb = 0; kb < num_kb; ++kb, ++it) {
    const uint32_t s = it % S;
    mbar_wait(&ring.full[s], (it / S) & 1);
    if (kb == 0) on_first();
    const uint32_t a0 = ring.base + s * Cfg::kStageBytes + frag0 * (64 * 128), b = ring.base + s * Cfg::kStageBytes + Cfg::kABytes;
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
      if (lane0) cuda::ptx::mbarrier_arrive(&ring.empty[prev], ring.release);
    }
    prev = s;
  }
  wgmma_wait<0>();
  if (num_kb > 0 && lane0) cuda::ptx::mbarrier_arrive(&ring.empty[prev], ring.release);
#pragma unroll
  for (int f = 0; f < Frags; ++f) fence_accumulators(acc[f]);
}

}  // namespace sm90
}  // namespace gemm
}  // namespace v0
}  // namespace moeblaze
