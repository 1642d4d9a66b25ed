// The narrow router GEMM (src/routing/narrow_logits_cuda.cu) against an fp64 sum of the same
// 16-bit inputs: every expert count it serves (1-16: partial and whole column tiles), hidden sizes
// that end inside a k stage or take several warps per row tile, token counts that end inside a warp's and a block's
// rows, padded row strides, bf16 and fp16. The output is poisoned (NaN) before each run and guarded past its end; every
// case runs twice and must give the same bits. The refusals: too many experts, misaligned rows, mixed or 32-bit dtypes.
// Exits 77 (skipped) without a CUDA device.
#include <cuda_runtime.h>

#include <cmath>
#include <cstdio>
#include <cstring>
#include <random>
#include <vector>

#include "routing/narrow_logits_cuda.hpp"
#include "util/dtype.hpp"

// cmocka.h defines a fail() macro: include it after the library headers.
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
extern "C" {
#include <cmocka.h>
}

using namespace moeblaze;

namespace {

#define CK(call) assert_int_equal(static_cast<int>(call), static_cast<int>(cudaSuccess))

View matrix(void* data, DType t, int64_t rows, int64_t cols, int64_t ld) {
  View v;
  v.present = true;
  v.data = static_cast<char*>(data);
  v.dtype = t;
  v.ndim = 2;
  v.shape[0] = rows;
  v.shape[1] = cols;
  v.stride[0] = ld;
  v.stride[1] = 1;
  v.span_bytes = rows > 0 ? static_cast<size_t>(((rows - 1) * ld + cols) * 2) : 0;
  return v;
}

uint16_t to16(DType t, float v) { return t == DType::kBF16 ? f32_to_bf16(v) : f32_to_f16(v); }
float from16(DType t, uint16_t h) { return t == DType::kBF16 ? bf16_to_f32(h) : f16_to_f32(h); }

// One case; returns the largest error in units of its bound.
void run_case(DType t, int64_t L, int64_t E, int64_t d, int64_t ldx, int64_t ldw, std::mt19937_64& rng) {
  std::normal_distribution<float> normal(0.f, 1.f);
  std::vector<uint16_t> x(static_cast<size_t>(std::max<int64_t>(L, 1) * ldx)), w(static_cast<size_t>(E * ldw));
  for (auto& v : x) v = to16(t, normal(rng));
  for (auto& v : w) v = to16(t, 0.1f * normal(rng));
  const int64_t guard = 64;
  const size_t out_n = static_cast<size_t>(L * E + guard);
  void *dx, *dw;
  float* dout;
  CK(cudaMalloc(&dx, x.size() * 2));
  CK(cudaMalloc(&dw, w.size() * 2));
  CK(cudaMalloc(&dout, out_n * 4));
  CK(cudaMemcpy(dx, x.data(), x.size() * 2, cudaMemcpyHostToDevice));
  CK(cudaMemcpy(dw, w.data(), w.size() * 2, cudaMemcpyHostToDevice));
  const View xv = matrix(dx, t, L, d, ldx), wv = matrix(dw, t, E, d, ldw);
  const char* why = routing::narrow_logits_unsupported(xv, wv, E, d);
  if (why) fprintf(stderr, "refused: %s (L=%lld E=%lld d=%lld)\n", why, (long long)L, (long long)E, (long long)d);
  assert_null(why);
  std::vector<float> got[2];
  for (int run = 0; run < 2; ++run) {
    CK(cudaMemset(dout, 0xFF, out_n * 4));  // NaN everywhere, the guard included
    routing::narrow_logits_cuda(xv, wv, L, E, d, dout, nullptr);
    CK(cudaDeviceSynchronize());
    got[run].resize(out_n);
    CK(cudaMemcpy(got[run].data(), dout, out_n * 4, cudaMemcpyDeviceToHost));
  }
  assert_int_equal(memcmp(got[0].data(), got[1].data(), out_n * 4), 0);
  for (size_t i = static_cast<size_t>(L * E); i < out_n; ++i) assert_true(std::isnan(got[0][i]));
  double worst = 0;
  for (int64_t r = 0; r < L; ++r)
    for (int64_t e = 0; e < E; ++e) {
      double sum = 0, mag = 0;
      for (int64_t c = 0; c < d; ++c) {
        const double p = static_cast<double>(from16(t, x[static_cast<size_t>(r * ldx + c)])) *
                         from16(t, w[static_cast<size_t>(e * ldw + c)]);
        sum += p;
        mag += std::fabs(p);
      }
      const double v = got[0][static_cast<size_t>(r * E + e)];
      assert_false(std::isnan(v));
      // fp32 accumulation over d products (each exact in fp32) in some fixed order.
      const double bound = 1e-6 * static_cast<double>(d) * mag + 1e-30;
      worst = std::max(worst, std::fabs(v - sum) / bound);
    }
  if (worst > 1.0)
    fprintf(stderr, "L=%lld E=%lld d=%lld ldx=%lld ldw=%lld %s: error %.2f x bound\n", (long long)L, (long long)E,
            (long long)d, (long long)ldx, (long long)ldw, t == DType::kBF16 ? "bf16" : "fp16", worst);
  assert_true(worst <= 1.0);
  CK(cudaFree(dx));
  CK(cudaFree(dw));
  CK(cudaFree(dout));
}

void every_shape(void**) {
  std::mt19937_64 rng(20261128);
  const int64_t Ls[] = {1, 31, 33, 257, 1000};
  const int64_t Es[] = {1, 3, 4, 7, 8, 9, 13, 16};
  const int64_t ds[] = {8, 24, 64, 72, 136, 264, 520};  // 1, 2 and 4 warps to a row tile
  int cases = 0;
  for (DType t : {DType::kBF16, DType::kF16})
    for (int64_t L : Ls)
      for (int64_t E : Es)
        for (int64_t d : ds) {
          if ((L * 7 + E * 3 + d) % 3 != 0 && L != 257) continue;  // a spread of the grid, all of one L
          const int64_t ldx = (L + E) % 2 ? d : d + 8, ldw = (E + d) % 2 ? d : d + 16;
          run_case(t, L, E, d, ldx, ldw, rng);
          ++cases;
        }
  run_case(DType::kBF16, 4133, 8, 2056, 2056, 2056, rng);  // 8 warps to a tile, a partial last stage
  run_case(DType::kF16, 600, 8, 4096, 4104, 4096, rng);
  run_case(DType::kBF16, 777, 16, 1024, 1024, 1032, rng);
  printf("narrow logits: %d cases + 3 large, all within the fp32 bound, run twice bitwise\n", cases);
}

void refusals(void**) {
  alignas(16) static uint16_t buf[4096];
  const View x = matrix(buf, DType::kBF16, 4, 64, 64), w = matrix(buf, DType::kBF16, 8, 64, 64);
  assert_null(routing::narrow_logits_unsupported(x, w, 8, 64));
  assert_non_null(routing::narrow_logits_unsupported(x, matrix(buf, DType::kBF16, 17, 64, 64), 17, 64));
  assert_null(routing::narrow_logits_unsupported(matrix(buf, DType::kBF16, 1, 1024, 1024),
                                                 matrix(buf, DType::kBF16, 2, 1024, 1024), 16, 1024));
  assert_non_null(routing::narrow_logits_unsupported(matrix(buf, DType::kBF16, 1, 1032, 1032),
                                                     matrix(buf, DType::kBF16, 2, 1032, 1032), 9, 1032));
  assert_non_null(routing::narrow_logits_unsupported(x, w, 0, 64));
  assert_non_null(routing::narrow_logits_unsupported(matrix(buf, DType::kBF16, 4, 60, 60),
                                                     matrix(buf, DType::kBF16, 8, 60, 60), 8, 60));
  assert_non_null(routing::narrow_logits_unsupported(matrix(buf, DType::kBF16, 4, 64, 68), w, 8, 64));
  assert_non_null(routing::narrow_logits_unsupported(matrix(buf + 1, DType::kBF16, 4, 64, 64), w, 8, 64));
  assert_non_null(routing::narrow_logits_unsupported(matrix(buf, DType::kF16, 4, 64, 64), w, 8, 64));
  View f32 = matrix(buf, DType::kF32, 4, 64, 64);
  assert_non_null(routing::narrow_logits_unsupported(f32, f32, 8, 64));
}

}  // namespace

int main() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess || n == 0) {
    printf("test_narrow_logits_cuda: no CUDA device, skipped\n");
    return 77;
  }
  const struct CMUnitTest tests[] = {cmocka_unit_test(every_shape), cmocka_unit_test(refusals)};
  return cmocka_run_group_tests(tests, nullptr, nullptr);
}
