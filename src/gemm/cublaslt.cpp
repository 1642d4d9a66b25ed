#include "gemm/cublaslt.hpp"

#include <cstdlib>
#include <cstring>

#include "cuda/cuda_check.hpp"
#include "gemm/cublaslt_api.hpp"

namespace moeblaze {
inline namespace v0 {
namespace gemm {
namespace {

cudaDataType_t cuda_type(DType t) {
  switch (t) {
    case DType::kF32: return CUDA_R_32F;
    case DType::kF16: return CUDA_R_16F;
    case DType::kBF16: return CUDA_R_16BF;
    default: fail(Status::kInternalError, "cuBLASLt GEMM on dtype %s", dtype_name(t));
  }
}

// RAII for the per-call descriptors.
struct Descs {
  const CublasLtApi& api;
  cublasLtMatmulDesc_t op = nullptr;
  cublasLtMatrixLayout_t a = nullptr, b = nullptr, c = nullptr;
  cublasLtMatmulPreference_t pref = nullptr;
  explicit Descs(const CublasLtApi& lt) : api(lt) {}
  ~Descs() {
    if (pref) api.pref_destroy(pref);
    if (c) api.layout_destroy(c);
    if (b) api.layout_destroy(b);
    if (a) api.layout_destroy(a);
    if (op) api.desc_destroy(op);
  }
};

}  // namespace

CublasLtGemm::CublasLtGemm() {
  MOEBLAZE_CUBLAS_CHECK(cublaslt_api().create(&handle_));
  const char* init = std::getenv("MOEBLAZE_SANITIZER_INIT_GEMM_OUTPUTS");
  mark_outputs_initialized_ = init && std::strcmp(init, "1") == 0;
}
CublasLtGemm::~CublasLtGemm() {
  if (handle_) cublaslt_api().destroy(handle_);  // a handle means cuBLASLt was opened: no throw
}

void CublasLtGemm::gemm(int64_t M, int64_t N, int64_t K, const GemmOperand& A, const GemmOperand& B, void* C, DType ct,
                        int64_t ldc, float alpha, float beta, void* ws, size_t ws_bytes, cudaStream_t s) const {
  if (M == 0 || N == 0) return;
  // Row-major C = op(A) op(B) is column-major C^T = op(B)^T op(A)^T: cuBLASLt's first operand
  // is B (stored [K, N] row-major = [N, K] column-major when not transposed), its second A.
  const CublasLtApi& api = cublaslt_api();
  Descs d(api);
  MOEBLAZE_CUBLAS_CHECK(api.desc_create(&d.op, CUBLAS_COMPUTE_32F, CUDA_R_32F));
  cublasOperation_t opb = B.trans ? CUBLAS_OP_T : CUBLAS_OP_N, opa = A.trans ? CUBLAS_OP_T : CUBLAS_OP_N;
  MOEBLAZE_CUBLAS_CHECK(api.desc_set_attribute(d.op, CUBLASLT_MATMUL_DESC_TRANSA, &opb, sizeof opb));
  MOEBLAZE_CUBLAS_CHECK(api.desc_set_attribute(d.op, CUBLASLT_MATMUL_DESC_TRANSB, &opa, sizeof opa));
  // Stored (column-major) shapes before the op.
  const uint64_t b_rows = B.trans ? K : N, b_cols = B.trans ? N : K;
  const uint64_t a_rows = A.trans ? M : K, a_cols = A.trans ? K : M;
  MOEBLAZE_CUBLAS_CHECK(api.layout_create(&d.a, cuda_type(B.dtype), b_rows, b_cols, B.ld));
  MOEBLAZE_CUBLAS_CHECK(api.layout_create(&d.b, cuda_type(A.dtype), a_rows, a_cols, A.ld));
  MOEBLAZE_CUBLAS_CHECK(api.layout_create(&d.c, cuda_type(ct), N, M, ldc));
  MOEBLAZE_CUBLAS_CHECK(api.pref_create(&d.pref));
  MOEBLAZE_CUBLAS_CHECK(api.pref_set_attribute(d.pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws_bytes,
                                                             sizeof ws_bytes));
  cublasLtMatmulHeuristicResult_t heur;
  int found = 0;
  MOEBLAZE_CUBLAS_CHECK(api.algo_get_heuristic(handle_, d.op, d.a, d.b, d.c, d.c, d.pref, 1, &heur, &found));
  if (found == 0) fail(Status::kCublasError, "cuBLASLt found no algorithm for a %lld x %lld x %lld GEMM", static_cast<long long>(M), static_cast<long long>(N), static_cast<long long>(K));
  if (mark_outputs_initialized_ && beta == 0.f)
    MOEBLAZE_CUDA_CHECK(cudaMemset2DAsync(C, static_cast<size_t>(ldc) * dtype_size(ct), 0,
                                          static_cast<size_t>(N) * dtype_size(ct), static_cast<size_t>(M), s));
  MOEBLAZE_CUBLAS_CHECK(api.matmul(handle_, d.op, &alpha, B.data, d.a, A.data, d.b, &beta, C, d.c, C, d.c, &heur.algo,
                                       ws, ws_bytes, s));
}

}  // namespace gemm
}  // namespace v0
}  // namespace moeblaze
