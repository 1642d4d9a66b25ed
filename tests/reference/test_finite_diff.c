/* Central finite differences in fp64 of the reference forward loss
 *   Loss = <y, dy> + grad_aux * aux + grad_z * z
 * with respect to x, W_gate_up, W_down, logits, W_g and (caller routing) the gates, compared
 * with (a) the reference's analytic backward (rel 1e-6) and (b) the CPU engine's f32 gradients
 * (rel 1e-4). Inputs are f32-representable, the top-k selection has clear margins and no
 * pre-activation sits near a kink, so the loss is smooth where it is differentiated. */
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <setjmp.h>
#include <cmocka.h>

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "reference_moe.h"
#include "test_util.h"

enum { FD_L = 5, FD_E = 4, FD_K = 2, FD_D = 4, FD_H = 3 };
enum { R_LOGITS = 1, R_WEIGHT = 2, R_CALLER = 3 };

static uint64_t g_seed;
static const double k_step = 1e-5;
static const double k_tol_ref = 1e-6;
static const double k_tol_lib = 1e-4;

typedef struct fd_case {
  ref_layer rl;
  int route;
  int explicit_scalars;
  double ga, gz;
  /* data (f32-representable doubles) */
  double x[FD_L * FD_D], wgu[FD_E * FD_D * 2 * FD_H], wd[FD_E * FD_H * FD_D], wg[FD_E * FD_D];
  double logits[FD_L * FD_E], gates[FD_L * FD_K], dy[FD_L * FD_D];
  int64_t ids[FD_L * FD_K];  /* caller ids (case 3) */
  int64_t base_ids[FD_L * FD_K];
  char desc[256];
} fd_case;

static double rnd32(double v) { return (double)(float)v; }
static void fill(tu_rng* r, double* p, size_t n, double scale) {
  for (size_t i = 0; i < n; ++i) p[i] = rnd32(scale * tu_rng_normal(r));
}

static ref_inputs inputs_of(fd_case* c) {
  ref_inputs in;
  memset(&in, 0, sizeof in);
  in.x = c->x;
  in.w_gate_up = c->wgu;
  in.w_down = c->wd;
  if (c->route == R_LOGITS) in.logits = c->logits;
  if (c->route == R_WEIGHT) in.w_router = c->wg;
  if (c->route == R_CALLER) { in.topk_ids = c->ids; in.topk_gates = c->gates; }
  return in;
}

static int cmp_desc(const void* a, const void* b) {
  const double x = *(const double*)a, y = *(const double*)b;
  return (x < y) - (x > y);
}

/* Margins: sorted logits of every token differ by >= 0.05 among the top k+1, and every
 * pre-activation of a selected (t, j) is >= 0.02 away from 0 (the ReLU kink). */
static int margins_ok(fd_case* c) {
  const ref_layer* l = &c->rl;
  const int64_t gh = ref_gate_factor(l->activation) * l->h;
  ref_inputs in = inputs_of(c);
  if (c->route != R_CALLER) {
    double lg[FD_L * FD_E];
    if (c->route == R_LOGITS) memcpy(lg, c->logits, sizeof lg);
    else ref_logits(l, FD_L, c->x, c->wg, lg);
    for (int t = 0; t < FD_L; ++t) {
      double s[FD_E];
      memcpy(s, lg + t * FD_E, sizeof s);
      qsort(s, FD_E, sizeof(double), cmp_desc);
      for (int j = 0; j < FD_E - 1 && j < l->k; ++j)
        if (s[j] - s[j + 1] < 0.05) return 0;
    }
  }
  ref_fwd_out out;
  double y[FD_L * FD_D];
  memset(&out, 0, sizeof out);
  out.y = y;
  out.ids = c->base_ids;
  if (ref_layer_forward(l, FD_L, &in, &out) != 0) return 0;
  for (int t = 0; t < FD_L; ++t)
    for (int j = 0; j < l->k; ++j) {
      const int64_t e = c->base_ids[t * l->k + j];
      for (int64_t col = 0; col < gh; ++col) {
        double pre = 0;
        for (int i = 0; i < FD_D; ++i) pre += c->x[t * FD_D + i] * c->wgu[(e * FD_D + i) * gh + col];
        if (fabs(pre) < 0.02) return 0;
      }
    }
  return 1;
}

