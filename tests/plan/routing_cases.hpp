// Random top-k routings for the plan tests: k distinct experts per token, optionally all drawn
// from the first `only_first` experts (the others get no tokens); the seed, printed so that a
// failure can be replayed (MOEBLAZE_TEST_SEED).
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <numeric>
#include <random>
#include <vector>

inline std::vector<int32_t> random_routing(std::mt19937_64& rng, int64_t L, int64_t k, int64_t E, int64_t only_first = 0) {
  std::vector<int32_t> ids(static_cast<size_t>(L * k));
  std::vector<int32_t> perm(static_cast<size_t>(E));
  const int64_t span = only_first ? only_first : E;
  std::iota(perm.begin(), perm.end(), 0);
  for (int64_t t = 0; t < L; ++t) {
    for (int64_t j = 0; j < k; ++j) {  // partial Fisher-Yates over the first `span` experts
      std::uniform_int_distribution<int64_t> pick(j, span - 1);
      std::swap(perm[static_cast<size_t>(j)], perm[static_cast<size_t>(pick(rng))]);
      ids[static_cast<size_t>(t * k + j)] = perm[static_cast<size_t>(j)];
    }
  }
  return ids;
}

inline uint64_t test_seed(const char* test) {
  const char* env = getenv("MOEBLAZE_TEST_SEED");
  const uint64_t s = env ? strtoull(env, nullptr, 0) : std::random_device{}();
  fprintf(stderr, "[seed] %s MOEBLAZE_TEST_SEED=%llu\n", test, static_cast<unsigned long long>(s));
  return s;
}
