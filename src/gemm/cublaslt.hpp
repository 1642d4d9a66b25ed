// Row-major GEMMs through cuBLASLt: C = alpha op(A) op(B) + beta C, fp32 accumulation
// (CUBLAS_COMPUTE_32F; no TF32 for fp32 data, so fp32 stays at fp32 accuracy).
#pragma once

#include <cublasLt.h>
#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

#include "util/dtype.hpp"

namespace moeblaze {
inline namespace v0 {
namespace gemm {

struct GemmOperand {
  const void* data;
  DType dtype;
  int64_t ld;  // row stride in elements (row-major)
  bool trans;  // op(X) = X^T
};

class CublasLtGemm {
 public:
  CublasLtGemm();
  ~CublasLtGemm();
  CublasLtGemm(const CublasLtGemm&) = delete;
  CublasLtGemm& operator=(const CublasLtGemm&) = delete;

  // C[M, N] (row-major, dtype c_dtype, row stride ldc) = alpha op(A)[M, K] op(B)[K, N] + beta C.
  void gemm(int64_t M, int64_t N, int64_t K, const GemmOperand& A, const GemmOperand& B, void* C, DType c_dtype,
            int64_t ldc, float alpha, float beta, void* workspace, size_t workspace_bytes, cudaStream_t s) const;

  static constexpr size_t kWorkspaceBytes = size_t{32} << 20;

 private:
  cublasLtHandle_t handle_ = nullptr;
  // MOEBLAZE_SANITIZER_INIT_GEMM_OUTPUTS=1 (read once, at creation): zero each output before a
  // beta = 0 GEMM. compute-sanitizer's initcheck does not see the TMA bulk stores of cuBLASLt's
  // Hopper kernels, so without it every read of a bf16/fp16 GEMM output is reported as
  // uninitialised (reproduced standalone, see scripts/gpu-check.sh). A test-only knob.
  bool mark_outputs_initialized_ = false;
};

}  // namespace gemm
}  // namespace v0
}  // namespace moeblaze
