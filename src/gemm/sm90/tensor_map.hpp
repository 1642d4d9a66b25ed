// TMA descriptors of the grouped GEMM's B operand (the experts' weights), encoded on the host
// through the driver's cuTensorMapEncodeTiled, reached via the runtime's entry-point query so
// the library links no libcuda. A 3-D map [E][rows][columns] with 128-byte swizzle and zero
// fill outside the tensor (the K and N tails of a tile).
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

}  // namespace sm90
}  // namespace gemm
}  // namespace v0
}  // namespace moeblaze
