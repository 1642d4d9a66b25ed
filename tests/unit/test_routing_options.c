/* Group-limited routing, the expert score bias and the route scale (docs/routing.md) on the CPU
 * engine, against an independent fp64 reference of DeepSeek-V3's rule written here:
 *  - the picked ids (in rank order) and gates for softmax and sigmoid scores, with and without
 *    renormalisation, groups of 1 to 4 experts, with and without a bias, scales 1 and 2.5;
 *  - a bias that moves the selection leaves the gates to the unbiased scores;
 *  - the route scale multiplies y and the router's gradient exactly as it multiplies the gates;
 *  - the sequence-wise balance loss (SEQUENCE_LENGTHS) against its definition in fp64, and its
 *    gradient against central differences;
 *  - the refusals: groups that do not divide E, TOPK_GROUPS above the group count or holding
 *    fewer than k experts, a bias of the wrong shape or dtype, a bias with caller routing,
 *    sequence lengths that do not sum to the tokens; a refused call writes nothing;
 *  - AUX_LOSS_FORM = HUGGING_FACE: k times the Switch form, value and gradient;
 *  - TOKEN_MASK: a masked call equals the same call on the unmasked tokens alone;
 *  - a loss whose coefficient is 0 reads exactly 0, even where its sum overflows fp32. */
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <setjmp.h>
#include <cmocka.h>

#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "moe_step.h"
#include "test_util.h"

enum { E = 16, L = 48, D = 8, H = 12, MAXK = 8 };

typedef struct opts {
  int64_t k, groups, keep, score_fn, normalize;
  double scale, aux;
  int64_t form;  /* AUX_LOSS_FORM */
  double z;      /* Z_LOSS_COEFF */
} opts;

static moeblaze_status_t make(const opts* o, moeblaze_handle_t* h) {
  moeblaze_config_t cfg = NULL;
  moeblaze_status_t s = moeblaze_config_create(&cfg);
  if (s != MOEBLAZE_STATUS_SUCCESS) return s;
  const struct { moeblaze_attr_t a; int64_t v; } i64s[] = {
      {MOEBLAZE_ATTR_NUM_EXPERTS, E}, {MOEBLAZE_ATTR_TOP_K, o->k}, {MOEBLAZE_ATTR_HIDDEN_SIZE, D},
      {MOEBLAZE_ATTR_FFN_HIDDEN_SIZE, H}, {MOEBLAZE_ATTR_MAX_TOKENS, 64},
      {MOEBLAZE_ATTR_ACTIVATION, MOEBLAZE_ACTIVATION_SWIGLU}, {MOEBLAZE_ATTR_SCORE_FUNCTION, o->score_fn},
      {MOEBLAZE_ATTR_NORMALIZE_TOPK, o->normalize}, {MOEBLAZE_ATTR_DEVICE_TYPE, MOEBLAZE_DEVICE_CPU},
      {MOEBLAZE_ATTR_NUM_EXPERT_GROUPS, o->groups}, {MOEBLAZE_ATTR_TOPK_GROUPS, o->keep},
      {MOEBLAZE_ATTR_AUX_LOSS_FORM, o->form}};
  for (size_t i = 0; i < sizeof i64s / sizeof i64s[0] && s == MOEBLAZE_STATUS_SUCCESS; ++i)
    s = moeblaze_config_set_i64(cfg, i64s[i].a, i64s[i].v);
  if (s == MOEBLAZE_STATUS_SUCCESS) s = moeblaze_config_set_dtype(cfg, MOEBLAZE_ATTR_ACTIVATION_DTYPE, tu_f32);
  if (s == MOEBLAZE_STATUS_SUCCESS) s = moeblaze_config_set_dtype(cfg, MOEBLAZE_ATTR_WEIGHT_DTYPE, tu_f32);
  if (s == MOEBLAZE_STATUS_SUCCESS) s = moeblaze_config_set_f64(cfg, MOEBLAZE_ATTR_ROUTE_SCALE, o->scale);
  if (s == MOEBLAZE_STATUS_SUCCESS) s = moeblaze_config_set_f64(cfg, MOEBLAZE_ATTR_AUX_LOSS_COEFF, o->aux);
  if (s == MOEBLAZE_STATUS_SUCCESS) s = moeblaze_config_set_f64(cfg, MOEBLAZE_ATTR_Z_LOSS_COEFF, o->z);
  *h = NULL;
  if (s == MOEBLAZE_STATUS_SUCCESS) s = moeblaze_create(h, cfg);
  moeblaze_config_destroy(cfg);
  return s;
}

/* ---- the reference: DeepSeek-V3's selection in fp64 ---- */
typedef struct ranked { double v; int id; } ranked;
static int by_value(const void* a, const void* b) {  /* higher first, then the lower id */
  const ranked *x = a, *y = b;
  if (x->v != y->v) return x->v > y->v ? -1 : 1;
  return x->id - y->id;
}

/* Picks, gates and the smallest gap between a kept and a dropped candidate (group or expert):
 * the caller draws again where that gap is too small for fp32 to rank the same way. */
