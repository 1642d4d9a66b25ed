// perf/ep-bench: the expert-parallel layer's weak scaling on one host. For each shape, tokens per
// rank fixed: the single-GPU layer with all experts (EP 1), then the EP layer over 2, 4, ... of
// the host's GPUs (one thread and one communicator rank each). Bf16, SwiGLU, routing by a random
// router weight (near-uniform), fwd+bwd with dx, the expert weights' and the router weight's
// gradients. Per P: the median step time of the slowest rank, TFLOP/s per GPU, and the
// weak-scaling efficiency (EP-1 time / EP-P time). EP_BENCH_HOST=1 also times each P > 1 on the
// HOST transport (grouped ncclSend/ncclRecv, a host synchronisation per pass).
// Usage: ep-bench [tokens per rank, default 16384] [iterations, default 20] [shape names...]
#include <cuda_runtime.h>
#include <nccl.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include "moeblaze/moeblaze.h"

namespace {

#define CK(call)                                                                                 \
  do {                                                                                           \
    cudaError_t e_ = (call);                                                                     \
    if (e_ != cudaSuccess) {                                                                     \
      std::fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #call, cudaGetErrorString(e_)); \
      std::exit(1);                                                                              \
    }                                                                                            \
  } while (0)
#define MB(call)                                                                                       \
  do {                                                                                                 \
    moeblaze_status_t s_ = (call);                                                                     \
    if (s_ != MOEBLAZE_STATUS_SUCCESS) {                                                               \
      std::fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #call, moeblaze_get_last_error_message()); \
      std::exit(1);                                                                                    \
    }                                                                                                  \
  } while (0)

struct Shape {
  const char* name;
  int64_t d, h, E, k;
};
const Shape kShapes[] = {
    {"qwen3-30b-a3b", 2048, 768, 128, 8},
    {"olmoe", 2048, 1024, 64, 8},
    {"deepseek-v3", 7168, 2048, 256, 8},
    {"mixtral", 4096, 14336, 8, 2},
};

const moeblaze_dtype_t kBf16 = {MOEBLAZE_DTYPE_CODE_BFLOAT, 16, 1};

// Deterministic pseudo-random bf16 in [-scale, scale).
__global__ void fill_kernel(uint16_t* p, size_t n, uint32_t seed, float scale) {
  for (size_t i = blockIdx.x * static_cast<size_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<size_t>(gridDim.x) * blockDim.x) {
    uint32_t x = static_cast<uint32_t>(i) * 2654435761u ^ seed;
    x ^= x >> 15;
    x *= 2246822519u;
    x ^= x >> 13;
    const float v = (static_cast<float>(x & 0xffffff) / 16777216.f * 2.f - 1.f) * scale;
    p[i] = static_cast<uint16_t>(__float_as_uint(v) >> 16);
  }
}

void* filled(size_t n, uint32_t seed, float scale) {
  void* p = nullptr;
  CK(cudaMalloc(&p, std::max<size_t>(n * 2, 16)));
  fill_kernel<<<1024, 256>>>(static_cast<uint16_t*>(p), n, seed, scale);
  CK(cudaGetLastError());
  return p;
}

struct Dims {
  int64_t s[12][3];
  int n = 0;
};
moeblaze_arg_t arg(int32_t kind, void* p, Dims& dm, int64_t a, int64_t b, int64_t c = -1) {
  moeblaze_arg_t r;
  std::memset(&r, 0, sizeof r);
  r.kind = kind;
  int64_t* s = dm.s[dm.n++];
  s[0] = a, s[1] = b, s[2] = c;
  r.tensor.data = p;
  r.tensor.device.device_type = MOEBLAZE_DEVICE_CUDA;
  CK(cudaGetDevice(&r.tensor.device.device_id));
  r.tensor.ndim = c >= 0 ? 3 : 2;
  r.tensor.dtype = kBf16;
  r.tensor.shape = s;
  return r;
}

// One rank's layer (or the single-GPU one): buffers, and the median fwd+bwd time in ms.
double run_layer(moeblaze_handle_t h, const Shape& sh, int64_t L, int64_t experts, int iters, cudaStream_t s,
                 uint32_t seed) {
  const int64_t d = sh.d, gh = 2 * sh.h;
  void* x = filled(static_cast<size_t>(L * d), seed + 1, 1.f);
  void* dy = filled(static_cast<size_t>(L * d), seed + 2, 1.f);
  void* wgu = filled(static_cast<size_t>(experts * d * gh), seed + 3, 0.02f);
  void* wd = filled(static_cast<size_t>(experts * sh.h * d), seed + 4, 0.02f);
  void* wg = filled(static_cast<size_t>(sh.E * d), 77, 0.05f);  // the same router on every rank
  void *y, *dx, *dwgu, *dwd, *dwg, *wsf, *wsb, *saved;
  CK(cudaMalloc(&y, L * d * 2));
  CK(cudaMalloc(&dx, L * d * 2));
  CK(cudaMalloc(&dwgu, experts * d * gh * 2));
  CK(cudaMalloc(&dwd, experts * sh.h * d * 2));
  CK(cudaMalloc(&dwg, sh.E * d * 2));
  size_t bf = 0, bb = 0, bs = 0;
  MB(moeblaze_get_workspace_size(h, MOEBLAZE_PASS_FORWARD_TRAINING, L, &bf));
  MB(moeblaze_get_workspace_size(h, MOEBLAZE_PASS_BACKWARD, L, &bb));
  MB(moeblaze_get_saved_size(h, L, &bs));
  CK(cudaMalloc(&wsf, bf));
  CK(cudaMalloc(&wsb, bb));
  CK(cudaMalloc(&saved, bs));
  CK(cudaDeviceSynchronize());
  auto step = [&] {
    Dims df;
    moeblaze_arg_t f[] = {arg(MOEBLAZE_ARG_INPUT, x, df, L, d), arg(MOEBLAZE_ARG_ROUTER_WEIGHT, wg, df, sh.E, d),
                          arg(MOEBLAZE_ARG_W_GATE_UP, wgu, df, experts, d, gh),
                          arg(MOEBLAZE_ARG_W_DOWN, wd, df, experts, sh.h, d), arg(MOEBLAZE_ARG_OUTPUT, y, df, L, d)};
    MB(moeblaze_forward(h, MOEBLAZE_PASS_FORWARD_TRAINING, f, 5, wsf, bf, saved, bs, s));
    Dims db;
    moeblaze_arg_t b[] = {arg(MOEBLAZE_ARG_INPUT, x, db, L, d), arg(MOEBLAZE_ARG_ROUTER_WEIGHT, wg, db, sh.E, d),
                          arg(MOEBLAZE_ARG_W_GATE_UP, wgu, db, experts, d, gh),
                          arg(MOEBLAZE_ARG_W_DOWN, wd, db, experts, sh.h, d), arg(MOEBLAZE_ARG_GRAD_OUTPUT, dy, db, L, d),
                          arg(MOEBLAZE_ARG_GRAD_INPUT, dx, db, L, d),
                          arg(MOEBLAZE_ARG_GRAD_W_GATE_UP, dwgu, db, experts, d, gh),
                          arg(MOEBLAZE_ARG_GRAD_W_DOWN, dwd, db, experts, sh.h, d),
                          arg(MOEBLAZE_ARG_GRAD_ROUTER_WEIGHT, dwg, db, sh.E, d)};
    MB(moeblaze_backward(h, b, 9, saved, bs, wsb, bb, s));
  };
  for (int i = 0; i < 3; ++i) step();
  std::vector<float> ms(static_cast<size_t>(iters));
  cudaEvent_t a, z;
  CK(cudaEventCreate(&a));
  CK(cudaEventCreate(&z));
  for (int i = 0; i < iters; ++i) {
    CK(cudaEventRecord(a, s));
    step();
    CK(cudaEventRecord(z, s));
    CK(cudaEventSynchronize(z));
    CK(cudaEventElapsedTime(&ms[static_cast<size_t>(i)], a, z));
  }
  std::sort(ms.begin(), ms.end());
  for (void* p : {x, dy, wgu, wd, wg, y, dx, dwgu, dwd, dwg, wsf, wsb, saved}) cudaFree(p);
  cudaEventDestroy(a);
  cudaEventDestroy(z);
  return ms[ms.size() / 2];
}

moeblaze_config_t config(const Shape& sh, int64_t L, int device, int64_t transport = MOEBLAZE_EP_TRANSPORT_AUTO) {
  moeblaze_config_t c = nullptr;
  MB(moeblaze_config_create(&c));
  MB(moeblaze_config_set_i64(c, MOEBLAZE_ATTR_NUM_EXPERTS, sh.E));
  MB(moeblaze_config_set_i64(c, MOEBLAZE_ATTR_TOP_K, sh.k));
  MB(moeblaze_config_set_i64(c, MOEBLAZE_ATTR_HIDDEN_SIZE, sh.d));
  MB(moeblaze_config_set_i64(c, MOEBLAZE_ATTR_FFN_HIDDEN_SIZE, sh.h));
  MB(moeblaze_config_set_i64(c, MOEBLAZE_ATTR_MAX_TOKENS, L));
  MB(moeblaze_config_set_i64(c, MOEBLAZE_ATTR_NORMALIZE_TOPK, 1));
  MB(moeblaze_config_set_i64(c, MOEBLAZE_ATTR_DEVICE_ID, device));
  MB(moeblaze_config_set_i64(c, MOEBLAZE_ATTR_EP_TRANSPORT, transport));
  return c;
}

}  // namespace