static void make_case(fd_case* c, int act, int score, int norm, int route, uint64_t seed) {
  memset(c, 0, sizeof *c);
  c->rl.E = FD_E; c->rl.k = FD_K; c->rl.d = FD_D; c->rl.h = FD_H;
  c->rl.activation = act;
  c->rl.score_fn = score;
  c->rl.normalize = norm;
  c->rl.aux_coeff = 0.3;
  c->rl.z_coeff = 0.1;
  c->route = route;
  c->explicit_scalars = (act + score + norm + route) % 2;
  c->ga = c->explicit_scalars ? 0.7 : 1.0;
  c->gz = c->explicit_scalars ? -1.3 : 1.0;
  const int64_t gh = ref_gate_factor(act) * FD_H;
  tu_rng r;
  tu_rng_seed(&r, seed);
  int tries = 0;
  do {
    if (++tries > 10000) fail_msg("could not draw inputs with clear margins (seed %llu)", (unsigned long long)seed);
    fill(&r, c->x, FD_L * FD_D, 1.0);
    fill(&r, c->wgu, (size_t)(FD_E * FD_D * gh), 0.6);
    fill(&r, c->wd, FD_E * FD_H * FD_D, 0.6);
    fill(&r, c->wg, FD_E * FD_D, 0.6);
    fill(&r, c->logits, FD_L * FD_E, 1.0);
    fill(&r, c->dy, FD_L * FD_D, 1.0);
    for (int t = 0; t < FD_L; ++t) {
      int64_t perm[FD_E];
      for (int e = 0; e < FD_E; ++e) perm[e] = e;
      for (int j = 0; j < FD_K; ++j) {
        int64_t q = j + tu_rng_below(&r, FD_E - j);
        int64_t tmp = perm[j]; perm[j] = perm[q]; perm[q] = tmp;
        c->ids[t * FD_K + j] = perm[j];
        c->gates[t * FD_K + j] = rnd32(0.2 + 0.8 * tu_rng_uniform(&r));
      }
    }
  } while (!margins_ok(c));
  snprintf(c->desc, sizeof c->desc,
           "[act=%d score=%s norm=%d route=%d scalars=%d (%g, %g) seed=%llu; replay with "
           "MOEBLAZE_TEST_SEED printed at start]", act, score ? "sigmoid" : "softmax", norm, route,
           c->explicit_scalars, c->ga, c->gz, (unsigned long long)seed);
}

/* Central differences of the loss w.r.t. every element of p[0..n). */
static void fd_grad(fd_case* c, double* p, size_t n, double* out) {
  ref_inputs in = inputs_of(c);
  int64_t ids_p[FD_L * FD_K], ids_m[FD_L * FD_K];
  for (size_t i = 0; i < n; ++i) {
    const double v = p[i];
    const double hstep = k_step * (fabs(v) > 1 ? fabs(v) : 1.0);
    p[i] = v + hstep;
    const double lp = ref_layer_loss(&c->rl, FD_L, &in, c->dy, c->ga, c->gz, ids_p);
    p[i] = v - hstep;
    const double lm = ref_layer_loss(&c->rl, FD_L, &in, c->dy, c->ga, c->gz, ids_m);
    p[i] = v;
    if (memcmp(ids_p, c->base_ids, sizeof ids_p) || memcmp(ids_m, c->base_ids, sizeof ids_m))
      fail_msg("perturbing element %zu changed the top-k selection %s", i, c->desc);
    out[i] = (lp - lm) / (2 * hstep);
  }
}

static void expect_close(const char* what, const char* who, const double* got, const double* want,
                         size_t n, double tol, const fd_case* c) {
  const double err = tu_rel_err(got, want, n);
  if (!(err <= tol)) {
    size_t w = 0;
    double wd = -1;
    for (size_t i = 0; i < n; ++i)
      if (fabs(got[i] - want[i]) > wd || !isfinite(got[i])) { wd = isfinite(got[i]) ? fabs(got[i] - want[i]) : INFINITY; w = i; }
    fail_msg("%s (%s vs finite differences): rel err %.3e > %.1e (worst [%zu] %.9g vs %.9g) %s",
             what, who, err, tol, n, w < n ? got[w] : 0.0, w < n ? want[w] : 0.0, c->desc);
  }
}

