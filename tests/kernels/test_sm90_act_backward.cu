// The activation backward in the dact GEMM's epilogue (EpilogueKind::kActivationBackward) against
// a host reference built from the naive fp32 GEMM (grouped_gemm_problem.cuh) and
// math/activation.hpp: dpre, g act and the dg partial sums, for every activation (the gated
// ones read gate and up and write both halves of dpre) with dy gathered or in expert order
// (read by TMA), bf16 and fp16, both
// B layouts, h not a multiple of 64 or 128, skewed and single-expert routings, one row, the saved
// pre placed per expert (the fused engine's windows) and hostile placements (nothing read or
// written outside the buffers), output rows narrower than their columns refused, the staged
// (TMA) path bitwise equal to the register one, and bitwise determinism. Every case runs on both
// kernels, the in-ring epilogue (128- and 256-wide tiles) and the epilogue warps (forced at any
// h; all give dpre and g act with the same bits). Outputs poisoned. Exits 77 without an sm_90 GPU.
#include "grouped_gemm_problem.cuh"
#include "gemm/sm90/tile_config.hpp"

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

struct Case {
  Activation a;
  DType dt;
  Major mj;
  int64_t m;      // positions (rows of dact)
  int32_t E, h, d;
  double skew;
  int placed;     // 0: pre row p; 1: placed per expert; 2: hostile placements
  int64_t ld_pad; // extra output columns (2: outputs TMA cannot address, the register path)
  bool expert_order = false;  // dy's rows in expert order (A by TMA, the fused engine's copy), not gathered
};

// pre's and dpre's columns: gate and up halves when gated.
int64_t pre_cols(const Case& c) { return (moeblaze::is_gated(c.a) ? 2 : 1) * int64_t{c.h}; }

struct Outputs {
  std::vector<uint16_t> dpre, gact;
  std::vector<float> dg;  // summed over the column blocks, in order
};

// Runs the epilogue; fills the host pre it drew and the placement it used.
using Schedule = sm90::ConsumerSchedule;
constexpr Schedule kSchedules[] = {Schedule::kCooperative, Schedule::kEpilogueWarpgroup};

Outputs run(const Problem& P, const Case& c, const std::vector<uint16_t>& pre_h, int64_t pre_rows,
            const std::vector<int32_t>& place, Schedule schedule, int block_n = 0) {
  const int64_t m = P.s.m_total, h = c.h, ld_pre = pre_cols(c) + 8;
  const int64_t ldc = pre_cols(c) + c.ld_pad, ld_act = h + c.ld_pad, parts = sm90::act_backward_dg_parts(h);
  void* pre = alloc_poisoned(pre_rows * ld_pre);
  GGP_CK(cudaMemcpy(pre, pre_h.data(), pre_rows * ld_pre * 2, cudaMemcpyHostToDevice));
  void* dpre = alloc_poisoned(m * ldc);
  void* gact = alloc_poisoned(m * ld_act);
  float* dg = nullptr;
  GGP_CK(cudaMalloc(&dg, std::max<int64_t>(parts * m, 1) * 4));
  GGP_CK(cudaMemset(dg, 0xFF, std::max<int64_t>(parts * m, 1) * 4));
  int32_t* d_place = nullptr;
  if (!place.empty()) {
    GGP_CK(cudaMalloc(&d_place, place.size() * 4));
    GGP_CK(cudaMemcpy(d_place, place.data(), place.size() * 4, cudaMemcpyHostToDevice));
  }
  sm90::EpilogueParams e = act_backward_params(c.a, dpre, ldc, gact, ld_act, P.d_scale, pre, ld_pre, dg, m);
  e.pre_expert_row = d_place;
  e.pre_out_rows = d_place ? static_cast<int32_t>(pre_rows) : 0;
  const char* why = sm90::unsupported_reason(P.dt, P.params(), e);
  if (why) std::printf("unsupported: %s\n", why);
  assert_null(why);
  sm90::KernelChoice kc;
  kc.schedule = schedule;
  kc.block_n = block_n;
  sm90::grouped_gemm(P.dt, P.params(), e, kc, nullptr);
  GGP_CK(cudaDeviceSynchronize());
  Outputs o;
  o.dpre = download_bits(dpre, m * ldc);
  o.gact = download_bits(gact, m * ld_act);
  std::vector<float> parts_h(std::max<int64_t>(parts * m, 1));
  GGP_CK(cudaMemcpy(parts_h.data(), dg, parts * m * 4, cudaMemcpyDeviceToHost));
  o.dg.assign(m, 0.f);
  for (int64_t p = 0; p < m; ++p)
    for (int64_t cb = 0; cb < parts; ++cb) o.dg[p] += parts_h[cb * m + p];
  cudaFree(pre);
  cudaFree(dpre);
  cudaFree(gact);
  cudaFree(dg);
  cudaFree(d_place);
  return o;
}

