// The expert-parallel layer on the GPUs of one host (every visible GPU a rank, 2 to 8, one
// thread each, one communicator from ncclCommInitAll) against the single-GPU layer run on all
// ranks' tokens at once with all experts: y, dx, the local experts' weight gradients, the
// router weight's gradient (summed over the ranks) and the gate gradients. Each case also checks
// that a second run gives the same bits, and that forward + backward captured in a CUDA graph and
// replayed on new inputs equals the eager call on them. Exits 77 (skipped) with fewer than two GPUs.
#include <cuda_runtime.h>
#include <nccl.h>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <thread>
#include <vector>

#include "moeblaze/moeblaze.h"
extern "C" {
#include "test_util.h"
}

namespace {

#define CK(call)                                                                                      \
  do {                                                                                                \
    cudaError_t e_ = (call);                                                                          \
    if (e_ != cudaSuccess) {                                                                          \
      std::fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #call, cudaGetErrorString(e_));      \
      std::exit(1);                                                                                   \
    }                                                                                                 \
  } while (0)
#define MB(call)                                                                                      \
  do {                                                                                                \
    moeblaze_status_t s_ = (call);                                                                    \
    if (s_ != MOEBLAZE_STATUS_SUCCESS) {                                                              \
      std::fprintf(stderr, "%s:%d %s: %s (%s)\n", __FILE__, __LINE__, #call, moeblaze_status_name(s_), \
                   moeblaze_get_last_error_message());                                                \
      std::exit(1);                                                                                   \
    }                                                                                                 \
  } while (0)

const moeblaze_dtype_t kBf16 = {MOEBLAZE_DTYPE_CODE_BFLOAT, 16, 1};
const moeblaze_dtype_t kF32 = {MOEBLAZE_DTYPE_CODE_FLOAT, 32, 1};
const moeblaze_dtype_t kI32 = {MOEBLAZE_DTYPE_CODE_INT, 32, 1};

struct Case {
  const char* name;
  int64_t E, k, d, h;
  int64_t activation;
  bool caller_ids;   // routing given as ids skewed onto rank 0's experts, else a router weight
  int64_t tokens[8];  // per rank
  int64_t max_recv = 0;  // EP_MAX_RECV_TOKENS (0: dropless); a bound too small for the step
                         // must turn every output NaN and report INSUFFICIENT_WORKSPACE
};

// Host tensors of one layer call, bf16 unless named.
struct Host {
  std::vector<uint16_t> x, dy, wgu, wd, wg;  // x, dy [L, d]; wgu [E, d, g h]; wd [E, h, d]; wg [E, d]
  std::vector<int32_t> ids;                   // [L, k]
  std::vector<float> gates;                   // [L, k]
};

std::vector<uint16_t> random_bf16(tu_rng* r, size_t n, double scale) {
  std::vector<uint16_t> v(n);
  for (auto& e : v) e = tu_f32_to_bf16(static_cast<float>(tu_rng_normal(r) * scale));
  return v;
}

void* to_device(const void* p, size_t bytes) {
  void* d = nullptr;
  CK(cudaMalloc(&d, bytes > 0 ? bytes : 16));
  if (bytes) CK(cudaMemcpy(d, p, bytes, cudaMemcpyHostToDevice));
  return d;
}
void* poisoned(size_t bytes) {
  void* d = nullptr;
  CK(cudaMalloc(&d, bytes > 0 ? bytes : 16));
  CK(cudaMemset(d, 0xff, bytes > 0 ? bytes : 16));  // NaN in bf16 and f32
  return d;
}
template <class T>
std::vector<T> to_host(const void* d, size_t n) {
  std::vector<T> v(n);
  if (n) CK(cudaMemcpy(v.data(), d, n * sizeof(T), cudaMemcpyDeviceToHost));
  return v;
}

struct Shapes {
  int64_t s[8][3];
  int n = 0;
  const int64_t* add(int64_t a, int64_t b = -1, int64_t c = -1) {
    s[n][0] = a, s[n][1] = b, s[n][2] = c;
    return s[n++];
  }
};

moeblaze_arg_t arg(int32_t kind, void* p, moeblaze_dtype_t t, Shapes& sh, int64_t a, int64_t b = -1, int64_t c = -1) {
  const int nd = c >= 0 ? 3 : b >= 0 ? 2 : a >= 0 ? 1 : 0;
  moeblaze_tensor_t tt = tu_tensor(p, t, nd, sh.add(a, b, c));
  tt.device.device_type = MOEBLAZE_DEVICE_CUDA;
  CK(cudaGetDevice(&tt.device.device_id));
  return tu_arg(kind, tt);
}

// One rank's (or the reference's) device buffers and results.
struct Run {
  std::vector<uint16_t> y, dx, dwgu, dwd, dwg;
  std::vector<float> dgates;
  std::vector<int32_t> status;  // forward's, backward's
};

// Forward (training) and backward of `h` on the given host inputs; experts [e0, e0 + Eh).
struct Layer {
  moeblaze_handle_t h = nullptr;
  const Case* c = nullptr;
  int64_t L = 0, Eh = 0, gh = 0;
  void *x, *dy, *wgu, *wd, *wg, *ids, *gates, *y, *dx, *dwgu, *dwd, *dwg, *dgates, *ws_f, *ws_b, *saved, *status;
  size_t ws_f_bytes = 0, ws_b_bytes = 0, saved_bytes = 0;