static double reference(const opts* o, const float* l, const float* bias, int32_t* ids, double* gates) {
  double s[E], v[E], m = -INFINITY, sum = 0, gap = INFINITY;
  for (int e = 0; e < E; ++e) m = fmax(m, l[e]);
  for (int e = 0; e < E; ++e) sum += exp((double)l[e] - m);
  for (int e = 0; e < E; ++e)
    s[e] = o->score_fn == MOEBLAZE_SCORE_SIGMOID ? 1.0 / (1.0 + exp(-(double)l[e])) : exp((double)l[e] - m) / sum;
  for (int e = 0; e < E; ++e) v[e] = s[e] + (bias ? bias[e] : 0.0);
  int open[E];
  for (int e = 0; e < E; ++e) open[e] = 1;
  const int size = (int)(E / o->groups);
  if (o->keep > 0 && o->keep < o->groups) {
    ranked g[E];
    for (int q = 0; q < o->groups; ++q) {
      ranked in[E];
      for (int i = 0; i < size; ++i) in[i] = (ranked){v[q * size + i], q * size + i};
      qsort(in, (size_t)size, sizeof in[0], by_value);
      g[q] = (ranked){size >= 2 ? in[0].v + in[1].v : in[0].v, q};
    }
    qsort(g, (size_t)o->groups, sizeof g[0], by_value);
    gap = fmin(gap, g[o->keep - 1].v - g[o->keep].v);
    for (int e = 0; e < E; ++e) open[e] = 0;
    for (int q = 0; q < o->keep; ++q)
      for (int i = 0; i < size; ++i) open[g[q].id * size + i] = 1;
  }
  ranked c[E];
  int n = 0;
  for (int e = 0; e < E; ++e)
    if (open[e]) c[n++] = (ranked){v[e], e};
  qsort(c, (size_t)n, sizeof c[0], by_value);
  for (int j = 0; j + 1 < n && j <= o->k; ++j) gap = fmin(gap, c[j].v - c[j + 1].v);
  double norm = 0;
  for (int j = 0; j < o->k; ++j) norm += s[c[j].id];
  for (int j = 0; j < o->k; ++j) {
    ids[j] = c[j].id;
    gates[j] = (o->normalize ? s[c[j].id] / norm : s[c[j].id]) * o->scale;
  }
  return gap;
}

/* moeblaze_route from logits (and the bias when given). */
static moeblaze_status_t route(moeblaze_handle_t h, int64_t k, float* logits, float* bias, int32_t* ids, float* gates) {
  const int64_t sl[2] = {L, E}, sk[2] = {L, k}, se[1] = {E};
  moeblaze_arg_t r[4] = {tu_arg(MOEBLAZE_ARG_ROUTER_LOGITS, tu_tensor(logits, tu_f32, 2, sl)),
                         tu_arg(MOEBLAZE_ARG_TOPK_INDICES, tu_tensor(ids, tu_i32, 2, sk)),
                         tu_arg(MOEBLAZE_ARG_TOPK_WEIGHTS, tu_tensor(gates, tu_f32, 2, sk)),
                         tu_arg(MOEBLAZE_ARG_EXPERT_BIAS, tu_tensor(bias, tu_f32, 1, se))};
  size_t ws = 0;
  moeblaze_status_t s = moeblaze_get_workspace_size(h, MOEBLAZE_PASS_ROUTE, L, &ws);
  if (s != MOEBLAZE_STATUS_SUCCESS) return s;
  void* w = tu_alloc_bytes(ws);
  s = moeblaze_route(h, r, bias ? 4 : 3, w, ws, NULL);
  tu_free(w);
  return s;
}

static void routing_matches_reference(void** state) {
  (void)state;
  tu_rng rng;
  tu_rng_seed(&rng, tu_fresh_seed("routing_options"));
  const int64_t group_sets[][2] = {{1, 0}, {4, 2}, {8, 3}, {16, 4}, {4, 4}};
  int cases = 0;
  for (int fn = 0; fn < 2; ++fn)
    for (size_t gs = 0; gs < sizeof group_sets / sizeof group_sets[0]; ++gs)
      for (int with_bias = 0; with_bias < 2; ++with_bias)
        for (int k = 2; k <= 4; k += 2) {
          const opts o = {k, group_sets[gs][0], group_sets[gs][1], fn ? MOEBLAZE_SCORE_SIGMOID : MOEBLAZE_SCORE_SOFTMAX,
                          (cases % 2), cases % 3 == 1 ? 2.5 : 1.0, 0, 0};
          moeblaze_handle_t h = NULL;
          assert_int_equal(make(&o, &h), MOEBLAZE_STATUS_SUCCESS);
          float logits[L * E], bias[E], gates[L * MAXK];
          int32_t ids[L * MAXK], want_ids[MAXK];
          double want_gates[MAXK];
          for (int e = 0; e < E; ++e) bias[e] = (float)(0.2 * tu_rng_normal(&rng));
          for (int t = 0; t < L; ++t)  /* draw again where fp32 could rank differently */
            do {
              for (int e = 0; e < E; ++e) logits[t * E + e] = (float)(1.5 * tu_rng_normal(&rng));
            } while (reference(&o, logits + t * E, with_bias ? bias : NULL, want_ids, want_gates) < 1e-4);
          tu_poison(ids, tu_i32, (size_t)(L * k));
          tu_poison(gates, tu_f32, (size_t)(L * k));
          assert_int_equal(route(h, k, logits, with_bias ? bias : NULL, ids, gates), MOEBLAZE_STATUS_SUCCESS);
          for (int t = 0; t < L; ++t) {
            reference(&o, logits + t * E, with_bias ? bias : NULL, want_ids, want_gates);
            for (int j = 0; j < k; ++j) {
              if (ids[t * k + j] != want_ids[j] || fabs(gates[t * k + j] - want_gates[j]) > 1e-6 * (1 + fabs(want_gates[j])))
                fail_msg("fn %d groups %lld keep %lld bias %d k %d scale %g: token %d pick %d is expert %d gate %g, "
                         "want %d gate %g", fn, (long long)o.groups, (long long)o.keep, with_bias, k, o.scale, t, j,
                         ids[t * k + j], gates[t * k + j], want_ids[j], want_gates[j]);
            }
          }
          moeblaze_destroy(h);
          ++cases;
        }
  print_message("%d routing configurations match the fp64 reference of DeepSeek-V3's rule\n", cases);
}

