// perf/grouped-gemm-bench: the sm_90a grouped GEMM (gemm/sm90) against cuBLASLt per-expert GEMMs
// (what the cuBLASLt engine runs: one GEMM per expert on pre-gathered rows, offsets on the host)
// and against one dense cuBLASLt GEMM of the same FLOPs, on the MoE layer's two forward GEMMs:
//   up:   pre/act = SwiGLU(x[idx] W_gate_up[e])  gathered A, gated, activation epilogue (fused;
//         --act geglu|silu|gelu|relu: that activation instead, plain ones on n columns)
//   down: out = act W_down[e]                    contiguous A, store epilogue
// and on its two weight-gradient GEMMs (varlen K, gemm/sm90/weight_grad):
//   dW_up:   x[idx]^T dpre per expert      A gathered, B in expert order
//   dW_down: act^T dy[idx] per expert      A in expert order, B gathered
// for uniform and skewed (Zipf s = 1.2) routings. --dact instead times the backward's dact GEMM
// with the activation backward three ways (the plain GEMM then the separate pass, in the ring,
// on the epilogue warps), dy gathered and in expert order, and says which the rule takes. The cuBLASLt side is timed on GEMMs alone (no
// gather, no activation pass), which favours it. Each config also compares our output with
// cuBLASLt's (relative error). Median of CUDA-event timings; prints a table last.
// --quick: uniform routing only and, without --only, the first two configs (use --only CONFIG
// for any other one).
#include <cstring>
#include <string>

#include "../tests/kernels/grouped_gemm_problem.cuh"
#include "experts/expert_cuda.hpp"
#include "gemm/cublaslt.hpp"
#include "gemm/sm90/tile_config.hpp"
#include "gemm/sm90/weight_grad.hpp"

using namespace ggp;
namespace sm90 = moeblaze::gemm::sm90;

namespace {

struct Config {
  const char* name;
  int64_t T, d, n, E, K;
};

template <class F>
double median_ms(F&& f, int reps) {
  cudaEvent_t a, b;
  GGP_CK(cudaEventCreate(&a));
  GGP_CK(cudaEventCreate(&b));
  std::vector<double> t;
  for (int r = -3; r < reps; ++r) {
    GGP_CK(cudaEventRecord(a));
    f();
    GGP_CK(cudaEventRecord(b));
    GGP_CK(cudaEventSynchronize(b));
    float ms = 0;
    GGP_CK(cudaEventElapsedTime(&ms, a, b));
    if (r >= 0) t.push_back(ms);
  }
  std::sort(t.begin(), t.end());
  cudaEventDestroy(a);
  cudaEventDestroy(b);
  return t[t.size() / 2];
}

struct Row {
  std::string what;
  double ours_ms, lt_ms, dense_ms, flops, rel;
  double copy_ms = 0;  // weight gradients: ours with the expert-order operand by cp.async too
  double tma_ms = 0;   // weight gradients: ours on the pre-gathered copy, both operands by TMA
  double pp_ms = 0;    // forward GEMMs: ours with the ping-pong consumer schedule
  double pp_rel = 0;   // its relative difference from cuBLASLt
  // --diag, up GEMMs: the same launch without the gather (A pre-gathered, read in order), with
  // act only, with pre only, and as a plain store of pre's columns (no activation, no pairing)
  double no_gather_ms = 0, act_only_ms = 0, pre_only_ms = 0, plain_ms = 0;
};

// A [m, k] contiguous copy of the gathered A rows, for cuBLASLt.
__global__ void gather_kernel(const __nv_bfloat16* a, const int32_t* idx, int64_t k, __nv_bfloat16* out) {
  const int64_t p = blockIdx.x;
  for (int64_t j = threadIdx.x; j < k; j += blockDim.x) out[p * k + j] = a[static_cast<int64_t>(idx[p]) * k + j];
}

__global__ void diff_kernel(const __nv_bfloat16* x, const __nv_bfloat16* y, int64_t count, double* sums) {
  double num = 0, den = 0;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < count;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const double u = __bfloat162float(x[i]), v = __bfloat162float(y[i]);
    num += (u - v) * (u - v);
    den += v * v;
  }
  atomicAdd(sums, num);  // a benchmark figure, not a library result: order does not matter
  atomicAdd(sums + 1, den);
}

