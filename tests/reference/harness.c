/* Shared driver of the reference tests (see harness.h). */
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <setjmp.h>
#include <cmocka.h>

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "harness.h"

/* The reference's enum numbers must be the library's. */
typedef char hx_enum_check[((int)REF_ACT_RELU == (int)MOEBLAZE_ACTIVATION_RELU &&
                            (int)REF_ACT_GELU == (int)MOEBLAZE_ACTIVATION_GELU &&
                            (int)REF_ACT_SILU == (int)MOEBLAZE_ACTIVATION_SILU &&
                            (int)REF_ACT_SWIGLU == (int)MOEBLAZE_ACTIVATION_SWIGLU &&
                            (int)REF_ACT_GEGLU == (int)MOEBLAZE_ACTIVATION_GEGLU &&
                            (int)REF_SCORE_SOFTMAX == (int)MOEBLAZE_SCORE_SOFTMAX &&
                            (int)REF_SCORE_SIGMOID == (int)MOEBLAZE_SCORE_SIGMOID) ? 1 : -1];

const char* hx_act_name(int64_t a) {
  static const char* n[] = {"relu", "gelu", "silu", "swiglu", "geglu"};
  return (a >= 0 && a < 5) ? n[a] : "?";
}
const char* hx_policy_name(int64_t p) {
  static const char* n[] = {"preact", "recompute", "saveall"};
  return (p >= 0 && p < 3) ? n[p] : "?";
}
const char* hx_route_name(int r) {
  return r == HX_ROUTE_LOGITS ? "logits" : r == HX_ROUTE_WEIGHT ? "wg" : "caller";
}

hx_case hx_case_make(int64_t E, int64_t k, int64_t d, int64_t h, int64_t L, int64_t activation,
                     int64_t policy, moeblaze_dtype_t dtype, int route, uint64_t seed) {
  hx_case c;
  memset(&c, 0, sizeof c);
  c.lay = tu_layer_default(E, k, d, h, L > 0 ? L : 1, activation);
  c.lay.save_policy = policy;
  c.lay.act_dtype = dtype;
  c.lay.weight_dtype = dtype;
  c.L = L;
  c.route = route;
  c.router_dtype = tu_f32;
  c.ids_dtype = tu_i64;
  c.pattern = HX_PAT_RANDOM;
  c.seed = seed;
  c.grad_aux = 1.0;
  c.grad_z = 1.0;
  return c;
}

hx_case hx_case_random(uint64_t seed) {
  tu_rng r;
  tu_rng_seed(&r, seed);
  const moeblaze_dtype_t dts[3] = {tu_f32, tu_f16, tu_bf16};
  const int64_t E = 1 + tu_rng_below(&r, 10);
  const int64_t k = 1 + tu_rng_below(&r, E < 4 ? E : 4);
  const int64_t d = 1 + tu_rng_below(&r, 40);
  const int64_t h = 1 + tu_rng_below(&r, 48);
  const int64_t L = tu_rng_below(&r, 90);
  const int64_t act = tu_rng_below(&r, 5);
  const int64_t policy = tu_rng_below(&r, 3);
  const int route = 1 + (int)tu_rng_below(&r, 3);
  hx_case c = hx_case_make(E, k, d, h, L, act, policy, dts[tu_rng_below(&r, 3)], route, seed);
  c.lay.weight_dtype = dts[tu_rng_below(&r, 3)];
  c.lay.max_tokens = (L > 0 ? L : 1) + tu_rng_below(&r, 10);
  c.lay.score_fn = tu_rng_below(&r, 2);
  c.lay.normalize = tu_rng_below(&r, 2);
  c.lay.aux_coeff = tu_rng_below(&r, 3) ? 0.1 * tu_rng_uniform(&r) : 0.0;
  c.lay.z_coeff = tu_rng_below(&r, 3) ? 0.05 * tu_rng_uniform(&r) : 0.0;
  c.lay.num_threads = tu_rng_below(&r, 3);
  c.router_dtype = tu_rng_below(&r, 2) ? c.lay.act_dtype : tu_f32;
  c.ids_dtype = tu_rng_below(&r, 2) ? tu_i32 : tu_i64;
  c.accumulate = (int)tu_rng_below(&r, 2);
  c.explicit_scalars = (int)tu_rng_below(&r, 2);
  c.grad_aux = 2.0 * tu_rng_uniform(&r) - 0.5;
  c.grad_z = 2.0 * tu_rng_uniform(&r) - 0.5;
  c.inference_too = (int)tu_rng_below(&r, 2);
  c.weights_transposed = tu_rng_below(&r, 3) ? 0 : 1 + (int)tu_rng_below(&r, 3);
  c.grad_mask = tu_rng_below(&r, 2) ? 0u : (unsigned)tu_rng_below(&r, 32);
  /* With k = 1 and renormalisation the gates are constant; if only the aux loss then reaches
   * the router and the experts happen to be equally loaded, the exact d logits is 0 and a
   * relative error is meaningless (any f32 rounding noise fails it). Keep a z-loss term. */
  if (c.lay.top_k == 1 && c.lay.normalize && c.lay.aux_coeff > 0) {
    c.lay.z_coeff = 0.01 + 0.04 * tu_rng_uniform(&r);
    c.grad_z = 0.5 + tu_rng_uniform(&r);
  }
  return c;
}

