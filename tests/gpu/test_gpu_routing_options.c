/* The routing options (docs/routing.md) on the CUDA engines against the CPU engine, on fresh
 * random inputs with every GPU output poisoned first: the expert score bias, group-limited
 * top-k, the route scale and the sequence-wise balance loss, for softmax and sigmoid scores,
 * E from 8 to 384 (every lane layout of the router kernels), groups of one to 32 experts.
 *  - AUX_LOSS_FORM = HUGGING_FACE against the CPU engine;
 *  - a loss whose coefficient is 0 reads exactly 0 on both engines, NaN logits included;
 *  - the picked ids equal the CPU engine's bit for bit, including logits quantised to force
 *    ties and rows of NaN and infinities; the gates, AUX_LOSS, y, dx, d logits and the expert
 *    gradients agree within the dtype's tolerance; two GPU runs give the same bits;
 *  - the fused engine captures forward and backward with every option in a CUDA graph, and a
 *    replay equals the eager run's bits;
 *  - TOKEN_MASK against the same call on the unmasked tokens alone (token_mask), and against
 *    the CPU engine, alone and with SEQUENCE_LENGTHS (sequences wholly masked among them);
 *  - bad input: SEQUENCE_LENGTHS that do not sum to L (cuBLASLt: INVALID_ARGUMENT before any
 *    output; fused: STATUS = INVALID_ARGUMENT, y and AUX_LOSS NaN), more sequences than tokens,
 *    a bias of the wrong size, and more expert groups than the GPU router takes.
 * Exits 77 (skipped) without a GPU. */
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

#include "test_util.h"

