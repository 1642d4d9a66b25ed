// Expert MLP building blocks for the CPU engine: row-panel GEMMs over weights stored in any
// float dtype (converted on the fly, fp32 accumulation, fixed summation order) and the
// activation forward/backward over a tile of rows.
#pragma once

#include <cstdint>

#include "core/config.hpp"
#include "core/view.hpp"
#include "util/dtype.hpp"
#include "util/function_ref.hpp"

namespace moeblaze {
inline namespace v0 {
namespace experts {

// Column block of the NN kernel; the scratch row of every kernel holds max(kColBlock, K, N) floats.
constexpr int64_t kColBlock = 512;

// C[R x N] = A[R x K] * B[K x N]. A, C fp32 (leading dims lda, ldc); B of dtype bt, row stride ldb.
void gemm_nn(int64_t R, int64_t N, int64_t K, const float* A, int64_t lda, const void* B, DType bt, int64_t ldb,
             float* C, int64_t ldc, float* scratch_row);

// C[R x N] = A[R x K] * B^T with B [N x K] of dtype bt, row stride ldb.
void gemm_nt(int64_t R, int64_t N, int64_t K, const float* A, int64_t lda, const void* B, DType bt, int64_t ldb,
             float* C, int64_t ldc, float* scratch_row);

// C[R x N] = A[R x K] * op(W_e), W_e the matrix of expert e of an expert-weight view: op = identity
// for a weight of logical shape [K x N], transpose for one of [N x K]. Row-major and column-major
// (View::transposed) weights alike; the two layouts meet in gemm_nn or gemm_nt.
void gemm_weight(int64_t R, int64_t N, int64_t K, const float* A, int64_t lda, const View& w, int64_t e,
                 bool transpose_w, float* C, int64_t ldc, float* scratch_row);

// Dot product with eight interleaved partial sums (vectorisable, fixed order).
float dot(const float* a, const float* b, int64_t n);

// Positions accumulate_outer takes per pass over acc (each element's sum still in ascending p).
constexpr int64_t kOuterRows = 4;

// acc[ib x N] = sum over p in [0, P) of a_p[ib] (outer) g_p[N], p ascending. fetch(p, a, g)
// fills a (ib floats) and g (N floats) for row p; a_scratch holds kOuterRows * ib floats and
// g_scratch kOuterRows * N. Used for every weight gradient.
void accumulate_outer(int64_t P, int64_t ib, int64_t N, FunctionRef<void(int64_t, float*, float*)> fetch,
                      float* acc, float* a_scratch, float* g_scratch);

// Activation over R rows: pre is [R x g*h] (gate then up columns), act is [R x h]; both fp32,
// act rounded to `round` (the activation dtype) as a 16-bit GEMM input would be.
void activation_forward(Activation a, int64_t R, int64_t h, const float* pre, float* act, DType round);

// dpre [R x g*h] from dact_scaled = gate * dact [R x h] and pre; rounded to `round`.
void activation_backward(Activation a, int64_t R, int64_t h, const float* pre, const float* dact_scaled,
                         float* dpre, DType round);

}  // namespace experts
}  // namespace v0
}  // namespace moeblaze
