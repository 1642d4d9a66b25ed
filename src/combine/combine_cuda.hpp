// Token-order reductions on the GPU through token_index_map: one block per token, slots summed
// in slot order in fp32 (no atomics, deterministic).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "core/args.hpp"
#include "core/memory_layout.hpp"

namespace moeblaze {
inline namespace v0 {
namespace combine {

// y_t = sum_j gates_tj O[token_index_map[t k + j]]; O is dense [L k, d] of dtype o_dtype.
void combine_outputs_cuda(const RoutingPlan& plan, int64_t L, int64_t k, int64_t d, const void* O, DType o_dtype,
                          const View& y, cudaStream_t s);

// dx_t (+)= sum_j part[token_index_map[t k + j]] (+ extra_f32[t] when non-null); part is dense
// [L k, d] of dtype part_dtype, extra dense fp32 [L, d].
void reduce_dx_cuda(const RoutingPlan& plan, int64_t L, int64_t k, int64_t d, const void* part, DType part_dtype,
                    const float* extra_f32, const View& dx, cudaStream_t s);

// out[t k + j] = v[token_index_map[t k + j]], optionally written to a caller view (dtype,
// strides, accumulate) instead of a dense fp32 buffer.
void to_token_order_cuda(const RoutingPlan& plan, int64_t L, int64_t k, const float* v, float* out, cudaStream_t s);
void store_f32_rows_cuda(const float* src, int64_t rows, int64_t cols, const View& out, cudaStream_t s);

}  // namespace combine
}  // namespace v0
}  // namespace moeblaze
