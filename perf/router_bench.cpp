// perf/router-bench: the CUDA router's kernels alone on random fp32 logits (softmax, normalised
// top-k, aux and z losses): top-k with the scores (route_tokens), the losses, and the backward
// to d logits written as fp32 rows or as the bf16 hi/lo pair the tensor-core GEMMs read. Prints
// the median of CUDA-event timings and the effective bandwidth of each (the bytes each kernel
// must read and write once: the floor against HBM), and checks that the pair is the fp32 rows
// split, bit for bit. Cases (L, E, k) cover one to eight experts per lane and the E > 256 path;
// `router-bench L E k` runs one case (for a profiler). With ROUTER_BENCH_DUMP=dir set, each
// case's outputs (ids, gates, lse, fp32 d logits) go to dir/L-E-k.bin, so that two builds can be
// compared bit for bit with cmp. A second table times the router's logits x W_g^T for few
// experts: the narrow kernel against cuBLASLt and against one read of x.
#include <cuda_runtime.h>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <string>
#include <vector>

#include "core/config.hpp"
#include "core/memory_layout.hpp"
#include "cuda_bench.hpp"
#include "gemm/cublaslt.hpp"
#include "routing/narrow_logits_cuda.hpp"
#include "routing/router_cuda.hpp"
#include "util/dtype.hpp"

using namespace moeblaze;

namespace {

// The router's logits x W_g^T (bf16 in, fp32 out) by the narrow kernel and by cuBLASLt, the way
// the CUDA router calls each, against the floor of reading x once; and their largest difference
// relative to the row's largest logit.
void logits_table(cudaStream_t s) {
  struct Shape {
    int64_t L, E, d;
  };
  const Shape shapes[] = {{65536, 4, 512},  {32768, 8, 1024}, {32768, 16, 512}, {32768, 16, 1024},
                          {16384, 8, 2048}, {16384, 8, 4096}, {8192, 8, 7168},  {32768, 16, 2048}};
  gemm::CublasLtGemm lt;
  void* ws;
  CK(cudaMalloc(&ws, gemm::CublasLtGemm::kWorkspaceBytes));
  std::printf("\n| L | E | d | narrow ms | GB/s | cuBLASLt ms | GB/s | cuBLASLt / narrow | max diff / max logit |\n");
  std::printf("|---|---|---|---|---|---|---|---|---|\n");
  for (const Shape& c : shapes) {
    const int64_t L = c.L, E = c.E, d = c.d;
    std::mt19937_64 rng(11);
    std::normal_distribution<float> normal(0.f, 1.f);
    std::vector<uint16_t> x(static_cast<size_t>(L * d)), w(static_cast<size_t>(E * d));
    for (auto& v : x) v = f32_to_bf16(normal(rng));
    for (auto& v : w) v = f32_to_bf16(normal(rng) / std::sqrt(static_cast<float>(d)));
    uint16_t *dx, *dw;
    float *a, *b;
    CK(cudaMalloc(&dx, 2 * x.size()));
    CK(cudaMalloc(&dw, 2 * w.size()));
    CK(cudaMalloc(&a, 4 * L * E));
    CK(cudaMalloc(&b, 4 * L * E));
    CK(cudaMemcpy(dx, x.data(), 2 * x.size(), cudaMemcpyHostToDevice));
    CK(cudaMemcpy(dw, w.data(), 2 * w.size(), cudaMemcpyHostToDevice));
    View xv, wv;
    for (View* v : {&xv, &wv}) {
      v->present = true;
      v->dtype = DType::kBF16;
      v->ndim = 2;
      v->stride[0] = d;
      v->stride[1] = 1;
      v->shape[1] = d;
    }
    xv.data = reinterpret_cast<char*>(dx);
    xv.shape[0] = L;
    wv.data = reinterpret_cast<char*>(dw);
    wv.shape[0] = E;
    if (const char* why = routing::narrow_logits_unsupported(xv, wv, E, d)) {
      std::printf("| %lld | %lld | %lld | refused: %s |\n", (long long)L, (long long)E, (long long)d, why);
      continue;
    }
    const double t_narrow = median_ms([&] { routing::narrow_logits_cuda(xv, wv, L, E, d, a, s); }, s, 50);
    const double t_lt = median_ms(
        [&] {
          lt.gemm(L, E, d, {dx, DType::kBF16, d, false}, {dw, DType::kBF16, d, true}, b, DType::kF32, E, 1.f, 0.f, ws,
                  gemm::CublasLtGemm::kWorkspaceBytes, s);
        },
        s, 50);
    CK(cudaStreamSynchronize(s));
    std::vector<float> ha(static_cast<size_t>(L * E)), hb(ha.size());
    CK(cudaMemcpy(ha.data(), a, 4 * ha.size(), cudaMemcpyDeviceToHost));
    CK(cudaMemcpy(hb.data(), b, 4 * hb.size(), cudaMemcpyDeviceToHost));
    double diff = 0, top = 0;
    for (size_t i = 0; i < ha.size(); ++i) {
      diff = std::max(diff, static_cast<double>(std::fabs(ha[i] - hb[i])));
      top = std::max(top, static_cast<double>(std::fabs(hb[i])));
    }
    const double bytes = 2.0 * L * d + 4.0 * L * E;
    std::printf("| %lld | %lld | %lld | %.4f | %.0f | %.4f | %.0f | %.2f | %.1e |\n", (long long)L, (long long)E,
                (long long)d, t_narrow, bytes / (t_narrow * 1e6), t_lt, bytes / (t_lt * 1e6), t_lt / t_narrow,
                diff / std::max(top, 1e-30));
    for (void* p : {static_cast<void*>(dx), static_cast<void*>(dw), static_cast<void*>(a), static_cast<void*>(b)})
      cudaFree(p);
  }
  cudaFree(ws);
}

}  // namespace

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
  if (argc != 4) logits_table(s);
  return 0;
}