void expect(const Case& c, uint64_t seed) {
  Problem P =
      make_problem({c.m, std::max<int64_t>(c.m / 2, 1), c.E, c.h, c.d, false, !c.expert_order, c.mj, c.skew}, c.dt, seed);
  const int64_t m = c.m, h = c.h, cols = pre_cols(c), ld_pre = cols + 8, guard = 64;
  const bool gated = moeblaze::is_gated(c.a);
  // pre: row p, or expert e's rows at place[e] + (p - offsets[e]) (reverse expert order after
  // guard rows); hostile: starts far outside pre.
  std::vector<int32_t> place;
  int64_t pre_rows = std::max<int64_t>(m, 1);
  if (c.placed) {
    pre_rows = m + 2 * guard;
    place.resize(c.E);
    for (int e = 0; e < c.E; ++e) place[e] = static_cast<int32_t>(guard + (m - P.offsets[e + 1]));
    if (c.placed == 2) {
      place[0] = -1000000;
      if (c.E > 1) place[1] = static_cast<int32_t>(pre_rows - 5);
      if (c.E > 2) place[2] = 0x7fffff00;
    }
  }
  std::mt19937_64 rng(seed * 7 + 1);
  std::normal_distribution<float> nd(0.f, 1.5f);
  std::vector<uint16_t> pre_h(pre_rows * ld_pre);
  for (auto& v : pre_h) v = to_half_bits(nd(rng), c.dt);
  // the in-ring epilogue on both tile widths (the rule takes either, by activation, K and h)
  const Outputs ring = run(P, c, pre_h, pre_rows, place, Schedule::kCooperative, 128);
  const Outputs ring256 = run(P, c, pre_h, pre_rows, place, Schedule::kCooperative, 256);
  const Outputs warps = run(P, c, pre_h, pre_rows, place, Schedule::kEpilogueWarpgroup);
  const int64_t ldc = cols + c.ld_pad, ld_act = h + c.ld_pad;
  assert_true(ring.dpre == warps.dpre && ring256.dpre == warps.dpre);
  assert_true(ring.gact == warps.gact && ring256.gact == warps.gact);
  if (c.placed == 2) {  // hostile: no reference, but every output element is written and finite
    // (pre rows outside the buffer read as zeros; compute-sanitizer memcheck sees no stray access)
    for (const Outputs* o : {&ring, &warps})
      for (int64_t p = 0; p < m; ++p) {
        assert_false(std::isnan(o->dg[p]));
        for (int64_t j = 0; j < h; ++j) assert_false(std::isnan(from_half_bits(o->gact[p * ld_act + j], c.dt)));
        for (int64_t j = 0; j < cols; ++j) assert_false(std::isnan(from_half_bits(o->dpre[p * ldc + j], c.dt)));
      }
    free_problem(P);
    return;
  }
  const std::vector<float> ref = reference(P), sc = scales(P);
  std::vector<float> want_dpre(std::max<int64_t>(m * cols, 1)), want_gact(std::max<int64_t>(m * h, 1)), want_dg(m);
  int e = 0;
  for (int64_t p = 0; p < m; ++p) {
    while (P.offsets[e + 1] <= p) ++e;
    const int64_t r = c.placed ? place[e] + (p - P.offsets[e]) : p;
    double dot = 0;
    for (int64_t j = 0; j < h; ++j) {
      const float da = round_to(ref[p * h + j], c.dt), g = sc[p];
      const float u = from_half_bits(pre_h[r * ld_pre + j], c.dt);
      const float b = gated ? from_half_bits(pre_h[r * ld_pre + h + j], c.dt) : 1.f;  // up
      const ActValueGrad v = act_value_grad(c.a, u);
      const float act = round_to(gated ? v.f * b : v.f, c.dt);
      dot += static_cast<double>(da) * act;
      want_dpre[p * cols + j] = g * da * b * v.df;
      if (gated) want_dpre[p * cols + h + j] = g * da * v.f;
      want_gact[p * h + j] = g * act;
    }
    want_dg[p] = static_cast<float>(dot);
  }
  for (const Outputs* out : {&ring, &warps}) {
    const Outputs& o = *out;
    const Check cd = compare_bits(o.dpre, m, cols, ldc, c.dt, want_dpre),
                ca = compare_bits(o.gact, m, h, ld_act, c.dt, want_gact);
    double num = 0, den = 0;
    int64_t dg_nan = 0;
    for (int64_t p = 0; p < m; ++p) {
      if (std::isnan(o.dg[p])) ++dg_nan;
      else num += (o.dg[p] - want_dg[p]) * double(o.dg[p] - want_dg[p]);
      den += double(want_dg[p]) * want_dg[p];
    }
    const double dg_rel = den > 0 ? std::sqrt(num / den) : std::sqrt(num);
    const double tol = tolerance(c.dt);
    if (cd.rel_err > tol || ca.rel_err > tol || dg_rel > tol || cd.unwritten || ca.unwritten || cd.clobbered ||
        ca.clobbered || dg_nan)
      std::printf("%s: act %d %s major=%d m=%lld E=%d h=%d d=%d placed=%d pad=%lld: dpre rel %.3g (unwritten %lld, "
                  "clobbered %lld) gact rel %.3g (unwritten %lld, clobbered %lld) dg rel %.3g (NaN %lld)\n",
                  out == &ring ? "in-ring" : "epilogue warps", static_cast<int>(c.a), dtype_name(c.dt),
                  static_cast<int>(c.mj), static_cast<long long>(m), c.E, c.h, c.d, c.placed,
                  static_cast<long long>(c.ld_pad), cd.rel_err, static_cast<long long>(cd.unwritten),
                  static_cast<long long>(cd.clobbered), ca.rel_err, static_cast<long long>(ca.unwritten),
                  static_cast<long long>(ca.clobbered), dg_rel, static_cast<long long>(dg_nan));
    assert_true(cd.rel_err <= tol && ca.rel_err <= tol && dg_rel <= tol);
    assert_int_equal(cd.unwritten + ca.unwritten + cd.clobbered + ca.clobbered + dg_nan, 0);
  }
  free_problem(P);
}

