/* moeblaze-bench: one MoE layer forward + backward on the paper's configs, the modern
 * fine-grained ones (perf/configs/modern-configs.json) or the user's own shapes (--shape
 * T,d,n,E,K), routing from logits, bf16 by default. Prints, per config and activation: median
 * fwd / bwd / fwd+bwd time, throughput, saved-activation bytes, peak bytes (saved + the larger
 * workspace; backward is the saved buffer's last use, moeblaze_backward_last_use, as in a
 * trainer) and the max relative error of one step against the fp64 reference, with a
 * pass/fail verdict at the dtype's tolerance. One progress line per row goes to stderr.
 *
 * Without a usable GPU engine it runs the CPU engine at a reduced token count (chosen so a
 * step costs about --cpu-gflop GFLOP), and says so: on the CPU the numbers show correctness,
 * not speed. --quick is the short CPU check of the quick start. Options are parsed strictly:
 * anything unknown or malformed prints the usage and exits 2. */
#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "bench.h"

#ifdef MOEBLAZE_BENCH_CUDA
#include <cublas_v2.h>
#include <cuda_runtime.h>
#endif

#define MAX_CONFIGS 64
#define MAX_FILES 4

typedef struct options {
  const char* configs[MAX_FILES];
  int num_configs;
  bench_config shapes[MAX_CONFIGS]; /* from --shape */
  int num_shapes;
  int quick;
  const char* json;
  const char* only;      /* comma-separated config names, or NULL for all */
  int64_t tokens;        /* 0 = automatic */
  double cpu_gflop;      /* per fwd+bwd step on the CPU engine */
  int reps, warmup, threads, check;
  int device; /* -1 auto, 0 cpu, 1 cuda */
  int32_t policy;
  int64_t engine; /* MOEBLAZE_ENGINE_* for CUDA handles (AUTO by default) */
  int64_t window; /* MOEBLAZE_ATTR_WINDOW_TOKENS (0: automatic) */
  moeblaze_dtype_t dtype;
  int activations[8];
  int num_activations;
} options;

static void die(const char* what, moeblaze_status_t s) {
  fprintf(stderr, "moeblaze-bench: %s failed: %s: %s\n", what, moeblaze_status_name(s), moeblaze_get_last_error_message());
  exit(1);
}
#define CHECK(call) do { moeblaze_status_t s_ = (call); if (s_ != MOEBLAZE_STATUS_SUCCESS) die(#call, s_); } while (0)

static double now_ms(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec * 1e3 + (double)ts.tv_nsec * 1e-6;
}

