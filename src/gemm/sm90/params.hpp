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
};

// The sanitised expert ranges and their row-block prefix (gemm/grouped_tiles.hpp), made on the
// device once per call by make_schedule and shared by every GEMM of the call with this block_m.
struct Schedule {
  const int32_t* offsets = nullptr;    // [E + 1] clamped to [0, m_total] and non-decreasing
  const int32_t* rb_prefix = nullptr;  // [E + 1]
  int32_t num_experts = 0;
  int32_t m_total = 0;                 // rows of C (L k)
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
};

// A CUtensorMap (128 opaque bytes, 64-byte aligned) by value: the weights' TMA descriptor,
// encoded on the host per launch (gemm/sm90/tensor_map.hpp) and passed as a __grid_constant__
// kernel parameter, so graph capture records it with the launch.
struct alignas(64) TmaDescriptor {
  unsigned char bytes[128];
};

struct EpilogueParams {
  EpilogueKind kind = EpilogueKind::kStore;
  void* c = nullptr;  // kStore: [m_total, ldc]
  int64_t ldc = 0;
  const float* row_scale = nullptr;  // kStore: optional per-row factor (the gate of a position)
  Activation activation = Activation::kSwiglu;  // kActivation
  void* pre = nullptr;  // kActivation: optional [m_total, ld_pre], gate half then up half
  int64_t ld_pre = 0;
  void* act = nullptr;  // kActivation: [m_total, ld_act]
  int64_t ld_act = 0;
  // kActivation: optional row maps. Row p of the problem is stored at pre row pre_rows[p] and act
  // row act_rows[p] instead of p: a window of the layer writes its saved tensors at the
  // positions of the whole call's plan (engines/fused/window.hpp).
  const int32_t* pre_rows = nullptr;
  const int32_t* act_rows = nullptr;
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
};

}  // namespace sm90
}  // namespace gemm
}  // namespace v0
}  // namespace moeblaze
