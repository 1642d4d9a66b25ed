// The grouped GEMM's epilogues, applied by each consumer warpgroup to its wgmma fragment: thread
// (warp w, lane l) holds rows 16 w + l/4 and +8, columns 8 i + 2 (l%4) and +1, for i < BN/8, as
// acc[4 i + q] (q: bit 0 the column, bit 1 the row). Rows past the tile's share of its expert
// and columns past n are masked, never written. The activation math is math/activation.hpp's,
// the one definition shared with the CPU engine and the elementwise kernels.
#pragma once

#include <type_traits>

#include "math/activation.hpp"
#include "gemm/grouped_tiles.hpp"
#include "gemm/sm90/epilogue_tma.cuh"
#include "gemm/sm90/params.hpp"
#include "gemm/sm90/tile_config.hpp"
#include "util/vec8.cuh"

namespace moeblaze {
inline namespace v0 {
namespace gemm {
namespace sm90 {

// A run-time flag turned into a compile-time one: f(Flag<true>{}) or f(Flag<false>{}), so a
// tile-wide mode picks one specialised copy of the per-element code instead of branching
// inside it.
template <bool B>
using Flag = std::integral_constant<bool, B>;
template <class F>
__device__ __forceinline__ void with_flag(bool b, F&& f) {
  if (b) f(Flag<true>{});
  else f(Flag<false>{});
}

// For each of the fragment's valid rows r: row_ctx(r) once (the row's pointers and factors,
// loaded once rather than once per column pair), then f(ctx, r, column in tile, acc index) for
// its column pairs.
template <int BN, class RowCtx, class F>
__device__ __forceinline__ void for_each_fragment_row(int wg, int rows, RowCtx&& row_ctx, F&& f) {
  const int warp = (threadIdx.x / 32) & 3, lane = threadIdx.x & 31;
  const int r0 = wg * 64 + warp * 16 + lane / 4;
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    const int r = r0 + 8 * half;
    if (r >= rows) continue;
    const auto ctx = row_ctx(r);
#pragma unroll
    for (int i = 0; i < BN / 8; ++i) f(ctx, r, i * 8 + (lane & 3) * 2, 4 * i + 2 * half);
  }
}

// The varlen-M epilogues. n (and so a tile's valid column count) is a multiple of 8 and a
// thread's columns come in even pairs, so a pair is wholly inside or wholly past n: one
// predicate per pair, no per-element branches. Each has two forms with the same math: from
// registers (any tile) and staged through shared memory to TMA stores (full tiles,
// gemm/sm90/epilogue_tma.cuh). A staged box covers the fragment's column groups 8 b .. 8 b + 7
// (box b); pair (g, half) of it is accumulator 4 (8 b + g) + 2 half and the next.
__device__ __forceinline__ constexpr int staged_acc(int box, int g, int half) { return 4 * (8 * box + g) + 2 * half; }

template <class T, int BN>
__device__ __forceinline__ void epilogue_store(const GroupedGemmParams& p, const EpilogueParams& e, const TileCoord& tc,
                                               int wg, const float (&acc)[BN / 2]) {
  struct Row {
    T* c;  // column 0 of the tile in the row's output
    float scale;
  };
  T* C = static_cast<T*>(e.c);
  const int32_t cols = p.n - tc.col_block * BN;
  for_each_fragment_row<BN>(
      wg, tc.rows,
      [&](int r) {
        const int32_t pos = tc.row0 + r;
        return Row{C + static_cast<int64_t>(pos) * e.ldc + tc.col_block * BN, e.row_scale ? __ldg(e.row_scale + pos) : 1.f};
      },
      [&](const Row& row, int, int c, int q) {
        if (c < cols) Elem<T>::store2(row.c + c, row.scale * acc[q], row.scale * acc[q + 1]);
      });
}

// The row factors (kStore: the gate of a position; kActivationBackward: g) of a thread's two
// rows of fragment frag (1 without row_scale, and for rows past the tile's share of its
// expert), loaded as soon as the tile is known so that their latency hides under its MMAs.
struct RowScales {
  float v[2];
};
__device__ __forceinline__ RowScales load_row_scales(const EpilogueParams& e, const TileCoord& tc, int frag) {
  RowScales s{{1.f, 1.f}};
  if (e.kind != EpilogueKind::kActivation && e.row_scale) {
    const int r = frag * 64 + ((threadIdx.x / 32) & 3) * 16 + (threadIdx.x & 31) / 4;
    if (r < tc.rows) s.v[0] = __ldg(e.row_scale + tc.row0 + r);
    if (r + 8 < tc.rows) s.v[1] = __ldg(e.row_scale + tc.row0 + r + 8);
  }
  return s;
}

// kStore with c_row (rows placed one by one, so no TMA box), from registers. Vec (C 8-byte
// aligned, ldc % 4 == 0): neighbouring lanes trade a column pair (one shuffle for two groups of 8
// columns) so that each lane holds four consecutive columns of its row and stores them as 8
// bytes: a quad's four stores then fill one whole 32-byte sector of its row instead of two
// half-sectors. Otherwise each element on its own (any row stride). Rows past the tile's share of
// its expert and placed outside C are not stored; every lane takes part in the shuffles.
template <class T, int BN, bool Vec>
__device__ __forceinline__ void epilogue_store_rows_as(const GroupedGemmParams& p, const EpilogueParams& e,
                                                       const TileCoord& tc, int wg, const RowScales& scale,
                                                       const float (&acc)[BN / 2]) {
  const int warp = (threadIdx.x / 32) & 3, lane = threadIdx.x & 31, j = lane & 3;
  const bool odd = j & 1;
  const int32_t cols = p.n - tc.col_block * BN;
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    const int r = wg * 64 + warp * 16 + lane / 4 + 8 * half;
    T* row = nullptr;
    if (r < tc.rows) {
      const int32_t t = __ldg(e.c_row + tc.row0 + r);
      if (t >= 0 && t < e.c_rows) row = static_cast<T*>(e.c) + static_cast<int64_t>(t) * e.ldc + tc.col_block * BN;
    }
    const float s = scale.v[half];
#pragma unroll
    for (int i = 0; i < BN / 8; i += 2) {
      // Column pair j of groups i and i + 1.
      const uint32_t a = Elem<T>::pack2(s * acc[4 * i + 2 * half], s * acc[4 * i + 2 * half + 1]);
      const uint32_t b = Elem<T>::pack2(s * acc[4 * i + 4 + 2 * half], s * acc[4 * i + 4 + 2 * half + 1]);
      if constexpr (Vec) {
        // An even lane keeps group i's pair and takes its odd neighbour's (pair j + 1); an odd
        // lane keeps group i + 1's and takes pair j - 1 of it.
        const uint32_t got = __shfl_xor_sync(0xffffffffu, odd ? a : b, 1);
        const int col = odd ? 8 * (i + 1) + 2 * (j - 1) : 8 * i + 2 * j;
        if (row && col < cols) *reinterpret_cast<uint2*>(row + col) = odd ? make_uint2(got, b) : make_uint2(a, got);
      } else if (row) {
#pragma unroll
        for (int g = 0; g < 2; ++g) {
          const int col = 8 * (i + g) + 2 * j;
          if (col >= cols) continue;
          const float2 v = Elem<T>::unpack2(g ? b : a);  // exact: the rounded values
          Elem<T>::store1(row + col, v.x);
          Elem<T>::store1(row + col + 1, v.y);
        }
      }
    }
  }
}
template <class T, int BN>
__device__ __forceinline__ void epilogue_store_rows(const GroupedGemmParams& p, const EpilogueParams& e,
                                                    const TileCoord& tc, int wg, const RowScales& scale,
                                                    const float (&acc)[BN / 2]) {
  const bool vec = reinterpret_cast<uintptr_t>(e.c) % 8 == 0 && e.ldc % 4 == 0;
  with_flag(vec, [&](auto v) { epilogue_store_rows_as<T, BN, decltype(v)::value>(p, e, tc, wg, scale, acc); });
}

// Whether a tile's outputs go through shared memory and TMA stores: the maps allow it and all
// 128 rows belong to the tile's expert (TMA clips only at the tensor's bounds).
__device__ __forceinline__ bool tile_staged(const EpilogueMaps& maps, const TileCoord& tc) {
  return maps.enabled && tc.rows == kBlockM;
}

// The store epilogue's packed pair (g, half) of staged box b: the row's scale times acc, rounded
// (staged now, or kept for later by gemm/sm90/epilogue_deferred.cuh).
template <class T, int BN>
__device__ __forceinline__ uint32_t store_pair(const RowScales& scale, const float (&acc)[BN / 2], int b, int g,
                                               int half) {
  const int q = staged_acc(b, g, half);
  return Elem<T>::pack2(scale.v[half] * acc[q], scale.v[half] * acc[q + 1]);
}

template <class T, int BN>
__device__ __forceinline__ void epilogue_store_staged(const GroupedGemmParams& p, const EpilogueMaps& maps, TileStore& ts,
                                                      const TileCoord& tc, int frag, const RowScales& scale,
                                                      const float (&acc)[BN / 2]) {
  const int32_t row = tc.row0 + frag * 64, col0 = tc.col_block * BN;
#pragma unroll
  for (int b = 0; b < BN / 64; ++b)
    if (col0 + 64 * b < p.n)
      ts.box(maps.out, {col0 + 64 * b, row}, [&](int g, int half) { return store_pair<T, BN>(scale, acc, b, g, half); });
}

// The activation epilogue's values: pre = acc rounded to T; act = f(pre) (plain) or f(gate) * up
// (gated: the tile's first half holds gate columns, its second half the same up columns),
// computed from the rounded pre as the elementwise kernels do, then rounded. The rounding is one
// pack per pair (F2FP, two values), unpacked by two bit operations: a conversion per element
// ran on the same quarter-rate pipe as the sigmoid's MUFU ops, in an epilogue no MMA overlaps
// (perf/NOTES.md). act_of gives the act pair of packed pre pairs (up: the up pair when
// gated); act_pair that of accumulators q, q + 1 (and their up columns).
template <class T, Activation A, bool Gated>
__device__ __forceinline__ float2 act_of(uint32_t gate, uint32_t up) {
  const float2 u = Elem<T>::unpack2(gate);
  if constexpr (Gated) {
    const float2 b = Elem<T>::unpack2(up);
    return make_float2(act_fn<A>(u.x) * b.x, act_fn<A>(u.y) * b.y);
  } else {
    return make_float2(act_fn<A>(u.x), act_fn<A>(u.y));
  }
}
template <class T, int BN, Activation A, bool Gated>
__device__ __forceinline__ float2 act_pair(const float (&acc)[BN / 2], int q) {
  return act_of<T, A, Gated>(Elem<T>::pack2(acc[q], acc[q + 1]),
                             Gated ? Elem<T>::pack2(acc[q + BN / 4], acc[q + 1 + BN / 4]) : 0u);
}

// The output row of problem row pos (of expert tc.expert) in an output placed by expert_row.
__device__ __forceinline__ int64_t placed_row(const GroupedGemmParams& p, const int32_t* expert_row, const TileCoord& tc,
                                              int32_t pos) {
  return expert_row ? static_cast<int64_t>(__ldg(expert_row + tc.expert)) + (pos - p.sched.offsets[tc.expert]) : pos;
}

// The nonlinearity and gating are chosen once per tile (compile-time in the per-element code).
template <class T, int BN, Activation A, bool Gated>
__device__ __forceinline__ void epilogue_activation_as(const GroupedGemmParams& p, const EpilogueParams& e,
                                                       const TileCoord& tc, int wg, const float (&acc)[BN / 2]) {
  struct Row {
    T* pre;  // column 0 of the tile's columns in the row's pre (gate half), or nullptr
    T* act;  // likewise in act, or nullptr
  };
  T* pre = static_cast<T*>(e.pre);
  T* act = static_cast<T*>(e.act);
  const int32_t tile_col = tc.col_block * (Gated ? BN / 2 : BN);
  const int32_t cols = p.n - tile_col;
  const int64_t pre_rows = e.pre_out_rows ? e.pre_out_rows : p.sched.m_total;
  const int64_t act_rows = e.act_out_rows ? e.act_out_rows : p.sched.m_total;
  auto rows_of = [&](int r) {
    const int64_t rp = placed_row(p, e.pre_expert_row, tc, tc.row0 + r), ra = placed_row(p, e.act_expert_row, tc, tc.row0 + r);
    return Row{pre && rp >= 0 && rp < pre_rows ? pre + rp * e.ld_pre + tile_col : nullptr,
               act && ra >= 0 && ra < act_rows ? act + ra * e.ld_act + tile_col : nullptr};
  };
  for_each_fragment_row<Gated ? BN / 2 : BN>(wg, tc.rows, rows_of, [&](const Row& row, int, int c, int q) {
    if (c >= cols) return;
    if (row.pre) {
      Elem<T>::store2(row.pre + c, acc[q], acc[q + 1]);
      if constexpr (Gated) Elem<T>::store2(row.pre + p.n + c, acc[q + BN / 4], acc[q + 1 + BN / 4]);
    }
    if (row.act) {
      const float2 v = act_pair<T, BN, A, Gated>(acc, q);
      Elem<T>::store2(row.act + c, v.x, v.y);
    }
  });
}

// Staged: act's boxes (BN / 128 gated, BN / 64 plain), then pre's (the whole fragment; gated,
// its first half to pre's gate half and its second to the up half, each clipped at n).
template <class T, int BN, Activation A, bool Gated>
__device__ __forceinline__ void epilogue_activation_staged_as(const GroupedGemmParams& p, const EpilogueParams& e,
                                                              const EpilogueMaps& maps, TileStore& ts,
                                                              const TileCoord& tc, int frag, const float (&acc)[BN / 2]) {
  constexpr int kHalfBoxes = Gated ? BN / 128 : BN / 64;  // boxes per output half
  const int32_t tile_col = tc.col_block * (Gated ? BN / 2 : BN), pos = tc.row0 + frag * 64;
  if (e.act) {
    const int32_t row = static_cast<int32_t>(placed_row(p, e.act_expert_row, tc, pos));
#pragma unroll
    for (int b = 0; b < kHalfBoxes; ++b)
      if (tile_col + 64 * b < p.n)
        ts.box(maps.out, {tile_col + 64 * b, row}, [&](int g, int half) {
          const float2 v = act_pair<T, BN, A, Gated>(acc, staged_acc(b, g, half));
          return Elem<T>::pack2(v.x, v.y);
        });
  }
  if (e.pre) {
    const int32_t row = static_cast<int32_t>(placed_row(p, e.pre_expert_row, tc, pos));
#pragma unroll
    for (int b = 0; b < BN / 64; ++b) {
      const int32_t col = tile_col + 64 * (b % kHalfBoxes);
      auto pair = [&](int g, int half) {
        const int q = staged_acc(b, g, half);
        return Elem<T>::pack2(acc[q], acc[q + 1]);
      };
      if (col >= p.n) continue;
      if constexpr (Gated) ts.box(maps.pre, {col, b / kHalfBoxes, row}, pair);  // [rows][2][n]
      else ts.box(maps.pre, {col, row}, pair);
    }
  }
}

// Whether a full tile's rows, placed by expert_row, lie inside an output of `rows` rows: only
// then does it go by TMA (whose boxes must not start outside the tensor; a placement that breaks
// this comes only from a bad plan, and the register path masks it row by row).
__device__ __forceinline__ bool placed_inside(const GroupedGemmParams& p, const int32_t* expert_row, int32_t rows,
                                              const TileCoord& tc) {
  const int64_t r = placed_row(p, expert_row, tc, tc.row0), n = rows ? rows : p.sched.m_total;
  return r >= 0 && r + kBlockM <= n;
}

// Whether a full tile's activation outputs go by TMA: `staged` (a full tile, the maps encoded)
// and its placed rows inside both outputs.
__device__ __forceinline__ bool activation_staged(const GroupedGemmParams& p, const EpilogueParams& e, bool staged,
                                                  const TileCoord& tc) {
  return staged && (!e.pre || placed_inside(p, e.pre_expert_row, e.pre_out_rows, tc)) &&
         (!e.act || placed_inside(p, e.act_expert_row, e.act_out_rows, tc));
}

// One tile fragment's activation epilogue: staged when `staged` (a full tile) and its placed
// rows lie inside the outputs, else from registers.
template <class T, int BN>
__device__ __forceinline__ void epilogue_activation(const GroupedGemmParams& p, const EpilogueParams& e,
                                                    const EpilogueMaps& maps, TileStore& ts, bool staged,
                                                    const TileCoord& tc, int frag, const float (&acc)[BN / 2]) {
  staged = activation_staged(p, e, staged, tc);
  auto run = [&](auto act_c, auto gated_c) {
    constexpr Activation A = decltype(act_c)::value;
    constexpr bool G = decltype(gated_c)::value;
    if (staged) epilogue_activation_staged_as<T, BN, A, G>(p, e, maps, ts, tc, frag, acc);
    else epilogue_activation_as<T, BN, A, G>(p, e, tc, frag, acc);
  };
  with_flag(p.gated != 0, [&](auto g) {
    // The three nonlinearities: gating is the flag g.
    with_activation(e.activation, [&](auto a) { run(ActTag<Nonlinearity<decltype(a)::value>::kPlain>{}, g); });
  });
}

// A weight-gradient tile's stores in one mode (template flags, so the per-pair code has no
// run-time branches: ncu put 28% of the consumers' time in the earlier epilogue, about 40
// instructions per store). Pairs (i, j), (i, j + 1) with j even: n is a multiple of 8, so a pair
// is wholly inside or wholly past n, and its fp32 partial sums are 8-byte aligned.
//   Store32: the sum (+ acc32 with Load32) goes to acc32 only;
//   otherwise v = acc (+ acc32 with Load32) (+ C with Accumulate) is rounded into C, at
//   C[i * ldc + j] or, Transposed, C[j * ldc + i] (2-byte stores: eight lanes still write 16
//   contiguous bytes).
template <class T, int BN, bool Load32, bool Store32, bool Transposed, bool Accumulate>
__device__ __forceinline__ void weight_grad_tile_stores(const WeightGradParams& p, T* C, float* C32, int32_t m0, int32_t n0,
                                                        int rows, int wg, const float (&acc)[BN / 2]) {
  struct Row {
    T* c;        // element (i, n0) of C (Transposed: of its transpose)
    float* c32;  // element (i, n0) of acc32
  };
  const int32_t cols = p.n - n0;
  const int64_t ldc = p.ldc;
  for_each_fragment_row<BN>(
      wg, rows,
      [&](int r) {
        const int64_t i = m0 + r;
        return Row{Transposed ? C + n0 * ldc + i : C + i * ldc + n0, C32 + i * p.n + n0};
      },
      [&](const Row& row, int, int c, int q) {
        if (c >= cols) return;
        float v0 = acc[q], v1 = acc[q + 1];
        if constexpr (Load32) {
          const float2 old = *reinterpret_cast<const float2*>(row.c32 + c);
          v0 += old.x;
          v1 += old.y;
        }
        if constexpr (Store32) {
          *reinterpret_cast<float2*>(row.c32 + c) = make_float2(v0, v1);
        } else if constexpr (Transposed) {  // elements (i, j) and (i, j + 1) lie in two rows of C
          T* at0 = row.c + c * ldc;
          T* at1 = at0 + ldc;
          if constexpr (Accumulate) {
            v0 += Elem<T>::load1(at0);
            v1 += Elem<T>::load1(at1);
          }
          Elem<T>::store1(at0, v0);
          Elem<T>::store1(at1, v1);
        } else {
          if constexpr (Accumulate) {
            v0 += Elem<T>::load1(row.c + c);
            v1 += Elem<T>::load1(row.c + c + 1);
          }
          Elem<T>::store2(row.c + c, v0, v1);
        }
      });
}

// A weight-gradient tile stored by TMA (EpilogueMaps::out over [E][m][n], or [E][n][m] when
// transposed, clipped at m and n): every tile, partial ones included, since the map's bounds are
// the expert's. Load32 (the last of several token windows): the fp32 sums of the earlier windows
// (c32: the expert's [m][n]) are added before rounding, read from registers' own positions.
template <class T, int BN, bool Transposed, bool Load32>
__device__ __forceinline__ void weight_grad_staged(const TmaDescriptor& map, TileStore& ts, int32_t expert, int32_t m0,
                                                   int32_t n0, int32_t m, int32_t n, int frag, const float* c32,
                                                   const float (&acc)[BN / 2]) {
  const int32_t i0 = m0 + 64 * frag;
  if (i0 >= m) return;  // the tile's second half lies past the gradient's rows
  const int lane = threadIdx.x & 31, row = i0 + 16 * ((threadIdx.x / 32) & 3) + lane / 4;
#pragma unroll
  for (int b = 0; b < BN / 64; ++b) {
    if (n0 + 64 * b >= n) continue;
    float2 old[8][2];  // the earlier windows' sums under this thread's pairs of the box
    if constexpr (Load32) {
#pragma unroll
      for (int g = 0; g < 8; ++g)
#pragma unroll
        for (int half = 0; half < 2; ++half) {
          const int32_t i = row + 8 * half, j = n0 + 64 * b + 8 * g + 2 * (lane & 3);
          old[g][half] = i < m && j < n ? *reinterpret_cast<const float2*>(c32 + static_cast<int64_t>(i) * n + j)
                                        : make_float2(0.f, 0.f);
        }
    }
    auto pair = [&](int g, int half) {
      const int q = staged_acc(b, g, half);
      if constexpr (Load32) return Elem<T>::pack2(acc[q] + old[g][half].x, acc[q + 1] + old[g][half].y);
      else return Elem<T>::pack2(acc[q], acc[q + 1]);
    };
    if constexpr (Transposed) ts.box_transposed(map, {i0, n0 + 64 * b, expert}, pair);
    else ts.box(map, {n0 + 64 * b, i0, expert}, pair);
  }
}

// A weight-gradient tile's fp32 sum over a token window, staged to the sums' [E][m][n] map:
// stored (the first window) or, Reduce, added to the earlier windows' sums by TMA reductions,
// which drain under the next tile's MMAs like any staged store.
template <int BN, bool Reduce>
__device__ __forceinline__ void weight_grad_sums_staged(const TmaDescriptor& map, TileStore& ts, int32_t expert,
                                                        int32_t m0, int32_t n0, int32_t m, int32_t n, int frag,
                                                        const float (&acc)[BN / 2]) {
  const int32_t i0 = m0 + 64 * frag;
  if (i0 >= m) return;
#pragma unroll
  for (int b = 0; b < BN / 32; ++b) {  // boxes of 32 fp32 columns: column groups 4 b .. 4 b + 3
    if (n0 + 32 * b >= n) continue;
    ts.box_f32<Reduce>(map, {n0 + 32 * b, i0, expert}, [&](int g, int half) {
      const int q = staged_acc(0, 4 * b + g, half);
      return make_float2(acc[q], acc[q + 1]);
    });
  }
}

// A weight-gradient tile: C_e[m0 + r, n0 + c] = acc (+ the old value when accumulating), rows
// past m and columns past n masked; stored transposed with c_transposed. An expert without
// positions (num_kb == 0, acc zero) leaves an accumulated gradient untouched. With acc32 (a sum
// over several launches), the fp32 partial sum is added first (acc32_load) and the result goes
// to acc32 (acc32_store) or, rounded once, to C; the partial sums are always written, so every
// launch leaves acc32 defined. The mode is chosen once per tile.
template <class T, int BN>
__device__ __forceinline__ void epilogue_weight_grad(const WeightGradParams& p, const EpilogueMaps& maps, TileStore& ts,
                                                     int32_t expert, int32_t m0, int32_t n0, int num_kb, int wg,
                                                     const float (&acc)[BN / 2]) {
  const bool load32 = p.acc32 && p.acc32_load, store32 = p.acc32 && p.acc32_store;
  if (maps.enabled) {  // the host enables it for every mode but accumulate (without store32)
    if (store32) {
      with_flag(load32, [&](auto red) {
        weight_grad_sums_staged<BN, decltype(red)::value>(maps.out, ts, expert, m0, n0, p.m, p.n, wg, acc);
      });
      return;
    }
    const float* c32 = load32 ? p.acc32 + static_cast<int64_t>(expert) * p.m * p.n : nullptr;
    with_flag(p.c_transposed, [&](auto tr) {
      with_flag(load32, [&](auto l32) {
        weight_grad_staged<T, BN, decltype(tr)::value, decltype(l32)::value>(maps.out, ts, expert, m0, n0, p.m, p.n, wg,
                                                                             c32, acc);
      });
    });
    return;
  }
  if (p.accumulate && num_kb == 0 && !load32 && !store32) return;
  T* C = static_cast<T*>(p.c) + static_cast<int64_t>(expert) * p.c_expert_stride;
  float* C32 = p.acc32 + static_cast<int64_t>(expert) * p.m * p.n;
  const int rows = p.m - m0 < kBlockM ? p.m - m0 : kBlockM;
  auto stores = [&](auto load32_c, auto store32_c, auto transposed_c, auto accumulate_c) {
    weight_grad_tile_stores<T, BN, decltype(load32_c)::value, decltype(store32_c)::value, decltype(transposed_c)::value,
                            decltype(accumulate_c)::value>(p, C, C32, m0, n0, rows, wg, acc);
  };
  with_flag(load32, [&](auto l32) {
    if (store32) stores(l32, Flag<true>{}, Flag<false>{}, Flag<false>{});
    else with_flag(p.c_transposed, [&](auto tr) { with_flag(p.accumulate, [&](auto ac) { stores(l32, Flag<false>{}, tr, ac); }); });
  });
}

}  // namespace sm90
}  // namespace gemm
}  // namespace v0
}  // namespace moeblaze
