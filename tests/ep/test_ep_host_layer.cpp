// The expert-parallel forward and backward on the host (src/ep/host_layer over the in-process
// loopback) against the independent fp64 reference layer (tests/common/reference_moe:
// ref_forward and ref_backward over all E experts on one device; the weight gradients summed
// over the ranks' tokens): y, dx, the gate gradients and both weight gradients; P = 1 to 4 and 8 ranks as threads, each with its own tokens (one with
// none), every activation, k above and below the experts per rank, routing spread or skewed onto
// rank 0's experts, fp32 and bf16 weights. Relative L2 error within fp32 accumulation noise.
#include "ep/host_layer.hpp"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <numeric>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "ep/exchange.hpp"
#include "util/dtype.hpp"
#include "util/error.hpp"

extern "C" {
#include "reference_moe.h"
}

#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <setjmp.h>
extern "C" {
#include <cmocka.h>
}

using namespace moeblaze;
using namespace moeblaze::ep;

namespace {

struct Case {
  int32_t P, E, k;
  int64_t d, h;
  Activation act;
  bool skew;
  DType wdt;
};

View weight_view(void* data, DType dt, int64_t E, int64_t R, int64_t C) {
  View v;
  v.present = true;
  v.dtype = dt;
  v.ndim = 3;
  v.data = static_cast<char*>(data);
  v.shape[0] = E;
  v.shape[1] = R;
  v.shape[2] = C;
  v.stride[0] = R * C;
  v.stride[1] = C;
  v.stride[2] = 1;
  v.span_bytes = static_cast<size_t>(E * R * C) * dtype_size(dt);
  return v;
}

double run_case(const Case& c, std::mt19937_64& rng) {
  const int64_t g = is_gated(c.act) ? 2 : 1, gh = g * c.h, El = c.E / c.P;
  std::normal_distribution<double> nd(0.0, 1.0);
  std::uniform_real_distribution<double> ud(0.1, 1.0);
  // Global weights, as the dtype holds them (bf16: rounded), in double for the reference.
  std::vector<double> wgu(static_cast<size_t>(c.E * c.d * gh)), wd(static_cast<size_t>(c.E * c.h * c.d));
  for (double& v : wgu) v = nd(rng) / std::sqrt(static_cast<double>(c.d));
  for (double& v : wd) v = nd(rng) / std::sqrt(static_cast<double>(c.h));
  std::vector<float> wgu32(wgu.size()), wd32(wd.size());
  std::vector<uint16_t> wgu16(wgu.size()), wd16(wd.size());
  for (size_t i = 0; i < wgu.size(); ++i) {
    wgu16[i] = f32_to_bf16(static_cast<float>(wgu[i]));
    if (c.wdt == DType::kBF16) wgu[i] = bf16_to_f32(wgu16[i]);
    wgu32[i] = static_cast<float>(wgu[i]);
  }
  for (size_t i = 0; i < wd.size(); ++i) {
    wd16[i] = f32_to_bf16(static_cast<float>(wd[i]));
    if (c.wdt == DType::kBF16) wd[i] = bf16_to_f32(wd16[i]);
    wd32[i] = static_cast<float>(wd[i]);
  }
  struct Rank {
    int64_t L;
    std::vector<float> x, gates, y, dy, dx, dgates, dwgu, dwd;
    std::vector<int32_t> ids;
  };
  std::vector<Rank> ranks(c.P);
  std::vector<int32_t> pool(c.E);
  for (int32_t r = 0; r < c.P; ++r) {
    Rank& rk = ranks[r];
    rk.L = r == c.P - 1 && c.P > 1 ? 0 : 1 + static_cast<int64_t>(rng() % 97);  // the last rank brings none
    rk.x.resize(rk.L * c.d);
    rk.gates.resize(rk.L * c.k);
    rk.ids.resize(rk.L * c.k);
    for (float& v : rk.x) v = static_cast<float>(nd(rng));
    rk.dy.resize(rk.L * c.d);
    for (float& v : rk.dy) v = static_cast<float>(nd(rng));
    for (int64_t t = 0; t < rk.L; ++t) {
      std::iota(pool.begin(), pool.end(), 0);
      std::shuffle(pool.begin(), pool.end(), rng);
      if (c.skew) std::stable_partition(pool.begin(), pool.end(), [&](int32_t e) { return e < El; });
      for (int32_t j = 0; j < c.k; ++j) {
        rk.ids[t * c.k + j] = pool[j];
        rk.gates[t * c.k + j] = static_cast<float>(ud(rng));
      }
    }
  }
  const Placement pl{c.P, c.E};
  LoopbackGroup group(c.P);
  std::vector<std::thread> threads;
  for (int32_t r = 0; r < c.P; ++r)
    threads.emplace_back([&, r] {
      Rank& rk = ranks[r];
      HostForwardArgs a;
      a.activation = c.act;
      a.hidden = c.d;
      a.ffn = c.h;
      a.top_k = c.k;
      a.tokens = rk.L;
      a.x = rk.x.data();
      a.topk_ids = rk.ids.data();
      a.gates = rk.gates.data();
      const size_t gu_off = static_cast<size_t>(r * El * c.d * gh), d_off = static_cast<size_t>(r * El * c.h * c.d);
      void* gu = c.wdt == DType::kBF16 ? static_cast<void*>(&wgu16[gu_off]) : static_cast<void*>(&wgu32[gu_off]);
      void* dn = c.wdt == DType::kBF16 ? static_cast<void*>(&wd16[d_off]) : static_cast<void*>(&wd32[d_off]);
      a.w_gate_up = weight_view(gu, c.wdt, El, c.d, gh);
      a.w_down = weight_view(dn, c.wdt, El, c.h, c.d);
      rk.y.assign(rk.L * c.d, NAN);
      auto tr = group.transport(r);
      host_forward(*tr, pl, a, rk.y.data());
      rk.dx.assign(rk.L * c.d, NAN);
      rk.dgates.assign(rk.L * c.k, NAN);
      rk.dwgu.assign(El * c.d * gh, NAN);
      rk.dwd.assign(El * c.h * c.d, NAN);
      HostBackwardOut o{rk.dx.data(), rk.dgates.data(), rk.dwgu.data(), rk.dwd.data()};
      host_backward(*tr, pl, a, rk.dy.data(), o);
    });
  for (std::thread& t : threads) t.join();
  // The reference, per rank, over all E experts.
  ref_layer l{};
  l.E = c.E;
  l.k = c.k;
  l.d = c.d;
  l.h = c.h;
  l.activation = static_cast<int32_t>(c.act);
  double worst = 0;
  auto err = [&](const std::vector<float>& got, const std::vector<double>& ref) {
    std::vector<double> g(got.begin(), got.end());
    worst = std::max(worst, ref_rel_l2(g.data(), ref.data(), g.size()));
  };
  // Weight gradients: the sum over ranks of each rank's tokens' gradients, against the
  // concatenation of the ranks' local experts' gradients.
  std::vector<double> dwgu_ref(wgu.size(), 0.0), dwd_ref(wd.size(), 0.0);
  std::vector<double> tmp_gu(wgu.size()), tmp_d(wd.size());
  for (const Rank& rk : ranks) {
    if (rk.L == 0) continue;
    std::vector<double> x(rk.x.begin(), rk.x.end()), gates(rk.gates.begin(), rk.gates.end()), ref(rk.L * c.d);
    std::vector<double> dy(rk.dy.begin(), rk.dy.end()), dx(rk.L * c.d), dg(rk.L * c.k);
    std::vector<int64_t> ids(rk.ids.begin(), rk.ids.end());
    ref_forward(&l, rk.L, x.data(), wgu.data(), wd.data(), ids.data(), gates.data(), ref.data());
    ref_backward(&l, rk.L, x.data(), wgu.data(), wd.data(), ids.data(), gates.data(), dy.data(), dx.data(), tmp_gu.data(),
                 tmp_d.data(), dg.data());
    err(rk.y, ref);
    err(rk.dx, dx);
    err(rk.dgates, dg);
    for (size_t i = 0; i < tmp_gu.size(); ++i) dwgu_ref[i] += tmp_gu[i];
    for (size_t i = 0; i < tmp_d.size(); ++i) dwd_ref[i] += tmp_d[i];
  }
  std::vector<float> dwgu_got, dwd_got;
  for (const Rank& rk : ranks) {
    dwgu_got.insert(dwgu_got.end(), rk.dwgu.begin(), rk.dwgu.end());
    dwd_got.insert(dwd_got.end(), rk.dwd.begin(), rk.dwd.end());
  }
  err(dwgu_got, dwgu_ref);
  err(dwd_got, dwd_ref);
  return worst;
}

void forward_and_backward_match_single_device(void**) {
  std::mt19937_64 rng(20261126);
  const Activation acts[] = {Activation::kRelu, Activation::kGelu, Activation::kSilu, Activation::kSwiglu,
                             Activation::kGeglu};
  int cases = 0;
  double worst = 0;
  for (int32_t P : {1, 2, 3, 4})
    for (int32_t El : {1, 3})
      for (int32_t k : {1, 2, 4}) {
        if (k > P * El) continue;
        for (Activation act : acts)
          for (bool skew : {false, true}) {
            const Case c{P, P * El, k, 24, 40, act, skew, cases % 3 == 2 ? DType::kBF16 : DType::kF32};
            const double err = run_case(c, rng);
            if (err > 1e-5) std::printf("P %d E %d k %d act %d skew %d: rel err %.3g\n", P, c.E, k, static_cast<int>(act), skew, err);
            assert_true(err <= 1e-5);
            worst = std::max(worst, err);
            ++cases;
          }
      }
  // Eight ranks, as one 8-GPU host runs them: k below, at and above the experts per rank.
  for (int32_t El : {1, 2})
    for (int32_t k : {1, 3, 8})
      for (Activation act : {Activation::kSwiglu, Activation::kGelu})
        for (bool skew : {false, true}) {
          const Case c{8, 8 * El, k, 24, 40, act, skew, cases % 3 == 2 ? DType::kBF16 : DType::kF32};
          const double err = run_case(c, rng);
          if (err > 1e-5) std::printf("P 8 E %d k %d act %d skew %d: rel err %.3g\n", c.E, k, static_cast<int>(act), skew, err);
          assert_true(err <= 1e-5);
          worst = std::max(worst, err);
          ++cases;
        }
  std::printf("%d EP forwards and backwards on 1 to 4 and 8 ranks against the fp64 single-device reference (y, dx, "
              "dgates, dW_gate_up, dW_down): worst relative L2 error %.3g\n", cases, worst);
}

// One step on P threads: each rank's flags from forward and backward, its y and dx.
struct StepResult {
  std::vector<int32_t> fwd_flag, bwd_flag;
  std::vector<std::vector<float>> y, dx;
};

StepResult step(int32_t P, int32_t E, int32_t k, int64_t bound, int32_t failing_rank, uint64_t seed) {
  const int64_t d = 8, h = 12, El = E / P;
  std::mt19937_64 rng(seed);
  std::normal_distribution<double> nd(0.0, 1.0);
  std::vector<float> wgu(static_cast<size_t>(E * d * h)), wd(static_cast<size_t>(E * h * d));
  for (float& v : wgu) v = static_cast<float>(nd(rng) * 0.3);
  for (float& v : wd) v = static_cast<float>(nd(rng) * 0.3);
  struct Rank {
    int64_t L;
    std::vector<float> x, gates, dy;
    std::vector<int32_t> ids;
  };
  std::vector<Rank> ranks(P);
  std::vector<int32_t> pool(E);
  for (int32_t r = 0; r < P; ++r) {
    Rank& rk = ranks[r];
    rk.L = 20 + 7 * r;
    for (int64_t i = 0; i < rk.L * d; ++i) rk.x.push_back(static_cast<float>(nd(rng)));
    for (int64_t i = 0; i < rk.L * d; ++i) rk.dy.push_back(static_cast<float>(nd(rng)));
    for (int64_t t = 0; t < rk.L; ++t) {
      std::iota(pool.begin(), pool.end(), 0);
      std::shuffle(pool.begin(), pool.end(), rng);
      std::stable_partition(pool.begin(), pool.end(), [&](int32_t e) { return e < El; });  // onto rank 0
      for (int32_t j = 0; j < k; ++j) {
        rk.ids.push_back(pool[j]);
        rk.gates.push_back(0.5f);
      }
    }
  }
  StepResult res;
  res.fwd_flag.assign(P, -1);
  res.bwd_flag.assign(P, -1);
  res.y.resize(P);
  res.dx.resize(P);
  const Placement pl{P, E};
  LoopbackGroup group(P);
  std::vector<std::thread> threads;
  for (int32_t r = 0; r < P; ++r)
    threads.emplace_back([&, r] {
      Rank& rk = ranks[r];
      HostForwardArgs a;
      a.activation = Activation::kSilu;
      a.hidden = d;
      a.ffn = h;
      a.top_k = k;
      a.tokens = rk.L;
      a.x = rk.x.data();
      a.topk_ids = rk.ids.data();
      a.gates = rk.gates.data();
      a.w_gate_up = weight_view(&wgu[static_cast<size_t>(r * El * d * h)], DType::kF32, El, d, h);
      a.w_down = weight_view(&wd[static_cast<size_t>(r * El * h * d)], DType::kF32, El, h, d);
      a.max_recv_rows = bound;
      a.flag = r == failing_rank ? 1 : 0;
      auto tr = group.transport(r);
      res.y[r].assign(rk.L * d, 0.f);
      res.fwd_flag[r] = host_forward(*tr, pl, a, res.y[r].data());
      std::vector<float> dg(rk.L * k), dwgu(El * d * h), dwd(El * h * d);
      res.dx[r].assign(rk.L * d, 0.f);
      HostBackwardOut o{res.dx[r].data(), dg.data(), dwgu.data(), dwd.data()};
      res.bwd_flag[r] = host_backward(*tr, pl, a, rk.dy.data(), o);
    });
  for (std::thread& t : threads) t.join();
  return res;
}

bool all_nan(const std::vector<std::vector<float>>& v) {
  for (const auto& r : v)
    for (float f : r)
      if (!std::isnan(f)) return false;
  return true;
}

// EP_MAX_RECV_TOKENS: a bound one row short of what the busiest rank receives turns every
// output of every rank NaN with kRecvOverflow on every rank; the exact bound changes nothing.
// A rank whose own checks failed turns every other rank's outputs NaN (kPeerFailed).
void receive_bound_and_failed_peers(void**) {
  const int32_t P = 3, E = 6, k = 2;
  const StepResult free_run = step(P, E, k, 0, -1, 7);
  // The busiest rank's rows: the smallest bound that does not overflow (routing is skewed onto
  // rank 0, which receives from every rank).
  int64_t busiest = 0;
  for (int64_t bound = 1; bound < 400 && busiest == 0; ++bound) {
    const StepResult r = step(P, E, k, bound, -1, 7);
    if (r.fwd_flag[0] == 0) busiest = bound;
  }
  assert_true(busiest > 20);  // rank 0 receives from every rank
  const StepResult tight = step(P, E, k, busiest - 1, -1, 7), exact = step(P, E, k, busiest, -1, 7);
  for (int32_t r = 0; r < P; ++r) {
    assert_int_equal(tight.fwd_flag[r], kRecvOverflow);
    assert_int_equal(tight.bwd_flag[r], kRecvOverflow);
    assert_int_equal(exact.fwd_flag[r], 0);
    assert_int_equal(exact.bwd_flag[r], 0);
    assert_true(exact.y[r] == free_run.y[r]);  // bitwise: the bound changes nothing that fits
    assert_true(exact.dx[r] == free_run.dx[r]);
  }
  assert_true(all_nan(tight.y) && all_nan(tight.dx));
  const StepResult failed = step(P, E, k, 0, 1, 7);
  for (int32_t r = 0; r < P; ++r) {
    assert_int_equal(failed.fwd_flag[r], r == 1 ? 1 : kPeerFailed);
    assert_int_equal(failed.bwd_flag[r], r == 1 ? 1 : kPeerFailed);
  }
  assert_true(all_nan(failed.y) && all_nan(failed.dx));
  std::printf("receive bound %lld rows: one less overflows on all %d ranks, the exact bound matches the dropless "
              "step bitwise; a failed rank poisons every rank\n", static_cast<long long>(busiest), P);
}

// Configurations that differ across ranks are refused on every rank, naming the first one.
void differing_configs_are_refused_everywhere(void**) {
  const int32_t P = 4;
  LoopbackGroup group(P);
  std::vector<int> refused(P, 0);
  std::vector<std::string> msg(P);
  std::vector<std::thread> threads;
  for (int32_t r = 0; r < P; ++r)
    threads.emplace_back([&, r] {
      auto tr = group.transport(r);
      try {
        require_same_config(*tr, r == 2 ? 8 : 7);
      } catch (const Error& e) {
        refused[r] = e.status() == Status::kInvalidArgument;
        msg[r] = e.what();
      }
      require_same_config(*tr, 99);  // and the same digest everywhere passes
    });
  for (std::thread& t : threads) t.join();
  for (int32_t r = 0; r < P; ++r) {
    assert_true(refused[r]);
    assert_non_null(std::strstr(msg[r].c_str(), "rank 2"));
  }
}

}  // namespace

int main() {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(forward_and_backward_match_single_device),
      cmocka_unit_test(receive_bound_and_failed_peers),
      cmocka_unit_test(differing_configs_are_refused_everywhere),
  };
  return cmocka_run_group_tests(tests, nullptr, nullptr);
}
