#include "experts/expert_mlp.hpp"

#include <algorithm>

#include "math/activation.hpp"
#include "util/rows.hpp"

namespace moeblaze {
inline namespace v0 {
namespace experts {

float dot(const float* a, const float* b, int64_t n) {
  float part[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
  int64_t i = 0;
  for (; i + 8 <= n; i += 8)
    for (int q = 0; q < 8; ++q) part[q] += a[i + q] * b[i + q];
  float tail = 0.f;
  for (; i < n; ++i) tail += a[i] * b[i];
  return ((part[0] + part[1]) + (part[2] + part[3])) + ((part[4] + part[5]) + (part[6] + part[7])) + tail;
}

void gemm_nn(int64_t R, int64_t N, int64_t K, const float* A, int64_t lda, const void* B, DType bt, int64_t ldb,
             float* C, int64_t ldc, float* brow) {
  const size_t es = dtype_size(bt);
  for (int64_t n0 = 0; n0 < N; n0 += kColBlock) {
    const int64_t nb = std::min(kColBlock, N - n0);
    for (int64_t r = 0; r < R; ++r) std::fill(C + r * ldc + n0, C + r * ldc + n0 + nb, 0.f);
    for (int64_t kk = 0; kk < K; ++kk) {
      load_row(static_cast<const char*>(B) + (kk * ldb + n0) * static_cast<int64_t>(es), bt, nb, brow);
      for (int64_t r = 0; r < R; ++r) {
        const float a = A[r * lda + kk];
        float* c = C + r * ldc + n0;
        for (int64_t n = 0; n < nb; ++n) c[n] += a * brow[n];
      }
    }
  }
}

void gemm_nt(int64_t R, int64_t N, int64_t K, const float* A, int64_t lda, const void* B, DType bt, int64_t ldb,
             float* C, int64_t ldc, float* brow) {
  const size_t es = dtype_size(bt);
  for (int64_t n = 0; n < N; ++n) {
    load_row(static_cast<const char*>(B) + n * ldb * static_cast<int64_t>(es), bt, K, brow);
    for (int64_t r = 0; r < R; ++r) C[r * ldc + n] = dot(A + r * lda, brow, K);
  }
}

void gemm_weight(int64_t R, int64_t N, int64_t K, const float* A, int64_t lda, const View& w, int64_t e,
                 bool transpose_w, float* C, int64_t ldc, float* scratch_row) {
  // Physically, W_e is row-major with pitch stride[1]: [K x N] for gemm_nn, [N x K] for gemm_nt.
  const bool nt = transpose_w != w.transposed;
  (nt ? gemm_nt : gemm_nn)(R, N, K, A, lda, w.row(e, 0), w.dtype, w.stride[1], C, ldc, scratch_row);
}

// kOuterRows positions per pass over acc: each element still takes its terms one at a time in
// ascending p (the same bits as one position per pass), with a quarter of the passes' loads and
// stores of acc, which bound the loop (1.7x on one core).
void accumulate_outer(int64_t P, int64_t ib, int64_t N, FunctionRef<void(int64_t, float*, float*)> fetch,
                      float* acc, float* a, float* g) {
  static_assert(kOuterRows == 4, "the fused pass below takes four positions");
  std::fill(acc, acc + ib * N, 0.f);
  int64_t p = 0;
  for (; p + kOuterRows <= P; p += kOuterRows) {
    for (int64_t j = 0; j < kOuterRows; ++j) fetch(p + j, a + j * ib, g + j * N);
    const float *g0 = g, *g1 = g + N, *g2 = g + 2 * N, *g3 = g + 3 * N;
    for (int64_t i = 0; i < ib; ++i) {
      const float a0 = a[i], a1 = a[ib + i], a2 = a[2 * ib + i], a3 = a[3 * ib + i];
      float* row = acc + i * N;
      for (int64_t n = 0; n < N; ++n) row[n] = (((row[n] + a0 * g0[n]) + a1 * g1[n]) + a2 * g2[n]) + a3 * g3[n];
    }
  }
  for (; p < P; ++p) {
    fetch(p, a, g);
    for (int64_t i = 0; i < ib; ++i) {
      const float ai = a[i];
      float* row = acc + i * N;
      for (int64_t n = 0; n < N; ++n) row[n] += ai * g[n];
    }
  }
}

void activation_forward(Activation a, int64_t R, int64_t h, const float* pre, float* act, DType round) {
  const bool gated = is_gated(a);
  const int64_t ld = gated ? 2 * h : h;
  for (int64_t r = 0; r < R; ++r) {
    const float* p = pre + r * ld;
    float* o = act + r * h;
    if (gated)
      for (int64_t i = 0; i < h; ++i) o[i] = round_to(round, act_fn(a, p[i]) * p[h + i]);
    else
      for (int64_t i = 0; i < h; ++i) o[i] = round_to(round, act_fn(a, p[i]));
  }
}

void activation_backward(Activation a, int64_t R, int64_t h, const float* pre, const float* dact, float* dpre,
                         DType round) {
  const bool gated = is_gated(a);
  const int64_t ld = gated ? 2 * h : h;
  for (int64_t r = 0; r < R; ++r) {
    const float* p = pre + r * ld;
    const float* d = dact + r * h;
    float* o = dpre + r * ld;
    for (int64_t i = 0; i < h; ++i) {
      const ActBackward v = act_backward(a, p[i], gated ? p[h + i] : 0.f, d[i]);
      o[i] = round_to(round, v.du);
      if (gated) o[h + i] = round_to(round, v.db);
    }
  }
}

}  // namespace experts
}  // namespace v0
}  // namespace moeblaze