/* A bias that moves the selection onto expert 3 leaves its gate to the unbiased score. */
static void bias_selects_but_does_not_gate(void** state) {
  (void)state;
  const opts o = {2, 1, 0, MOEBLAZE_SCORE_SIGMOID, 0, 1.0, 0, 0};
  moeblaze_handle_t h = NULL;
  assert_int_equal(make(&o, &h), MOEBLAZE_STATUS_SUCCESS);
  float logits[L * E], bias[E] = {0}, gates[L * 2];
  int32_t ids[L * 2];
  tu_rng rng;
  tu_rng_seed(&rng, 7);
  for (int i = 0; i < L * E; ++i) logits[i] = (float)tu_rng_normal(&rng);
  bias[3] = 10.f;
  assert_int_equal(route(h, 2, logits, bias, ids, gates), MOEBLAZE_STATUS_SUCCESS);
  for (int t = 0; t < L; ++t) {
    assert_int_equal(ids[t * 2], 3);
    const float want = 1.f / (1.f + expf(-logits[t * E + 3]));
    assert_true(fabsf(gates[t * 2] - want) <= 1e-6f);
  }
  moeblaze_destroy(h);
}

/* ROUTE_SCALE c: y and the router's gradient are c times those of the same layer without it. */
static void route_scale_scales_y_and_gradients(void** state) {
  (void)state;
  const double c = 2.5;
  opts o = {2, 4, 2, MOEBLAZE_SCORE_SOFTMAX, 1, 1.0, 0, 0};
  moeblaze_handle_t h1 = NULL, hc = NULL;
  assert_int_equal(make(&o, &h1), MOEBLAZE_STATUS_SUCCESS);
  o.scale = c;
  assert_int_equal(make(&o, &hc), MOEBLAZE_STATUS_SUCCESS);
  ms_problem p1, pc;
  ms_init(&p1, h1, L, E, 2, D, H, 1, 99);
  ms_init(&pc, hc, L, E, 2, D, H, 1, 99);
  assert_int_equal(ms_forward(h1, &p1), MOEBLAZE_STATUS_SUCCESS);
  assert_int_equal(ms_forward(hc, &pc), MOEBLAZE_STATUS_SUCCESS);
  assert_int_equal(ms_backward(h1, &p1), MOEBLAZE_STATUS_SUCCESS);
  assert_int_equal(ms_backward(hc, &pc), MOEBLAZE_STATUS_SUCCESS);
  /* relative L2 errors of y and of d logits against c times the unscaled layer's */
  double ny = 0, dy = 0, nl = 0, dl = 0;
  for (int64_t i = 0; i < L * D; ++i) ny += pow(c * p1.y[i], 2), dy += pow(pc.y[i] - c * p1.y[i], 2);
  for (int64_t i = 0; i < L * E; ++i) nl += pow(c * p1.dlogits[i], 2), dl += pow(pc.dlogits[i] - c * p1.dlogits[i], 2);
  for (int64_t i = 0; i < L * 2; ++i) assert_int_equal(pc.ids[i], p1.ids[i]);
  const double ey = sqrt(dy / ny), el = sqrt(dl / nl);
  print_message("ROUTE_SCALE %g: y within %.2g and d logits within %.2g (relative L2) of %g x the unscaled layer's\n",
                c, ey, el, c);
  assert_true(ny > 0 && nl > 0 && ey < 1e-6 && el < 1e-5);
  ms_free(&p1);
  ms_free(&pc);
  moeblaze_destroy(h1);
  moeblaze_destroy(hc);
}

/* ---- the sequence-wise balance loss ---- */
enum { NSEQ = 3 };
static const int64_t kLengths[NSEQ] = {10, 25, 13};  /* sum L */

/* Forward routed from logits: AUX_LOSS with the lengths (or without: batch-wise). */
static float seq_aux(moeblaze_handle_t h, ms_problem* p, int with_lengths, moeblaze_status_t* st) {
  moeblaze_arg_t a[16];
  size_t n = ms_forward_args(p, a);
  float aux = NAN;
  const int64_t sn[1] = {NSEQ};
  a[n++] = tu_arg(MOEBLAZE_ARG_AUX_LOSS, tu_tensor(&aux, tu_f32, 0, NULL));
  if (with_lengths) a[n++] = tu_arg(MOEBLAZE_ARG_SEQUENCE_LENGTHS, tu_tensor((void*)kLengths, tu_i64, 1, sn));
  *st = moeblaze_forward(h, MOEBLAZE_PASS_FORWARD_TRAINING, a, n, p->ws, p->ws_bytes, p->saved, p->saved_bytes, NULL);
  return aux;
}

/* The definition: alpha / B * sum_q E / (k T_q) * sum_e n_qe * mean_t s'_te, in fp64. */
static double seq_aux_reference(const opts* o, const float* logits, const int32_t* ids) {
  double total = 0;
  int64_t t0 = 0;
  for (int q = 0; q < NSEQ; ++q) {
    double P[E] = {0}, cnt[E] = {0};
    for (int64_t t = t0; t < t0 + kLengths[q]; ++t) {
      double s[E], m = -INFINITY, sum = 0, ssum = 0;
      for (int e = 0; e < E; ++e) m = fmax(m, logits[t * E + e]);
      for (int e = 0; e < E; ++e) sum += exp(logits[t * E + e] - m);
      for (int e = 0; e < E; ++e) {
        s[e] = o->score_fn == MOEBLAZE_SCORE_SIGMOID ? 1 / (1 + exp(-(double)logits[t * E + e])) : exp(logits[t * E + e] - m) / sum;
        ssum += s[e];
      }
      for (int e = 0; e < E; ++e) P[e] += o->score_fn == MOEBLAZE_SCORE_SIGMOID ? s[e] / ssum : s[e];
      for (int j = 0; j < o->k; ++j) cnt[ids[t * o->k + j]] += 1;
    }
    double sq = 0;
    for (int e = 0; e < E; ++e) sq += cnt[e] * P[e] / (double)kLengths[q];
    total += sq * E / ((double)o->k * (double)kLengths[q]);
    t0 += kLengths[q];
  }
  return o->aux * total / NSEQ;
}

