// The routing plan builder (src/routing/plan) against the paper's worked example and against
// an independent sort-based build on random routings, including the edge cases: experts with
// no tokens, all tokens on one expert, k = E, L = 1, tiles that do not divide L.
#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <numeric>
#include <random>
#include <vector>

#include "core/memory_layout.hpp"
#include "routing/plan.hpp"
#include "routing_cases.hpp"
#include "util/error.hpp"

// cmocka.h defines a fail() macro: include it after the library headers.
#include <stdarg.h>
#include <stddef.h>
#include <setjmp.h>
extern "C" {
#include <cmocka.h>
}

using namespace moeblaze;

namespace {

struct Plan {
  std::vector<int32_t> token_expert, expert_token, token_index_map, offsets;
};

Plan build(const std::vector<int32_t>& ids, int64_t L, int64_t k, int64_t E, int workers) {
  Plan p;
  p.token_expert = ids;
  p.expert_token.assign(static_cast<size_t>(L * k), -7);
  p.token_index_map.assign(static_cast<size_t>(L * k), -7);
  p.offsets.assign(static_cast<size_t>(E + 1), -7);
  RoutingPlan rp;
  rp.token_expert_indices = p.token_expert.data();
  rp.expert_token_indices = p.expert_token.data();
  rp.token_index_map = p.token_index_map.data();
  rp.expert_token_offsets = p.offsets.data();
  std::vector<unsigned char> scratch(routing::plan_scratch_bytes(L, E, workers) + 256);
  void* aligned = scratch.data() + (256 - reinterpret_cast<uintptr_t>(scratch.data()) % 256) % 256;
  const ThreadPool pool(workers);
  routing::build_plan(rp, L, k, E, aligned, pool);
  return p;
}

// Independent oracle: stable sort of (expert, token, slot) triples.
Plan sort_build(const std::vector<int32_t>& ids, int64_t L, int64_t k, int64_t E) {
  struct Pair { int32_t e, t, j; };
  std::vector<Pair> pairs;
  for (int64_t t = 0; t < L; ++t)
    for (int64_t j = 0; j < k; ++j) pairs.push_back({ids[t * k + j], static_cast<int32_t>(t), static_cast<int32_t>(j)});
  std::stable_sort(pairs.begin(), pairs.end(), [](const Pair& a, const Pair& b) { return a.e != b.e ? a.e < b.e : a.t < b.t; });
  Plan p;
  p.token_expert = ids;
  p.expert_token.resize(pairs.size());
  p.token_index_map.resize(pairs.size());
  p.offsets.assign(static_cast<size_t>(E + 1), 0);
  for (size_t i = 0; i < pairs.size(); ++i) {
    p.expert_token[i] = pairs[i].t;
    p.token_index_map[static_cast<size_t>(pairs[i].t * k + pairs[i].j)] = static_cast<int32_t>(i);
    p.offsets[static_cast<size_t>(pairs[i].e + 1)]++;
  }
  for (int64_t e = 0; e < E; ++e) p.offsets[e + 1] += p.offsets[e];
  return p;
}

void expect_equal(const Plan& got, const Plan& want) {
  assert_true(got.offsets == want.offsets);
  assert_true(got.expert_token == want.expert_token);
  assert_true(got.token_index_map == want.token_index_map);
}

void paper_example(void**) {
  // Five tokens, E = 4, k = 2 (docs/design.md explains the paper's L = 6 slip).
  const std::vector<int32_t> ids = {2, 3, 0, 1, 0, 3, 1, 2, 0, 3};
  for (int workers : {1, 3}) {
    Plan p = build(ids, 5, 2, 4, workers);
    assert_true((p.expert_token == std::vector<int32_t>{1, 2, 4, 1, 3, 0, 3, 0, 2, 4}));
    assert_true((p.offsets == std::vector<int32_t>{0, 3, 5, 7, 10}));
    assert_int_equal(p.token_index_map[0], 5);
    assert_int_equal(p.token_index_map[1], 7);
    expect_equal(p, sort_build(ids, 5, 2, 4));
  }
}

void random_routings_match_sort(void**) {
  std::mt19937_64 rng(test_seed("test_plan"));
  struct Case { int64_t L, k, E, only_first; };
  const Case cases[] = {
      {1, 1, 1, 0},     {1, 3, 8, 0},     {37, 2, 6, 0},    {200, 4, 16, 3 + 1},  // experts 4..15 empty
      {1000, 8, 8, 0},  // k = E
      {4097, 2, 300, 0},                                     // several tiles, partial last tile
      {5000, 1, 64, 1},                                      // all tokens on expert 0
      {3000, 6, 1024, 0},
  };
  for (const Case& c : cases) {
    std::vector<int32_t> ids = random_routing(rng, c.L, c.k, c.E, c.only_first);
    Plan want = sort_build(ids, c.L, c.k, c.E);
    for (int workers : {1, 2, 5}) expect_equal(build(ids, c.L, c.k, c.E, workers), want);
  }
}

void empty_routing(void**) {
  Plan p = build({}, 0, 2, 5, 2);
  assert_true((p.offsets == std::vector<int32_t>{0, 0, 0, 0, 0, 0}));
}

void bad_caller_ids_are_rejected(void**) {
  std::vector<int32_t> out(4, -9);
  const int32_t out_of_range[] = {0, 1, 2, 4};
  const int64_t duplicate[] = {1, 1, 0, 2};
  const int32_t negative[] = {0, -1, 2, 3};
  for (int variant = 0; variant < 3; ++variant) {
    bool threw = false;
    try {
      if (variant == 0) routing::import_topk_ids(reinterpret_cast<const char*>(out_of_range), false, 2, 2, 2, 4, View{}, out.data());
      if (variant == 1) routing::import_topk_ids(reinterpret_cast<const char*>(duplicate), true, 2, 2, 2, 4, View{}, out.data());
      if (variant == 2) routing::import_topk_ids(reinterpret_cast<const char*>(negative), false, 2, 2, 2, 4, View{}, out.data());
    } catch (const Error& e) {
      threw = e.status() == Status::kInvalidArgument;
    }
    assert_true(threw);
    assert_true((out == std::vector<int32_t>(4, -9)));  // nothing written on failure
  }
  const int64_t good[] = {3, 0, 9, 1, 2, 9};  // row stride 3: the 9s are padding, never read
  routing::import_topk_ids(reinterpret_cast<const char*>(good), true, 3, 2, 2, 4, View{}, out.data());
  assert_true((out == std::vector<int32_t>{3, 0, 1, 2}));
}

}  // namespace

int main() {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(paper_example),
      cmocka_unit_test(random_routings_match_sort),
      cmocka_unit_test(empty_routing),
      cmocka_unit_test(bad_caller_ids_are_rejected),
  };
  return cmocka_run_group_tests_name("routing_plan", tests, nullptr, nullptr);
}
