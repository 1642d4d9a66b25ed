// The expert-parallel layer on the GPUs of one host (every visible GPU a rank, 2 to 8, one
// thread each, one communicator from ncclCommInitAll) against the single-GPU layer run on all
// ranks' tokens at once with all experts: y, dx, the local experts' weight gradients, the
// router weight's gradient (summed over the ranks) and the gate gradients. Each case also checks
// that a second run gives the same bits, and that forward + backward captured in a CUDA graph and
// replayed on new inputs equals the eager call on them; with a router, that inference and route on
// the EP handle agree with the single-GPU layer. Cases cover bf16 and fp16, the fused and the
// cuBLASLt local engine, every save policy, a token mask, the sequence-wise loss and both
// transports (NVLink, HOST). Exits 77 (skipped) with fewer than two GPUs.
#include <nccl.h>

#include <cstring>
#include <thread>

#include "ep_gpu_harness.hpp"

namespace {

using namespace ep_test;

// The EP layer: one thread per rank, each running the same sequence of collective calls.
std::vector<RankRuns> run_ep(const Case& cs, const Problem& pb, int P, ncclComm_t* comms) {
  std::vector<RankRuns> runs(P);
  std::vector<std::thread> threads;
  for (int r = 0; r < P; ++r) {
    threads.emplace_back([&, r] {
      CK(cudaSetDevice(r));
      cudaStream_t s;
      CK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
      moeblaze_config_t cfg = config(cs, pb.maxL, r, cs.max_recv, P);
      moeblaze_handle_t h = nullptr;
      MB(moeblaze_create_ep(&h, cfg, comms[r], s));
      moeblaze_config_destroy(cfg);
      std::printf("  rank %d: created\n", r);
      runs[r] = run_rank(pb, h, r, s);
      CK(cudaStreamDestroy(s));
    });
  }
  for (auto& t : threads) t.join();
  return runs;
}

void run_case(const Case& cs, int P, ncclComm_t* comms, uint64_t seed) {
  const Problem pb = make_problem(cs, P, seed);
  print_problem(pb);
  const Run ref = reference(pb, 0);
  const std::vector<RankRuns> runs = run_ep(cs, pb, P, comms);
  if (cs.transport == MOEBLAZE_EP_TRANSPORT_HOST) {  // the same rows in the same places: NVLink's bits
    Case nvlink = cs;
    nvlink.transport = MOEBLAZE_EP_TRANSPORT_NVLINK;
    Problem pn = pb;
    pn.cs = &nvlink;
    const std::vector<RankRuns> nv = run_ep(nvlink, pn, P, comms);
    for (int r = 0; r < P; ++r) {
      const Run &a = runs[r].first, &b = nv[r].first;
      // status[0, 1]: forward's and backward's (the others are inference's and route's, not run
      // with caller ids or a receive bound); the fp32 gate gradients by their bits (NaN after an
      // overflow).
      const bool same = a.y == b.y && a.dx == b.dx && a.dwgu == b.dwgu && a.dwd == b.dwd && a.dwg == b.dwg &&
                        a.dgates.size() == b.dgates.size() &&
                        !std::memcmp(a.dgates.data(), b.dgates.data(), a.dgates.size() * sizeof(float)) &&
                        a.status[0] == b.status[0] && a.status[1] == b.status[1];
      expect(same, "HOST == NVLink, bitwise", cs.name, r, 0);
    }
  }
  std::vector<double> dwg_sum(static_cast<size_t>(cs.E * cs.d), 0.0);
  for (int r = 0; r < P; ++r) check_rank(pb, ref, runs[r], r, &dwg_sum);
  if (!cs.caller_ids && cs.max_recv == 0) check_router_sum(pb, ref, dwg_sum);
  if (cs.seqs && !cs.caller_ids) {  // each rank's sequence-wise loss, summed: the single-GPU one
    double sum = 0;
    for (int r = 0; r < P; ++r) sum += runs[r].first.aux;
    const double e = std::fabs(sum - ref.aux) / std::max(std::fabs(static_cast<double>(ref.aux)), 1e-30);
    expect(e < 1e-2 && ref.aux > 0, "AUX_LOSS (sequence-wise) summed over ranks", cs.name, -1, e);
  }
}

// Refused on every rank before any collective call: an EP_SIZE or EP_RANK the communicator
// contradicts.
void refusals(const Case& cs, int P, ncclComm_t* comms) {
  std::vector<std::thread> th;
  std::vector<int> bad(P, 0);
  for (int r = 0; r < P; ++r)
    th.emplace_back([&, r] {
      CK(cudaSetDevice(r));
      const struct {
        moeblaze_attr_t attr;
        int64_t value;
        moeblaze_status_t want;
      } probes[] = {{MOEBLAZE_ATTR_EP_SIZE, P + 1, MOEBLAZE_STATUS_INVALID_ARGUMENT},
                    {MOEBLAZE_ATTR_EP_RANK, (r + 1) % P, MOEBLAZE_STATUS_INVALID_ARGUMENT}};
      for (const auto& p : probes) {
        moeblaze_config_t cfg = config(cs, 64, r);
        MB(moeblaze_config_set_i64(cfg, p.attr, p.value));
        moeblaze_handle_t h = reinterpret_cast<moeblaze_handle_t>(1);
        bad[r] += moeblaze_create_ep(&h, cfg, comms[r], nullptr) != p.want || h != nullptr;
        moeblaze_config_destroy(cfg);
      }
    });
  for (auto& t : th) t.join();
  for (int r = 0; r < P; ++r) expect(bad[r] == 0, "refusals (EP_SIZE, EP_RANK)", cs.name, r, bad[r]);
}

// Every case on the first P GPUs, one communicator over them.
bool run_all(int P, uint64_t seed) {
  std::vector<ncclComm_t> comms(P);
  std::vector<int> devs(P);
  for (int i = 0; i < P; ++i) devs[i] = i;
  if (ncclCommInitAll(comms.data(), P, devs.data()) != ncclSuccess) {
    std::fprintf(stderr, "ncclCommInitAll failed\n");
    return false;
  }
  std::printf("test_ep_gpu: %d ranks, seed %llu\n", P, static_cast<unsigned long long>(seed));
  const Case cases[] = {
      {"swiglu-router", 8LL * P, 4, 256, 128, MOEBLAZE_ACTIVATION_SWIGLU, false, {300, 173, 256, 77, 300, 12, 190, 64}},
      // k larger than the experts per rank, a rank with no tokens, routing skewed onto rank 0.
      {"silu-ids-skewed", 2LL * P, std::min<int64_t>(2LL * P, 3), 128, 64, MOEBLAZE_ACTIVATION_SILU, true,
       {129, 0, 64, 200, 5, 33, 0, 97}},
      // Most tokens go to rank 0's experts: a receive bound of 40 rows overflows there.
      {"overflow", 2LL * P, 2, 128, 64, MOEBLAZE_ACTIVATION_SILU, true, {100, 90, 80, 70, 60, 50, 40, 30}, 40},
      // fp16 on the cuBLASLt local engine, recomputing the up projection in backward.
      {"f16-cublaslt-recompute", 4LL * P, 3, 128, 96, MOEBLAZE_ACTIVATION_SWIGLU, false,
       {200, 150, 0, 90, 31, 250, 64, 128}, 0, true, MOEBLAZE_ENGINE_CUDA_CUBLASLT, MOEBLAZE_SAVE_RECOMPUTE_UP},
      // GEGLU on the fused engine, saving every intermediate.
      {"geglu-save-all", 4LL * P, 4, 256, 64, MOEBLAZE_ACTIVATION_GEGLU, false, {130, 257, 99, 1, 64, 300, 17, 200}, 0,
       false, MOEBLAZE_ENGINE_AUTO, MOEBLAZE_SAVE_ALL},
      // GELU (not gated) on the cuBLASLt engine, bf16, caller routing skewed onto rank 0.
      {"gelu-cublaslt-ids", 2LL * P, 2, 128, 128, MOEBLAZE_ACTIVATION_GELU, true, {77, 300, 12, 0, 190, 5, 64, 33}, 0,
       false, MOEBLAZE_ENGINE_CUDA_CUBLASLT},
      // DeepSeek-V3's routing: sigmoid, an expert bias, 2 of 4 expert groups, route scale 2.5.
      {"deepseek-routing", 8LL * P, 4, 128, 64, MOEBLAZE_ACTIVATION_SWIGLU, false, {250, 99, 300, 0, 64, 128, 17, 200},
       0, false, MOEBLAZE_ENGINE_AUTO, MOEBLAZE_SAVE_PREACT, 4, 2, 2.5, true, true},
      // A token mask: about a third of each rank's tokens not routed (router, fused engine).
      {"masked", 8LL * P, 4, 128, 64, MOEBLAZE_ACTIVATION_SWIGLU, false, {250, 99, 300, 0, 64, 128, 17, 200}, 0, false,
       MOEBLAZE_ENGINE_AUTO, MOEBLAZE_SAVE_PREACT, 1, 0, 1.0, false, false, true},
      // Top-1 with a token mask: the local experts' dx rows stored at their rows by the dx GEMM,
      // the masked and unrouted rows zeroed.
      {"top1-masked", 4LL * P, 1, 128, 64, MOEBLAZE_ACTIVATION_SILU, false, {250, 99, 300, 0, 64, 128, 17, 200}, 0,
       false, MOEBLAZE_ENGINE_AUTO, MOEBLAZE_SAVE_PREACT, 1, 0, 1.0, false, false, true},
      // ...with caller routing on the cuBLASLt local engine.
      {"masked-ids-cublaslt", 2LL * P, 2, 128, 64, MOEBLAZE_ACTIVATION_SILU, true, {129, 0, 64, 200, 5, 33, 0, 97}, 0,
       false, MOEBLAZE_ENGINE_CUDA_CUBLASLT, MOEBLAZE_SAVE_PREACT, 1, 0, 1.0, false, false, true},
      // The sequence-wise balance loss (3 sequences per rank, coefficient 1 so that it weighs in
      // the router gradient), with a token mask.
      {"sequences-masked", 8LL * P, 4, 128, 64, MOEBLAZE_ACTIVATION_SWIGLU, false, {250, 99, 300, 17, 64, 128, 17, 200},
       0, false, MOEBLAZE_ENGINE_AUTO, MOEBLAZE_SAVE_PREACT, 1, 0, 1.0, true, false, true, 3, 1.0},
      // More local slots per row than a warp stages 32 sends of (k = 24 of 32 experts per rank):
      // the metadata goes out in shorter runs, on both transports.
      {"topk24", 32LL * P, 24, 128, 64, MOEBLAZE_ACTIVATION_SWIGLU, false, {200, 64, 300, 17, 150, 90, 33, 256}},
      {"topk24-host", 32LL * P, 24, 128, 64, MOEBLAZE_ACTIVATION_SWIGLU, false, {200, 64, 300, 17, 150, 90, 33, 256}, 0,
       false, MOEBLAZE_ENGINE_AUTO, MOEBLAZE_SAVE_PREACT, 1, 0, 1.0, false, false, false, 0, 0.0,
       MOEBLAZE_EP_TRANSPORT_HOST},
      // The HOST transport (grouped ncclSend/ncclRecv): the router on the fused engine with a mask
      // and a rank without tokens, caller ids skewed onto rank 0 on the cuBLASLt engine in fp16,
      // and the overflow report.
      {"host-masked", 8LL * P, 4, 256, 128, MOEBLAZE_ACTIVATION_SWIGLU, false, {300, 0, 256, 77, 300, 12, 190, 64}, 0,
       false, MOEBLAZE_ENGINE_AUTO, MOEBLAZE_SAVE_PREACT, 1, 0, 1.0, false, false, true, 0, 0.0,
       MOEBLAZE_EP_TRANSPORT_HOST},
      {"host-ids-f16-cublaslt", 2LL * P, std::min<int64_t>(2LL * P, 3), 128, 64, MOEBLAZE_ACTIVATION_SILU, true,
       {129, 7, 64, 200, 5, 33, 0, 97}, 0, true, MOEBLAZE_ENGINE_CUDA_CUBLASLT, MOEBLAZE_SAVE_ALL, 1, 0, 1.0, false,
       false, false, 0, 0.0, MOEBLAZE_EP_TRANSPORT_HOST},
      {"host-overflow", 2LL * P, 2, 128, 64, MOEBLAZE_ACTIVATION_SILU, true, {100, 90, 80, 70, 60, 50, 40, 30}, 40,
       false, MOEBLAZE_ENGINE_AUTO, MOEBLAZE_SAVE_PREACT, 1, 0, 1.0, false, false, false, 0, 0.0,
       MOEBLAZE_EP_TRANSPORT_HOST},
  };
  for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); ++i) run_case(cases[i], P, comms.data(), seed + i);
  refusals(cases[0], P, comms.data());
  for (int i = 0; i < P; ++i) ncclCommDestroy(comms[i]);
  return true;
}

}  // namespace

int main() {
  std::setvbuf(stdout, nullptr, _IONBF, 0);
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess || n < 2) {
    std::printf("test_ep_gpu: needs at least two GPUs (found %d): skipped\n", n);
    return 77;
  }
  const uint64_t seed = tu_fresh_seed("test_ep_gpu");
  // Every GPU of the machine (up to 8), and on a larger machine two of them as well: the layers
  // take other paths at P = 2 (fewer ranks per token, other exchange sizes).
  const int P = std::min(n, 8);
  bool ok = run_all(P, seed);
  if (ok && P > 2) ok = run_all(2, seed + 1000);
  std::printf("test_ep_gpu: %s (%d failed)\n", failures || !ok ? "FAILED" : "passed", failures);
  return failures || !ok ? 1 : 0;
}
