// Expert parallelism's host data movement (src/ep/exchange over the in-process loopback
// transport): P threads as ranks, each with its own tokens (some with none), route them,
// dispatch rows and their experts and gates, compute a stand-in expert function on the
// received rows (sum over the row's local experts in id order of gate * f_e(x)), send the
// partial sums back and combine them in rank order. Every token's result must equal the same
// sums computed directly on the token's own rank, bitwise (doubles, the same order), for
// uniform and skewed routings, k above and below the experts per rank, P = 1 to 8.
#include "ep/exchange.hpp"

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <numeric>
#include <random>
#include <thread>
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

constexpr int kD = 5;  // doubles per token row

double expert_fn(int32_t e, double x, int c) { return x * (e + 1) + 0.25 * e - c; }

struct RankData {
  int64_t L = 0;
  std::vector<int32_t> ids;     // [L, k] global
  std::vector<double> gates;    // [L, k]
  std::vector<double> x;        // [L, kD]
  std::vector<double> y;        // [L, kD] through EP
  int64_t received = 0;
};

// The row record a destination receives: the token row, then per row slot its local expert
// (as a double; -1 past the row's experts) and gate.
int64_t record_doubles(const SendPlan& sp) { return kD + 2 * sp.row_slots; }

void run_rank(Transport& tr, const Placement& pl, int32_t k, RankData& rd) {
  const SendPlan sp = make_send_plan(pl, rd.ids.data(), rd.L, k);
  const std::vector<int64_t> recv_off = exchange_counts(tr, sp).recv_off;
  const int64_t rec = record_doubles(sp), R = recv_off.back();
  std::vector<double> send(static_cast<size_t>(sp.sends()) * rec), recv(static_cast<size_t>(R) * rec);
  for (int32_t s = 0; s < sp.sends(); ++s) {
    double* r = &send[static_cast<size_t>(s) * rec];
    const int32_t t = sp.token[s];
    std::copy_n(&rd.x[static_cast<size_t>(t) * kD], kD, r);
    for (int32_t i = 0; i < sp.row_slots; ++i) {
      const int32_t slot = sp.topk_slot[static_cast<size_t>(s) * sp.row_slots + i];
      r[kD + 2 * i] = sp.local_expert[static_cast<size_t>(s) * sp.row_slots + i];
      r[kD + 2 * i + 1] = slot >= 0 ? rd.gates[t * k + slot] : 0.0;
    }
  }
  dispatch_rows(tr, sp, recv_off, send.data(), rec * 8, recv.data());
  rd.received = R;
  // The destination's experts: partial sums over each row's local experts in id order.
  const int32_t first = tr.rank() * pl.experts_per_rank();
  std::vector<double> partial(static_cast<size_t>(R) * kD, 0.0);
  for (int64_t i = 0; i < R; ++i) {
    const double* r = &recv[static_cast<size_t>(i) * rec];
    for (int c = 0; c < kD; ++c) {
      double acc = 0;
      for (int32_t j = 0; j < sp.row_slots && r[kD + 2 * j] >= 0; ++j)
        acc += r[kD + 2 * j + 1] * expert_fn(first + static_cast<int32_t>(r[kD + 2 * j]), r[c], c);
      partial[static_cast<size_t>(i) * kD + c] = acc;
    }
  }
  std::vector<double> back(static_cast<size_t>(sp.sends()) * kD);
  return_rows(tr, sp, recv_off, partial.data(), kD * 8, back.data());
  rd.y.assign(static_cast<size_t>(rd.L) * kD, 0.0);
  for (int64_t t = 0; t < rd.L; ++t)
    for (int32_t i = 0; i < sp.token_slots; ++i) {
      const int32_t s = sp.token_send[t * sp.token_slots + i];
      if (s < 0) break;
      for (int c = 0; c < kD; ++c) rd.y[t * kD + c] += back[static_cast<size_t>(s) * kD + c];
    }
}

// The same sums on the token's own rank: ranks in order, each rank's experts in id order.
std::vector<double> direct(const Placement& pl, int32_t k, const RankData& rd) {
  std::vector<double> y(static_cast<size_t>(rd.L) * kD, 0.0);
  std::vector<int32_t> order(k);
  for (int64_t t = 0; t < rd.L; ++t) {
    std::iota(order.begin(), order.end(), 0);
    std::sort(order.begin(), order.end(), [&](int32_t a, int32_t b) { return rd.ids[t * k + a] < rd.ids[t * k + b]; });
    for (int c = 0; c < kD; ++c) {
      double total = 0, part = 0;
      int32_t rank = -1;
      for (int32_t j : order) {
        const int32_t e = rd.ids[t * k + j];
        if (pl.owner(e) != rank && rank >= 0) {
          total += part;
          part = 0;
        }
        rank = pl.owner(e);
        part += rd.gates[t * k + j] * expert_fn(e, rd.x[t * kD + c], c);
      }
      y[t * kD + c] = total + part;
    }
  }
  return y;
}

void group_case(int32_t P, int32_t El, int32_t k, bool skew, std::mt19937_64& rng, int64_t* rows_moved) {
  const Placement pl{P, P * El};
  std::vector<RankData> data(P);
  std::vector<int32_t> pool(pl.num_experts);
  for (int32_t r = 0; r < P; ++r) {
    RankData& rd = data[r];
    rd.L = r == 1 ? 0 : static_cast<int64_t>(rng() % 200);  // rank 1 brings no tokens
    rd.ids.resize(rd.L * k);
    rd.gates.resize(rd.L * k);
    rd.x.resize(rd.L * kD);
    std::uniform_real_distribution<double> u(-1, 1);
    for (int64_t t = 0; t < rd.L; ++t) {
      std::iota(pool.begin(), pool.end(), 0);
      std::shuffle(pool.begin(), pool.end(), rng);
      if (skew) std::stable_partition(pool.begin(), pool.end(), [&](int32_t e) { return e < El; });
      for (int32_t j = 0; j < k; ++j) {
        rd.ids[t * k + j] = pool[j];
        rd.gates[t * k + j] = u(rng);
      }
      for (int c = 0; c < kD; ++c) rd.x[t * kD + c] = u(rng);
    }
  }
  LoopbackGroup group(P);
  std::vector<std::thread> threads;
  for (int32_t r = 0; r < P; ++r)
    threads.emplace_back([&, r] {
      auto tr = group.transport(r);
      run_rank(*tr, pl, k, data[r]);
    });
  for (std::thread& th : threads) th.join();
  for (int32_t r = 0; r < P; ++r) {
    const std::vector<double> want = direct(pl, k, data[r]);
    assert_int_equal(want.size(), data[r].y.size());
    assert_memory_equal(want.data(), data[r].y.data(), want.size() * sizeof(double));
    *rows_moved += data[r].received;
  }
  if (skew && P > 1) assert_true(data[0].received > 0);
}

void dispatch_and_combine_round_trip(void**) {
  std::mt19937_64 rng(11);
  int cases = 0;
  int64_t rows = 0;
  for (int32_t P : {1, 2, 3, 4, 8})
    for (int32_t El : {1, 2, 4})
      for (int32_t k : {1, 2, 4, 8}) {
        if (k > P * El) continue;
        for (bool skew : {false, true}) {
          group_case(P, El, k, skew, rng, &rows);
          ++cases;
        }
      }
  std::printf("%d EP groups, %lld rows received in all: every token equal to its direct sum\n", cases,
              static_cast<long long>(rows));
}

}  // namespace

int main() {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(dispatch_and_combine_round_trip),
  };
  return cmocka_run_group_tests(tests, nullptr, nullptr);
}
