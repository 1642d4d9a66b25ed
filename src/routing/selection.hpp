// The selection scores of the routing options (docs/routing.md): where a pick depends on score
// values and not only on their order (an expert score bias, group sums), the CPU and GPU
// engines must compute those values to the same bits. So they come from one definition here,
// built only from IEEE-exact operations (fmaf, +, *, /, ldexpf, rintf: correctly rounded on
// every host and device), never from the platform's expf, whose last bits differ:
//   - sigmoid: 1 / (1 + exp_portable(-l));
//   - softmax: exp_portable(l - m) / S, m the row maximum skipping NaN, S the fp64 sum of the E
//     terms in the GPU router's fixed lane order (lane partials, then an xor butterfly), which
//     the CPU engine replays with fixed_order_sum.
// The gates keep each engine's own scores; only the picks must agree.
#pragma once

#include <cmath>
#include <cstdint>

#include "routing/score_order.hpp"
#include "util/dtype.hpp"

namespace moeblaze {
inline namespace v0 {
namespace routing {

// Group-limited routing on the GPU: each of a token's (at most 32) lanes holds up to
// kGroupSlots group scores, so the CUDA engines take at most kMaxExpertGroupsCuda groups.
constexpr int kGroupSlots = 8;
constexpr int64_t kMaxExpertGroupsCuda = 32 * kGroupSlots;

// Lanes per token in the GPU router (routing/token_group.cuh): the smallest power of two
// >= min(E, 32).
MOEBLAZE_HD int selection_lanes(int64_t E) {
  int w = 1;
  while (w < 32 && w < E) w *= 2;
  return w;
}

// exp(x) within 2 ulp, the same bits everywhere: x = n ln2 + r (Cody-Waite with fmaf,
// |r| <= ln2/2), exp(r) by its degree-7 Taylor polynomial (truncation < 6e-9 relative), times
// 2^n by ldexpf (exact, subnormal results included).
MOEBLAZE_HD float exp_portable(float x) {
  if (x != x) return x;
  if (x > 88.72284f) return INFINITY;
  if (x < -103.97909f) return 0.f;
  const float n = rintf(x * 1.44269504f);
  float r = fmaf(-n, 0.693145752f, x);  // ln2's leading bits: n * hi is exact
  r = fmaf(-n, 1.42860677e-6f, r);      // ln2 - hi
  float p = 1.f / 5040.f;
  p = fmaf(p, r, 1.f / 720.f);
  p = fmaf(p, r, 1.f / 120.f);
  p = fmaf(p, r, 1.f / 24.f);
  p = fmaf(p, r, 1.f / 6.f);
  p = fmaf(p, r, 0.5f);
  p = fmaf(p, r, 1.f);
  p = fmaf(p, r, 1.f);
  return ldexpf(p, static_cast<int>(n));
}

MOEBLAZE_HD float sigmoid_selection(float logit) { return 1.f / (1.f + exp_portable(-logit)); }

// Softmax selection score of one expert: its term exp_portable(l - m) over the row's fixed-order
// sum S of the terms.
MOEBLAZE_HD float softmax_selection(float term, double S) {
  return static_cast<float>(static_cast<double>(term) / S);
}

// The bit pattern of a rank key's value (the inverse of rank_key's high word; NaN for key 0's
// word, -0 read back as +0): group sums are formed from the keys a butterfly carried.
MOEBLAZE_HD float rank_key_value(uint64_t key) {
  const uint32_t hi = static_cast<uint32_t>(key >> 32);
  if (hi == 0) return NAN;
  return bits_f32((hi & 0x80000000u) ? (hi & 0x7fffffffu) : ~hi);
}

// The sum of term(e) for e in [0, E) in the GPU router's order: lane sub of `lanes` sums
// e = sub, sub + lanes, ... in fp64, then partials combine by an xor butterfly (every lane ends
// with the same value; lane 0's is returned). Host replay of group_sum over for_each_expert.
template <class Term>
double fixed_order_sum(int64_t E, Term term) {
  double part[32];
  const int lanes = selection_lanes(E);
  for (int sub = 0; sub < lanes; ++sub) {
    part[sub] = 0.0;
    for (int64_t e = sub; e < E; e += lanes) part[sub] += static_cast<double>(term(e));
  }
  for (int o = lanes / 2; o > 0; o >>= 1) {
    double next[32];
    for (int sub = 0; sub < lanes; ++sub) next[sub] = part[sub] + part[sub ^ o];
    for (int sub = 0; sub < lanes; ++sub) part[sub] = next[sub];
  }
  return part[0];
}

}  // namespace routing
}  // namespace v0
}  // namespace moeblaze
