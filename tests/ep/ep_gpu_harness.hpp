// The expert-parallel GPU tests' harness: a case (shape, dtype, engine, routing), its inputs for
// every rank, the single-GPU reference on all ranks' tokens, one rank's sequence of calls on an EP
// handle and the checks of its results against the reference.
#pragma once
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "moeblaze/moeblaze.h"
extern "C" {
#include "test_util.h"
}

namespace ep_test {

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

inline const moeblaze_dtype_t kBf16 = {MOEBLAZE_DTYPE_CODE_BFLOAT, 16, 1};
inline const moeblaze_dtype_t kF16 = {MOEBLAZE_DTYPE_CODE_FLOAT, 16, 1};
inline const moeblaze_dtype_t kF32 = {MOEBLAZE_DTYPE_CODE_FLOAT, 32, 1};
inline const moeblaze_dtype_t kI32 = {MOEBLAZE_DTYPE_CODE_INT, 32, 1};
inline const moeblaze_dtype_t kI64 = {MOEBLAZE_DTYPE_CODE_INT, 64, 1};

struct Case {
  const char* name;
  int64_t E, k, d, h;
  int64_t activation;
  bool caller_ids;   // routing given as ids skewed onto rank 0's experts, else a router weight
  int64_t tokens[8];  // per rank
  int64_t max_recv = 0;  // EP_MAX_RECV_TOKENS (0: dropless); a bound too small for the step
                         // must turn every output NaN and report INSUFFICIENT_WORKSPACE
  bool f16 = false;      // fp16 activations and weights, else bf16
  int64_t engine = MOEBLAZE_ENGINE_AUTO;
  int64_t save_policy = MOEBLAZE_SAVE_PREACT;
  // Routing options (docs/routing.md), routed by the EP router on every rank's own tokens.
  int64_t groups = 1, keep = 0;  // NUM_EXPERT_GROUPS, TOPK_GROUPS
  double route_scale = 1.0;
  bool sigmoid = false;          // SCORE_FUNCTION
  bool bias = false;             // an EXPERT_BIAS [E]
  bool mask = false;             // a TOKEN_MASK: about a third of each rank's tokens masked
  // The sequence-wise balance loss: this many SEQUENCE_LENGTHS per rank (each rank's tokens
  // split at random), AUX_LOSS_COEFF `aux` on one GPU and aux / P on each of the P ranks, so
  // that the ranks' losses and router gradients sum to the single-GPU layer's on all tokens.
  int64_t seqs = 0;
  double aux = 0.0;
  // EP_TRANSPORT: HOST moves the rows with ncclSend/ncclRecv after the counts reach the host,
  // so its calls refuse a capture (as the cuBLASLt local engine's do).
  int64_t transport = MOEBLAZE_EP_TRANSPORT_AUTO;
};

inline bool syncs(const Case& c) {
  return c.engine == MOEBLAZE_ENGINE_CUDA_CUBLASLT || c.transport == MOEBLAZE_EP_TRANSPORT_HOST;
}

inline int64_t gated(const Case& c) {
  return c.activation == MOEBLAZE_ACTIVATION_SWIGLU || c.activation == MOEBLAZE_ACTIVATION_GEGLU ? 2 : 1;
}
inline moeblaze_dtype_t storage(const Case& c) { return c.f16 ? kF16 : kBf16; }
inline float decode(const Case& c, uint16_t v) { return c.f16 ? tu_f16_to_f32(v) : tu_bf16_to_f32(v); }

// Host tensors of one layer call, bf16 unless named.
struct Host {
  std::vector<uint16_t> x, dy, wgu, wd, wg;  // x, dy [L, d]; wgu [E, d, g h]; wd [E, h, d]; wg [E, d]
  std::vector<int32_t> ids;                   // [L, k]
  std::vector<float> gates;                   // [L, k]
  std::vector<float> bias;                    // [E] expert score bias (Case::bias)
  std::vector<int32_t> mask;                  // [L] TOKEN_MASK (Case::mask)
  std::vector<int64_t> lens;                  // [B] SEQUENCE_LENGTHS (Case::seqs)
};

inline std::vector<uint16_t> random16(const Case& c, tu_rng* r, size_t n, double scale) {
  std::vector<uint16_t> v(n);
  for (auto& e : v) {
    const float f = static_cast<float>(tu_rng_normal(r) * scale);
    e = c.f16 ? tu_f32_to_f16(f) : tu_f32_to_bf16(f);
  }
  return v;
}

inline void* to_device(const void* p, size_t bytes) {
  void* d = nullptr;
  CK(cudaMalloc(&d, bytes > 0 ? bytes : 16));
  if (bytes) CK(cudaMemcpy(d, p, bytes, cudaMemcpyHostToDevice));
  return d;
}
inline void* poisoned(size_t bytes) {
  void* d = nullptr;
  CK(cudaMalloc(&d, bytes > 0 ? bytes : 16));
  CK(cudaMemset(d, 0xff, bytes > 0 ? bytes : 16));  // NaN in bf16 and f32
  return d;
}
template <class T>
inline std::vector<T> to_host(const void* d, size_t n) {
  std::vector<T> v(n);
  if (n) CK(cudaMemcpy(v.data(), d, n * sizeof(T), cudaMemcpyDeviceToHost));
  return v;
}

struct Shapes {
  int64_t s[16][3];
  int n = 0;
  const int64_t* add(int64_t a, int64_t b = -1, int64_t c = -1) {
    s[n][0] = a, s[n][1] = b, s[n][2] = c;
    return s[n++];
  }
};

inline moeblaze_arg_t arg(int32_t kind, void* p, moeblaze_dtype_t t, Shapes& sh, int64_t a, int64_t b = -1, int64_t c = -1) {
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
  std::vector<uint16_t> y_inference;  // with a router: forward inference's y,
  std::vector<int32_t> route_ids;     // and route's top-k ids and gates
  std::vector<float> route_gates;
  float aux = 0.f;                    // forward's AUX_LOSS
};

// Forward (training) and backward of `h` on the given host inputs; experts [e0, e0 + Eh).
struct Layer {
  moeblaze_handle_t h = nullptr;
  const Case* c = nullptr;
  int64_t L = 0, Eh = 0, gh = 0;
  void *x, *dy, *wgu, *wd, *wg, *ids, *gates, *bias, *mask, *lens, *aux, *y, *dx, *dwgu, *dwd, *dwg, *dgates, *ws_f,
      *ws_b, *saved, *status;
  int64_t B = 0;  // sequences
  void *y_inf, *ws_i, *route_ids, *route_gates, *ws_r;
  size_t ws_f_bytes = 0, ws_b_bytes = 0, saved_bytes = 0, ws_i_bytes = 0, ws_r_bytes = 0;

