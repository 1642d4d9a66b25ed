// Host interface of the sm_90a weight-gradient GEMM (varlen K; gemm/sm90/params.hpp's
// WeightGradParams says what it computes). Stream-ordered and sync-free: the reduction ranges
// come from the device expert offsets of a Schedule (grouped_gemm.hpp's make_schedule).
#pragma once

#include <cuda_runtime.h>

#include "gemm/sm90/params.hpp"
#include "util/dtype.hpp"

namespace moeblaze {
inline namespace v0 {
namespace gemm {
namespace sm90 {

// Why this GEMM cannot run here, or nullptr: dtype bf16 or fp16; m, n, lda, ldb multiples of 8;
// 16-byte aligned a and b; ldc and the expert stride even, c 4-byte aligned.
const char* weight_grad_unsupported_reason(DType dt, const WeightGradParams& p);

// One persistent launch: every expert's C_e, one CTA per 128 x 256 tile and its whole reduction
// (fixed order: bitwise deterministic, no atomics).
void weight_grad(DType dt, const WeightGradParams& p, cudaStream_t s);

}  // namespace sm90
}  // namespace gemm
}  // namespace v0
}  // namespace moeblaze
