/* Differential fuzzer of the CUDA engines against the CPU engine, for a time budget.
 *
 * Each case draws a layer (E, k, d, h, activation, score function, renormalisation, loss
 * coefficients, save policy, dtype, engine, token window), a token count, a routing (logits,
 * router weight, or caller ids: uniform, skewed onto a few experts, leaving experts empty, or
 * bad: out of range or repeated) and a layout for every tensor (contiguous, rows padded to a
 * pitch, experts spaced tightly, expert weights column-major), then runs forward (training) and
 * backward on a CUDA handle and on a CPU handle with the same logical inputs. Every device
 * buffer has 256 canary bytes on both sides; outputs are poisoned (NaN) before each run, or
 * filled with values when a gradient accumulates. Checked: statuses (a refused configuration
 * must say why), the STATUS argument, canaries, ids and token counts exactly, the rest within
 * the dtype's tolerance, and on some cases a second run bitwise.
 *
 * Usage: fuzz_gpu [seconds (default 20)] [seed]. Prints one line per finding and a summary
 * last; exits 1 on a finding, 77 without a CUDA device. FUZZ_CASE=<case seed> (as a finding
 * prints it) runs that one case alone and prints every compared tensor's error; vary() lists the
 * variations it takes from the environment. */
#define _POSIX_C_SOURCE 200809L
#include <cuda_runtime.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "grad_conditioning.h"
#include "test_util.h"

enum { CANARY = 256 };
static const unsigned char kCanary = 0xA5;

static int g_findings;
static int g_verbose; /* FUZZ_CASE: every compared tensor's error, not only the failing ones */
static char g_last_message[512]; /* the CUDA run's failing call's message */
static uint64_t g_case_seed;

static void finding(const char* fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  printf("FINDING (case seed %llu): ", (unsigned long long)g_case_seed);
  vprintf(fmt, ap);
  printf("\n");
  va_end(ap);
  fflush(stdout);
  ++g_findings;
}

