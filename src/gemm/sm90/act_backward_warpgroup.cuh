// The activation backward on epilogue warps (EpilogueKind::kActivationBackward,
// ConsumerSchedule::kEpilogueWarpgroup; gemm/sm90/params.hpp says what it computes). The two
// consumer warpgroups run the dact GEMM's cooperative 128 x 256 tiles; after a tile's MMAs they
// round its dact to the dtype (as the separate pass reads it) into the staging area (64 KB, four
// 128-byte-swizzled boxes of 128 rows x 64 columns), hand it over through the ring's hand-off
// (a one-slot pipeline) and go on to the next tile's MMAs. Two epilogue warps (the producer
// warpgroup's last two: tile_config.hpp says why not a warpgroup of their own) read the saved
// pre from global memory (prefetched into L2 as soon as they turn to the tile), compute dpre, g act and
// the dg partial sums, store them with 16-byte stores and free the slot. So the epilogue's
// 320 KB a tile move under the next tile's MMAs instead of holding the tensor cores idle, and
// the ring keeps its operand stages (the in-ring epilogue, gemm/sm90/epilogue_act_backward.cuh,
// loads pre into ring stages that the next tile's k-blocks then wait for).
#pragma once

#include <cstdint>

#include "math/activation.hpp"
#include "gemm/sm90/epilogue.cuh"
#include "gemm/sm90/epilogue_act_backward.cuh"
#include "gemm/sm90/epilogue_tma.cuh"
#include "gemm/sm90/mainloop.cuh"
#include "gemm/sm90/pipeline.cuh"
#include "gemm/sm90/tile_scheduler.cuh"
#include "util/vec8.cuh"

