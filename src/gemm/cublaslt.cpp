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

// The per-call descriptors, initialised in place (cuBLASLt's *Init calls on caller-owned
// opaque storage) instead of created: a GEMM allocates no host memory.
struct Descs {
  cublasLtMatmulDescOpaque_t op_storage;
  cublasLtMatrixLayoutOpaque_t a_storage, b_storage, c_storage;
  cublasLtMatmulPreferenceOpaque_t pref_storage;
  cublasLtMatmulDesc_t op = &op_storage;
  cublasLtMatrixLayout_t a = &a_storage, b = &b_storage, c = &c_storage;
  cublasLtMatmulPreference_t pref = &pref_storage;
};

// The largest power of two (at most 256) that divides an address: cuBLASLt's preference
// defaults assume 256-byte operands, and an algorithm chosen under that assumption may fault on
// a row view in the middle of a tensor.
uint32_t alignment_of(const void* p) {
  const uintptr_t a = reinterpret_cast<uintptr_t>(p);
  const uintptr_t low = a & (~a + 1);
  return static_cast<uint32_t>(a == 0 || low > 256 ? 256 : low);
}

}  // namespace

bool CublasLtGemm::AlgoKey::operator==(const AlgoKey& o) const {
  return m == o.m && n == o.n && k == o.k && lda == o.lda && ldb == o.ldb && ldc == o.ldc && a_dtype == o.a_dtype &&
         b_dtype == o.b_dtype && c_dtype == o.c_dtype && a_trans == o.a_trans && b_trans == o.b_trans &&
         align[0] == o.align[0] && align[1] == o.align[1] && align[2] == o.align[2] && align[3] == o.align[3] &&
         workspace_bytes == o.workspace_bytes;
}

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
  Descs d;
  MOEBLAZE_CUBLAS_CHECK(api.desc_init(d.op, sizeof d.op_storage, CUBLAS_COMPUTE_32F, CUDA_R_32F));
  cublasOperation_t opb = B.trans ? CUBLAS_OP_T : CUBLAS_OP_N, opa = A.trans ? CUBLAS_OP_T : CUBLAS_OP_N;
  MOEBLAZE_CUBLAS_CHECK(api.desc_set_attribute(d.op, CUBLASLT_MATMUL_DESC_TRANSA, &opb, sizeof opb));
  MOEBLAZE_CUBLAS_CHECK(api.desc_set_attribute(d.op, CUBLASLT_MATMUL_DESC_TRANSB, &opa, sizeof opa));
  // Stored (column-major) shapes before the op.
  const uint64_t b_rows = B.trans ? K : N, b_cols = B.trans ? N : K;
  const uint64_t a_rows = A.trans ? M : K, a_cols = A.trans ? K : M;
  MOEBLAZE_CUBLAS_CHECK(api.layout_init(d.a, sizeof d.a_storage, cuda_type(B.dtype), b_rows, b_cols, B.ld));
  MOEBLAZE_CUBLAS_CHECK(api.layout_init(d.b, sizeof d.b_storage, cuda_type(A.dtype), a_rows, a_cols, A.ld));
  MOEBLAZE_CUBLAS_CHECK(api.layout_init(d.c, sizeof d.c_storage, cuda_type(ct), N, M, ldc));
  MOEBLAZE_CUBLAS_CHECK(api.pref_init(d.pref, sizeof d.pref_storage));
  MOEBLAZE_CUBLAS_CHECK(api.pref_set_attribute(d.pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws_bytes,
                                                             sizeof ws_bytes));
  // cuBLASLt's A is our B (see above), its B our A, and C is D.
  const uint32_t align[4] = {alignment_of(B.data), alignment_of(A.data), alignment_of(C), alignment_of(C)};
  const cublasLtMatmulPreferenceAttributes_t align_attr[4] = {
      CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES,
      CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES};
  for (int i = 0; i < 4; ++i)
    MOEBLAZE_CUBLAS_CHECK(api.pref_set_attribute(d.pref, align_attr[i], &align[i], sizeof align[i]));
  // Split-K partial sums reduced in fp32 only: a reduction in the output type (in place in the
  // output, or in the workspace) rounds each partial to bf16/fp16, an absolute error of a few
  // ulps of the partials that flips ReLU's derivative wherever the exact sum lies within it of
  // zero. In place stays allowed for fp32 outputs (the router's logits and weight gradient).
  const uint32_t reduction = CUBLASLT_REDUCTION_SCHEME_COMPUTE_TYPE |
                             (ct == DType::kF32 ? uint32_t{CUBLASLT_REDUCTION_SCHEME_INPLACE} : 0u);
  MOEBLAZE_CUBLAS_CHECK(api.pref_set_attribute(d.pref, CUBLASLT_MATMUL_PREF_REDUCTION_SCHEME_MASK, &reduction,
                                                sizeof reduction));
  const AlgoKey key{M, N, K, A.ld, B.ld, ldc, static_cast<int32_t>(A.dtype), static_cast<int32_t>(B.dtype),
                    static_cast<int32_t>(ct), A.trans, B.trans, {align[0], align[1], align[2], align[3]}, ws_bytes};
  cublasLtMatmulAlgo_t algo;
  bool cached = false;
  {
    std::lock_guard<std::mutex> lock(algo_mutex_);
    for (const AlgoEntry& e : algo_cache_)
      if (e.used && e.key == key) {
        algo = e.algo;
        cached = true;
        break;
      }
  }
  if (!cached) {
    cublasLtMatmulHeuristicResult_t heur;
    int found = 0;
    MOEBLAZE_CUBLAS_CHECK(api.algo_get_heuristic(handle_, d.op, d.a, d.b, d.c, d.c, d.pref, 1, &heur, &found));
    if (found == 0)
      fail(Status::kCublasError, "cuBLASLt found no algorithm for a %lld x %lld x %lld GEMM", static_cast<long long>(M),
           static_cast<long long>(N), static_cast<long long>(K));
    algo = heur.algo;
    std::lock_guard<std::mutex> lock(algo_mutex_);
    AlgoEntry& slot = algo_cache_[algo_next_];
    algo_next_ = (algo_next_ + 1) % kAlgoCacheSize;
    slot.key = key;
    slot.algo = algo;
    slot.used = true;
  }
  if (mark_outputs_initialized_) {
    if (beta == 0.f)
      MOEBLAZE_CUDA_CHECK(cudaMemset2DAsync(C, static_cast<size_t>(ldc) * dtype_size(ct), 0,
                                            static_cast<size_t>(N) * dtype_size(ct), static_cast<size_t>(M), s));
    // Split-K algorithms store their partial sums into the workspace by TMA too, and their
    // reduction kernel then reads them.
    if (ws && ws_bytes) MOEBLAZE_CUDA_CHECK(cudaMemsetAsync(ws, 0, ws_bytes, s));
  }
  MOEBLAZE_CUBLAS_CHECK(api.matmul(handle_, d.op, &alpha, B.data, d.a, A.data, d.b, &beta, C, d.c, C, d.c, &algo,
                                       ws, ws_bytes, s));
}

}  // namespace gemm
}  // namespace v0
}  // namespace moeblaze