void activations(void**) {
  uint64_t seed = 10;
  for (DType dt : {DType::kBF16, DType::kF16})
    for (Activation a : {Activation::kRelu, Activation::kGelu, Activation::kSilu, Activation::kSwiglu, Activation::kGeglu})
      expect({a, dt, Major::kK, 1200, 6, 200, 136, 0.7, 0, 0}, seed++);
  expect({Activation::kSwiglu, DType::kF16, Major::kMN, 1000, 5, 264, 72, 0.0, 0, 0}, seed++);
  expect({Activation::kSwiglu, DType::kBF16, Major::kK, 1200, 6, 200, 2048, 0.7, 0, 0, true}, seed++);
  expect({Activation::kGeglu, DType::kBF16, Major::kK, 1700, 6, 520, 264, 0.5, 1, 0, true}, seed++);
  expect({Activation::kGelu, DType::kBF16, Major::kMN, 1000, 5, 136, 200, 0.3, 0, 0}, seed++);
  expect({Activation::kSilu, DType::kF16, Major::kMN, 1000, 5, 264, 72, 0.0, 0, 0}, seed++);
  // dy in expert order (by TMA), K up to 2048 as the fused engine takes it
  expect({Activation::kSilu, DType::kBF16, Major::kK, 1200, 6, 200, 2048, 0.7, 0, 0, true}, seed++);
  expect({Activation::kGelu, DType::kF16, Major::kK, 1700, 6, 136, 264, 0.5, 1, 0, true}, seed++);
}

