/* moeblaze-bench: one MoE layer forward + backward on the paper's configs (routing from
 * logits, bf16 by default). Prints, per config and activation: median fwd / bwd / fwd+bwd
 * time, throughput, saved-activation bytes, peak bytes (saved + the larger workspace) and
 * the max relative error of one step against the fp64 reference.
 *
 * Without a usable GPU engine it runs the CPU engine at a reduced token count (chosen so a
 * step costs about --cpu-gflop GFLOP), and says so. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "bench.h"

#define MAX_CONFIGS 64

typedef struct options {
  const char* configs;
  const char* json;
  const char* only;      /* comma-separated config names, or NULL for all */
  int64_t tokens;        /* 0 = automatic */
  double cpu_gflop;      /* per fwd+bwd step on the CPU engine */
  int reps, warmup, threads, check;
  int32_t policy;
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

/* splitmix64 + Box-Muller: reproducible inputs. */
static uint64_t rng_state = 0x5eed;
static double rng_normal(void) {
  uint64_t z1 = (rng_state += 0x9E3779B97F4A7C15ull), z2 = (rng_state += 0x9E3779B97F4A7C15ull);
  z1 = (z1 ^ (z1 >> 30)) * 0xBF58476D1CE4E5B9ull; z1 = (z1 ^ (z1 >> 27)) * 0x94D049BB133111EBull; z1 ^= z1 >> 31;
  z2 = (z2 ^ (z2 >> 30)) * 0xBF58476D1CE4E5B9ull; z2 = (z2 ^ (z2 >> 27)) * 0x94D049BB133111EBull; z2 ^= z2 >> 31;
  double u1 = ((double)(z1 >> 11) + 0.5) * (1.0 / 9007199254740992.0), u2 = (double)(z2 >> 11) * (1.0 / 9007199254740992.0);
  return sqrt(-2.0 * log(u1)) * cos(6.283185307179586 * u2);
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

static moeblaze_tensor_t tensor(void* data, moeblaze_dtype_t t, int32_t ndim, const int64_t* shape) {
  moeblaze_tensor_t x;
  memset(&x, 0, sizeof x);
  x.data = data;
  x.device.device_type = MOEBLAZE_DEVICE_CPU;
  x.ndim = ndim;
  x.dtype = t;
  x.shape = shape;
  return x;
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

static void usage(void) {
  printf("usage: moeblaze-bench [--configs FILE] [--only conf1,conf3] [--activations silu,swiglu]\n"
         "                      [--dtype bf16|f16|f32] [--policy preact|recompute|all] [--tokens N]\n"
         "                      [--cpu-gflop G] [--reps N] [--warmup N] [--threads N] [--no-check] [--json FILE]\n");
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
  o->configs = MOEBLAZE_DEFAULT_CONFIGS;
  o->cpu_gflop = 6.0;
  o->reps = -1;
  o->warmup = 1;
  o->check = 1;
  o->policy = MOEBLAZE_SAVE_PREACT;
  moeblaze_dtype_t bf16 = MOEBLAZE_DTYPE_BF16;
  o->dtype = bf16;
  o->activations[0] = MOEBLAZE_ACTIVATION_SILU;
  o->activations[1] = MOEBLAZE_ACTIVATION_SWIGLU;
  o->num_activations = 2;
  for (int i = 1; i < argc; ++i) {
    const char* a = argv[i];
    const char* v = i + 1 < argc ? argv[i + 1] : NULL;
    if (!strcmp(a, "--help") || !strcmp(a, "-h")) { usage(); exit(0); }
    else if (!strcmp(a, "--no-check")) { o->check = 0; continue; }
    if (!v) { usage(); exit(2); }
    ++i;
    if (!strcmp(a, "--configs")) o->configs = v;
    else if (!strcmp(a, "--only")) o->only = v;
    else if (!strcmp(a, "--json")) o->json = v;
    else if (!strcmp(a, "--tokens")) o->tokens = atoll(v);
    else if (!strcmp(a, "--cpu-gflop")) o->cpu_gflop = atof(v);
    else if (!strcmp(a, "--reps")) o->reps = atoi(v);
    else if (!strcmp(a, "--warmup")) o->warmup = atoi(v);
    else if (!strcmp(a, "--threads")) o->threads = atoi(v);
    else if (!strcmp(a, "--policy")) {
      o->policy = !strcmp(v, "recompute") ? MOEBLAZE_SAVE_RECOMPUTE_UP : !strcmp(v, "all") ? MOEBLAZE_SAVE_ALL : MOEBLAZE_SAVE_PREACT;
    } else if (!strcmp(a, "--dtype")) {
      moeblaze_dtype_t f32 = MOEBLAZE_DTYPE_F32, f16 = MOEBLAZE_DTYPE_F16;
      o->dtype = !strcmp(v, "f32") ? f32 : !strcmp(v, "f16") ? f16 : bf16;
    } else if (!strcmp(a, "--activations")) {
      o->num_activations = 0;
      char buf[128];
      snprintf(buf, sizeof buf, "%s", v);
      for (char* t = strtok(buf, ","); t && o->num_activations < 8; t = strtok(NULL, ",")) {
        int act = act_from_name(t);
        if (act < 0) { fprintf(stderr, "unknown activation %s\n", t); exit(2); }
        o->activations[o->num_activations++] = act;
      }
    } else { usage(); exit(2); }
  }
}

int main(int argc, char** argv) {
  options o;
  parse(argc, argv, &o);
  bench_config cfgs[MAX_CONFIGS];
  int n = bench_read_configs(o.configs, cfgs, MAX_CONFIGS);
  if (n <= 0) { fprintf(stderr, "moeblaze-bench: cannot read configs from %s\n", o.configs); return 1; }

  int32_t gpus = 0;
  CHECK(moeblaze_get_device_count(MOEBLAZE_DEVICE_CUDA, &gpus));
  printf("# %s\n", moeblaze_get_build_info());
  printf("# CUDA devices: %d; engine: CPU reference (the CUDA engines arrive in 0.2)%s\n", gpus,
         o.tokens ? "" : "; tokens reduced so that one fwd+bwd step costs about --cpu-gflop GFLOP");
  printf("# dtype %s, policy %s, routing from logits (softmax), h = 4 d\n", dtype_name(o.dtype),
         o.policy == MOEBLAZE_SAVE_PREACT ? "SAVE_PREACT" : o.policy == MOEBLAZE_SAVE_ALL ? "SAVE_ALL" : "RECOMPUTE_UP");
  FILE* json = o.json ? fopen(o.json, "w") : NULL;
  if (o.json && !json) { fprintf(stderr, "moeblaze-bench: cannot write %s\n", o.json); return 1; }

  printf("| config | act | tokens (paper) | fwd ms | bwd ms | fwd+bwd ms | GFLOP/s | saved MiB | saved B/token | peak MiB | max rel err |\n");
  printf("|---|---|---|---|---|---|---|---|---|---|---|\n");
  fflush(stdout);
  for (int ci = 0; ci < n; ++ci) {
    const bench_config* c = &cfgs[ci];
    if (!selected(&o, c->name)) continue;
    for (int ai = 0; ai < o.num_activations; ++ai) {
      const int act = o.activations[ai];
      const int gated = act == MOEBLAZE_ACTIVATION_SWIGLU || act == MOEBLAZE_ACTIVATION_GEGLU;
      const int64_t d = c->d, h = 4 * c->d, E = c->experts, k = c->k, gh = (gated ? 2 : 1) * h;
      const int64_t L_paper = c->batch * c->seq;
      const double flop_per_token = 3.0 * 2.0 * (double)k * (double)d * (double)h * (gated ? 3.0 : 2.0);
      int64_t L = o.tokens;
      if (L <= 0) {
        L = (int64_t)(o.cpu_gflop * 1e9 / flop_per_token);
        if (L < 2 * E) L = 2 * E; /* enough tokens that experts see work */
      }
      if (L > L_paper) L = L_paper;

      moeblaze_config_t cfg;
      CHECK(moeblaze_config_create(&cfg));
      CHECK(moeblaze_config_set_i64(cfg, MOEBLAZE_ATTR_DEVICE_TYPE, MOEBLAZE_DEVICE_CPU));
      CHECK(moeblaze_config_set_i64(cfg, MOEBLAZE_ATTR_NUM_EXPERTS, E));
      CHECK(moeblaze_config_set_i64(cfg, MOEBLAZE_ATTR_TOP_K, k));
      CHECK(moeblaze_config_set_i64(cfg, MOEBLAZE_ATTR_HIDDEN_SIZE, d));
      CHECK(moeblaze_config_set_i64(cfg, MOEBLAZE_ATTR_FFN_HIDDEN_SIZE, h));
      CHECK(moeblaze_config_set_i64(cfg, MOEBLAZE_ATTR_MAX_TOKENS, L));
      CHECK(moeblaze_config_set_i64(cfg, MOEBLAZE_ATTR_ACTIVATION, act));
      CHECK(moeblaze_config_set_i64(cfg, MOEBLAZE_ATTR_SAVE_POLICY, o.policy));
      CHECK(moeblaze_config_set_i64(cfg, MOEBLAZE_ATTR_NUM_THREADS, o.threads));
      CHECK(moeblaze_config_set_dtype(cfg, MOEBLAZE_ATTR_ACTIVATION_DTYPE, o.dtype));
      CHECK(moeblaze_config_set_dtype(cfg, MOEBLAZE_ATTR_WEIGHT_DTYPE, o.dtype));
      moeblaze_handle_t handle;
      CHECK(moeblaze_create(&handle, cfg));
      moeblaze_config_destroy(cfg);

      const moeblaze_dtype_t dt = o.dtype, f32 = MOEBLAZE_DTYPE_F32;
      bench_step s;
      memset(&s, 0, sizeof s);
      s.L = L; s.d = d; s.h = h; s.E = E; s.k = k; s.activation = act; s.dtype = dt;
      s.x = random_tensor(dt, (size_t)(L * d), 1.0);
      s.logits = random_tensor(f32, (size_t)(L * E), 1.0);
      s.w_gate_up = random_tensor(dt, (size_t)(E * d * gh), 1.0 / sqrt((double)d));
      s.w_down = random_tensor(dt, (size_t)(E * h * d), 1.0 / sqrt((double)h));
      s.dy = random_tensor(dt, (size_t)(L * d), 1.0);
      s.y = alloc_aligned((size_t)(L * d) * dsize(dt));
      s.dx = alloc_aligned((size_t)(L * d) * dsize(dt));
      s.dw_gate_up = alloc_aligned((size_t)(E * d * gh) * dsize(dt));
      s.dw_down = alloc_aligned((size_t)(E * h * d) * dsize(dt));
      s.dlogits = alloc_aligned((size_t)(L * E) * 4u);

      const int64_t sx[2] = {L, d}, sl[2] = {L, E}, sw[3] = {E, d, gh}, sd[3] = {E, h, d};
      moeblaze_arg_t fwd[5] = {
          {MOEBLAZE_ARG_INPUT, 0, tensor(s.x, dt, 2, sx)}, {MOEBLAZE_ARG_ROUTER_LOGITS, 0, tensor(s.logits, f32, 2, sl)},
          {MOEBLAZE_ARG_W_GATE_UP, 0, tensor(s.w_gate_up, dt, 3, sw)}, {MOEBLAZE_ARG_W_DOWN, 0, tensor(s.w_down, dt, 3, sd)},
          {MOEBLAZE_ARG_OUTPUT, 0, tensor(s.y, dt, 2, sx)}};
      moeblaze_arg_t bwd[9] = {
          fwd[0], fwd[1], fwd[2], fwd[3],
          {MOEBLAZE_ARG_GRAD_OUTPUT, 0, tensor(s.dy, dt, 2, sx)}, {MOEBLAZE_ARG_GRAD_INPUT, 0, tensor(s.dx, dt, 2, sx)},
          {MOEBLAZE_ARG_GRAD_W_GATE_UP, 0, tensor(s.dw_gate_up, dt, 3, sw)},
          {MOEBLAZE_ARG_GRAD_W_DOWN, 0, tensor(s.dw_down, dt, 3, sd)},
          {MOEBLAZE_ARG_GRAD_ROUTER_LOGITS, 0, tensor(s.dlogits, f32, 2, sl)}};
      size_t ws_fwd = 0, ws_bwd = 0, saved_bytes = 0;
      CHECK(moeblaze_get_workspace_size(handle, MOEBLAZE_PASS_FORWARD_TRAINING, L, &ws_fwd));
      CHECK(moeblaze_get_workspace_size(handle, MOEBLAZE_PASS_BACKWARD, L, &ws_bwd));
      CHECK(moeblaze_get_saved_size(handle, L, &saved_bytes));
      const size_t ws_bytes = ws_fwd > ws_bwd ? ws_fwd : ws_bwd;
      void* ws = alloc_aligned(ws_bytes);
      void* saved = alloc_aligned(saved_bytes);

      const int reps = o.reps > 0 ? o.reps : 3;
      double* tf = malloc(sizeof(double) * (size_t)reps);
      double* tb = malloc(sizeof(double) * (size_t)reps);
      double* tt = malloc(sizeof(double) * (size_t)reps);
      for (int r = -o.warmup; r < reps; ++r) {
        double t0 = now_ms();
        CHECK(moeblaze_forward(handle, MOEBLAZE_PASS_FORWARD_TRAINING, fwd, 5, ws, ws_bytes, saved, saved_bytes, NULL));
        double t1 = now_ms();
        CHECK(moeblaze_backward(handle, bwd, 9, saved, saved_bytes, ws, ws_bytes, NULL));
        double t2 = now_ms();
        if (r >= 0) { tf[r] = t1 - t0; tb[r] = t2 - t1; tt[r] = t2 - t0; }
      }
      const double mf = median(tf, reps), mb = median(tb, reps), mt = median(tt, reps);
      const double gflops = flop_per_token * (double)L / (mt * 1e-3) * 1e-9;
      const double err = o.check ? bench_max_rel_error(&s) : NAN;
      const double peak = (double)(saved_bytes + ws_bytes);
      char tokens[64];
      snprintf(tokens, sizeof tokens, "%lld (%lld)", (long long)L, (long long)L_paper);
      printf("| %s | %s | %s | %.2f | %.2f | %.2f | %.1f | %.2f | %.0f | %.2f | %.2e |\n", c->name, act_name(act), tokens,
             mf, mb, mt, gflops, (double)saved_bytes / 1048576.0, (double)saved_bytes / (double)L, peak / 1048576.0, err);
      fflush(stdout);
      if (json)
        fprintf(json,
                "{\"config\":\"%s\",\"activation\":\"%s\",\"engine\":\"cpu\",\"dtype\":\"%s\",\"tokens\":%lld,\"paper_tokens\":%lld,"
                "\"d\":%lld,\"h\":%lld,\"experts\":%lld,\"k\":%lld,\"fwd_ms\":%.4f,\"bwd_ms\":%.4f,\"fwd_bwd_ms\":%.4f,"
                "\"gflops\":%.3f,\"saved_bytes\":%zu,\"workspace_fwd_bytes\":%zu,\"workspace_bwd_bytes\":%zu,"
                "\"peak_bytes\":%.0f,\"max_rel_err\":%.3e}\n",
                c->name, act_name(act), dtype_name(dt), (long long)L, (long long)L_paper, (long long)d, (long long)h,
                (long long)E, (long long)k, mf, mb, mt, gflops, saved_bytes, ws_fwd, ws_bwd, peak, err);
      free(tf); free(tb); free(tt);
      free(ws); free(saved);
      free(s.x); free(s.logits); free(s.w_gate_up); free(s.w_down); free(s.dy);
      free(s.y); free(s.dx); free(s.dw_gate_up); free(s.dw_down); free(s.dlogits);
      moeblaze_destroy(handle);
    }
  }
  if (json) fclose(json);
  return 0;
}
