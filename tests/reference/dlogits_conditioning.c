/* Why d logits in bf16 is further from the fp64 reference at L = 1 than at large L:
 * for random single-token layers it prints, per case, the relative error of d logits from the
 * CPU engine in bf16 and in f32 (same bf16-representable data) against the fp64 reference
 * with and without the engines' bf16 intermediates modelled, the error of the gate gradients
 * dg it is computed from, and the conditioning kappa of the router backward at that point:
 * (computed exactly below, as the componentwise condition number of the linear map dg -> d logits),
 * the factor by which relative errors in dg reach d logits through the cancellations of the
 * renormalisation and the softmax Jacobian. The test asserts that the bf16 error stays within
 * delta * kappa (delta: the engine's largest relative dg error): the error is the bf16 rounding
 * of the intermediates, amplified by the conditioning, not an ordering problem (the engine
 * matches the bf16-modelled reference to ~1e-6). docs/design.md ("Numerics") records it. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "reference_moe.h"
#include "test_util.h"

enum { E = 8, K = 2, D = 64, H = 128, CASES = 400 };

static double round_bf16(double v) { return tu_bf16_to_f32(tu_f32_to_bf16((float)v)); }

/* One forward + backward on the CPU engine; returns d logits and d topk weights as doubles. */
static int run(moeblaze_dtype_t dt, int64_t L, int normalize, const double* x, const double* lg, const double* wgu,
               const double* wd, const double* dy, double* dlogits, double* dgates) {
  tu_layer l = tu_layer_default(E, K, D, H, L, MOEBLAZE_ACTIVATION_SWIGLU);
  l.normalize = normalize;
  l.act_dtype = l.weight_dtype = dt;
  l.num_threads = 1;
  moeblaze_handle_t h;
  if (tu_create_cpu(&l, &h)) return 1;
  const int64_t sx[2] = {L, D}, sl[2] = {L, E}, sw[3] = {E, D, 2 * H}, sd[3] = {E, H, D}, sk[2] = {L, K};
  void *bx = tu_alloc(dt, L * D), *bw = tu_alloc(dt, E * D * 2 * H), *bd = tu_alloc(dt, E * H * D), *by = tu_alloc(dt, L * D),
       *bdy = tu_alloc(dt, L * D), *bdx = tu_alloc(dt, L * D);
  float *blg = tu_alloc(tu_f32, L * E), *bdl = tu_alloc(tu_f32, L * E), *bdg = tu_alloc(tu_f32, L * K);
  for (int64_t i = 0; i < L * D; ++i) { tu_store(bx, dt, i, x[i]); tu_store(bdy, dt, i, dy[i]); }
  for (int64_t i = 0; i < E * D * 2 * H; ++i) tu_store(bw, dt, i, wgu[i]);
  for (int64_t i = 0; i < E * H * D; ++i) tu_store(bd, dt, i, wd[i]);
  for (int64_t i = 0; i < L * E; ++i) blg[i] = (float)lg[i];
  moeblaze_arg_t f[5] = {tu_arg(MOEBLAZE_ARG_INPUT, tu_tensor(bx, dt, 2, sx)), tu_arg(MOEBLAZE_ARG_ROUTER_LOGITS, tu_tensor(blg, tu_f32, 2, sl)),
                         tu_arg(MOEBLAZE_ARG_W_GATE_UP, tu_tensor(bw, dt, 3, sw)), tu_arg(MOEBLAZE_ARG_W_DOWN, tu_tensor(bd, dt, 3, sd)),
                         tu_arg(MOEBLAZE_ARG_OUTPUT, tu_tensor(by, dt, 2, sx))};
  moeblaze_arg_t b[8] = {f[0], f[1], f[2], f[3], tu_arg(MOEBLAZE_ARG_GRAD_OUTPUT, tu_tensor(bdy, dt, 2, sx)),
                         tu_arg(MOEBLAZE_ARG_GRAD_INPUT, tu_tensor(bdx, dt, 2, sx)),
                         tu_arg(MOEBLAZE_ARG_GRAD_ROUTER_LOGITS, tu_tensor(bdl, tu_f32, 2, sl)),
                         tu_arg(MOEBLAZE_ARG_GRAD_TOPK_WEIGHTS, tu_tensor(bdg, tu_f32, 2, sk))};
  size_t wf, wb, sv;
  moeblaze_get_workspace_size(h, MOEBLAZE_PASS_FORWARD_TRAINING, L, &wf);
  moeblaze_get_workspace_size(h, MOEBLAZE_PASS_BACKWARD, L, &wb);
  moeblaze_get_saved_size(h, L, &sv);
  void *ws = tu_alloc_bytes(wf > wb ? wf : wb), *saved = tu_alloc_bytes(sv);
  int rc = moeblaze_forward(h, MOEBLAZE_PASS_FORWARD_TRAINING, f, 5, ws, wf > wb ? wf : wb, saved, sv, NULL) ||
           moeblaze_backward(h, b, 8, saved, sv, ws, wf > wb ? wf : wb, NULL);
  for (int64_t i = 0; i < L * E; ++i) dlogits[i] = bdl[i];
  for (int64_t i = 0; i < L * K; ++i) dgates[i] = bdg[i];
  void* all[] = {bx, bw, bd, by, bdy, bdx, blg, bdl, bdg, ws, saved};
  for (size_t i = 0; i < sizeof all / sizeof all[0]; ++i) tu_free(all[i]);
  moeblaze_destroy(h);
  return rc;
}

