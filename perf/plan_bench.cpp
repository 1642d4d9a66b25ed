// perf/plan-bench: the routing plan built by the paper's three atomic-free passes against the
// CUB radix-sort baseline, on the GPU. Prints time (median of CUDA-event timings) and
// effective bandwidth (ids read once, the three index lists written once: 16 L k bytes) for
// (L, E, k) = (65536, 16, 4), (40960, 128, 8), (262144, 64, 8), (1048576, 256, 8), plus the scratch each
// build needs, and checks that both builds give identical plans. `plan-bench L E k` runs one case.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <numeric>
#include <random>
#include <vector>

#include "core/memory_layout.hpp"
#include "cuda_bench.hpp"
#include "routing/router_cuda.hpp"
#include "util/error.hpp"

using namespace moeblaze;

struct DevicePlan {
  int32_t *ids, *eti, *tim, *off;
  RoutingPlan plan() const {
    RoutingPlan p;
    p.token_expert_indices = ids;
    p.expert_token_indices = eti;
    p.token_index_map = tim;
    p.expert_token_offsets = off;
    return p;
  }
};

int main(int argc, char** argv) {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess || n == 0) {
    std::printf("plan-bench: no CUDA device\n");
    return 77;
  }
  struct Case { int64_t L, E, k; };
  std::vector<Case> cases = {{65536, 16, 4}, {40960, 128, 8}, {262144, 64, 8}, {1048576, 256, 8}};
  if (argc == 4) {  // one case: plan-bench L E k (for a profiler)
    const Case one{std::atoll(argv[1]), std::atoll(argv[2]), std::atoll(argv[3])};
    if (one.L < 1 || one.E < 1 || one.k < 1 || one.k > one.E) {
      std::fprintf(stderr, "usage: plan-bench [L E k], 1 <= k <= E\n");
      return 2;
    }
    cases = {one};
  }
  cudaStream_t s;
  CK(cudaStreamCreate(&s));
  std::printf("| L | E | k | three-pass ms | GB/s | scratch MiB | CUB radix sort ms | GB/s | scratch MiB | speedup | identical |\n");
  std::printf("|---|---|---|---|---|---|---|---|---|---|---|\n");
  for (const Case& c : cases) {
    const int64_t P = c.L * c.k;
    std::mt19937_64 rng(1234);
    std::vector<int32_t> ids(static_cast<size_t>(P)), perm(static_cast<size_t>(c.E));
    for (int64_t t = 0; t < c.L; ++t) {
      std::iota(perm.begin(), perm.end(), 0);
      for (int64_t j = 0; j < c.k; ++j) {  // partial Fisher-Yates: k distinct experts
        std::uniform_int_distribution<int64_t> pick(j, c.E - 1);
        std::swap(perm[j], perm[pick(rng)]);
        ids[t * c.k + j] = perm[j];
      }
    }
    DevicePlan a, b;
    for (DevicePlan* d : {&a, &b}) {
      CK(cudaMalloc(&d->ids, P * 4));
      CK(cudaMalloc(&d->eti, P * 4));
      CK(cudaMalloc(&d->tim, P * 4));
      CK(cudaMalloc(&d->off, (c.E + 1) * 4));
      CK(cudaMemcpy(d->ids, ids.data(), P * 4, cudaMemcpyHostToDevice));
    }
    const size_t sa = routing::plan_scratch_bytes_cuda(c.L, c.E), sb = routing::sort_plan_scratch_bytes_cuda(c.L, c.k, c.E);
    void *scratch_a, *scratch_b;
    CK(cudaMalloc(&scratch_a, sa));
    CK(cudaMalloc(&scratch_b, sb));
    RoutingPlan pa = a.plan(), pb = b.plan();
    const double ta = median_ms([&] { routing::build_plan_cuda(pa, c.L, c.k, c.E, scratch_a, s); }, s, 50);
    const double tb = median_ms([&] { routing::build_plan_sort_cuda(pb, c.L, c.k, c.E, scratch_b, s); }, s, 50);
    CK(cudaStreamSynchronize(s));
    std::vector<int32_t> ea(P), eb(P), ma(P), mb(P), oa(c.E + 1), ob(c.E + 1);
    CK(cudaMemcpy(ea.data(), a.eti, P * 4, cudaMemcpyDeviceToHost));
    CK(cudaMemcpy(eb.data(), b.eti, P * 4, cudaMemcpyDeviceToHost));
    CK(cudaMemcpy(ma.data(), a.tim, P * 4, cudaMemcpyDeviceToHost));
    CK(cudaMemcpy(mb.data(), b.tim, P * 4, cudaMemcpyDeviceToHost));
    CK(cudaMemcpy(oa.data(), a.off, (c.E + 1) * 4, cudaMemcpyDeviceToHost));
    CK(cudaMemcpy(ob.data(), b.off, (c.E + 1) * 4, cudaMemcpyDeviceToHost));
    const bool same = ea == eb && ma == mb && oa == ob;
    const double bytes = 16.0 * static_cast<double>(P);
    std::printf("| %lld | %lld | %lld | %.4f | %.0f | %.2f | %.4f | %.0f | %.2f | %.2fx | %s |\n", static_cast<long long>(c.L),
                static_cast<long long>(c.E), static_cast<long long>(c.k), ta, bytes / (ta * 1e6), sa / 1048576.0, tb,
                bytes / (tb * 1e6), sb / 1048576.0, tb / ta, same ? "yes" : "NO");
    for (DevicePlan* d : {&a, &b}) {
      cudaFree(d->ids); cudaFree(d->eti); cudaFree(d->tim); cudaFree(d->off);
    }
    cudaFree(scratch_a);
    cudaFree(scratch_b);
  }
  return 0;
}