  void setup(moeblaze_handle_t handle, const Case& cs, const Host& in, int64_t tokens, int64_t e0, int64_t experts) {
    h = handle, c = &cs, L = tokens, Eh = experts;
    gh = gated(cs) * cs.h;
    const int64_t d = cs.d, k = cs.k;
    x = to_device(in.x.data(), in.x.size() * 2);
    dy = to_device(in.dy.data(), in.dy.size() * 2);
    wgu = to_device(in.wgu.data() + e0 * d * gh, static_cast<size_t>(Eh * d * gh * 2));
    wd = to_device(in.wd.data() + e0 * cs.h * d, static_cast<size_t>(Eh * cs.h * d * 2));
    wg = to_device(in.wg.data(), in.wg.size() * 2);
    ids = to_device(in.ids.data(), in.ids.size() * 4);
    gates = to_device(in.gates.data(), in.gates.size() * 4);
    bias = to_device(in.bias.data(), in.bias.size() * 4);
    mask = to_device(in.mask.data(), in.mask.size() * 4);
    B = static_cast<int64_t>(in.lens.size());
    lens = to_device(in.lens.data(), in.lens.size() * 8);
    aux = poisoned(4);
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
    CK(cudaMalloc(&status, 4 * sizeof(int32_t)));
    y_inf = poisoned(static_cast<size_t>(L * d * 2));
    route_ids = poisoned(static_cast<size_t>(L * k * 4));
    route_gates = poisoned(static_cast<size_t>(L * k * 4));
    MB(moeblaze_get_workspace_size(h, MOEBLAZE_PASS_FORWARD_INFERENCE, L, &ws_i_bytes));
    MB(moeblaze_get_workspace_size(h, MOEBLAZE_PASS_ROUTE, L, &ws_r_bytes));
    CK(cudaMalloc(&ws_i, ws_i_bytes));
    CK(cudaMalloc(&ws_r, ws_r_bytes));
    CK(cudaDeviceSynchronize());  // the copies and fills above ran on the legacy stream
  }
  void set_x(const std::vector<uint16_t>& v) { CK(cudaMemcpy(x, v.data(), v.size() * 2, cudaMemcpyHostToDevice)); }

