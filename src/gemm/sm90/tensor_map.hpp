// TMA descriptors of the sm_90a GEMMs' operands, encoded on the host through the driver's
// cuTensorMapEncodeTiled, reached via the runtime's entry-point query so the library links no
// libcuda. 128-byte swizzle and zero fill outside the tensor (the tails of a tile).
#pragma once

#include "gemm/sm90/params.hpp"
#include "util/dtype.hpp"

namespace moeblaze {
inline namespace v0 {
namespace gemm {
namespace sm90 {

// kMN: B_e is [K][ncols] (ncols = 2n gated, else n), box 64 k-rows x 64 columns.
// kK:  B_e is [ncols][K], box box_rows x 64 k.
TmaDescriptor weight_tensor_map(DType dt, const GroupedGemmParams& p, int box_rows);

// A row-major [rows, cols] matrix (row stride ld elements) read in 64 x 64 boxes: the operands
// that lie in expert order (the weight gradients' dpre and g act, the varlen-M GEMMs' A when it
// has no index list). rows >= 1.
TmaDescriptor rows_tensor_map(DType dt, const void* data, int64_t rows, int64_t cols, int64_t ld);

// The store map of an epilogue output [rows][halves][cols] (row stride ld elements; gated pre
// has two halves of cols columns side by side, so each half clips at cols): 64 x 64 boxes with
// 128-byte swizzle, rank 2 for one half, else rank 3 (boxes of one half). False, without
// failing, where TMA cannot address the output (not 16-byte aligned, strides not multiples of
// 16 bytes, no rows): the epilogue then stores from registers.
bool output_tensor_map(DType dt, void* data, int64_t rows, int64_t cols, int halves, int64_t ld, TmaDescriptor* out);

// The same for `experts` matrices [rows][cols] of row stride ld, expert_stride elements apart
// (the weight gradients, bf16/fp16, and their fp32 sums over token windows): rank 3, boxes of
// 64 rows x 128 bytes (64 x 64 x 1, fp32 32 x 64 x 1), clipped at each expert's rows and cols.
bool expert_matrices_tensor_map(DType dt, void* data, int64_t experts, int64_t rows, int64_t cols, int64_t ld,
                                int64_t expert_stride, TmaDescriptor* out);

}  // namespace sm90
}  // namespace gemm
}  // namespace v0
}  // namespace moeblaze