int main(int argc, char** argv) {
  std::setvbuf(stdout, nullptr, _IONBF, 0);
  const int64_t L = argc > 1 ? std::atoll(argv[1]) : 16384;
  const int iters = argc > 2 ? std::atoi(argv[2]) : 20;
  int gpus = 0;
  CK(cudaGetDeviceCount(&gpus));
  std::vector<int> sizes = {1};
  for (int p = 2; p <= gpus; p *= 2) sizes.push_back(p);
  std::printf("ep-bench: %d GPUs, %lld tokens per rank, median of %d fwd+bwd steps (bf16, SwiGLU, router weight)\n\n",
              gpus, static_cast<long long>(L), iters);
  const bool with_host = std::getenv("EP_BENCH_HOST") && std::atoi(std::getenv("EP_BENCH_HOST"));
  std::printf("| shape (d, h, E, k) | P | transport | fwd+bwd ms (slowest rank) | TFLOP/s per GPU | weak-scaling efficiency |\n");
  std::printf("|---|---|---|---|---|---|\n");
  for (const Shape& sh : kShapes) {
    bool wanted = argc <= 3;
    for (int a = 3; a < argc; ++a) wanted |= std::strcmp(argv[a], sh.name) == 0;
    if (!wanted) continue;
    const double flops = 18.0 * static_cast<double>(L) * sh.k * sh.d * sh.h;  // per rank: its tokens' GEMMs
    double base = 0;
    for (int run = 0; run < 2 * static_cast<int>(sizes.size()); ++run) {
      const int P = sizes[static_cast<size_t>(run / 2)];
      const bool host = run % 2 == 1;
      if (host && (P == 1 || !with_host)) continue;
      std::vector<double> ms(static_cast<size_t>(P));
      if (P == 1) {
        CK(cudaSetDevice(0));
        moeblaze_config_t c = config(sh, L, 0);
        moeblaze_handle_t h = nullptr;
        MB(moeblaze_create(&h, c));
        moeblaze_config_destroy(c);
        ms[0] = run_layer(h, sh, L, sh.E, iters, nullptr, 11);
        moeblaze_destroy(h);
        base = ms[0];
      } else {
        std::vector<ncclComm_t> comms(static_cast<size_t>(P));
        std::vector<int> devs(static_cast<size_t>(P));
        for (int i = 0; i < P; ++i) devs[static_cast<size_t>(i)] = i;
        if (ncclCommInitAll(comms.data(), P, devs.data()) != ncclSuccess) {
          std::fprintf(stderr, "ncclCommInitAll failed\n");
          return 1;
        }
        std::vector<std::thread> th;
        for (int r = 0; r < P; ++r)
          th.emplace_back([&, r] {
            CK(cudaSetDevice(r));
            cudaStream_t s;
            CK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
            moeblaze_config_t c =
                config(sh, L, r, host ? MOEBLAZE_EP_TRANSPORT_HOST : MOEBLAZE_EP_TRANSPORT_AUTO);
            moeblaze_handle_t h = nullptr;
            MB(moeblaze_create_ep(&h, c, comms[static_cast<size_t>(r)], s));
            moeblaze_config_destroy(c);
            ms[static_cast<size_t>(r)] = run_layer(h, sh, L, sh.E / P, iters, s, 11 + 100 * static_cast<uint32_t>(r));
            moeblaze_destroy(h);
            CK(cudaStreamDestroy(s));
          });
        for (auto& t : th) t.join();
        for (ncclComm_t c : comms) ncclCommDestroy(c);
      }
      const double worst = *std::max_element(ms.begin(), ms.end());
      std::printf("| %s (%lld, %lld, %lld, %lld) | %d | %s | %.3f | %.1f | %.1f%% |\n", sh.name,
                  static_cast<long long>(sh.d), static_cast<long long>(sh.h), static_cast<long long>(sh.E),
                  static_cast<long long>(sh.k), P, P == 1 ? "-" : host ? "HOST" : "NVLink", worst,
                  flops / (worst * 1e-3) / 1e12, 100.0 * base / worst);
    }
  }
  return 0;
}