/* The library (f32, CPU engine) on the same inputs: forward (training) then backward. */
typedef struct lib_grads {
  double dx[FD_L * FD_D], dwgu[FD_E * FD_D * 2 * FD_H], dwd[FD_E * FD_H * FD_D];
  double dwg[FD_E * FD_D], dlogits[FD_L * FD_E], dgates[FD_L * FD_K];
} lib_grads;

static void to_f32(const double* in, float* out, size_t n) {
  for (size_t i = 0; i < n; ++i) out[i] = (float)in[i];
}
static void from_f32(const float* in, double* out, size_t n) {
  for (size_t i = 0; i < n; ++i) out[i] = in[i];
}

static void run_library(const fd_case* c, lib_grads* G) {
  const int64_t gh = ref_gate_factor(c->rl.activation) * FD_H;
  tu_layer tl = tu_layer_default(FD_E, FD_K, FD_D, FD_H, FD_L, c->rl.activation);
  tl.score_fn = c->rl.score_fn;
  tl.normalize = c->rl.normalize;
  tl.aux_coeff = c->rl.aux_coeff;
  tl.z_coeff = c->rl.z_coeff;
  tl.save_policy = (c->rl.activation + c->route) % 3;
  moeblaze_handle_t hd = NULL;
  assert_ok(tu_create_cpu(&tl, &hd));

  const int64_t sx[2] = {FD_L, FD_D}, swgu[3] = {FD_E, FD_D, gh}, swd[3] = {FD_E, FD_H, FD_D};
  const int64_t swg[2] = {FD_E, FD_D}, slg[2] = {FD_L, FD_E}, sk[2] = {FD_L, FD_K}, s1[1] = {1};
  float* x = (float*)tu_alloc(tu_f32, FD_L * FD_D);
  float* wgu = (float*)tu_alloc(tu_f32, (size_t)(FD_E * FD_D * gh));
  float* wd = (float*)tu_alloc(tu_f32, FD_E * FD_H * FD_D);
  float* wg = (float*)tu_alloc(tu_f32, FD_E * FD_D);
  float* lg = (float*)tu_alloc(tu_f32, FD_L * FD_E);
  float* gt = (float*)tu_alloc(tu_f32, FD_L * FD_K);
  float* dy = (float*)tu_alloc(tu_f32, FD_L * FD_D);
  float* y = (float*)tu_alloc(tu_f32, FD_L * FD_D);
  int64_t* ids = (int64_t*)tu_alloc(tu_i64, FD_L * FD_K);
  to_f32(c->x, x, FD_L * FD_D);
  to_f32(c->wgu, wgu, (size_t)(FD_E * FD_D * gh));
  to_f32(c->wd, wd, FD_E * FD_H * FD_D);
  to_f32(c->wg, wg, FD_E * FD_D);
  to_f32(c->logits, lg, FD_L * FD_E);
  to_f32(c->gates, gt, FD_L * FD_K);
  to_f32(c->dy, dy, FD_L * FD_D);
  memcpy(ids, c->ids, sizeof c->ids);

  moeblaze_arg_t a[20];
  size_t n = 0;
  a[n++] = tu_arg(MOEBLAZE_ARG_INPUT, tu_tensor(x, tu_f32, 2, sx));
  a[n++] = tu_arg(MOEBLAZE_ARG_W_GATE_UP, tu_tensor(wgu, tu_f32, 3, swgu));
  a[n++] = tu_arg(MOEBLAZE_ARG_W_DOWN, tu_tensor(wd, tu_f32, 3, swd));
  if (c->route == R_LOGITS) a[n++] = tu_arg(MOEBLAZE_ARG_ROUTER_LOGITS, tu_tensor(lg, tu_f32, 2, slg));
  if (c->route == R_WEIGHT) a[n++] = tu_arg(MOEBLAZE_ARG_ROUTER_WEIGHT, tu_tensor(wg, tu_f32, 2, swg));
  if (c->route == R_CALLER) {
    a[n++] = tu_arg(MOEBLAZE_ARG_TOPK_INDICES, tu_tensor(ids, tu_i64, 2, sk));
    a[n++] = tu_arg(MOEBLAZE_ARG_TOPK_WEIGHTS, tu_tensor(gt, tu_f32, 2, sk));
  }
  /* backward takes the same inputs except TOPK_* in caller routing (saved buffer holds them) */
  const size_t n_in = c->route == R_CALLER ? n - 2 : n;
  a[n++] = tu_arg(MOEBLAZE_ARG_OUTPUT, tu_tensor(y, tu_f32, 2, sx));
  size_t wf_b = 0, wb_b = 0, sv_b = 0;
  assert_ok(moeblaze_get_workspace_size(hd, MOEBLAZE_PASS_FORWARD_TRAINING, FD_L, &wf_b));
  assert_ok(moeblaze_get_workspace_size(hd, MOEBLAZE_PASS_BACKWARD, FD_L, &wb_b));
  assert_ok(moeblaze_get_saved_size(hd, FD_L, &sv_b));
  void* wf = tu_alloc_bytes(wf_b);
  void* wb = tu_alloc_bytes(wb_b);
  void* sv = tu_alloc_bytes(sv_b);
  assert_ok(moeblaze_forward(hd, MOEBLAZE_PASS_FORWARD_TRAINING, a, n, wf, wf_b, sv, sv_b, NULL));

  float* gx = (float*)tu_alloc(tu_f32, FD_L * FD_D);
  float* gwgu = (float*)tu_alloc(tu_f32, (size_t)(FD_E * FD_D * gh));
  float* gwd = (float*)tu_alloc(tu_f32, FD_E * FD_H * FD_D);
  float* gwg = (float*)tu_alloc(tu_f32, FD_E * FD_D);
  float* glg = (float*)tu_alloc(tu_f32, FD_L * FD_E);
  float* ggt = (float*)tu_alloc(tu_f32, FD_L * FD_K);
  tu_poison(gx, tu_f32, FD_L * FD_D);
  tu_poison(gwgu, tu_f32, (size_t)(FD_E * FD_D * gh));
  tu_poison(gwd, tu_f32, FD_E * FD_H * FD_D);
  tu_poison(gwg, tu_f32, FD_E * FD_D);
  tu_poison(glg, tu_f32, FD_L * FD_E);
  tu_poison(ggt, tu_f32, FD_L * FD_K);
  float ga = (float)c->ga, gz = (float)c->gz;
  n = n_in;
  a[n++] = tu_arg(MOEBLAZE_ARG_GRAD_OUTPUT, tu_tensor(dy, tu_f32, 2, sx));
  if (c->explicit_scalars) {
    a[n++] = tu_arg(MOEBLAZE_ARG_GRAD_AUX_LOSS, tu_tensor(&ga, tu_f32, 0, s1));
    a[n++] = tu_arg(MOEBLAZE_ARG_GRAD_Z_LOSS, tu_tensor(&gz, tu_f32, 0, s1));
  }
  a[n++] = tu_arg(MOEBLAZE_ARG_GRAD_INPUT, tu_tensor(gx, tu_f32, 2, sx));
  a[n++] = tu_arg(MOEBLAZE_ARG_GRAD_W_GATE_UP, tu_tensor(gwgu, tu_f32, 3, swgu));
  a[n++] = tu_arg(MOEBLAZE_ARG_GRAD_W_DOWN, tu_tensor(gwd, tu_f32, 3, swd));
  a[n++] = tu_arg(MOEBLAZE_ARG_GRAD_TOPK_WEIGHTS, tu_tensor(ggt, tu_f32, 2, sk));
  if (c->route == R_LOGITS) a[n++] = tu_arg(MOEBLAZE_ARG_GRAD_ROUTER_LOGITS, tu_tensor(glg, tu_f32, 2, slg));
  if (c->route == R_WEIGHT) a[n++] = tu_arg(MOEBLAZE_ARG_GRAD_ROUTER_WEIGHT, tu_tensor(gwg, tu_f32, 2, swg));
  assert_ok(moeblaze_backward(hd, a, n, sv, sv_b, wb, wb_b, NULL));

  from_f32(gx, G->dx, FD_L * FD_D);
  from_f32(gwgu, G->dwgu, (size_t)(FD_E * FD_D * gh));
  from_f32(gwd, G->dwd, FD_E * FD_H * FD_D);
  from_f32(gwg, G->dwg, FD_E * FD_D);
  from_f32(glg, G->dlogits, FD_L * FD_E);
  from_f32(ggt, G->dgates, FD_L * FD_K);

  tu_free(x); tu_free(wgu); tu_free(wd); tu_free(wg); tu_free(lg); tu_free(gt); tu_free(dy);
  tu_free(y); tu_free(ids); tu_free(wf); tu_free(wb); tu_free(sv);
  tu_free(gx); tu_free(gwgu); tu_free(gwd); tu_free(gwg); tu_free(glg); tu_free(ggt);
  assert_ok(moeblaze_destroy(hd));
}

