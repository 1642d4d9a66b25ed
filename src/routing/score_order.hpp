// The one ranking rule of the router, shared by the CPU engine and the GPU kernels, so every
// engine picks the same experts bit for bit, whatever the scores hold (docs/design.md,
// "Non-finite router inputs"). Experts are ranked by rank_value: the logit where the score is
// a number (softmax and sigmoid are monotone in it, and the logits are the same bits in every
// engine while the scores' last bits depend on how each engine rounds the softmax normaliser),
// NaN where the score is NaN. Then:
//   - a higher value ranks first (+inf above every finite value, -inf below);
//   - NaN ranks below every number, -inf included;
//   - equal values, and two NaNs, go to the lower expert id.
// This is a strict total order on distinct ids, so top-k always names k distinct experts in
// [0, E): a NaN or infinite logit never drops an assignment or yields an invalid id. The gates
// carry the NaN on to that token's output, which is where the caller sees it.
#pragma once

#include <cmath>
#include <cstdint>

#include "util/dtype.hpp"

namespace moeblaze {
inline namespace v0 {
namespace routing {

// The value an expert is ranked by: its logit, or its score when that is NaN.
MOEBLAZE_HD float rank_value(float logit, float score) { return score != score ? score : logit; }

// True when (a, ia) ranks strictly before (b, ib). An id < 0 marks "no candidate" and ranks last.
MOEBLAZE_HD bool ranks_before(float a, int64_t ia, float b, int64_t ib) {
  if (ia < 0 || ib < 0) return ib < 0 && ia >= 0;
  const bool a_nan = a != a, b_nan = b != b;
  if (a_nan != b_nan) return b_nan;
  if (!a_nan && a != b) return a > b;
  return ia < ib;
}

// ranks_before as one 64-bit unsigned comparison: rank_key(a, ia) > rank_key(b, ib) exactly
// when (a, ia) ranks before (b, ib), for ids in [0, 2^31). The high word orders the rank value
// (sign-magnitude bits turned into an unsigned order; -0 counts as +0; every NaN is 0, below
// -inf), the low word the inverted id (a lower id wins a tie). Key 0 is "no candidate". The
// GPU router's top-k picks with integer maxima of these keys (routing/token_group.cuh).
MOEBLAZE_HD uint64_t rank_key(float s, int64_t id) {
  uint32_t hi = 0;
  if (s == s) {
    const uint32_t u = f32_bits(s + 0.0f);  // -0 -> +0
    hi = (u & 0x80000000u) ? ~u : (u | 0x80000000u);
  }
  return (static_cast<uint64_t>(hi) << 32) | static_cast<uint32_t>(~static_cast<uint32_t>(id));
}

// rank_value without the score, from the logit and its row's log-sum-exp: under softmax a score
// exp(l - lse) is NaN exactly where l or lse is (lse is NaN for a row with a NaN or +inf logit,
// or with every logit -inf; otherwise l <= lse), under sigmoid 1 / (1 + exp(-l)) exactly where
// l is. So a top-k ranks the same without computing the scores it does not pick. Any NaN it
// returns ranks as every NaN does.
MOEBLAZE_HD float rank_value_of_logit(bool softmax, float logit, float lse) {
  return softmax && lse != lse ? lse : logit;
}

// The id of a key.
MOEBLAZE_HD int32_t rank_key_id(uint64_t key) { return static_cast<int32_t>(~static_cast<uint32_t>(key)); }

// The row maximum used to shift logits before exp: NaN entries are skipped (fmax), so the
// shift is the same for every engine; a NaN then reaches the normaliser and every score.
MOEBLAZE_HD float max_skipping_nan(float m, float v) { return fmaxf(m, v); }

}  // namespace routing
}  // namespace v0
}  // namespace moeblaze
