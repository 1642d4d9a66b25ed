// The sm_90a weight-gradient GEMM (gemm/sm90/weight_grad) against a naive fp32 reference kernel
// on fresh random operands, gradients poisoned with NaN: bf16 and fp16; A gathered and B in
// expert order (dW_gate_up = x^T dpre) and the reverse (dW_down = (g act)^T dy); m and n
// multiples of 8 but not of the tile; uniform, skewed and single-expert routings with empty
// experts (their gradient is zero, or left alone when accumulating); accumulate onto random
// values; C stored transposed (with accumulate); out-of-range indices (zero rows); an expert with thousands of positions (the stage
// ring wraps across tiles); bitwise determinism; padded gradient rows, stored by TMA and from
// registers, bitwise equal; sums over token windows in fp32, staged and from registers; both
// operands in expert order (by TMA); a grid capped below the SM count (the same bits). Exits 77
// (skipped) without an sm_90 GPU.
#include "grouped_gemm_problem.cuh"

#include "gemm/sm90/weight_grad.hpp"

#include <cstring>

#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <setjmp.h>
extern "C" {
#include <cmocka.h>
}

using namespace ggp;
namespace sm90 = moeblaze::gemm::sm90;

namespace {

struct WgShape {
  int64_t positions;  // L k
  int64_t tokens;     // rows of the gathered operand
  int32_t E, m, n;
  bool gather_a;      // else B is the gathered one
  double skew;        // as ggp::Shape
  bool accumulate, bad_indices;
  bool transposed = false;  // C_e stored [n, m] (dW_down as the engine computes it)
  int ld_pad = 0;           // extra elements per row of C_e (2: TMA cannot store it; registers do)
  int windows = 1;          // launches over consecutive position ranges, summed in fp32 (acc32)
  bool sums_misaligned = false;  // acc32 8- but not 16-byte aligned: its windows store from registers
  bool expert_order = false;     // neither operand gathered (the engine's copy in expert order): both by TMA
  int32_t max_ctas = 0;          // the persistent grid capped (0: one CTA per SM)
};

// ref[e, i, j] = init[e, i, j] (accumulate) + sum over the expert's positions of A[ra, i] B[rb, j].
template <class T>
__global__ void wgrad_reference_kernel(const T* a, const int32_t* ai, int64_t a_rows, const T* b, const int32_t* bi,
                                       int64_t b_rows, const int32_t* off, int m, int n, const float* init, float* ref) {
  const int e = blockIdx.z, i = blockIdx.y, j = blockIdx.x * blockDim.x + threadIdx.x;
  if (j >= n) return;
  float acc = init ? init[(static_cast<int64_t>(e) * m + i) * n + j] : 0.f;
  for (int32_t p = off[e]; p < off[e + 1]; ++p) {
    const int64_t ra = ai ? ai[p] : p, rb = bi ? bi[p] : p;
    if (ra < 0 || ra >= a_rows || rb < 0 || rb >= b_rows) continue;
    acc = fmaf(ld_f(a + ra * m + i), ld_f(b + rb * n + j), acc);
  }
  ref[(static_cast<int64_t>(e) * m + i) * n + j] = acc;
}

struct Result {
  double rel_err = 0;
  int64_t unwritten = 0;
  int64_t clobbered = 0;  // padding elements written
  std::vector<uint16_t> bits;  // [E, m, n]
};

Result run(const WgShape& s, DType dt, uint64_t seed) {
  std::mt19937_64 rng(seed);
  Shape rs{};
  rs.m_total = s.positions;
  rs.E = s.E;
  rs.skew = s.skew;
  const std::vector<int32_t> counts = make_counts(rs, rng);
  std::vector<int32_t> off(s.E + 1, 0);
  for (int e = 0; e < s.E; ++e) off[e + 1] = off[e] + counts[e];
  std::vector<int32_t> idx(std::max<int64_t>(s.positions, 1));
  std::uniform_int_distribution<int64_t> tok(0, s.tokens - 1);
  for (auto& v : idx) v = static_cast<int32_t>(tok(rng));
  if (s.bad_indices && s.positions > 2) {
    idx[0] = -1;
    idx[s.positions / 2] = static_cast<int32_t>(s.tokens);
  }
  const bool ga = s.gather_a && !s.expert_order, gb = !s.gather_a && !s.expert_order;  // the gathered operand
  const int64_t a_rows = ga ? s.tokens : s.positions, b_rows = gb ? s.tokens : s.positions;
  const int64_t c_elems = static_cast<int64_t>(s.E) * s.m * s.n;
  // C_e as stored: [c_rows][ldc], c_stride elements apart.
  const int64_t c_rows = s.transposed ? s.n : s.m, ldc = (s.transposed ? s.m : s.n) + s.ld_pad, c_stride = c_rows * ldc;
  const int64_t c_alloc = s.E * c_stride;
  auto c_at = [&](int64_t e, int64_t i, int64_t j) { return e * c_stride + (s.transposed ? j * ldc + i : i * ldc + j); };
  int32_t *d_off, *d_off_w, *d_idx;
  void *d_a, *d_b, *d_c, *d_sched;
  float *d_ref, *d_init = nullptr;
  GGP_CK(cudaMalloc(&d_off, 4 * (s.E + 1)));
  GGP_CK(cudaMalloc(&d_off_w, 4 * (s.E + 1)));
  GGP_CK(cudaMalloc(&d_idx, 4 * idx.size()));
  GGP_CK(cudaMalloc(&d_a, 2 * std::max<int64_t>(a_rows * s.m, 1)));
  GGP_CK(cudaMalloc(&d_b, 2 * std::max<int64_t>(b_rows * s.n, 1)));
  GGP_CK(cudaMalloc(&d_c, 2 * c_alloc));
  GGP_CK(cudaMalloc(&d_ref, 4 * c_elems));
  GGP_CK(cudaMalloc(&d_sched, sm90::schedule_bytes(s.E)));
  GGP_CK(cudaMemcpy(d_off, off.data(), 4 * off.size(), cudaMemcpyHostToDevice));
  GGP_CK(cudaMemcpy(d_idx, idx.data(), 4 * idx.size(), cudaMemcpyHostToDevice));
  fill_random(d_a, a_rows * s.m, dt, rng, 1.f);
  fill_random(d_b, b_rows * s.n, dt, rng, 1.f / std::sqrt(static_cast<float>(std::max<int64_t>(s.positions / s.E, 1))));
  if (s.accumulate) {  // random starting gradient; the reference starts from its rounded values
    fill_random(d_c, c_alloc, dt, rng, 0.5f);
    std::vector<uint16_t> h(c_alloc);
    std::vector<float> f(c_elems);
    GGP_CK(cudaMemcpy(h.data(), d_c, 2 * c_alloc, cudaMemcpyDeviceToHost));
    for (int64_t e = 0; e < s.E; ++e)  // the reference's [E, m, n] view of C's starting values
      for (int64_t i = 0; i < s.m; ++i)
        for (int64_t j = 0; j < s.n; ++j) f[(e * s.m + i) * s.n + j] = from_half_bits(h[c_at(e, i, j)], dt);
    GGP_CK(cudaMalloc(&d_init, 4 * c_elems));
    GGP_CK(cudaMemcpy(d_init, f.data(), 4 * c_elems, cudaMemcpyHostToDevice));
  } else {
    GGP_CK(cudaMemset(d_c, 0xFF, 2 * c_alloc));  // NaN poison
  }
  const int32_t* ai = ga ? d_idx : nullptr;
  const int32_t* bi = gb ? d_idx : nullptr;
  dim3 grid((s.n + 127) / 128, s.m, s.E);
  if (dt == DType::kBF16)
    wgrad_reference_kernel<<<grid, 128>>>(static_cast<const __nv_bfloat16*>(d_a), ai, a_rows,
                                          static_cast<const __nv_bfloat16*>(d_b), bi, b_rows, d_off, s.m, s.n, d_init, d_ref);
  else
    wgrad_reference_kernel<<<grid, 128>>>(static_cast<const __half*>(d_a), ai, a_rows, static_cast<const __half*>(d_b),
                                          bi, b_rows, d_off, s.m, s.n, d_init, d_ref);
  GGP_CK(cudaGetLastError());

  // Window w covers positions [P w / W, P (w + 1) / W): the experts' ranges clipped to it, the
  // expert-order operand from its first row, the index list from its first position.
  const int64_t a_es = 2 * s.m, b_es = 2 * s.n;  // bytes per operand row
  float* d_sums = nullptr;
  if (s.windows > 1) {
    GGP_CK(cudaMalloc(&d_sums, 4 * c_elems + 16));
    GGP_CK(cudaMemset(d_sums, 0xFF, 4 * c_elems + 16));  // NaN: the first window writes every sum
  }
  for (int w = 0; w < s.windows; ++w) {
    const int64_t start = s.positions * w / s.windows, end = s.positions * (w + 1) / s.windows;
    std::vector<int32_t> off_w(s.E + 1);
    for (int e = 0; e <= s.E; ++e) off_w[e] = static_cast<int32_t>(std::clamp<int64_t>(off[e], start, end) - start);
    GGP_CK(cudaMemcpy(d_off_w, off_w.data(), 4 * off_w.size(), cudaMemcpyHostToDevice));
    sm90::WeightGradParams p;
    p.sched = sm90::make_schedule(s.windows > 1 ? d_off_w : d_off, s.E, end - start, d_sched, nullptr);
    p.m = s.m;
    p.n = s.n;
    p.a = static_cast<const char*>(d_a) + (ga ? 0 : start * a_es);
    p.lda = s.m;
    p.a_index = ai ? ai + start : nullptr;
    p.a_rows = static_cast<int32_t>(ga ? a_rows : end - start);
    p.b = static_cast<const char*>(d_b) + (gb ? 0 : start * b_es);
    p.ldb = s.n;
    p.b_index = bi ? bi + start : nullptr;
    p.b_rows = static_cast<int32_t>(gb ? b_rows : end - start);
    p.c = d_c;
    p.ldc = ldc;
    p.c_expert_stride = c_stride;
    p.c_transposed = s.transposed;
    p.accumulate = s.accumulate;
    p.max_ctas = s.max_ctas;
    if (s.windows > 1) {
      p.acc32 = d_sums + (s.sums_misaligned ? 2 : 0);
      p.acc32_load = w > 0;
      p.acc32_store = w + 1 < s.windows;
    }
    sm90::weight_grad(dt, p, nullptr);
  }
  GGP_CK(cudaDeviceSynchronize());
  cudaFree(d_sums);

  Result r;
  std::vector<uint16_t> stored(c_alloc);
  std::vector<float> ref(c_elems);
  GGP_CK(cudaMemcpy(stored.data(), d_c, 2 * c_alloc, cudaMemcpyDeviceToHost));
  GGP_CK(cudaMemcpy(ref.data(), d_ref, 4 * c_elems, cudaMemcpyDeviceToHost));
  double num = 0, den = 0;
  r.bits.resize(c_elems);  // back to [E, m, n] for the comparison
  for (int64_t e = 0; e < s.E; ++e)
    for (int64_t i = 0; i < s.m; ++i)
      for (int64_t j = 0; j < s.n; ++j) r.bits[(e * s.m + i) * s.n + j] = stored[c_at(e, i, j)];
  if (!s.accumulate)  // the padding keeps its poison
    for (int64_t e = 0; e < s.E; ++e)
      for (int64_t row = 0; row < c_rows; ++row)
        for (int64_t col = ldc - s.ld_pad; col < ldc; ++col) r.clobbered += stored[e * c_stride + row * ldc + col] != 0xFFFF;
  for (int64_t i = 0; i < c_elems; ++i) {
    const float v = from_half_bits(r.bits[i], dt);
    if (std::isnan(v)) { ++r.unwritten; continue; }
    num += (v - ref[i]) * double(v - ref[i]);
    den += double(ref[i]) * ref[i];
  }
  r.rel_err = den > 0 ? std::sqrt(num / den) : std::sqrt(num);
  cudaFree(d_off); cudaFree(d_off_w); cudaFree(d_idx); cudaFree(d_a); cudaFree(d_b); cudaFree(d_c); cudaFree(d_ref); cudaFree(d_sched);
  cudaFree(d_init);
  return r;
}

double tolerance(DType dt) { return dt == DType::kBF16 ? 1e-2 : 2e-3; }

void expect(const WgShape& s, DType dt, uint64_t seed) {
  const Result r = run(s, dt, seed);
  if (r.rel_err > tolerance(dt) || r.unwritten)
    std::printf("wgrad P=%lld E=%d m=%d n=%d gather_a=%d expert_order=%d skew=%g acc=%d transposed=%d windows=%d %s: "
                "rel %.3g unwritten %lld\n",
                static_cast<long long>(s.positions), s.E, s.m, s.n, s.gather_a, s.expert_order, s.skew, s.accumulate,
                s.transposed, s.windows, dtype_name(dt),
                r.rel_err, static_cast<long long>(r.unwritten));
  assert_true(r.rel_err <= tolerance(dt));
  assert_int_equal(r.unwritten, 0);
  assert_int_equal(r.clobbered, 0);
}

const DType kTypes[] = {DType::kBF16, DType::kF16};

void shapes(void**) {
  uint64_t seed = 11;
  for (DType dt : kTypes) {
    expect({4096, 1024, 8, 256, 512, true, 0.0, false, false}, dt, seed++);   // dW_gate_up-like, tile multiples
    expect({3000, 700, 5, 136, 520, true, 1.2, false, false}, dt, seed++);    // tails in m, n and K, skewed
    expect({2500, 600, 6, 264, 200, false, 0.0, false, false}, dt, seed++);   // dW_down-like (B gathered)
    expect({1800, 400, 7, 72, 88, false, -1.0, false, false}, dt, seed++);    // all on expert 0, others empty
  }
}

void accumulate_and_bad_indices(void**) {
  uint64_t seed = 101;
  for (DType dt : kTypes) {
    expect({2000, 500, 6, 136, 264, true, -1.0, true, false}, dt, seed++);  // empty experts keep their values
    expect({2000, 500, 4, 128, 256, false, 0.0, true, true}, dt, seed++);
    expect({2000, 500, 4, 200, 136, true, 0.0, false, true}, dt, seed++);
  }
}

// dW_down as the fused engine computes it: dy gathered as A, g act in expert order as B, C
// stored transposed; tails in both dimensions, skew, accumulate and bad indices.
void transposed_output(void**) {
  uint64_t seed = 301;
  for (DType dt : kTypes) {
    expect({2500, 600, 6, 264, 200, true, 0.0, false, false, true}, dt, seed++);
    expect({3000, 700, 5, 136, 520, true, 1.2, true, false, true}, dt, seed++);
    expect({2000, 500, 4, 128, 256, true, -1.0, true, true, true}, dt, seed++);
  }
}

void long_reduction_and_tiny(void**) {
  expect({20000, 4000, 2, 136, 264, true, 0.0, false, false}, DType::kBF16, 7);  // 157 k-blocks per tile
  expect({1, 1, 1, 8, 8, true, 0.0, false, false}, DType::kBF16, 8);
  expect({64, 16, 256, 8, 16, false, 0.0, false, false}, DType::kF16, 9);      // E = 256, most experts empty
}

// Padded gradient rows: the TMA-stored epilogue (pad 8) and the register one (pad 2, a row stride
// TMA cannot take) give the same bits, plain and transposed, and leave the padding alone.
void staged_matches_registers(void**) {
  uint64_t seed = 401;
  for (bool tr : {false, true}) {
    WgShape s{3000, 700, 5, 136, 264, true, 0.7, false, false, tr, 8};
    expect(s, DType::kBF16, seed);
    const Result a = run(s, DType::kBF16, seed);
    s.ld_pad = 2;
    expect(s, DType::kBF16, seed);
    const Result b = run(s, DType::kBF16, seed);
    assert_true(a.bits == b.bits);
    ++seed;
  }
}

// The fused engine's token windows: the sums over 2-4 windows in fp32 (stored, then added by TMA
// reductions, the last window adding them before it rounds) against the one-launch reference,
// and bitwise equal to the same windows with the sums stored from registers (acc32 not 16-byte
// aligned); plain, transposed, accumulate, skewed with empty experts, tails.
void windowed_sums(void**) {
  uint64_t seed = 501;
  const WgShape shapes[] = {
      {4096, 1024, 8, 256, 512, true, 0.0, false, false, false, 0, 3},
      {3000, 700, 5, 136, 520, true, 1.2, false, false, false, 0, 2},
      {2500, 600, 6, 264, 200, true, 0.0, false, false, true, 0, 4},   // dW_down-like, transposed
      {2000, 500, 6, 136, 264, true, -1.0, true, false, false, 0, 3},  // accumulate, one expert
      {2000, 500, 4, 128, 256, false, 0.7, true, false, true, 0, 2},
  };
  for (const WgShape& base : shapes)
    for (DType dt : kTypes) {
      WgShape s = base;
      expect(s, dt, seed);
      const Result staged = run(s, dt, seed);
      s.sums_misaligned = true;
      const Result registers = run(s, dt, seed);
      assert_true(staged.bits == registers.bits);
      ++seed;
    }
}

// Both operands in expert order, both by TMA (the fused engine's backward on a copy of dy's or
// x's rows, gemm/sm90/heuristics.hpp): whole k-blocks by TMA and each expert's last, partial
// block by cp.async; tails, skew with empty experts, transposed, accumulate, windowed sums.
void both_in_expert_order(void**) {
  uint64_t seed = 601;
  WgShape shapes[] = {
      {4096, 4096, 8, 256, 512, true, 0.0, false, false},
      {3000, 3000, 5, 136, 520, true, 1.2, false, false},
      {2500, 2500, 6, 264, 200, true, 0.0, false, false, true},         // dW_down-like, transposed
      {2000, 2000, 6, 136, 264, true, -1.0, true, false, false},        // accumulate, one expert
      {3000, 3000, 5, 136, 264, true, 0.7, false, false, true, 0, 3},   // windowed sums
      {2000, 2000, 4, 128, 256, true, 0.0, true, false, false, 0, 2},
  };
  for (WgShape& s : shapes) {
    s.expert_order = true;
    for (DType dt : kTypes) expect(s, dt, seed++);
  }
  WgShape s = shapes[4];
  const Result a = run(s, DType::kBF16, 7), b = run(s, DType::kBF16, 7);
  assert_true(a.bits == b.bits);
}

void deterministic(void**) {
  const WgShape s{6000, 1500, 8, 136, 520, true, 0.8, false, false};
  const Result a = run(s, DType::kBF16, 5), b = run(s, DType::kBF16, 5), c = run(s, DType::kBF16, 5);
  assert_true(a.bits == b.bits);
  assert_true(a.bits == c.bits);
}

// A grid capped below the SM count (SMs left to another stream's kernels): within tolerance,
// and the same bits as the full grid (a tile's sum never depends on which CTA computes it).
void capped_grid(void**) {
  WgShape s{6000, 1500, 8, 136, 520, true, 0.8, false, false};
  const Result full = run(s, DType::kBF16, 9);
  for (int32_t ctas : {1, 5}) {
    s.max_ctas = ctas;
    expect(s, DType::kBF16, 9);
    assert_true(run(s, DType::kBF16, 9).bits == full.bits);
  }
}

}  // namespace

int main() {
  skip_without_sm90();
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(shapes),
      cmocka_unit_test(accumulate_and_bad_indices),
      cmocka_unit_test(transposed_output),
      cmocka_unit_test(long_reduction_and_tiny),
      cmocka_unit_test(deterministic),
      cmocka_unit_test(capped_grid),
      cmocka_unit_test(staged_matches_registers),
      cmocka_unit_test(windowed_sums),
      cmocka_unit_test(both_in_expert_order),
  };
  return cmocka_run_group_tests(tests, nullptr, nullptr);
}