static void sequence_balance_loss(void** state) {
  (void)state;
  for (int fn = 0; fn < 2; ++fn) {
    const opts o = {2, 1, 0, fn ? MOEBLAZE_SCORE_SIGMOID : MOEBLAZE_SCORE_SOFTMAX, 1, 1.0, 0.01, 0};
    moeblaze_handle_t h = NULL;
    assert_int_equal(make(&o, &h), MOEBLAZE_STATUS_SUCCESS);
    ms_problem p;
    ms_init(&p, h, L, E, 2, D, H, 1, 31 + (uint64_t)fn);
    moeblaze_status_t st;
    const float aux = seq_aux(h, &p, 1, &st);
    if (st != MOEBLAZE_STATUS_SUCCESS) fail_msg("forward: %s", moeblaze_get_last_error_message());
    const double want = seq_aux_reference(&o, p.logits, p.ids);
    print_message("%s: sequence-wise balance loss %.6g, reference %.6g\n", fn ? "sigmoid" : "softmax", aux, want);
    assert_true(fabs(aux - want) <= 1e-5 * fabs(want));
    const float batch = seq_aux(h, &p, 0, &st);
    assert_true(fabs(batch - aux) > 1e-7);  /* the lengths change the loss */

    /* Its gradient: backward with dy = 0, GRAD_AUX_LOSS = 1 and the lengths gives d aux / d logits;
     * against central differences of the forward's AUX_LOSS where the picks do not change. */
    moeblaze_arg_t f[16];
    size_t nf = ms_forward_args(&p, f);
    float aux_t = 0, one = 1.f;
    const int64_t sn[1] = {NSEQ};
    f[nf++] = tu_arg(MOEBLAZE_ARG_AUX_LOSS, tu_tensor(&aux_t, tu_f32, 0, NULL));
    f[nf++] = tu_arg(MOEBLAZE_ARG_SEQUENCE_LENGTHS, tu_tensor((void*)kLengths, tu_i64, 1, sn));
    assert_int_equal(moeblaze_forward(h, MOEBLAZE_PASS_FORWARD_TRAINING, f, nf, p.ws, p.ws_bytes, p.saved, p.saved_bytes, NULL),
                     MOEBLAZE_STATUS_SUCCESS);
    memset(p.dy, 0, sizeof(float) * L * D);
    moeblaze_arg_t b[16];
    size_t nb = ms_backward_args(&p, b);
    b[nb++] = tu_arg(MOEBLAZE_ARG_GRAD_AUX_LOSS, tu_tensor(&one, tu_f32, 0, NULL));
    b[nb++] = tu_arg(MOEBLAZE_ARG_SEQUENCE_LENGTHS, tu_tensor((void*)kLengths, tu_i64, 1, sn));
    assert_int_equal(moeblaze_backward(h, b, nb, p.saved, p.saved_bytes, p.ws, p.ws_bytes, NULL), MOEBLAZE_STATUS_SUCCESS);
    int32_t ids0[L * 2];
    memcpy(ids0, p.ids, sizeof ids0);
    double num = 0, den = 0;
    int checked = 0;
    for (int i = 0; i < L * E; i += 7) {
      const float keep = p.logits[i], eps = 1e-2f;
      p.logits[i] = keep + eps;
      const float up = seq_aux(h, &p, 1, &st);
      const int same_up = memcmp(ids0, p.ids, sizeof ids0) == 0;
      p.logits[i] = keep - eps;
      const float down = seq_aux(h, &p, 1, &st);
      const int same_down = memcmp(ids0, p.ids, sizeof ids0) == 0;
      p.logits[i] = keep;
      if (!same_up || !same_down) continue;  /* a pick moved: the loss jumps there */
      const double fd = ((double)up - (double)down) / (2.0 * eps);
      num += pow(p.dlogits[i] - fd, 2);
      den += fd * fd;
      ++checked;
    }
    const double err = sqrt(num / den);
    print_message("  d aux / d logits against central differences at %d logits: relative L2 error %.2g\n", checked, err);
    assert_true(checked > 50 && err < 2e-2);
    ms_free(&p);
    moeblaze_destroy(h);
  }
}

/* AUX_LOSS_FORM = HUGGING_FACE: k times the Switch form's loss and d logits (dy = 0, so d logits
 * is the balance loss's alone), the same picks; refused with SEQUENCE_LENGTHS. */
static void hugging_face_form(void** state) {
  (void)state;
  const int64_t k = 3;
  opts o = {k, 1, 0, MOEBLAZE_SCORE_SOFTMAX, 1, 1.0, 0.01, MOEBLAZE_AUX_LOSS_SWITCH};
  moeblaze_handle_t hs = NULL, hf = NULL;
  assert_int_equal(make(&o, &hs), MOEBLAZE_STATUS_SUCCESS);
  o.form = MOEBLAZE_AUX_LOSS_HUGGING_FACE;
  assert_int_equal(make(&o, &hf), MOEBLAZE_STATUS_SUCCESS);
  int64_t form = -1;
  assert_int_equal(moeblaze_handle_get_i64(hf, MOEBLAZE_ATTR_AUX_LOSS_FORM, &form), MOEBLAZE_STATUS_SUCCESS);
  assert_int_equal(form, MOEBLAZE_AUX_LOSS_HUGGING_FACE);
  float aux[2];
  ms_problem p[2];
  moeblaze_handle_t hh[2] = {hs, hf};
  for (int i = 0; i < 2; ++i) {
    ms_init(&p[i], hh[i], L, E, k, D, H, 1, 77);
    moeblaze_status_t st;
    aux[i] = seq_aux(hh[i], &p[i], 0, &st);
    assert_int_equal(st, MOEBLAZE_STATUS_SUCCESS);
    memset(p[i].dy, 0, sizeof(float) * L * D);
    float one = 1.f;
    moeblaze_arg_t b[16];
    size_t nb = ms_backward_args(&p[i], b);
    b[nb++] = tu_arg(MOEBLAZE_ARG_GRAD_AUX_LOSS, tu_tensor(&one, tu_f32, 0, NULL));
    assert_int_equal(moeblaze_backward(hh[i], b, nb, p[i].saved, p[i].saved_bytes, p[i].ws, p[i].ws_bytes, NULL),
                     MOEBLAZE_STATUS_SUCCESS);
  }
  assert_memory_equal(p[0].ids, p[1].ids, sizeof(int32_t) * L * k);
  print_message("balance loss: Switch form %.6g, Hugging Face form %.6g (k = %lld)\n", aux[0], aux[1], (long long)k);
  assert_true(aux[0] > 0 && fabs(aux[1] - (double)k * aux[0]) <= 1e-6 * aux[1]);
  double num = 0, den = 0;
  for (int64_t i = 0; i < L * E; ++i) {
    num += pow(p[1].dlogits[i] - (double)k * p[0].dlogits[i], 2);
    den += pow((double)k * p[0].dlogits[i], 2);
  }
  assert_true(den > 0 && sqrt(num / den) < 1e-6);
  moeblaze_status_t st;
  const float refused = seq_aux(hf, &p[1], 1, &st);
  (void)refused;
  assert_int_equal(st, MOEBLAZE_STATUS_INVALID_ARGUMENT);
  assert_non_null(strstr(moeblaze_get_last_error_message(), "SEQUENCE_LENGTHS"));
  for (int i = 0; i < 2; ++i) ms_free(&p[i]);
  moeblaze_destroy(hs);
  moeblaze_destroy(hf);
}