static int cmp_double(const void* a, const void* b) {
  double x = *(const double*)a, y = *(const double*)b;
  return x < y ? -1 : x > y;
}
static double median(double* v, int n) {
  qsort(v, (size_t)n, sizeof *v, cmp_double);
  return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

/* Reproducible inputs: xorshift64* draws, uniform with unit variance (cheap enough for the
 * paper's largest weights). */
static uint64_t rng_state = 0x9E3779B97F4A7C15ull;
static double rng_normal(void) {
  rng_state ^= rng_state >> 12;
  rng_state ^= rng_state << 25;
  rng_state ^= rng_state >> 27;
  const uint64_t r = rng_state * 0x2545F4914F6CDD1Dull;
  return ((double)(r >> 11) * (1.0 / 9007199254740992.0) * 2.0 - 1.0) * 1.7320508075688772;
}

static uint16_t f32_to_bf16(float f) {
  uint32_t u;
  memcpy(&u, &f, 4);
  u += 0x7fffu + ((u >> 16) & 1u);
  return (uint16_t)(u >> 16);
}
static uint16_t f32_to_f16(float f) { /* inputs here are small normals: simple round-to-nearest */
  uint32_t x;
  memcpy(&x, &f, 4);
  uint32_t sign = (x >> 16) & 0x8000u, ax = x & 0x7fffffffu;
  if (ax < 0x38800000u) return (uint16_t)sign; /* flush tiny values */
  uint32_t h = (((ax >> 23) - 112u) << 10) | ((ax & 0x7fffffu) >> 13);
  if ((ax & 0x1fffu) > 0x1000u || ((ax & 0x1fffu) == 0x1000u && (h & 1u))) h++;
  return (uint16_t)(sign | h);
}

static size_t dsize(moeblaze_dtype_t t) { return t.bits / 8u; }
static void* alloc_aligned(size_t bytes) {
  size_t n = (bytes + 255u) / 256u * 256u;
  void* p = aligned_alloc(256, n ? n : 256);
  if (!p) { fprintf(stderr, "moeblaze-bench: out of host memory (%zu bytes)\n", bytes); exit(1); }
  return p;
}
static void* random_tensor(moeblaze_dtype_t t, size_t n, double scale) {
  void* p = alloc_aligned(n * dsize(t));
  for (size_t i = 0; i < n; ++i) {
    float v = (float)(scale * rng_normal());
    if (t.bits == 32) ((float*)p)[i] = v;
    else if (t.code == 4) ((uint16_t*)p)[i] = f32_to_bf16(v);
    else ((uint16_t*)p)[i] = f32_to_f16(v);
  }
  return p;
}

/* ---- where the data lives: host (CPU engine) or a CUDA device ---- */
typedef struct backend {
  int cuda;
  void* stream;
#ifdef MOEBLAZE_BENCH_CUDA
  cudaEvent_t ev[4];
  cublasHandle_t blas;
#endif
} backend;

#ifdef MOEBLAZE_BENCH_CUDA
static void cuda_check(cudaError_t e, const char* what) {
  if (e != cudaSuccess) { fprintf(stderr, "moeblaze-bench: %s: %s\n", what, cudaGetErrorString(e)); exit(1); }
}
#endif

static void* buf_alloc(const backend* b, size_t bytes) {
#ifdef MOEBLAZE_BENCH_CUDA
  if (b->cuda) {
    void* p = NULL;
    cuda_check(cudaMalloc(&p, bytes ? bytes : 256), "cudaMalloc");
    return p;
  }
#endif
  (void)b;
  return alloc_aligned(bytes);
}
static void buf_free(const backend* b, void* p) {
#ifdef MOEBLAZE_BENCH_CUDA
  if (b->cuda) { cudaFree(p); return; }
#endif
  (void)b;
  free(p);
}
/* A copy of host data where the backend computes (the host pointer itself on the CPU). */
static void* buf_upload(const backend* b, const void* host, size_t bytes) {
#ifdef MOEBLAZE_BENCH_CUDA
  if (b->cuda) {
    void* p = buf_alloc(b, bytes);
    cuda_check(cudaMemcpy(p, host, bytes, cudaMemcpyHostToDevice), "upload");
    return p;
  }
#endif
  (void)b; (void)bytes;
  return (void*)host;
}
static void buf_download(const backend* b, void* host, const void* src, size_t bytes) {
#ifdef MOEBLAZE_BENCH_CUDA
  if (b->cuda) { cuda_check(cudaMemcpy(host, src, bytes, cudaMemcpyDeviceToHost), "download"); return; }
#endif
  (void)b;
  if (host != src) memcpy(host, src, bytes);
}

static moeblaze_tensor_t tensor(const backend* b, void* data, moeblaze_dtype_t t, int32_t ndim, const int64_t* shape) {
  moeblaze_tensor_t x;
  memset(&x, 0, sizeof x);
  x.data = data;
  x.device.device_type = b->cuda ? MOEBLAZE_DEVICE_CUDA : MOEBLAZE_DEVICE_CPU;
  x.ndim = ndim;
  x.dtype = t;
  x.shape = shape;
  return x;
}

/* Times the region between mark(0) and mark(1) in ms (CUDA events on the GPU). */
static double clock_start;
static void mark(backend* b, int which) {
#ifdef MOEBLAZE_BENCH_CUDA
  if (b->cuda) { cudaEventRecord(b->ev[which], (cudaStream_t)b->stream); return; }
#endif
  (void)b;
  if (which == 0) clock_start = now_ms();
}
static double elapsed(backend* b) {
#ifdef MOEBLAZE_BENCH_CUDA
  if (b->cuda) {
    float ms = 0.f;
    cudaEventSynchronize(b->ev[1]);
    cudaEventElapsedTime(&ms, b->ev[0], b->ev[1]);
    return ms;
  }
#endif
  (void)b;
  return now_ms() - clock_start;
}

/* The ceiling: dense bf16 cuBLAS GEMMs of the same total FLOPs, back to back (8192^3 each, or
 * one square GEMM of the same FLOPs when smaller). run_one times one repetition of it after each
 * repetition of the layer, so that both see the same clocks: the H100's dense rate moves by
 * ~10% between bursts and its sustained 700 W state (measured beside the peers), and a
 * ceiling timed once, apart from the layer, moved a config's % of dense by that much between runs
 * (perf/NOTES.md). */
typedef struct dense_ceiling {
  int64_t n, count;  /* count GEMMs of n x n x n */
  double scale;      /* the layer's FLOPs over the GEMMs' */
  void *A, *B, *C;
} dense_ceiling;

static dense_ceiling dense_ceiling_create(backend* b, double flops) {
  dense_ceiling dc;
  memset(&dc, 0, sizeof dc);
#ifdef MOEBLAZE_BENCH_CUDA
  if (!b->cuda) return dc;
  const double f8192 = 2.0 * 8192.0 * 8192.0 * 8192.0;
  dc.n = 8192;
  dc.count = (int64_t)(flops / f8192 + 0.5);
  if (flops < f8192) {
    dc.count = 1;
    dc.n = (int64_t)(cbrt(flops / 2.0) / 256.0 + 0.5) * 256;
    if (dc.n < 256) dc.n = 256;
  }
  dc.scale = flops / (2.0 * (double)dc.n * (double)dc.n * (double)dc.n * (double)dc.count);
  const moeblaze_dtype_t bf16 = MOEBLAZE_DTYPE_BF16;
  void* hA = random_tensor(bf16, (size_t)(dc.n * dc.n), 1.0);
  dc.A = buf_upload(b, hA, (size_t)(dc.n * dc.n) * 2);
  dc.B = buf_upload(b, hA, (size_t)(dc.n * dc.n) * 2);
  dc.C = buf_alloc(b, (size_t)(dc.n * dc.n) * 2);
  free(hA);
#else
  (void)b; (void)flops;
#endif
  return dc;
}

/* One repetition, in ms scaled to the layer's FLOPs; NaN without a GPU. */
static double dense_ceiling_rep_ms(backend* b, const dense_ceiling* dc) {
#ifdef MOEBLAZE_BENCH_CUDA
  if (!dc->A) return NAN;
  const float alpha = 1.f, beta = 0.f;
  const int n = (int)dc->n;
  mark(b, 0);
  for (int64_t i = 0; i < dc->count; ++i)
    cublasGemmEx(b->blas, CUBLAS_OP_N, CUBLAS_OP_N, n, n, n, &alpha, dc->A, CUDA_R_16BF, n, dc->B, CUDA_R_16BF, n, &beta, dc->C,
                 CUDA_R_16BF, n, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT);
  mark(b, 1);
  return elapsed(b) * dc->scale;
#else
  (void)b; (void)dc;
  return NAN;
#endif
}

static void dense_ceiling_destroy(backend* b, dense_ceiling* dc) {
  if (!dc->A) return;
  buf_free(b, dc->A); buf_free(b, dc->B); buf_free(b, dc->C);
}

static const char* act_name(int a) {
  static const char* names[] = {"relu", "gelu", "silu", "swiglu", "geglu"};
  return a >= 0 && a <= 4 ? names[a] : "?";
}
static int act_from_name(const char* s) {
  for (int a = 0; a <= 4; ++a)
    if (strcmp(s, act_name(a)) == 0) return a;
  return -1;
}
static const char* dtype_name(moeblaze_dtype_t t) { return t.bits == 32 ? "f32" : (t.code == 4 ? "bf16" : "f16"); }

static void usage(FILE* f) {
  fprintf(f,
          "usage: moeblaze-bench [--configs paper|modern|FILE]... [--shape T,d,n,E,K]... [--only NAME,...]\n"
          "                      [--activations silu,swiglu,...] [--dtype bf16|f16|f32] [--policy preact|recompute|all]\n"
          "                      [--tokens N] [--device auto|cpu|cuda] [--engine auto|fused|cublaslt] [--cpu-gflop G]\n"
          "                      [--reps N] [--warmup N] [--window N]\n"
          "                      [--threads N] [--quick] [--no-check] [--json FILE]\n"
          "  --configs   config file(s): paper (default; n = 4 d), modern (fine-grained MoEs, explicit n), or a path\n"
          "  --shape     one layer: T tokens, d model dim, n expert FFN dim, E experts, K top-k (repeatable)\n"
          "  --engine    the CUDA engine (auto: the registry's choice; fused: sm_90, bf16/fp16)\n"
          "  --window    the fused engine's tokens per window (MOEBLAZE_ATTR_WINDOW_TOKENS; 0: automatic)\n"
          "  --quick     a short CPU correctness check: small token counts, one rep, pass/fail per row\n");
}

/* Strict value parsing: the whole string must be a number in [lo, hi], else usage and exit 2. */
static void bad_option(const char* opt, const char* v, const char* why) {
  fprintf(stderr, "moeblaze-bench: %s '%s': %s\n", opt, v ? v : "", why);
  usage(stderr);
  exit(2);
}
static int64_t parse_int(const char* opt, const char* v, int64_t lo, int64_t hi) {
  char* end = NULL;
  errno = 0;
  long long x = strtoll(v, &end, 10);
  if (errno || end == v || *end != '\0' || x < lo || x > hi) {
    char why[96];
    snprintf(why, sizeof why, "expected an integer in [%lld, %lld]", (long long)lo, (long long)hi);
    bad_option(opt, v, why);
  }
  return x;
}
static double parse_real(const char* opt, const char* v, double lo, double hi) {
  char* end = NULL;
  errno = 0;
  double x = strtod(v, &end);
  if (errno || end == v || *end != '\0' || !(x >= lo && x <= hi)) bad_option(opt, v, "expected a number in range");
  return x;
}
/* Index of v in the NULL-terminated list, else usage and exit 2. */
static int parse_choice(const char* opt, const char* v, const char* const* names) {
  for (int i = 0; names[i]; ++i)
    if (!strcmp(v, names[i])) return i;
  char why[160] = "expected one of:";
  for (int i = 0; names[i]; ++i) {
    strncat(why, " ", sizeof why - strlen(why) - 1);
    strncat(why, names[i], sizeof why - strlen(why) - 1);
  }
  bad_option(opt, v, why);
  return -1;
}
/* --shape T,d,n,E,K */
static void parse_shape(const char* v, bench_config* c) {
  int64_t f[5];
  const char* p = v;
  for (int i = 0; i < 5; ++i) {
    char* end = NULL;
    errno = 0;
    long long x = strtoll(p, &end, 10);
    if (errno || end == p || x < 1 || (i < 4 && *end != ',') || (i == 4 && *end != '\0'))
      bad_option("--shape", v, "expected T,d,n,E,K: five positive integers");
    f[i] = x;
    p = end + 1;
  }
  if (f[4] > f[3]) bad_option("--shape", v, "K must not exceed E");
  memset(c, 0, sizeof *c);
  c->tokens = f[0]; c->d = f[1]; c->n = f[2]; c->experts = f[3]; c->k = f[4];
  snprintf(c->name, sizeof c->name, "T%lld_d%lld_n%lld_E%lld_K%lld", (long long)f[0], (long long)f[1], (long long)f[2],
           (long long)f[3], (long long)f[4]);
}

static int selected(const options* o, const char* name) {
  if (!o->only) return 1;
  const char* p = o->only;
  size_t n = strlen(name);
  while (p && *p) {
    if (strncmp(p, name, n) == 0 && (p[n] == ',' || p[n] == '\0')) return 1;
    p = strchr(p, ',');
    if (p) ++p;
  }
  return 0;
}

static void parse(int argc, char** argv, options* o) {
  memset(o, 0, sizeof *o);
  o->cpu_gflop = 4.0;
  o->reps = -1;
  o->warmup = 1;
  o->check = 1;
  o->device = -1;
  o->policy = MOEBLAZE_SAVE_PREACT;
  const moeblaze_dtype_t dtypes[3] = {MOEBLAZE_DTYPE_BF16, MOEBLAZE_DTYPE_F16, MOEBLAZE_DTYPE_F32};
  o->dtype = dtypes[0];
  o->activations[0] = MOEBLAZE_ACTIVATION_SILU;
  o->activations[1] = MOEBLAZE_ACTIVATION_SWIGLU;
  o->num_activations = 2;
  static const char* const dtype_names[] = {"bf16", "f16", "f32", NULL};
  static const char* const policy_names[] = {"preact", "recompute", "all", NULL};
  static const int32_t policies[] = {MOEBLAZE_SAVE_PREACT, MOEBLAZE_SAVE_RECOMPUTE_UP, MOEBLAZE_SAVE_ALL};
  static const char* const device_names[] = {"auto", "cpu", "cuda", NULL};
  static const char* const engine_names[] = {"auto", "fused", "cublaslt", NULL};
  static const int64_t engines[] = {MOEBLAZE_ENGINE_AUTO, MOEBLAZE_ENGINE_CUDA_FUSED, MOEBLAZE_ENGINE_CUDA_CUBLASLT};
  for (int i = 1; i < argc; ++i) {
    const char* a = argv[i];
    if (!strcmp(a, "--help") || !strcmp(a, "-h")) { usage(stdout); exit(0); }
    if (!strcmp(a, "--no-check")) { o->check = 0; continue; }
    if (!strcmp(a, "--quick")) { o->quick = 1; continue; }
    if (strncmp(a, "--", 2) != 0) bad_option("argument", a, "not an option");
    if (i + 1 >= argc) bad_option(a, "", "needs a value");
    const char* v = argv[++i];
    if (!strcmp(a, "--configs")) {
      if (o->num_configs == MAX_FILES) bad_option(a, v, "at most 4 config files");
      o->configs[o->num_configs++] = !strcmp(v, "paper") ? MOEBLAZE_PERF_DIR "/configs/paper-configs.json"
                                   : !strcmp(v, "modern") ? MOEBLAZE_PERF_DIR "/configs/modern-configs.json" : v;
    } else if (!strcmp(a, "--shape")) {
      if (o->num_shapes == MAX_CONFIGS) bad_option(a, v, "too many shapes");
      parse_shape(v, &o->shapes[o->num_shapes++]);
    } else if (!strcmp(a, "--only")) o->only = v;
    else if (!strcmp(a, "--json")) o->json = v;
    else if (!strcmp(a, "--tokens")) o->tokens = parse_int(a, v, 1, (int64_t)1 << 31);
    else if (!strcmp(a, "--cpu-gflop")) o->cpu_gflop = parse_real(a, v, 1e-3, 1e6);
    else if (!strcmp(a, "--reps")) o->reps = (int)parse_int(a, v, 1, 100000);
    else if (!strcmp(a, "--warmup")) o->warmup = (int)parse_int(a, v, 0, 100000);
    else if (!strcmp(a, "--threads")) o->threads = (int)parse_int(a, v, 0, 4096);
    else if (!strcmp(a, "--device")) o->device = parse_choice(a, v, device_names) - 1;
    else if (!strcmp(a, "--engine")) o->engine = engines[parse_choice(a, v, engine_names)];
    else if (!strcmp(a, "--window")) o->window = parse_int(a, v, 0, 2147483647);
    else if (!strcmp(a, "--policy")) o->policy = policies[parse_choice(a, v, policy_names)];
    else if (!strcmp(a, "--dtype")) o->dtype = dtypes[parse_choice(a, v, dtype_names)];
    else if (!strcmp(a, "--activations")) {
      static const char* const act_names[] = {"relu", "gelu", "silu", "swiglu", "geglu", NULL};
      o->num_activations = 0;
      char buf[128];
      if (strlen(v) >= sizeof buf) bad_option(a, v, "too long");
      snprintf(buf, sizeof buf, "%s", v);
      for (char* t = strtok(buf, ","); t; t = strtok(NULL, ",")) {
        if (o->num_activations == 8) bad_option(a, v, "at most 8 activations");
        o->activations[o->num_activations++] = parse_choice(a, t, act_names);
      }
      if (o->num_activations == 0) bad_option(a, v, "no activation named");
    } else {
      bad_option(a, v, "unknown option");
    }
  }
  if (o->num_configs == 0 && o->num_shapes == 0) o->configs[o->num_configs++] = MOEBLAZE_PERF_DIR "/configs/paper-configs.json";
  if (o->quick) {  /* the quick start's short CPU check */
    if (o->device == 1) bad_option("--quick", "", "is the CPU check; drop --device cuda");
    o->device = 0;
    if (o->reps < 0) o->reps = 1;
    o->warmup = 0;
    o->check = 1;
  }
}

typedef struct result {
  double fwd, bwd, total, ceiling, err;
  double dense_ratio; /* median over repetitions of ceiling / fwd+bwd, each pair timed together */
  size_t saved, ws_fwd, ws_bwd;
  int64_t L, check_tokens;
  int64_t engine; /* the engine the handle resolved to */
} result;

/* One config x activation: times fwd, bwd and fwd+bwd, the dense ceiling, and one checked
 * step of `check_tokens` tokens against the fp64 reference. */
static result run_one(backend* be, const options* o, const bench_config* c, int act, int64_t L) {
  result res;
  memset(&res, 0, sizeof res);
  const int gated = act == MOEBLAZE_ACTIVATION_SWIGLU || act == MOEBLAZE_ACTIVATION_GEGLU;
  const int64_t d = c->d, h = c->n, E = c->experts, k = c->k, gh = (gated ? 2 : 1) * h;
  const double flop_per_token = 3.0 * 2.0 * (double)k * (double)d * (double)h * (gated ? 3.0 : 2.0);
  moeblaze_config_t cfg;
  CHECK(moeblaze_config_create(&cfg));
  CHECK(moeblaze_config_set_i64(cfg, MOEBLAZE_ATTR_DEVICE_TYPE, be->cuda ? MOEBLAZE_DEVICE_CUDA : MOEBLAZE_DEVICE_CPU));
  CHECK(moeblaze_config_set_i64(cfg, MOEBLAZE_ATTR_NUM_EXPERTS, E));
  CHECK(moeblaze_config_set_i64(cfg, MOEBLAZE_ATTR_TOP_K, k));
  CHECK(moeblaze_config_set_i64(cfg, MOEBLAZE_ATTR_HIDDEN_SIZE, d));
  CHECK(moeblaze_config_set_i64(cfg, MOEBLAZE_ATTR_FFN_HIDDEN_SIZE, h));
  CHECK(moeblaze_config_set_i64(cfg, MOEBLAZE_ATTR_MAX_TOKENS, L));
  CHECK(moeblaze_config_set_i64(cfg, MOEBLAZE_ATTR_ACTIVATION, act));
  CHECK(moeblaze_config_set_i64(cfg, MOEBLAZE_ATTR_SAVE_POLICY, o->policy));
  if (!be->cuda) CHECK(moeblaze_config_set_i64(cfg, MOEBLAZE_ATTR_NUM_THREADS, o->threads));
  if (be->cuda) CHECK(moeblaze_config_set_i64(cfg, MOEBLAZE_ATTR_ENGINE, o->engine));
  if (be->cuda && o->window) CHECK(moeblaze_config_set_i64(cfg, MOEBLAZE_ATTR_WINDOW_TOKENS, o->window));
  CHECK(moeblaze_config_set_dtype(cfg, MOEBLAZE_ATTR_ACTIVATION_DTYPE, o->dtype));
  CHECK(moeblaze_config_set_dtype(cfg, MOEBLAZE_ATTR_WEIGHT_DTYPE, o->dtype));
  moeblaze_handle_t handle;
  CHECK(moeblaze_create(&handle, cfg));
  moeblaze_config_destroy(cfg);
  CHECK(moeblaze_handle_get_i64(handle, MOEBLAZE_ATTR_ENGINE, &res.engine));

  const moeblaze_dtype_t dt = o->dtype, f32 = MOEBLAZE_DTYPE_F32;
  const size_t es = dsize(dt), nx = (size_t)(L * d), nl = (size_t)(L * E), nwgu = (size_t)(E * d * gh), nwd = (size_t)(E * h * d);
  /* Host copies (the reference check reads them), device copies where the engine runs. */
  bench_step s;
  memset(&s, 0, sizeof s);
  s.d = d; s.h = h; s.E = E; s.k = k; s.activation = act; s.dtype = dt;
  s.x = random_tensor(dt, nx, 1.0);
  s.logits = random_tensor(f32, nl, 1.0);
  s.w_gate_up = random_tensor(dt, nwgu, 1.0 / sqrt((double)d));
  s.w_down = random_tensor(dt, nwd, 1.0 / sqrt((double)h));
  s.dy = random_tensor(dt, nx, 1.0);
  void *x = buf_upload(be, s.x, nx * es), *logits = buf_upload(be, s.logits, nl * 4), *wgu = buf_upload(be, s.w_gate_up, nwgu * es),
       *wd = buf_upload(be, s.w_down, nwd * es), *dy = buf_upload(be, s.dy, nx * es);
  void *y = buf_alloc(be, nx * es), *dx = buf_alloc(be, nx * es), *dwgu = buf_alloc(be, nwgu * es), *dwd = buf_alloc(be, nwd * es),
       *dlog = buf_alloc(be, nl * 4);
  CHECK(moeblaze_get_workspace_size(handle, MOEBLAZE_PASS_FORWARD_TRAINING, L, &res.ws_fwd));
  /* One backward per forward, as a trainer runs them: the saved buffer's last use. */
  CHECK(moeblaze_get_workspace_size(handle, MOEBLAZE_PASS_BACKWARD_LAST_USE, L, &res.ws_bwd));
  CHECK(moeblaze_get_saved_size(handle, L, &res.saved));
  const size_t ws_bytes = res.ws_fwd > res.ws_bwd ? res.ws_fwd : res.ws_bwd;
  void* ws = buf_alloc(be, ws_bytes);
  void* saved = buf_alloc(be, res.saved);

  int64_t sx[2] = {L, d}, sl[2] = {L, E};
  const int64_t sw[3] = {E, d, gh}, sd[3] = {E, h, d};
  moeblaze_arg_t fwd[5] = {
      {MOEBLAZE_ARG_INPUT, 0, tensor(be, x, dt, 2, sx)}, {MOEBLAZE_ARG_ROUTER_LOGITS, 0, tensor(be, logits, f32, 2, sl)},
      {MOEBLAZE_ARG_W_GATE_UP, 0, tensor(be, wgu, dt, 3, sw)}, {MOEBLAZE_ARG_W_DOWN, 0, tensor(be, wd, dt, 3, sd)},
      {MOEBLAZE_ARG_OUTPUT, 0, tensor(be, y, dt, 2, sx)}};
  moeblaze_arg_t bwd[9] = {
      fwd[0], fwd[1], fwd[2], fwd[3],
      {MOEBLAZE_ARG_GRAD_OUTPUT, 0, tensor(be, dy, dt, 2, sx)}, {MOEBLAZE_ARG_GRAD_INPUT, 0, tensor(be, dx, dt, 2, sx)},
      {MOEBLAZE_ARG_GRAD_W_GATE_UP, 0, tensor(be, dwgu, dt, 3, sw)}, {MOEBLAZE_ARG_GRAD_W_DOWN, 0, tensor(be, dwd, dt, 3, sd)},
      {MOEBLAZE_ARG_GRAD_ROUTER_LOGITS, 0, tensor(be, dlog, f32, 2, sl)}};
  moeblaze_stream_t stream = (moeblaze_stream_t)be->stream;

  const int reps = o->reps > 0 ? o->reps : (be->cuda ? 20 : 3);
  double* tf = malloc(sizeof(double) * (size_t)reps);
  double* tb = malloc(sizeof(double) * (size_t)reps);
  double* tt = malloc(sizeof(double) * (size_t)reps);
  double* tc = malloc(sizeof(double) * (size_t)reps);
  double* tr = malloc(sizeof(double) * (size_t)reps);
  dense_ceiling dc = dense_ceiling_create(be, flop_per_token * (double)L);
  const int warmup = be->cuda && o->warmup < 3 ? 3 : o->warmup;
  for (int r = -warmup; r < reps; ++r) {
    mark(be, 0);
    CHECK(moeblaze_forward(handle, MOEBLAZE_PASS_FORWARD_TRAINING, fwd, 5, ws, ws_bytes, saved, res.saved, stream));
    mark(be, 1);
    double f = elapsed(be);
    mark(be, 0);
    CHECK(moeblaze_backward_last_use(handle, bwd, 9, saved, res.saved, ws, ws_bytes, stream));
    mark(be, 1);
    double bk = elapsed(be);
    const double ceiling = dense_ceiling_rep_ms(be, &dc);
    if (r >= 0) { tf[r] = f; tb[r] = bk; tt[r] = f + bk; tc[r] = ceiling; tr[r] = ceiling / (f + bk); }
  }
  dense_ceiling_destroy(be, &dc);
  res.fwd = median(tf, reps);
  res.bwd = median(tb, reps);
  res.total = median(tt, reps);
  res.L = L;
  res.ceiling = be->cuda ? median(tc, reps) : NAN;
  res.dense_ratio = be->cuda ? median(tr, reps) : NAN;
  free(tc); free(tr);
  free(tf); free(tb); free(tt);

  /* One checked step on the first check_tokens tokens (the fp64 reference is slow). */
  res.err = NAN;
  if (o->check) {
    int64_t lc = (int64_t)(5e8 / flop_per_token);
    if (lc < 1) lc = 1;
    if (lc > 256) lc = 256;
    if (lc > L) lc = L;
    res.check_tokens = lc;
    sx[0] = lc;
    sl[0] = lc;
    CHECK(moeblaze_forward(handle, MOEBLAZE_PASS_FORWARD_TRAINING, fwd, 5, ws, ws_bytes, saved, res.saved, stream));
    CHECK(moeblaze_backward_last_use(handle, bwd, 9, saved, res.saved, ws, ws_bytes, stream));
#ifdef MOEBLAZE_BENCH_CUDA
    if (be->cuda) cuda_check(cudaStreamSynchronize((cudaStream_t)be->stream), "sync");
#endif
    s.L = lc;
    s.y = alloc_aligned((size_t)lc * (size_t)d * es);
    s.dx = alloc_aligned((size_t)lc * (size_t)d * es);
    s.dw_gate_up = alloc_aligned(nwgu * es);
    s.dw_down = alloc_aligned(nwd * es);
    s.dlogits = alloc_aligned((size_t)lc * (size_t)E * 4);
    buf_download(be, s.y, y, (size_t)lc * (size_t)d * es);
    buf_download(be, s.dx, dx, (size_t)lc * (size_t)d * es);
    buf_download(be, s.dw_gate_up, dwgu, nwgu * es);
    buf_download(be, s.dw_down, dwd, nwd * es);
    buf_download(be, s.dlogits, dlog, (size_t)lc * (size_t)E * 4);
    res.err = bench_max_rel_error(&s);
    free(s.y); free(s.dx); free(s.dw_gate_up); free(s.dw_down); free(s.dlogits);
  }
  void* dev[] = {y, dx, dwgu, dwd, dlog, ws, saved};
  for (size_t i = 0; i < sizeof dev / sizeof dev[0]; ++i) buf_free(be, dev[i]);
  if (be->cuda) { buf_free(be, x); buf_free(be, logits); buf_free(be, wgu); buf_free(be, wd); buf_free(be, dy); }
  free(s.x); free(s.logits); free(s.w_gate_up); free(s.w_down); free(s.dy);
  moeblaze_destroy(handle);
  return res;
}

/* The error a step may have against the fp64 reference, by storage dtype. */
static double tolerance(moeblaze_dtype_t t) { return t.bits == 32 ? 1e-4 : 2e-2; }

/* JSON has no NaN: missing numbers are null. */
static void json_number(FILE* f, const char* key, double v, const char* fmt) {
  fprintf(f, ",\"%s\":", key);
  if (isnan(v)) fprintf(f, "null");
  else fprintf(f, fmt, v);
}

int main(int argc, char** argv) {
  options o;
  parse(argc, argv, &o);
  bench_config cfgs[MAX_CONFIGS];
  int n = 0;
  for (int f = 0; f < o.num_configs; ++f) {
    int got = bench_read_configs(o.configs[f], cfgs + n, MAX_CONFIGS - n);
    if (got <= 0) { fprintf(stderr, "moeblaze-bench: cannot read configs from %s\n", o.configs[f]); return 1; }
    n += got;
  }
  for (int i = 0; i < o.num_shapes && n < MAX_CONFIGS; ++i) cfgs[n++] = o.shapes[i];

  int32_t gpus = 0;
  CHECK(moeblaze_get_device_count(MOEBLAZE_DEVICE_CUDA, &gpus));
  backend be;
  memset(&be, 0, sizeof be);
#ifdef MOEBLAZE_BENCH_CUDA
  be.cuda = o.device == 1 || (o.device == -1 && gpus > 0);
  if (be.cuda) {
    cudaStream_t st;
    cuda_check(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking), "stream");
    be.stream = st;
    for (int i = 0; i < 4; ++i) cuda_check(cudaEventCreate(&be.ev[i]), "event");
    if (cublasCreate(&be.blas) != CUBLAS_STATUS_SUCCESS) { fprintf(stderr, "moeblaze-bench: cublasCreate failed\n"); return 1; }
    cublasSetStream(be.blas, st);
  }
#else
  if (o.device == 1) { fprintf(stderr, "moeblaze-bench: built without CUDA\n"); return 1; }
#endif
  printf("# %s\n", moeblaze_get_build_info());
  if (be.cuda)
    printf("# engine: CUDA %s on device 0 of %d (the resolved engine is in the JSON); median of %d reps after warm-up, CUDA events; ceiling = dense bf16 cuBLAS GEMMs of the same FLOPs, timed after each repetition of the layer; %% of dense = the median of those pairs' ratios\n",
           o.engine == MOEBLAZE_ENGINE_CUDA_FUSED ? "fused" : o.engine == MOEBLAZE_ENGINE_CUDA_CUBLASLT ? "cuBLASLt" : "AUTO",
           gpus, o.reps > 0 ? o.reps : 20);
  if (be.cuda && o.window) printf("# fused engine windows of %lld tokens (MOEBLAZE_ATTR_WINDOW_TOKENS)\n", (long long)o.window);
  if (!be.cuda)
    printf("# engine: CPU reference (%d CUDA device(s) seen)%s. On the CPU these numbers show correctness, not speed:\n"
           "# the GPU results are in perf/RESULTS.md (and the README's summary).\n",
           gpus, o.tokens || o.quick ? "" : "; tokens reduced so that one fwd+bwd step costs about --cpu-gflop GFLOP");
  if (o.quick)
    printf("# --quick: each layer scaled down (d and n / 8, tokens / 512), one rep: a correctness check in seconds\n");
  printf("# dtype %s, policy %s, routing from logits (softmax); error: one step vs the fp64 reference on the first tokens, pass below %.0e\n",
         dtype_name(o.dtype), o.policy == MOEBLAZE_SAVE_PREACT ? "SAVE_PREACT" : o.policy == MOEBLAZE_SAVE_ALL ? "SAVE_ALL" : "RECOMPUTE_UP",
         tolerance(o.dtype));
  FILE* json = o.json ? fopen(o.json, "w") : NULL;
  if (o.json && !json) { fprintf(stderr, "moeblaze-bench: cannot write %s\n", o.json); return 1; }

  const char* unit = be.cuda ? "TFLOP/s" : "GFLOP/s";
  const double scale = be.cuda ? 1e-12 : 1e-9;
  printf("| config | act | tokens (full) | d | n | E | K | fwd ms | bwd ms | fwd+bwd ms | %s | ceiling ms | %% of dense | saved MiB | saved B/token | peak MiB | max rel err (tokens) | check |\n", unit);
  printf("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|\n");
  fflush(stdout);
  int rows = 0, row = 0, failed = 0;
  for (int ci = 0; ci < n; ++ci)
    if (selected(&o, cfgs[ci].name)) rows += o.num_activations;
  const double t_start = now_ms();
  for (int ci = 0; ci < n; ++ci) {
    bench_config quick_shape = cfgs[ci];
    const bench_config* c = &cfgs[ci];
    if (!selected(&o, c->name)) continue;
    if (o.quick) {  /* the same layer scaled down: d and n / 8, tokens / 512 (at least 2 per expert) */
      quick_shape.d = c->d / 8 > 8 ? c->d / 8 : 8;
      quick_shape.n = c->n / 8 > 8 ? c->n / 8 : 8;
      quick_shape.tokens = c->tokens / 512 > 2 * c->experts ? c->tokens / 512 : 2 * c->experts;
      c = &quick_shape;
    }
    for (int ai = 0; ai < o.num_activations; ++ai) {
      const int act = o.activations[ai];
      const int gated = act == MOEBLAZE_ACTIVATION_SWIGLU || act == MOEBLAZE_ACTIVATION_GEGLU;
      const double flop_per_token = 3.0 * 2.0 * (double)c->k * (double)c->d * (double)c->n * (gated ? 3.0 : 2.0);
      const int64_t L_full = cfgs[ci].tokens, L_cap = c->tokens; /* the config's tokens; this run's cap */
      int64_t L = o.tokens;
      if (L <= 0 && be.cuda) L = L_cap;
      if (L <= 0) {
        L = (int64_t)(o.cpu_gflop * 1e9 / flop_per_token);
        if (L < 2 * c->experts) L = 2 * c->experts; /* enough tokens that experts see work */
      }
      if (L > L_cap) L = L_cap;
      const double t_row = now_ms();
      result r = run_one(&be, &o, c, act, L);
      const double flops = flop_per_token * (double)L / (r.total * 1e-3) * scale;
      const double peak = (double)(r.saved + (r.ws_fwd > r.ws_bwd ? r.ws_fwd : r.ws_bwd));
      char ceiling[32] = "-", ratio[32] = "-"; /* no dense ceiling on the CPU */
      if (!isnan(r.ceiling)) {
        snprintf(ceiling, sizeof ceiling, "%.3f", r.ceiling);
        snprintf(ratio, sizeof ratio, "%.1f", 100.0 * r.dense_ratio);
      }
      const char* verdict = isnan(r.err) ? "-" : r.err <= tolerance(o.dtype) ? "pass" : "FAIL";
      failed += !isnan(r.err) && !(r.err <= tolerance(o.dtype));
      printf("| %s | %s | %lld (%lld) | %lld | %lld | %lld | %lld | %.3f | %.3f | %.3f | %.3f | %s | %s | %.2f | %.0f | %.2f | %.2e (%lld) | %s |\n",
             c->name, act_name(act), (long long)L, (long long)L_full, (long long)c->d, (long long)c->n, (long long)c->experts,
             (long long)c->k, r.fwd, r.bwd, r.total, flops, ceiling, ratio, (double)r.saved / 1048576.0, (double)r.saved / (double)L,
             peak / 1048576.0, r.err, (long long)r.check_tokens, verdict);
      fflush(stdout);
      fprintf(stderr, "moeblaze-bench: [%d/%d] %s %s, %lld tokens: %.1f s (%.0f s so far)\n", ++row, rows, c->name, act_name(act),
              (long long)L, (now_ms() - t_row) * 1e-3, (now_ms() - t_start) * 1e-3);
      if (json) {
        fprintf(json,
                "{\"config\":\"%s\",\"activation\":\"%s\",\"engine\":\"%s\",\"dtype\":\"%s\",\"tokens\":%lld,\"full_tokens\":%lld,"
                "\"d\":%lld,\"n\":%lld,\"experts\":%lld,\"k\":%lld",
                c->name, act_name(act),
                !be.cuda ? "cpu" : r.engine == MOEBLAZE_ENGINE_CUDA_FUSED ? "cuda_fused" : "cuda_cublaslt", dtype_name(o.dtype), (long long)L, (long long)L_full,
                (long long)c->d, (long long)c->n, (long long)c->experts, (long long)c->k);
        json_number(json, "fwd_ms", r.fwd, "%.4f");
        json_number(json, "bwd_ms", r.bwd, "%.4f");
        json_number(json, "fwd_bwd_ms", r.total, "%.4f");
        json_number(json, be.cuda ? "tflops" : "gflops", flops, "%.4f");
        json_number(json, "ceiling_ms", r.ceiling, "%.4f");
        json_number(json, "dense_ratio", r.dense_ratio, "%.4f");
        fprintf(json, ",\"saved_bytes\":%zu,\"workspace_fwd_bytes\":%zu,\"workspace_bwd_bytes\":%zu,\"peak_bytes\":%.0f", r.saved,
                r.ws_fwd, r.ws_bwd, peak);
        json_number(json, "max_rel_err", r.err, "%.3e");
        fprintf(json, ",\"check_tokens\":%lld,\"check\":%s}\n", (long long)r.check_tokens,
                isnan(r.err) ? "null" : r.err <= tolerance(o.dtype) ? "true" : "false");
      }
    }
  }
  if (json) fclose(json);
  if (o.check)
    printf("\n%s: %d of %d rows within the %s tolerance (%.0e) of the fp64 reference\n", failed ? "FAIL" : "PASS", row - failed, row,
           dtype_name(o.dtype), tolerance(o.dtype));
  return failed ? 1 : 0;
}