  // Forward and backward; with `fwd_status`, forward's status is stored there (not fatal) and a
  // refused forward ends the step.
  void step(cudaStream_t s, moeblaze_status_t* fwd_status = nullptr) const {
    const int64_t d = c->d, k = c->k, E = c->E;
    Shapes sh;
    const moeblaze_dtype_t t = storage(*c);
    std::vector<moeblaze_arg_t> f = {arg(MOEBLAZE_ARG_INPUT, x, t, sh, L, d),
                                     arg(MOEBLAZE_ARG_W_GATE_UP, wgu, t, sh, Eh, d, gh),
                                     arg(MOEBLAZE_ARG_W_DOWN, wd, t, sh, Eh, c->h, d),
                                     arg(MOEBLAZE_ARG_OUTPUT, y, t, sh, L, d),
                                     arg(MOEBLAZE_ARG_STATUS, status, kI32, sh, -1)};
    if (c->caller_ids) {
      f.push_back(arg(MOEBLAZE_ARG_TOPK_INDICES, ids, kI32, sh, L, k));
      f.push_back(arg(MOEBLAZE_ARG_TOPK_WEIGHTS, gates, kF32, sh, L, k));
    } else {
      f.push_back(arg(MOEBLAZE_ARG_ROUTER_WEIGHT, wg, t, sh, E, d));
      if (c->bias) f.push_back(arg(MOEBLAZE_ARG_EXPERT_BIAS, bias, kF32, sh, E));
    }
    if (c->mask) f.push_back(arg(MOEBLAZE_ARG_TOKEN_MASK, mask, kI32, sh, L));
    if (c->seqs && !c->caller_ids) {
      f.push_back(arg(MOEBLAZE_ARG_SEQUENCE_LENGTHS, lens, kI64, sh, B));
      f.push_back(arg(MOEBLAZE_ARG_AUX_LOSS, aux, kF32, sh, -1));
    }
    if (fwd_status) {
      *fwd_status = moeblaze_forward(h, MOEBLAZE_PASS_FORWARD_TRAINING, f.data(), f.size(), ws_f, ws_f_bytes, saved,
                                     saved_bytes, s);
      if (*fwd_status != MOEBLAZE_STATUS_SUCCESS) return;
    } else {
      MB(moeblaze_forward(h, MOEBLAZE_PASS_FORWARD_TRAINING, f.data(), f.size(), ws_f, ws_f_bytes, saved, saved_bytes,
                          s));
    }
    Shapes sb;
    std::vector<moeblaze_arg_t> b = {arg(MOEBLAZE_ARG_INPUT, x, t, sb, L, d),
                                     arg(MOEBLAZE_ARG_W_GATE_UP, wgu, t, sb, Eh, d, gh),
                                     arg(MOEBLAZE_ARG_W_DOWN, wd, t, sb, Eh, c->h, d),
                                     arg(MOEBLAZE_ARG_GRAD_OUTPUT, dy, t, sb, L, d),
                                     arg(MOEBLAZE_ARG_GRAD_INPUT, dx, t, sb, L, d)};
    Shapes sc;
    b.push_back(arg(MOEBLAZE_ARG_STATUS, static_cast<int32_t*>(status) + 1, kI32, sc, -1));
    b.push_back(arg(MOEBLAZE_ARG_GRAD_W_GATE_UP, dwgu, t, sc, Eh, d, gh));
    b.push_back(arg(MOEBLAZE_ARG_GRAD_W_DOWN, dwd, t, sc, Eh, c->h, d));
    if (c->caller_ids) {
      b.push_back(arg(MOEBLAZE_ARG_TOPK_INDICES, ids, kI32, sc, L, k));
      b.push_back(arg(MOEBLAZE_ARG_TOPK_WEIGHTS, gates, kF32, sc, L, k));
      b.push_back(arg(MOEBLAZE_ARG_GRAD_TOPK_WEIGHTS, dgates, kF32, sc, L, k));
    } else {
      b.push_back(arg(MOEBLAZE_ARG_ROUTER_WEIGHT, wg, t, sc, E, d));
      b.push_back(arg(MOEBLAZE_ARG_GRAD_ROUTER_WEIGHT, dwg, t, sc, E, d));
      if (c->seqs) b.push_back(arg(MOEBLAZE_ARG_SEQUENCE_LENGTHS, lens, kI64, sc, B));
    }
    MB(moeblaze_backward(h, b.data(), b.size(), saved, saved_bytes, ws_b, ws_b_bytes, s));
  }
  // With a router: forward inference into y_inf, then route into route_ids / route_gates.
  void infer_and_route(cudaStream_t s) const {
    const int64_t d = c->d, k = c->k, E = c->E;
    const moeblaze_dtype_t t = storage(*c);
    Shapes sh;
    std::vector<moeblaze_arg_t> f = {arg(MOEBLAZE_ARG_INPUT, x, t, sh, L, d),
                                     arg(MOEBLAZE_ARG_W_GATE_UP, wgu, t, sh, Eh, d, gh),
                                     arg(MOEBLAZE_ARG_W_DOWN, wd, t, sh, Eh, c->h, d),
                                     arg(MOEBLAZE_ARG_OUTPUT, y_inf, t, sh, L, d),
                                     arg(MOEBLAZE_ARG_ROUTER_WEIGHT, wg, t, sh, E, d),
                                     arg(MOEBLAZE_ARG_STATUS, static_cast<int32_t*>(status) + 2, kI32, sh, -1)};
    if (c->bias) f.push_back(arg(MOEBLAZE_ARG_EXPERT_BIAS, bias, kF32, sh, E));
    if (c->mask) f.push_back(arg(MOEBLAZE_ARG_TOKEN_MASK, mask, kI32, sh, L));
    MB(moeblaze_forward(h, MOEBLAZE_PASS_FORWARD_INFERENCE, f.data(), f.size(), ws_i, ws_i_bytes, nullptr, 0, s));
    Shapes sr;
    std::vector<moeblaze_arg_t> r = {arg(MOEBLAZE_ARG_INPUT, x, t, sr, L, d),
                                     arg(MOEBLAZE_ARG_ROUTER_WEIGHT, wg, t, sr, E, d),
                                     arg(MOEBLAZE_ARG_TOPK_INDICES, route_ids, kI32, sr, L, k),
                                     arg(MOEBLAZE_ARG_TOPK_WEIGHTS, route_gates, kF32, sr, L, k),
                                     arg(MOEBLAZE_ARG_STATUS, static_cast<int32_t*>(status) + 3, kI32, sr, -1)};
    if (c->bias) r.push_back(arg(MOEBLAZE_ARG_EXPERT_BIAS, bias, kF32, sr, E));
    if (c->mask) r.push_back(arg(MOEBLAZE_ARG_TOKEN_MASK, mask, kI32, sr, L));
    MB(moeblaze_route(h, r.data(), r.size(), ws_r, ws_r_bytes, s));
  }
  Run results() const {
    Run r;
    r.y = to_host<uint16_t>(y, static_cast<size_t>(L * c->d));
    r.dx = to_host<uint16_t>(dx, static_cast<size_t>(L * c->d));
    r.dwgu = to_host<uint16_t>(dwgu, static_cast<size_t>(Eh * c->d * gh));
    r.dwd = to_host<uint16_t>(dwd, static_cast<size_t>(Eh * c->h * c->d));
    r.status = to_host<int32_t>(status, 4);
    if (c->seqs && !c->caller_ids) r.aux = to_host<float>(aux, 1)[0];
    if (c->caller_ids) r.dgates = to_host<float>(dgates, static_cast<size_t>(L * c->k));
    else r.dwg = to_host<uint16_t>(dwg, static_cast<size_t>(c->E * c->d));
    return r;
  }
  void inference_results(Run* r) const {
    r->y_inference = to_host<uint16_t>(y_inf, static_cast<size_t>(L * c->d));
    r->route_ids = to_host<int32_t>(route_ids, static_cast<size_t>(L * c->k));
    r->route_gates = to_host<float>(route_gates, static_cast<size_t>(L * c->k));
    r->status = to_host<int32_t>(status, 4);
  }
  void release() {
    for (void* p : {x, dy, wgu, wd, wg, ids, gates, bias, mask, lens, aux, y, dx, dwgu, dwd, dwg, dgates, ws_f, ws_b, saved, status, y_inf, ws_i,
                    route_ids, route_gates, ws_r})
      cudaFree(p);
    moeblaze_destroy(h);
  }
};

// ranks: the EP size the handle is for (1: the single-GPU reference), which scales AUX_LOSS_COEFF.
inline moeblaze_config_t config(const Case& c, int64_t max_tokens, int device, int64_t max_recv = 0, int ranks = 1) {
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
  MB(moeblaze_config_set_i64(cfg, MOEBLAZE_ATTR_ENGINE, c.engine));
  MB(moeblaze_config_set_i64(cfg, MOEBLAZE_ATTR_SAVE_POLICY, c.save_policy));
  MB(moeblaze_config_set_dtype(cfg, MOEBLAZE_ATTR_ACTIVATION_DTYPE, storage(c)));
  MB(moeblaze_config_set_dtype(cfg, MOEBLAZE_ATTR_WEIGHT_DTYPE, storage(c)));
  MB(moeblaze_config_set_i64(cfg, MOEBLAZE_ATTR_NUM_EXPERT_GROUPS, c.groups));
  MB(moeblaze_config_set_i64(cfg, MOEBLAZE_ATTR_TOPK_GROUPS, c.keep));
  MB(moeblaze_config_set_f64(cfg, MOEBLAZE_ATTR_ROUTE_SCALE, c.route_scale));
  MB(moeblaze_config_set_i64(cfg, MOEBLAZE_ATTR_SCORE_FUNCTION, c.sigmoid ? MOEBLAZE_SCORE_SIGMOID : MOEBLAZE_SCORE_SOFTMAX));
  MB(moeblaze_config_set_f64(cfg, MOEBLAZE_ATTR_AUX_LOSS_COEFF, c.aux / ranks));
  MB(moeblaze_config_set_i64(cfg, MOEBLAZE_ATTR_EP_TRANSPORT, c.transport));
  return cfg;
}

inline double rel16(const Case& c, const uint16_t* a, const uint16_t* b, size_t n) {
  double num = 0, den = 0;
  for (size_t i = 0; i < n; ++i) {
    const double x = decode(c, a[i]), y = decode(c, b[i]);
    if (!std::isfinite(x)) return INFINITY;
    num += (x - y) * (x - y);
    den += y * y;
  }
  return std::sqrt(num / std::max(den, 1e-30));
}

inline int failures = 0;
inline void expect(bool ok, const char* what, const char* name, int rank, double v) {
  std::printf("  %-8s rank %d %-28s %s (%.3g)\n", ok ? "ok" : "FAILED", rank, what, name, v);
  if (!ok) ++failures;
}


// Every rank's inputs from one seed (each process of a multi-process run draws the same).
struct Problem {
  const Case* cs = nullptr;
  int P = 0;
  Host all;                               // all ranks' tokens, all experts
  std::vector<int64_t> off;               // rank r's tokens are [off[r], off[r + 1])
  int64_t total = 0, maxL = 0;
  std::vector<std::vector<uint16_t>> new_x;  // per rank: x for the graph replay