double rel_diff(const void* x, const void* y, int64_t count) {
  double* d = nullptr;
  GGP_CK(cudaMalloc(&d, 16));
  GGP_CK(cudaMemset(d, 0, 16));
  diff_kernel<<<1024, 256>>>(static_cast<const __nv_bfloat16*>(x), static_cast<const __nv_bfloat16*>(y), count, d);
  double h[2];
  GGP_CK(cudaMemcpy(h, d, 16, cudaMemcpyDeviceToHost));
  cudaFree(d);
  return h[1] > 0 ? std::sqrt(h[0] / h[1]) : -1.0;  // -1: the reference is all zeros (a broken run)
}

Row run(const Config& c, bool up, double skew, int bn, int reps, bool diag, Activation act_kind, const gemm::CublasLtGemm& lt,
        void* lt_ws) {
  const int64_t m = c.T * c.K;
  const bool gated = is_gated(act_kind);
  Shape s = up ? Shape{m, c.T, static_cast<int32_t>(c.E), static_cast<int32_t>(c.n), static_cast<int32_t>(c.d), gated, true, Major::kMN, skew}
               : Shape{m, m, static_cast<int32_t>(c.E), static_cast<int32_t>(c.d), static_cast<int32_t>(c.n), false, false, Major::kMN, skew};
  Problem P = make_problem(s, DType::kBF16, 7, false, false);
  const int64_t N = P.ncols(), K = s.k;
  void* out = alloc_poisoned(m * N);      // ours: pre (up) or out (down)
  void* act = alloc_poisoned(up ? m * s.n : 1);
  void* lt_out = alloc_poisoned(m * N);
  void* a_contig = P.d_a;
  if (up) {
    GGP_CK(cudaMalloc(&a_contig, m * K * 2));
    gather_kernel<<<static_cast<unsigned>(m), 256>>>(static_cast<const __nv_bfloat16*>(P.d_a), P.d_index, K,
                                                     static_cast<__nv_bfloat16*>(a_contig));
  }
  sm90::EpilogueParams e;
  if (up) {
    e.kind = sm90::EpilogueKind::kActivation;
    e.activation = act_kind;
    e.pre = out;
    e.ld_pre = N;
    e.act = act;
    e.ld_act = s.n;
  } else {
    e.kind = sm90::EpilogueKind::kStore;
    e.c = out;
    e.ldc = N;
  }
  const sm90::GroupedGemmParams gp = P.params();
  sm90::KernelChoice kc;
  kc.block_n = bn;
  sm90::KernelChoice pp;
  pp.schedule = sm90::ConsumerSchedule::kPingPong;
  auto ours = [&] { sm90::grouped_gemm(DType::kBF16, gp, e, kc, nullptr); };
  auto ping_pong = [&] { sm90::grouped_gemm(DType::kBF16, gp, e, pp, nullptr); };
  auto per_expert = [&] {
    for (int64_t x = 0; x < c.E; ++x) {
      const int64_t r0 = P.offsets[x], rows = P.offsets[x + 1] - r0;
      if (rows == 0) continue;
      lt.gemm(rows, N, K, {static_cast<const char*>(a_contig) + r0 * K * 2, DType::kBF16, K, false},
              {static_cast<const char*>(P.d_b) + x * P.b_stride() * 2, DType::kBF16, N, false},
              static_cast<char*>(lt_out) + r0 * N * 2, DType::kBF16, N, 1.f, 0.f, lt_ws, gemm::CublasLtGemm::kWorkspaceBytes, nullptr);
    }
  };
  auto dense = [&] {
    lt.gemm(m, N, K, {a_contig, DType::kBF16, K, false}, {P.d_b, DType::kBF16, N, false}, lt_out, DType::kBF16, N, 1.f,
            0.f, lt_ws, gemm::CublasLtGemm::kWorkspaceBytes, nullptr);
  };
  Row r;
  r.what = std::string(c.name) + (up ? " up" : " down") + (skew > 0 ? " skew" : "");
  r.flops = 2.0 * m * N * K;
  r.pp_ms = median_ms(ping_pong, reps);
  r.ours_ms = median_ms(ours, reps);
  r.dense_ms = median_ms(dense, reps);
  r.lt_ms = median_ms(per_expert, reps);
  if (diag && up) {
    sm90::GroupedGemmParams in_order = gp;
    in_order.a = a_contig;
    in_order.a_index = nullptr;
    in_order.a_rows = static_cast<int32_t>(m);
    sm90::EpilogueParams act_only = e, pre_only = e, plain;
    act_only.pre = nullptr;
    pre_only.act = nullptr;
    plain.c = out;
    plain.ldc = N;
    sm90::GroupedGemmParams plain_p = gp;
    plain_p.gated = 0;  // pre's N columns (2n when gated) as one plain output
    plain_p.n = static_cast<int32_t>(N);
    r.no_gather_ms = median_ms([&] { sm90::grouped_gemm(DType::kBF16, in_order, e, kc, nullptr); }, reps);
    r.act_only_ms = median_ms([&] { sm90::grouped_gemm(DType::kBF16, gp, act_only, kc, nullptr); }, reps);
    r.pre_only_ms = median_ms([&] { sm90::grouped_gemm(DType::kBF16, gp, pre_only, kc, nullptr); }, reps);
    r.plain_ms = median_ms([&] { sm90::grouped_gemm(DType::kBF16, plain_p, plain, kc, nullptr); }, reps);
    ours();  // the timed variants overwrote pre; the comparison below checks the full launch
  }
  GGP_CK(cudaDeviceSynchronize());
  r.rel = rel_diff(out, lt_out, m * N);  // lt_out holds the per-expert result (timed last)
  ping_pong();
  GGP_CK(cudaDeviceSynchronize());
  r.pp_rel = rel_diff(out, lt_out, m * N);
  cudaFree(out);
  cudaFree(act);
  cudaFree(lt_out);
  if (up) cudaFree(a_contig);
  free_problem(P);
  return r;
}