/* TOKEN_MASK on the CPU engine: the masked call against the same call on the unmasked tokens
 * alone (an independent reference): the same picks, y, dx, d logits (balance loss included)
 * and expert gradients for those tokens, AUX_LOSS and TOKENS_PER_EXPERT; id -1 and zero rows
 * for the masked ones; the same through caller routing. */
static float masked_step_in(moeblaze_handle_t h, ms_problem* p, const int32_t* mask, int64_t L_, const int64_t* lens,
                            int64_t B) {
  const int64_t sm[1] = {L_}, sn[1] = {B};
  float aux = NAN, one = 1.f;
  moeblaze_arg_t f[16], b[16];
  size_t nf = ms_forward_args(p, f), nb = ms_backward_args(p, b);
  f[nf++] = tu_arg(MOEBLAZE_ARG_AUX_LOSS, tu_tensor(&aux, tu_f32, 0, NULL));
  if (mask) f[nf++] = tu_arg(MOEBLAZE_ARG_TOKEN_MASK, tu_tensor((void*)mask, tu_i32, 1, sm));
  b[nb++] = tu_arg(MOEBLAZE_ARG_GRAD_AUX_LOSS, tu_tensor(&one, tu_f32, 0, NULL));
  if (mask) b[nb++] = tu_arg(MOEBLAZE_ARG_TOKEN_MASK, tu_tensor((void*)mask, tu_i32, 1, sm));
  if (lens) {
    f[nf++] = tu_arg(MOEBLAZE_ARG_SEQUENCE_LENGTHS, tu_tensor((void*)lens, tu_i64, 1, sn));
    b[nb++] = tu_arg(MOEBLAZE_ARG_SEQUENCE_LENGTHS, tu_tensor((void*)lens, tu_i64, 1, sn));
  }
  moeblaze_status_t st = moeblaze_forward(h, MOEBLAZE_PASS_FORWARD_TRAINING, f, nf, p->ws, p->ws_bytes, p->saved,
                                          p->saved_bytes, NULL);
  if (st) fail_msg("forward: %s", moeblaze_get_last_error_message());
  st = moeblaze_backward(h, b, nb, p->saved, p->saved_bytes, p->ws, p->ws_bytes, NULL);
  if (st) fail_msg("backward: %s", moeblaze_get_last_error_message());
  return aux;
}
static float masked_step(moeblaze_handle_t h, ms_problem* p, const int32_t* mask, int64_t L_) {
  return masked_step_in(h, p, mask, L_, NULL, 0);
}

/* The largest difference between a masked call (p) and the call on its unmasked tokens alone
 * (q) over y, dx, d logits and the expert gradients; the picks and TOKENS_PER_EXPERT equal, and
 * the masked tokens' ids -1 and rows 0. */
static double masked_difference(const ms_problem* p, const ms_problem* q, const int32_t* mask, int64_t k) {
  double worst = 0;
  for (int64_t t = 0, i = 0; t < L; ++t) {
    for (int64_t j = 0; j < k; ++j)
      assert_int_equal(p->ids[t * k + j], mask[t] ? q->ids[i * k + j] : -1);
    for (int64_t c = 0; c < D; ++c) {
      const float y = p->y[t * D + c], dx = p->dx[t * D + c];
      if (!mask[t]) {
        assert_true(y == 0.f && dx == 0.f);
        continue;
      }
      worst = fmax(worst, fabs(y - q->y[i * D + c]) + fabs(dx - q->dx[i * D + c]));
    }
    for (int64_t e = 0; e < E; ++e) {
      if (!mask[t]) assert_true(p->dlogits[t * E + e] == 0.f);
      else worst = fmax(worst, fabs(p->dlogits[t * E + e] - q->dlogits[i * E + e]));
    }
    i += mask[t] != 0;
  }
  for (int64_t i = 0; i < E * D * 2 * H; ++i) worst = fmax(worst, fabs(p->dwgu[i] - q->dwgu[i]));
  for (int64_t i = 0; i < E * H * D; ++i) worst = fmax(worst, fabs(p->dwd[i] - q->dwd[i]));
  assert_memory_equal(p->tpe, q->tpe, sizeof(int32_t) * E);
  return worst;
}

/* q: the tokens of p that mask keeps, with p's weights (q's own seed for the rest). Returns their
 * count. */
static int64_t compact_problem(ms_problem* q, const ms_problem* p, moeblaze_handle_t h, const int32_t* mask,
                               int64_t k) {
  int64_t Lc = 0;
  for (int64_t t = 0; t < L; ++t) Lc += mask[t] != 0;
  ms_init(q, h, Lc, E, k, D, H, 1, 6);
  memcpy(q->wgu, p->wgu, sizeof(float) * E * D * 2 * H);
  memcpy(q->wd, p->wd, sizeof(float) * E * H * D);
  for (int64_t t = 0, i = 0; t < L; ++t) {
    if (!mask[t]) continue;
    memcpy(q->x + i * D, p->x + t * D, sizeof(float) * D);
    memcpy(q->dy + i * D, p->dy + t * D, sizeof(float) * D);
    memcpy(q->logits + i * E, p->logits + t * E, sizeof(float) * E);
    ++i;
  }
  return Lc;
}

