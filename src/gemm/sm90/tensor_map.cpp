#include "gemm/sm90/tensor_map.hpp"

#include <cuda.h>
#include <cudaTypedefs.h>
#include <cuda_runtime.h>

#include <cstdlib>
#include <cstring>
#include <mutex>

#include "util/error.hpp"

namespace moeblaze {
inline namespace v0 {
namespace gemm {
namespace sm90 {
namespace {

PFN_cuTensorMapEncodeTiled_v12000 encoder() {
  static PFN_cuTensorMapEncodeTiled_v12000 fn = nullptr;
  static std::once_flag once;
  std::call_once(once, [] {
    void* f = nullptr;
    cudaDriverEntryPointQueryResult q{};
    if (cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &f, 12000, cudaEnableDefault, &q) == cudaSuccess &&
        q == cudaDriverEntryPointSuccess)
      fn = reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(f);
  });
  if (!fn) fail(Status::kCudaError, "the CUDA driver has no cuTensorMapEncodeTiled (driver too old for TMA)");
  return fn;
}

// Encodes a 2- or 3-D bf16/fp16/fp32 map with 128-byte swizzle and zero fill past the tensor.
CUresult try_encode(DType dt, const void* data, int rank, const cuuint64_t* dims, const cuuint64_t* byte_strides,
                    const cuuint32_t* box, TmaDescriptor* out) {
  static_assert(sizeof(CUtensorMap) == sizeof(TmaDescriptor), "TmaDescriptor holds a CUtensorMap");
  const cuuint32_t elem_strides[3] = {1, 1, 1};
  const CUtensorMapDataType type = dt == DType::kBF16  ? CU_TENSOR_MAP_DATA_TYPE_BFLOAT16
                                   : dt == DType::kF32 ? CU_TENSOR_MAP_DATA_TYPE_FLOAT32
                                                       : CU_TENSOR_MAP_DATA_TYPE_FLOAT16;
  CUtensorMap map;
  const CUresult r = encoder()(&map, type, rank, const_cast<void*>(data), dims, byte_strides, box, elem_strides,
                               CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
                               CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  if (r == CUDA_SUCCESS) std::memcpy(out->bytes, &map, sizeof(map));
  return r;
}

TmaDescriptor encode(DType dt, const void* data, int rank, const cuuint64_t* dims, const cuuint64_t* byte_strides,
                     const cuuint32_t* box, const char* what) {
  TmaDescriptor d;
  const CUresult r = try_encode(dt, data, rank, dims, byte_strides, box, &d);
  if (r != CUDA_SUCCESS)
    fail(Status::kNotSupported, "cuTensorMapEncodeTiled rejected the %s layout (error %d): strides must be "
         "multiples of 16 bytes and below 2^40", what, static_cast<int>(r));
  return d;
}

// Bytes per element: every map's strides and 128-byte box rows derive from it.
int64_t elem_bytes(DType dt) { return static_cast<int64_t>(dtype_size(dt)); }

// TMA store maps: 16-byte aligned data, strides multiples of 16 bytes, int32 coordinates.
bool storable(const void* data, int64_t rows, int64_t cols, int64_t ld, int64_t es) {
  return data && rows > 0 && cols > 0 && reinterpret_cast<uintptr_t>(data) % 16 == 0 && (ld * es) % 16 == 0 &&
         (cols * es) % 16 == 0 && rows < (int64_t{1} << 31);
}

}  // namespace

TmaDescriptor weight_tensor_map(DType dt, const GroupedGemmParams& p, int box_rows) {
  const cuuint64_t ncols = static_cast<cuuint64_t>(p.gated ? 2 * p.n : p.n);
  const bool mn = p.b_major == Major::kMN;
  const cuuint64_t dims[3] = {mn ? ncols : static_cast<cuuint64_t>(p.k), mn ? static_cast<cuuint64_t>(p.k) : ncols,
                              static_cast<cuuint64_t>(p.sched.num_experts)};
  const int64_t es = elem_bytes(dt);
  const cuuint64_t strides[2] = {static_cast<cuuint64_t>(p.ldb * es), static_cast<cuuint64_t>(p.b_expert_stride * es)};
  const cuuint32_t box[3] = {static_cast<cuuint32_t>(128 / es), mn ? 64u : static_cast<cuuint32_t>(box_rows), 1};
  return encode(dt, p.b, 3, dims, strides, box, "weight");
}

TmaDescriptor rows_tensor_map(DType dt, const void* data, int64_t rows, int64_t cols, int64_t ld) {
  const cuuint64_t dims[2] = {static_cast<cuuint64_t>(cols), static_cast<cuuint64_t>(rows)};
  const int64_t es = elem_bytes(dt);
  const cuuint64_t strides[1] = {static_cast<cuuint64_t>(ld * es)};
  const cuuint32_t box[2] = {static_cast<cuuint32_t>(128 / es), 64};
  return encode(dt, data, 2, dims, strides, box, "weight-gradient operand");
}

bool output_tensor_map(DType dt, void* data, int64_t rows, int64_t cols, int halves, int64_t ld, TmaDescriptor* out) {
  const int64_t es = elem_bytes(dt);
  if (!storable(data, rows, cols, ld, es)) return false;
  const cuuint64_t strides[2] = {static_cast<cuuint64_t>(cols * es), static_cast<cuuint64_t>(ld * es)};
  const cuuint32_t box_cols = static_cast<cuuint32_t>(128 / es);  // 128-byte rows
  if (halves == 1) {  // [rows][cols]
    const cuuint64_t dims[2] = {static_cast<cuuint64_t>(cols), static_cast<cuuint64_t>(rows)};
    const cuuint32_t box[2] = {box_cols, 64};
    return try_encode(dt, data, 2, dims, strides + 1, box, out) == CUDA_SUCCESS;
  }
  const cuuint64_t dims[3] = {static_cast<cuuint64_t>(cols), static_cast<cuuint64_t>(halves), static_cast<cuuint64_t>(rows)};
  const cuuint32_t box[3] = {box_cols, 1, 64};
  return try_encode(dt, data, 3, dims, strides, box, out) == CUDA_SUCCESS;
}

bool expert_matrices_tensor_map(DType dt, void* data, int64_t experts, int64_t rows, int64_t cols, int64_t ld,
                                int64_t expert_stride, TmaDescriptor* out) {
  const int64_t es = elem_bytes(dt);
  if (!storable(data, rows, cols, ld, es) || experts <= 0 || (expert_stride * es) % 16) return false;
  const cuuint64_t dims[3] = {static_cast<cuuint64_t>(cols), static_cast<cuuint64_t>(rows), static_cast<cuuint64_t>(experts)};
  const cuuint64_t strides[2] = {static_cast<cuuint64_t>(ld * es), static_cast<cuuint64_t>(expert_stride * es)};
  const cuuint32_t box[3] = {static_cast<cuuint32_t>(128 / es), 64, 1};  // 128-byte rows
  return try_encode(dt, data, 3, dims, strides, box, out) == CUDA_SUCCESS;
}

}  // namespace sm90
}  // namespace gemm
}  // namespace v0
}  // namespace moeblaze
