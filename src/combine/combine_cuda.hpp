// Token-order reductions on the GPU through token_index_map: one block per token, the k slots
// summed in slot order in fp32 (no atomics, deterministic). 16-byte vector access where rows
// allow it.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "core/view.hpp"
#include "core/memory_layout.hpp"

namespace moeblaze {
inline namespace v0 {
namespace combine {

// What a combine adds to each token's sum besides its slots' rows (either or both, or none):
// dense fp32 rows [L, d], and rows of a small matrix of out's dtype taken per pick, sum_j
// coef[t picks + j] rows[ids[t picks + j]] (j in order; an id outside [0, count) adds nothing).
// dx's router part: dense on the fp32 path, sum_j dl_tj W_g[id_tj] when d logits are zero off
// the picks (routing/router_cuda.hpp, grads_from_gates). The pointers start at the combine's
// first token.
struct TokenTerms {
  const float* dense_f32 = nullptr;
  const void* rows = nullptr;  // [count, d], row stride ld; 16-byte aligned rows take the vector path
  int64_t ld = 0, count = 0;
  const int32_t* ids = nullptr;
  const float* coef = nullptr;
  int64_t picks = 0;
};

// out_t = sum_j w_tj src[token_index_map[t k + j]] (+ the terms) (+ out_t if out.accumulate),
// with w = gates, or 1 when gates is null. src is dense [L k, d] of out's dtype. Serves y
// (w = gates) and dx (w = 1, the terms: the router's part). With
// row_out, row t goes to row_out[t] instead (nothing where it is null; out gives the dtype, and
// its rows are not written): an expert-parallel layer's rows stored straight into the ranks
// they return to. The addresses must be 16-byte aligned where d % 8 == 0. With row_out_first
// (a device value), the rows are taken from row *row_out_first - first_base on, wrapping
// around (the same sums, in another order of rows): expert-parallel ranks storing into each
// other then start at different ranks instead of all at the first.
void combine_rows_cuda(const int32_t* token_index_map, const float* gates, int64_t L, int64_t k, int64_t d,
                       const void* src, const TokenTerms& terms, const View& out, cudaStream_t s,
                       char* const* row_out = nullptr, const int32_t* row_out_first = nullptr,
                       int64_t first_base = 0);

// Zeroes row t of out (its dtype and row stride; 16-byte aligned rows where d % 8 == 0) for
// each token t < L none of whose k slots has a position in [0, L k): the rows that a GEMM
// storing straight at the tokens' rows (top-1 y and dx) leaves unwritten, a masked token's.
void zero_unrouted_rows_cuda(const int32_t* token_index_map, int64_t L, int64_t k, int64_t d, const View& out,
                             cudaStream_t s);

// out[t k + j] = v[pos] with pos = token_index_map[t k + j]; with parts > 1, the sum of
// v[c ld + pos] over c < parts in that order (per-column-block partial sums). A position past
// *rows_done (when given: the rows the producing GEMM wrote) or outside [0, L k) gives 0.
void to_token_order_cuda(const int32_t* token_index_map, int64_t L, int64_t k, const float* v, float* out, cudaStream_t s,
                         int64_t parts = 1, int64_t ld = 0, const int32_t* rows_done = nullptr);
// Dense fp32 [rows, cols] into a caller view (its dtype, row stride, accumulate flag); with
// `add`, src + add (the same shape) in that order.
void store_f32_rows_cuda(const float* src, int64_t rows, int64_t cols, const View& out, cudaStream_t s,
                         const float* add = nullptr);

}  // namespace combine
}  // namespace v0
}  // namespace moeblaze