const char* hx_describe(const hx_case* c) {
  static char buf[512];
  snprintf(buf, sizeof buf,
           "[act=%s policy=%s act_dtype=%s w_dtype=%s route=%s router=%s ids=%s L=%lld E=%lld "
           "k=%lld d=%lld h=%lld score=%s norm=%lld aux=%g z=%g pattern=%d wT=%d acc=%d scalars=%d "
           "(%g, %g) grad_mask=0x%x threads=%lld case_seed=%llu (replay: MOEBLAZE_TEST_SEED printed at start)]",
           hx_act_name(c->lay.activation), hx_policy_name(c->lay.save_policy),
           tu_dtype_name(c->lay.act_dtype), tu_dtype_name(c->lay.weight_dtype),
           hx_route_name(c->route), tu_dtype_name(c->router_dtype), tu_dtype_name(c->ids_dtype),
           (long long)c->L, (long long)c->lay.experts, (long long)c->lay.top_k,
           (long long)c->lay.d, (long long)c->lay.h,
           c->lay.score_fn == MOEBLAZE_SCORE_SIGMOID ? "sigmoid" : "softmax",
           (long long)c->lay.normalize, c->lay.aux_coeff, c->lay.z_coeff, c->pattern,
           c->weights_transposed, c->accumulate, c->explicit_scalars, c->grad_aux, c->grad_z, c->grad_mask,
           (long long)c->lay.num_threads,
           (unsigned long long)c->seed);
  return buf;
}

/* ------------------------------------------------------------------------------------------ */
/* Data                                                                                        */
/* ------------------------------------------------------------------------------------------ */
typedef struct hx_data {
  int64_t L, E, k, d, h, gh;
  moeblaze_dtype_t at, wt, rt, it;
  void *x, *wgu, *wd, *wg, *logits, *ids, *gates, *dy;
  double *x64, *wgu64, *wd64, *wg64, *logits64, *gates64, *dy64;
  int64_t* ids64;
  int64_t sh_x[2], sh_wgu[3], sh_wd[3], sh_wg[2], sh_lg[2], sh_k[2], sh_E[1], sh_1[1];
  /* weights_transposed: the column-major copies the library reads, their pitches and strides */
  void *wgu_t, *wd_t;
  int64_t pitch_wgu, pitch_wd, st_wgu[3], st_wd[3];
} hx_data;

static double* f64_of(const void* buf, moeblaze_dtype_t t, size_t n) {
  double* out = (double*)malloc(sizeof(double) * (n + 1));
  assert_non_null(out);
  tu_to_f64(buf, t, n, out);
  return out;
}

static size_t zn(int64_t n) { return (size_t)(n > 0 ? n : 0); }

/* ReLU's derivative steps at 0: a pre-activation within accumulation rounding of 0 can take
 * either side in the engine (fp32 sums) and in the fp64 reference, and one flipped element moves
 * dx and dW_gate_up by a whole term (a flaky failure: 1.5e-2 against an fp32 tolerance of 1e-5).
 * Each token's x row is drawn again, from a stream of its own, until every pre-activation of
 * every expert clears 0 by 1e-6 of its terms' absolute sum (fp32's rounding at these widths is
 * about 1e-7 of it). Column 0 stays when a routing pattern steers by it. */
static void hx_clear_relu_kinks(const hx_case* c, hx_data* D) {
  if (c->lay.activation != MOEBLAZE_ACTIVATION_RELU) return;
  const int64_t L = D->L, E = D->E, d = D->d, gh = D->gh;
  const int64_t first = c->route == HX_ROUTE_WEIGHT && c->pattern != HX_PAT_RANDOM && c->pattern != HX_PAT_TIES ? 1 : 0;
  tu_rng r;
  tu_rng_seed(&r, c->seed ^ 0x9e3779b97f4a7c15ull);
  for (int64_t t = 0; t < L; ++t)
    for (int attempt = 0; attempt < 64; ++attempt) {
      int clear = 1;
      for (int64_t e = 0; e < E && clear; ++e)
        for (int64_t col = 0; col < gh && clear; ++col) {
          double pre = 0.0, terms = 0.0;
          for (int64_t i = 0; i < d; ++i) {
            const double v = tu_load(D->x, D->at, (size_t)(t * d + i)) *
                             tu_load(D->wgu, D->wt, (size_t)((e * d + i) * gh + col));
            pre += v;
            terms += fabs(v);
          }
          clear = terms == 0.0 || fabs(pre) > 1e-6 * terms;
        }
      if (clear || d <= first) break;
      for (int64_t i = first; i < d; ++i) tu_store(D->x, D->at, (size_t)(t * d + i), tu_rng_normal(&r));
    }
}

