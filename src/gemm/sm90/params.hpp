// The grouped GEMM's plain parameter structs (host and device; no CUDA types, no C API types).
//
// One launch computes, for every expert e with rows [offsets[e], offsets[e+1]) of C:
//   C[p, :] = epilogue( A[row(p), :] . B_e )      p in the expert's rows (varlen M)
// where row(p) = a_index ? a_index[p] : p gathers A rows on the fly (x or dy through the routing
// plan) and B_e = b + e * b_expert_stride is the expert's weight. The device expert offsets are
// the only source of per-expert rows: nothing is copied to the host.
#pragma once

#include <cstdint>

#include "core/config.hpp"
#include "cuda/row_arrival.hpp"
#include "gemm/grouped_tiles.hpp"

namespace moeblaze {
inline namespace v0 {
namespace gemm {
namespace sm90 {

// How B's elements lie in memory: element (k, n) of expert e is at
//   kMN: b_e[k * ldb + n]   (weights stored [K, N], as W_gate_up [d, 2h] and W_down [h, d])
//   kK:  b_e[n * ldb + k]   (the transpose of such a weight: dact = dy W_down^T, dx = dpre W_gate_up^T)
enum class Major : int32_t { kK = 0, kMN = 1 };

enum class EpilogueKind : int32_t {
  kStore = 0,       // C[p, j] = row_scale[p] * acc (row_scale optional), rounded to the dtype
  kActivation = 1,  // pre (optional) and act = f(pre) or f(gate) * up, both rounded to the dtype
  // The activation backward on the dact GEMM's product (dact = dy W_down^T, n = h): dpre,
  // g * act and per-column-block partial sums of dg from dact and the saved pre (EpilogueParams
  // says where each lies; gemm/sm90/epilogue_act_backward.cuh).
  kActivationBackward = 2,
};

// The sanitised expert ranges and their row-block prefix (gemm/grouped_tiles.hpp), made on the
// device once per call by make_schedule and shared by every GEMM of the call with this block_m.
struct Schedule {
  const int32_t* offsets = nullptr;    // [E + 1] clamped to [0, m_total] and non-decreasing
  const int32_t* rb_prefix = nullptr;  // [E + 1]
  int32_t num_experts = 0;
  int32_t m_total = 0;                 // rows of C (L k)
  int32_t raster_group = kRasterRowBlocks;  // row blocks per raster group (gemm/grouped_tiles.hpp)
};

struct GroupedGemmParams {
  Schedule sched;
  int32_t n = 0;       // output columns; with gated, the columns of each half (h): B has 2n columns
  int32_t k = 0;       // reduction length
  int32_t gated = 0;   // tile = [BN/2 gate columns | the same BN/2 columns of the up half, + n]
  Major b_major = Major::kMN;
  // A: row p of the problem is a[row(p) * lda + kk]; a row index outside [0, a_rows) reads as
  // zeros (a caller's bad index never becomes an out-of-bounds read).
  const void* a = nullptr;
  int64_t lda = 0;
  const int32_t* a_index = nullptr;
  int32_t a_rows = 0;
  const void* b = nullptr;
  int64_t ldb = 0;
  int64_t b_expert_stride = 0;  // elements
  // At most this many persistent CTAs (0: one per SM), so that kernels on another stream (an
  // expert-parallel exchange) keep SMs of their own; the tile walk strides by the grid.
  int32_t max_ctas = 0;
  // Gathered A only: rows that other GPUs are still storing; the producer waits for each row of
  // a tile before it loads them (cuda/row_arrival.hpp).
  RowArrival arrival;
};

// A CUtensorMap (128 opaque bytes, 64-byte aligned) by value: the weights' TMA descriptor,
// encoded on the host per launch (gemm/sm90/tensor_map.hpp) and passed as a __grid_constant__
// kernel parameter, so graph capture records it with the launch.
struct alignas(64) TmaDescriptor {
  unsigned char bytes[128];
};

// The mainloop's TMA descriptors: B (the weights) always; A when a_by_tma (A in expert order,
// no a_index: gemm/sm90/mainloop.cuh), else unused.
struct OperandMaps {
  TmaDescriptor b;
  TmaDescriptor a;
  int32_t a_by_tma = 0;
};

struct EpilogueParams {
  EpilogueKind kind = EpilogueKind::kStore;
  void* c = nullptr;  // kStore: [m_total, ldc]
  int64_t ldc = 0;
  const float* row_scale = nullptr;  // kStore: optional per-row factor (the gate of a position)
  // kStore: with c_row, row p of the problem is stored at row c_row[p] of C (of c_rows rows; a
  // row index outside [0, c_rows) is not stored): a top-1 layer's y and dx, whose rows are each
  // one position's, go from the GEMM straight to their tokens (8-byte stores where C is 8-byte
  // aligned and ldc % 4 == 0, else one element at a time).
  const int32_t* c_row = nullptr;
  int32_t c_rows = 0;
  Activation activation = Activation::kSwiglu;  // kActivation
  void* pre = nullptr;  // kActivation: optional [m_total, ld_pre], gate half then up half
  int64_t ld_pre = 0;
  void* act = nullptr;  // kActivation: [m_total, ld_act]
  int64_t ld_act = 0;
  // kActivation: where pre's and act's rows lie. Row p of the problem is row p of the output by
  // default; with pre_expert_row (act_expert_row), row p of expert e is stored at row
  // pre_expert_row[e] + (p - offsets[e]): a window of the layer writes its saved tensors at the
  // positions of the whole call's plan, where each expert's window rows are consecutive
  // (routing/window_plan_cuda.hpp). pre_out_rows and act_out_rows are the outputs' row counts
  // (0: m_total); rows at or past them are never written, whatever the arrays hold.
  const int32_t* pre_expert_row = nullptr;
  const int32_t* act_expert_row = nullptr;
  int32_t pre_out_rows = 0;
  int32_t act_out_rows = 0;
  // kActivationBackward (n = h): with da = acc rounded to the dtype (dact), g = row_scale[p] and
  // u = pre's column read at pre's placed row (pre_expert_row and pre_out_rows as above; pre is
  // an input here, loaded by TMA), act = f(u) rounded (plain: ReLU, GELU, SiLU):
  //   c [m_total, ldc] (dpre): g da f'(u);   act [m_total, ld_act]: g act
  // or, gated (SwiGLU, GeGLU; pre and dpre hold gate u then up b, 2n columns), act = f(u) b
  // rounded: dpre's gate half g da b f'(u), its up half g da f(u);
  //   dg[cb * ld_dg + p] = sum of da act over the columns of column block cb (kActBackwardBlockN wide)
  // Rows and columns past the problem's are never written.
  float* dg = nullptr;
  int64_t ld_dg = 0;
};

// The epilogue's TMA store maps, encoded on the host per launch (gemm/sm90/tensor_map.hpp). With
// `enabled`, a tile whose 128 rows all belong to its expert stages its outputs in shared memory
// and stores them by TMA (gemm/sm90/epilogue_tma.cuh), the stores draining while the next tile's
// MMAs run; the last tile of each expert, and every tile without `enabled` (an output TMA cannot
// address), stores from registers.
struct EpilogueMaps {
  TmaDescriptor out;  // kStore: C [rows][n]; kActivation(Backward): act [rows][n]
  TmaDescriptor pre;  // kActivation: pre, [rows][2][n] when gated (clipped at n per half); kActivationBackward: dpre
  TmaDescriptor pre_load;  // kActivationBackward: the pre it reads, shaped as `pre` (always set)
  int32_t enabled = 0;     // the stores' maps
  // kStore on the cooperative schedule, with `enabled`: a full tile's boxes are staged during
  // the next tile's mainloop (gemm/sm90/epilogue_deferred.cuh).
  int32_t defer = 0;
};

// The weight-gradient shape (varlen K): for every expert e, over its positions
// p in [offsets[e], offsets[e+1]) (the reduction),
//   C_e[i, j] = sum_p A[rowA(p), i] * B[rowB(p), j]      (+ C_e[i, j] when accumulate)
// with rowA(p) = a_index ? a_index[p] : p and likewise for B, so either operand can be gathered
// through the plan (x or dy) or read in expert order (dpre, g * act). An expert without
// positions gets C_e = 0 (left alone when accumulating). As for A above, a row index outside
// [0, rows) reads as zeros.
struct WeightGradParams {
  Schedule sched;      // only offsets and num_experts are read
  int32_t m = 0;       // rows of C_e: columns of A
  int32_t n = 0;       // columns of C_e: columns of B
  const void* a = nullptr;
  int64_t lda = 0;
  const int32_t* a_index = nullptr;
  int32_t a_rows = 0;
  const void* b = nullptr;
  int64_t ldb = 0;
  const int32_t* b_index = nullptr;
  int32_t b_rows = 0;
  void* c = nullptr;
  int64_t ldc = 0;
  int64_t c_expert_stride = 0;  // elements
  // C_e[i, j] lies at c_e[i * ldc + j], or at c_e[j * ldc + i] when transposed: dW_down [h, d]
  // is computed as (dy^T (g act))^T so that the gathered dy is the tile's narrower side.
  int32_t c_transposed = 0;
  int32_t accumulate = 0;
  // A sum over several launches (the fused engine's token windows) in fp32: acc32 is [E, m, n]
  // dense (never transposed). acc32_load adds acc32 to the tile's sum; acc32_store writes the sum to acc32 instead
  // of C. The last launch loads and writes C (with accumulate as above), rounding once.
  float* acc32 = nullptr;
  int32_t acc32_load = 0;
  int32_t acc32_store = 0;
  int32_t max_ctas = 0;  // as GroupedGemmParams::max_ctas
};

// The weight-gradient operands' TMA descriptors: an operand read in expert order (no index)
// comes by TMA in whole k-blocks, 64 x 64 boxes of its rows_tensor_map (set only for such an
// operand: the kernel's TmaA / TmaB say which).
struct WeightGradMaps {
  TmaDescriptor a, b;
};

}  // namespace sm90
}  // namespace gemm
}  // namespace v0
}  // namespace moeblaze
