// The activation backward in the dact GEMM's epilogue (EpilogueKind::kActivationBackward,
// gemm/sm90/params.hpp says what it computes), for the plain activations (ReLU, GELU, SiLU).
// Ping-pong 128 x 128 tiles only (ActBackwardConfig): each consumer warpgroup owns its tile's
// two 64-row fragments and a 32 KB pre slot of four 8 KB boxes (64 rows x 64 columns, one per
// fragment and 64-column half of the tile). While the tile's MMAs run, the warpgroup's leader
// loads the tile's saved pre into the slot by TMA, column half b on barrier pre_full[2 w + b].
// The epilogue reads each thread's pairs from the slot (ldmatrix, in the accumulators' layout),
// writes dpre back in place (stmatrix, the same swizzled positions) and stores those boxes by
// TMA from there, g * act through the staging boxes. dact never reaches memory: the separate
// pass's read and write of it, and that pass, are gone. Gated activations would need twice the
// slot (gate and up) and a reload inside the epilogue; measured slower than the separate pass
// (perf/NOTES.md, step 14), they keep it.
#pragma once

#include <cuda/ptx>

#include <climits>

#include "experts/activation.hpp"
#include "gemm/sm90/epilogue.cuh"
#include "gemm/sm90/mainloop.cuh"

