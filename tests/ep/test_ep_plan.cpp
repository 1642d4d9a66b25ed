// Expert parallelism's send plan (src/ep/send_plan) against a brute-force reading of its
// definition (docs/ep.md): every (token, owning rank) pair sent exactly once, destinations'
// rows in token order, each row's local experts ascending with their top-k slots, each token's
// sends in rank order, receive offsets by source rank; on random, skewed and single-rank
// routings, k above and below the experts per rank, and no tokens. Also the placements refused.
#include "ep/send_plan.hpp"

#include <algorithm>
#include <cstdio>
#include <numeric>
#include <random>
#include <set>
#include <vector>

#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <setjmp.h>
extern "C" {
#include <cmocka.h>
}

using namespace moeblaze::ep;

namespace {

// Distinct ids per token: uniform, or (skewed) drawn from the first rank's experts first.
std::vector<int32_t> routing(std::mt19937_64& rng, int64_t L, int32_t E, int32_t k, int32_t skew_to) {
  std::vector<int32_t> ids(static_cast<size_t>(L) * k);
  std::vector<int32_t> pool(E);
  for (int64_t t = 0; t < L; ++t) {
    std::iota(pool.begin(), pool.end(), 0);
    std::shuffle(pool.begin(), pool.end(), rng);
    if (skew_to > 0) std::stable_partition(pool.begin(), pool.end(), [&](int32_t e) { return e < skew_to; });
    std::copy(pool.begin(), pool.begin() + k, ids.begin() + t * k);
  }
  return ids;
}

void check_plan(const Placement& pl, const std::vector<int32_t>& ids, int64_t L, int32_t k) {
  const SendPlan sp = make_send_plan(pl, ids.data(), L, k);
  const int32_t P = pl.ranks, El = pl.experts_per_rank();
  assert_int_equal(sp.row_slots, std::min(k, El));
  assert_int_equal(sp.token_slots, std::min(k, P));
  assert_int_equal(sp.dest_start.size(), P + 1);
  assert_int_equal(sp.dest_start[0], 0);
  std::vector<int32_t> seen(static_cast<size_t>(L) * P, 0);
  for (int32_t q = 0; q < P; ++q) {
    assert_true(sp.dest_start[q] <= sp.dest_start[q + 1]);
    for (int32_t s = sp.dest_start[q]; s < sp.dest_start[q + 1]; ++s) {
      const int32_t t = sp.token[s];
      assert_true(t >= 0 && t < L);
      if (s > sp.dest_start[q]) assert_true(sp.token[s - 1] < t);  // token order
      ++seen[static_cast<size_t>(t) * P + q];
      // The row's experts: exactly the token's experts on q, ascending, then -1.
      std::vector<int32_t> want;
      for (int32_t j = 0; j < k; ++j)
        if (pl.owner(ids[t * k + j]) == q) want.push_back(pl.local(ids[t * k + j]));
      std::sort(want.begin(), want.end());
      assert_false(want.empty());
      for (int32_t i = 0; i < sp.row_slots; ++i) {
        const int32_t le = sp.local_expert[static_cast<size_t>(s) * sp.row_slots + i];
        const int32_t slot = sp.topk_slot[static_cast<size_t>(s) * sp.row_slots + i];
        if (i < static_cast<int32_t>(want.size())) {
          assert_int_equal(le, want[i]);
          assert_true(slot >= 0 && slot < k);
          assert_int_equal(ids[t * k + slot], q * El + le);
        } else {
          assert_int_equal(le, -1);
          assert_int_equal(slot, -1);
        }
      }
    }
  }
  for (int64_t t = 0; t < L; ++t) {
    std::set<int32_t> owners;
    for (int32_t j = 0; j < k; ++j) owners.insert(pl.owner(ids[t * k + j]));
    for (int32_t q = 0; q < P; ++q) assert_int_equal(seen[t * P + q], owners.count(q));
    // The token's sends: one per owning rank, in rank order, then -1.
    std::vector<int32_t> ranks(owners.begin(), owners.end());
    for (int32_t i = 0; i < sp.token_slots; ++i) {
      const int32_t s = sp.token_send[t * sp.token_slots + i];
      if (i < static_cast<int32_t>(ranks.size())) {
        assert_true(s >= sp.dest_start[ranks[i]] && s < sp.dest_start[ranks[i] + 1]);
        assert_int_equal(sp.token[s], t);
      } else {
        assert_int_equal(s, -1);
      }
    }
  }
}

void plans_match_their_definition(void**) {
  std::mt19937_64 rng(20261126);
  int cases = 0;
  for (int32_t P : {1, 2, 3, 4, 8})
    for (int32_t El : {1, 2, 5, 16})
      for (int32_t k : {1, 2, 4, 8}) {
        const int32_t E = P * El;
        if (k > E) continue;
        for (int64_t L : {0, 1, 7, 300})
          for (int32_t skew : {0, El}) {  // El: the first rank's experts first
            const Placement pl{P, E};
            check_plan(pl, routing(rng, L, E, k, skew), L, k);
            ++cases;
          }
      }
  std::printf("%d send plans checked\n", cases);
}

void receive_layout_by_source(void**) {
  const std::vector<int64_t> off = receive_offsets({3, 0, 5, 1});
  const std::vector<int64_t> want = {0, 3, 3, 8, 9};
  assert_true(off == want);
  assert_int_equal(receive_offsets({}).size(), 1);
}

void placements_refused(void**) {
  assert_null(placement_error(4, 128));
  assert_null(placement_error(1, 1));
  assert_non_null(placement_error(0, 8));
  assert_non_null(placement_error(3, 128));  // not a multiple
  assert_non_null(placement_error(8, 4));    // a rank without experts
}

}  // namespace

int main() {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(plans_match_their_definition),
      cmocka_unit_test(receive_layout_by_source),
      cmocka_unit_test(placements_refused),
  };
  return cmocka_run_group_tests(tests, nullptr, nullptr);
}