static void hx_make(const hx_case* c, hx_data* D) {
  memset(D, 0, sizeof *D);
  const int64_t L = c->L, E = c->lay.experts, k = c->lay.top_k, d = c->lay.d, h = c->lay.h;
  const int64_t gh = ref_gate_factor((int32_t)c->lay.activation) * h;
  D->L = L; D->E = E; D->k = k; D->d = d; D->h = h; D->gh = gh;
  D->at = c->lay.act_dtype; D->wt = c->lay.weight_dtype; D->rt = c->router_dtype; D->it = c->ids_dtype;
  D->sh_x[0] = L; D->sh_x[1] = d;
  D->sh_wgu[0] = E; D->sh_wgu[1] = d; D->sh_wgu[2] = gh;
  D->sh_wd[0] = E; D->sh_wd[1] = h; D->sh_wd[2] = d;
  D->sh_wg[0] = E; D->sh_wg[1] = d;
  D->sh_lg[0] = L; D->sh_lg[1] = E;
  D->sh_k[0] = L; D->sh_k[1] = k;
  D->sh_E[0] = E;
  D->sh_1[0] = 1;

  tu_rng r;
  tu_rng_seed(&r, c->seed);
  const int64_t hot = E > 2 ? 2 : E - 1; /* the expert of HX_PAT_ONE_EXPERT */

  D->x = tu_alloc(D->at, zn(L * d));
  tu_fill_normal(&r, D->x, D->at, zn(L * d), 1.0);
  D->wgu = tu_alloc(D->wt, zn(E * d * gh));
  tu_fill_normal(&r, D->wgu, D->wt, zn(E * d * gh), 1.0 / sqrt((double)d));
  D->wd = tu_alloc(D->wt, zn(E * h * d));
  tu_fill_normal(&r, D->wd, D->wt, zn(E * h * d), 1.0 / sqrt((double)h));
  D->dy = tu_alloc(D->at, zn(L * d));
  tu_fill_normal(&r, D->dy, D->at, zn(L * d), 1.0);
  if (c->weights_transposed) {
    const int64_t pad = c->weights_transposed - 1;
    D->pitch_wgu = d + pad;
    D->pitch_wd = h + pad;
    D->wgu_t = tu_transposed_copy(D->wgu, D->wt, E, d, gh, D->pitch_wgu);
    D->wd_t = tu_transposed_copy(D->wd, D->wt, E, h, d, D->pitch_wd);
    tu_transposed_strides(d, gh, D->pitch_wgu, D->st_wgu);
    tu_transposed_strides(h, d, D->pitch_wd, D->st_wd);
  }

  if (c->route == HX_ROUTE_LOGITS) {
    D->logits = tu_alloc(D->rt, zn(L * E));
    for (int64_t t = 0; t < L; ++t)
      for (int64_t e = 0; e < E; ++e) {
        double v = tu_rng_normal(&r);
        if (c->pattern == HX_PAT_EMPTY_EXPERT && e == E - 1) v -= 8.0;
        if (c->pattern == HX_PAT_ONE_EXPERT && e == hot) v += 8.0;
        if (c->pattern == HX_PAT_TIES) {
          static const double vals[4] = {-1.0, 0.0, 0.5, 1.0};
          v = vals[tu_rng_below(&r, 4)];
        }
        tu_store(D->logits, D->rt, (size_t)(t * E + e), v);
      }
  } else if (c->route == HX_ROUTE_WEIGHT) {
    D->wg = tu_alloc(D->wt, zn(E * d));
    tu_fill_normal(&r, D->wg, D->wt, zn(E * d), 1.0 / sqrt((double)d));
    if (c->pattern == HX_PAT_TIES) {
      const size_t sz = tu_dtype_size(D->wt);
      if (E >= 2) memcpy((char*)D->wg + (size_t)((E - 1) * d) * sz, D->wg, (size_t)d * sz);
      if (E >= 4) memcpy((char*)D->wg + (size_t)(2 * d) * sz, (char*)D->wg + (size_t)d * sz, (size_t)d * sz);
    } else if (c->pattern != HX_PAT_RANDOM) {
      /* x[:, 0] large and positive, W_g[e][0] steers expert e for every token */
      for (int64_t t = 0; t < L; ++t)
        tu_store(D->x, D->at, (size_t)(t * d), 3.0 + fabs(tu_rng_normal(&r)));
      if (c->pattern == HX_PAT_EMPTY_EXPERT) tu_store(D->wg, D->wt, (size_t)((E - 1) * d), -4.0);
      else tu_store(D->wg, D->wt, (size_t)(hot * d), 4.0);
    }
  } else {
    D->ids = tu_alloc(D->it, zn(L * k));
    D->gates = tu_alloc(D->rt, zn(L * k));
    int64_t* perm = (int64_t*)malloc(sizeof(int64_t) * (size_t)E);
    assert_non_null(perm);
    for (int64_t t = 0; t < L; ++t) {
      int64_t pool = c->pattern == HX_PAT_EMPTY_EXPERT ? E - 1 : E;
      for (int64_t e = 0; e < E; ++e) perm[e] = e;
      int64_t start = 0;
      if (c->pattern == HX_PAT_ONE_EXPERT) { perm[hot] = 0; perm[0] = hot; start = 1; }
      for (int64_t j = start; j < k; ++j) { /* partial Fisher-Yates over perm[j..pool) */
        int64_t q = j + tu_rng_below(&r, pool - j);
        int64_t tmp = perm[j]; perm[j] = perm[q]; perm[q] = tmp;
      }
      for (int64_t j = 0; j < k; ++j) {
        tu_store(D->ids, D->it, (size_t)(t * k + j), (double)perm[j]);
        tu_store(D->gates, D->rt, (size_t)(t * k + j), 0.1 + 0.9 * tu_rng_uniform(&r));
      }
    }
    free(perm);
  }

  hx_clear_relu_kinks(c, D);
  D->x64 = f64_of(D->x, D->at, zn(L * d));
  D->wgu64 = f64_of(D->wgu, D->wt, zn(E * d * gh));
  D->wd64 = f64_of(D->wd, D->wt, zn(E * h * d));
  D->dy64 = f64_of(D->dy, D->at, zn(L * d));
  if (D->wg) D->wg64 = f64_of(D->wg, D->wt, zn(E * d));
  if (D->logits) D->logits64 = f64_of(D->logits, D->rt, zn(L * E));
  if (D->gates) D->gates64 = f64_of(D->gates, D->rt, zn(L * k));
  if (D->ids) {
    D->ids64 = (int64_t*)malloc(sizeof(int64_t) * (zn(L * k) + 1));
    assert_non_null(D->ids64);
    for (size_t i = 0; i < zn(L * k); ++i) D->ids64[i] = (int64_t)tu_load(D->ids, D->it, i);
  }
}

static void hx_free(hx_data* D) {
  tu_free(D->x); tu_free(D->wgu); tu_free(D->wd); tu_free(D->wg); tu_free(D->logits);
  tu_free(D->ids); tu_free(D->gates); tu_free(D->dy); tu_free(D->wgu_t); tu_free(D->wd_t);
  free(D->x64); free(D->wgu64); free(D->wd64); free(D->wg64); free(D->logits64);
  free(D->gates64); free(D->dy64); free(D->ids64);
}

/* The engines round A/B/H, act, O and dA/dB to ACTIVATION_DTYPE (from fp32 accumulators):
 * the reference models that, so 16-bit comparisons measure the engine, not the rounding. */
static double round_f32(double v) { return (double)(float)v; }
static double round_bf16(double v) { return tu_bf16_to_f32(tu_f32_to_bf16((float)v)); }
static double round_f16(double v) { return tu_f16_to_f32(tu_f32_to_f16((float)v)); }