static void token_mask(void** state) {
  (void)state;
  const int64_t k = 2;
  const opts o = {k, 4, 2, MOEBLAZE_SCORE_SIGMOID, 1, 2.5, 0.01, 0};
  moeblaze_handle_t h = NULL;
  assert_int_equal(make(&o, &h), MOEBLAZE_STATUS_SUCCESS);
  int32_t mask[L];
  for (int64_t t = 0; t < L; ++t) mask[t] = t % 3 != 1 && t != L - 1;
  ms_problem p, q;
  ms_init(&p, h, L, E, k, D, H, 1, 5);
  const int64_t Lc = compact_problem(&q, &p, h, mask, k);
  const float aux = masked_step(h, &p, mask, L), aux1 = masked_step(h, &q, NULL, Lc);
  const double worst = masked_difference(&p, &q, mask, k);
  print_message("token mask, %lld of %d tokens masked: largest difference from the unmasked tokens alone %.3g; "
                "aux %.7g vs %.7g\n", (long long)(L - Lc), L, worst, aux, aux1);
  assert_true(worst < 1e-6 && fabs(aux - aux1) <= 1e-6 * fabs(aux1));

  int32_t ids[L * 2];  /* the masked call's picks, for the caller-routing call below */
  memcpy(ids, p.ids, sizeof ids);

  /* Every token masked: nothing routed; y, d logits, the expert gradients and the loss are 0. */
  int32_t none[L];
  memset(none, 0, sizeof none);
  const float aux0 = masked_step(h, &p, none, L);
  assert_true(aux0 == 0.f);
  for (int64_t i = 0; i < L * k; ++i) assert_int_equal(p.ids[i], -1);
  for (int64_t i = 0; i < L * D; ++i) assert_true(p.y[i] == 0.f && p.dx[i] == 0.f);
  for (int64_t i = 0; i < L * E; ++i) assert_true(p.dlogits[i] == 0.f);
  for (int64_t i = 0; i < E * H * D; ++i) assert_true(p.dwd[i] == 0.f);
  for (int64_t e = 0; e < E; ++e) assert_int_equal(p.tpe[e], 0);

  /* A mask of the wrong length or dtype: refused, naming it. */
  {
    const int64_t short_len[1] = {L - 1}, full[1] = {L};
    const float fmask[L] = {0};
    moeblaze_arg_t f[16];
    size_t nf = ms_forward_args(&p, f);
    f[nf] = tu_arg(MOEBLAZE_ARG_TOKEN_MASK, tu_tensor(mask, tu_i32, 1, short_len));
    assert_int_equal(moeblaze_forward(h, MOEBLAZE_PASS_FORWARD_TRAINING, f, nf + 1, p.ws, p.ws_bytes, p.saved,
                                      p.saved_bytes, NULL), MOEBLAZE_STATUS_INVALID_ARGUMENT);
    assert_non_null(strstr(moeblaze_get_last_error_message(), "TOKEN_MASK"));
    f[nf] = tu_arg(MOEBLAZE_ARG_TOKEN_MASK, tu_tensor((void*)fmask, tu_f32, 1, full));
    assert_int_equal(moeblaze_forward(h, MOEBLAZE_PASS_FORWARD_TRAINING, f, nf + 1, p.ws, p.ws_bytes, p.saved,
                                      p.saved_bytes, NULL), MOEBLAZE_STATUS_INVALID_ARGUMENT);
    assert_non_null(strstr(moeblaze_get_last_error_message(), "TOKEN_MASK"));
  }

  /* Caller routing: the masked tokens' ids are not read (out of range here), their slots empty. */
  moeblaze_handle_t hc = NULL;
  assert_int_equal(make(&o, &hc), MOEBLAZE_STATUS_SUCCESS);
  float gates[L * 2];
  for (int64_t t = 0; t < L; ++t) {
    for (int64_t j = 0; j < k; ++j) gates[t * k + j] = 0.5f;
    if (!mask[t]) ids[t * k] = 999;
  }
  const int64_t sk[2] = {L, k}, sm[1] = {L};
  moeblaze_arg_t f[16];
  size_t nf = 0;
  f[nf++] = tu_arg(MOEBLAZE_ARG_INPUT, tu_tensor(p.x, tu_f32, 2, p.sx));
  f[nf++] = tu_arg(MOEBLAZE_ARG_W_GATE_UP, tu_tensor(p.wgu, tu_f32, 3, p.sw));
  f[nf++] = tu_arg(MOEBLAZE_ARG_W_DOWN, tu_tensor(p.wd, tu_f32, 3, p.sd));
  f[nf++] = tu_arg(MOEBLAZE_ARG_TOPK_INDICES, tu_tensor(ids, tu_i32, 2, sk));
  f[nf++] = tu_arg(MOEBLAZE_ARG_TOPK_WEIGHTS, tu_tensor(gates, tu_f32, 2, sk));
  f[nf++] = tu_arg(MOEBLAZE_ARG_TOKEN_MASK, tu_tensor(mask, tu_i32, 1, sm));
  f[nf++] = tu_arg(MOEBLAZE_ARG_OUTPUT, tu_tensor(p.y, tu_f32, 2, p.sx));
  assert_int_equal(moeblaze_forward(hc, MOEBLAZE_PASS_FORWARD_TRAINING, f, nf, p.ws, p.ws_bytes, p.saved, p.saved_bytes,
                                    NULL), MOEBLAZE_STATUS_SUCCESS);
  for (int64_t t = 0; t < L; ++t)
    if (!mask[t])
      for (int64_t c = 0; c < D; ++c) assert_true(p.y[t * D + c] == 0.f);

  moeblaze_destroy(hc);
  ms_free(&p);
  ms_free(&q);
  moeblaze_destroy(h);
}

