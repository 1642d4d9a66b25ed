// The sm_90a grouped GEMM (gemm/sm90) against a naive fp32 reference kernel on fresh random
// operands, outputs poisoned: both B layouts, block_n 128 and 256 and the ping-pong schedule,
// bf16 and fp16, gathered and
// contiguous A, uniform, skewed and single-expert routings with empty experts, n and K multiples
// of 8 but not of 64, one row, E = 256, every activation in the fused epilogue, out-of-range
// gather indices (zero rows, no stray reads), bitwise determinism. Exits 77 (skipped) without an
// sm_90 GPU.
#include "grouped_gemm_problem.cuh"

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

double tolerance(DType dt) { return dt == DType::kBF16 ? 1e-2 : 2e-3; }

// The kernels under test, as bn codes in the messages: 128 and 256 cooperative, -128 ping-pong.
const int kBlockNs[] = {128, 256, -128};
sm90::KernelChoice kernel_choice(int bn) {
  sm90::KernelChoice kc;
  kc.block_n = bn < 0 ? -bn : bn;
  kc.schedule = bn < 0 ? sm90::ConsumerSchedule::kPingPong : sm90::ConsumerSchedule::kCooperative;
  return kc;
}

// ld_pad: extra columns per output row, which must keep their poison (8: the 16-byte store
// path with padding; 2: an ld that is not a multiple of 8, the pair-store path).
std::vector<uint16_t> run_store(const Problem& P, int bn, bool scaled, Check* c, int64_t ld_pad = 0) {
  const int64_t ld = P.s.n + ld_pad;
  void* out = alloc_poisoned(P.s.m_total * ld);
  sm90::EpilogueParams e;
  e.kind = sm90::EpilogueKind::kStore;
  e.c = out;
  e.ldc = ld;
  e.row_scale = scaled ? P.d_scale : nullptr;
  sm90::grouped_gemm(P.dt, P.params(), e, kernel_choice(bn), nullptr);
  GGP_CK(cudaDeviceSynchronize());
  *c = compare(out, P.s.m_total, P.s.n, ld, P.dt, want_store(P, scaled));
  std::vector<uint16_t> bits(std::max<int64_t>(P.s.m_total * ld, 1));
  GGP_CK(cudaMemcpy(bits.data(), out, P.s.m_total * ld * 2, cudaMemcpyDeviceToHost));
  cudaFree(out);
  return bits;
}

void expect_store(const Shape& s, DType dt, int bn, uint64_t seed, bool bad = false) {
  Problem P = make_problem(s, dt, seed, bad);
  Check c;
  run_store(P, bn, seed % 2 == 0, &c);
  if (c.rel_err > tolerance(dt) || c.unwritten || c.clobbered)
    std::printf("store m=%lld E=%d n=%d k=%d gather=%d major=%d skew=%g bn=%d %s: rel %.3g unwritten %lld\n",
                static_cast<long long>(s.m_total), s.E, s.n, s.k, s.gather, static_cast<int>(s.b_major), s.skew, bn,
                dtype_name(dt), c.rel_err, static_cast<long long>(c.unwritten));
  assert_true(c.rel_err <= tolerance(dt));
  assert_int_equal(c.unwritten, 0);
  free_problem(P);
}

const Major kMajors[] = {Major::kMN, Major::kK};
const DType kTypes[] = {DType::kBF16, DType::kF16};

void store_shapes(void**) {
  uint64_t seed = 1;
  for (DType dt : kTypes)
    for (Major mj : kMajors)
      for (int bn : kBlockNs) {
        expect_store({1000, 700, 8, 200, 136, false, true, mj, 0.0}, dt, bn, seed++);       // n, K not multiples of 64
        expect_store({3000, 3000, 16, 264, 520, false, false, mj, 1.2}, dt, bn, seed++);    // skewed, contiguous A
        expect_store({1, 1, 1, 8, 8, false, true, mj, 0.0}, dt, bn, seed++);                // one row, E = 1
        expect_store({2000, 500, 12, 128, 64, false, true, mj, -1.0}, dt, bn, seed++);      // all rows on one expert
      }
}

void many_experts(void**) {
  expect_store({8192, 1024, 256, 256, 192, false, true, Major::kMN, 0.0}, DType::kBF16, 256, 77);
  expect_store({8192, 1024, 256, 96, 256, false, true, Major::kK, 0.5}, DType::kBF16, 128, 78);
  expect_store({8192, 1024, 256, 136, 200, false, true, Major::kMN, 0.8}, DType::kBF16, -128, 79);
}

void bad_indices(void**) {
  expect_store({1000, 300, 4, 128, 128, false, true, Major::kMN, 0.0}, DType::kBF16, 128, 9, true);
  expect_store({1000, 300, 4, 128, 128, false, true, Major::kK, 0.0}, DType::kF16, 256, 10, true);
  expect_store({1000, 300, 4, 128, 128, false, true, Major::kMN, 0.0}, DType::kBF16, -128, 11, true);
}

