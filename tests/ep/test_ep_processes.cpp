// The expert-parallel layer with one process per GPU, each making its layer (and communicator)
// with moeblaze_create_ep_from_unique_id, as a caller without an NCCL communicator does. The parent
// draws one ncclUniqueId per layer and starts the ranks (this program again, with --rank); each rank
// checks its results against the single-GPU layer run on its own GPU over all ranks' tokens, then
// runs a soak: EP_SOAK_STEPS steps (default 1000) alternating eager calls and replays of a captured
// step, with new inputs (so new routing) every step, and checks that device memory does not grow
// and that the last replay equals the eager call on the same inputs bit for bit.
// One process per rank is also what compute-sanitizer needs (--target-processes all).
// EP_PROCS limits the ranks (default: every GPU, at most 8). Exits 77 with fewer than two GPUs.
#include <nccl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <string>

#include "ep_gpu_harness.hpp"

namespace {

using namespace ep_test;

std::string to_hex(const ncclUniqueId& id) {
  static const char* digits = "0123456789abcdef";
  std::string s;
  for (size_t i = 0; i < sizeof(id.internal); ++i) {
    const unsigned char b = static_cast<unsigned char>(id.internal[i]);
    s += digits[b >> 4];
    s += digits[b & 15];
  }
  return s;
}

ncclUniqueId from_hex(const char* s) {
  ncclUniqueId id{};
  if (std::strlen(s) != 2 * sizeof(id.internal)) {
    std::fprintf(stderr, "test_ep_processes: a unique id of %zu hex digits expected\n", 2 * sizeof(id.internal));
    std::exit(2);
  }
  auto nibble = [](char c) { return c <= '9' ? c - '0' : c - 'a' + 10; };
  for (size_t i = 0; i < sizeof(id.internal); ++i) id.internal[i] = static_cast<char>(nibble(s[2 * i]) << 4 | nibble(s[2 * i + 1]));
  return id;
}

moeblaze_handle_t create_from_id(const Case& cs, const Problem& pb, const ncclUniqueId& id, int r, cudaStream_t s) {
  moeblaze_config_t cfg = config(cs, pb.maxL, r, cs.max_recv);
  moeblaze_handle_t h = nullptr;
  MB(moeblaze_create_ep_from_unique_id(&h, cfg, &id, sizeof(id), pb.P, r, s));
  moeblaze_config_destroy(cfg);
  return h;
}

size_t free_device_memory() {
  size_t free_bytes = 0, total = 0;
  CK(cudaMemGetInfo(&free_bytes, &total));
  return free_bytes;
}

// Alternating eager steps and replays of one captured step, new x before every step.
void soak(const Case& cs, const Problem& pb, const ncclUniqueId& id, int r, cudaStream_t s, int steps) {
  moeblaze_handle_t h = create_from_id(cs, pb, id, r, s);
  const int64_t El = cs.E / pb.P;
  Layer l;
  l.setup(h, cs, pb.slice(r), cs.tokens[r], r * El, El);
  cudaGraph_t g;
  cudaGraphExec_t ge;
  CK(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal));
  l.step(s);
  CK(cudaStreamEndCapture(s, &g));
  CK(cudaGraphInstantiate(&ge, g, 0));
  tu_rng rng;
  tu_rng_seed(&rng, 1000 + static_cast<uint64_t>(r));
  size_t free_after_warmup = 0;
  bool statuses_ok = true;
  Run replayed, eager;
  for (int i = 0; i < steps; ++i) {
    l.set_x(random16(cs, &rng, static_cast<size_t>(cs.tokens[r] * cs.d), 1.0));
    if (i % 2) {
      CK(cudaGraphLaunch(ge, s));
    } else {
      l.step(s);
    }
    if (i == 9 || i == steps - 1) CK(cudaStreamSynchronize(s));
    if (i == 9) free_after_warmup = free_device_memory();
    if (i % 100 == 99 || i == steps - 1) {
      CK(cudaStreamSynchronize(s));
      const Run now = l.results();
      statuses_ok &= now.status[0] == 0 && now.status[1] == 0;
    }
  }
  CK(cudaStreamSynchronize(s));
  const size_t free_end = free_device_memory();
  // The last inputs once more, replayed and eagerly: the same bits.
  CK(cudaGraphLaunch(ge, s));
  CK(cudaStreamSynchronize(s));
  replayed = l.results();
  l.step(s);
  CK(cudaStreamSynchronize(s));
  eager = l.results();
  const double grown_mib =
      steps < 10 ? 0 : (static_cast<double>(free_after_warmup) - static_cast<double>(free_end)) / (1 << 20);
  expect(grown_mib <= 0, "soak: device memory does not grow (MiB)", cs.name, r, grown_mib);
  expect(statuses_ok, "soak: STATUS 0 throughout", cs.name, r, steps);
  const bool same = replayed.y == eager.y && replayed.dx == eager.dx && replayed.dwgu == eager.dwgu &&
                    replayed.dwd == eager.dwd && replayed.dwg == eager.dwg;
  bool finite = true;
  for (uint16_t v : eager.y) finite &= std::isfinite(decode(cs, v));
  expect(same && finite, "soak: last replay == eager, finite", cs.name, r, steps);
  CK(cudaGraphExecDestroy(ge));
  CK(cudaGraphDestroy(g));
  l.release();
}