static ref_layer hx_ref_layer(const hx_case* c) {
  ref_layer l;
  memset(&l, 0, sizeof l);
  l.E = c->lay.experts; l.k = c->lay.top_k; l.d = c->lay.d; l.h = c->lay.h;
  l.activation = (int32_t)c->lay.activation;
  l.score_fn = (int32_t)c->lay.score_fn;
  l.normalize = (int32_t)c->lay.normalize;
  l.aux_coeff = c->lay.aux_coeff;
  l.z_coeff = c->lay.z_coeff;
  l.round_act = tu_dtype_eq(c->lay.act_dtype, tu_bf16) ? round_bf16
              : tu_dtype_eq(c->lay.act_dtype, tu_f16) ? round_f16 : round_f32;
  return l;
}

/* The inputs every call takes: x, weights and the routing input of the case. Backward in
 * caller routing (case 3) takes no TOPK_* arguments: the library rejects them there (the
 * ids and gates are in the saved buffer). */
static size_t hx_input_args(const hx_case* c, hx_data* D, moeblaze_arg_t* a, int backward) {
  size_t n = 0;
  a[n++] = tu_arg(MOEBLAZE_ARG_INPUT, tu_tensor(D->x, D->at, 2, D->sh_x));
  if (c->weights_transposed) {
    moeblaze_tensor_t wgu = tu_tensor(D->wgu_t, D->wt, 3, D->sh_wgu), wd = tu_tensor(D->wd_t, D->wt, 3, D->sh_wd);
    wgu.strides = D->st_wgu;
    wd.strides = D->st_wd;
    a[n++] = tu_arg(MOEBLAZE_ARG_W_GATE_UP, wgu);
    a[n++] = tu_arg(MOEBLAZE_ARG_W_DOWN, wd);
  } else {
    a[n++] = tu_arg(MOEBLAZE_ARG_W_GATE_UP, tu_tensor(D->wgu, D->wt, 3, D->sh_wgu));
    a[n++] = tu_arg(MOEBLAZE_ARG_W_DOWN, tu_tensor(D->wd, D->wt, 3, D->sh_wd));
  }
  if (c->route == HX_ROUTE_LOGITS) {
    a[n++] = tu_arg(MOEBLAZE_ARG_ROUTER_LOGITS, tu_tensor(D->logits, D->rt, 2, D->sh_lg));
  } else if (c->route == HX_ROUTE_WEIGHT) {
    a[n++] = tu_arg(MOEBLAZE_ARG_ROUTER_WEIGHT, tu_tensor(D->wg, D->wt, 2, D->sh_wg));
  } else if (!backward) {
    a[n++] = tu_arg(MOEBLAZE_ARG_TOPK_INDICES, tu_tensor(D->ids, D->it, 2, D->sh_k));
    a[n++] = tu_arg(MOEBLAZE_ARG_TOPK_WEIGHTS, tu_tensor(D->gates, D->rt, 2, D->sh_k));
  }
  return n;
}

/* Logits the reference uses (cases 1 and 2), or NULL. */
static double* hx_ref_logits(const hx_case* c, const hx_data* D, const ref_layer* rl) {
  if (c->route == HX_ROUTE_CALLER) return NULL;
  double* lg = (double*)malloc(sizeof(double) * (zn(D->L * D->E) + 1));
  assert_non_null(lg);
  if (c->route == HX_ROUTE_LOGITS) memcpy(lg, D->logits64, sizeof(double) * zn(D->L * D->E));
  else ref_logits(rl, D->L, D->x64, D->wg64, lg);
  return lg;
}

static double dmax(double a, double b) { return a > b ? a : b; }

/* Closeness of logits (both score functions are monotone in the logit) under which two
 * implementations may legitimately order experts differently. */
static double hx_tie_eps(const hx_case* c) {
  if (c->pattern == HX_PAT_TIES) return 0.0; /* exact ties must follow the rule */
  if (c->route == HX_ROUTE_LOGITS) return 1e-6; /* exact inputs: fp32 vs fp64 only */
  /* logits = x W_g^T may be formed (and rounded) in a 16-bit dtype by the engine: allow a
   * few units of the coarsest 16-bit dtype involved */
  const moeblaze_dtype_t at = c->lay.act_dtype, wt = c->lay.weight_dtype;
  if (tu_dtype_eq(at, tu_bf16) || tu_dtype_eq(wt, tu_bf16)) return 1.6e-2;
  if (tu_dtype_eq(at, tu_f16) || tu_dtype_eq(wt, tu_f16)) return 2e-3;
  return 1e-5;
}

/* Compares the library's ids with the reference's top-k. Where they differ, the library's
 * choice is accepted only if it is a valid top-k up to near-ties of the fp64 logits; `use`
 * receives the selection the reference should follow. Fails the test otherwise. */
static void hx_match_ids(const hx_case* c, const hx_data* D, const double* lg,
                         const int64_t* ref_ids, const int64_t* lib_ids, int64_t* use) {
  const int64_t L = D->L, E = D->E, k = D->k;
  const double eps = hx_tie_eps(c);
  int ties = 0;
  for (int64_t t = 0; t < L; ++t) {
    int same = 1;
    for (int64_t j = 0; j < k; ++j) same &= lib_ids[t * k + j] == ref_ids[t * k + j];
    if (!same) {
      for (int64_t j = 0; j < k; ++j) {
        const int64_t e = lib_ids[t * k + j], r = ref_ids[t * k + j];
        if (e < 0 || e >= E)
          fail_msg("token %lld slot %lld: library id %lld out of range (ref %lld) %s", (long long)t,
                   (long long)j, (long long)e, (long long)r, hx_describe(c));
        for (int64_t q = 0; q < j; ++q)
          if (lib_ids[t * k + q] == e)
            fail_msg("token %lld: library id %lld repeated %s", (long long)t, (long long)e, hx_describe(c));
        if (e == r) continue;
        const double a = lg[t * E + e], b = lg[t * E + r];
        /* an exact tie (a == b) must follow the rule: only a near-tie may be ordered differently */
        if (a == b || fabs(a - b) > eps * (1.0 + fabs(b)))
          fail_msg("token %lld slot %lld: library id %lld (logit %.9g) but reference id %lld "
                   "(logit %.9g) %s", (long long)t, (long long)j, (long long)e, a, (long long)r, b,
                   hx_describe(c));
      }
      ties++;
    }
    for (int64_t j = 0; j < k; ++j) use[t * k + j] = lib_ids[t * k + j];
  }
  if (ties) print_message("note: %d token(s) with near-tied logits ordered differently; reference follows the library %s\n", ties, hx_describe(c));
}