// The weight gradients: C_e = A_e^T B_e over expert e's positions, as the fused engine runs
// them: A is the gathered operand, B the one in expert order. dW_up: A = x rows (m = d), B = dpre
// (n = 2h); dW_down: A = dy rows (m = d), B = act (n = h), C stored transposed ([h, d] per
// expert). cuBLASLt runs one GEMM per expert on a pre-gathered copy (its gather not timed);
// dense is one GEMM with the same FLOPs (K = all positions). "cp.async ms" times our kernel with
// the expert-order operand behind an identity index list, which sends it down the gathered
// (cp.async) path, in the same run; "2xTMA ms" runs it on the pre-gathered copy, both operands
// by TMA (what a gather costs the kernel).
Row run_wgrad(const Config& c, bool up, double skew, int reps, const gemm::CublasLtGemm& lt, void* lt_ws) {
  const int64_t P = c.T * c.K, m = c.d, n = up ? 2 * c.n : c.n;
  std::mt19937_64 rng(17);
  Shape rs{};
  rs.m_total = P;
  rs.E = static_cast<int32_t>(c.E);
  rs.skew = skew;
  const std::vector<int32_t> counts = make_counts(rs, rng);
  std::vector<int32_t> off(c.E + 1, 0), idx(P);
  for (int64_t e = 0; e < c.E; ++e) off[e + 1] = off[e] + counts[e];
  std::uniform_int_distribution<int64_t> tok(0, c.T - 1);
  for (auto& v : idx) v = static_cast<int32_t>(tok(rng));
  std::vector<int32_t> iota(P);
  for (int64_t i = 0; i < P; ++i) iota[i] = static_cast<int32_t>(i);
  int32_t *d_off, *d_idx, *d_iota;
  GGP_CK(cudaMalloc(&d_off, 4 * (c.E + 1)));
  GGP_CK(cudaMalloc(&d_idx, 4 * P));
  GGP_CK(cudaMalloc(&d_iota, 4 * P));
  GGP_CK(cudaMemcpy(d_iota, iota.data(), 4 * P, cudaMemcpyHostToDevice));
  GGP_CK(cudaMemcpy(d_off, off.data(), 4 * off.size(), cudaMemcpyHostToDevice));
  GGP_CK(cudaMemcpy(d_idx, idx.data(), 4 * P, cudaMemcpyHostToDevice));
  void *tokens, *contig, *gathered, *sched;
  GGP_CK(cudaMalloc(&tokens, 2 * c.T * m));
  GGP_CK(cudaMalloc(&contig, 2 * P * n));
  GGP_CK(cudaMalloc(&gathered, 2 * P * m));
  GGP_CK(cudaMalloc(&sched, sm90::schedule_bytes(c.E)));
  fill_random_device(tokens, c.T * m, DType::kBF16, rng(), 1.f);
  fill_random_device(contig, P * n, DType::kBF16, rng(), 0.05f);
  gather_kernel<<<static_cast<unsigned>(P), 256>>>(static_cast<const __nv_bfloat16*>(tokens), d_idx, m,
                                                   static_cast<__nv_bfloat16*>(gathered));
  void* out = alloc_poisoned(c.E * m * n);
  void* lt_out = alloc_poisoned(c.E * m * n);
  sm90::WeightGradParams p;
  p.sched = sm90::make_schedule(d_off, c.E, P, sched, nullptr);
  p.m = static_cast<int32_t>(m);
  p.n = static_cast<int32_t>(n);
  p.a = tokens;
  p.lda = m;
  p.a_index = d_idx;
  p.a_rows = static_cast<int32_t>(c.T);
  p.b = contig;
  p.ldb = n;
  p.b_rows = static_cast<int32_t>(P);
  p.c = out;
  p.ldc = up ? n : m;
  p.c_expert_stride = m * n;
  p.c_transposed = !up;
  auto ours = [&] { sm90::weight_grad(DType::kBF16, p, nullptr); };
  sm90::WeightGradParams p_copy = p;
  p_copy.b_index = d_iota;
  auto ours_copy = [&] { sm90::weight_grad(DType::kBF16, p_copy, nullptr); };
  sm90::WeightGradParams p_tma = p;
  p_tma.a = gathered;
  p_tma.a_index = nullptr;
  p_tma.a_rows = static_cast<int32_t>(P);
  auto ours_tma = [&] { sm90::weight_grad(DType::kBF16, p_tma, nullptr); };
  // cuBLASLt in the gradient's own layout: dW_up[e] = xg^T dpre ([d, 2h]), dW_down[e] = act^T dyg ([h, d]).
  const void* a_lt = up ? gathered : contig;
  const void* b_lt = up ? contig : gathered;
  const int64_t lt_m = up ? m : n, lt_n = up ? n : m;
  auto per_expert = [&] {
    for (int64_t x = 0; x < c.E; ++x) {
      const int64_t r0 = off[x], rows = off[x + 1] - r0;
      if (rows == 0) continue;
      lt.gemm(lt_m, lt_n, rows, {static_cast<const char*>(a_lt) + r0 * lt_m * 2, DType::kBF16, lt_m, true},
              {static_cast<const char*>(b_lt) + r0 * lt_n * 2, DType::kBF16, lt_n, false},
              static_cast<char*>(lt_out) + x * m * n * 2, DType::kBF16, lt_n, 1.f, 0.f, lt_ws,
              gemm::CublasLtGemm::kWorkspaceBytes, nullptr);
    }
  };
  auto dense = [&] {
    lt.gemm(lt_m, lt_n, P, {a_lt, DType::kBF16, lt_m, true}, {b_lt, DType::kBF16, lt_n, false}, lt_out, DType::kBF16,
            lt_n, 1.f, 0.f, lt_ws, gemm::CublasLtGemm::kWorkspaceBytes, nullptr);
  };
  Row r;
  r.what = std::string(c.name) + (up ? " dW_up" : " dW_down") + (skew > 0 ? " skew" : "");
  r.flops = 2.0 * P * m * n;
  r.copy_ms = median_ms(ours_copy, reps);
  r.tma_ms = median_ms(ours_tma, reps);
  r.ours_ms = median_ms(ours, reps);
  r.dense_ms = median_ms(dense, reps);
  r.lt_ms = median_ms(per_expert, reps);
  for (int64_t x = 0; x < c.E; ++x)  // an expert without positions: ours writes a zero gradient
    if (off[x + 1] == off[x]) GGP_CK(cudaMemset(static_cast<char*>(lt_out) + x * m * n * 2, 0, m * n * 2));
  GGP_CK(cudaDeviceSynchronize());
  r.rel = rel_diff(out, lt_out, c.E * m * n);
  cudaFree(d_off); cudaFree(d_idx); cudaFree(d_iota); cudaFree(tokens); cudaFree(contig); cudaFree(gathered); cudaFree(sched);
  cudaFree(out); cudaFree(lt_out);
  return r;
}