// A pre TMA cannot read, or outputs narrower than their columns (gated: pre and dpre have 2 h),
// are refused.
void refusals(void**) {
  Problem P = make_problem({256, 128, 2, 64, 64, false, true, Major::kK, 0.0}, DType::kBF16, 7);
  sm90::EpilogueParams e;
  e.kind = sm90::EpilogueKind::kActivationBackward;
  e.activation = Activation::kSilu;
  e.c = e.act = e.pre = P.d_a;
  e.ldc = e.ld_act = e.ld_pre = 64;
  e.row_scale = P.d_scale;
  e.dg = P.d_ref;
  e.ld_dg = 256;
  assert_null(sm90::unsupported_reason(P.dt, P.params(), e));
  for (Activation a : {Activation::kSwiglu, Activation::kGeglu}) {
    e.activation = a;
    assert_non_null(sm90::unsupported_reason(P.dt, P.params(), e));  // pre and dpre rows of 64 < 2 h
    e.ld_pre = e.ldc = 128;
    assert_null(sm90::unsupported_reason(P.dt, P.params(), e));
    e.ld_pre = e.ldc = 64;
  }
  e.activation = Activation::kSilu;
  e.ld_pre = 68;  // rows not 16-byte aligned
  assert_non_null(sm90::unsupported_reason(P.dt, P.params(), e));
  e.ld_pre = 64;
  e.ldc = 56;  // dpre rows narrower than its columns
  assert_non_null(sm90::unsupported_reason(P.dt, P.params(), e));
  e.ldc = 64;
  e.ld_act = 56;  // g act's likewise
  assert_non_null(sm90::unsupported_reason(P.dt, P.params(), e));
  e.ld_act = 64;
  e.ld_dg = 100;  // fewer than the rows
  assert_non_null(sm90::unsupported_reason(P.dt, P.params(), e));
  free_problem(P);
}

void shapes(void**) {
  uint64_t seed = 100;
  expect({Activation::kSilu, DType::kBF16, Major::kK, 4000, 16, 1024, 512, 0.0, 0, 0}, seed++);    // whole boxes
  expect({Activation::kGelu, DType::kBF16, Major::kK, 2000, 12, 64, 128, -1.0, 0, 0}, seed++);     // one expert, h = 64
  expect({Activation::kRelu, DType::kF16, Major::kK, 1, 1, 8, 8, 0.0, 0, 0}, seed++);              // one row
  expect({Activation::kSilu, DType::kBF16, Major::kK, 3000, 64, 136, 64, 1.2, 0, 0}, seed++);       // many partial tiles
  expect({Activation::kSwiglu, DType::kBF16, Major::kK, 4000, 16, 1024, 512, 0.0, 0, 0}, seed++);  // gated, whole boxes
  expect({Activation::kSwiglu, DType::kBF16, Major::kK, 3000, 64, 136, 64, 1.2, 0, 0}, seed++);
}

void placed_pre(void**) {
  uint64_t seed = 200;
  expect({Activation::kSilu, DType::kBF16, Major::kK, 1700, 6, 200, 136, 0.5, 1, 0}, seed++);
  expect({Activation::kRelu, DType::kF16, Major::kK, 1700, 6, 136, 200, 0.5, 1, 0}, seed++);
  expect({Activation::kSilu, DType::kBF16, Major::kK, 1700, 6, 200, 136, 0.5, 2, 0}, seed++);
  expect({Activation::kGelu, DType::kBF16, Major::kK, 900, 4, 136, 72, 0.5, 2, 2}, seed++);
  expect({Activation::kSwiglu, DType::kBF16, Major::kK, 1700, 6, 200, 136, 0.5, 1, 0}, seed++);
  expect({Activation::kSwiglu, DType::kF16, Major::kK, 900, 4, 136, 72, 0.5, 2, 2}, seed++);
}

