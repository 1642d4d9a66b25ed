// perf/router-bench: the CUDA router's kernels alone on random fp32 logits (softmax, normalised
// top-k, aux and z losses): top-k with the scores (route_tokens), the losses, and the backward
// to d logits written as fp32 rows or as the bf16 hi/lo pair the tensor-core GEMMs read. Prints
// the median of CUDA-event timings and the effective bandwidth of each (the bytes each kernel
// must read and write once: the floor against HBM), and checks that the pair is the fp32 rows
// split, bit for bit. Cases (L, E, k) cover one to eight experts per lane and the E > 256 path;
// `router-bench L E k` runs one case (for a profiler). With ROUTER_BENCH_DUMP=dir set, each
// case's outputs (ids, gates, lse, fp32 d logits) go to dir/L-E-k.bin, so that two builds can be
// compared bit for bit with cmp.
#include <cuda_runtime.h>

#include <cstdio>
#include <cstdlib>
#include <random>
#include <string>
#include <vector>

#include "core/config.hpp"
#include "core/memory_layout.hpp"
#include "cuda_bench.hpp"
#include "routing/router_cuda.hpp"
#include "util/dtype.hpp"

using namespace moeblaze;

int main(int argc, char** argv) {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess || n == 0) {
    std::printf("router-bench: no CUDA device\n");
    return 77;
  }
  struct Case { int64_t L, E, k; };
  std::vector<Case> cases = {{40960, 128, 8}, {32768, 64, 4}, {16384, 8, 2}, {24576, 32, 2}, {8192, 256, 8}, {4096, 512, 8}};
  if (argc == 4) {
    const Case one{std::atoll(argv[1]), std::atoll(argv[2]), std::atoll(argv[3])};
    if (one.L < 1 || one.E < 1 || one.k < 1 || one.k > one.E || one.k > 64) {
      std::fprintf(stderr, "usage: router-bench [L E k], 1 <= k <= min(E, 64)\n");
      return 2;
    }
    cases = {one};
  }
  cudaStream_t s;
  CK(cudaStreamCreate(&s));
  std::printf("| L | E | k | top-k ms | GB/s | losses ms | GB/s | backward, fp32 ms | GB/s | backward, pair ms | GB/s | "
              "pair = split fp32 |\n");
  std::printf("|---|---|---|---|---|---|---|---|---|---|---|---|\n");
  for (const Case& c : cases) {
    LayerConfig cfg{};
    cfg.num_experts = c.E;
    cfg.top_k = c.k;
    cfg.score_fn = ScoreFn::kSoftmax;
    cfg.normalize_topk = true;
    cfg.aux_loss_coeff = 0.01;
    cfg.z_loss_coeff = 0.001;
    const int64_t L = c.L, E = c.E, k = c.k, P = L * k;
    std::mt19937_64 rng(7);
    std::normal_distribution<float> normal(0.f, 2.f);
    std::vector<float> logits(static_cast<size_t>(L * E)), dgates(static_cast<size_t>(P));
    for (float& v : logits) v = normal(rng);
    for (float& v : dgates) v = 0.5f * normal(rng);
    float *d_logits, *d_gates, *d_lse, *d_dgates, *d_dlogits, *d_losses, *d_scratch;
    int32_t *d_ids, *d_eti, *d_tim, *d_off;
    uint16_t* d_pair;
    void* d_plan_scratch;
    CK(cudaMalloc(&d_logits, sizeof(float) * L * E));
    CK(cudaMalloc(&d_gates, sizeof(float) * P));
    CK(cudaMalloc(&d_lse, sizeof(float) * L));
    CK(cudaMalloc(&d_dgates, sizeof(float) * P));
    CK(cudaMalloc(&d_dlogits, sizeof(float) * L * E));
    CK(cudaMalloc(&d_pair, sizeof(uint16_t) * 2 * L * E));
    CK(cudaMalloc(&d_losses, 2 * sizeof(float)));
    CK(cudaMalloc(&d_scratch, sizeof(float) * routing::router_loss_scratch_floats(L, E)));
    CK(cudaMalloc(&d_ids, 4 * P));
    CK(cudaMalloc(&d_eti, 4 * P));
    CK(cudaMalloc(&d_tim, 4 * P));
    CK(cudaMalloc(&d_off, 4 * (E + 1)));
    CK(cudaMalloc(&d_plan_scratch, routing::plan_scratch_bytes_cuda(L, E)));
    CK(cudaMemcpy(d_logits, logits.data(), sizeof(float) * L * E, cudaMemcpyHostToDevice));
    CK(cudaMemcpy(d_dgates, dgates.data(), sizeof(float) * P, cudaMemcpyHostToDevice));
    RoutingPlan plan;
    plan.token_expert_indices = d_ids;
    plan.gates = d_gates;
    plan.expert_token_indices = d_eti;
    plan.token_index_map = d_tim;
    plan.expert_token_offsets = d_off;

    const double t_route = median_ms([&] {
      routing::route_tokens_cuda(cfg, d_logits, L, nullptr, routing::TokenMask{}, d_ids, d_gates, d_lse, s);
    }, s, 50);
    routing::build_plan_cuda(plan, L, k, E, d_plan_scratch, s);
    const double t_losses = median_ms([&] {
      routing::router_losses_cuda(cfg, d_logits, d_lse, d_ids, L, d_off, d_scratch, d_losses, d_losses + 1, s);
    }, s, 50);
    const routing::SequenceBalance none;
    auto backward = [&](float* f32, void* pair) {
      routing::router_backward_cuda(cfg, d_logits, L, L, d_ids, d_dgates, nullptr, nullptr, d_off, none, f32, pair, s);
    };
    const double t_f32 = median_ms([&] { backward(d_dlogits, nullptr); }, s, 50);
    const double t_pair = median_ms([&] { backward(nullptr, d_pair); }, s, 50);
    CK(cudaStreamSynchronize(s));

    std::vector<float> f32(static_cast<size_t>(L * E));
    std::vector<uint16_t> pair(static_cast<size_t>(2 * L * E));
    CK(cudaMemcpy(f32.data(), d_dlogits, sizeof(float) * L * E, cudaMemcpyDeviceToHost));
    CK(cudaMemcpy(pair.data(), d_pair, sizeof(uint16_t) * 2 * L * E, cudaMemcpyDeviceToHost));
    bool split = true;
    for (int64_t t = 0; t < L && split; ++t)
      for (int64_t e = 0; e < E; ++e) {
        const float v = f32[t * E + e];
        const uint16_t hi = f32_to_bf16(v), lo = f32_to_bf16(v - bf16_to_f32(hi));
        if (pair[t * 2 * E + e] != hi || pair[t * 2 * E + E + e] != lo) {
          split = false;
          break;
        }
      }
    if (const char* dir = std::getenv("ROUTER_BENCH_DUMP")) {
      std::vector<int32_t> ids(static_cast<size_t>(P));
      std::vector<float> gates(static_cast<size_t>(P)), lse(static_cast<size_t>(L));
      CK(cudaMemcpy(ids.data(), d_ids, 4 * P, cudaMemcpyDeviceToHost));
      CK(cudaMemcpy(gates.data(), d_gates, 4 * P, cudaMemcpyDeviceToHost));
      CK(cudaMemcpy(lse.data(), d_lse, 4 * L, cudaMemcpyDeviceToHost));
      const std::string path = std::string(dir) + "/" + std::to_string(L) + "-" + std::to_string(E) + "-" +
                               std::to_string(k) + ".bin";
      if (FILE* f = std::fopen(path.c_str(), "wb")) {
        std::fwrite(ids.data(), 4, ids.size(), f);
        std::fwrite(gates.data(), 4, gates.size(), f);
        std::fwrite(lse.data(), 4, lse.size(), f);
        std::fwrite(f32.data(), 4, f32.size(), f);
        std::fclose(f);
      }
    }
    const double le = static_cast<double>(L * E), lk = static_cast<double>(P), l = static_cast<double>(L);
    const double route_bytes = 4 * le + 8 * lk + 4 * l;    // logits in; ids, gates, lse out
    const double loss_bytes = 4 * le + 4 * l + 4 * l;      // logits, lse and each token's first id in
    const double bwd_bytes = 4 * le + 8 * lk + 4 * le;     // logits, ids, d gates in; d logits out
    auto gbs = [](double bytes, double ms) { return bytes / (ms * 1e6); };
    std::printf("| %lld | %lld | %lld | %.4f | %.0f | %.4f | %.0f | %.4f | %.0f | %.4f | %.0f | %s |\n",
                static_cast<long long>(L), static_cast<long long>(E), static_cast<long long>(k), t_route,
                gbs(route_bytes, t_route), t_losses, gbs(loss_bytes, t_losses), t_f32, gbs(bwd_bytes, t_f32), t_pair,
                gbs(bwd_bytes, t_pair), split ? "yes" : "NO");
    for (void* p : {static_cast<void*>(d_logits), static_cast<void*>(d_gates), static_cast<void*>(d_lse),
                    static_cast<void*>(d_dgates), static_cast<void*>(d_dlogits), static_cast<void*>(d_pair),
                    static_cast<void*>(d_losses), static_cast<void*>(d_scratch), static_cast<void*>(d_ids),
                    static_cast<void*>(d_eti), static_cast<void*>(d_tim), static_cast<void*>(d_off), d_plan_scratch})
      cudaFree(p);
  }
  return 0;
}