/* Half the spacing of t's smallest (subnormal) values: what storing an exact result in t may
   add to each element whatever its size. A relative tolerance alone fails a tiny result, e.g.
   fp16 d_logits of 4e-7 (6.5 subnormal steps) when the gates' gradient cancels (k = 1,
   normalised) and only the z-loss's remains. */
static double hx_storage_floor(moeblaze_dtype_t t) {
  if (tu_dtype_eq(t, tu_f16)) return ldexp(1.0, -25);
  if (tu_dtype_eq(t, tu_bf16)) return ldexp(1.0, -134);
  return ldexp(1.0, -150);
}

/* The norm-wise relative error of got, each element's difference first reduced by the output
   dtype's storage floor. */
static void hx_check_close(const char* what, const double* got, const double* want, size_t n,
                           double tol, moeblaze_dtype_t out_t, const hx_case* c) {
  const double floor = hx_storage_floor(out_t);
  double* adj = (double*)malloc((n ? n : 1) * sizeof(double));
  assert_non_null(adj);
  for (size_t i = 0; i < n; ++i) {
    const double dd = got[i] - want[i], m = fabs(dd) > floor ? fabs(dd) - floor : 0.0;
    adj[i] = isfinite(got[i]) ? want[i] + (dd < 0 ? -m : m) : got[i];
  }
  const double err = tu_rel_err(adj, want, n);
  free(adj);
  if (!(err <= tol)) {
    /* locate the worst element for the report */
    size_t worst = 0;
    double wd = -1;
    for (size_t i = 0; i < n; ++i) {
      double dd = isfinite(got[i]) ? fabs(got[i] - want[i]) : INFINITY;
      if (dd > wd) { wd = dd; worst = i; }
    }
    fail_msg("%s: rel err %.3e > tol %.1e (n=%zu; worst [%zu] got %.9g want %.9g) %s", what, err,
             tol, n, worst, n ? got[worst] : 0.0, n ? want[worst] : 0.0, hx_describe(c));
  }
}

static void hx_check_scalar(const char* what, double got, double want, double tol, const hx_case* c) {
  const double err = fabs(got - want) / dmax(fabs(want), 1e-6);
  if (!(err <= tol) || !isfinite(got))
    fail_msg("%s: got %.9g want %.9g (rel err %.3e > %.1e) %s", what, got, want, err, tol, hx_describe(c));
}

static double tol_of(moeblaze_dtype_t a, moeblaze_dtype_t b) { return dmax(tu_tol(a), tu_tol(b)); }

