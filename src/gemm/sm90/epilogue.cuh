// The grouped GEMM's epilogues, applied by each consumer warpgroup to its wgmma fragment: thread
// (warp w, lane l) holds rows 16 w + l/4 and +8, columns 8 i + 2 (l%4) and +1, for i < BN/8, as
// acc[4 i + q] (q: bit 0 the column, bit 1 the row). Rows past the tile's share of its expert
// and columns past n are masked, never written. The activation math is experts/activation.hpp's,
// the one definition shared with the CPU engine and the elementwise kernels.
#pragma once

#include <type_traits>

#include "experts/activation.hpp"
#include "gemm/grouped_tiles.hpp"
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
// predicate per pair, no per-element branches.
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

// pre = acc rounded to T (optional); act = f(pre) (optional) (plain) or f(gate) * up (gated: the tile's first half
// holds gate columns, its second half the same up columns), computed from the rounded pre as the
// elementwise kernels do, then rounded. The nonlinearity is chosen once per tile (a
// compile-time Activation in the per-element code).
template <class T, int BN, Activation A>
__device__ __forceinline__ void epilogue_activation_as(const GroupedGemmParams& p, const EpilogueParams& e,
                                                       const TileCoord& tc, int wg, const float (&acc)[BN / 2]) {
  struct Row {
    T* pre;  // column 0 of the tile's columns in the row's pre (gate half), or nullptr
    T* act;  // likewise in act, or nullptr
  };
  T* pre = static_cast<T*>(e.pre);
  T* act = static_cast<T*>(e.act);
  const int32_t tile_col = tc.col_block * (p.gated ? BN / 2 : BN);
  const int32_t cols = p.n - tile_col;
  auto rows_of = [&](int r) {
    const int64_t pos = tc.row0 + r;
    return Row{pre ? pre + (e.pre_rows ? __ldg(e.pre_rows + pos) : pos) * e.ld_pre + tile_col : nullptr,
               act ? act + (e.act_rows ? __ldg(e.act_rows + pos) : pos) * e.ld_act + tile_col : nullptr};
  };
  if (p.gated) {
    for_each_fragment_row<BN / 2>(wg, tc.rows, rows_of, [&](const Row& row, int, int c, int q) {
      if (c >= cols) return;
      const float u0 = round_as<T>(acc[q]), u1 = round_as<T>(acc[q + 1]);
      const float b0 = round_as<T>(acc[q + BN / 4]), b1 = round_as<T>(acc[q + 1 + BN / 4]);
      if (row.pre) {
        Elem<T>::store2(row.pre + c, u0, u1);
        Elem<T>::store2(row.pre + p.n + c, b0, b1);
      }
      if (row.act) Elem<T>::store2(row.act + c, act_fn(A, u0) * b0, act_fn(A, u1) * b1);
    });
  } else {
    for_each_fragment_row<BN>(wg, tc.rows, rows_of, [&](const Row& row, int, int c, int q) {
      if (c >= cols) return;
      const float u0 = round_as<T>(acc[q]), u1 = round_as<T>(acc[q + 1]);
      if (row.pre) Elem<T>::store2(row.pre + c, u0, u1);
      if (row.act) Elem<T>::store2(row.act + c, act_fn(A, u0), act_fn(A, u1));
    });
  }
}

template <class T, int BN>
__device__ __forceinline__ void epilogue_activation(const GroupedGemmParams& p, const EpilogueParams& e,
                                                    const TileCoord& tc, int wg, const float (&acc)[BN / 2]) {
  switch (e.activation) {  // act_fn's three nonlinearities
    case Activation::kRelu: epilogue_activation_as<T, BN, Activation::kRelu>(p, e, tc, wg, acc); break;
    case Activation::kGelu: case Activation::kGeglu: epilogue_activation_as<T, BN, Activation::kGelu>(p, e, tc, wg, acc); break;
    default: epilogue_activation_as<T, BN, Activation::kSilu>(p, e, tc, wg, acc); break;
  }
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

// A weight-gradient tile: C_e[m0 + r, n0 + c] = acc (+ the old value when accumulating), rows
// past m and columns past n masked; stored transposed with c_transposed. An expert without
// positions (num_kb == 0, acc zero) leaves an accumulated gradient untouched. With acc32 (a sum
// over several launches), the fp32 partial sum is added first (acc32_load) and the result goes
// to acc32 (acc32_store) or, rounded once, to C; the partial sums are always written, so every
// launch leaves acc32 defined. The mode is chosen once per tile.
template <class T, int BN>
__device__ __forceinline__ void epilogue_weight_grad(const WeightGradParams& p, int32_t expert, int32_t m0, int32_t n0,
                                                     int num_kb, int wg, const float (&acc)[BN / 2]) {
  const bool load32 = p.acc32 && p.acc32_load, store32 = p.acc32 && p.acc32_store;
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
