// The grouped GEMM's automatic kernel choice (gemm/sm90 choose_kernel), host only: cooperative
// for every epilogue and K, with 256-wide tiles from 256 output columns (gated: both halves), the
// activation backward on the epilogue warps where they win, the activation epilogue deferred
// where it has a kernel; an explicit choice is kept, ping-pong always 128 wide. The
// expert-parallel rule of rows sent beside the local GEMMs (ep_overlap) on the benchmarked
// layers. The measurements behind the rules are in perf/NOTES.md.
#include <cstdio>
#include <cstdlib>

#include "gemm/sm90/grouped_gemm.hpp"
#include "gemm/sm90/heuristics.hpp"

// cmocka.h defines a fail() macro: include it after the library headers.
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <setjmp.h>
extern "C" {
#include <cmocka.h>
}

namespace sm90 = moeblaze::gemm::sm90;
using sm90::ConsumerSchedule;
using sm90::EpilogueKind;

namespace {

sm90::EpilogueParams epilogue(EpilogueKind kind, moeblaze::Activation act = moeblaze::Activation::kSwiglu) {
  sm90::EpilogueParams e;
  e.kind = kind;
  e.activation = act;
  return e;
}

sm90::KernelChoice pick(int32_t n, int32_t k, int32_t gated, EpilogueKind epi, sm90::KernelChoice kc = {}) {
  sm90::GroupedGemmParams p;
  p.n = n;
  p.k = k;
  p.gated = gated;
  return sm90::choose_kernel(p, epilogue(epi), kc);
}

void expect(const sm90::KernelChoice& kc, ConsumerSchedule s, int block_n) {
  assert_int_equal(static_cast<int>(kc.schedule), static_cast<int>(s));
  assert_int_equal(kc.block_n, block_n);
}

void automatic(void**) {
  // store epilogues (down, dact, dx GEMMs), short K included: cooperative
  expect(pick(768, 256, 0, EpilogueKind::kStore), ConsumerSchedule::kCooperative, 256);
  expect(pick(4096, 768, 0, EpilogueKind::kStore), ConsumerSchedule::kCooperative, 256);
  expect(pick(4096, 1024, 0, EpilogueKind::kStore), ConsumerSchedule::kCooperative, 256);
  expect(pick(2048, 8192, 0, EpilogueKind::kStore), ConsumerSchedule::kCooperative, 256);
  expect(pick(128, 4096, 0, EpilogueKind::kStore), ConsumerSchedule::kCooperative, 128);
  // activation epilogues (up GEMMs) stay cooperative whatever K; gated tiles count both halves
  expect(pick(256, 768, 1, EpilogueKind::kActivation), ConsumerSchedule::kCooperative, 256);
  expect(pick(128, 256, 1, EpilogueKind::kActivation), ConsumerSchedule::kCooperative, 256);
  expect(pick(64, 256, 1, EpilogueKind::kActivation), ConsumerSchedule::kCooperative, 128);
  expect(pick(200, 2048, 0, EpilogueKind::kActivation), ConsumerSchedule::kCooperative, 128);
}

void explicit_choices(void**) {
  sm90::KernelChoice coop;
  coop.schedule = ConsumerSchedule::kCooperative;
  expect(pick(4096, 256, 0, EpilogueKind::kStore, coop), ConsumerSchedule::kCooperative, 256);
  coop.block_n = 128;
  expect(pick(4096, 256, 0, EpilogueKind::kStore, coop), ConsumerSchedule::kCooperative, 128);
  sm90::KernelChoice pp;
  pp.schedule = ConsumerSchedule::kPingPong;
  pp.block_n = 256;  // ping-pong tiles are 128 wide: the request is corrected, not honoured
  expect(pick(4096, 8192, 1, EpilogueKind::kActivation, pp), ConsumerSchedule::kPingPong, 128);
  sm90::KernelChoice bn;
  bn.block_n = 128;  // a width alone leaves the schedule automatic
  expect(pick(4096, 4096, 0, EpilogueKind::kStore, bn), ConsumerSchedule::kCooperative, 128);
}

// The activation epilogue deferred under the next tile's k-blocks: ReLU, SiLU and SwiGLU on
// cooperative 256-wide tiles whose gating matches the activation; never GELU or GeGLU, 128-wide
// or ping-pong tiles, or another epilogue (gemm/sm90/heuristics.hpp).
void deferred_activation(void**) {
  using moeblaze::Activation;
  auto deferred = [](int32_t n, int32_t gated, Activation act, EpilogueKind epi = EpilogueKind::kActivation,
                     sm90::KernelChoice kc = {}) {
    sm90::GroupedGemmParams p;
    p.n = n;
    p.k = 512;
    p.gated = gated;
    return sm90::choose_kernel(p, epilogue(epi, act), kc).deferred_activation;
  };
  assert_true(deferred(768, 1, Activation::kSwiglu));
  assert_true(deferred(2048, 0, Activation::kSilu));
  assert_true(deferred(2048, 0, Activation::kRelu));
  assert_false(deferred(2048, 1, Activation::kGeglu));
  assert_false(deferred(2048, 0, Activation::kGelu));
  assert_false(deferred(2048, 0, Activation::kSwiglu));  // gating that disagrees with the activation
  assert_false(deferred(200, 0, Activation::kSilu));     // 128-wide tiles
  assert_false(deferred(2048, 0, Activation::kSilu, EpilogueKind::kStore));
  sm90::KernelChoice pp, narrow, asked;
  pp.schedule = sm90::ConsumerSchedule::kPingPong;
  narrow.block_n = 128;
  asked.deferred_activation = true;  // set by the choice, not asked for
  assert_false(deferred(768, 1, Activation::kSwiglu, EpilogueKind::kActivation, pp));
  assert_false(deferred(768, 1, Activation::kSwiglu, EpilogueKind::kActivation, narrow));
  assert_false(deferred(2048, 1, Activation::kGeglu, EpilogueKind::kActivation, asked));
  assert_false(deferred(2048, 0, Activation::kSilu, EpilogueKind::kActivationBackward, asked));
}

// The activation backward never runs ping-pong: on the epilogue warps' 256-wide tiles where they
// win (from 256 columns: dy gathered with 1024 < K <= 2048, dy in expert order with K > 2048) or
// when asked for, else on cooperative tiles with the in-ring epilogue; the epilogue warps serve
// nothing else, and only where their 16-byte stores can address the outputs. The in-ring
// epilogue is taken for K <= 1024, or K <= 2048 with dy in expert order, gated activations from
// h = 2048 or with K <= 768, on 128-wide tiles (gemm/sm90/heuristics.hpp).
void activation_backward(void**) {
  const EpilogueKind ab = EpilogueKind::kActivationBackward;
  const int32_t index[1] = {0};
  sm90::KernelChoice pp, coop, warps;
  pp.schedule = ConsumerSchedule::kPingPong;
  pp.block_n = 128;
  coop.schedule = ConsumerSchedule::kCooperative;
  warps.schedule = ConsumerSchedule::kEpilogueWarpgroup;
  auto pick_dact = [&](int32_t n, int32_t k, bool gathered, sm90::KernelChoice kc = {},
                       moeblaze::Activation act = moeblaze::Activation::kSilu) {
    sm90::GroupedGemmParams p;
    p.n = n;
    p.k = k;
    p.a_index = gathered ? index : nullptr;
    return sm90::choose_kernel(p, epilogue(ab, act), kc);
  };
  expect(pick_dact(136, 512, true, warps), ConsumerSchedule::kEpilogueWarpgroup, 256);  // asked for: any shape
  expect(pick_dact(1024, 4096, false, coop), ConsumerSchedule::kCooperative, 256);
  expect(pick_dact(136, 512, false, coop), ConsumerSchedule::kCooperative, 128);
  expect(pick(4096, 512, 0, EpilogueKind::kStore, warps), ConsumerSchedule::kCooperative, 256);
  expect(pick(1024, 512, 1, EpilogueKind::kActivation, warps), ConsumerSchedule::kCooperative, 256);
  if (!std::getenv("MOEBLAZE_SM90_SCHEDULE")) {
    expect(pick_dact(768, 2048, true), ConsumerSchedule::kEpilogueWarpgroup, 256);
    expect(pick_dact(256, 1032, true), ConsumerSchedule::kEpilogueWarpgroup, 256);
    expect(pick_dact(2048, 7168, false), ConsumerSchedule::kEpilogueWarpgroup, 256);
    expect(pick_dact(2048, 4096, false, pp), ConsumerSchedule::kEpilogueWarpgroup, 256);  // ping-pong is not honoured
    expect(pick_dact(1024, 1024, true), ConsumerSchedule::kCooperative, 256);
    expect(pick_dact(1024, 4096, true), ConsumerSchedule::kCooperative, 256);
    expect(pick_dact(1024, 2048, false), ConsumerSchedule::kCooperative, 256);
    expect(pick_dact(248, 2048, true), ConsumerSchedule::kCooperative, 128);
    expect(pick_dact(136, 4096, false, pp), ConsumerSchedule::kCooperative, 128);
    // gated in the ring at K <= 768: 128-wide tiles, so that pre takes half the ring
    const auto swiglu = moeblaze::Activation::kSwiglu, geglu = moeblaze::Activation::kGeglu;
    expect(pick_dact(2048, 512, false, {}, swiglu), ConsumerSchedule::kCooperative, 128);
    expect(pick_dact(256, 768, true, {}, geglu), ConsumerSchedule::kCooperative, 128);
    expect(pick_dact(4096, 1024, true, {}, swiglu), ConsumerSchedule::kCooperative, 256);
    expect(pick_dact(2048, 512, false), ConsumerSchedule::kCooperative, 256);  // SiLU keeps 256
    sm90::KernelChoice wide;
    wide.block_n = 256;  // an explicit width is kept
    expect(pick_dact(2048, 512, false, wide, swiglu), ConsumerSchedule::kCooperative, 256);
  }
  // outputs the epilogue warps' 16-byte stores cannot address: the in-ring epilogue instead
  {
    sm90::GroupedGemmParams p;
    p.n = 768;
    p.k = 2048;
    p.a_index = index;
    sm90::EpilogueParams e = epilogue(ab, moeblaze::Activation::kSilu);
    e.ldc = 772;
    expect(sm90::choose_kernel(p, e, warps), ConsumerSchedule::kCooperative, 256);
    e.ldc = 768;
    e.act = reinterpret_cast<void*>(uintptr_t{8});
    expect(sm90::choose_kernel(p, e, warps), ConsumerSchedule::kCooperative, 256);
    e.act = nullptr;
    expect(sm90::choose_kernel(p, e, warps), ConsumerSchedule::kEpilogueWarpgroup, 256);
  }
  if (std::getenv("MOEBLAZE_SM90_ACT_BACKWARD")) return;  // the knob overrides the rule
  sm90::GroupedGemmParams p;
  p.a_index = index;  // dy gathered: in the ring to K = 1024, on the epilogue warps to K = 2048
  p.n = 2048;  // h: gated in the ring from 2048
  for (int32_t k : {8, 512, 1024, 1032, 2048}) {
    p.k = k;
    assert_true(sm90::act_backward_in_epilogue(p, false));
    assert_true(sm90::act_backward_in_epilogue(p, true));
  }
  for (int32_t k : {2056, 4096, 7168}) {
    p.k = k;
    assert_false(sm90::act_backward_in_epilogue(p, false));
    assert_false(sm90::act_backward_in_epilogue(p, true));
  }
  p.n = 248;  // narrower than an epilogue-warps tile: the pass from K = 1032
  p.k = 2048;
  assert_false(sm90::act_backward_in_epilogue(p, false));
  p.a_index = nullptr;  // dy in expert order (by TMA): in the ring to K = 2048, on the warps beyond
  p.n = 2048;
  for (int32_t k : {8, 1024, 1032, 2048, 2056, 4096, 7168}) {
    p.k = k;
    assert_true(sm90::act_backward_in_epilogue(p, false));
    assert_true(sm90::act_backward_in_epilogue(p, true));
  }
  p.n = 136;
  p.k = 4096;
  assert_false(sm90::act_backward_in_epilogue(p, false));
  p.k = 768;  // narrow gated experts in the ring up to K = 768 (128-wide tiles), the pass beyond
  for (int32_t n : {256, 1024, 2040}) {
    p.n = n;
    p.k = 768;
    assert_true(sm90::act_backward_in_epilogue(p, false));
    assert_true(sm90::act_backward_in_epilogue(p, true));
    p.k = 1024;
    assert_true(sm90::act_backward_in_epilogue(p, false));
    assert_false(sm90::act_backward_in_epilogue(p, true));
  }
}

// Rows beside the local GEMMs where they were measured faster (Qwen3- and OLMoE-like at EP 4),
// before them where slower (EP 2; Mixtral-like) or not expected to pay (DeepSeek-V3-like); never
// on one rank, or with senders on more than a quarter of the SMs. SwiGLU, bf16: g h = 2 h; 16
// senders on an H100's 132 SMs.
void ep_overlap_rule(void**) {
  struct Case {
    int32_t P;
    int64_t E, k, h;
    bool beside;
  };
  const Case cases[] = {
      {4, 128, 8, 768, true},    {2, 128, 8, 768, false},  // Qwen3-30B-A3B-like
      {8, 128, 8, 768, true},                              // ... at EP 8: 5.25 ranks a token
      {4, 64, 8, 1024, true},    {2, 64, 8, 1024, false},  // OLMoE-like
      {4, 256, 8, 2048, false},  {2, 256, 8, 2048, false}, // DeepSeek-V3-like
      {4, 8, 2, 14336, false},   {2, 8, 2, 14336, false},  // Mixtral-like
      {1, 128, 8, 768, false},                             // one rank
  };
  for (const Case& c : cases) {
    if (sm90::ep_overlap(c.P, c.E, c.k, 2 * c.h, 2, 16, 132) != c.beside)
      std::printf("ep_overlap(P %d, E %lld, k %lld, h %lld) != %d\n", c.P, static_cast<long long>(c.E),
                  static_cast<long long>(c.k), static_cast<long long>(c.h), c.beside);
    assert_int_equal(sm90::ep_overlap(c.P, c.E, c.k, 2 * c.h, 2, 16, 132), c.beside);
  }
  // The senders may take at most a quarter of the SMs (EP_COMM_SMS): 33 of 132 is too many.
  assert_true(sm90::ep_overlap(4, 128, 8, 1536, 2, 33, 132));
  assert_false(sm90::ep_overlap(4, 128, 8, 1536, 2, 34, 132));
}

}  // namespace

int main() {
  // The override knobs would change the answers: these tests are of the automatic rules.
  for (const char* knob : {"MOEBLAZE_SM90_SCHEDULE", "MOEBLAZE_EP_OVERLAP"})
    if (std::getenv(knob)) {
      std::printf("%s is set: skipped\n", knob);
      return 77;
    }
  const struct CMUnitTest tests[] = {cmocka_unit_test(automatic), cmocka_unit_test(explicit_choices),
                                     cmocka_unit_test(deferred_activation), cmocka_unit_test(activation_backward),
                                     cmocka_unit_test(ep_overlap_rule)};
  return cmocka_run_group_tests(tests, nullptr, nullptr);
}