#define CUDA_OK(call)                                                         \
  do {                                                                        \
    cudaError_t e_ = (call);                                                  \
    if (e_ != cudaSuccess) fail_msg("%s: %s", #call, cudaGetErrorString(e_)); \
  } while (0)

static void assert_ok_msg(moeblaze_status_t s, const char* what) {
  if (s != MOEBLAZE_STATUS_SUCCESS) fail_msg("%s: status %d: %s", what, (int)s, moeblaze_get_last_error_message());
}

typedef struct rcase {
  int64_t E, k, groups, keep, score_fn, normalize, L;
  double scale, aux, z;  /* ROUTE_SCALE, AUX_LOSS_COEFF, Z_LOSS_COEFF */
  int bias;      /* an expert score bias */
  int seqs;      /* SEQUENCE_LENGTHS: this many sequences of random lengths (0: none) */
  int ties;      /* logits rounded to multiples of 1/4, and a bias of a few values: exact ties */
  int specials;  /* a few NaN and infinite logits, an all-NaN row */
  int64_t form;  /* AUX_LOSS_FORM */
  int mask;      /* a TOKEN_MASK (set by the mask test) */
} rcase;

enum { D = 64, H = 32, GUARD = 64 };

/* One buffer of a step: host bytes and, for a CUDA handle, a device copy. */
typedef struct buf {
  void* host;
  void* dev;
  size_t bytes;
} buf;

typedef struct problem {
  rcase c;
  int64_t B;
  buf x, wgu, wd, logits, bias, lens, dy, mask;               /* inputs */
  buf y, ids, gates, aux, z, dx, dwgu, dwd, dlogits, status;  /* outputs */
  int64_t sx[2], sgu[3], sd[3], sl[2], se[1], sb[1], sk[2], sm[1];
} problem;

static buf* inputs(problem* p, int i) {
  buf* all[] = {&p->x, &p->wgu, &p->wd, &p->logits, &p->bias, &p->lens, &p->dy, &p->mask};
  return i < 8 ? all[i] : NULL;
}
static buf* outputs(problem* p, int i) {
  buf* all[] = {&p->y, &p->ids, &p->gates, &p->aux, &p->z, &p->dx, &p->dwgu, &p->dwd, &p->dlogits, &p->status};
  return i < 10 ? all[i] : NULL;
}

static void alloc_buf(buf* b, size_t bytes) {
  b->bytes = bytes;
  b->host = tu_alloc_bytes(bytes + GUARD);
  b->dev = NULL;
}

static void fill_bf16(tu_rng* r, buf* b, size_t n, double scale) { tu_fill_normal(r, b->host, tu_bf16, n, scale); }

static void make_problem(problem* p, const rcase* c, tu_rng* r) {
  memset(p, 0, sizeof *p);
  p->c = *c;
  const int64_t L = c->L, E = c->E, k = c->k;
  alloc_buf(&p->x, (size_t)(L * D) * 2);
  alloc_buf(&p->wgu, (size_t)(E * D * 2 * H) * 2);
  alloc_buf(&p->wd, (size_t)(E * H * D) * 2);
  alloc_buf(&p->logits, (size_t)(L * E) * 4);
  alloc_buf(&p->bias, (size_t)E * 4);
  alloc_buf(&p->dy, (size_t)(L * D) * 2);
  fill_bf16(r, &p->x, (size_t)(L * D), 1.0);
  fill_bf16(r, &p->wgu, (size_t)(E * D * 2 * H), 0.125);
  fill_bf16(r, &p->wd, (size_t)(E * H * D), 0.125);
  fill_bf16(r, &p->dy, (size_t)(L * D), 1.0);
  float* l = p->logits.host;
  for (int64_t i = 0; i < L * E; ++i) {
    const double v = 2.0 * tu_rng_normal(r);
    l[i] = c->ties ? (float)(floor(v * 4.0) / 4.0) : (float)v;
  }
  if (c->specials) {
    const float sp[3] = {NAN, INFINITY, -INFINITY};
    for (int64_t i = 0; i < L * E; ++i)
      if (tu_rng_uniform(r) < 0.02) l[i] = sp[tu_rng_below(r, 3)];
    for (int64_t e = 0; e < E; ++e) l[E + e] = NAN;
  }
  float* b = p->bias.host;
  for (int64_t e = 0; e < E; ++e)
    b[e] = c->ties ? (float)(tu_rng_below(r, 3) * 0.25) : (float)(0.1 * tu_rng_normal(r));
  if (c->specials && E >= 8) {  /* a NaN, an infinite and a huge bias too */
    b[1] = NAN;
    b[3] = INFINITY;
    b[5] = -INFINITY;
    b[7] = 3e38f;
  }
  p->B = c->seqs;
  alloc_buf(&p->lens, (size_t)(p->B > 0 ? p->B : 1) * 8);
  if (p->B > 0) {  /* B random lengths >= 1 summing to L */
    int64_t* n = p->lens.host;
    for (int64_t q = 0; q < p->B; ++q) n[q] = 1;
    for (int64_t t = p->B; t < L; ++t) n[tu_rng_below(r, p->B)] += 1;
  }
  alloc_buf(&p->y, (size_t)(L * D) * 2);
  alloc_buf(&p->ids, (size_t)(L * k) * 4);
  alloc_buf(&p->gates, (size_t)(L * k) * 4);
  alloc_buf(&p->aux, 4);
  alloc_buf(&p->z, 4);
  alloc_buf(&p->mask, (size_t)(L > 0 ? L : 1) * 4);
  int32_t* m = p->mask.host;  /* about a third of the tokens masked, the last one too */
  for (int64_t t = 0; t < L; ++t) m[t] = t == L - 1 ? 0 : tu_rng_uniform(r) < 0.3 ? 0 : 1;
  alloc_buf(&p->dx, (size_t)(L * D) * 2);
  alloc_buf(&p->dwgu, p->wgu.bytes);
  alloc_buf(&p->dwd, p->wd.bytes);
  alloc_buf(&p->dlogits, p->logits.bytes);
  alloc_buf(&p->status, 4);
  p->sx[0] = L; p->sx[1] = D;
  p->sgu[0] = E; p->sgu[1] = D; p->sgu[2] = 2 * H;
  p->sd[0] = E; p->sd[1] = H; p->sd[2] = D;
  p->sl[0] = L; p->sl[1] = E;
  p->se[0] = E;
  p->sb[0] = p->B;
  p->sm[0] = L;
  p->sk[0] = L; p->sk[1] = k;
}

static void free_problem(problem* p) {
  for (int i = 0; inputs(p, i); ++i) tu_free(inputs(p, i)->host);
  for (int i = 0; outputs(p, i); ++i) tu_free(outputs(p, i)->host);
}

/* Device copies of the inputs; the outputs poisoned (NaN / INT_MIN) with guard bytes after. */
static void to_device(problem* p) {
  for (int i = 0; inputs(p, i); ++i) {
    buf* b = inputs(p, i);
    CUDA_OK(cudaMalloc(&b->dev, b->bytes));
    CUDA_OK(cudaMemcpy(b->dev, b->host, b->bytes, cudaMemcpyHostToDevice));
  }
  for (int i = 0; outputs(p, i); ++i) {
    buf* b = outputs(p, i);
    CUDA_OK(cudaMalloc(&b->dev, b->bytes + GUARD));
    CUDA_OK(cudaMemset(b->dev, 0xff, b->bytes));  /* NaN in every float dtype, -1 in ids */
    CUDA_OK(cudaMemset((char*)b->dev + b->bytes, 0xa5, GUARD));
  }
}

static void from_device(problem* p) {
  CUDA_OK(cudaDeviceSynchronize());
  for (int i = 0; outputs(p, i); ++i) {
    buf* b = outputs(p, i);
    unsigned char guard[GUARD];
    CUDA_OK(cudaMemcpy(b->host, b->dev, b->bytes, cudaMemcpyDeviceToHost));
    CUDA_OK(cudaMemcpy(guard, (char*)b->dev + b->bytes, GUARD, cudaMemcpyDeviceToHost));
    for (int g = 0; g < GUARD; ++g)
      if (guard[g] != 0xa5) fail_msg("output %d: guard byte %d overwritten", i, g);
  }
}

static void free_device(problem* p) {
  for (int i = 0; inputs(p, i); ++i) cudaFree(inputs(p, i)->dev), inputs(p, i)->dev = NULL;
  for (int i = 0; outputs(p, i); ++i) cudaFree(outputs(p, i)->dev), outputs(p, i)->dev = NULL;
}

static moeblaze_arg_t arg(int cuda, int32_t kind, buf* b, moeblaze_dtype_t t, int32_t nd, const int64_t* shape) {
  moeblaze_arg_t a = tu_arg(kind, tu_tensor(cuda ? b->dev : b->host, t, nd, shape));
  if (cuda) a.tensor.device.device_type = MOEBLAZE_DEVICE_CUDA;
  return a;
}

/* The inputs both passes take (backward accepts the bias and the mask and does not read them). */
static size_t input_args(problem* p, int cuda, moeblaze_arg_t* a) {
  size_t n = 0;
  a[n++] = arg(cuda, MOEBLAZE_ARG_INPUT, &p->x, tu_bf16, 2, p->sx);
  a[n++] = arg(cuda, MOEBLAZE_ARG_W_GATE_UP, &p->wgu, tu_bf16, 3, p->sgu);
  a[n++] = arg(cuda, MOEBLAZE_ARG_W_DOWN, &p->wd, tu_bf16, 3, p->sd);
  a[n++] = arg(cuda, MOEBLAZE_ARG_ROUTER_LOGITS, &p->logits, tu_f32, 2, p->sl);
  if (p->c.bias) a[n++] = arg(cuda, MOEBLAZE_ARG_EXPERT_BIAS, &p->bias, tu_f32, 1, p->se);
  if (p->c.seqs) a[n++] = arg(cuda, MOEBLAZE_ARG_SEQUENCE_LENGTHS, &p->lens, tu_i64, 1, p->sb);
  if (p->c.mask) a[n++] = arg(cuda, MOEBLAZE_ARG_TOKEN_MASK, &p->mask, tu_i32, 1, p->sm);
  return n;
}

static size_t forward_args(problem* p, int cuda, moeblaze_arg_t* a) {
  size_t n = input_args(p, cuda, a);
  a[n++] = arg(cuda, MOEBLAZE_ARG_OUTPUT, &p->y, tu_bf16, 2, p->sx);
  a[n++] = arg(cuda, MOEBLAZE_ARG_TOPK_INDICES, &p->ids, tu_i32, 2, p->sk);
  a[n++] = arg(cuda, MOEBLAZE_ARG_TOPK_WEIGHTS, &p->gates, tu_f32, 2, p->sk);
  a[n++] = arg(cuda, MOEBLAZE_ARG_AUX_LOSS, &p->aux, tu_f32, 0, NULL);
  a[n++] = arg(cuda, MOEBLAZE_ARG_Z_LOSS, &p->z, tu_f32, 0, NULL);
  if (cuda) a[n++] = arg(cuda, MOEBLAZE_ARG_STATUS, &p->status, tu_i32, 0, NULL);
  return n;
}

static size_t backward_args(problem* p, int cuda, moeblaze_arg_t* a) {
  size_t n = input_args(p, cuda, a);
  a[n++] = arg(cuda, MOEBLAZE_ARG_GRAD_OUTPUT, &p->dy, tu_bf16, 2, p->sx);
  a[n++] = arg(cuda, MOEBLAZE_ARG_GRAD_INPUT, &p->dx, tu_bf16, 2, p->sx);
  a[n++] = arg(cuda, MOEBLAZE_ARG_GRAD_W_GATE_UP, &p->dwgu, tu_bf16, 3, p->sgu);
  a[n++] = arg(cuda, MOEBLAZE_ARG_GRAD_W_DOWN, &p->dwd, tu_bf16, 3, p->sd);
  a[n++] = arg(cuda, MOEBLAZE_ARG_GRAD_ROUTER_LOGITS, &p->dlogits, tu_f32, 2, p->sl);
  if (cuda) a[n++] = arg(cuda, MOEBLAZE_ARG_STATUS, &p->status, tu_i32, 0, NULL);
  return n;
}

static int64_t g_engine = MOEBLAZE_ENGINE_CUDA_FUSED;

static moeblaze_status_t create(const rcase* c, int cuda, moeblaze_handle_t* h) {
  moeblaze_config_t cfg = NULL;
  moeblaze_status_t s = moeblaze_config_create(&cfg);
  if (s) return s;
  const struct { moeblaze_attr_t a; int64_t v; } i64s[] = {
      {MOEBLAZE_ATTR_DEVICE_TYPE, cuda ? MOEBLAZE_DEVICE_CUDA : MOEBLAZE_DEVICE_CPU},
      {MOEBLAZE_ATTR_NUM_EXPERTS, c->E}, {MOEBLAZE_ATTR_TOP_K, c->k}, {MOEBLAZE_ATTR_HIDDEN_SIZE, D},
      {MOEBLAZE_ATTR_FFN_HIDDEN_SIZE, H}, {MOEBLAZE_ATTR_MAX_TOKENS, c->L},
      {MOEBLAZE_ATTR_ACTIVATION, MOEBLAZE_ACTIVATION_SWIGLU}, {MOEBLAZE_ATTR_SCORE_FUNCTION, c->score_fn},
      {MOEBLAZE_ATTR_NORMALIZE_TOPK, c->normalize}, {MOEBLAZE_ATTR_NUM_EXPERT_GROUPS, c->groups},
      {MOEBLAZE_ATTR_TOPK_GROUPS, c->keep}, {MOEBLAZE_ATTR_ENGINE, cuda ? g_engine : MOEBLAZE_ENGINE_CPU},
      {MOEBLAZE_ATTR_AUX_LOSS_FORM, c->form}};
  for (size_t i = 0; i < sizeof i64s / sizeof i64s[0] && !s; ++i) s = moeblaze_config_set_i64(cfg, i64s[i].a, i64s[i].v);
  if (!s) s = moeblaze_config_set_dtype(cfg, MOEBLAZE_ATTR_ACTIVATION_DTYPE, tu_bf16);
  if (!s) s = moeblaze_config_set_dtype(cfg, MOEBLAZE_ATTR_WEIGHT_DTYPE, tu_bf16);
  if (!s) s = moeblaze_config_set_f64(cfg, MOEBLAZE_ATTR_ROUTE_SCALE, c->scale);
  if (!s) s = moeblaze_config_set_f64(cfg, MOEBLAZE_ATTR_AUX_LOSS_COEFF, c->aux);
  if (!s) s = moeblaze_config_set_f64(cfg, MOEBLAZE_ATTR_Z_LOSS_COEFF, c->z);
  *h = NULL;
  if (!s) s = moeblaze_create(h, cfg);
  moeblaze_config_destroy(cfg);
  return s;
}

typedef struct buffers {
  void *ws, *saved;
  size_t ws_bytes, saved_bytes;
} buffers;

static buffers make_buffers(moeblaze_handle_t h, int64_t L, int cuda) {
  buffers b;
  size_t wf, wb;
  assert_ok_msg(moeblaze_get_workspace_size(h, MOEBLAZE_PASS_FORWARD_TRAINING, L, &wf), "workspace size");
  assert_ok_msg(moeblaze_get_workspace_size(h, MOEBLAZE_PASS_BACKWARD, L, &wb), "workspace size");
  assert_ok_msg(moeblaze_get_saved_size(h, L, &b.saved_bytes), "saved size");
  b.ws_bytes = wf > wb ? wf : wb;
  if (cuda) {
    CUDA_OK(cudaMalloc(&b.ws, b.ws_bytes));
    CUDA_OK(cudaMalloc(&b.saved, b.saved_bytes));
  } else {
    b.ws = tu_alloc_bytes(b.ws_bytes);
    b.saved = tu_alloc_bytes(b.saved_bytes);
  }
  return b;
}

static void free_buffers(buffers* b, int cuda) {
  if (cuda) {
    cudaFree(b->ws);
    cudaFree(b->saved);
  } else {
    tu_free(b->ws);
    tu_free(b->saved);
  }
}

/* Forward (training) and backward; returns the first failing status. */
static moeblaze_status_t step(moeblaze_handle_t h, problem* p, int cuda, const buffers* b, cudaStream_t s) {
  moeblaze_arg_t fa[16], ba[16];
  const size_t nf = forward_args(p, cuda, fa), nb = backward_args(p, cuda, ba);
  moeblaze_status_t st = moeblaze_forward(h, MOEBLAZE_PASS_FORWARD_TRAINING, fa, nf, b->ws, b->ws_bytes, b->saved,
                                          b->saved_bytes, s);
  if (st) return st;
  return moeblaze_backward(h, ba, nb, b->saved, b->saved_bytes, b->ws, b->ws_bytes, s);
}

static double rel_err(const void* a, const void* b, moeblaze_dtype_t t, size_t n) {
  double* da = malloc(n * sizeof *da);
  double* db = malloc(n * sizeof *db);
  tu_to_f64(a, t, n, da);
  tu_to_f64(b, t, n, db);
  const double e = tu_rel_err(da, db, n);
  free(da);
  free(db);
  return e;
}

static void describe(char* s, size_t n, const rcase* c) {
  snprintf(s, n, "E=%lld k=%lld groups=%lld/%lld %s%s scale=%g bias=%d seqs=%d ties=%d specials=%d mask=%d form=%lld L=%lld engine=%lld",
           (long long)c->E, (long long)c->k, (long long)c->keep, (long long)c->groups,
           c->score_fn == MOEBLAZE_SCORE_SIGMOID ? "sigmoid" : "softmax", c->normalize ? " renorm" : "", c->scale,
           c->bias, c->seqs, c->ties, c->specials, c->mask, (long long)c->form, (long long)c->L, (long long)g_engine);
}

/* The picks bit for bit; with finite logits, every output within bf16's tolerance; the same
 * bits from a second GPU run. */
static void check_case(const rcase* c, tu_rng* r) {
  char what[256];
  describe(what, sizeof what, c);
  problem p;
  make_problem(&p, c, r);
  moeblaze_handle_t hc = NULL, hg = NULL;
  assert_ok_msg(create(c, 0, &hc), what);
  assert_ok_msg(create(c, 1, &hg), what);
  buffers bc = make_buffers(hc, c->L, 0), bg = make_buffers(hg, c->L, 1);
  assert_ok_msg(step(hc, &p, 0, &bc, NULL), what);
  problem cpu = p;  /* the CPU results, kept aside */
  for (int i = 0; outputs(&cpu, i); ++i) {
    buf* o = outputs(&cpu, i);
    void* copy = tu_alloc_bytes(o->bytes + GUARD);
    memcpy(copy, o->host, o->bytes);
    o->host = copy;
  }
  void* first_y = NULL;
  void* first_dl = NULL;
  for (int run = 0; run < 2; ++run) {
    to_device(&p);
    assert_ok_msg(step(hg, &p, 1, &bg, NULL), what);
    from_device(&p);
    if (*(int32_t*)p.status.host != 0) fail_msg("%s: STATUS %d", what, *(int32_t*)p.status.host);
    const int32_t* gi = p.ids.host;
    const int32_t* ci = cpu.ids.host;
    for (int64_t i = 0; i < c->L * c->k; ++i)
      if (gi[i] != ci[i])
        fail_msg("%s: token %lld pick %lld: GPU expert %d, CPU %d", what, (long long)(i / c->k), (long long)(i % c->k),
                 gi[i], ci[i]);
    if (run == 0) {
      first_y = tu_alloc_bytes(p.y.bytes);
      first_dl = tu_alloc_bytes(p.dlogits.bytes);
      memcpy(first_y, p.y.host, p.y.bytes);
      memcpy(first_dl, p.dlogits.host, p.dlogits.bytes);
    } else {
      if (memcmp(first_y, p.y.host, p.y.bytes) || memcmp(first_dl, p.dlogits.host, p.dlogits.bytes))
        fail_msg("%s: two GPU runs differ", what);
    }
    free_device(&p);
  }
  /* A loss whose coefficient is 0 reads exactly 0 on both engines, NaN logits or not. */
  const struct { const char* name; double coeff; const buf *g, *c; } zero[] = {
      {"aux loss", c->aux, &p.aux, &cpu.aux}, {"z loss", c->z, &p.z, &cpu.z}};
  for (int i = 0; i < 2; ++i)
    if (zero[i].coeff == 0.0 && (*(const float*)zero[i].g->host != 0.f || *(const float*)zero[i].c->host != 0.f))
      fail_msg("%s: %s with coefficient 0: GPU %g, CPU %g", what, zero[i].name, *(const float*)zero[i].g->host,
               *(const float*)zero[i].c->host);
  if (!c->specials) {
    const size_t Lk = (size_t)(c->L * c->k);
    const struct { const char* name; buf *g, *c; moeblaze_dtype_t t; size_t n; double tol; } cmp[] = {
        {"gates", &p.gates, &cpu.gates, tu_f32, Lk, 1e-5},
        {"aux loss", &p.aux, &cpu.aux, tu_f32, 1, 1e-4},
        {"z loss", &p.z, &cpu.z, tu_f32, 1, 1e-4},
        {"y", &p.y, &cpu.y, tu_bf16, (size_t)(c->L * D), tu_tol(tu_bf16)},
        {"dx", &p.dx, &cpu.dx, tu_bf16, (size_t)(c->L * D), tu_tol(tu_bf16)},
        {"d logits", &p.dlogits, &cpu.dlogits, tu_f32, (size_t)(c->L * c->E), tu_tol(tu_bf16)},
        {"dW_gate_up", &p.dwgu, &cpu.dwgu, tu_bf16, p.wgu.bytes / 2, tu_tol(tu_bf16)},
        {"dW_down", &p.dwd, &cpu.dwd, tu_bf16, p.wd.bytes / 2, tu_tol(tu_bf16)},
    };
    for (size_t i = 0; i < sizeof cmp / sizeof cmp[0]; ++i) {
      if (i == 1 && c->aux == 0.0) continue;
      const double e = rel_err(cmp[i].g->host, cmp[i].c->host, cmp[i].t, cmp[i].n);
      if (!(e <= cmp[i].tol)) fail_msg("%s: %s relative error %.3g > %.3g", what, cmp[i].name, e, cmp[i].tol);
    }
    if (c->seqs && c->aux > 0.0) print_message("  %s: aux %.6g (CPU %.6g)\n", what, *(float*)p.aux.host, *(float*)cpu.aux.host);
  }
  tu_free(first_y);
  tu_free(first_dl);
  for (int i = 0; outputs(&cpu, i); ++i) tu_free(outputs(&cpu, i)->host);
  free_buffers(&bc, 0);
  free_buffers(&bg, 1);
  moeblaze_destroy(hc);
  moeblaze_destroy(hg);
  free_problem(&p);
}

static rcase base(int64_t E, int64_t k, int64_t groups, int64_t keep, int64_t fn) {
  rcase c;
  memset(&c, 0, sizeof c);
  c.E = E; c.k = k; c.groups = groups; c.keep = keep; c.score_fn = fn; c.normalize = 1; c.L = 777;
  c.scale = 1.0; c.aux = 0.01; c.z = 1e-3;
  return c;
}

static int have_gpu(void) {
  int n = 0;
  return cudaGetDeviceCount(&n) == cudaSuccess && n > 0;
}

static void options_match_cpu(void** state) {
  (void)state;
  tu_rng r;
  tu_rng_seed(&r, tu_fresh_seed("gpu_routing_options"));
  const int64_t S = MOEBLAZE_SCORE_SOFTMAX, G = MOEBLAZE_SCORE_SIGMOID;
  /* E, k, groups, open groups, score: every router lane layout (E = 8: 8 lanes per token;
   * 64 and 256: 2 and 8 experts per lane; 384: from memory), groups of 1..32 experts. */
  const rcase shapes[] = {base(8, 2, 4, 2, S),    base(64, 6, 8, 3, G),  base(64, 8, 64, 16, S),
                          base(256, 8, 8, 4, G),  base(256, 8, 256, 12, S), base(384, 8, 12, 4, G),
                          base(160, 6, 5, 2, S)};
  /* ROUTING_TEST_QUICK (the compute-sanitizer runs): three shapes, two variants. */
  const int quick = getenv("ROUTING_TEST_QUICK") != NULL;
  for (size_t i = 0; i < (quick ? 3 : sizeof shapes / sizeof shapes[0]); ++i)
    for (int variant = 0; variant < 6; variant += quick ? 3 : 1) {
      rcase c = shapes[i];
      c.bias = variant != 1;
      c.scale = variant == 2 ? 2.5 : 1.0;
      c.seqs = variant == 3 ? 7 : variant == 4 ? 1 : 0;
      c.ties = variant == 5;
      c.normalize = variant != 2;
      if (variant == 1) c.keep = 0;  /* the bias alone, no group limit */
      if (variant == 4) c.keep = 0, c.bias = 0, c.scale = 1.0;  /* one sequence, plain routing */
      check_case(&c, &r);
    }
  rcase masked = base(256, 8, 8, 4, G);  /* a TOKEN_MASK, with the bias and groups */
  masked.bias = masked.mask = 1;
  if (!quick) check_case(&masked, &r);
  masked.score_fn = S, masked.keep = 0, masked.bias = 0;
  if (!quick) check_case(&masked, &r);
  masked.seqs = 7;  /* with the sequence-wise loss over each sequence's unmasked tokens */
  if (!quick) check_case(&masked, &r);
  masked.score_fn = G, masked.seqs = (int)(masked.L / 3);  /* short sequences: some wholly masked */
  check_case(&masked, &r);
  rcase masked_top1 = base(16, 1, 1, 0, S);  /* k = 1: a masked token's rows are zeros */
  masked_top1.mask = 1;
  check_case(&masked_top1, &r);
  rcase hf = base(128, 8, 1, 0, S);  /* the Hugging Face form of the batch-wise balance loss */
  hf.form = MOEBLAZE_AUX_LOSS_HUGGING_FACE;
  check_case(&hf, &r);
  /* Renormalised softmax with no loss: d logits from the saved gates alone, with the bias, groups,
   * a route scale and a token mask, then plain */
  rcase from_gates = base(64, 8, 8, 3, S);
  from_gates.aux = 0.0;
  from_gates.bias = from_gates.mask = 1;
  from_gates.scale = 2.5;
  check_case(&from_gates, &r);
  from_gates.bias = from_gates.mask = 0, from_gates.keep = 0, from_gates.scale = 1.0;
  check_case(&from_gates, &r);
  rcase nan_rows = base(64, 4, 8, 2, S);  /* NaN and infinities: the picks still agree */
  nan_rows.bias = nan_rows.specials = 1;
  check_case(&nan_rows, &r);
  nan_rows.score_fn = G;
  check_case(&nan_rows, &r);
  nan_rows.score_fn = S, nan_rows.aux = nan_rows.z = 0.0;  /* both losses off: they read 0 */
  check_case(&nan_rows, &r);
}

/* Forward and backward with the bias, groups, scale, sequence lengths and a token mask, captured
 * once and replayed on new inputs: the replay's bits are the eager run's. */
static void capture_case(const rcase c, tu_rng* rng) {
  problem p;
  make_problem(&p, &c, rng);
  moeblaze_handle_t h = NULL;
  assert_ok_msg(create(&c, 1, &h), "create");
  buffers b = make_buffers(h, c.L, 1);
  cudaStream_t s;
  CUDA_OK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  to_device(&p);
  cudaGraph_t graph;
  cudaGraphExec_t exec;
  CUDA_OK(cudaStreamBeginCapture(s, cudaStreamCaptureModeGlobal));
  assert_ok_msg(step(h, &p, 1, &b, s), "captured step");
  CUDA_OK(cudaStreamEndCapture(s, &graph));
  CUDA_OK(cudaGraphInstantiate(&exec, graph, 0));
  /* New logits and bias in the same device buffers, then replay. */
  problem q;
  make_problem(&q, &c, rng);
  CUDA_OK(cudaMemcpy(p.logits.dev, q.logits.host, q.logits.bytes, cudaMemcpyHostToDevice));
  CUDA_OK(cudaMemcpy(p.bias.dev, q.bias.host, q.bias.bytes, cudaMemcpyHostToDevice));
  CUDA_OK(cudaGraphLaunch(exec, s));
  CUDA_OK(cudaStreamSynchronize(s));
  from_device(&p);
  void* replay_y = tu_alloc_bytes(p.y.bytes);
  void* replay_dl = tu_alloc_bytes(p.dlogits.bytes);
  void* replay_ids = tu_alloc_bytes(p.ids.bytes);
  memcpy(replay_y, p.y.host, p.y.bytes);
  memcpy(replay_dl, p.dlogits.host, p.dlogits.bytes);
  memcpy(replay_ids, p.ids.host, p.ids.bytes);
  assert_ok_msg(step(h, &p, 1, &b, s), "eager step");
  CUDA_OK(cudaStreamSynchronize(s));
  from_device(&p);
  assert_int_equal(*(int32_t*)p.status.host, 0);
  assert_memory_equal(replay_ids, p.ids.host, p.ids.bytes);
  assert_memory_equal(replay_y, p.y.host, p.y.bytes);
  assert_memory_equal(replay_dl, p.dlogits.host, p.dlogits.bytes);
  tu_free(replay_y);
  tu_free(replay_dl);
  tu_free(replay_ids);
  cudaGraphExecDestroy(exec);
  cudaGraphDestroy(graph);
  free_device(&p);
  free_buffers(&b, 1);
  cudaStreamDestroy(s);
  moeblaze_destroy(h);
  free_problem(&p);
  free_problem(&q);
}

static void capture_with_options(void** state) {
  (void)state;
  if (g_engine != MOEBLAZE_ENGINE_CUDA_FUSED) skip();
  tu_rng r;
  tu_rng_seed(&r, tu_fresh_seed("gpu_routing_capture"));
  rcase c = base(256, 8, 8, 4, MOEBLAZE_SCORE_SIGMOID);
  c.bias = 1;
  c.scale = 2.5;
  c.seqs = 5;  /* with the sequence-wise loss */
  capture_case(c, &r);
  c.mask = 1;  /* with a token mask as well */
  capture_case(c, &r);
  rcase top1 = base(16, 1, 1, 0, MOEBLAZE_SCORE_SOFTMAX);  /* k = 1: y stored at the tokens, masked rows zeroed */
  top1.mask = 1;
  capture_case(top1, &r);
  rcase from_gates = base(128, 8, 1, 0, MOEBLAZE_SCORE_SOFTMAX);  /* d logits from the saved gates */
  from_gates.aux = 0.0;
  from_gates.mask = 1;
  capture_case(from_gates, &r);
}

static void bad_input(void** state) {
  (void)state;
  tu_rng r;
  tu_rng_seed(&r, tu_fresh_seed("gpu_routing_bad"));
  rcase c = base(64, 4, 8, 2, MOEBLAZE_SCORE_SOFTMAX);
  c.bias = 1;
  c.seqs = 4;
  problem p;
  make_problem(&p, &c, &r);
  moeblaze_handle_t h = NULL;
  assert_ok_msg(create(&c, 1, &h), "create");
  buffers b = make_buffers(h, c.L, 1);
  int64_t* n = p.lens.host;
  n[2] += 1;  /* the lengths now sum to L + 1 */
  to_device(&p);
  moeblaze_arg_t fa[16];
  const size_t nf = forward_args(&p, 1, fa);
  moeblaze_status_t st = moeblaze_forward(h, MOEBLAZE_PASS_FORWARD_TRAINING, fa, nf, b.ws, b.ws_bytes, b.saved,
                                          b.saved_bytes, NULL);
  if (g_engine == MOEBLAZE_ENGINE_CUDA_CUBLASLT) {
    assert_int_equal(st, MOEBLAZE_STATUS_INVALID_ARGUMENT);
    assert_non_null(strstr(moeblaze_get_last_error_message(), "SEQUENCE_LENGTHS"));
    from_device(&p);
    const uint32_t* y = p.y.host;  /* nothing written: still the poison */
    for (size_t i = 0; i < p.y.bytes / 4; ++i) assert_int_equal(y[i], 0xffffffffu);
  } else {
    assert_int_equal(st, MOEBLAZE_STATUS_SUCCESS);
    from_device(&p);
    assert_int_equal(*(int32_t*)p.status.host, MOEBLAZE_STATUS_INVALID_ARGUMENT);
    assert_true(isnan(*(float*)p.aux.host));
    const uint16_t* y = p.y.host;
    for (size_t i = 0; i < p.y.bytes / 2; ++i) assert_true(isnan(tu_bf16_to_f32(y[i])));
  }
  free_device(&p);
  /* More sequences than tokens, a bias of the wrong size: refused before anything is enqueued. */
  p.sb[0] = c.L + 1;
  to_device(&p);
  st = moeblaze_forward(h, MOEBLAZE_PASS_FORWARD_TRAINING, fa, forward_args(&p, 1, fa), b.ws, b.ws_bytes, b.saved,
                        b.saved_bytes, NULL);
  assert_int_equal(st, MOEBLAZE_STATUS_INVALID_ARGUMENT);
  assert_non_null(strstr(moeblaze_get_last_error_message(), "SEQUENCE_LENGTHS"));
  p.sb[0] = 4;
  p.se[0] = c.E - 1;
  st = moeblaze_forward(h, MOEBLAZE_PASS_FORWARD_TRAINING, fa, forward_args(&p, 1, fa), b.ws, b.ws_bytes, b.saved,
                        b.saved_bytes, NULL);
  assert_int_equal(st, MOEBLAZE_STATUS_INVALID_ARGUMENT);
  assert_non_null(strstr(moeblaze_get_last_error_message(), "EXPERT_BIAS"));
  from_device(&p);
  const uint32_t* y = p.y.host;
  for (size_t i = 0; i < p.y.bytes / 4; ++i) assert_int_equal(y[i], 0xffffffffu);
  free_device(&p);
  free_buffers(&b, 1);
  moeblaze_destroy(h);
  free_problem(&p);
  /* More expert groups than the GPU router takes. */
  rcase many = base(512, 8, 512, 16, MOEBLAZE_SCORE_SIGMOID);
  moeblaze_handle_t refused = NULL;
  assert_int_equal(create(&many, 1, &refused), MOEBLAZE_STATUS_NOT_SUPPORTED);
  assert_null(refused);
}

/* TOKEN_MASK: the masked call against the same call on the unmasked tokens alone, on the same
 * engine (an independent reference): the same picks, y, dx, d logits and losses for those
 * tokens and the same expert gradients; for the masked tokens id -1, gate 0 and y, dx and
 * d logits rows exactly 0. Then every token masked, and the refusals. */
static double rows_err(const buf* a, const buf* b, moeblaze_dtype_t t, const int32_t* mask, int64_t L, int64_t w,
                       int* zero_ok) {
  double num = 0, den = 0;
  int64_t i = 0;
  *zero_ok = 1;
  for (int64_t r = 0; r < L; ++r)
    for (int64_t c = 0; c < w; ++c) {
      const double x = tu_load(a->host, t, (size_t)(r * w + c));
      if (!mask[r]) {
        *zero_ok &= x == 0.0;
        continue;
      }
      const double y = tu_load(b->host, t, (size_t)(i * w + c));
      num += (x - y) * (x - y);
      den += y * y;
      if (c == w - 1) ++i;
    }
  return den > 0 ? sqrt(num / den) : (num > 0 ? INFINITY : 0.0);
}

static void token_mask(void** state) {
  (void)state;
  tu_rng r;
  tu_rng_seed(&r, tu_fresh_seed("gpu_token_mask"));
  rcase c = base(64, 4, 8, 2, MOEBLAZE_SCORE_SIGMOID);
  c.bias = 1;
  c.mask = 1;
  problem p;
  make_problem(&p, &c, &r);
  const int32_t* m = p.mask.host;
  int64_t Lc = 0;
  for (int64_t t = 0; t < c.L; ++t) Lc += m[t] != 0;
  rcase cc = c;
  cc.mask = 0;
  cc.L = Lc;
  problem q;  /* the unmasked tokens alone, the same weights and bias */
  make_problem(&q, &cc, &r);
  memcpy(q.wgu.host, p.wgu.host, p.wgu.bytes);
  memcpy(q.wd.host, p.wd.host, p.wd.bytes);
  memcpy(q.bias.host, p.bias.host, p.bias.bytes);
  for (int64_t t = 0, i = 0; t < c.L; ++t) {
    if (!m[t]) continue;
    memcpy((char*)q.x.host + i * D * 2, (char*)p.x.host + t * D * 2, D * 2);
    memcpy((char*)q.dy.host + i * D * 2, (char*)p.dy.host + t * D * 2, D * 2);
    memcpy((float*)q.logits.host + i * c.E, (float*)p.logits.host + t * c.E, (size_t)c.E * 4);
    ++i;
  }
  moeblaze_handle_t h = NULL;
  assert_ok_msg(create(&c, 1, &h), "create");
  buffers b = make_buffers(h, c.L, 1);
  problem* runs[2] = {&p, &q};
  for (int i = 0; i < 2; ++i) {
    to_device(runs[i]);
    assert_ok_msg(step(h, runs[i], 1, &b, NULL), i ? "compacted step" : "masked step");
    from_device(runs[i]);
    free_device(runs[i]);
    assert_int_equal(*(int32_t*)runs[i]->status.host, 0);
  }
  const int32_t *ids = p.ids.host, *qids = q.ids.host;
  const float* gates = p.gates.host;
  for (int64_t t = 0, i = 0; t < c.L; ++t)
    for (int64_t j = 0; j < c.k; ++j) {
      if (!m[t]) {
        assert_int_equal(ids[t * c.k + j], -1);
        assert_true(gates[t * c.k + j] == 0.f);
      } else {
        assert_int_equal(ids[t * c.k + j], qids[i * c.k + j]);
        if (j == c.k - 1) ++i;
      }
    }
  int zero;
  const struct { const char* name; buf *a, *b; moeblaze_dtype_t t; int64_t w; double tol; } rows[] = {
      {"y", &p.y, &q.y, tu_bf16, D, 1e-3}, {"dx", &p.dx, &q.dx, tu_bf16, D, 1e-3},
      {"d logits", &p.dlogits, &q.dlogits, tu_f32, c.E, 1e-4}};
  for (size_t i = 0; i < 3; ++i) {
    const double e = rows_err(rows[i].a, rows[i].b, rows[i].t, m, c.L, rows[i].w, &zero);
    print_message("  engine %lld, %lld of %lld tokens masked: %s of the unmasked tokens within %.2g, masked rows %s\n",
                  (long long)g_engine, (long long)(c.L - Lc), (long long)c.L, rows[i].name, e, zero ? "0" : "NOT 0");
    if (!(e <= rows[i].tol) || !zero) fail_msg("token mask: %s", rows[i].name);
  }
  const double ea = fabs(*(float*)p.aux.host - *(float*)q.aux.host) / fabs(*(float*)q.aux.host);
  const double ez = fabs(*(float*)p.z.host - *(float*)q.z.host) / fabs(*(float*)q.z.host);
  const double ew = rel_err(p.dwgu.host, q.dwgu.host, tu_bf16, p.wgu.bytes / 2);
  const double ed = rel_err(p.dwd.host, q.dwd.host, tu_bf16, p.wd.bytes / 2);
  print_message("  aux %.3g, z %.3g, dW_gate_up %.3g, dW_down %.3g (relative errors)\n", ea, ez, ew, ed);
  assert_true(ea < 1e-5 && ez < 1e-5 && ew < 2e-3 && ed < 2e-3);

  /* Every token masked: nothing routed, every output and gradient 0. */
  memset(p.mask.host, 0, p.mask.bytes);
  to_device(&p);
  assert_ok_msg(step(h, &p, 1, &b, NULL), "all masked");
  from_device(&p);
  free_device(&p);
  assert_int_equal(*(int32_t*)p.status.host, 0);
  assert_true(*(float*)p.aux.host == 0.f && *(float*)p.z.host == 0.f);
  for (int64_t i = 0; i < c.L * c.k; ++i) assert_int_equal(ids[i], -1);
  for (int64_t i = 0; i < c.L * D; ++i) assert_true(tu_load(p.y.host, tu_bf16, (size_t)i) == 0.0);
  for (int64_t i = 0; i < c.L * D; ++i) assert_true(tu_load(p.dx.host, tu_bf16, (size_t)i) == 0.0);
  for (int64_t i = 0; i < c.L * c.E; ++i) assert_true(((float*)p.dlogits.host)[i] == 0.f);
  for (size_t i = 0; i < p.wgu.bytes / 2; ++i) assert_true(tu_load(p.dwgu.host, tu_bf16, i) == 0.0);

  /* Refused before anything is enqueued: a mask of the wrong length. */
  to_device(&p);
  moeblaze_arg_t fa[16];
  p.sm[0] = c.L - 1;
  moeblaze_status_t st = moeblaze_forward(h, MOEBLAZE_PASS_FORWARD_TRAINING, fa, forward_args(&p, 1, fa), b.ws,
                                          b.ws_bytes, b.saved, b.saved_bytes, NULL);
  assert_int_equal(st, MOEBLAZE_STATUS_INVALID_ARGUMENT);
  assert_non_null(strstr(moeblaze_get_last_error_message(), "TOKEN_MASK"));
  from_device(&p);
  const uint32_t* y = p.y.host;  /* nothing written */
  for (size_t i = 0; i < p.y.bytes / 4; ++i) assert_int_equal(y[i], 0xffffffffu);
  free_device(&p);
  free_buffers(&b, 1);
  moeblaze_destroy(h);
  free_problem(&p);
  free_problem(&q);
}

static int use_engine(void** state, int64_t engine) {
  (void)state;
  g_engine = engine;
  moeblaze_handle_t h = NULL;
  rcase c = base(64, 4, 8, 2, MOEBLAZE_SCORE_SOFTMAX);
  if (create(&c, 1, &h)) {
    print_message("engine %lld not served here: %s\n", (long long)engine, moeblaze_get_last_error_message());
    return -1;
  }
  moeblaze_destroy(h);
  return 0;
}
static int fused(void** state) { return use_engine(state, MOEBLAZE_ENGINE_CUDA_FUSED); }
static int cublaslt(void** state) { return use_engine(state, MOEBLAZE_ENGINE_CUDA_CUBLASLT); }

int main(void) {
  if (!have_gpu()) {
    printf("no CUDA device: skipped\n");
    return 77;
  }
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(options_match_cpu),
      cmocka_unit_test(capture_with_options),
      cmocka_unit_test(bad_input),
      cmocka_unit_test(token_mask),
  };
  int failed = 0;
  if (fused(NULL) == 0) failed += _cmocka_run_group_tests("routing options, fused engine", tests, 4, NULL, NULL);
  if (cublaslt(NULL) == 0) failed += _cmocka_run_group_tests("routing options, cuBLASLt engine", tests, 4, NULL, NULL);
  return failed ? 1 : 0;
}