#define CUDA_OR_DIE(call)                                                                     \
  do {                                                                                        \
    cudaError_t e_ = (call);                                                                  \
    if (e_ != cudaSuccess) {                                                                  \
      printf("FATAL %s: %s (case seed %llu)\n", #call, cudaGetErrorString(e_), (unsigned long long)g_case_seed); \
      exit(1);                                                                                \
    }                                                                                         \
  } while (0)

/* ---- a tensor: logical row-major host data, and a device copy in some layout ---- */
typedef struct tensor {
  const char* name;
  moeblaze_dtype_t dt;
  int nd;
  int64_t shape[3];     /* logical */
  int64_t strides[3];   /* device layout, in elements */
  int strided;          /* 0: NULL strides (row-major) */
  size_t n;             /* logical elements */
  size_t extent;        /* device elements from the first to one past the last */
  void* host;           /* logical, row-major (CPU engine's copy) */
  unsigned char* base;  /* device allocation: canary | data | canary */
  void* dev;
} tensor;

static size_t elem(const tensor* t) { return tu_dtype_size(t->dt); }

/* Logical index -> device element offset. */
static size_t dev_offset(const tensor* t, size_t i) {
  int64_t idx[3] = {0, 0, 0}, rest = (int64_t)i;
  for (int d = t->nd - 1; d >= 0; --d) {
    idx[d] = t->shape[d] ? rest % t->shape[d] : 0;
    rest = t->shape[d] ? rest / t->shape[d] : 0;
  }
  size_t off = 0;
  for (int d = 0; d < t->nd; ++d) off += (size_t)(idx[d] * t->strides[d]);
  return off;
}

/* Layout kinds for a [A, R, C] or [R, C] tensor. */
enum { LAYOUT_ROWMAJOR, LAYOUT_PADDED, LAYOUT_TIGHT, LAYOUT_COLUMNS, LAYOUT_COUNT };

static void set_layout(tensor* t, int layout, tu_rng* r) {
  const int nd = t->nd;
  int64_t contiguous = 1;
  for (int d = nd - 1; d >= 0; --d) { t->strides[d] = contiguous; contiguous *= t->shape[d] > 0 ? t->shape[d] : 1; }
  t->strided = layout != LAYOUT_ROWMAJOR || tu_rng_below(r, 2);
  if (nd >= 2 && layout != LAYOUT_ROWMAJOR) {
    const int64_t pads[4] = {8, 1, 3, 64};
    const int64_t pad = pads[tu_rng_below(r, 4)];
    const int64_t R = t->shape[nd - 2], C = t->shape[nd - 1];
    if (layout == LAYOUT_COLUMNS && nd == 3) {
      const int64_t pitch = R + pad;  /* each [R, C] matrix column-major: element (r, c) at c * pitch + r */
      t->strides[2] = pitch;
      t->strides[1] = 1;
      t->strides[0] = tu_rng_below(r, 2) ? C * pitch : (C - 1) * pitch + R;
    } else {
      const int64_t pitch = C + pad;
      t->strides[nd - 1] = 1;
      t->strides[nd - 2] = pitch;
      if (nd == 3) t->strides[0] = layout == LAYOUT_TIGHT ? (R - 1) * pitch + C : R * pitch;
    }
  }
  size_t last = 0;
  for (int d = 0; d < nd; ++d) last += (size_t)((t->shape[d] > 0 ? t->shape[d] - 1 : 0) * t->strides[d]);
  t->extent = t->n ? last + 1 : 0;
}

static void make_tensor(tensor* t, const char* name, moeblaze_dtype_t dt, int nd, int64_t a, int64_t b, int64_t c) {
  memset(t, 0, sizeof *t);
  t->name = name;
  t->dt = dt;
  t->nd = nd;
  t->shape[0] = a; t->shape[1] = b; t->shape[2] = c;
  t->n = 1;
  for (int d = 0; d < nd; ++d) t->n *= (size_t)t->shape[d];
  t->host = tu_alloc(dt, t->n + 1);
}

/* Allocates the device copy (with canaries) and uploads the logical data into the layout;
 * bytes between the layout's elements are poisoned. */
static void upload(tensor* t) {
  const size_t bytes = t->extent * elem(t);
  CUDA_OR_DIE(cudaMalloc((void**)&t->base, bytes + 2 * CANARY));
  t->dev = t->base + CANARY;
  unsigned char* phys = malloc(bytes + 2 * CANARY);
  memset(phys, kCanary, CANARY);
  memset(phys + CANARY, 0xFF, bytes);
  memset(phys + CANARY + bytes, kCanary, CANARY);
  for (size_t i = 0; i < t->n; ++i)
    memcpy(phys + CANARY + dev_offset(t, i) * elem(t), (char*)t->host + i * elem(t), elem(t));
  CUDA_OR_DIE(cudaMemcpy(t->base, phys, bytes + 2 * CANARY, cudaMemcpyHostToDevice));
  free(phys);
}

/* Device -> `out` (logical, row-major); checks both canaries. Returns 0 when they are intact. */
static int download(const tensor* t, void* out) {
  const size_t bytes = t->extent * elem(t);
  unsigned char* phys = malloc(bytes + 2 * CANARY);
  CUDA_OR_DIE(cudaMemcpy(phys, t->base, bytes + 2 * CANARY, cudaMemcpyDeviceToHost));
  int bad = 0;
  for (size_t i = 0; i < CANARY; ++i) bad |= phys[i] != kCanary || phys[CANARY + bytes + i] != kCanary;
  if (out)
    for (size_t i = 0; i < t->n; ++i)
      memcpy((char*)out + i * elem(t), phys + CANARY + dev_offset(t, i) * elem(t), elem(t));
  free(phys);
  if (bad) finding("%s: a canary byte around its device buffer was overwritten", t->name);
  return bad;
}

static void free_tensor(tensor* t) {
  if (t->base) cudaFree(t->base);
  tu_free(t->host);
  memset(t, 0, sizeof *t);
}

static moeblaze_arg_t arg_of(const tensor* t, int32_t kind, int cuda, uint32_t flags) {
  int64_t* shape = (int64_t*)t->shape;
  moeblaze_tensor_t x = tu_tensor(cuda ? t->dev : t->host, t->dt, t->nd, shape);
  if (cuda) {
    x.device.device_type = MOEBLAZE_DEVICE_CUDA;
    x.strides = t->strided ? t->strides : NULL;
  }
  moeblaze_arg_t a = tu_arg(kind, x);
  a.flags = flags;
  return a;
}

/* ---- one case ---- */
enum { MODE_LOGITS, MODE_WG, MODE_CALLER };
enum { T_X, T_WG, T_LOG, T_WGU, T_WD, T_IDS, T_GW, T_DY, /* inputs */
       T_Y, T_OID, T_OW, T_TPE, T_AUX, T_Z, /* forward outputs */
       T_DX, T_DWGU, T_DWD, T_DROUTER, /* gradients */
       T_COUNT };

typedef struct fcase {
  tu_layer layer;
  int64_t L;
  int mode, bad_ids, accumulate, repeat;
  int layout[T_COUNT];
  int last_use; /* the CUDA run's backward is moeblaze_backward_last_use */
} fcase;

typedef struct counters {
  long cases, runs, compared, refused_create, refused_call, bad_id_cases, tie_skips, repeats;
} counters;

static int64_t pick(tu_rng* r, const int64_t* v, int n) { return v[tu_rng_below(r, n)]; }

static void draw(fcase* c, tu_rng* r) {
  memset(c, 0, sizeof *c);
  static const int64_t Es[] = {1, 2, 3, 4, 7, 8, 16, 32, 64, 128, 256};
  static const int64_t dims[] = {8, 16, 24, 32, 40, 64, 96, 128, 136, 256, 384, 512, 768, 1024, 12, 20};
  const int64_t E = pick(r, Es, 11);
  const int64_t k = 1 + tu_rng_below(r, E < 8 ? E : 8);
  int64_t d = pick(r, dims, 16), h = pick(r, dims, 16);
  const int64_t act = tu_rng_below(r, 5);
  const int gated = act == MOEBLAZE_ACTIVATION_SWIGLU || act == MOEBLAZE_ACTIVATION_GEGLU;
  while (E * d * h * (gated ? 3 : 2) > ((int64_t)1 << 23)) { if (d > h) d /= 2; else h /= 2; }
  int64_t max_tokens = 1 + tu_rng_below(r, 4096);
  while (max_tokens * k * d * h > ((int64_t)1 << 29) && max_tokens > 1) max_tokens /= 2;
  tu_layer l = tu_layer_default(E, k, d, h, max_tokens, act);
  l.score_fn = tu_rng_below(r, 2);
  l.normalize = tu_rng_below(r, 2);
  l.aux_coeff = tu_rng_below(r, 2) ? 0.01 : 0.0;
  l.z_coeff = tu_rng_below(r, 2) ? 0.001 : 0.0;
  l.save_policy = tu_rng_below(r, 3);
  const int64_t dt = tu_rng_below(r, 10);
  l.act_dtype = l.weight_dtype = dt < 6 ? tu_bf16 : dt < 9 ? tu_f16 : tu_f32;
  const int64_t eng = tu_rng_below(r, 5);
  l.engine = eng < 3 ? MOEBLAZE_ENGINE_CUDA_FUSED : eng < 4 ? MOEBLAZE_ENGINE_CUDA_CUBLASLT : MOEBLAZE_ENGINE_AUTO;
  if (tu_rng_below(r, 3) == 0) l.window_tokens = 1 + tu_rng_below(r, max_tokens);
  else if (tu_rng_below(r, 4) == 0) l.window_bytes = 1 + tu_rng_below(r, max_tokens * 4096); /* a budget: 1024+ token windows */
  c->layer = l;
  const int64_t lpick = tu_rng_below(r, 8);
  c->L = lpick == 0 ? 0 : lpick == 1 ? 1 : lpick == 2 ? max_tokens : tu_rng_below(r, max_tokens + 1);
  const int64_t m = tu_rng_below(r, 10);
  c->mode = m < 5 ? MODE_LOGITS : m < 7 ? MODE_WG : MODE_CALLER;
  c->bad_ids = c->mode == MODE_CALLER && c->L > 0 && tu_rng_below(r, 6) == 0;
  c->accumulate = tu_rng_below(r, 6) == 0;
  c->repeat = tu_rng_below(r, 5) == 0;
  for (int i = 0; i < T_COUNT; ++i) {
    const int64_t v = tu_rng_below(r, 10);
    c->layout[i] = v < 6 ? LAYOUT_ROWMAJOR : v < 8 ? LAYOUT_PADDED : v < 9 ? LAYOUT_TIGHT : LAYOUT_COLUMNS;
    const int weight = i == T_WGU || i == T_WD || i == T_DWGU || i == T_DWD;
    if (!weight && c->layout[i] == LAYOUT_COLUMNS) c->layout[i] = LAYOUT_PADDED;
  }
  c->last_use = tu_rng_below(r, 2) == 0;
}

static const char* describe(const fcase* c, char* buf, size_t n) {
  const tu_layer* l = &c->layer;
  snprintf(buf, n, "L=%lld E=%lld k=%lld d=%lld h=%lld act=%lld score=%lld norm=%lld aux=%g z=%g policy=%lld %s engine=%lld "
           "window=%lld window_bytes=%lld mode=%d bad_ids=%d acc=%d last_use=%d layouts=[x%d y%d wgu%d wd%d dwgu%d dwd%d]",
           (long long)c->L, (long long)l->experts, (long long)l->top_k, (long long)l->d, (long long)l->h,
           (long long)l->activation, (long long)l->score_fn, (long long)l->normalize, l->aux_coeff, l->z_coeff,
           (long long)l->save_policy, tu_dtype_name(l->act_dtype), (long long)l->engine, (long long)l->window_tokens,
           (long long)l->window_bytes, c->mode, c->bad_ids, c->accumulate, c->last_use, c->layout[T_X], c->layout[T_Y],
           c->layout[T_WGU], c->layout[T_WD],
           c->layout[T_DWGU], c->layout[T_DWD]);
  return buf;
}

/* The tensors of a case, host data filled; device copies made by run_gpu. */
static void make_tensors(const fcase* c, tensor* t, tu_rng* r) {
  const tu_layer* l = &c->layer;
  const int64_t L = c->L, E = l->experts, k = l->top_k, d = l->d, h = l->h;
  const int gated = l->activation == MOEBLAZE_ACTIVATION_SWIGLU || l->activation == MOEBLAZE_ACTIVATION_GEGLU;
  const int64_t gh = (gated ? 2 : 1) * h;
  const moeblaze_dtype_t at = l->act_dtype, wt = l->weight_dtype;
  make_tensor(&t[T_X], "INPUT", at, 2, L, d, 0);
  make_tensor(&t[T_WG], "ROUTER_WEIGHT", wt, 2, E, d, 0);
  make_tensor(&t[T_LOG], "ROUTER_LOGITS", tu_f32, 2, L, E, 0);
  make_tensor(&t[T_WGU], "W_GATE_UP", wt, 3, E, d, gh);
  make_tensor(&t[T_WD], "W_DOWN", wt, 3, E, h, d);
  make_tensor(&t[T_IDS], "TOPK_INDICES (in)", tu_i32, 2, L, k, 0);
  make_tensor(&t[T_GW], "TOPK_WEIGHTS (in)", tu_f32, 2, L, k, 0);
  make_tensor(&t[T_DY], "GRAD_OUTPUT", at, 2, L, d, 0);
  make_tensor(&t[T_Y], "OUTPUT", at, 2, L, d, 0);
  make_tensor(&t[T_OID], "TOPK_INDICES", tu_i32, 2, L, k, 0);
  make_tensor(&t[T_OW], "TOPK_WEIGHTS", tu_f32, 2, L, k, 0);
  make_tensor(&t[T_TPE], "TOKENS_PER_EXPERT", tu_i64, 1, E, 0, 0);
  make_tensor(&t[T_AUX], "AUX_LOSS", tu_f32, 0, 0, 0, 0);
  make_tensor(&t[T_Z], "Z_LOSS", tu_f32, 0, 0, 0, 0);
  make_tensor(&t[T_DX], "GRAD_INPUT", at, 2, L, d, 0);
  make_tensor(&t[T_DWGU], "GRAD_W_GATE_UP", wt, 3, E, d, gh);
  make_tensor(&t[T_DWD], "GRAD_W_DOWN", wt, 3, E, h, d);
  if (c->mode == MODE_LOGITS) make_tensor(&t[T_DROUTER], "GRAD_ROUTER_LOGITS", tu_f32, 2, L, E, 0);
  else if (c->mode == MODE_WG) make_tensor(&t[T_DROUTER], "GRAD_ROUTER_WEIGHT", wt, 2, E, d, 0);
  else make_tensor(&t[T_DROUTER], "GRAD_TOPK_WEIGHTS", tu_f32, 2, L, k, 0);
  tu_fill_normal(r, t[T_X].host, at, t[T_X].n, 1.0);
  tu_fill_normal(r, t[T_WG].host, wt, t[T_WG].n, 1.0 / sqrt((double)d));
  tu_fill_normal(r, t[T_LOG].host, tu_f32, t[T_LOG].n, 1.5);
  tu_fill_normal(r, t[T_WGU].host, wt, t[T_WGU].n, 1.0 / sqrt((double)d));
  tu_fill_normal(r, t[T_WD].host, wt, t[T_WD].n, 1.0 / sqrt((double)h));
  tu_fill_normal(r, t[T_DY].host, at, t[T_DY].n, 1.0);
  /* caller routing: uniform, skewed onto the first few experts, or leaving the last half empty */
  const int64_t skew = tu_rng_below(r, 3);
  const int64_t span = skew == 1 ? (k + tu_rng_below(r, 2) < E ? k + tu_rng_below(r, 2) : E) : skew == 2 ? (E / 2 > k ? E / 2 : k) : E;
  int64_t* perm = malloc(sizeof(int64_t) * (size_t)E);
  for (int64_t tok = 0; tok < L; ++tok) {
    for (int64_t e = 0; e < span; ++e) perm[e] = e;
    for (int64_t e = span - 1; e > 0; --e) { int64_t j = tu_rng_below(r, e + 1), tmp = perm[e]; perm[e] = perm[j]; perm[j] = tmp; }
    for (int64_t j = 0; j < k; ++j) {
      ((int32_t*)t[T_IDS].host)[tok * k + j] = (int32_t)perm[j];
      ((float*)t[T_GW].host)[tok * k + j] = (float)(0.1 + tu_rng_uniform(r));
    }
  }
  free(perm);
  if (c->bad_ids) {
    const int64_t pos = tu_rng_below(r, L * k);
    const int64_t how = tu_rng_below(r, 4);
    int32_t* ids = t[T_IDS].host;
    if (how == 0) ids[pos] = (int32_t)E;
    else if (how == 1) ids[pos] = -1;
    else if (how == 2) ids[pos] = INT32_MAX;
    else if (k > 1) ids[pos - pos % k + (pos % k + 1) % k] = ids[pos]; /* repeated within a token */
    else ids[pos] = (int32_t)E + 7;
  }
  for (int i = 0; i < T_COUNT; ++i) set_layout(&t[i], c->layout[i], r);
  /* accumulated gradients start from values; others are poisoned */
  for (int i = T_Y; i < T_COUNT; ++i) {
    const int acc = c->accumulate && (i == T_DWGU || i == T_DWD || i == T_DROUTER || i == T_DX);
    if (acc) tu_fill_normal(r, t[i].host, t[i].dt, t[i].n, 0.5);
    else tu_poison(t[i].host, t[i].dt, t[i].n);
  }
}

typedef struct outputs {
  void* v[T_COUNT]; /* logical copies of every output slot */
} outputs;

static void free_outputs(outputs* o) {
  for (int i = 0; i < T_COUNT; ++i) tu_free(o->v[i]);
  memset(o, 0, sizeof *o);
}

/* Argument lists of forward (training) and backward. */
static size_t forward_args(const fcase* c, const tensor* t, int cuda, moeblaze_arg_t* a) {
  size_t n = 0;
  a[n++] = arg_of(&t[T_X], MOEBLAZE_ARG_INPUT, cuda, 0);
  a[n++] = arg_of(&t[T_WGU], MOEBLAZE_ARG_W_GATE_UP, cuda, 0);
  a[n++] = arg_of(&t[T_WD], MOEBLAZE_ARG_W_DOWN, cuda, 0);
  a[n++] = arg_of(&t[T_Y], MOEBLAZE_ARG_OUTPUT, cuda, 0);
  a[n++] = arg_of(&t[T_TPE], MOEBLAZE_ARG_TOKENS_PER_EXPERT, cuda, 0);
  if (c->mode == MODE_CALLER) {
    a[n++] = arg_of(&t[T_IDS], MOEBLAZE_ARG_TOPK_INDICES, cuda, 0);
    a[n++] = arg_of(&t[T_GW], MOEBLAZE_ARG_TOPK_WEIGHTS, cuda, 0);
  } else {
    a[n++] = c->mode == MODE_LOGITS ? arg_of(&t[T_LOG], MOEBLAZE_ARG_ROUTER_LOGITS, cuda, 0)
                                    : arg_of(&t[T_WG], MOEBLAZE_ARG_ROUTER_WEIGHT, cuda, 0);
    a[n++] = arg_of(&t[T_OID], MOEBLAZE_ARG_TOPK_INDICES, cuda, 0);
    a[n++] = arg_of(&t[T_OW], MOEBLAZE_ARG_TOPK_WEIGHTS, cuda, 0);
    a[n++] = arg_of(&t[T_AUX], MOEBLAZE_ARG_AUX_LOSS, cuda, 0);
    a[n++] = arg_of(&t[T_Z], MOEBLAZE_ARG_Z_LOSS, cuda, 0);
  }
  return n;
}

static size_t backward_args(const fcase* c, const tensor* t, int cuda, moeblaze_arg_t* a) {
  const uint32_t acc = c->accumulate ? MOEBLAZE_ARG_FLAG_ACCUMULATE : 0;
  size_t n = 0;
  a[n++] = arg_of(&t[T_X], MOEBLAZE_ARG_INPUT, cuda, 0);
  a[n++] = arg_of(&t[T_WGU], MOEBLAZE_ARG_W_GATE_UP, cuda, 0);
  a[n++] = arg_of(&t[T_WD], MOEBLAZE_ARG_W_DOWN, cuda, 0);
  a[n++] = arg_of(&t[T_DY], MOEBLAZE_ARG_GRAD_OUTPUT, cuda, 0);
  a[n++] = arg_of(&t[T_DX], MOEBLAZE_ARG_GRAD_INPUT, cuda, acc);
  a[n++] = arg_of(&t[T_DWGU], MOEBLAZE_ARG_GRAD_W_GATE_UP, cuda, acc);
  a[n++] = arg_of(&t[T_DWD], MOEBLAZE_ARG_GRAD_W_DOWN, cuda, acc);
  if (c->mode == MODE_CALLER) {
    a[n++] = arg_of(&t[T_IDS], MOEBLAZE_ARG_TOPK_INDICES, cuda, 0);
    a[n++] = arg_of(&t[T_GW], MOEBLAZE_ARG_TOPK_WEIGHTS, cuda, 0);
    a[n++] = arg_of(&t[T_DROUTER], MOEBLAZE_ARG_GRAD_TOPK_WEIGHTS, cuda, acc);
  } else if (c->mode == MODE_LOGITS) {
    a[n++] = arg_of(&t[T_LOG], MOEBLAZE_ARG_ROUTER_LOGITS, cuda, 0);
    a[n++] = arg_of(&t[T_DROUTER], MOEBLAZE_ARG_GRAD_ROUTER_LOGITS, cuda, acc);
  } else {
    a[n++] = arg_of(&t[T_WG], MOEBLAZE_ARG_ROUTER_WEIGHT, cuda, 0);
    a[n++] = arg_of(&t[T_DROUTER], MOEBLAZE_ARG_GRAD_ROUTER_WEIGHT, cuda, acc);
  }
  return n;
}

/* Runs forward + backward; statuses in st[0] (forward), st[1] (backward, -1 if not run) and,
 * for CUDA, the STATUS argument of each in dev_status[0..1]. Outputs copied to o. */
static void run(const fcase* c, tensor* t, moeblaze_handle_t h, int cuda, moeblaze_status_t* st, int32_t* dev_status,
                outputs* o, counters* k) {
  size_t ws_f = 0, ws_b = 0, sv = 0;
  st[0] = st[1] = (moeblaze_status_t)-1;
  dev_status[0] = dev_status[1] = 0;
  moeblaze_get_workspace_size(h, MOEBLAZE_PASS_FORWARD_TRAINING, c->L, &ws_f);
  const int last_use = cuda && c->last_use;
  moeblaze_get_workspace_size(h, last_use ? MOEBLAZE_PASS_BACKWARD_LAST_USE : MOEBLAZE_PASS_BACKWARD, c->L, &ws_b);
  moeblaze_get_saved_size(h, c->L, &sv);
  const size_t ws_bytes = ws_f > ws_b ? ws_f : ws_b;
  void *ws = NULL, *saved = NULL;
  int32_t* status = NULL;
  if (cuda) {
    for (int i = 0; i < T_COUNT; ++i) upload(&t[i]);
    if (ws_bytes) CUDA_OR_DIE(cudaMalloc(&ws, ws_bytes));
    if (sv) CUDA_OR_DIE(cudaMalloc(&saved, sv));
    if (ws_bytes) CUDA_OR_DIE(cudaMemset(ws, 0xFF, ws_bytes));
    CUDA_OR_DIE(cudaMalloc((void**)&status, sizeof(int32_t)));
    CUDA_OR_DIE(cudaMemset(status, 0x5A, sizeof(int32_t)));
  } else {
    ws = ws_bytes ? tu_alloc_bytes(ws_bytes) : NULL;
    saved = sv ? tu_alloc_bytes(sv) : NULL;
  }
  moeblaze_arg_t a[16];
  size_t n = forward_args(c, t, cuda, a);
  moeblaze_tensor_t stt = tu_tensor(status, tu_i32, 0, NULL);
  stt.device.device_type = MOEBLAZE_DEVICE_CUDA;
  if (cuda) a[n++] = tu_arg(MOEBLAZE_ARG_STATUS, stt);
  st[0] = moeblaze_forward(h, MOEBLAZE_PASS_FORWARD_TRAINING, a, n, ws, ws_bytes, saved, sv, NULL);
  g_last_message[0] = '\0';
  if (st[0] != MOEBLAZE_STATUS_SUCCESS) snprintf(g_last_message, sizeof g_last_message, "%s", moeblaze_get_last_error_message());
  ++k->runs;
  if (cuda) {
    CUDA_OR_DIE(cudaDeviceSynchronize());
    CUDA_OR_DIE(cudaMemcpy(&dev_status[0], status, sizeof(int32_t), cudaMemcpyDeviceToHost));
  }
  const int forward_ok = st[0] == MOEBLAZE_STATUS_SUCCESS && (!cuda || dev_status[0] == 0);
  if (forward_ok) {
    n = backward_args(c, t, cuda, a);
    if (cuda) {
      CUDA_OR_DIE(cudaMemset(status, 0x5A, sizeof(int32_t)));
      a[n++] = tu_arg(MOEBLAZE_ARG_STATUS, stt);
    }
    st[1] = last_use ? moeblaze_backward_last_use(h, a, n, saved, sv, ws, ws_bytes, NULL)
                     : moeblaze_backward(h, a, n, saved, sv, ws, ws_bytes, NULL);
    if (st[1] != MOEBLAZE_STATUS_SUCCESS) snprintf(g_last_message, sizeof g_last_message, "%s", moeblaze_get_last_error_message());
    if (cuda) {
      CUDA_OR_DIE(cudaDeviceSynchronize());
      CUDA_OR_DIE(cudaMemcpy(&dev_status[1], status, sizeof(int32_t), cudaMemcpyDeviceToHost));
    }
  }
  for (int i = T_Y; i < T_COUNT; ++i) {
    o->v[i] = tu_alloc(t[i].dt, t[i].n + 1);
    if (cuda) download(&t[i], o->v[i]);
    else memcpy(o->v[i], t[i].host, t[i].n * elem(&t[i]));
  }
  if (cuda) {
    for (int i = 0; i < T_Y; ++i) download(&t[i], NULL); /* inputs: canaries only */
    for (int i = 0; i < T_COUNT; ++i) { cudaFree(t[i].base); t[i].base = NULL; t[i].dev = NULL; }
    cudaFree(ws);
    cudaFree(saved);
    cudaFree(status);
  } else {
    tu_free(ws);
    tu_free(saved);
  }
}

/* CPU outputs are computed in place on the host copies: keep a pristine copy of the initial
 * output contents for the GPU run (poison or accumulate start values). */
static void snapshot(tensor* t, void** keep, int restore) {
  for (int i = T_Y; i < T_COUNT; ++i) {
    if (!restore) {
      keep[i] = tu_alloc(t[i].dt, t[i].n + 1);
      memcpy(keep[i], t[i].host, t[i].n * elem(&t[i]));
    } else {
      memcpy(t[i].host, keep[i], t[i].n * elem(&t[i]));
    }
  }
}

static void compare(const fcase* c, const tensor* t, const outputs* gpu, const outputs* cpu, counters* k) {
  const size_t rows = (size_t)c->L * (size_t)c->layer.top_k;
  if (c->mode != MODE_CALLER) {
    const int ids_equal = !memcmp(gpu->v[T_OID], cpu->v[T_OID], rows * sizeof(int32_t));
    if (!ids_equal) {
      if (c->mode == MODE_WG) { ++k->tie_skips; return; } /* x W_g rounded differently: a near tie flipped */
      finding("TOPK_INDICES differ from the CPU engine's (routing from logits)");
      return;
    }
  }
  if (memcmp(gpu->v[T_TPE], cpu->v[T_TPE], t[T_TPE].n * sizeof(int64_t)))
    finding("TOKENS_PER_EXPERT differs from the CPU engine's");
  const double tol = tu_tol(c->layer.act_dtype) * 1.5;
  /* the gate and router gradients cancel: their scale (grad_conditioning.h) */
  const int32_t* routed = c->mode == MODE_CALLER ? t[T_IDS].host : cpu->v[T_OID];
  const float* gates = c->mode == MODE_CALLER ? t[T_GW].host : cpu->v[T_OW];
  double* gate_grad_scales = malloc(sizeof(double) * (rows + 1));
  double scale = tu_gate_grad_scale2(&c->layer, c->L, t[T_X].host, t[T_WGU].host, t[T_WD].host, routed, t[T_DY].host,
                                     gate_grad_scales);
  if (c->mode != MODE_CALLER)
    scale = tu_router_grad_scale2(c->L, c->layer.top_k, c->layer.d, gates, gate_grad_scales,
                                  c->mode == MODE_WG ? t[T_X].host : NULL, c->layer.act_dtype);
  free(gate_grad_scales);
  if (isnan(scale)) finding("the CPU forward for the gradients' scale failed: %s", moeblaze_get_last_error_message());
  const int slots[] = {T_Y, T_OW, T_AUX, T_Z, T_DX, T_DWGU, T_DWD, T_DROUTER};
  for (size_t s = 0; s < sizeof slots / sizeof slots[0]; ++s) {
    const int i = slots[s];
    if (c->mode == MODE_CALLER && (i == T_OW || i == T_AUX || i == T_Z)) continue;
    if (t[i].n == 0) continue;
    double* a = malloc(sizeof(double) * t[i].n);
    double* b = malloc(sizeof(double) * t[i].n);
    tu_to_f64(gpu->v[i], t[i].dt, t[i].n, a);
    tu_to_f64(cpu->v[i], t[i].dt, t[i].n, b);
    double err = i == T_DROUTER ? tu_err_against(a, b, t[i].n, scale) : tu_rel_err(a, b, t[i].n);
    if (i == T_AUX || i == T_Z) err = fabs(a[0] - b[0]) <= 1e-5 + tol * fabs(b[0]) ? 0.0 : INFINITY;
    if (!(err <= tol)) finding("%s: relative error %.3g against the CPU engine (tolerance %.3g)", t[i].name, err, tol);
    else if (g_verbose) printf("  %s: relative error %.3g (tolerance %.3g)\n", t[i].name, err, tol);
    free(a);
    free(b);
  }
}

static int same_bits(const tensor* t, const outputs* a, const outputs* b) {
  for (int i = T_Y; i < T_COUNT; ++i)
    if (memcmp(a->v[i], b->v[i], t[i].n * elem(&t[i]))) return i;
  return 0;
}

/* FUZZ_CASE's variations of the replayed case, to narrow a finding down: FUZZ_ACT,
 * FUZZ_POLICY and FUZZ_ENGINE (the API's numbers), FUZZ_ROW_MAJOR=1 (every tensor contiguous),
 * FUZZ_LAST_USE=0|1 (the CUDA backward plain or the saved buffer's last use). */
static void vary(fcase* c) {
  const char* v;
  if ((v = getenv("FUZZ_ACT")) && *v) c->layer.activation = atoi(v);
  if ((v = getenv("FUZZ_POLICY")) && *v) c->layer.save_policy = atoi(v);
  if ((v = getenv("FUZZ_ENGINE")) && *v) c->layer.engine = atoi(v);
  if ((v = getenv("FUZZ_ROW_MAJOR")) && atoi(v) == 1)
    for (int i = 0; i < T_COUNT; ++i) c->layout[i] = LAYOUT_ROWMAJOR;
  if ((v = getenv("FUZZ_LAST_USE")) && *v) c->last_use = atoi(v) != 0;
}

static void one_case(tu_rng* r, counters* k) {
  fcase c;
  draw(&c, r);
  if (g_verbose) vary(&c);
  char desc[512];
  tensor t[T_COUNT];
  make_tensors(&c, t, r);
  int failures_before = g_findings;
  moeblaze_handle_t gpu = NULL, cpu = NULL;
  const moeblaze_status_t cs = tu_create_on(&c.layer, MOEBLAZE_DEVICE_CUDA, &gpu);
  ++k->cases;
  if (cs != MOEBLAZE_STATUS_SUCCESS) {
    if (cs != MOEBLAZE_STATUS_NOT_SUPPORTED || !moeblaze_get_last_error_message()[0])
      finding("create -> %s (%s)", moeblaze_status_name(cs), moeblaze_get_last_error_message());
    ++k->refused_create;
    goto done;
  }
  tu_layer cl = c.layer;
  cl.engine = MOEBLAZE_ENGINE_CPU;
  cl.window_tokens = 0;
  cl.window_bytes = 0;
  if (tu_create_on(&cl, MOEBLAZE_DEVICE_CPU, &cpu) != MOEBLAZE_STATUS_SUCCESS) {
    finding("the CPU engine refused the layer: %s", moeblaze_get_last_error_message());
    goto done;
  }
  void* initial[T_COUNT] = {0};
  snapshot(t, initial, 0);
  outputs og = {{0}}, oc = {{0}}, og2 = {{0}};
  moeblaze_status_t sg[2], sc[2];
  int32_t dsg[2], dsc[2];
  run(&c, t, cpu, 0, sc, dsc, &oc, k);
  snapshot(t, initial, 1);
  run(&c, t, gpu, 1, sg, dsg, &og, k);
  if (c.bad_ids) {
    ++k->bad_id_cases;
    if (sc[0] != MOEBLAZE_STATUS_INVALID_ARGUMENT) finding("CPU engine: bad ids -> %s", moeblaze_status_name(sc[0]));
    /* refused: by its status, by STATUS (the fused engine finds ids on the device), or for a
     * layout the engine does not take, which it checks first */
    const int reported = sg[0] == MOEBLAZE_STATUS_INVALID_ARGUMENT ||
                         (sg[0] == MOEBLAZE_STATUS_SUCCESS && dsg[0] == MOEBLAZE_STATUS_INVALID_ARGUMENT) ||
                         (sg[0] == MOEBLAZE_STATUS_NOT_SUPPORTED && g_last_message[0]);
    if (!reported) finding("bad caller ids: forward -> %s, STATUS %d", moeblaze_status_name(sg[0]), dsg[0]);
  } else if ((sg[0] == MOEBLAZE_STATUS_NOT_SUPPORTED ||
              (sg[0] == MOEBLAZE_STATUS_SUCCESS && sg[1] == MOEBLAZE_STATUS_NOT_SUPPORTED)) &&
             g_last_message[0]) {
    ++k->refused_call; /* a layout this engine does not take, refused with its reason */
  } else if (sc[0] != MOEBLAZE_STATUS_SUCCESS || sc[1] != MOEBLAZE_STATUS_SUCCESS) {
    finding("CPU engine: forward %s, backward %s", moeblaze_status_name(sc[0]), moeblaze_status_name(sc[1]));
  } else if (sg[0] != MOEBLAZE_STATUS_SUCCESS || sg[1] != MOEBLAZE_STATUS_SUCCESS || dsg[0] || dsg[1]) {
    finding("CUDA engine: forward %s (STATUS %d), backward %s (STATUS %d): %s", moeblaze_status_name(sg[0]), dsg[0],
            moeblaze_status_name(sg[1]), dsg[1], g_last_message);
  } else {
    ++k->compared;
    compare(&c, t, &og, &oc, k);
    if (c.repeat) {
      ++k->repeats;
      snapshot(t, initial, 1);
      run(&c, t, gpu, 1, sg, dsg, &og2, k);
      const int differ = same_bits(t, &og, &og2);
      if (differ) finding("a second run differs in %s (determinism)", t[differ].name);
    }
  }
  free_outputs(&og);
  free_outputs(&oc);
  free_outputs(&og2);
  for (int i = 0; i < T_COUNT; ++i) tu_free(initial[i]);
done:
  if (g_findings != failures_before || g_verbose) printf("  case: %s\n", describe(&c, desc, sizeof desc));
  moeblaze_destroy(gpu);
  moeblaze_destroy(cpu);
  for (int i = 0; i < T_COUNT; ++i) free_tensor(&t[i]);
}

int main(int argc, char** argv) {
  int devices = 0;
  if (cudaGetDeviceCount(&devices) != cudaSuccess || devices == 0) {
    printf("fuzz_gpu: no CUDA device, skipped\n");
    return 77;
  }
  const double seconds = argc > 1 ? atof(argv[1]) : 20.0;
  const uint64_t seed = argc > 2 ? strtoull(argv[2], NULL, 10) : tu_fresh_seed("fuzz_gpu");
  counters k;
  memset(&k, 0, sizeof k);
  const char* one = getenv("FUZZ_CASE");
  if (one && *one) {
    g_verbose = 1;
    g_case_seed = strtoull(one, NULL, 10);
    tu_rng cr;
    tu_rng_seed(&cr, g_case_seed);
    one_case(&cr, &k);
    printf("fuzz_gpu: case seed %llu: %ld compared, %ld refused; %d findings\n", (unsigned long long)g_case_seed,
           k.compared, k.refused_create + k.refused_call, g_findings);
    return g_findings ? 1 : 0;
  }
  tu_rng r;
  tu_rng_seed(&r, seed);
  struct timespec t0, now;
  clock_gettime(CLOCK_MONOTONIC, &t0);
  do {
    g_case_seed = tu_rng_next(&r);
    tu_rng cr;
    tu_rng_seed(&cr, g_case_seed);
    one_case(&cr, &k);
    clock_gettime(CLOCK_MONOTONIC, &now);
  } while ((double)(now.tv_sec - t0.tv_sec) + 1e-9 * (double)(now.tv_nsec - t0.tv_nsec) < seconds && g_findings < 20);
  printf("fuzz_gpu: seed %llu, %.0f s: %ld cases, %ld runs (forward, then backward when it succeeds), %ld compared "
         "with the CPU engine, %ld refused at create and %ld at the call (NOT_SUPPORTED, with a reason), %ld bad-id cases, "
         "%ld router-weight ties skipped, %ld repeated bitwise; %d findings\n",
         (unsigned long long)seed, seconds, k.cases, k.runs, k.compared, k.refused_create, k.refused_call,
         k.bad_id_cases, k.tie_skips, k.repeats, g_findings);
  return g_findings ? 1 : 0;
}