namespace moeblaze {
inline namespace v0 {
namespace gemm {
namespace sm90 {

// The hand-off's arrivals: every consumer thread fills the slot with its own writes; every
// epilogue thread frees it after its own reads (each thread's arrival orders its accesses for
// compute-sanitizer's racecheck).
__device__ __forceinline__ PipelineArrivals act_backward_handoff() { return {256, kActBackwardEpilogueThreads / 32, 32}; }

// Bytes of one staged box of the hand-off: 128 rows x 64 columns.
constexpr uint32_t kHandoffBoxBytes = kBlockM * 128;

// A consumer warpgroup's fragment `frag` of the tile's dact into the hand-off slot, once the
// epilogue warps have freed it: box b holds columns [64 b, 64 b + 64), fragment f its rows
// [64 f, 64 f + 64).
template <class T, int BN, class Cfg>
__device__ __forceinline__ void hand_off_dact(const StageRing<Cfg>& ring, PipelineState<1>& hs, int frag,
                                              const float (&acc)[BN / 2]) {
  ring.handoff.acquire(hs);
  const uint32_t slot = smem_addr(ring.staging) + frag * (64 * 128);
#pragma unroll
  for (int b = 0; b < BN / 64; ++b)
    write_box(slot + b * kHandoffBoxBytes, [&](int g, int half) {
      const int q = staged_acc(b, g, half);
      return Elem<T>::pack2(acc[q], acc[q + 1]);
    });
  ring.handoff.arrive(hs);
  hs.advance();
}

// 16 bytes of global memory, or zeros where `ok` is false (nothing read).
__device__ __forceinline__ uint4 load16_or_zero(const void* ptr, bool ok) {
  return ok ? __ldg(static_cast<const uint4*>(ptr)) : make_uint4(0u, 0u, 0u, 0u);
}
__device__ __forceinline__ uint32_t word(const uint4& v, int i) { return i == 0 ? v.x : i == 1 ? v.y : i == 2 ? v.z : v.w; }
// The 128-byte lines of [ptr, ptr + bytes) into L2 (a line instruction per thread: the bulk
// prefetch takes its address in a uniform register, so per-thread rows would serialise).
__device__ __forceinline__ void prefetch_l2(const void* ptr, uint32_t bytes) {
  const char* p = static_cast<const char*>(ptr);
  for (uint32_t off = 0; off < bytes; off += 128) asm volatile("prefetch.global.L2 [%0];\n" ::"l"(p + off));
}

// The epilogue warps: for each of the CTA's tiles (the consumers' sequence), its pre rows
// prefetched into L2 before the tile's dact is waited for, then thread t takes rows
// kRowStep i + t / 8 and its 16-byte column chunk t % 8 of each 64-column box: eight threads
// cover a row's 128 bytes of a box (whole lines in global memory, the four rows of a warp one
// wavefront each in the swizzled slot). Two epilogue warps are few for the tile's 128 KB of pre:
// the loads of kBatch row groups are all issued before any is used, so that a thread waits for
// memory once per batch rather than once per box. The dg partial sum of a row and 128-column
// block is reduced over the row's eight threads in a fixed order.
template <class T, Activation A, int BN, class Cfg>
__device__ __forceinline__ void act_backward_warpgroup_as(const GroupedGemmParams& p, const EpilogueParams& e,
                                                          const StageRing<Cfg>& ring) {
  constexpr bool kGated = is_gated(A);
  constexpr int kBoxes = BN / 64, kBoxesPerPart = kActBackwardBlockN / 64;
  constexpr int kRowStep = kActBackwardEpilogueThreads / 8, kBatch = 2;
  const int t = threadIdx.x % 128 - kActBackwardProducerThreads, chunk = t & 7, lane = threadIdx.x & 31;
  const T* pre = static_cast<const T*>(e.pre);
  T* dpre = static_cast<T*>(e.c);
  T* gact = static_cast<T*>(e.act);
  const int64_t pre_rows = e.pre_out_rows ? e.pre_out_rows : p.sched.m_total;
  const PersistentTileScheduler<GroupedTiles> sched({p.sched, column_blocks(p.n, 0, BN)});
  const uint32_t slot = smem_addr(ring.staging);
  PipelineState<1> hs;
  for (const TileWork w : sched.walk()) {
    const TileCoord tc = sched.decode(w);
    const int32_t col0 = tc.col_block * BN, cols = p.n - col0;
    const int64_t placed0 = placed_row(p, e.pre_expert_row, tc, tc.row0);  // pre's row of the tile's row 0
    auto pre_row = [&](int r) {  // the row's pre (gate half), or nullptr outside pre
      const int64_t pr = placed0 + r;
      return r < tc.rows && pr >= 0 && pr < pre_rows ? pre + pr * e.ld_pre + col0 : nullptr;
    };
    for (int r = t; r < kBlockM; r += kActBackwardEpilogueThreads)  // a row's columns of the tile per prefetch
      if (const T* row = pre_row(r)) {
        const uint32_t bytes = static_cast<uint32_t>(min(cols, BN) * sizeof(T));
        prefetch_l2(row, bytes);
        if constexpr (kGated) prefetch_l2(row + p.n, bytes);
      }
    ring.handoff.wait(hs);
#pragma unroll 1
    for (int i0 = 0; i0 < kBlockM / kRowStep; i0 += kBatch) {
      uint4 u[kBatch][kBoxes], b[kBatch][kBoxes];
      float g[kBatch];
#pragma unroll
      for (int k = 0; k < kBatch; ++k) {  // every load of the batch first
        const int r = kRowStep * (i0 + k) + t / 8;
        const T* pr = pre_row(r);
        g[k] = r < tc.rows && e.row_scale ? __ldg(e.row_scale + tc.row0 + r) : 1.f;
#pragma unroll
        for (int box = 0; box < kBoxes; ++box) {
          const int c = 64 * box + 8 * chunk;
          const bool has = pr && c < cols;  // a row outside pre reads as zeros, as TMA's fill
          u[k][box] = load16_or_zero(has ? pr + c : pre, has);
          b[k][box] = kGated ? load16_or_zero(has ? pr + p.n + c : pre, has) : make_uint4(0u, 0u, 0u, 0u);
        }
      }
#pragma unroll
      for (int k = 0; k < kBatch; ++k) {
        const int r = kRowStep * (i0 + k) + t / 8;
        const bool row_ok = r < tc.rows;
        const int64_t pos = tc.row0 + r;
#pragma unroll
        for (int part = 0; part < kBoxes / kBoxesPerPart; ++part) {
          float dot[2] = {0.f, 0.f};
#pragma unroll
          for (int j = 0; j < kBoxesPerPart; ++j) {
            const int box = kBoxesPerPart * part + j, c = 64 * box + 8 * chunk;
            const bool ok = row_ok && c < cols;
            const uint4 da = ld_shared_v4(slot + box * kHandoffBoxBytes + sw128_offset(r, chunk));
            uint32_t d0[4], d1[4], ga[4];
#pragma unroll
            for (int q = 0; q < 4; ++q) {
              const BackwardPair<T, A> v(word(da, q), word(u[k][box], q), word(b[k][box], q), g[k], ok, dot[q & 1]);
              d0[q] = v.dpre[0];
              d1[q] = v.dpre[1];
              ga[q] = v.gact;
            }
            if (ok) {
              T* d = dpre + pos * e.ldc + col0 + c;
              *reinterpret_cast<uint4*>(d) = make_uint4(d0[0], d0[1], d0[2], d0[3]);
              if constexpr (kGated) *reinterpret_cast<uint4*>(d + p.n) = make_uint4(d1[0], d1[1], d1[2], d1[3]);
              *reinterpret_cast<uint4*>(gact + pos * e.ld_act + col0 + c) = make_uint4(ga[0], ga[1], ga[2], ga[3]);
            }
          }
          float v = dot[0] + dot[1];
          v += __shfl_xor_sync(0xffffffffu, v, 1);
          v += __shfl_xor_sync(0xffffffffu, v, 2);
          v += __shfl_xor_sync(0xffffffffu, v, 4);
          if ((lane & 7) == 0 && row_ok && kActBackwardBlockN * part < cols)
            e.dg[(tc.col_block * (BN / kActBackwardBlockN) + part) * e.ld_dg + tc.row0 + r] = v;
        }
      }
    }
    ring.handoff.release_thread(hs);
    hs.advance();
  }
}

template <class T, int BN, class Cfg>
__device__ __forceinline__ void act_backward_warpgroup(const GroupedGemmParams& p, const EpilogueParams& e,
                                                       const StageRing<Cfg>& ring) {
  with_activation(e.activation, [&](auto a) { act_backward_warpgroup_as<T, decltype(a)::value, BN>(p, e, ring); });
}

}  // namespace sm90
}  // namespace gemm
}  // namespace v0
}  // namespace moeblaze