  void setup(moeblaze_handle_t handle, const Case& cs, const Host& in, int64_t tokens, int64_t e0, int64_t experts) {
    h = handle, c = &cs, L = tokens, Eh = experts;
    gh = (cs.activation == MOEBLAZE_ACTIVATION_SWIGLU ? 2 : 1) * cs.h;
    const int64_t d = cs.d, k = cs.k;
    x = to_device(in.x.data(), in.x.size() * 2);
    dy = to_device(in.dy.data(), in.dy.size() * 2);
    wgu = to_device(in.wgu.data() + e0 * d * gh, static_cast<size_t>(Eh * d * gh * 2));
    wd = to_device(in.wd.data() + e0 * cs.h * d, static_cast<size_t>(Eh * cs.h * d * 2));
    wg = to_device(in.wg.data(), in.wg.size() * 2);
    ids = to_device(in.ids.data(), in.ids.size() * 4);
    gates = to_device(in.gates.data(), in.gates.size() * 4);
    y = poisoned(static_cast<size_t>(L * d * 2));
    dx = poisoned(static_cast<size_t>(L * d * 2));
    dwgu = poisoned(static_cast<size_t>(Eh * d * gh * 2));
    dwd = poisoned(static_cast<size_t>(Eh * cs.h * d * 2));
    dwg = poisoned(static_cast<size_t>(cs.E * d * 2));
    dgates = poisoned(static_cast<size_t>(L * k * 4));
    MB(moeblaze_get_workspace_size(h, MOEBLAZE_PASS_FORWARD_TRAINING, L, &ws_f_bytes));
    MB(moeblaze_get_workspace_size(h, MOEBLAZE_PASS_BACKWARD, L, &ws_b_bytes));
    MB(moeblaze_get_saved_size(h, L, &saved_bytes));
    CK(cudaMalloc(&ws_f, ws_f_bytes));
    CK(cudaMalloc(&ws_b, ws_b_bytes));
    CK(cudaMalloc(&saved, saved_bytes));
    CK(cudaMalloc(&status, 2 * sizeof(int32_t)));
    CK(cudaDeviceSynchronize());  // the copies and fills above ran on the legacy stream
  }
  void set_x(const std::vector<uint16_t>& v) { CK(cudaMemcpy(x, v.data(), v.size() * 2, cudaMemcpyHostToDevice)); }