int main(int argc, char** argv) {
  const int verbose = argc > 1;
  tu_rng r;
  tu_rng_seed(&r, tu_fresh_seed("dlogits_conditioning"));
  double worst_ratio = 0, sum_err[2] = {0, 0}, sum_f32 = 0, worst_model = 0;
  int fails = 0, n[2] = {0, 0};
  const int64_t Ls[2] = {1, 64};
  for (int c = 0; c < CASES; ++c) {
    const int64_t L = Ls[c % 2];
    const int normalize = (c / 2) % 2;
    double *x = malloc(sizeof(double) * L * D), *lg = malloc(sizeof(double) * L * E), *wgu = malloc(sizeof(double) * E * D * 2 * H),
           *wd = malloc(sizeof(double) * E * H * D), *dy = malloc(sizeof(double) * L * D);
    for (int64_t i = 0; i < L * D; ++i) { x[i] = round_bf16(tu_rng_normal(&r)); dy[i] = round_bf16(tu_rng_normal(&r)); }
    for (int64_t i = 0; i < L * E; ++i) lg[i] = (float)tu_rng_normal(&r);
    for (int64_t i = 0; i < E * D * 2 * H; ++i) wgu[i] = round_bf16(0.15 * tu_rng_normal(&r));
    for (int64_t i = 0; i < E * H * D; ++i) wd[i] = round_bf16(0.1 * tu_rng_normal(&r));
    double dl16[L * E], dg16[L * K], dl32[L * E], dg32[L * K];
    if (run(tu_bf16, L, normalize, x, lg, wgu, wd, dy, dl16, dg16) || run(tu_f32, L, normalize, x, lg, wgu, wd, dy, dl32, dg32)) {
      fprintf(stderr, "run failed: %s\n", moeblaze_get_last_error_message());
      return 1;
    }
    /* references: exact, and with the engines' bf16 intermediates */
    ref_layer rl = {E, K, D, H, REF_ACT_SWIGLU, REF_SCORE_SOFTMAX, normalize, 0, 0, NULL};
    double dl[2][L * E], dg[2][L * K], gates[L * K], y[L * D];
    int64_t ids[L * K], counts[E];
    double aux, z;
    ref_route(&rl, L, lg, NULL, ids, gates, counts, &aux, &z);
    for (int m = 0; m < 2; ++m) {
      rl.round_act = m ? round_bf16 : NULL;
      ref_forward(&rl, L, x, wgu, wd, ids, gates, y);
      ref_backward(&rl, L, x, wgu, wd, ids, gates, dy, NULL, NULL, NULL, dg[m]);
      ref_router_backward(&rl, L, lg, ids, dg[m], 0, 0, dl[m]);
    }
    /* d logits is linear in dg (aux and z off): dl_t = sum_j M_tj dg_tj, with M_tj the router
     * backward of a unit dg_tj. kappa = || sum_j |M_tj| |dg_tj| || / || dl || is its
     * componentwise condition number: |dl' - dl| <= delta kappa ||dl|| for any dg' with
     * |dg'_tj - dg_tj| <= delta |dg_tj|. */
    double kn = 0, dn = 0;
    for (int64_t t = 0; t < L; ++t) {
      double acc[E] = {0};
      for (int j = 0; j < K; ++j) {
        double unit[K] = {0}, m[E];
        unit[j] = 1.0;
        ref_router_backward(&rl, 1, lg + t * E, ids + t * K, unit, 0, 0, m);
        for (int e = 0; e < E; ++e) acc[e] += fabs(m[e]) * fabs(dg[0][t * K + j]);
      }
      for (int e = 0; e < E; ++e) {
        kn += acc[e] * acc[e];
        dn += dl[0][t * E + e] * dl[0][t * E + e];
      }
    }
    double delta = 0; /* componentwise relative error of the engine's dg */
    for (int64_t i = 0; i < L * K; ++i) delta = fmax(delta, fabs(dg16[i] - dg[0][i]) / fmax(fabs(dg[0][i]), 1e-30));
    const double kappa = sqrt(kn / (dn > 0 ? dn : 1e-300));
    const double e16 = tu_rel_err(dl16, dl[0], L * E), e16r = tu_rel_err(dl16, dl[1], L * E);
    const double e32 = tu_rel_err(dl32, dl[0], L * E), edg = tu_rel_err(dg16, dg[0], L * K);
    const double bound = 1.01 * delta * kappa + 1e-4; /* + the f32 arithmetic of the engine */
    if (e16 > bound) ++fails;
    worst_ratio = fmax(worst_ratio, e16 / bound);
    sum_err[L > 1] += e16;
    n[L > 1]++;
    sum_f32 = fmax(sum_f32, e32);
    if (verbose || e16 > 0.02)
      printf("L=%-3lld norm=%d  d logits bf16 vs fp64 %.2e (vs bf16-modelled ref %.1e), f32 %.1e; dg %.2e (max comp. %.2e); kappa %.1f\n",
             (long long)L, normalize, e16, e16r, e32, edg, delta, kappa);
    worst_model = fmax(worst_model, e16r);
    free(x); free(lg); free(wgu); free(wd); free(dy);
  }
  printf("mean bf16 d logits error vs fp64: L=1 %.2e, L=64 %.2e; worst vs the bf16-modelled reference %.1e; worst f32 %.1e;"
         " worst error / (delta kappa) bound %.2f; %d of %d cases over it\n",
         sum_err[0] / n[0], sum_err[1] / n[1], worst_model, sum_f32, worst_ratio, fails, CASES);
  return fails ? 1 : 0;
}