// Outputs TMA cannot address (ld not a multiple of 8): every tile from registers, the same bits.
void registers_match_staged(void**) {
  uint64_t seed = 300;
  for (Activation a : {Activation::kSilu, Activation::kGelu, Activation::kSwiglu}) {
    const Case staged{a, DType::kBF16, Major::kK, 2500, 4, 264, 136, 0.4, 0, 0};
    Case regs = staged;
    regs.ld_pad = 2;
    expect(regs, seed);
    Problem P = make_problem({staged.m, staged.m / 2, staged.E, staged.h, staged.d, false, true, staged.mj, staged.skew},
                             staged.dt, seed++);
    const int64_t cols = pre_cols(staged), ld_pre = cols + 8;
    std::vector<uint16_t> pre_h(staged.m * ld_pre);
    std::mt19937_64 rng(seed);
    std::normal_distribution<float> nd(0.f, 1.5f);
    for (auto& v : pre_h) v = to_half_bits(nd(rng), staged.dt);
    const Outputs s = run(P, staged, pre_h, staged.m, {}, Schedule::kCooperative),
                  r = run(P, regs, pre_h, staged.m, {}, Schedule::kCooperative);
    for (int64_t p = 0; p < staged.m; ++p) {
      assert_memory_equal(&s.dpre[p * cols], &r.dpre[p * (cols + 2)], cols * 2);
      assert_memory_equal(&s.gact[p * staged.h], &r.gact[p * (staged.h + 2)], staged.h * 2);
    }
    assert_memory_equal(s.dg.data(), r.dg.data(), staged.m * 4);
    free_problem(P);
  }
}

void deterministic(void**) {
  for (Activation act : {Activation::kSilu, Activation::kSwiglu}) {
    const Case c{act, DType::kBF16, Major::kK, 5000, 16, 512, 256, 0.9, 1, 0};
    Problem P = make_problem({c.m, c.m / 2, c.E, c.h, c.d, false, true, c.mj, c.skew}, c.dt, 42);
    const int64_t pre_rows = c.m + 128, ld_pre = pre_cols(c) + 8;
    std::vector<int32_t> place(c.E);
    for (int e = 0; e < c.E; ++e) place[e] = static_cast<int32_t>(64 + (c.m - P.offsets[e + 1]));
    std::vector<uint16_t> pre_h(pre_rows * ld_pre);
    std::mt19937_64 rng(5);
    std::normal_distribution<float> nd(0.f, 1.5f);
    for (auto& v : pre_h) v = to_half_bits(nd(rng), c.dt);
    for (Schedule sched : kSchedules) {
      const Outputs a = run(P, c, pre_h, pre_rows, place, sched), b = run(P, c, pre_h, pre_rows, place, sched),
                    d = run(P, c, pre_h, pre_rows, place, sched);
      assert_true(a.dpre == b.dpre && b.dpre == d.dpre && a.gact == b.gact && b.gact == d.gact);
      assert_memory_equal(a.dg.data(), b.dg.data(), c.m * 4);
      assert_memory_equal(a.dg.data(), d.dg.data(), c.m * 4);
    }
    free_problem(P);
  }
}

}  // namespace

// `quick`: the shapes and the placed (and hostile) pre only, for compute-sanitizer's tools.
int main(int argc, char** argv) {
  skip_without_sm90();
  const struct CMUnitTest tests[] = {cmocka_unit_test(activations), cmocka_unit_test(refusals), cmocka_unit_test(shapes),
                                     cmocka_unit_test(placed_pre), cmocka_unit_test(registers_match_staged),
                                     cmocka_unit_test(deterministic)};
  const struct CMUnitTest quick[] = {cmocka_unit_test(shapes), cmocka_unit_test(placed_pre)};
  if (argc > 1 && std::strcmp(argv[1], "quick") == 0) return cmocka_run_group_tests(quick, nullptr, nullptr);
  return cmocka_run_group_tests(tests, nullptr, nullptr);
}