  void step(cudaStream_t s) const {
    const int64_t d = c->d, k = c->k, E = c->E;
    Shapes sh;
    std::vector<moeblaze_arg_t> f = {arg(MOEBLAZE_ARG_INPUT, x, kBf16, sh, L, d),
                                     arg(MOEBLAZE_ARG_W_GATE_UP, wgu, kBf16, sh, Eh, d, gh),
                                     arg(MOEBLAZE_ARG_W_DOWN, wd, kBf16, sh, Eh, c->h, d),
                                     arg(MOEBLAZE_ARG_OUTPUT, y, kBf16, sh, L, d),
                                     arg(MOEBLAZE_ARG_STATUS, status, kI32, sh, -1)};
    if (c->caller_ids) {
      f.push_back(arg(MOEBLAZE_ARG_TOPK_INDICES, ids, kI32, sh, L, k));
      f.push_back(arg(MOEBLAZE_ARG_TOPK_WEIGHTS, gates, kF32, sh, L, k));
    } else {
      f.push_back(arg(MOEBLAZE_ARG_ROUTER_WEIGHT, wg, kBf16, sh, E, d));
    }
    MB(moeblaze_forward(h, MOEBLAZE_PASS_FORWARD_TRAINING, f.data(), f.size(), ws_f, ws_f_bytes, saved, saved_bytes, s));
    Shapes sb;
    std::vector<moeblaze_arg_t> b = {arg(MOEBLAZE_ARG_INPUT, x, kBf16, sb, L, d),
                                     arg(MOEBLAZE_ARG_W_GATE_UP, wgu, kBf16, sb, Eh, d, gh),
                                     arg(MOEBLAZE_ARG_W_DOWN, wd, kBf16, sb, Eh, c->h, d),
                                     arg(MOEBLAZE_ARG_GRAD_OUTPUT, dy, kBf16, sb, L, d),
                                     arg(MOEBLAZE_ARG_GRAD_INPUT, dx, kBf16, sb, L, d)};
    Shapes sc;
    b.push_back(arg(MOEBLAZE_ARG_STATUS, static_cast<int32_t*>(status) + 1, kI32, sc, -1));
    b.push_back(arg(MOEBLAZE_ARG_GRAD_W_GATE_UP, dwgu, kBf16, sc, Eh, d, gh));
    b.push_back(arg(MOEBLAZE_ARG_GRAD_W_DOWN, dwd, kBf16, sc, Eh, c->h, d));
    if (c->caller_ids) {
      b.push_back(arg(MOEBLAZE_ARG_TOPK_INDICES, ids, kI32, sc, L, k));
      b.push_back(arg(MOEBLAZE_ARG_TOPK_WEIGHTS, gates, kF32, sc, L, k));
      b.push_back(arg(MOEBLAZE_ARG_GRAD_TOPK_WEIGHTS, dgates, kF32, sc, L, k));
    } else {
      b.push_back(arg(MOEBLAZE_ARG_ROUTER_WEIGHT, wg, kBf16, sc, E, d));
      b.push_back(arg(MOEBLAZE_ARG_GRAD_ROUTER_WEIGHT, dwg, kBf16, sc, E, d));
    }
    MB(moeblaze_backward(h, b.data(), b.size(), saved, saved_bytes, ws_b, ws_b_bytes, s));
  }
  Run results() const {
    Run r;
    r.y = to_host<uint16_t>(y, static_cast<size_t>(L * c->d));
    r.dx = to_host<uint16_t>(dx, static_cast<size_t>(L * c->d));
    r.dwgu = to_host<uint16_t>(dwgu, static_cast<size_t>(Eh * c->d * gh));
    r.dwd = to_host<uint16_t>(dwd, static_cast<size_t>(Eh * c->h * c->d));
    r.status = to_host<int32_t>(status, 2);
    if (c->caller_ids) r.dgates = to_host<float>(dgates, static_cast<size_t>(L * c->k));
    else r.dwg = to_host<uint16_t>(dwg, static_cast<size_t>(c->E * c->d));
    return r;
  }
  void release() {
    for (void* p : {x, dy, wgu, wd, wg, ids, gates, y, dx, dwgu, dwd, dwg, dgates, ws_f, ws_b, saved, status}) cudaFree(p);
    moeblaze_destroy(h);
  }
};

moeblaze_config_t config(const Case& c, int64_t max_tokens, int device, int64_t max_recv = 0) {
  moeblaze_config_t cfg = nullptr;
  MB(moeblaze_config_create(&cfg));
  MB(moeblaze_config_set_i64(cfg, MOEBLAZE_ATTR_NUM_EXPERTS, c.E));
  MB(moeblaze_config_set_i64(cfg, MOEBLAZE_ATTR_TOP_K, c.k));
  MB(moeblaze_config_set_i64(cfg, MOEBLAZE_ATTR_HIDDEN_SIZE, c.d));
  MB(moeblaze_config_set_i64(cfg, MOEBLAZE_ATTR_FFN_HIDDEN_SIZE, c.h));
  MB(moeblaze_config_set_i64(cfg, MOEBLAZE_ATTR_MAX_TOKENS, std::max<int64_t>(max_tokens, 1)));
  MB(moeblaze_config_set_i64(cfg, MOEBLAZE_ATTR_ACTIVATION, c.activation));
  MB(moeblaze_config_set_i64(cfg, MOEBLAZE_ATTR_NORMALIZE_TOPK, 1));
  MB(moeblaze_config_set_i64(cfg, MOEBLAZE_ATTR_DEVICE_TYPE, MOEBLAZE_DEVICE_CUDA));
  MB(moeblaze_config_set_i64(cfg, MOEBLAZE_ATTR_DEVICE_ID, device));
  MB(moeblaze_config_set_i64(cfg, MOEBLAZE_ATTR_EP_MAX_RECV_TOKENS, max_recv));
  return cfg;
}

double rel_bf16(const uint16_t* a, const uint16_t* b, size_t n) {
  double num = 0, den = 0;
  for (size_t i = 0; i < n; ++i) {
    const double x = tu_bf16_to_f32(a[i]), y = tu_bf16_to_f32(b[i]);
    if (!std::isfinite(x)) return INFINITY;
    num += (x - y) * (x - y);
    den += y * y;
  }
  return std::sqrt(num / std::max(den, 1e-30));
}

int failures = 0;
void expect(bool ok, const char* what, const char* name, int rank, double v) {
  std::printf("  %-8s rank %d %-28s %s (%.3g)\n", ok ? "ok" : "FAILED", rank, what, name, v);
  if (!ok) ++failures;
}

void run_case(const Case& cs, int P, ncclComm_t* comms, uint64_t seed) {
  tu_rng rng;
  tu_rng_seed(&rng, seed);
  const int64_t d = cs.d, k = cs.k, E = cs.E, El = E / P;
  const int64_t gh = (cs.activation == MOEBLAZE_ACTIVATION_SWIGLU ? 2 : 1) * cs.h;
  int64_t total = 0, maxL = 0;
  std::vector<int64_t> off(P + 1, 0);
  for (int r = 0; r < P; ++r) {
    off[r + 1] = off[r] + cs.tokens[r];
    maxL = std::max(maxL, cs.tokens[r]);
  }
  total = off[P];
  Host all;
  all.x = random_bf16(&rng, static_cast<size_t>(total * d), 1.0);
  all.dy = random_bf16(&rng, static_cast<size_t>(total * d), 1.0);
  all.wgu = random_bf16(&rng, static_cast<size_t>(E * d * gh), 1.0 / std::sqrt(static_cast<double>(d)));
  all.wd = random_bf16(&rng, static_cast<size_t>(E * cs.h * d), 1.0 / std::sqrt(static_cast<double>(cs.h)));
  all.wg = random_bf16(&rng, static_cast<size_t>(E * d), 1.0 / std::sqrt(static_cast<double>(d)));
  all.ids.resize(static_cast<size_t>(total * k));
  all.gates.resize(static_cast<size_t>(total * k));
  for (int64_t t = 0; t < total; ++t) {
    // Skewed: most tokens' first min(k, E_loc) experts on rank 0, the rest anywhere.
    const bool skew = cs.caller_ids && t % 4 != 3;
    for (int64_t j = 0; j < k; ++j) {
      const int64_t pool = skew && j < El ? El : E;
      int32_t e;
      bool again;
      do {
        e = static_cast<int32_t>(tu_rng_below(&rng, pool));
        again = false;
        for (int64_t q = 0; q < j; ++q) again |= all.ids[t * k + q] == e;
      } while (again);
      all.ids[t * k + j] = e;
      all.gates[t * k + j] = static_cast<float>(0.25 + tu_rng_uniform(&rng));
    }
  }
  auto slice = [&](int r) {
    Host h = all;
    const int64_t a = off[r], n = cs.tokens[r];
    h.x.assign(all.x.begin() + a * d, all.x.begin() + (a + n) * d);
    h.dy.assign(all.dy.begin() + a * d, all.dy.begin() + (a + n) * d);
    h.ids.assign(all.ids.begin() + a * k, all.ids.begin() + (a + n) * k);
    h.gates.assign(all.gates.begin() + a * k, all.gates.begin() + (a + n) * k);
    return h;
  };
  std::printf("%s: P %d, E %lld, k %lld, d %lld, h %lld, tokens", cs.name, P, static_cast<long long>(E),
              static_cast<long long>(k), static_cast<long long>(d), static_cast<long long>(cs.h));
  for (int r = 0; r < P; ++r) std::printf(" %lld", static_cast<long long>(cs.tokens[r]));
  std::printf("\n");

  // The reference: one GPU, every token, every expert.
  Run ref;
  {
    CK(cudaSetDevice(0));
    moeblaze_config_t cfg = config(cs, total, 0);
    moeblaze_handle_t h = nullptr;
    MB(moeblaze_create(&h, cfg));
    moeblaze_config_destroy(cfg);
    Layer l;
    l.setup(h, cs, all, total, 0, E);
    l.step(nullptr);
    CK(cudaDeviceSynchronize());
    ref = l.results();
    l.release();
    std::printf("  reference done\n");
  }

  // The EP layer: one thread per rank, each running the same sequence of collective calls.
  std::vector<Run> first(P), second(P), graphed(P), eager_new(P);
  std::vector<std::vector<uint16_t>> new_x(P);
  for (int r = 0; r < P; ++r) new_x[r] = random_bf16(&rng, static_cast<size_t>(cs.tokens[r] * d), 1.0);
  std::vector<std::thread> threads;
  for (int r = 0; r < P; ++r) {
    threads.emplace_back([&, r] {
      CK(cudaSetDevice(r));
      cudaStream_t s;
      CK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
      moeblaze_config_t cfg = config(cs, maxL, r, cs.max_recv);
      moeblaze_handle_t h = nullptr;
      MB(moeblaze_create_ep(&h, cfg, comms[r], s));
      int64_t size = 0, rank = -1;
      MB(moeblaze_handle_get_i64(h, MOEBLAZE_ATTR_EP_SIZE, &size));
      MB(moeblaze_handle_get_i64(h, MOEBLAZE_ATTR_EP_RANK, &rank));
      if (size != P || rank != r) {
        std::printf("  FAILED rank %d: the handle reports EP_SIZE %lld, EP_RANK %lld\n", r, static_cast<long long>(size),
                    static_cast<long long>(rank));
        std::exit(1);
      }
      moeblaze_config_destroy(cfg);
      std::printf("  rank %d: created\n", r);
      Layer l;
      l.setup(h, cs, slice(r), cs.tokens[r], r * El, El);
      l.step(s);
      CK(cudaStreamSynchronize(s));
      first[r] = l.results();
      std::printf("  rank %d: first step done\n", r);
      l.step(s);
      CK(cudaStreamSynchronize(s));
      second[r] = l.results();
      // Captured once, replayed on new x; then the same call eagerly.
      cudaGraph_t g;
      cudaGraphExec_t ge;
      CK(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal));
      l.step(s);
      CK(cudaStreamEndCapture(s, &g));
      CK(cudaGraphInstantiate(&ge, g, 0));
      std::printf("  rank %d: captured\n", r);
      l.set_x(new_x[r]);
      CK(cudaGraphLaunch(ge, s));
      CK(cudaStreamSynchronize(s));
      graphed[r] = l.results();
      l.step(s);
      CK(cudaStreamSynchronize(s));
      eager_new[r] = l.results();
      CK(cudaGraphExecDestroy(ge));
      CK(cudaGraphDestroy(g));
      l.release();
      CK(cudaStreamDestroy(s));
    });
  }
  for (auto& t : threads) t.join();