/* AUX_LOSS and Z_LOSS with coefficients 0 read exactly 0. One token's logits near 1e30 make
 * its logsumexp^2 overflow fp32, so the z loss is +inf once its coefficient is set (checked
 * below): 0 times that sum would be NaN. The balance loss stays finite and positive. */
static void zero_coefficients_read_zero(void** state) {
  (void)state;
  tu_rng rng;
  tu_rng_seed(&rng, tu_fresh_seed("zero_coefficients"));
  const int64_t k = 2;
  float logits[L * E], gates[L * MAXK];
  int32_t ids[L * MAXK];
  for (int i = 0; i < L * E; ++i) logits[i] = (float)tu_rng_normal(&rng);
  for (int e = 0; e < E; ++e) logits[5 * E + e] = 1e30f * (1.f + (float)e / E);
  for (int with_coeffs = 0; with_coeffs < 2; ++with_coeffs) {
    const opts o = {k, 1, 0, MOEBLAZE_SCORE_SOFTMAX, 1, 1.0, with_coeffs ? 0.01 : 0.0, 0, with_coeffs ? 1e-3 : 0.0};
    moeblaze_handle_t h = NULL;
    assert_int_equal(make(&o, &h), MOEBLAZE_STATUS_SUCCESS);
    const int64_t sl[2] = {L, E}, sk[2] = {L, k};
    float aux = NAN, z = NAN;
    moeblaze_arg_t r[5] = {tu_arg(MOEBLAZE_ARG_ROUTER_LOGITS, tu_tensor(logits, tu_f32, 2, sl)),
                           tu_arg(MOEBLAZE_ARG_TOPK_INDICES, tu_tensor(ids, tu_i32, 2, sk)),
                           tu_arg(MOEBLAZE_ARG_TOPK_WEIGHTS, tu_tensor(gates, tu_f32, 2, sk)),
                           tu_arg(MOEBLAZE_ARG_AUX_LOSS, tu_tensor(&aux, tu_f32, 0, NULL)),
                           tu_arg(MOEBLAZE_ARG_Z_LOSS, tu_tensor(&z, tu_f32, 0, NULL))};
    size_t ws = 0;
    assert_int_equal(moeblaze_get_workspace_size(h, MOEBLAZE_PASS_ROUTE, L, &ws), MOEBLAZE_STATUS_SUCCESS);
    void* w = tu_alloc_bytes(ws);
    assert_int_equal(moeblaze_route(h, r, 5, w, ws, NULL), MOEBLAZE_STATUS_SUCCESS);
    tu_free(w);
    print_message("coefficients %s: aux %g, z %g\n", with_coeffs ? "set" : "0", aux, z);
    if (with_coeffs) {
      assert_true(isfinite(aux) && aux > 0.f);
      assert_true(isinf(z) && z > 0.f);
    } else {
      assert_true(aux == 0.f && !signbit(aux));
      assert_true(z == 0.f && !signbit(z));
    }
    moeblaze_destroy(h);
  }
}

/* TOKEN_MASK with SEQUENCE_LENGTHS on the CPU engine: the sequence-wise loss over each sequence's
 * unmasked tokens, a sequence with none left out of the mean. Checked against the same call on
 * the unmasked tokens alone with their own lengths (the empty sequence dropped). */
static void token_mask_with_sequences(void** state) {
  (void)state;
  for (int sigmoid = 0; sigmoid < 2; ++sigmoid) {
    const int64_t k = 3;
    const opts o = {k, 4, 2, sigmoid ? MOEBLAZE_SCORE_SIGMOID : MOEBLAZE_SCORE_SOFTMAX, 1, 1.0, 0.01, 0};
    moeblaze_handle_t h = NULL;
    assert_int_equal(make(&o, &h), MOEBLAZE_STATUS_SUCCESS);
    /* kLengths {10, 25, 13}: the first keeps 5, the second 17, the third none */
    int32_t mask[L];
    for (int64_t t = 0; t < L; ++t) mask[t] = t < 10 ? t % 2 == 0 : t < 35 ? t % 3 != 0 : 0;
    int64_t kept[NSEQ] = {0}, B = 0;
    for (int64_t q = 0, t0 = 0; q < NSEQ; t0 += kLengths[q++])
      for (int64_t t = t0; t < t0 + kLengths[q]; ++t) kept[q] += mask[t] != 0;
    int64_t lens1[NSEQ];
    for (int64_t q = 0; q < NSEQ; ++q)
      if (kept[q]) lens1[B++] = kept[q];
    ms_problem p, c;
    ms_init(&p, h, L, E, k, D, H, 1, 7);
    compact_problem(&c, &p, h, mask, k);
    const float aux = masked_step_in(h, &p, mask, L, kLengths, NSEQ);
    const float aux1 = masked_step_in(h, &c, NULL, c.L, lens1, B);
    const double worst = masked_difference(&p, &c, mask, k);
    print_message("token mask with %d sequences (%s; %lld left empty): largest difference from the unmasked "
                  "tokens alone %.3g; aux %.7g vs %.7g\n", NSEQ, sigmoid ? "sigmoid" : "softmax",
                  (long long)(NSEQ - B), worst, aux, aux1);
    assert_true(aux1 > 0.f);
    assert_true(worst < 1e-6 && fabs(aux - aux1) <= 1e-6 * fabs(aux1));
    ms_free(&p);
    ms_free(&c);
    moeblaze_destroy(h);
  }
}