/* ------------------------------------------------------------------------------------------ */
/* Forward                                                                                     */
/* ------------------------------------------------------------------------------------------ */
void hx_check_forward(const hx_case* c) {
  hx_data D;
  hx_make(c, &D);
  const int64_t L = D.L, E = D.E, k = D.k, d = D.d;
  const ref_layer rl = hx_ref_layer(c);
  moeblaze_handle_t hd = NULL;
  assert_ok(tu_create_cpu(&c->lay, &hd));

  size_t ws_b = 0, sv_b = 0;
  assert_ok(moeblaze_get_workspace_size(hd, MOEBLAZE_PASS_FORWARD_TRAINING, L, &ws_b));
  assert_ok(moeblaze_get_saved_size(hd, L, &sv_b));
  void* ws = tu_alloc_bytes(ws_b);
  void* sv = tu_alloc_bytes(sv_b);

  void* y = tu_alloc(D.at, zn(L * d));
  void* oids = tu_alloc(D.it, zn(L * k));
  void* ogates = tu_alloc(D.rt, zn(L * k));
  void* counts = tu_alloc(D.it, zn(E));
  float aux = 0, z = 0;
  tu_poison(y, D.at, zn(L * d));
  tu_poison(oids, D.it, zn(L * k));
  tu_poison(ogates, D.rt, zn(L * k));
  tu_poison(counts, D.it, zn(E));
  tu_poison(&aux, tu_f32, 1);
  tu_poison(&z, tu_f32, 1);

  moeblaze_arg_t args[16];
  size_t n = hx_input_args(c, &D, args, 0);
  args[n++] = tu_arg(MOEBLAZE_ARG_OUTPUT, tu_tensor(y, D.at, 2, D.sh_x));
  args[n++] = tu_arg(MOEBLAZE_ARG_TOKENS_PER_EXPERT, tu_tensor(counts, D.it, 1, D.sh_E));
  if (c->route != HX_ROUTE_CALLER) {
    args[n++] = tu_arg(MOEBLAZE_ARG_TOPK_INDICES, tu_tensor(oids, D.it, 2, D.sh_k));
    args[n++] = tu_arg(MOEBLAZE_ARG_TOPK_WEIGHTS, tu_tensor(ogates, D.rt, 2, D.sh_k));
    args[n++] = tu_arg(MOEBLAZE_ARG_AUX_LOSS, tu_tensor(&aux, tu_f32, 0, D.sh_1));
    args[n++] = tu_arg(MOEBLAZE_ARG_Z_LOSS, tu_tensor(&z, tu_f32, 1, D.sh_1));
  }
  assert_ok(moeblaze_check_args(hd, MOEBLAZE_PASS_FORWARD_TRAINING, args, n));
  assert_ok(moeblaze_forward(hd, MOEBLAZE_PASS_FORWARD_TRAINING, args, n, ws, ws_b, sv, sv_b, NULL));

  /* reference */
  double* lg = hx_ref_logits(c, &D, &rl);
  int64_t* use = (int64_t*)malloc(sizeof(int64_t) * (zn(L * k) + 1));
  int64_t* lib_ids = (int64_t*)malloc(sizeof(int64_t) * (zn(L * k) + 1));
  assert_non_null(use);
  assert_non_null(lib_ids);
  if (c->route != HX_ROUTE_CALLER) {
    int64_t* rids = (int64_t*)malloc(sizeof(int64_t) * (zn(L * k) + 1));
    assert_non_null(rids);
    ref_route(&rl, L, lg, NULL, rids, NULL, NULL, NULL, NULL);
    for (size_t i = 0; i < zn(L * k); ++i) {
      const double v = tu_load(oids, D.it, i);
      if (!(v >= 0 && v < (double)E))
        fail_msg("top-k id [%zu] = %.0f not written or out of range %s", i, v, hx_describe(c));
      lib_ids[i] = (int64_t)v;
    }
    hx_match_ids(c, &D, lg, rids, lib_ids, use);
    free(rids);
  } else {
    memcpy(use, D.ids64, sizeof(int64_t) * zn(L * k));
  }
  ref_inputs in;
  memset(&in, 0, sizeof in);
  in.x = D.x64; in.w_gate_up = D.wgu64; in.w_down = D.wd64;
  in.logits = c->route == HX_ROUTE_LOGITS ? D.logits64 : NULL;
  in.w_router = c->route == HX_ROUTE_WEIGHT ? D.wg64 : NULL;
  in.topk_ids = use;
  in.topk_gates = c->route == HX_ROUTE_CALLER ? D.gates64 : NULL;
  double* ry = (double*)malloc(sizeof(double) * (zn(L * d) + 1));
  double* rg = (double*)malloc(sizeof(double) * (zn(L * k) + 1));
  int64_t* rc = (int64_t*)malloc(sizeof(int64_t) * (zn(E) + 1));
  assert_non_null(ry); assert_non_null(rg); assert_non_null(rc);
  ref_fwd_out out;
  memset(&out, 0, sizeof out);
  out.y = ry; out.gates = rg; out.counts = rc;
  assert_int_equal(ref_layer_forward(&rl, L, &in, &out), 0);

  /* compare */
  double* gy = f64_of(y, D.at, zn(L * d));
  hx_check_close("y", gy, ry, zn(L * d), tu_tol(D.at), D.at, c);
  for (int64_t e = 0; e < E; ++e) {
    const double v = tu_load(counts, D.it, (size_t)e);
    if (v != (double)rc[e])
      fail_msg("tokens_per_expert[%lld] = %.0f, want %lld %s", (long long)e, v, (long long)rc[e], hx_describe(c));
  }
  if (c->pattern == HX_PAT_EMPTY_EXPERT && rc[E - 1] != 0)
    print_message("note: the empty-expert data routed %lld token(s) to expert E-1 %s\n", (long long)rc[E - 1], hx_describe(c));
  if (c->route != HX_ROUTE_CALLER) {
    const double rtol = c->route == HX_ROUTE_LOGITS ? tu_tol(D.rt) : dmax(tol_of(D.at, D.wt), tu_tol(D.rt));
    double* gg = f64_of(ogates, D.rt, zn(L * k));
    hx_check_close("topk_weights", gg, rg, zn(L * k), rtol, D.rt, c);
    free(gg);
    hx_check_scalar("aux_loss", aux, out.aux, rtol, c);
    hx_check_scalar("z_loss", z, out.z, rtol, c);
    if (L == 0 && (aux != 0.0f || z != 0.0f))
      fail_msg("L = 0: aux %g z %g, want 0 %s", aux, z, hx_describe(c));
  }

  /* inference gives the same bits as training */
  if (c->inference_too) {
    size_t wi_b = 0;
    assert_ok(moeblaze_get_workspace_size(hd, MOEBLAZE_PASS_FORWARD_INFERENCE, L, &wi_b));
    void* wi = tu_alloc_bytes(wi_b);
    void* y2 = tu_alloc(D.at, zn(L * d));
    tu_poison(y2, D.at, zn(L * d));
    for (size_t i = 0; i < n; ++i)
      if (args[i].kind == MOEBLAZE_ARG_OUTPUT) args[i].tensor.data = y2;
    assert_ok(moeblaze_forward(hd, MOEBLAZE_PASS_FORWARD_INFERENCE, args, n, wi, wi_b, NULL, 0, NULL));
    if (memcmp(y, y2, zn(L * d) * tu_dtype_size(D.at)) != 0)
      fail_msg("FORWARD_INFERENCE y differs from FORWARD_TRAINING y %s", hx_describe(c));
    tu_free(wi);
    tu_free(y2);
  }

  free(gy); free(ry); free(rg); free(rc); free(use); free(lib_ids); free(lg);
  tu_free(y); tu_free(oids); tu_free(ogates); tu_free(counts); tu_free(ws); tu_free(sv);
  assert_ok(moeblaze_destroy(hd));
  hx_free(&D);
}

/* ------------------------------------------------------------------------------------------ */
/* Backward                                                                                    */
/* ------------------------------------------------------------------------------------------ */
typedef struct hx_grad {
  const char* name;
  int kind;
  moeblaze_dtype_t t;
  int ndim;
  const int64_t* shape;
  size_t n;
  double* ref;   /* reference gradient */
  void* buf;     /* library output */
  double* prior; /* accumulate: prior content (as stored, logical order) */
  double tol;
  /* a weight gradient passed column-major (weights_transposed): logical [E, R, C] in a
     physical [E, C, pitch] buffer of phys_n elements with these strides; pitch 0 otherwise */
  int64_t E, R, C, pitch;
  const int64_t* strides;
  size_t phys_n;
} hx_grad;

static hx_grad hx_grad_make(const char* name, int kind, moeblaze_dtype_t t, int ndim, const int64_t* shape, size_t n,
                            double tol) {
  hx_grad g;
  memset(&g, 0, sizeof g);
  g.name = name; g.kind = kind; g.t = t; g.ndim = ndim; g.shape = shape; g.n = n; g.tol = tol;
  return g;
}