static void check_case(fd_case* c) {
  const int64_t gh = ref_gate_factor(c->rl.activation) * FD_H;
  const size_t n_x = FD_L * FD_D, n_wgu = (size_t)(FD_E * FD_D * gh), n_wd = FD_E * FD_H * FD_D;
  ref_inputs in = inputs_of(c);

  /* analytic reference */
  static double rx[FD_L * FD_D], rwgu[FD_E * FD_D * 2 * FD_H], rwd[FD_E * FD_H * FD_D];
  static double rwg[FD_E * FD_D], rlg[FD_L * FD_E], rgt[FD_L * FD_K];
  ref_grads g;
  memset(&g, 0, sizeof g);
  g.dx = rx; g.dw_gate_up = rwgu; g.dw_down = rwd; g.dgates = rgt;
  if (c->route == R_LOGITS) g.dlogits = rlg;
  if (c->route == R_WEIGHT) g.dw_router = rwg;
  assert_int_equal(ref_layer_backward(&c->rl, FD_L, &in, c->dy, c->ga, c->gz, &g), 0);

  /* finite differences */
  static double fx[FD_L * FD_D], fwgu[FD_E * FD_D * 2 * FD_H], fwd[FD_E * FD_H * FD_D];
  static double fwg[FD_E * FD_D], flg[FD_L * FD_E], fgt[FD_L * FD_K];
  fd_grad(c, c->x, n_x, fx);
  fd_grad(c, c->wgu, n_wgu, fwgu);
  fd_grad(c, c->wd, n_wd, fwd);
  if (c->route == R_LOGITS) fd_grad(c, c->logits, FD_L * FD_E, flg);
  if (c->route == R_WEIGHT) fd_grad(c, c->wg, FD_E * FD_D, fwg);
  if (c->route == R_CALLER) fd_grad(c, c->gates, FD_L * FD_K, fgt);

  expect_close("dx", "reference", rx, fx, n_x, k_tol_ref, c);
  expect_close("dW_gate_up", "reference", rwgu, fwgu, n_wgu, k_tol_ref, c);
  expect_close("dW_down", "reference", rwd, fwd, n_wd, k_tol_ref, c);
  if (c->route == R_LOGITS) expect_close("d_logits", "reference", rlg, flg, FD_L * FD_E, k_tol_ref, c);
  if (c->route == R_WEIGHT) expect_close("dW_g", "reference", rwg, fwg, FD_E * FD_D, k_tol_ref, c);
  if (c->route == R_CALLER) expect_close("d_topk_weights", "reference", rgt, fgt, FD_L * FD_K, k_tol_ref, c);

  /* the library, f32 */
  static lib_grads G;
  run_library(c, &G);
  expect_close("dx", "library f32", G.dx, fx, n_x, k_tol_lib, c);
  expect_close("dW_gate_up", "library f32", G.dwgu, fwgu, n_wgu, k_tol_lib, c);
  expect_close("dW_down", "library f32", G.dwd, fwd, n_wd, k_tol_lib, c);
  if (c->route == R_LOGITS) expect_close("d_logits", "library f32", G.dlogits, flg, FD_L * FD_E, k_tol_lib, c);
  if (c->route == R_WEIGHT) expect_close("dW_g", "library f32", G.dwg, fwg, FD_E * FD_D, k_tol_lib, c);
  if (c->route == R_CALLER) expect_close("d_topk_weights", "library f32", G.dgates, fgt, FD_L * FD_K, k_tol_lib, c);
  else expect_close("d_topk_weights", "library f32 vs reference analytic", G.dgates, rgt, FD_L * FD_K, k_tol_lib, c);
}

