// The activation backward in the dact GEMM's epilogue (EpilogueKind::kActivationBackward,
// gemm/sm90/params.hpp says what it computes), on the cooperative tiles (each consumer warpgroup
// one 64-row fragment of BN columns). The saved pre comes through the operand ring: after a
// tile's k-blocks the producer loads it by TMA into pre_stages(BN, gated) further stages
// (PreLoads), issued a few k-blocks before the consumers get there, each of four 64 x 64 boxes
// at 8 KB (2 f + j) for fragment f: plain (ReLU, GELU, SiLU), j = the column box of the stage's
// 128 columns; gated (SwiGLU, GeGLU), the gate (j = 0) and up (j = 1) boxes of the stage's 64
// columns. The epilogue reads each thread's pairs from its boxes (ldmatrix, in the
// accumulators' layout), writes dpre back in place (stmatrix, the same swizzled positions) and
// stores those boxes by TMA from there, g * act through the staging boxes, then releases the
// stage once its stores have read it. dact never reaches memory. The plain ones once
// ran on ping-pong 128 x 128 tiles with a 32 KB pre slot per warpgroup (the ping-pong mainloop
// held it near half the tensor pipe, perf/NOTES.md), and the gated ones, which
// need twice the bytes, in a separate pass.
#pragma once

#include <cuda/ptx>

#include <climits>

#include "math/activation.hpp"
#include "gemm/sm90/epilogue.cuh"
#include "gemm/sm90/mainloop.cuh"