/* The logical, row-major values of a gradient as the library stored it. */
static double* hx_grad_values(const hx_grad* g) {
  if (!g->pitch) return f64_of(g->buf, g->t, g->n);
  void* logical = tu_alloc(g->t, g->n + 1);
  tu_from_transposed(g->buf, g->t, g->E, g->R, g->C, g->pitch, logical);
  double* out = f64_of(logical, g->t, g->n);
  tu_free(logical);
  return out;
}

static double rms(const double* v, size_t n) {
  double s = 0;
  for (size_t i = 0; i < n; ++i) s += v[i] * v[i];
  return n ? sqrt(s / (double)n) : 0.0;
}

void hx_check_backward(const hx_case* c) {
  hx_data D;
  hx_make(c, &D);
  const int64_t L = D.L, E = D.E, k = D.k, d = D.d, h = D.h, gh = D.gh;
  const ref_layer rl = hx_ref_layer(c);
  moeblaze_handle_t hd = NULL;
  assert_ok(tu_create_cpu(&c->lay, &hd));

  /* forward (training) */
  size_t wf_b = 0, wb_b = 0, sv_b = 0;
  assert_ok(moeblaze_get_workspace_size(hd, MOEBLAZE_PASS_FORWARD_TRAINING, L, &wf_b));
  assert_ok(moeblaze_get_workspace_size(hd, MOEBLAZE_PASS_BACKWARD, L, &wb_b));
  assert_ok(moeblaze_get_saved_size(hd, L, &sv_b));
  void* wf = tu_alloc_bytes(wf_b);
  void* wb = tu_alloc_bytes(wb_b);
  void* sv = tu_alloc_bytes(sv_b);
  void* y = tu_alloc(D.at, zn(L * d));
  void* oids = tu_alloc(D.it, zn(L * k));
  tu_poison(y, D.at, zn(L * d));
  tu_poison(oids, D.it, zn(L * k));
  moeblaze_arg_t args[24];
  size_t n = hx_input_args(c, &D, args, 0);
  args[n++] = tu_arg(MOEBLAZE_ARG_OUTPUT, tu_tensor(y, D.at, 2, D.sh_x));
  if (c->route != HX_ROUTE_CALLER)
    args[n++] = tu_arg(MOEBLAZE_ARG_TOPK_INDICES, tu_tensor(oids, D.it, 2, D.sh_k));
  assert_ok(moeblaze_forward(hd, MOEBLAZE_PASS_FORWARD_TRAINING, args, n, wf, wf_b, sv, sv_b, NULL));

  /* the selection the reference follows */
  double* lg = hx_ref_logits(c, &D, &rl);
  int64_t* use = (int64_t*)malloc(sizeof(int64_t) * (zn(L * k) + 1));
  assert_non_null(use);
  if (c->route != HX_ROUTE_CALLER) {
    int64_t* rids = (int64_t*)malloc(sizeof(int64_t) * (zn(L * k) + 1));
    int64_t* lib_ids = (int64_t*)malloc(sizeof(int64_t) * (zn(L * k) + 1));
    assert_non_null(rids);
    assert_non_null(lib_ids);
    ref_route(&rl, L, lg, NULL, rids, NULL, NULL, NULL, NULL);
    for (size_t i = 0; i < zn(L * k); ++i) {
      const double v = tu_load(oids, D.it, i);
      if (!(v >= 0 && v < (double)E)) fail_msg("forward top-k id [%zu] = %.0f %s", i, v, hx_describe(c));
      lib_ids[i] = (int64_t)v;
    }
    hx_match_ids(c, &D, lg, rids, lib_ids, use);
    free(rids);
    free(lib_ids);
  } else {
    memcpy(use, D.ids64, sizeof(int64_t) * zn(L * k));
  }

  /* reference gradients */
  const double ga = c->explicit_scalars ? c->grad_aux : 1.0;
  const double gz = c->explicit_scalars ? c->grad_z : 1.0;
  ref_inputs in;
  memset(&in, 0, sizeof in);
  in.x = D.x64; in.w_gate_up = D.wgu64; in.w_down = D.wd64;
  in.logits = c->route == HX_ROUTE_LOGITS ? D.logits64 : NULL;
  in.w_router = c->route == HX_ROUTE_WEIGHT ? D.wg64 : NULL;
  in.topk_ids = use;
  in.topk_gates = c->route == HX_ROUTE_CALLER ? D.gates64 : NULL;

  hx_grad G[6];
  int ng = 0;
  const double wtol = tol_of(D.at, D.wt);
  const double rtol = dmax(wtol, tu_tol(D.rt));
  G[ng++] = hx_grad_make("dx", MOEBLAZE_ARG_GRAD_INPUT, D.at, 2, D.sh_x, zn(L * d), wtol);
  G[ng++] = hx_grad_make("dW_gate_up", MOEBLAZE_ARG_GRAD_W_GATE_UP, D.wt, 3, D.sh_wgu, zn(E * d * gh), wtol);
  G[ng++] = hx_grad_make("dW_down", MOEBLAZE_ARG_GRAD_W_DOWN, D.wt, 3, D.sh_wd, zn(E * h * d), wtol);
  G[ng++] = hx_grad_make("d_topk_weights", MOEBLAZE_ARG_GRAD_TOPK_WEIGHTS, D.rt, 2, D.sh_k, zn(L * k), rtol);
  if (c->route == HX_ROUTE_LOGITS)
    G[ng++] = hx_grad_make("d_logits", MOEBLAZE_ARG_GRAD_ROUTER_LOGITS, D.rt, 2, D.sh_lg, zn(L * E), rtol);
  if (c->route == HX_ROUTE_WEIGHT)
    G[ng++] = hx_grad_make("dW_g", MOEBLAZE_ARG_GRAD_ROUTER_WEIGHT, D.wt, 2, D.sh_wg, zn(E * d), rtol);
  if (c->weights_transposed) {
    G[1].E = E; G[1].R = d; G[1].C = gh; G[1].pitch = D.pitch_wgu; G[1].strides = D.st_wgu;
    G[2].E = E; G[2].R = h; G[2].C = d; G[2].pitch = D.pitch_wd; G[2].strides = D.st_wd;
  }
  for (int i = 0; i < ng; ++i) {
    G[i].ref = (double*)calloc(G[i].n + 1, sizeof(double));
    assert_non_null(G[i].ref);
    G[i].phys_n = G[i].pitch ? zn(G[i].E * G[i].C * G[i].pitch) : G[i].n;
  }
  ref_grads rg;
  memset(&rg, 0, sizeof rg);
  rg.dx = G[0].ref; rg.dw_gate_up = G[1].ref; rg.dw_down = G[2].ref; rg.dgates = G[3].ref;
  if (c->route == HX_ROUTE_LOGITS) rg.dlogits = G[4].ref;
  if (c->route == HX_ROUTE_WEIGHT) rg.dw_router = G[4].ref;
  assert_int_equal(ref_layer_backward(&rl, L, &in, D.dy64, ga, gz, &rg), 0);

  /* library backward */
  tu_rng r;
  tu_rng_seed(&r, c->seed ^ 0x5bd1e995u);
  float gaux = (float)ga, gzz = (float)gz;
  n = hx_input_args(c, &D, args, 1);
  args[n++] = tu_arg(MOEBLAZE_ARG_GRAD_OUTPUT, tu_tensor(D.dy, D.at, 2, D.sh_x));
  if (c->explicit_scalars) {
    args[n++] = tu_arg(MOEBLAZE_ARG_GRAD_AUX_LOSS, tu_tensor(&gaux, tu_f32, 0, D.sh_1));
    args[n++] = tu_arg(MOEBLAZE_ARG_GRAD_Z_LOSS, tu_tensor(&gzz, tu_f32, 1, D.sh_1));
  }
  for (int i = 0; i < ng; ++i) {
    G[i].buf = NULL;
    if (c->grad_mask && !(c->grad_mask & (1u << i))) continue; /* not requested */
    G[i].buf = tu_alloc(G[i].t, G[i].phys_n);
    tu_poison(G[i].buf, G[i].t, G[i].phys_n);
    if (c->accumulate) {
      double s = rms(G[i].ref, G[i].n);
      void* prior = tu_alloc(G[i].t, G[i].n);
      tu_fill_normal(&r, prior, G[i].t, G[i].n, s > 0 ? s : 1.0);
      G[i].prior = f64_of(prior, G[i].t, G[i].n);
      if (G[i].pitch) {  /* the same values, stored column-major (padding stays poisoned) */
        void* phys = tu_transposed_copy(prior, G[i].t, G[i].E, G[i].R, G[i].C, G[i].pitch);
        memcpy(G[i].buf, phys, G[i].phys_n * tu_dtype_size(G[i].t));
        tu_free(phys);
      } else {
        memcpy(G[i].buf, prior, G[i].n * tu_dtype_size(G[i].t));
      }
      tu_free(prior);
    }
    args[n] = tu_arg(G[i].kind, tu_tensor(G[i].buf, G[i].t, G[i].ndim, G[i].shape));
    args[n].tensor.strides = G[i].strides;
    if (c->accumulate) args[n].flags = MOEBLAZE_ARG_FLAG_ACCUMULATE;
    n++;
  }
  assert_ok(moeblaze_check_args(hd, MOEBLAZE_PASS_BACKWARD, args, n));
  assert_ok(moeblaze_backward(hd, args, n, sv, sv_b, wb, wb_b, NULL));

  for (int i = 0; i < ng; ++i) {
    if (!G[i].buf) { free(G[i].ref); continue; }
    double* got = hx_grad_values(&G[i]);
    if (G[i].pitch)  /* padding between the physical rows is never written */
      for (int64_t e = 0; e < G[i].E; ++e)
        for (int64_t cc = 0; cc < G[i].C; ++cc)
          for (int64_t q = G[i].R; q < G[i].pitch; ++q)
            if (!isnan(tu_load(G[i].buf, G[i].t, (size_t)((e * G[i].C + cc) * G[i].pitch + q))))
              fail_msg("%s: padding element (%lld, %lld, %lld) was written %s", G[i].name, (long long)e, (long long)cc,
                       (long long)q, hx_describe(c));
    if (G[i].prior)
      for (size_t q = 0; q < G[i].n; ++q) got[q] -= G[i].prior[q];
    char what[64];
    snprintf(what, sizeof what, "%s%s", G[i].name, c->accumulate ? " (accumulated - prior)" : "");
    hx_check_close(what, got, G[i].ref, G[i].n, G[i].tol, G[i].t, c);
    free(got);
    free(G[i].ref);
    free(G[i].prior);
    tu_free(G[i].buf);
  }

  free(use); free(lg);
  tu_free(y); tu_free(oids); tu_free(wf); tu_free(wb); tu_free(sv);
  assert_ok(moeblaze_destroy(hd));
  hx_free(&D);
}

/* ------------------------------------------------------------------------------------------ */
void hx_tests_add(hx_tests* t, const char* name, void (*fn)(void**), void* state) {
  if (t->n == t->cap) {
    t->cap = t->cap ? 2 * t->cap : 64;
    t->tests = (struct CMUnitTest*)realloc(t->tests, t->cap * sizeof(struct CMUnitTest));
    if (!t->tests) abort();
  }
  struct CMUnitTest u;
  memset(&u, 0, sizeof u);
  char* nm = (char*)malloc(strlen(name) + 1);
  if (!nm) abort();
  strcpy(nm, name);
  u.name = nm;
  u.test_func = fn;
  u.initial_state = state;
  t->tests[t->n++] = u;
}

int hx_tests_run(hx_tests* t, const char* group) {
  int rc = _cmocka_run_group_tests(group, t->tests, t->n, NULL, NULL);
  for (size_t i = 0; i < t->n; ++i) free((void*)t->tests[i].name);
  free(t->tests);
  t->tests = NULL;
  t->n = t->cap = 0;
  return rc;
}