  if (cs.max_recv > 0) {  // the bound is too small: every output NaN, STATUS on every rank
    for (int r = 0; r < P; ++r) {
      const Run& a = first[r];
      bool nan = true;
      for (uint16_t v : a.y) nan &= std::isnan(tu_bf16_to_f32(v));
      for (uint16_t v : a.dx) nan &= std::isnan(tu_bf16_to_f32(v));
      for (uint16_t v : a.dwgu) nan &= std::isnan(tu_bf16_to_f32(v));
      const bool st = a.status[0] == MOEBLAZE_STATUS_INSUFFICIENT_WORKSPACE &&
                      a.status[1] == MOEBLAZE_STATUS_INSUFFICIENT_WORKSPACE;
      expect(nan, "overflow: every output NaN", cs.name, r, 0);
      expect(st, "overflow: STATUS INSUFFICIENT_WORKSPACE", cs.name, r, a.status[0]);
    }
    return;
  }
  const double tol = 2e-2;
  std::vector<double> dwg_sum(static_cast<size_t>(E * d), 0.0);
  for (int r = 0; r < P; ++r) {
    const Run& a = first[r];
    const size_t n = static_cast<size_t>(cs.tokens[r] * d);
    if (n) {
      const double ey = rel_bf16(a.y.data(), ref.y.data() + off[r] * d, n);
      const double ex = rel_bf16(a.dx.data(), ref.dx.data() + off[r] * d, n);
      expect(ey < tol, "y vs single GPU", cs.name, r, ey);
      expect(ex < tol, "dx vs single GPU", cs.name, r, ex);
    }
    const double egu = rel_bf16(a.dwgu.data(), ref.dwgu.data() + r * El * d * gh, a.dwgu.size());
    const double ed = rel_bf16(a.dwd.data(), ref.dwd.data() + r * El * cs.h * d, a.dwd.size());
    expect(egu < tol, "dW_gate_up vs single GPU", cs.name, r, egu);
    expect(ed < tol, "dW_down vs single GPU", cs.name, r, ed);
    if (cs.caller_ids) {
      double num = 0, den = 0;
      for (int64_t i = 0; i < cs.tokens[r] * k; ++i) {
        const double u = a.dgates[i], v = ref.dgates[off[r] * k + i];
        num += (u - v) * (u - v);
        den += v * v;
      }
      const double eg = std::isfinite(num) ? std::sqrt(num / std::max(den, 1e-30)) : INFINITY;
      if (cs.tokens[r]) expect(eg < tol, "gate gradients vs single GPU", cs.name, r, eg);
    } else {
      for (size_t i = 0; i < dwg_sum.size(); ++i) dwg_sum[i] += tu_bf16_to_f32(a.dwg[i]);
    }
    expect(a.status[0] == 0 && a.status[1] == 0, "STATUS 0", cs.name, r, a.status[0] + a.status[1]);
    const bool same = a.y == second[r].y && a.dx == second[r].dx && a.dwgu == second[r].dwgu &&
                      a.dwd == second[r].dwd && a.dwg == second[r].dwg && a.dgates == second[r].dgates;
    expect(same, "bitwise equal on a second run", cs.name, r, 0);
    const Run& g = graphed[r];
    const Run& e = eager_new[r];
    const bool graph_same = g.y == e.y && g.dx == e.dx && g.dwgu == e.dwgu && g.dwd == e.dwd && g.dwg == e.dwg &&
                            g.dgates == e.dgates && (cs.tokens[r] == 0 || g.y != a.y);
    expect(graph_same, "graph replay on new x == eager", cs.name, r, 0);
  }
  if (!cs.caller_ids) {
    double num = 0, den = 0;
    for (size_t i = 0; i < dwg_sum.size(); ++i) {
      const double v = tu_bf16_to_f32(ref.dwg[i]);
      num += (dwg_sum[i] - v) * (dwg_sum[i] - v);
      den += v * v;
    }
    const double e = std::isfinite(num) ? std::sqrt(num / std::max(den, 1e-30)) : INFINITY;
    expect(e < tol, "dW_router (sum over ranks)", cs.name, -1, e);
  }
}

