/* Hostile input on the CUDA engine: saved buffers that forward did not write are rejected before any
 * index in them is followed; a stream capture is refused before anything is enqueued and stays
 * valid (route, which does not sync, is captured and replays to the eager bits); size queries
 * give the same answer before, during and after a capture; non-finite router logits pick the
 * same experts as the CPU engine. Exits 77 (skipped) without a GPU. */
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <setjmp.h>
#include <cmocka.h>

#include <cuda_runtime.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "moe_step_cuda.h"
#include "test_util.h"

#define CUDA_OK(call)                                                                  \
  do {                                                                                 \
    cudaError_t e_ = (call);                                                           \
    if (e_ != cudaSuccess) fail_msg("%s: %s", #call, cudaGetErrorString(e_));          \
  } while (0)

enum { L0 = 300, E0 = 16, K0 = 4, D0 = 64, H0 = 96 };

static moeblaze_status_t create_cuda(int64_t L, int64_t E, int64_t k, int64_t score_fn, moeblaze_handle_t* out) {
  tu_layer l = tu_layer_default(E, k, D0, H0, L, MOEBLAZE_ACTIVATION_SWIGLU);
  l.score_fn = score_fn;
  return tu_create_on(&l, MOEBLAZE_DEVICE_CUDA, out);
}

static int have_gpu(void) {
  int n = 0;
  return cudaGetDeviceCount(&n) == cudaSuccess && n > 0;
}

typedef struct gpu_fixture {
  moeblaze_handle_t h;
  ms_problem p;
  ms_mirror m;
  moeblaze_arg_t f[10], b[12];
  size_t nf, nb;
  cudaStream_t s;
} gpu_fixture;

static int setup(void** state) {
  gpu_fixture* g = calloc(1, sizeof *g);
  if (create_cuda(L0, E0, K0, MOEBLAZE_SCORE_SOFTMAX, &g->h)) return -1;
  ms_init(&g->p, g->h, L0, E0, K0, D0, H0, 1, tu_fresh_seed("gpu_hardening"));
  if (ms_mirror_create(&g->p, &g->m)) return -1;
  g->nf = ms_forward_args(&g->p, g->f);
  g->nb = ms_backward_args(&g->p, g->b);
  ms_mirror_args(&g->m, g->f, g->nf);
  ms_mirror_args(&g->m, g->b, g->nb);
  if (cudaStreamCreateWithFlags(&g->s, cudaStreamNonBlocking) != cudaSuccess) return -1;
  *state = g;
  return 0;
}
static int teardown(void** state) {
  gpu_fixture* g = *state;
  cudaStreamDestroy(g->s);
  ms_mirror_free(&g->m);
  ms_free(&g->p);
  moeblaze_destroy(g->h);
  free(g);
  return 0;
}

static void* ws(gpu_fixture* g) { return ms_mirror_of(&g->m, g->p.ws); }
static void* saved(gpu_fixture* g) { return ms_mirror_of(&g->m, g->p.saved); }
static moeblaze_status_t fwd(gpu_fixture* g) {
  return moeblaze_forward(g->h, MOEBLAZE_PASS_FORWARD_TRAINING, g->f, g->nf, ws(g), g->p.ws_bytes, saved(g), g->p.saved_bytes, g->s);
}
static moeblaze_status_t bwd(gpu_fixture* g) {
  return moeblaze_backward(g->h, g->b, g->nb, saved(g), g->p.saved_bytes, ws(g), g->p.ws_bytes, g->s);
}

/* Backward rejects the saved buffer, and dx (poisoned with 0x3c) stays untouched. */
static void expect_rejected(gpu_fixture* g, const char* what) {
  const size_t dxb = (size_t)(L0 * D0) * 4;
  void* dx = ms_mirror_of(&g->m, g->p.dx);
  CUDA_OK(cudaStreamSynchronize(g->s)); /* g->s does not order with the legacy stream's copies */
  CUDA_OK(cudaMemset(dx, 0x3c, dxb));
  const moeblaze_status_t s = bwd(g);
  if (s != MOEBLAZE_STATUS_INVALID_ARGUMENT)
    fail_msg("%s: backward returned %s (%s)", what, moeblaze_status_name(s), moeblaze_get_last_error_message());
  CUDA_OK(cudaStreamSynchronize(g->s));
  unsigned char* host = malloc(dxb);
  CUDA_OK(cudaMemcpy(host, dx, dxb, cudaMemcpyDeviceToHost));
  for (size_t i = 0; i < dxb; ++i)
    if (host[i] != 0x3c) fail_msg("%s: dx byte %zu was written", what, i);
  free(host);
  assert_true(ms_mirror_guards_intact(&g->m));
}

static void garbage_saved_buffers(void** state) {
  if (!have_gpu()) skip();
  gpu_fixture* g = *state;
  CUDA_OK(cudaMemset(saved(g), 0, g->p.saved_bytes));
  expect_rejected(g, "zeroed");
  CUDA_OK(cudaMemset(saved(g), 0xff, g->p.saved_bytes));
  expect_rejected(g, "0xFF");
  tu_rng r;
  tu_rng_seed(&r, tu_fresh_seed("gpu_garbage"));
  unsigned char* junk = malloc(g->p.saved_bytes);
  for (int rep = 0; rep < 5; ++rep) {
    for (size_t i = 0; i < g->p.saved_bytes; ++i) junk[i] = (unsigned char)tu_rng_next(&r);
    CUDA_OK(cudaMemcpy(saved(g), junk, g->p.saved_bytes, cudaMemcpyHostToDevice));
    expect_rejected(g, "random bytes");
  }
  /* a valid header over a corrupted plan: one entry of each index list in turn */
  const size_t R = ((size_t)L0 * K0 * 4 + 255) / 256 * 256;
  const size_t at[4] = {256 + 7 * 4, 256 + 2 * R + 5 * 4, 256 + 3 * R + 11 * 4, 256 + 4 * R + 3 * 4};
  const int32_t bad[4] = {E0 + 3, -9, L0 * K0 + 1, 1 << 29};
  for (int c = 0; c < 4; ++c) {
    assert_ok(fwd(g));
    CUDA_OK(cudaMemcpyAsync((char*)saved(g) + at[c], &bad[c], 4, cudaMemcpyHostToDevice, g->s));
    expect_rejected(g, "corrupted plan");
  }
  /* a valid buffer still works, and STATUS (device I32) reads 0 after it; flipping one header
   * byte does not work, and a rejected call leaves STATUS alone */
  int32_t* d_status;
  CUDA_OK(cudaMalloc((void**)&d_status, 4));
  CUDA_OK(cudaMemset(d_status, 0x5a, 4));
  g->f[g->nf] = tu_arg(MOEBLAZE_ARG_STATUS, tu_tensor(d_status, tu_i32, 0, NULL));
  g->f[g->nf].tensor.device.device_type = MOEBLAZE_DEVICE_CUDA;
  g->b[g->nb++] = g->f[g->nf++];
  assert_ok(fwd(g));
  CUDA_OK(cudaStreamSynchronize(g->s));
  int32_t hs = -1;
  CUDA_OK(cudaMemcpy(&hs, d_status, 4, cudaMemcpyDeviceToHost));
  assert_int_equal(hs, 0);
  CUDA_OK(cudaMemset(d_status, 0x5a, 4));
  assert_ok(bwd(g));
  CUDA_OK(cudaStreamSynchronize(g->s));
  CUDA_OK(cudaMemcpy(&hs, d_status, 4, cudaMemcpyDeviceToHost));
  assert_int_equal(hs, 0);
  CUDA_OK(cudaMemset(d_status, 0x5a, 4));
  CUDA_OK(cudaStreamSynchronize(g->s));
  unsigned char b;
  CUDA_OK(cudaMemcpy(&b, (char*)saved(g) + 9, 1, cudaMemcpyDeviceToHost));
  b ^= 1;
  CUDA_OK(cudaMemcpy((char*)saved(g) + 9, &b, 1, cudaMemcpyHostToDevice));
  expect_rejected(g, "header byte flipped");
  CUDA_OK(cudaMemcpy(&hs, d_status, 4, cudaMemcpyDeviceToHost));
  assert_int_equal(hs, 0x5a5a5a5a);
  g->nf--;
  g->nb--;
  cudaFree(d_status);
  free(junk);
}

static void sizes(moeblaze_handle_t h, size_t out[5]) {
  for (int p = 0; p < 4; ++p) assert_ok(moeblaze_get_workspace_size(h, (moeblaze_pass_t)p, L0, &out[p]));
  assert_ok(moeblaze_get_saved_size(h, L0, &out[4]));
}

static void capture_is_refused_cleanly(void** state) {
  if (!have_gpu()) skip();
  gpu_fixture* g = *state;
  size_t before[5], during[5], after[5];
  sizes(g->h, before);
  /* route outputs of an eager call, for the replay to match */
  ms_problem* p = &g->p;
  const int64_t sl[2] = {L0, E0}, sk[2] = {L0, K0};
  float* gates = tu_alloc(tu_f32, L0 * K0);
  void *d_ids2, *d_gates, *d_gates2, *rws;
  size_t rws_bytes;
  assert_ok(moeblaze_get_workspace_size(g->h, MOEBLAZE_PASS_ROUTE, L0, &rws_bytes));
  CUDA_OK(cudaMalloc(&d_ids2, L0 * K0 * 4));
  CUDA_OK(cudaMalloc(&d_gates, L0 * K0 * 4));
  CUDA_OK(cudaMalloc(&d_gates2, L0 * K0 * 4));
  CUDA_OK(cudaMalloc(&rws, rws_bytes));
  moeblaze_arg_t r[3] = {tu_arg(MOEBLAZE_ARG_ROUTER_LOGITS, tu_tensor(p->logits, tu_f32, 2, sl)),
                         tu_arg(MOEBLAZE_ARG_TOPK_INDICES, tu_tensor(p->ids, tu_i32, 2, sk)),
                         tu_arg(MOEBLAZE_ARG_TOPK_WEIGHTS, tu_tensor(gates, tu_f32, 2, sk))};
  ms_mirror_args(&g->m, r, 3);
  r[2].tensor.data = d_gates;
  r[2].tensor.device.device_type = MOEBLAZE_DEVICE_CUDA;

  cudaGraph_t graph = NULL;
  CUDA_OK(cudaStreamBeginCapture(g->s, cudaStreamCaptureModeGlobal));
  assert_status(fwd(g), MOEBLAZE_STATUS_NOT_SUPPORTED);
  assert_non_null(strstr(moeblaze_get_last_error_message(), "capture"));
  assert_status(bwd(g), MOEBLAZE_STATUS_NOT_SUPPORTED);
  sizes(g->h, during);
  moeblaze_arg_t rc[3];
  memcpy(rc, r, sizeof rc);
  rc[1].tensor.data = d_ids2;
  rc[2].tensor.data = d_gates2;
  assert_ok(moeblaze_route(g->h, rc, 3, rws, rws_bytes, g->s)); /* route has no sync: captured */
  CUDA_OK(cudaStreamEndCapture(g->s, &graph));                  /* the capture is still valid */
  cudaGraphExec_t exec = NULL;
  CUDA_OK(cudaGraphInstantiate(&exec, graph, 0));
  sizes(g->h, after);
  assert_memory_equal(before, during, sizeof before);
  assert_memory_equal(before, after, sizeof before);

  /* the graph, replayed on new logits, gives the eager route's bits */
  tu_rng rng;
  tu_rng_seed(&rng, tu_fresh_seed("capture_route"));
  for (int rep = 0; rep < 3; ++rep) {
    tu_fill_normal(&rng, p->logits, tu_f32, L0 * E0, 2.0);
    CUDA_OK(cudaMemcpy(ms_mirror_of(&g->m, p->logits), p->logits, L0 * E0 * 4, cudaMemcpyHostToDevice));
    CUDA_OK(cudaGraphLaunch(exec, g->s));
    assert_ok(moeblaze_route(g->h, r, 3, rws, rws_bytes, g->s));
    CUDA_OK(cudaStreamSynchronize(g->s));
    int32_t a[L0 * K0], b[L0 * K0];
    float ga[L0 * K0], gb[L0 * K0];
    CUDA_OK(cudaMemcpy(a, ms_mirror_of(&g->m, p->ids), sizeof a, cudaMemcpyDeviceToHost));
    CUDA_OK(cudaMemcpy(b, d_ids2, sizeof b, cudaMemcpyDeviceToHost));
    CUDA_OK(cudaMemcpy(ga, d_gates, sizeof ga, cudaMemcpyDeviceToHost));
    CUDA_OK(cudaMemcpy(gb, d_gates2, sizeof gb, cudaMemcpyDeviceToHost));
    assert_memory_equal(a, b, sizeof a);
    assert_memory_equal(ga, gb, sizeof ga);
  }
  /* ordinary calls on the same handle still work with the workspace the query gave */
  assert_ok(fwd(g));
  assert_ok(bwd(g));
  CUDA_OK(cudaStreamSynchronize(g->s));
  cudaGraphExecDestroy(exec);
  cudaGraphDestroy(graph);
  cudaFree(d_ids2); cudaFree(d_gates); cudaFree(d_gates2); cudaFree(rws);
  tu_free(gates);
}

/* The CPU engine's ranking rule, bit for bit, on logits full of NaN and infinities. */
static void non_finite_logits_match_cpu(void** state) {
  (void)state;
  if (!have_gpu()) skip();
  enum { L = 512, E = 40, K = 6 };
  tu_rng r;
  tu_rng_seed(&r, tu_fresh_seed("gpu_nonfinite"));
  float* logits = tu_alloc(tu_f32, L * E);
  const float specials[4] = {NAN, INFINITY, -INFINITY, 0.f};
  for (int fn = 0; fn < 2; ++fn) {
    for (int i = 0; i < L * E; ++i) {
      const double u = tu_rng_uniform(&r);
      logits[i] = u < 0.05 ? specials[tu_rng_below(&r, 4)] : (float)tu_rng_normal(&r);
    }
    for (int e = 0; e < E; ++e) logits[3 * E + e] = NAN;        /* an all-NaN row */
    for (int e = 0; e < E; ++e) logits[4 * E + e] = -INFINITY;  /* an all -inf row */
    int32_t ids[2][L * K], tpe[2][E];
    for (int dev = 0; dev < 2; ++dev) {
      moeblaze_handle_t h = NULL;
      if (dev) {
        assert_ok(create_cuda(L, E, K, fn ? MOEBLAZE_SCORE_SIGMOID : MOEBLAZE_SCORE_SOFTMAX, &h));
      } else {
        tu_layer l = tu_layer_default(E, K, D0, H0, L, MOEBLAZE_ACTIVATION_SWIGLU);
        l.score_fn = fn ? MOEBLAZE_SCORE_SIGMOID : MOEBLAZE_SCORE_SOFTMAX;
        assert_ok(tu_create_cpu(&l, &h));
      }
      const int64_t sl[2] = {L, E}, sk[2] = {L, K}, se[1] = {E};
      size_t wsb;
      assert_ok(moeblaze_get_workspace_size(h, MOEBLAZE_PASS_ROUTE, L, &wsb));
      void *dl = logits, *di = ids[dev], *dt = tpe[dev], *w = NULL;
      if (dev) {
        CUDA_OK(cudaMalloc(&dl, L * E * 4)); CUDA_OK(cudaMalloc(&di, sizeof ids[0]));
        CUDA_OK(cudaMalloc(&dt, sizeof tpe[0])); CUDA_OK(cudaMalloc(&w, wsb));
        CUDA_OK(cudaMemcpy(dl, logits, L * E * 4, cudaMemcpyHostToDevice));
      } else {
        w = tu_alloc_bytes(wsb);
      }
      moeblaze_arg_t a[3] = {tu_arg(MOEBLAZE_ARG_ROUTER_LOGITS, tu_tensor(dl, tu_f32, 2, sl)),
                             tu_arg(MOEBLAZE_ARG_TOPK_INDICES, tu_tensor(di, tu_i32, 2, sk)),
                             tu_arg(MOEBLAZE_ARG_TOKENS_PER_EXPERT, tu_tensor(dt, tu_i32, 1, se))};
      for (int i = 0; i < 3 && dev; ++i) a[i].tensor.device.device_type = MOEBLAZE_DEVICE_CUDA;
      /* route needs TOPK_WEIGHTS too */
      void* gw = dev ? NULL : tu_alloc(tu_f32, L * K);
      if (dev) CUDA_OK(cudaMalloc(&gw, L * K * 4));
      moeblaze_arg_t all[4] = {a[0], a[1], a[2], tu_arg(MOEBLAZE_ARG_TOPK_WEIGHTS, tu_tensor(gw, tu_f32, 2, sk))};
      if (dev) all[3].tensor.device.device_type = MOEBLAZE_DEVICE_CUDA;
      assert_ok(moeblaze_route(h, all, 4, w, wsb, NULL));
      if (dev) {
        CUDA_OK(cudaDeviceSynchronize());
        CUDA_OK(cudaMemcpy(ids[1], di, sizeof ids[1], cudaMemcpyDeviceToHost));
        CUDA_OK(cudaMemcpy(tpe[1], dt, sizeof tpe[1], cudaMemcpyDeviceToHost));
        cudaFree(dl); cudaFree(di); cudaFree(dt); cudaFree(w); cudaFree(gw);
      } else {
        tu_free(w);
        tu_free(gw);
      }
      moeblaze_destroy(h);
    }
    int64_t total = 0;
    for (int e = 0; e < E; ++e) total += tpe[1][e];
    assert_int_equal(total, L * K);
    for (int i = 0; i < L * K; ++i)
      if (ids[0][i] != ids[1][i])
        fail_msg("%s: token %d pick %d: GPU %d, CPU %d", fn ? "sigmoid" : "softmax", i / K, i % K, ids[1][i], ids[0][i]);
    assert_memory_equal(tpe[0], tpe[1], sizeof tpe[0]);
  }
  tu_free(logits);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test_setup_teardown(garbage_saved_buffers, setup, teardown),
      cmocka_unit_test_setup_teardown(capture_is_refused_cleanly, setup, teardown),
      cmocka_unit_test(non_finite_logits_match_cpu),
  };
  if (!have_gpu()) {
    printf("no CUDA device: skipped\n");
    return 77;
  }
  return cmocka_run_group_tests(tests, NULL, NULL);
}
