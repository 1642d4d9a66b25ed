// The router's ranking rule (src/routing/score_order.hpp): rank_key, the 64-bit key the GPU
// top-k compares as integers, must order every pair of (score, id) exactly as ranks_before
// does, NaN, infinities, signed zeros, subnormals and ties included, and give back its id;
// rank_value makes the picks a function of the logits alone; and rank_value_of_logit ranks as
// rank_value does without the scores.
#include <cfloat>
#include <cmath>
#include <cstdint>
#include <random>
#include <vector>

#include "routing/score_order.hpp"

#include <stdarg.h>
#include <stddef.h>
#include <setjmp.h>
extern "C" {
#include <cmocka.h>
}

using namespace moeblaze::routing;

namespace {

using moeblaze::bits_f32;

// Scores that stress the order: specials, neighbours of each other, and random bit patterns.
std::vector<float> score_pool(std::mt19937_64& rng) {
  std::vector<float> v = {0.f, -0.f, INFINITY, -INFINITY, NAN, -NAN, bits_f32(0x7f800001u), bits_f32(0xffc12345u),
                          FLT_MIN, -FLT_MIN, bits_f32(1u), bits_f32(0x80000001u), FLT_MAX, -FLT_MAX, 1.f, -1.f,
                          0.5f, std::nextafter(0.5f, 1.f), std::nextafter(0.5f, 0.f), 1e-30f, -1e-30f};
  std::uniform_int_distribution<uint32_t> any;
  std::normal_distribution<float> normal;
  for (int i = 0; i < 200; ++i) v.push_back(bits_f32(any(rng)));
  for (int i = 0; i < 200; ++i) v.push_back(normal(rng));
  return v;
}

void key_order_is_ranks_before(void**) {
  std::mt19937_64 rng(20261124);
  const std::vector<float> pool = score_pool(rng);
  const int64_t ids[] = {0, 1, 2, 7, 127, 128, 255, 1000, 65535, 2147483646, 2147483647};
  int64_t checked = 0;
  for (float a : pool)
    for (float b : pool)
      for (int64_t ia : ids)
        for (int64_t ib : {int64_t{0}, int64_t{3}, int64_t{128}, int64_t{2147483647}}) {
          if (ia == ib) continue;  // ids of one token's experts are distinct
          const bool by_key = rank_key(a, ia) > rank_key(b, ib);
          if (by_key != ranks_before(a, ia, b, ib))
            fail_msg("(%a, %lld) vs (%a, %lld): key says %d, ranks_before %d", a, static_cast<long long>(ia), b,
                     static_cast<long long>(ib), by_key, ranks_before(a, ia, b, ib));
          ++checked;
        }
  assert_true(checked > 1000000);
}

void key_gives_back_id(void**) {
  std::mt19937_64 rng(7);
  for (float s : score_pool(rng))
    for (int64_t id : {int64_t{0}, int64_t{5}, int64_t{255}, int64_t{2147483647}}) {
      const uint64_t key = rank_key(s, id);
      assert_int_equal(rank_key_id(key), id);
      assert_true(key != 0);  // 0 is "no candidate": a real expert, even with a NaN score, ranks above it
    }
}

// The picks depend on the logits only: two near-equal logits whose softmax scores tie under one
// normaliser and not under the next float up (the CPU and GPU engines round the normaliser
// differently) still rank the same way under rank_value. The scan must find such splits, or the
// test proves nothing.
void rank_value_ignores_normaliser_rounding(void**) {
  int splits = 0;
  for (float a = 0.5f; a < 1.f; a *= 1.001f) {  // a - lse exact, scores near 1: 1-ulp ties common
    const float b = std::nextafter(a, 2.f);
    for (float lse = 0.5f; lse < 1.f; lse += 0.0137f) {
      const float lse2 = std::nextafter(lse, 8.f);
      const float sa1 = std::exp(a - lse), sb1 = std::exp(b - lse), sa2 = std::exp(a - lse2), sb2 = std::exp(b - lse2);
      if ((sa1 == sb1) != (sa2 == sb2)) ++splits;  // the score order differs between the two normalisers
      const bool first1 = ranks_before(rank_value(b, sb1), 1, rank_value(a, sa1), 0);
      const bool first2 = ranks_before(rank_value(b, sb2), 1, rank_value(a, sa2), 0);
      assert_true(first1 && first2);  // the larger logit first, whatever the scores' rounding
    }
  }
  assert_true(splits > 0);
  assert_true(std::isnan(rank_value(1.f, NAN)));  // a NaN score ranks as NaN: below every number
  assert_true(rank_value(-INFINITY, 0.f) == -INFINITY);
}

// rank_value_of_logit ranks every logit of a row as rank_value does with the row's scores,
// computed as the CPU engine computes them (routing/router.cpp: the max skipping NaN, the fp64
// normaliser, then exp(l - lse) or 1 / (1 + exp(-l))), on rows full of specials and extremes.
void rank_without_scores_is_rank_value(void**) {
  std::mt19937_64 rng(20261128);
  const std::vector<float> pool = score_pool(rng);
  std::uniform_int_distribution<size_t> pick(0, pool.size() - 1);
  std::uniform_int_distribution<int> width(1, 40), mode(0, 3);
  std::normal_distribution<float> normal(0.f, 3.f);
  int64_t nan_rows = 0, checked = 0;
  for (int row = 0; row < 20000; ++row) {
    const int E = width(rng);
    std::vector<float> l(static_cast<size_t>(E));
    const int m = mode(rng);  // 0: normal; 1: a few specials; 2: all from the pool; 3: all -inf
    for (float& v : l) v = m == 3 ? -INFINITY : m == 2 || (m == 1 && pick(rng) % 8 == 0) ? pool[pick(rng)] : normal(rng);
    float mx = -INFINITY;
    for (float v : l) mx = max_skipping_nan(mx, v);
    double sum = 0.0;
    for (float v : l) sum += std::exp(static_cast<double>(v - mx));
    const float lse = mx + static_cast<float>(std::log(sum));
    nan_rows += lse != lse;
    for (int softmax = 0; softmax < 2; ++softmax)
      for (int e = 0; e < E; ++e) {
        const float s = softmax ? std::exp(l[e] - lse) : 1.f / (1.f + std::exp(-l[e]));
        const uint64_t want = rank_key(rank_value(l[e], s), e), got = rank_key(rank_value_of_logit(softmax, l[e], lse), e);
        if (want != got)
          fail_msg("%s: logit %a, lse %a, score %a: key %llx, without the score %llx", softmax ? "softmax" : "sigmoid",
                   l[e], lse, s, static_cast<unsigned long long>(want), static_cast<unsigned long long>(got));
        ++checked;
      }
  }
  assert_true(nan_rows > 1000 && checked > 100000);  // rows whose scores are all NaN were met
}

}  // namespace

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(key_order_is_ranks_before),
      cmocka_unit_test(key_gives_back_id),
      cmocka_unit_test(rank_value_ignores_normaliser_rounding),
      cmocka_unit_test(rank_without_scores_is_rank_value),
  };
  return cmocka_run_group_tests(tests, nullptr, nullptr);
}