int child(int r, int P, char** ids, uint64_t seed, int steps) {
  std::setvbuf(stdout, nullptr, _IONBF, 0);
  CK(cudaSetDevice(r));
  cudaStream_t s;
  CK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  const Case cases[] = {
      {"proc-swiglu-router", 8LL * P, 4, 256, 128, MOEBLAZE_ACTIVATION_SWIGLU, false, {300, 173, 256, 77, 300, 12, 190, 64}},
      {"proc-silu-ids-skewed", 2LL * P, std::min<int64_t>(2LL * P, 3), 128, 64, MOEBLAZE_ACTIVATION_SILU, true,
       {129, 0, 64, 200, 5, 33, 0, 97}},
      {"proc-host-router", 4LL * P, 4, 128, 64, MOEBLAZE_ACTIVATION_SWIGLU, false, {200, 64, 0, 150, 33, 7, 90, 5}, 0,
       false, MOEBLAZE_ENGINE_AUTO, MOEBLAZE_SAVE_PREACT, 1, 0, 1.0, false, false, false, 0, 0.0,
       MOEBLAZE_EP_TRANSPORT_HOST},
  };
  const int n = static_cast<int>(sizeof(cases) / sizeof(cases[0]));
  for (int i = 0; i < n; ++i) {
    const Problem pb = make_problem(cases[i], P, seed + static_cast<uint64_t>(i));
    if (r == 0) print_problem(pb);
    const Run ref = reference(pb, r);
    moeblaze_handle_t h = create_from_id(cases[i], pb, from_hex(ids[i]), r, s);
    std::printf("  rank %d: created from a unique id\n", r);
    const RankRuns runs = run_rank(pb, h, r, s);
    check_rank(pb, ref, runs, r, nullptr);
  }
  const Problem pb = make_problem(cases[0], P, seed);
  soak(cases[0], pb, from_hex(ids[n]), r, s, steps);
  CK(cudaStreamDestroy(s));
  std::printf("  rank %d: %s (%d failed)\n", r, failures ? "FAILED" : "passed", failures);
  return failures ? 1 : 0;
}

}  // namespace

int main(int argc, char** argv) {
  std::setvbuf(stdout, nullptr, _IONBF, 0);
  const int kLayers = 4;  // three checked cases and the soak: one communicator each
  if (argc == 6 + kLayers && std::strcmp(argv[1], "--rank") == 0)
    return child(std::atoi(argv[2]), std::atoi(argv[3]), argv + 6, std::strtoull(argv[4], nullptr, 10), std::atoi(argv[5]));
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess || n < 2) {
    std::printf("test_ep_processes: needs at least two GPUs (found %d): skipped\n", n);
    return 77;
  }
  int P = std::min(n, 8);
  if (const char* e = std::getenv("EP_PROCS"); e && std::atoi(e) >= 2) P = std::min(P, std::atoi(e));
  const int steps = std::getenv("EP_SOAK_STEPS") ? std::atoi(std::getenv("EP_SOAK_STEPS")) : 1000;
  const uint64_t seed = tu_fresh_seed("test_ep_processes");
  std::printf("test_ep_processes: %d ranks (processes), seed %llu, soak %d steps\n", P,
              static_cast<unsigned long long>(seed), steps);
  std::vector<std::string> ids;
  for (int i = 0; i < kLayers; ++i) {
    ncclUniqueId id;
    if (ncclGetUniqueId(&id) != ncclSuccess) {
      std::fprintf(stderr, "ncclGetUniqueId failed\n");
      return 1;
    }
    ids.push_back(to_hex(id));
  }
  const std::string seed_s = std::to_string(seed), P_s = std::to_string(P), steps_s = std::to_string(steps);
  std::vector<pid_t> pids;
  for (int r = 0; r < P; ++r) {
    const std::string r_s = std::to_string(r);
    std::vector<char*> av = {argv[0], const_cast<char*>("--rank"), const_cast<char*>(r_s.c_str()),
                             const_cast<char*>(P_s.c_str()), const_cast<char*>(seed_s.c_str()),
                             const_cast<char*>(steps_s.c_str())};
    for (auto& id : ids) av.push_back(const_cast<char*>(id.c_str()));
    av.push_back(nullptr);
    const pid_t pid = fork();
    if (pid == 0) {
      execv("/proc/self/exe", av.data());
      std::perror("execv");
      _exit(127);
    }
    pids.push_back(pid);
  }
  int failed = 0;
  for (int r = 0; r < P; ++r) {
    int status = 0;
    waitpid(pids[r], &status, 0);
    const bool ok = WIFEXITED(status) && WEXITSTATUS(status) == 0;
    failed += !ok;
    if (!ok) std::printf("  rank %d: exited with %d\n", r, WIFEXITED(status) ? WEXITSTATUS(status) : -1);
  }
  std::printf("test_ep_processes: %s (%d of %d ranks failed)\n", failed ? "FAILED" : "passed", failed, P);
  return failed ? 1 : 0;
}