namespace moeblaze {
inline namespace v0 {
namespace gemm {
namespace sm90 {

constexpr int kPreBoxBytes = 64 * 128;  // 64 rows x 64 columns of bf16/fp16

// A consumer warpgroup's pre slot as shared-memory addresses (32-bit: the kernel's registers are
// at their limit): box (frag, b) and column half b's barrier.
struct PreSlot {
  uint32_t boxes, bars;
  __device__ __forceinline__ uint32_t box(int frag, int b) const { return boxes + (2 * frag + b) * kPreBoxBytes; }
  __device__ __forceinline__ uint32_t bar(int b) const { return bars + 8 * b; }
};

__device__ __forceinline__ int32_t clamp_i32(int64_t v) {
  return static_cast<int32_t>(v < INT32_MIN ? INT32_MIN : v > INT32_MAX ? INT32_MAX : v);
}

// The tile's loads, issued by the leader in the mainloop (consume_tile's on_first). The slot is
// free once the previous tile's dpre stores have read it (their issue followed every thread's
// last access of it). A box reaching past pre's rows or past n is zero-filled by TMA, whatever
// the placed row (a bad plan's included): nothing outside pre is read, and every box counts its
// full bytes.
__device__ __forceinline__ void prefetch_pre(const GroupedGemmParams& p, const EpilogueParams& e,
                                             const EpilogueMaps& maps, const TileCoord& tc, const PreSlot& slot) {
  const int32_t col = tc.col_block * kActBackwardBlockN;
  int32_t rows[2];
  for (int f = 0; f < 2; ++f) rows[f] = clamp_i32(placed_row(p, e.pre_expert_row, tc, tc.row0 + 64 * f));
  using namespace cuda::ptx;
  cp_async_bulk_wait_group_read(n32_t<0>{});
  for (int b = 0; b < 2; ++b) {
    uint64_t* bar = static_cast<uint64_t*>(__cvta_shared_to_generic(slot.bar(b)));
    mbarrier_arrive_expect_tx(sem_release, scope_cta, space_shared, bar, 2 * kPreBoxBytes);
    for (int f = 0; f < 2; ++f) {
      const int32_t c[2] = {col + 64 * b, rows[f]};
      cp_async_bulk_tensor(space_cluster, space_global, __cvta_shared_to_generic(slot.box(f, b)), &maps.pre_load, c, bar);
    }
  }
}

// One packed pair of the backward: in, dact (fp32) and the pre pair; out, the packed dpre and
// g act pairs, and da act added to dot.
template <class T, Activation A>
struct BackwardPair {
  uint32_t dpre, gact;
  __device__ __forceinline__ BackwardPair(float a0, float a1, uint32_t pre, float g, bool valid, float& dot) {
    const float2 da = Elem<T>::unpack2(Elem<T>::pack2(a0, a1));  // dact in the dtype, as the separate pass reads it
    const float2 u = Elem<T>::unpack2(pre);
    const ActValueGrad v0 = act_value_grad(A, u.x), v1 = act_value_grad(A, u.y);
    const float2 act = Elem<T>::unpack2(Elem<T>::pack2(v0.f, v1.f));
    if (valid) dot += da.x * act.x + da.y * act.y;
    dpre = Elem<T>::pack2(g * da.x * v0.df, g * da.y * v1.df);
    gact = Elem<T>::pack2(g * act.x, g * act.y);
  }
};

// Column half b of fragment frag (its pre in the slot, landed): dpre and g act, staged (Staged: a
// full tile and TMA-addressable outputs) or from registers; its da act sums go to dot.
template <class T, Activation A, bool Staged>
__device__ __forceinline__ void act_backward_half(const GroupedGemmParams& p, const EpilogueParams& e,
                                                  const EpilogueMaps& maps, TileStore& ts, const TileCoord& tc, int frag,
                                                  int b, const RowScales& gate, const PreSlot& slot,
                                                  const float (&acc)[64], float (&dot)[2]) {
  const int lane = threadIdx.x & 31, warp = (threadIdx.x / 32) & 3;
  const int32_t col0 = tc.col_block * kActBackwardBlockN, cols = p.n - col0, row = tc.row0 + 64 * frag;
  const int rr = 16 * warp + lane / 4;  // the thread's first row in the fragment (+ 8: its second)
  if (64 * b >= cols) return;
  const uint32_t box = slot.box(frag, b);
  // Pair (g, half): columns 64 b + 8 g + 2 (lane % 4), +1 and row rr + 8 half of the fragment,
  // at the same offset in the pre box, the staged boxes and (in place) the dpre box.
  auto offset = [&](int g, int half) { return sw128_offset(rr + 8 * half, g) + 4 * (lane & 3); };
  auto pair = [&](int g, int half, uint32_t pre) {
    const int q = staged_acc(b, g, half);
    const bool valid = 64 * b + 8 * g + 2 * (lane & 3) < cols && (Staged || 64 * frag + rr + 8 * half < tc.rows);
    return BackwardPair<T, A>(acc[q], acc[q + 1], pre, gate.v[half], valid, dot[half]);
  };
  if constexpr (Staged) {
    // The box's pre by four ldmatrix, its 16 pairs as independent chains, dpre back in place by
    // four stmatrix: 8 shared-memory instructions instead of 32, and no load -> math -> store
    // chain per pair (shared-memory accesses are ordered asm); ~1% on the dact GEMM
    // (perf/NOTES.md, step 20).
    uint32_t v[8][2], gact[8][2];
#pragma unroll
    for (int g = 0; g < 8; g += 2) ldmatrix_x4(box_matrices(box, g), v[g][0], v[g][1], v[g + 1][0], v[g + 1][1]);
#pragma unroll
    for (int g = 0; g < 8; ++g)
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        const BackwardPair<T, A> r = pair(g, half, v[g][half]);
        v[g][half] = r.dpre;
        gact[g][half] = r.gact;
      }
#pragma unroll
    for (int g = 0; g < 8; g += 2) stmatrix_x4(box_matrices(box, g), v[g][0], v[g][1], v[g + 1][0], v[g + 1][1]);
    ts.box(maps.out, {col0 + 64 * b, row}, [&](int g, int half) { return gact[g][half]; });
    // ts.box fenced every thread's writes (the dpre ones too) and synced the warpgroup.
    if (ts.leader) {
      const int32_t c[2] = {col0 + 64 * b, row};
      cuda::ptx::cp_async_bulk_tensor(cuda::ptx::space_global, cuda::ptx::space_shared, &maps.pre, c,
                                      reinterpret_cast<const uint8_t*>(__cvta_shared_to_generic(box)));
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
        const int c = 64 * b + 8 * g + 2 * (lane & 3);
        const BackwardPair<T, A> v = pair(g, half, ld_shared_b32(box + offset(g, half)));
        if (r < tc.rows && c < cols) {
          *reinterpret_cast<uint32_t*>(d + c) = v.dpre;
          *reinterpret_cast<uint32_t*>(a + c) = v.gact;
        }
      }
    }
    named_barrier_sync(ts.bar_id, 128);  // every read of the slot is done before the next tile's loads
  }
}

// A fragment's rows' dg partial sums: the quad's four lanes hold a row's columns; lane 0 of the
// quad writes the row's sum over the tile's columns.
__device__ __forceinline__ void store_dg(const EpilogueParams& e, const TileCoord& tc, int frag, const float (&dot)[2]) {
  const int lane = threadIdx.x & 31, rr = 16 * ((threadIdx.x / 32) & 3) + lane / 4;
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    float v = dot[half];
    v += __shfl_xor_sync(0xffffffffu, v, 1);
    v += __shfl_xor_sync(0xffffffffu, v, 2);
    const int r = 64 * frag + rr + 8 * half;
    if ((lane & 3) == 0 && r < tc.rows) e.dg[tc.col_block * e.ld_dg + tc.row0 + r] = v;
  }
}

// A warpgroup's tile (ping-pong: both fragments); pre_phase counts its waits on the slot.
template <class T, Activation A>
__device__ __forceinline__ void act_backward_tile_as(const GroupedGemmParams& p, const EpilogueParams& e,
                                                     const EpilogueMaps& maps, TileStore& ts, const TileCoord& tc,
                                                     const RowScales (&gate)[2], const PreSlot& slot,
                                                     uint32_t& pre_phase, const float (&acc)[2][64]) {
  const bool staged = tile_staged(maps, tc);
#pragma unroll
  for (int frag = 0; frag < 2; ++frag) {
    float dot[2] = {0.f, 0.f};
#pragma unroll
    for (int b = 0; b < 2; ++b) {
      if (frag == 0) mbar_wait_shared(slot.bar(b), pre_phase & 1);
      if (staged) act_backward_half<T, A, true>(p, e, maps, ts, tc, frag, b, gate[frag], slot, acc[frag], dot);
      else act_backward_half<T, A, false>(p, e, maps, ts, tc, frag, b, gate[frag], slot, acc[frag], dot);
    }
    store_dg(e, tc, frag, dot);
  }
  ++pre_phase;
}

template <class T>
__device__ __forceinline__ void act_backward_tile(const GroupedGemmParams& p, const EpilogueParams& e,
                                                  const EpilogueMaps& maps, TileStore& ts, const TileCoord& tc,
                                                  const RowScales (&gate)[2], const PreSlot& slot, uint32_t& pre_phase,
                                                  const float (&acc)[2][64]) {
  switch (e.activation) {  // the plain ones (unsupported_reason refuses the gated)
    case Activation::kRelu:
      act_backward_tile_as<T, Activation::kRelu>(p, e, maps, ts, tc, gate, slot, pre_phase, acc);
      break;
    case Activation::kGelu:
      act_backward_tile_as<T, Activation::kGelu>(p, e, maps, ts, tc, gate, slot, pre_phase, acc);
      break;
    default:
      act_backward_tile_as<T, Activation::kSilu>(p, e, maps, ts, tc, gate, slot, pre_phase, acc);
      break;
  }
}

}  // namespace sm90
}  // namespace gemm
}  // namespace v0
}  // namespace moeblaze
