// A probe of compute-sanitizer, not of MoEBlaze: a cuBLASLt GEMM into fresh memory, then a
// kernel that reads the result. Under `compute-sanitizer --tool initcheck` the bf16 case is
// reported as reading uninitialised memory (cuBLASLt's Hopper kernels store C with TMA bulk
// copies, which initcheck does not track) while the f32 case is clean. scripts/gpu-check.sh
// runs it to show why the library's initcheck pass sets MOEBLAZE_SANITIZER_INIT_GEMM_OUTPUTS=1.
// Usage: initcheck-tma-probe [0 = bf16 | 1 = f32]
#include <cublasLt.h>
#include <cuda_bf16.h>
#include <cstdio>
#include <cstdlib>
__global__ void reader(const uint4* c, size_t n, unsigned* sink) {
  unsigned acc = 0;
  for (size_t i = threadIdx.x + blockIdx.x * blockDim.x; i < n; i += gridDim.x * blockDim.x) acc ^= c[i].x ^ c[i].w;
  if (acc == 0x12345) *sink = acc;
}
int main(int argc, char** argv) {
  int dt = argc > 1 ? atoi(argv[1]) : 0;  // 0 bf16, 1 f32
  int M = 154, N = 112, K = 40;
  cudaDataType t = dt ? CUDA_R_32F : CUDA_R_16BF; size_t es = dt ? 4 : 2;
  void *A, *B, *C; unsigned* sink;
  cudaMalloc(&A, M * K * es); cudaMalloc(&B, K * N * es); cudaMalloc(&C, M * N * es); cudaMalloc(&sink, 4);
  cudaMemset(A, 0, M * K * es); cudaMemset(B, 0, K * N * es);
  cublasLtHandle_t h; cublasLtCreate(&h);
  cublasLtMatmulDesc_t op; cublasLtMatmulDescCreate(&op, CUBLAS_COMPUTE_32F, CUDA_R_32F);
  cublasLtMatrixLayout_t la, lb, lc;  // row-major C = A B as column-major C^T = B^T A^T
  cublasLtMatrixLayoutCreate(&lb, t, N, K, N); cublasLtMatrixLayoutCreate(&la, t, K, M, K); cublasLtMatrixLayoutCreate(&lc, t, N, M, N);
  cublasLtMatmulPreference_t pref; cublasLtMatmulPreferenceCreate(&pref);
  size_t wsb = 32 << 20; void* ws; cudaMalloc(&ws, wsb); cudaMemset(ws, 0, wsb);
  cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &wsb, sizeof wsb);
  cublasLtMatmulHeuristicResult_t r; int n = 0;
  cublasLtMatmulAlgoGetHeuristic(h, op, lb, la, lc, lc, pref, 1, &r, &n);
  float one = 1, zero = 0;
  int st = cublasLtMatmul(h, op, &one, B, lb, A, la, &zero, C, lc, C, lc, &r.algo, ws, wsb, 0);
  reader<<<4, 128>>>((const uint4*)C, M * N * es / 16, sink);
  printf("dtype %s status %d err %s\n", dt ? "f32" : "bf16", st, cudaGetErrorString(cudaDeviceSynchronize()));
}