  Host slice(int r) const {
    const int64_t d = cs->d, k = cs->k, a = off[r], n = cs->tokens[r];
    Host h = all;
    h.x.assign(all.x.begin() + a * d, all.x.begin() + (a + n) * d);
    h.dy.assign(all.dy.begin() + a * d, all.dy.begin() + (a + n) * d);
    h.ids.assign(all.ids.begin() + a * k, all.ids.begin() + (a + n) * k);
    h.gates.assign(all.gates.begin() + a * k, all.gates.begin() + (a + n) * k);
    h.mask.assign(all.mask.begin() + a, all.mask.begin() + a + n);
    const int64_t b = cs->seqs;
    h.lens.assign(all.lens.begin() + r * b, all.lens.begin() + (r + 1) * b);
    return h;
  }
};

inline Problem make_problem(const Case& cs, int P, uint64_t seed) {
  tu_rng rng;
  tu_rng_seed(&rng, seed);
  Problem pb;
  pb.cs = &cs;
  pb.P = P;
  const int64_t d = cs.d, k = cs.k, E = cs.E, El = E / P;
  const int64_t gh = gated(cs) * cs.h;
  pb.off.assign(P + 1, 0);
  for (int r = 0; r < P; ++r) {
    pb.off[r + 1] = pb.off[r] + cs.tokens[r];
    pb.maxL = std::max(pb.maxL, cs.tokens[r]);
  }
  const int64_t total = pb.total = pb.off[P];
  Host& all = pb.all;
  all.x = random16(cs, &rng, static_cast<size_t>(total * d), 1.0);
  all.dy = random16(cs, &rng, static_cast<size_t>(total * d), 1.0);
  all.wgu = random16(cs, &rng, static_cast<size_t>(E * d * gh), 1.0 / std::sqrt(static_cast<double>(d)));
  all.wd = random16(cs, &rng, static_cast<size_t>(E * cs.h * d), 1.0 / std::sqrt(static_cast<double>(cs.h)));
  all.wg = random16(cs, &rng, static_cast<size_t>(E * d), 1.0 / std::sqrt(static_cast<double>(d)));
  all.bias.resize(static_cast<size_t>(E));
  for (auto& b : all.bias) b = static_cast<float>(0.05 * tu_rng_normal(&rng));
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
  for (int r = 0; r < P && cs.seqs > 0; ++r) {  // Case::seqs random lengths >= 1 per rank, summing to its tokens
    std::vector<int64_t> n(static_cast<size_t>(cs.seqs), 1);
    for (int64_t t = cs.seqs; t < cs.tokens[r]; ++t) n[tu_rng_below(&rng, static_cast<uint64_t>(cs.seqs))] += 1;
    all.lens.insert(all.lens.end(), n.begin(), n.end());
  }
  all.mask.resize(static_cast<size_t>(total));
  for (auto& m : all.mask) m = tu_rng_uniform(&rng) < 0.3 ? 0 : 1;
  // Every sequence keeps its first token: a wholly masked one would leave the mean over one
  // rank's sequences and over all of them with different counts.
  for (int64_t t = 0, q = 0; q < static_cast<int64_t>(all.lens.size()); t += all.lens[static_cast<size_t>(q++)])
    all.mask[static_cast<size_t>(t)] = 1;
  for (int r = 0; r < P; ++r) pb.new_x.push_back(random16(cs, &rng, static_cast<size_t>(cs.tokens[r] * d), 1.0));
  return pb;
}

inline void print_problem(const Problem& pb) {
  const Case& cs = *pb.cs;
  std::printf("%s: P %d, E %lld, k %lld, d %lld, h %lld, tokens", cs.name, pb.P, static_cast<long long>(cs.E),
              static_cast<long long>(cs.k), static_cast<long long>(cs.d), static_cast<long long>(cs.h));
  for (int r = 0; r < pb.P; ++r) std::printf(" %lld", static_cast<long long>(cs.tokens[r]));
  std::printf("\n");
}

// The reference: one GPU (`device`), every token, every expert.
inline Run reference(const Problem& pb, int device) {
  const Case& cs = *pb.cs;
  Run ref;
  {
    CK(cudaSetDevice(device));
    moeblaze_config_t cfg = config(cs, pb.total, device);
    moeblaze_handle_t h = nullptr;
    MB(moeblaze_create(&h, cfg));
    moeblaze_config_destroy(cfg);
    Layer l;
    l.setup(h, cs, pb.all, pb.total, 0, cs.E);
    l.step(nullptr);
    CK(cudaDeviceSynchronize());
    ref = l.results();
    if (!cs.caller_ids && cs.max_recv == 0) {
      l.infer_and_route(nullptr);
      CK(cudaDeviceSynchronize());
      l.inference_results(&ref);
    }
    l.release();
    std::printf("  reference done\n");
  }
  return ref;

}

// One rank's results: two steps (for bitwise equality), then a graph replay on new x and the same
// step eagerly.
struct RankRuns {
  Run first, second, graphed, eager_new;
  bool refused_capture = false;  // syncs(): capture refused, capture intact
};

// Rank r's sequence of calls on `h` (an EP handle this function destroys), on the caller's stream `s`.
inline RankRuns run_rank(const Problem& pb, moeblaze_handle_t h, int r, cudaStream_t s) {
  const Case& cs = *pb.cs;
  const int64_t El = cs.E / pb.P;
  RankRuns out;
  int64_t size = 0, rank = -1;
  MB(moeblaze_handle_get_i64(h, MOEBLAZE_ATTR_EP_SIZE, &size));
  MB(moeblaze_handle_get_i64(h, MOEBLAZE_ATTR_EP_RANK, &rank));
  if (size != pb.P || rank != r) {
    std::printf("  FAILED rank %d: the handle reports EP_SIZE %lld, EP_RANK %lld\n", r, static_cast<long long>(size),
                static_cast<long long>(rank));
    std::exit(1);
  }
  Layer l;
  l.setup(h, cs, pb.slice(r), cs.tokens[r], r * El, El);
  l.step(s);
  CK(cudaStreamSynchronize(s));
  out.first = l.results();
  if (!cs.caller_ids && cs.max_recv == 0) {
    l.infer_and_route(s);
    CK(cudaStreamSynchronize(s));
    l.inference_results(&out.first);
  }
  std::printf("  rank %d: first step done\n", r);
  l.step(s);
  CK(cudaStreamSynchronize(s));
  out.second = l.results();
  // Captured once, replayed on new x; then the same call eagerly. The cuBLASLt local engine and
  // the HOST transport refuse the capture before enqueuing anything, and the capture stays usable.
  cudaGraph_t g;
  cudaGraphExec_t ge;
  CK(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal));
  if (syncs(cs)) {
    moeblaze_status_t st = MOEBLAZE_STATUS_SUCCESS;
    l.step(s, &st);
    const cudaError_t end = cudaStreamEndCapture(s, &g);
    out.refused_capture = st == MOEBLAZE_STATUS_NOT_SUPPORTED && end == cudaSuccess;
    if (end == cudaSuccess) CK(cudaGraphDestroy(g));
    l.set_x(pb.new_x[r]);
    l.step(s);
    CK(cudaStreamSynchronize(s));
    out.graphed = out.eager_new = l.results();
    l.release();
    return out;
  }
  l.step(s);
  CK(cudaStreamEndCapture(s, &g));
  CK(cudaGraphInstantiate(&ge, g, 0));
  std::printf("  rank %d: captured\n", r);
  l.set_x(pb.new_x[r]);
  CK(cudaGraphLaunch(ge, s));
  CK(cudaStreamSynchronize(s));
  out.graphed = l.results();
  l.step(s);
  CK(cudaStreamSynchronize(s));
  out.eager_new = l.results();
  CK(cudaGraphExecDestroy(ge));
  CK(cudaGraphDestroy(g));
  l.release();
  return out;
}