typedef struct fd_state { int act; } fd_state;

static void test_fd(void** state) {
  const fd_state* s = (const fd_state*)*state;
  static fd_case c;
  for (int route = R_LOGITS; route <= R_CALLER; ++route)
    for (int score = 0; score < 2; ++score)
      for (int norm = 0; norm < 2; ++norm) {
        if (route == R_CALLER && (score || norm)) continue; /* no router in case 3 */
        const uint64_t seed = g_seed + 0x9E3779B97F4A7C15ull * (uint64_t)(1 + s->act * 100 + route * 10 + score * 2 + norm);
        make_case(&c, s->act, score, norm, route, seed);
        check_case(&c);
      }
}

/* Sanity of the reference's own pieces on hand-computable values. */
static void test_reference_pieces(void** state) {
  (void)state;
  ref_layer l;
  memset(&l, 0, sizeof l);
  l.E = 4; l.k = 2; l.d = 1; l.h = 1;
  /* ties go to the lower id; descending order */
  const double sc[8] = {0.1, 0.4, 0.4, 0.1, 0.3, 0.2, 0.3, 0.2};
  int64_t ids[4];
  ref_topk(&l, 2, sc, ids);
  assert_int_equal(ids[0], 1); assert_int_equal(ids[1], 2);
  assert_int_equal(ids[2], 0); assert_int_equal(ids[3], 2);
  /* activations */
  assert_true(fabs(ref_gelu(1.0) - 0.8413447460685429) < 1e-15);
  assert_true(fabs(ref_silu(1.0) - 0.7310585786300049) < 1e-15);
  assert_true(fabs(ref_gelu_grad(0.3) - (ref_gelu(0.3 + 1e-6) - ref_gelu(0.3 - 1e-6)) / 2e-6) < 1e-8);
  assert_true(fabs(ref_silu_grad(-0.7) - (ref_silu(-0.7 + 1e-6) - ref_silu(-0.7 - 1e-6)) / 2e-6) < 1e-8);
  /* plan by sort: the paper's worked example (docs/design.md) */
  const int64_t tei[10] = {2, 3, 0, 1, 0, 3, 1, 2, 0, 3};
  int64_t eti[10], off[5], tim[10];
  assert_int_equal(ref_plan_sort(5, 2, 4, tei, eti, off, tim), 0);
  const int64_t want_eti[10] = {1, 2, 4, 1, 3, 0, 3, 0, 2, 4}, want_off[5] = {0, 3, 5, 7, 10};
  for (int i = 0; i < 10; ++i) assert_int_equal(eti[i], want_eti[i]);
  for (int i = 0; i < 5; ++i) assert_int_equal(off[i], want_off[i]);
  assert_int_equal(tim[0], 5); assert_int_equal(tim[1], 7);
  for (int i = 0; i < 10; ++i) assert_int_equal(eti[tim[i]], i / 2);
  const int64_t bad[2] = {1, 1};
  assert_int_equal(ref_plan_sort(1, 2, 4, bad, eti, off, tim), -1);
  /* aux loss with uniform routing and uniform scores equals the coefficient */
  ref_layer u = l;
  u.aux_coeff = 0.25;
  const double us[8] = {0.25, 0.25, 0.25, 0.25, 0.25, 0.25, 0.25, 0.25};
  const int64_t uid[4] = {0, 1, 2, 3};
  assert_true(fabs(ref_aux_loss(&u, 2, us, uid) - 0.25) < 1e-15);
}

int main(void) {
  g_seed = tu_fresh_seed("test_finite_diff");
  static fd_state st[5];
  static const char* names[5] = {"finite_diff_relu", "finite_diff_gelu", "finite_diff_silu",
                                 "finite_diff_swiglu", "finite_diff_geglu"};
  struct CMUnitTest tests[6];
  memset(tests, 0, sizeof tests);
  tests[0].name = "reference_pieces";
  tests[0].test_func = test_reference_pieces;
  for (int a = 0; a < 5; ++a) {
    st[a].act = a;
    tests[a + 1].name = names[a];
    tests[a + 1].test_func = test_fd;
    tests[a + 1].initial_state = &st[a];
  }
  return cmocka_run_group_tests_name("finite_diff", tests, NULL, NULL);
}
