// The grouped GEMM's epilogues, applied by each consumer warpgroup to its wgmma fragment: thread
// (warp w, lane l) holds rows 16 w + l/4 and +8, columns 8 i + 2 (l%4) and +1, for i < BN/8, as
// acc[4 i + q] (q: bit 0 the column, bit 1 the row). Rows past the tile's share of its expert
// and columns past n are masked, never written. The activation math is experts/activation.hpp's,
// the one definition shared with the CPU engine and the elementwise kernels.
#pragma once

#include "experts/activation.hpp"
#include "gemm/grouped_tiles.hpp"
#include "gemm/sm90/params.hpp"
#include "gemm/sm90/tile_config.hpp"
#include "util/vec8.cuh"

namespace moeblaze {
inline namespace v0 {
namespace gemm {
namespace sm90 {

// Stores v0, v1 at columns j, j + 1 of a row (j even); the second only where j + 1 < n.
template <class T>
__device__ __forceinline__ void store_pair(T* row, int32_t j, int32_t n, float v0, float v1) {
  if (j + 1 < n) Elem<T>::store2(row + j, v0, v1);
  else if (j < n) Elem<T>::store1(row + j, v0);
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

template <class T, int BN>
__device__ __forceinline__ void epilogue_store(const GroupedGemmParams& p, const EpilogueParams& e, const TileCoord& tc,
                                               int wg, const float (&acc)[BN / 2]) {
  struct Row {
    T* c;
    float scale;
  };
  T* C = static_cast<T*>(e.c);
  for_each_fragment_row<BN>(
      wg, tc.rows,
      [&](int r) {
        const int32_t pos = tc.row0 + r;
        return Row{C + static_cast<int64_t>(pos) * e.ldc, e.row_scale ? __ldg(e.row_scale + pos) : 1.f};
      },
      [&](const Row& row, int, int c, int q) {
        store_pair(row.c, tc.col_block * BN + c, p.n, row.scale * acc[q], row.scale * acc[q + 1]);
      });
}

// pre = acc rounded to T (optional); act = f(pre) (optional) (plain) or f(gate) * up (gated: the tile's first half
// holds gate columns, its second half the same up columns), computed from the rounded pre as the
// elementwise kernels do, then rounded.
template <class T, int BN>
__device__ __forceinline__ void epilogue_activation(const GroupedGemmParams& p, const EpilogueParams& e,
                                                    const TileCoord& tc, int wg, const float (&acc)[BN / 2]) {
  struct Row {
    T* pre;
    T* act;
  };
  T* pre = static_cast<T*>(e.pre);
  T* act = static_cast<T*>(e.act);
  const Activation a = e.activation;
  auto rows_of = [&](int r) {
    const int64_t pos = tc.row0 + r;
    return Row{pre ? pre + (e.pre_rows ? __ldg(e.pre_rows + pos) : pos) * e.ld_pre : nullptr,
               act ? act + (e.act_rows ? __ldg(e.act_rows + pos) : pos) * e.ld_act : nullptr};
  };
  if (p.gated) {
    for_each_fragment_row<BN / 2>(wg, tc.rows, rows_of, [&](const Row& row, int, int c, int q) {
      const int32_t j = tc.col_block * (BN / 2) + c;
      const float u0 = round_as<T>(acc[q]), u1 = round_as<T>(acc[q + 1]);
      const float b0 = round_as<T>(acc[q + BN / 4]), b1 = round_as<T>(acc[q + 1 + BN / 4]);
      if (row.pre) {
        store_pair(row.pre, j, p.n, u0, u1);
        store_pair(row.pre + p.n, j, p.n, b0, b1);
      }
      if (row.act) store_pair(row.act, j, p.n, act_fn(a, u0) * b0, act_fn(a, u1) * b1);
    });
  } else {
    for_each_fragment_row<BN>(wg, tc.rows, rows_of, [&](const Row& row, int, int c, int q) {
      const int32_t j = tc.col_block * BN + c;
      const float u0 = round_as<T>(acc[q]), u1 = round_as<T>(acc[q + 1]);
      if (row.pre) store_pair(row.pre, j, p.n, u0, u1);
      if (row.act) store_pair(row.act, j, p.n, act_fn(a, u0), act_fn(a, u1));
    });
  }
}

// A weight-gradient tile: C_e[m0 + r, n0 + c] = acc (+ the old value when accumulating), rows
// past m and columns past n masked; stored transposed with c_transposed (2-byte stores: eight
// lanes still write 16 contiguous bytes). An expert without positions (num_kb == 0, acc zero) leaves
// an accumulated gradient untouched. With acc32 (a sum over several launches), the fp32 partial
// sum is added first (acc32_load) and the result goes to acc32 (acc32_store) or, rounded once,
// to C; the partial sums are always written, so every launch leaves acc32 defined.
template <class T, int BN>
__device__ __forceinline__ void epilogue_weight_grad(const WeightGradParams& p, int32_t expert, int32_t m0, int32_t n0,
                                                     int num_kb, int wg, const float (&acc)[BN / 2]) {
  const bool load32 = p.acc32 && p.acc32_load, store32 = p.acc32 && p.acc32_store;
  if (p.accumulate && num_kb == 0 && !load32 && !store32) return;
  T* C = static_cast<T*>(p.c) + static_cast<int64_t>(expert) * p.c_expert_stride;
  float* C32 = p.acc32 + static_cast<int64_t>(expert) * p.m * p.n;
  const int rows = p.m - m0 < kBlockM ? p.m - m0 : kBlockM;
  for_each_fragment_row<BN>(wg, rows, [](int r) { return r; }, [&](int, int r, int c, int q) {
    const int64_t i = m0 + r;
    const int32_t j = n0 + c;
    float v0 = acc[q], v1 = acc[q + 1];
    // n is a multiple of 8 and j even: a pair is whole or wholly past n, and 8-byte aligned.
    float2* pair32 = reinterpret_cast<float2*>(C32 + i * p.n + j);
    if (load32 && j < p.n) {
      const float2 old = *pair32;
      v0 += old.x;
      v1 += old.y;
    }
    if (store32) {
      if (j < p.n) *pair32 = make_float2(v0, v1);
      return;
    }
    if (p.c_transposed) {  // elements (i, j) and (i, j + 1) lie in two rows of C
      T* at0 = C + static_cast<int64_t>(j) * p.ldc + i;
      T* at1 = at0 + p.ldc;
      if (j < p.n) Elem<T>::store1(at0, p.accumulate ? v0 + Elem<T>::load1(at0) : v0);
      if (j + 1 < p.n) Elem<T>::store1(at1, p.accumulate ? v1 + Elem<T>::load1(at1) : v1);
      return;
    }
    T* row = C + i * p.ldc;
    if (p.accumulate) {
      if (j < p.n) v0 += Elem<T>::load1(row + j);
      if (j + 1 < p.n) v1 += Elem<T>::load1(row + j + 1);
    }
    store_pair(row, j, p.n, v0, v1);
  });
}

}  // namespace sm90
}  // namespace gemm
}  // namespace v0
}  // namespace moeblaze
