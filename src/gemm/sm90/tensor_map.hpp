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

// A row-major [rows, cols] matrix (row stride ld elements) read in 64 x 64 boxes: the
// weight-gradient operands that lie in expert order (dpre, g act). rows >= 1.
TmaDescriptor rows_tensor_map(DType dt, const void* data, int64_t rows, int64_t cols, int64_t ld);

}  // namespace sm90
}  // namespace gemm
}  // namespace v0
}  // namespace moeblaze