// Rank r's results against the reference; adds its router-weight gradient to *dwg_sum (if given).
inline void check_rank(const Problem& pb, const Run& ref, const RankRuns& runs, int r, std::vector<double>* dwg_sum) {
  const Case& cs = *pb.cs;
  const int64_t d = cs.d, k = cs.k, El = cs.E / pb.P;
  const int64_t gh = gated(cs) * cs.h;
  const std::vector<int64_t>& off = pb.off;
  const double tol = 2e-2;
  if (cs.max_recv > 0) {  // the bound is too small: every output NaN, STATUS on every rank
    {
      const Run& a = runs.first;
      bool nan = true;
      for (uint16_t v : a.y) nan &= std::isnan(decode(cs, v));
      for (uint16_t v : a.dx) nan &= std::isnan(decode(cs, v));
      for (uint16_t v : a.dwgu) nan &= std::isnan(decode(cs, v));
      const bool st = a.status[0] == MOEBLAZE_STATUS_INSUFFICIENT_WORKSPACE &&
                      a.status[1] == MOEBLAZE_STATUS_INSUFFICIENT_WORKSPACE;
      expect(nan, "overflow: every output NaN", cs.name, r, 0);
      expect(st, "overflow: STATUS INSUFFICIENT_WORKSPACE", cs.name, r, a.status[0]);
    }
    return;
  }
  {
    const Run& a = runs.first;
    const size_t n = static_cast<size_t>(cs.tokens[r] * d);
    if (n) {
      const double ey = rel16(cs, a.y.data(), ref.y.data() + off[r] * d, n);
      const double ex = rel16(cs, a.dx.data(), ref.dx.data() + off[r] * d, n);
      expect(ey < tol, "y vs single GPU", cs.name, r, ey);
      expect(ex < tol, "dx vs single GPU", cs.name, r, ex);
    }
    if (cs.mask) {  // a masked token: y and dx rows exactly 0
      int64_t masked = 0, nonzero = 0;
      for (int64_t t = 0; t < cs.tokens[r]; ++t) {
        if (pb.all.mask[off[r] + t]) continue;
        ++masked;
        for (int64_t c = 0; c < d; ++c) nonzero += decode(cs, a.y[t * d + c]) != 0.f || decode(cs, a.dx[t * d + c]) != 0.f;
      }
      expect(nonzero == 0, "masked tokens: y and dx rows 0", cs.name, r, static_cast<double>(masked));
    }
    const double egu = rel16(cs, a.dwgu.data(), ref.dwgu.data() + r * El * d * gh, a.dwgu.size());
    const double ed = rel16(cs, a.dwd.data(), ref.dwd.data() + r * El * cs.h * d, a.dwd.size());
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
      if (dwg_sum)
        for (size_t i = 0; i < dwg_sum->size(); ++i) (*dwg_sum)[i] += decode(cs, a.dwg[i]);
    }
    expect(a.status[0] == 0 && a.status[1] == 0, "STATUS 0", cs.name, r, a.status[0] + a.status[1]);
    if (!cs.caller_ids && n) {
      const double ei = rel16(cs, a.y_inference.data(), ref.y_inference.data() + off[r] * d, n);
      expect(ei < tol && a.status[2] == 0, "inference y vs single GPU", cs.name, r, ei);
      // The router is the same code on the same rows: the same picks, up to near-ties of the
      // logits (the GEMM's tiling depends on the token count).
      int64_t same_ids = 0;
      double gate_err = 0;
      for (int64_t i = 0; i < cs.tokens[r] * k; ++i) {
        same_ids += a.route_ids[i] == ref.route_ids[off[r] * k + i];
        gate_err = std::max(gate_err, static_cast<double>(std::fabs(a.route_gates[i] - ref.route_gates[off[r] * k + i])));
      }
      const double frac = static_cast<double>(same_ids) / static_cast<double>(cs.tokens[r] * k);
      expect(frac > 0.99 && a.status[3] == 0, "route ids vs single GPU", cs.name, r, frac);
      expect(frac < 1 || gate_err < 1e-3, "route gates vs single GPU", cs.name, r, gate_err);
    }
    const bool same = a.y == runs.second.y && a.dx == runs.second.dx && a.dwgu == runs.second.dwgu &&
                      a.dwd == runs.second.dwd && a.dwg == runs.second.dwg && a.dgates == runs.second.dgates;
    expect(same, "bitwise equal on a second run", cs.name, r, 0);
    const Run& g = runs.graphed;
    const Run& e = runs.eager_new;
    const bool graph_same = g.y == e.y && g.dx == e.dx && g.dwgu == e.dwgu && g.dwd == e.dwd && g.dwg == e.dwg &&
                            g.dgates == e.dgates && (cs.tokens[r] == 0 || g.y != a.y);
    if (syncs(cs))
      expect(runs.refused_capture && (cs.tokens[r] == 0 || e.y != a.y), "capture refused, capture intact", cs.name, r, 0);
    else
      expect(graph_same, "graph replay on new x == eager", cs.name, r, 0);
  }
}

// The router weight's gradient summed over the ranks against the reference's.
inline void check_router_sum(const Problem& pb, const Run& ref, const std::vector<double>& dwg_sum) {
  const Case& cs = *pb.cs;
  const double tol = 2e-2;
  if (!cs.caller_ids) {
    double num = 0, den = 0;
    for (size_t i = 0; i < dwg_sum.size(); ++i) {
      const double v = decode(cs, ref.dwg[i]);
      num += (dwg_sum[i] - v) * (dwg_sum[i] - v);
      den += v * v;
    }
    const double e = std::isfinite(num) ? std::sqrt(num / std::max(den, 1e-30)) : INFINITY;
    expect(e < tol, "dW_router (sum over ranks)", cs.name, -1, e);
  }
}

}  // namespace ep_test