// The backward's dact GEMM (dact = dy[row] W_down[e]^T: K = d, n = h, dy gathered through the
// plan or in expert order) with the activation backward, as the fused engine runs it: the plain
// GEMM writing dact into dpre's first h columns, then the separate pass
// (experts::activation_backward_cuda); or the backward in the GEMM's epilogue, in the ring
// (cooperative tiles) or on the epilogue warps. Each way from the same pre, dy and gates; dpre
// and g act of the two epilogues are compared bit for bit.
struct DactRow {
  std::string what;
  double gemm_ms = 0, pass_ms = 0, ring_ms = 0, warps_ms = 0;
  bool same_bits = false;
  const char* rule = "";
};

DactRow run_dact(const Config& c, bool expert_order, int reps, Activation act_kind, int ring_bn) {
  const int64_t m = c.T * c.K, h = c.n, gh = (is_gated(act_kind) ? 2 : 1) * h;
  const Shape s{m, expert_order ? m : c.T, static_cast<int32_t>(c.E), static_cast<int32_t>(h), static_cast<int32_t>(c.d),
                false, !expert_order, Major::kK, 0.0};
  Problem P = make_problem(s, DType::kBF16, 11, false, false);
  const int64_t parts = sm90::act_backward_dg_parts(h);
  void* pre = alloc_poisoned(m * gh);
  fill_random_device(pre, m * gh, DType::kBF16, 5, 1.f);
  void* dpre = alloc_poisoned(m * gh);
  void* gact = alloc_poisoned(m * h);
  float* dg = nullptr;
  GGP_CK(cudaMalloc(&dg, sizeof(float) * parts * m));
  const sm90::GroupedGemmParams gp = P.params();
  sm90::EpilogueParams plain;
  plain.c = dpre;
  plain.ldc = gh;
  const sm90::EpilogueParams e = act_backward_params(act_kind, dpre, gh, gact, h, P.d_scale, pre, gh, dg, m);
  sm90::KernelChoice ring, warps;
  ring.schedule = sm90::ConsumerSchedule::kCooperative;
  ring.block_n = ring_bn;  // 0: as the rule sizes the in-ring tiles
  warps.schedule = sm90::ConsumerSchedule::kEpilogueWarpgroup;
  DactRow r;
  r.what = std::string(c.name) + (expert_order ? " dact, dy in expert order" : " dact, dy gathered");
  r.gemm_ms = median_ms([&] { sm90::grouped_gemm(DType::kBF16, gp, plain, {}, nullptr); }, reps);
  r.pass_ms = median_ms([&] {
    moeblaze::experts::activation_backward_cuda(act_kind, DType::kBF16, m, h, pre, nullptr, P.d_scale, dpre, gh, dpre,
                                                gact, dg, nullptr);
  }, reps);
  r.ring_ms = median_ms([&] { sm90::grouped_gemm(DType::kBF16, gp, e, ring, nullptr); }, reps);
  GGP_CK(cudaDeviceSynchronize());
  const std::vector<uint16_t> ring_dpre = download_bits(dpre, m * gh), ring_gact = download_bits(gact, m * h);
  r.warps_ms = median_ms([&] { sm90::grouped_gemm(DType::kBF16, gp, e, warps, nullptr); }, reps);
  GGP_CK(cudaDeviceSynchronize());
  r.same_bits = download_bits(dpre, m * gh) == ring_dpre && download_bits(gact, m * h) == ring_gact;
  const bool in_epilogue = sm90::act_backward_in_epilogue(gp, is_gated(act_kind));
  const bool on_warps = sm90::choose_kernel(gp, e, {}).schedule == sm90::ConsumerSchedule::kEpilogueWarpgroup;
  r.rule = !in_epilogue ? "separate pass" : on_warps ? "epilogue warps" : "in the ring";
  cudaFree(pre);
  cudaFree(dpre);
  cudaFree(gact);
  cudaFree(dg);
  free_problem(P);
  return r;
}