static void refusals(void** state) {
  (void)state;
  moeblaze_handle_t h = (moeblaze_handle_t)1;
  const opts bad[] = {{2, 3, 0, 0, 0, 1.0, 0, 0},   /* 3 groups do not divide 16 experts */
                      {2, 4, 5, 0, 0, 1.0, 0, 0},   /* 5 of 4 groups */
                      {4, 8, 1, 0, 0, 1.0, 0, 0}};  /* one group of 2 experts for top-4 */
  const char* names[] = {"num_expert_groups", "topk_groups", "topk_groups"};
  for (int i = 0; i < 3; ++i) {
    assert_int_equal(make(&bad[i], &h), MOEBLAZE_STATUS_INVALID_ARGUMENT);
    assert_null(h);
    assert_non_null(strstr(moeblaze_get_last_error_message(), names[i]));
  }
  const opts o = {2, 4, 2, MOEBLAZE_SCORE_SOFTMAX, 1, 1.0, 0.01, 0};
  assert_int_equal(make(&o, &h), MOEBLAZE_STATUS_SUCCESS);
  float logits[L * E], bias[E + 1], gates[L * 2];
  int32_t ids[L * 2];
  memset(logits, 0, sizeof logits);
  memset(bias, 0, sizeof bias);
  size_t ws = 0;
  assert_int_equal(moeblaze_get_workspace_size(h, MOEBLAZE_PASS_ROUTE, L, &ws), MOEBLAZE_STATUS_SUCCESS);
  void* w = tu_alloc_bytes(ws);
  const int64_t sl[2] = {L, E}, sk[2] = {L, 2}, se_bad[1] = {E + 1}, se[1] = {E};
  uint16_t bias16[E] = {0};
  const moeblaze_tensor_t bad_bias[] = {tu_tensor(bias, tu_f32, 1, se_bad), tu_tensor(bias16, tu_bf16, 1, se)};
  for (int i = 0; i < 2; ++i) {
    tu_poison(ids, tu_i32, L * 2);
    moeblaze_arg_t r[4] = {tu_arg(MOEBLAZE_ARG_ROUTER_LOGITS, tu_tensor(logits, tu_f32, 2, sl)),
                           tu_arg(MOEBLAZE_ARG_TOPK_INDICES, tu_tensor(ids, tu_i32, 2, sk)),
                           tu_arg(MOEBLAZE_ARG_TOPK_WEIGHTS, tu_tensor(gates, tu_f32, 2, sk)),
                           tu_arg(MOEBLAZE_ARG_EXPERT_BIAS, bad_bias[i])};
    assert_int_equal(moeblaze_route(h, r, 4, w, ws, NULL), MOEBLAZE_STATUS_INVALID_ARGUMENT);
    assert_non_null(strstr(moeblaze_get_last_error_message(), "EXPERT_BIAS"));
    for (int t = 0; t < L * 2; ++t) assert_int_equal(ids[t], INT32_MIN);  /* nothing written */
  }
  tu_free(w);
  /* with caller routing */
  ms_problem p;
  ms_init(&p, h, L, E, 2, D, H, 1, 5);
  moeblaze_arg_t a[16];
  size_t n = ms_forward_args(&p, a);
  for (size_t i = 0; i < n; ++i)  /* the logits become a bias-less caller routing... */
    if (a[i].kind == MOEBLAZE_ARG_ROUTER_LOGITS) a[i] = tu_arg(MOEBLAZE_ARG_EXPERT_BIAS, tu_tensor(bias, tu_f32, 1, se));
  float cw[L * 2];
  for (int i = 0; i < L * 2; ++i) { p.ids[i] = i % 2 ? 1 : 0; cw[i] = 0.5f; }
  a[n++] = tu_arg(MOEBLAZE_ARG_TOPK_WEIGHTS, tu_tensor(cw, tu_f32, 2, sk));
  tu_poison(p.y, tu_f32, (size_t)(L * D));
  assert_int_equal(moeblaze_forward(h, MOEBLAZE_PASS_FORWARD_TRAINING, a, n, p.ws, p.ws_bytes, p.saved, p.saved_bytes, NULL),
                   MOEBLAZE_STATUS_INVALID_ARGUMENT);
  assert_non_null(strstr(moeblaze_get_last_error_message(), "EXPERT_BIAS"));
  for (int64_t i = 0; i < L * D; ++i) assert_true(isnan(p.y[i]));
  /* sequence lengths that do not sum to the tokens, a zero length, more sequences than tokens */
  const int64_t short_sum[2] = {10, 20}, zero[3] = {48, 0, 0}, many[L + 1] = {0};
  const int64_t n2[1] = {2}, n3[1] = {3}, nmany[1] = {L + 1};
  const moeblaze_tensor_t bad_lengths[] = {tu_tensor((void*)short_sum, tu_i64, 1, n2), tu_tensor((void*)zero, tu_i64, 1, n3),
                                           tu_tensor((void*)many, tu_i64, 1, nmany)};
  for (int i = 0; i < 3; ++i) {
    moeblaze_arg_t g[16];
    size_t ng = ms_forward_args(&p, g);
    float aux = 12345.f;
    g[ng++] = tu_arg(MOEBLAZE_ARG_AUX_LOSS, tu_tensor(&aux, tu_f32, 0, NULL));
    g[ng++] = tu_arg(MOEBLAZE_ARG_SEQUENCE_LENGTHS, bad_lengths[i]);
    tu_poison(p.y, tu_f32, (size_t)(L * D));
    assert_int_equal(moeblaze_forward(h, MOEBLAZE_PASS_FORWARD_TRAINING, g, ng, p.ws, p.ws_bytes, p.saved, p.saved_bytes,
                                      NULL),
                     MOEBLAZE_STATUS_INVALID_ARGUMENT);
    assert_non_null(strstr(moeblaze_get_last_error_message(), "SEQUENCE_LENGTHS"));
    assert_true(aux == 12345.f && isnan(p.y[0]));
  }
  ms_free(&p);
  moeblaze_destroy(h);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(routing_matches_reference),
      cmocka_unit_test(bias_selects_but_does_not_gate),
      cmocka_unit_test(route_scale_scales_y_and_gradients),
      cmocka_unit_test(sequence_balance_loss),
      cmocka_unit_test(hugging_face_form),
      cmocka_unit_test(token_mask),
      cmocka_unit_test(token_mask_with_sequences),
      cmocka_unit_test(zero_coefficients_read_zero),
      cmocka_unit_test(refusals),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