// The activation epilogue against the reference; ld_pad as run_store's, on both outputs.
void expect_activation(Activation a, DType dt, int bn, Major mj, uint64_t seed, int64_t ld_pad) {
  const bool gated = is_gated(a);
  Problem P = make_problem({1200, 800, 6, 136, 200, gated, true, mj, 0.7}, dt, seed);
  const int64_t n = P.s.n, nc = P.ncols(), ld_pre = nc + ld_pad, ld_act = n + ld_pad;
  void* pre = alloc_poisoned(P.s.m_total * ld_pre);
  void* act = alloc_poisoned(P.s.m_total * ld_act);
  sm90::EpilogueParams e;
  e.kind = sm90::EpilogueKind::kActivation;
  e.activation = a;
  e.pre = pre;
  e.ld_pre = ld_pre;
  e.act = act;
  e.ld_act = ld_act;
  sm90::grouped_gemm(dt, P.params(), e, kernel_choice(bn), nullptr);
  GGP_CK(cudaDeviceSynchronize());
  std::vector<float> want_pre = reference(P);
  for (auto& v : want_pre) v = round_to(v, dt);
  const Check cp = compare(pre, P.s.m_total, nc, ld_pre, dt, want_pre);
  const Check ca = compare(act, P.s.m_total, n, ld_act, dt, want_act(P, a));
  if (cp.rel_err > tolerance(dt) || ca.rel_err > tolerance(dt) || cp.unwritten || ca.unwritten || cp.clobbered ||
      ca.clobbered)
    std::printf("act %d %s bn=%d major=%d pad=%lld: pre rel %.3g (unwritten %lld, clobbered %lld) act rel %.3g "
                "(unwritten %lld, clobbered %lld)\n",
                static_cast<int>(a), dtype_name(dt), bn, static_cast<int>(mj), static_cast<long long>(ld_pad),
                cp.rel_err, static_cast<long long>(cp.unwritten), static_cast<long long>(cp.clobbered), ca.rel_err,
                static_cast<long long>(ca.unwritten), static_cast<long long>(ca.clobbered));
  assert_true(cp.rel_err <= tolerance(dt) && ca.rel_err <= tolerance(dt));
  assert_int_equal(cp.unwritten + ca.unwritten, 0);
  assert_int_equal(cp.clobbered + ca.clobbered, 0);
  cudaFree(pre);
  cudaFree(act);
  free_problem(P);
}

void activations(void**) {
  const Activation acts[] = {Activation::kRelu, Activation::kGelu, Activation::kSilu, Activation::kSwiglu,
                             Activation::kGeglu};
  uint64_t seed = 100;
  for (DType dt : kTypes)
    for (Activation a : acts)
      for (int bn : kBlockNs)
        for (Major mj : kMajors) expect_activation(a, dt, bn, mj, seed++, 0);
}

// Padded output rows: the 16-byte store path (ld a multiple of 8) and the pair-store path (an
// ld that is not), for both epilogues; the padding keeps its poison.
void padded_outputs(void**) {
  uint64_t seed = 500;
  for (int64_t pad : {8, 2})
    for (int bn : kBlockNs) {
      expect_activation(Activation::kSwiglu, DType::kBF16, bn, Major::kMN, seed++, pad);
      expect_activation(Activation::kGelu, DType::kF16, bn, Major::kK, seed++, pad);
      Problem P = make_problem({1500, 600, 5, 264, 136, false, true, Major::kMN, 0.5}, DType::kBF16, seed++);
      Check c;
      run_store(P, bn, true, &c, pad);
      if (c.rel_err > tolerance(DType::kBF16) || c.unwritten || c.clobbered)
        std::printf("store pad=%lld bn=%d: rel %.3g unwritten %lld clobbered %lld\n", static_cast<long long>(pad), bn,
                    c.rel_err, static_cast<long long>(c.unwritten), static_cast<long long>(c.clobbered));
      assert_true(c.rel_err <= tolerance(DType::kBF16));
      assert_int_equal(c.unwritten + c.clobbered, 0);
      free_problem(P);
    }
}

void deterministic(void**) {
  Problem P = make_problem({5000, 2000, 16, 256, 512, false, true, Major::kMN, 0.9}, DType::kBF16, 42);
  Check c;
  for (int bn : kBlockNs) {
    const std::vector<uint16_t> a = run_store(P, bn, true, &c), b = run_store(P, bn, true, &c),
                                d = run_store(P, bn, true, &c);
    assert_true(a == b && b == d);
  }
  free_problem(P);
}

void no_rows(void**) {  // m_total = 0: no tiles, nothing launched past the schedule, no error
  Problem P = make_problem({0, 10, 4, 64, 64, false, true, Major::kMN, 0.0}, DType::kBF16, 3);
  Check c;
  for (int bn : kBlockNs) run_store(P, bn, false, &c);
  assert_int_equal(cudaGetLastError(), cudaSuccess);
  free_problem(P);
}

}  // namespace

int main() {
  cudaDeviceProp prop;
  if (!have_sm90(&prop)) {
    std::printf("no sm_90 GPU: skipped\n");
    return 77;
  }
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(store_shapes),   cmocka_unit_test(many_experts),  cmocka_unit_test(bad_indices),
      cmocka_unit_test(activations),    cmocka_unit_test(padded_outputs), cmocka_unit_test(deterministic),
      cmocka_unit_test(no_rows)};
  return cmocka_run_group_tests(tests, nullptr, nullptr);
}