// The activations by name (--act).
constexpr struct {
  const char* name;
  Activation a;
} kActivationNames[] = {{"swiglu", Activation::kSwiglu}, {"geglu", Activation::kGeglu}, {"silu", Activation::kSilu},
                        {"gelu", Activation::kGelu},     {"relu", Activation::kRelu}};

// The activation named `name`; false for an unknown name.
bool parse_activation(const char* name, Activation* out) {
  for (const auto& n : kActivationNames)
    if (!std::strcmp(name, n.name)) {
      *out = n.a;
      return true;
    }
  return false;
}
const char* activation_name(Activation a) {
  for (const auto& n : kActivationNames)
    if (n.a == a) return n.name;
  return "?";
}

}  // namespace

int main(int argc, char** argv) {
  int bn = 0, reps = 20;
  bool quick = false, fwd = true, wgrad = true, diag = false, dact = false;
  Activation act_kind = Activation::kSwiglu;
  const char* only = nullptr;
  for (int i = 1; i < argc; ++i) {
    if (!std::strcmp(argv[i], "--bn") && i + 1 < argc) bn = std::atoi(argv[++i]);
    else if (!std::strcmp(argv[i], "--quick")) quick = true;
    else if (!std::strcmp(argv[i], "--wgrad")) fwd = false;
    else if (!std::strcmp(argv[i], "--only") && i + 1 < argc) only = argv[++i];
    else if (!std::strcmp(argv[i], "--fwd")) wgrad = false;
    else if (!std::strcmp(argv[i], "--diag")) diag = true;
    else if (!std::strcmp(argv[i], "--dact")) dact = true;
    else if (!std::strcmp(argv[i], "--act") && i + 1 < argc && parse_activation(argv[i + 1], &act_kind)) ++i;
    else {
      std::fprintf(stderr, "usage: grouped-gemm-bench [--bn 128|256] [--quick] [--fwd | --wgrad | --dact] [--only CONFIG]\n"
                           "                          [--diag] [--act swiglu|geglu|silu|gelu|relu]\n"
                           "  --quick: uniform routing only; without --only, the first two configs\n"
                           "  --diag: up GEMMs also timed without the gather, act only, pre only, plain store\n"
                           "  --dact: the dact GEMM with the activation backward: the pass, in the ring, on the epilogue warps\n"
                           "         (--bn: the in-ring tiles' width)\n");
      return 2;
    }
  }
  cudaDeviceProp prop;
  if (!have_sm90(&prop)) {
    std::printf("grouped-gemm-bench needs an sm_90 GPU\n");
    return 77;
  }
  const Config all[] = {{"sonic_1.4B_n256", 40960, 768, 256, 128, 8},  {"sonic_7B_n256", 24576, 1536, 256, 128, 8},
                        {"qwen3_30b_a3b", 32768, 2048, 768, 128, 8},   {"sonic_30B_n512", 32768, 4096, 512, 128, 8},
                        {"sonic_120B_n1024", 32768, 4096, 1024, 128, 8}, {"conf4", 16384, 2048, 8192, 16, 4},
                        {"conf1", 65536, 512, 2048, 4, 1},               {"conf2", 65536, 1024, 4096, 8, 2},
                        {"conf5", 32768, 512, 2048, 16, 4},
                        {"conf3", 65536, 1024, 4096, 16, 4},             {"conf7", 8192, 2048, 8192, 8, 4},
                        {"conf6", 16384, 1024, 4096, 16, 4},             {"sonic_120B_n2048", 32768, 4096, 2048, 64, 4},
                        {"deepseek_v3_like", 8192, 7168, 2048, 256, 8}};
  if (dact) {
    std::printf("%s, uniform routing, %s; ms (median of %d)\n", prop.name, activation_name(act_kind), reps);
    std::printf("%-44s %9s %9s %9s %9s %9s  %-9s %s\n", "dact GEMM", "GEMM", "+ pass", "= sum", "in ring", "warps",
                "same bits", "rule");
    int done = 0;
    for (const Config& c : all) {
      if (only && std::strcmp(only, c.name)) continue;
      if (quick && !only && done++ >= 3) break;
      for (bool expert_order : {false, true}) {
        const DactRow r = run_dact(c, expert_order, reps, act_kind, bn);
        std::printf("%-44s %9.3f %9.3f %9.3f %9.3f %9.3f  %-9s %s\n", r.what.c_str(), r.gemm_ms, r.pass_ms,
                    r.gemm_ms + r.pass_ms, r.ring_ms, r.warps_ms, r.same_bits ? "yes" : "NO", r.rule);
        std::fflush(stdout);
      }
    }
    return 0;
  }
  gemm::CublasLtGemm lt;
  void* lt_ws = nullptr;
  GGP_CK(cudaMalloc(&lt_ws, gemm::CublasLtGemm::kWorkspaceBytes));
  std::printf("%s, block_n %s\n", prop.name, bn ? std::to_string(bn).c_str() : "auto");
  std::printf("%-28s %9s %9s %9s %8s %8s %8s %9s %10s %9s\n", "GEMM", "ours ms", "lt/exp ms", "dense ms", "ours TF", "vs lt",
              "vs dense", "rel diff", "cp.async ms", "2xTMA ms");
  std::printf("(forward GEMMs: \"cp.async ms\" is the ping-pong schedule's time, \"2xTMA ms\" its rel diff)\n");
  for (const Config& c : all) {
    if (only && std::strcmp(only, c.name)) continue;
    for (double skew : {0.0, 1.2}) {
      for (int g = 0; g < 4; ++g) {
        const bool up = g % 2 == 0, is_wgrad = g >= 2;
        if ((is_wgrad && !wgrad) || (!is_wgrad && !fwd)) continue;
        const Row r = is_wgrad ? run_wgrad(c, up, skew, reps, lt, lt_ws) : run(c, up, skew, bn, reps, diag, act_kind, lt, lt_ws);
        std::printf("%-28s %9.3f %9.3f %9.3f %8.1f %7.2fx %7.1f%% %9.2e %10.3f %9.3f\n", r.what.c_str(), r.ours_ms, r.lt_ms,
                    r.dense_ms, r.flops / r.ours_ms / 1e9, r.lt_ms / r.ours_ms, 100.0 * r.dense_ms / r.ours_ms, r.rel,
                    is_wgrad ? r.copy_ms : r.pp_ms, is_wgrad ? r.tma_ms : r.pp_rel);
        if (r.plain_ms > 0)
          std::printf("  diag %s: in order %.3f, act only %.3f, pre only %.3f, plain store of pre %.3f ms\n", r.what.c_str(),
                      r.no_gather_ms, r.act_only_ms, r.pre_only_ms, r.plain_ms);
        std::fflush(stdout);
      }
      if (quick) break;
    }
    if (quick && &c - all >= 1) break;
  }
  return 0;
}