namespace moeblaze {
inline namespace v0 {
namespace gemm {
namespace sm90 {

__device__ __forceinline__ int32_t clamp_i32(int64_t v) {
  return static_cast<int32_t>(v < INT32_MIN ? INT32_MIN : v > INT32_MAX ? INT32_MAX : v);
}

// The producer's loads of a tile's pre (mainloop.cuh's Loads): stage q holds columns
// [128 q, 128 q + 128) of the tile, or, gated, the gate and up halves of columns [64 q, 64 q + 64)
// (pre_load is then pre's [rows][2][n] map). A box reaching past pre's rows or past n is
// zero-filled by TMA, whatever the placed row (a bad plan's included): nothing outside pre is
// read, and every box counts its full bytes.
template <int BN>
struct PreLoads {
  static constexpr uint32_t kBytes = 4 * kPreBoxBytes;
  const GroupedGemmParams& p;
  const EpilogueParams& e;
  const EpilogueMaps& maps;
  __device__ __forceinline__ int stages() const { return pre_stages(BN, is_gated(e.activation)); }
  __device__ __forceinline__ void issue(int q, uint8_t* stage, const TileCoord& tc, uint64_t* bar) const {
    using namespace cuda::ptx;
    const bool gated = is_gated(e.activation);
    const int32_t col = tc.col_block * BN + (gated ? 64 : kActBackwardBlockN) * q;
#pragma unroll
    for (int f = 0; f < 2; ++f) {
      const int32_t row = clamp_i32(placed_row(p, e.pre_expert_row, tc, tc.row0 + 64 * f));
#pragma unroll
      for (int j = 0; j < 2; ++j) {
        uint8_t* box = stage + (2 * f + j) * kPreBoxBytes;
        if (gated) {
          const int32_t c[3] = {col, j, row};
          cp_async_bulk_tensor(space_cluster, space_global, box, &maps.pre_load, c, bar);
        } else {
          const int32_t c[2] = {col + 64 * j, row};
          cp_async_bulk_tensor(space_cluster, space_global, box, &maps.pre_load, c, bar);
        }
      }
    }
  }
};

// One packed pair of the backward: in, the dact pair (rounded to the dtype, as the separate pass
// reads it; or its fp32 accumulators), the pre pair and, gated (act = f(gate) up), the up pair;
// out, the packed dpre pair (gated: d gate, then d up) and g act pair, and da act added to dot.
// The products are act_backward's, as in the separate pass (experts/expert_cuda.cu); the
// rounding is one pack per pair (perf/NOTES.md).
template <class T, Activation A>
struct BackwardPair {
  uint32_t dpre[2], gact;
  __device__ __forceinline__ BackwardPair(float a0, float a1, uint32_t pre, uint32_t up, float g, bool valid, float& dot)
      : BackwardPair(Elem<T>::pack2(a0, a1), pre, up, g, valid, dot) {}
  __device__ __forceinline__ BackwardPair(uint32_t dact, uint32_t pre, uint32_t up, float g, bool valid, float& dot) {
    const float2 da = Elem<T>::unpack2(dact);
    const float2 u = Elem<T>::unpack2(pre);
    const float2 b = is_gated(A) ? Elem<T>::unpack2(up) : make_float2(0.f, 0.f);
    const ActBackward v0 = act_backward<A>(u.x, b.x, g * da.x), v1 = act_backward<A>(u.y, b.y, g * da.y);
    const float2 act = Elem<T>::unpack2(Elem<T>::pack2(v0.act, v1.act));
    dpre[0] = Elem<T>::pack2(v0.du, v1.du);
    dpre[1] = is_gated(A) ? Elem<T>::pack2(v0.db, v1.db) : 0u;
    if (valid) dot += da.x * act.x + da.y * act.y;
    gact = Elem<T>::pack2(g * act.x, g * act.y);
  }
};

// Column box cb of fragment frag, its pre (gated: gate, and up kPreBoxBytes after it) landed at
// `box`: dpre (gated: both halves) and g act, staged (Staged: a full tile and TMA-addressable
// outputs) or from registers; its da act sums go to dot.
template <class T, Activation A, int BN, bool Staged>
__device__ __forceinline__ void act_backward_box(const GroupedGemmParams& p, const EpilogueParams& e,
                                                 const EpilogueMaps& maps, TileStore& ts, const TileCoord& tc, int frag,
                                                 int cb, const RowScales& gate, uint32_t box,
                                                 const float (&acc)[BN / 2], float (&dot)[2]) {
  constexpr int kIn = is_gated(A) ? 2 : 1;  // input boxes (pre; or gate and up), each written back as dpre's half
  const int lane = threadIdx.x & 31, warp = (threadIdx.x / 32) & 3;
  const int32_t col0 = tc.col_block * BN, cols = p.n - col0, row = tc.row0 + 64 * frag;
  const int rr = 16 * warp + lane / 4;  // the thread's first row in the fragment (+ 8: its second)
  if (64 * cb >= cols) return;
  // Pair (g, half): columns 64 cb + 8 g + 2 (lane % 4), +1 and row rr + 8 half of the fragment,
  // at the same offset in the input boxes, the staged boxes and (in place) the dpre boxes.
  auto offset = [&](int g, int half) { return sw128_offset(rr + 8 * half, g) + 4 * (lane & 3); };
  auto pair = [&](int g, int half, uint32_t pre, uint32_t up) {
    const int q = staged_acc(cb, g, half);
    const bool valid = 64 * cb + 8 * g + 2 * (lane & 3) < cols && (Staged || 64 * frag + rr + 8 * half < tc.rows);
    return BackwardPair<T, A>(acc[q], acc[q + 1], pre, up, gate.v[half], valid, dot[half]);
  };
  if constexpr (Staged) {
    // The boxes' pairs by ldmatrix, as independent chains, dpre back in place by stmatrix: 8
    // shared-memory instructions per box instead of 32, and no load -> math -> store chain per
    // pair (shared-memory accesses are ordered asm); ~1% on the dact GEMM (perf/NOTES.md, step
    // 20). Gated, two column groups at a time: all sixteen pairs' gate and up inputs beside the
    // 128 accumulators would spill.
    constexpr int kChunk = is_gated(A) ? 2 : 8;
    uint32_t gact[8][2];
#pragma unroll
    for (int g0 = 0; g0 < 8; g0 += kChunk) {
      uint32_t v[kIn][kChunk][2];
#pragma unroll
      for (int j = 0; j < kIn; ++j)
#pragma unroll
        for (int g = 0; g < kChunk; g += 2)
          ldmatrix_x4(box_matrices(box + j * kPreBoxBytes, g0 + g), v[j][g][0], v[j][g][1], v[j][g + 1][0],
                      v[j][g + 1][1]);
#pragma unroll
      for (int g = 0; g < kChunk; ++g)
#pragma unroll
        for (int half = 0; half < 2; ++half) {
          const BackwardPair<T, A> r = pair(g0 + g, half, v[0][g][half], v[kIn - 1][g][half]);
#pragma unroll
          for (int j = 0; j < kIn; ++j) v[j][g][half] = r.dpre[j];
          gact[g0 + g][half] = r.gact;
        }
#pragma unroll
      for (int j = 0; j < kIn; ++j)
#pragma unroll
        for (int g = 0; g < kChunk; g += 2)
          stmatrix_x4(box_matrices(box + j * kPreBoxBytes, g0 + g), v[j][g][0], v[j][g][1], v[j][g + 1][0],
                      v[j][g + 1][1]);
    }
    ts.box(maps.out, {col0 + 64 * cb, row}, [&](int g, int half) { return gact[g][half]; });
    // ts.box fenced every thread's writes (the dpre ones too) and synced the warpgroup.
    if (ts.leader) {
#pragma unroll
      for (int j = 0; j < kIn; ++j) {
        const uint8_t* src = reinterpret_cast<const uint8_t*>(__cvta_shared_to_generic(box + j * kPreBoxBytes));
        if constexpr (kIn == 2) {  // dpre [rows][2][n]: the gate half, then the up half
          const int32_t c[3] = {col0 + 64 * cb, j, row};
          cuda::ptx::cp_async_bulk_tensor(cuda::ptx::space_global, cuda::ptx::space_shared, &maps.pre, c, src);
        } else {
          const int32_t c[2] = {col0 + 64 * cb, row};
          cuda::ptx::cp_async_bulk_tensor(cuda::ptx::space_global, cuda::ptx::space_shared, &maps.pre, c, src);
        }
      }
      cuda::ptx::cp_async_bulk_commit_group();
    }
  } else {
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const int r = 64 * frag + rr + 8 * half;
      T* d = static_cast<T*>(e.c) + static_cast<int64_t>(tc.row0 + r) * e.ldc + col0;
      T* a = static_cast<T*>(e.act) + static_cast<int64_t>(tc.row0 + r) * e.ld_act + col0;
#pragma unroll
      for (int g = 0; g < 8; ++g) {
        const int c = 64 * cb + 8 * g + 2 * (lane & 3);
        const uint32_t pre = ld_shared_b32(box + offset(g, half));
        const BackwardPair<T, A> v = pair(g, half, pre, kIn == 2 ? ld_shared_b32(box + kPreBoxBytes + offset(g, half)) : 0u);
        if (r < tc.rows && c < cols) {
#pragma unroll
          for (int j = 0; j < kIn; ++j) *reinterpret_cast<uint32_t*>(d + j * p.n + c) = v.dpre[j];
          *reinterpret_cast<uint32_t*>(a + c) = v.gact;
        }
      }
    }
  }
}

// A fragment's rows' dg partial sums of column block `part`: the quad's four lanes hold a row's
// columns; lane 0 of the quad writes the row's sum.
__device__ __forceinline__ void store_dg(const EpilogueParams& e, const TileCoord& tc, int frag, int32_t part,
                                         const float (&dot)[2]) {
  const int lane = threadIdx.x & 31, rr = 16 * ((threadIdx.x / 32) & 3) + lane / 4;
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    float v = dot[half];
    v += __shfl_xor_sync(0xffffffffu, v, 1);
    v += __shfl_xor_sync(0xffffffffu, v, 2);
    const int r = 64 * frag + rr + 8 * half;
    if ((lane & 3) == 0 && r < tc.rows) e.dg[part * e.ld_dg + tc.row0 + r] = v;
  }
}

// A consumer warpgroup's fragment of the tile, after its MMAs: the tile's pre stages in ring
// order (st moves past them), each released by every thread's own arrival (the ring counts
// threads: PipelineArrivals' per_warp = 32) once its reads and writes of the boxes are done; the
// leader's waits for its stores to have read them.
template <class T, Activation A, int BN>
__device__ __forceinline__ void act_backward_fragment_as(const GroupedGemmParams& p, const EpilogueParams& e,
                                                         const EpilogueMaps& maps, TileStore& ts,
                                                         const StageRing<TileConfig<BN>>& ring,
                                                         typename StageRing<TileConfig<BN>>::State& st, const TileCoord& tc,
                                                         int frag, const RowScales& gate, const float (&acc)[BN / 2]) {
  constexpr bool kGated = is_gated(A);
  constexpr int kPerPart = kGated ? 2 : 1;  // stages per kActBackwardBlockN columns (one dg part)
  const bool staged = tile_staged(maps, tc);
  const int32_t cols = p.n - tc.col_block * BN;
  float dot[2] = {0.f, 0.f};
#pragma unroll
  for (int q = 0; q < pre_stages(BN, kGated); ++q, st.advance()) {
    ring.pipe.wait(st);
    const uint32_t boxes = ring.stage_addr(st) + 2 * frag * kPreBoxBytes;
    // Column boxes per stage: two of a plain pre, one of gate and up.
    constexpr int kBoxes = kGated ? 1 : 2;
#pragma unroll
    for (int b = 0; b < kBoxes; ++b) {
      const uint32_t box = boxes + b * kPreBoxBytes;
      if (staged) act_backward_box<T, A, BN, true>(p, e, maps, ts, tc, frag, kBoxes * q + b, gate, box, acc, dot);
      else act_backward_box<T, A, BN, false>(p, e, maps, ts, tc, frag, kBoxes * q + b, gate, box, acc, dot);
    }
    if (q % kPerPart == kPerPart - 1) {
      const int part = q / kPerPart;
      if (kActBackwardBlockN * part < cols) store_dg(e, tc, frag, tc.col_block * (BN / kActBackwardBlockN) + part, dot);
      dot[0] = dot[1] = 0.f;
    }
    if (staged && ts.leader) cuda::ptx::cp_async_bulk_wait_group_read(cuda::ptx::n32_t<0>{});
    ring.pipe.release_thread(st);
  }
}

template <class T, int BN>
__device__ __forceinline__ void act_backward_fragment(const GroupedGemmParams& p, const EpilogueParams& e,
                                                      const EpilogueMaps& maps, TileStore& ts,
                                                      const StageRing<TileConfig<BN>>& ring,
                                                      typename StageRing<TileConfig<BN>>::State& st, const TileCoord& tc, int frag,
                                                      const RowScales& gate, const float (&acc)[BN / 2]) {
  with_activation(e.activation, [&](auto a) {
    act_backward_fragment_as<T, decltype(a)::value, BN>(p, e, maps, ts, ring, st, tc, frag, gate, acc);
  });
}

}  // namespace sm90
}  // namespace gemm
}  // namespace v0
}  // namespace moeblaze