// Refused on every rank before any collective call: an EP_SIZE or EP_RANK the communicator
// contradicts, the HOST transport (not built).
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
                    {MOEBLAZE_ATTR_EP_RANK, (r + 1) % P, MOEBLAZE_STATUS_INVALID_ARGUMENT},
                    {MOEBLAZE_ATTR_EP_TRANSPORT, MOEBLAZE_EP_TRANSPORT_HOST, MOEBLAZE_STATUS_NOT_SUPPORTED}};
      for (const auto& p : probes) {
        moeblaze_config_t cfg = config(cs, 64, r);
        MB(moeblaze_config_set_i64(cfg, p.attr, p.value));
        moeblaze_handle_t h = reinterpret_cast<moeblaze_handle_t>(1);
        bad[r] += moeblaze_create_ep(&h, cfg, comms[r], nullptr) != p.want || h != nullptr;
        moeblaze_config_destroy(cfg);
      }
    });
  for (auto& t : th) t.join();
  for (int r = 0; r < P; ++r) expect(bad[r] == 0, "refusals (EP_SIZE, EP_RANK, HOST)", cs.name, r, bad[r]);
}

}  // namespace

int main() {
  std::setvbuf(stdout, nullptr, _IONBF, 0);
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess || n < 2) {
    std::printf("test_ep_gpu: needs at least two GPUs (found %d): skipped\n", n);
    return 77;
  }
  const int P = std::min(n, 8);
  std::vector<ncclComm_t> comms(P);
  std::vector<int> devs(P);
  for (int i = 0; i < P; ++i) devs[i] = i;
  if (ncclCommInitAll(comms.data(), P, devs.data()) != ncclSuccess) {
    std::fprintf(stderr, "ncclCommInitAll failed\n");
    return 1;
  }
  const uint64_t seed = tu_fresh_seed("test_ep_gpu");
  std::printf("test_ep_gpu: %d ranks, seed %llu\n", P, static_cast<unsigned long long>(seed));
  const Case cases[] = {
      {"swiglu-router", 8LL * P, 4, 256, 128, MOEBLAZE_ACTIVATION_SWIGLU, false, {300, 173, 256, 77, 300, 12, 190, 64}},
      // k larger than the experts per rank, a rank with no tokens, routing skewed onto rank 0.
      {"silu-ids-skewed", 2LL * P, std::min<int64_t>(2LL * P, 3), 128, 64, MOEBLAZE_ACTIVATION_SILU, true,
       {129, 0, 64, 200, 5, 33, 0, 97}},
      // Most tokens go to rank 0's experts: a receive bound of 40 rows overflows there.
      {"overflow", 2LL * P, 2, 128, 64, MOEBLAZE_ACTIVATION_SILU, true, {100, 90, 80, 70, 60, 50, 40, 30}, 40},
  };
  for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); ++i) run_case(cases[i], P, comms.data(), seed + i);
  refusals(cases[0], P, comms.data());
  for (int i = 0; i < P; ++i) ncclCommDestroy(comms[i]);
  std::printf("test_ep_gpu: %s (%d failed)\n", failures ? "FAILED" : "passed", failures);
  return failures ? 1 : 0;
}
