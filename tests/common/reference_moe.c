/*
 * reference_moe.c: the fp64 reference of one MoE layer (see reference_moe.h and
 * docs/design.md, "The math"). Straightforward loops, clarity over speed.
 * SPDX-License-Identifier: Apache-2.0
 */
#include "reference_moe.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

/* ---------------------------------------------------------------------------------------- */
/* Activations                                                                               */
/* ---------------------------------------------------------------------------------------- */
int64_t ref_gate_factor(int32_t activation) {
  return (activation == REF_ACT_SWIGLU || activation == REF_ACT_GEGLU) ? 2 : 1;
}

static double sigmoid(double v) {
  if (v >= 0) return 1.0 / (1.0 + exp(-v));
  const double e = exp(v);
  return e / (1.0 + e);
}

double ref_silu(double v) { return v * sigmoid(v); }
double ref_silu_grad(double v) {
  const double s = sigmoid(v);
  return s * (1.0 + v * (1.0 - s));
}
/* gelu(v) = v Phi(v), Phi the standard normal CDF (exact erf form). */
double ref_gelu(double v) { return 0.5 * v * (1.0 + erf(v * 0.70710678118654752440)); }
double ref_gelu_grad(double v) {
  const double cdf = 0.5 * (1.0 + erf(v * 0.70710678118654752440));
  const double pdf = 0.39894228040143267794 * exp(-0.5 * v * v);
  return cdf + v * pdf;
}
double ref_relu(double v) { return v > 0 ? v : 0.0; }
double ref_relu_grad(double v) { return v > 0 ? 1.0 : 0.0; }

/* Plain activations: value and derivative. */
static double plain_act(int32_t a, double v) {
  switch (a) {
    case REF_ACT_RELU: return ref_relu(v);
    case REF_ACT_GELU: return ref_gelu(v);
    default: return ref_silu(v);
  }
}
static double plain_act_grad(int32_t a, double v) {
  switch (a) {
    case REF_ACT_RELU: return ref_relu_grad(v);
    case REF_ACT_GELU: return ref_gelu_grad(v);
    default: return ref_silu_grad(v);
  }
}
/* The gate nonlinearity of a gated activation. */
static double gate_act(int32_t a, double v) { return a == REF_ACT_GEGLU ? ref_gelu(v) : ref_silu(v); }
static double gate_act_grad(int32_t a, double v) {
  return a == REF_ACT_GEGLU ? ref_gelu_grad(v) : ref_silu_grad(v);
}

/* ---------------------------------------------------------------------------------------- */
/* Router                                                                                    */
/* ---------------------------------------------------------------------------------------- */
void ref_logits(const ref_layer* l, int64_t L, const double* x, const double* w_router,
                double* logits) {
  for (int64_t t = 0; t < L; ++t)
    for (int64_t e = 0; e < l->E; ++e) {
      double acc = 0.0;
      for (int64_t i = 0; i < l->d; ++i) acc += x[t * l->d + i] * w_router[e * l->d + i];
      logits[t * l->E + e] = acc;
    }
}

static double row_max(const double* r, int64_t n) {
  double m = -INFINITY;
  for (int64_t i = 0; i < n; ++i) if (r[i] > m) m = r[i];
  return m;
}

static double logsumexp(const double* r, int64_t n) {
  const double m = row_max(r, n);
  double s = 0.0;
  for (int64_t i = 0; i < n; ++i) s += exp(r[i] - m);
  return m + log(s);
}

/* Softmax of one row of n logits. */
static void softmax_row(const double* r, int64_t n, double* out) {
  const double m = row_max(r, n);
  double s = 0.0;
  for (int64_t i = 0; i < n; ++i) { out[i] = exp(r[i] - m); s += out[i]; }
  for (int64_t i = 0; i < n; ++i) out[i] /= s;
}

void ref_scores(const ref_layer* l, int64_t L, const double* logits, double* scores) {
  const int64_t E = l->E;
  for (int64_t t = 0; t < L; ++t) {
    if (l->score_fn == REF_SCORE_SIGMOID) {
      for (int64_t e = 0; e < E; ++e) scores[t * E + e] = sigmoid(logits[t * E + e]);
    } else {
      softmax_row(logits + t * E, E, scores + t * E);
    }
  }
}

void ref_topk(const ref_layer* l, int64_t L, const double* scores, int64_t* ids) {
  const int64_t E = l->E, k = l->k;
  for (int64_t t = 0; t < L; ++t) {
    const double* s = scores + t * E;
    /* Selection: slot j takes the best expert not yet taken. "Better" = larger score, or the
     * same score and a lower id (strict > in the scan keeps the first, i.e. lower, id). */
    for (int64_t j = 0; j < k; ++j) {
      int64_t best = -1;
      for (int64_t e = 0; e < E; ++e) {
        int taken = 0;
        for (int64_t q = 0; q < j; ++q) if (ids[t * k + q] == e) { taken = 1; break; }
        if (taken) continue;
        if (best < 0 || s[e] > s[best]) best = e;
      }
      ids[t * k + j] = best;
    }
  }
}

void ref_gates(const ref_layer* l, int64_t L, const double* scores, const int64_t* ids,
               double* gates) {
  const int64_t E = l->E, k = l->k;
  for (int64_t t = 0; t < L; ++t) {
    double sum = 0.0;
    for (int64_t j = 0; j < k; ++j) {
      gates[t * k + j] = scores[t * E + ids[t * k + j]];
      sum += gates[t * k + j];
    }
    if (l->normalize)
      for (int64_t j = 0; j < k; ++j) gates[t * k + j] /= sum;
  }
}

int ref_counts(int64_t E, int64_t L, int64_t k, const int64_t* ids, int64_t* counts) {
  for (int64_t e = 0; e < E; ++e) counts[e] = 0;
  for (int64_t i = 0; i < L * k; ++i) {
    if (ids[i] < 0 || ids[i] >= E) return -1;
    counts[ids[i]]++;
  }
  return 0;
}

double ref_aux_loss(const ref_layer* l, int64_t L, const double* scores, const int64_t* ids) {
  const int64_t E = l->E, k = l->k;
  if (L == 0 || l->aux_coeff == 0.0) return 0.0; /* a loss whose coefficient is 0 reads 0 */
  double sum = 0.0;
  for (int64_t e = 0; e < E; ++e) {
    int64_t c = 0;
    for (int64_t i = 0; i < L * k; ++i) c += ids[i] == e;
    double p = 0.0;
    for (int64_t t = 0; t < L; ++t) p += scores[t * E + e];
    sum += ((double)c / (double)(L * k)) * (p / (double)L);
  }
  return l->aux_coeff * (double)E * sum;
}

double ref_z_loss(const ref_layer* l, int64_t L, const double* logits) {
  if (L == 0 || l->z_coeff == 0.0) return 0.0;
  double sum = 0.0;
  for (int64_t t = 0; t < L; ++t) {
    const double lse = logsumexp(logits + t * l->E, l->E);
    sum += lse * lse;
  }
  return l->z_coeff * sum / (double)L;
}

void ref_route(const ref_layer* l, int64_t L, const double* logits, const int64_t* force_ids,
               int64_t* ids, double* gates, int64_t* counts, double* aux, double* z) {
  const int64_t E = l->E, k = l->k;
  double* scores = (double*)malloc(sizeof(double) * (size_t)(L * E + 1));
  int64_t* sel = (int64_t*)malloc(sizeof(int64_t) * (size_t)(L * k + 1));
  double* gt = (double*)malloc(sizeof(double) * (size_t)(L * k + 1));
  if (!scores || !sel || !gt) abort(); /* test code: tiny sizes */
  ref_scores(l, L, logits, scores);
  if (force_ids) memcpy(sel, force_ids, sizeof(int64_t) * (size_t)(L * k));
  else ref_topk(l, L, scores, sel);
  ref_gates(l, L, scores, sel, gt);
  if (ids) memcpy(ids, sel, sizeof(int64_t) * (size_t)(L * k));
  if (gates) memcpy(gates, gt, sizeof(double) * (size_t)(L * k));
  if (counts) ref_counts(E, L, k, sel, counts);
  if (aux) *aux = ref_aux_loss(l, L, scores, sel);
  if (z) *z = ref_z_loss(l, L, logits);
  free(scores);
  free(sel);
  free(gt);
}

void ref_router_backward(const ref_layer* l, int64_t L, const double* logits,
                         const int64_t* ids, const double* dgates, double grad_aux,
                         double grad_z, double* dlogits) {
  const int64_t E = l->E, k = l->k;
  double* s = (double*)malloc(sizeof(double) * (size_t)E);
  double* ds = (double*)malloc(sizeof(double) * (size_t)E);
  double* p = (double*)malloc(sizeof(double) * (size_t)E);
  double* fe = (double*)malloc(sizeof(double) * (size_t)E);
  if (!s || !ds || !p || !fe) abort();
  /* f_e = count_e / (L k): a constant of the selection. */
  for (int64_t e = 0; e < E; ++e) fe[e] = 0.0;
  for (int64_t i = 0; i < L * k; ++i) fe[ids[i]] += 1.0;
  for (int64_t e = 0; e < E; ++e) fe[e] = L > 0 ? fe[e] / (double)(L * k) : 0.0;

  for (int64_t t = 0; t < L; ++t) {
    const double* lg = logits + t * E;
    double* dl = dlogits + t * E;
    if (l->score_fn == REF_SCORE_SIGMOID) {
      for (int64_t e = 0; e < E; ++e) s[e] = sigmoid(lg[e]);
    } else {
      softmax_row(lg, E, s);
    }
    for (int64_t e = 0; e < E; ++e) ds[e] = 0.0;
    /* gates -> selected scores */
    if (dgates) {
      const int64_t* id = ids + t * k;
      const double* dg = dgates + t * k;
      if (l->normalize) {
        /* g_j = s_j / S:  ds_m = (dg_m - sum_j dg_j g_j) / S */
        double S = 0.0, dot = 0.0;
        for (int64_t j = 0; j < k; ++j) S += s[id[j]];
        for (int64_t j = 0; j < k; ++j) dot += dg[j] * (s[id[j]] / S);
        for (int64_t j = 0; j < k; ++j) ds[id[j]] += (dg[j] - dot) / S;
      } else {
        for (int64_t j = 0; j < k; ++j) ds[id[j]] += dg[j];
      }
    }
    /* aux = c E sum_e f_e (1/L) sum_t s[t, e] */
    if (l->aux_coeff != 0.0 && grad_aux != 0.0)
      for (int64_t e = 0; e < E; ++e)
        ds[e] += grad_aux * l->aux_coeff * (double)E * fe[e] / (double)L;
    /* scores -> logits */
    if (l->score_fn == REF_SCORE_SIGMOID) {
      /* s (1 - s) = sigmoid(v) sigmoid(-v): no cancellation when s is near 1 */
      for (int64_t e = 0; e < E; ++e) dl[e] = ds[e] * s[e] * sigmoid(-lg[e]);
    } else {
      /* dl_m = s_m (ds_m - sum_e s_e ds_e) = s_m sum_e s_e (ds_m - ds_e)  (sum_e s_e = 1):
       * the second form does not cancel when one score is near 1, and is exactly 0 when
       * ds is constant over the experts (e.g. aux loss with equal counts, k = 1 renormalised) */
      for (int64_t m = 0; m < E; ++m) {
        double acc = 0.0;
        for (int64_t e = 0; e < E; ++e) acc += s[e] * (ds[m] - ds[e]);
        dl[m] = s[m] * acc;
      }
    }
    /* z = cz (1/L) sum_t lse_t^2:  dz/dlogit = cz (2/L) lse_t softmax_t */
    if (l->z_coeff != 0.0 && grad_z != 0.0) {
      const double lse = logsumexp(lg, E);
      softmax_row(lg, E, p);
      for (int64_t e = 0; e < E; ++e)
        dl[e] += grad_z * l->z_coeff * 2.0 * lse * p[e] / (double)L;
    }
  }
  free(s);
  free(ds);
  free(p);
  free(fe);
}

void ref_router_weight_backward(const ref_layer* l, int64_t L, const double* x,
                                const double* w_router, const double* dlogits,
                                double* dw_router, double* dx) {
  const int64_t E = l->E, d = l->d;
  if (dw_router) {
    for (int64_t e = 0; e < E; ++e)
      for (int64_t i = 0; i < d; ++i) {
        double acc = 0.0;
        for (int64_t t = 0; t < L; ++t) acc += dlogits[t * E + e] * x[t * d + i];
        dw_router[e * d + i] = acc;
      }
  }
  if (dx) {
    for (int64_t t = 0; t < L; ++t)
      for (int64_t i = 0; i < d; ++i) {
        double acc = 0.0;
        for (int64_t e = 0; e < E; ++e) acc += dlogits[t * E + e] * w_router[e * d + i];
        dx[t * d + i] += acc;
      }
  }
}

/* ---------------------------------------------------------------------------------------- */
/* Experts                                                                                   */
/* ---------------------------------------------------------------------------------------- */
/* pre[g h] = x_t W_gate_up[e]; act[h] from pre. */
static void up_and_act(const ref_layer* l, const double* xt, const double* w_gate_up, int64_t e,
                       double* pre, double* act) {
  const int64_t d = l->d, h = l->h, gh = ref_gate_factor(l->activation) * l->h;
  const double* w = w_gate_up + e * d * gh;
  for (int64_t c = 0; c < gh; ++c) pre[c] = 0.0;
  for (int64_t i = 0; i < d; ++i) {
    const double xi = xt[i];
    for (int64_t c = 0; c < gh; ++c) pre[c] += xi * w[i * gh + c];
  }
  if (l->round_act)
    for (int64_t c = 0; c < gh; ++c) pre[c] = l->round_act(pre[c]);
  if (gh == 2 * h) {
    for (int64_t m = 0; m < h; ++m) act[m] = gate_act(l->activation, pre[m]) * pre[h + m];
  } else {
    for (int64_t m = 0; m < h; ++m) act[m] = plain_act(l->activation, pre[m]);
  }
  if (l->round_act)
    for (int64_t m = 0; m < h; ++m) act[m] = l->round_act(act[m]);
}

void ref_forward(const ref_layer* l, int64_t L, const double* x, const double* w_gate_up,
                 const double* w_down, const int64_t* ids, const double* gates, double* y) {
  const int64_t d = l->d, h = l->h, k = l->k, gh = ref_gate_factor(l->activation) * l->h;
  double* pre = (double*)malloc(sizeof(double) * (size_t)gh);
  double* act = (double*)malloc(sizeof(double) * (size_t)h);
  double* o = (double*)malloc(sizeof(double) * (size_t)d);
  if (!pre || !act || !o) abort();
  for (int64_t t = 0; t < L; ++t) {
    double* yt = y + t * d;
    for (int64_t c = 0; c < d; ++c) yt[c] = 0.0;
    for (int64_t j = 0; j < k; ++j) {
      const int64_t e = ids[t * k + j];
      up_and_act(l, x + t * d, w_gate_up, e, pre, act);
      const double* wd = w_down + e * h * d;
      for (int64_t c = 0; c < d; ++c) o[c] = 0.0;
      for (int64_t m = 0; m < h; ++m)
        for (int64_t c = 0; c < d; ++c) o[c] += act[m] * wd[m * d + c];
      if (l->round_act)
        for (int64_t c = 0; c < d; ++c) o[c] = l->round_act(o[c]);
      for (int64_t c = 0; c < d; ++c) yt[c] += gates[t * k + j] * o[c];
    }
  }
  free(pre);
  free(act);
  free(o);
}

void ref_backward(const ref_layer* l, int64_t L, const double* x, const double* w_gate_up,
                  const double* w_down, const int64_t* ids, const double* gates,
                  const double* dy, double* dx, double* dw_gate_up, double* dw_down,
                  double* dgates) {
  const int64_t E = l->E, d = l->d, h = l->h, k = l->k;
  const int64_t gh = ref_gate_factor(l->activation) * h;
  double* pre = (double*)malloc(sizeof(double) * (size_t)gh);
  double* act = (double*)malloc(sizeof(double) * (size_t)h);
  double* dact = (double*)malloc(sizeof(double) * (size_t)h);
  double* dpre = (double*)malloc(sizeof(double) * (size_t)gh);
  if (!pre || !act || !dact || !dpre) abort();
  if (dx) memset(dx, 0, sizeof(double) * (size_t)(L * d));
  if (dw_gate_up) memset(dw_gate_up, 0, sizeof(double) * (size_t)(E * d * gh));
  if (dw_down) memset(dw_down, 0, sizeof(double) * (size_t)(E * h * d));
  for (int64_t t = 0; t < L; ++t) {
    const double* xt = x + t * d;
    const double* dyt = dy + t * d;
    for (int64_t j = 0; j < k; ++j) {
      const int64_t e = ids[t * k + j];
      const double g = gates[t * k + j];
      const double* wd = w_down + e * h * d;
      const double* wu = w_gate_up + e * d * gh;
      up_and_act(l, xt, w_gate_up, e, pre, act);
      /* dact = dy_t W_down[e]^T ; dg = <dact, act> */
      double dg = 0.0;
      for (int64_t m = 0; m < h; ++m) {
        double acc = 0.0;
        for (int64_t c = 0; c < d; ++c) acc += dyt[c] * wd[m * d + c];
        dact[m] = acc;
        dg += acc * act[m];
      }
      if (dgates) dgates[t * k + j] = dg;
      /* dW_down[e] += act^T (g dy_t) */
      if (dw_down) {
        double* dwd = dw_down + e * h * d;
        for (int64_t m = 0; m < h; ++m)
          for (int64_t c = 0; c < d; ++c) dwd[m * d + c] += act[m] * g * dyt[c];
      }
      /* activation derivative applied to g dact */
      if (gh == 2 * h) {
        for (int64_t m = 0; m < h; ++m) {
          const double u = g * dact[m];
          const double a = pre[m], b = pre[h + m];
          dpre[m] = u * b * gate_act_grad(l->activation, a);
          dpre[h + m] = u * gate_act(l->activation, a);
        }
      } else {
        for (int64_t m = 0; m < h; ++m) dpre[m] = g * dact[m] * plain_act_grad(l->activation, pre[m]);
      }
      if (l->round_act)
        for (int64_t c = 0; c < gh; ++c) dpre[c] = l->round_act(dpre[c]);
      if (dw_gate_up) {
        double* dwu = dw_gate_up + e * d * gh;
        for (int64_t i = 0; i < d; ++i)
          for (int64_t c = 0; c < gh; ++c) dwu[i * gh + c] += xt[i] * dpre[c];
      }
      if (dx) {
        for (int64_t i = 0; i < d; ++i) {
          double acc = 0.0;
          for (int64_t c = 0; c < gh; ++c) acc += dpre[c] * wu[i * gh + c];
          dx[t * d + i] += acc;
        }
      }
    }
  }
  free(pre);
  free(act);
  free(dact);
  free(dpre);
}

/* ---------------------------------------------------------------------------------------- */
/* Whole layer                                                                               */
/* ---------------------------------------------------------------------------------------- */
int ref_routing_case(const ref_inputs* in) {
  if (in->logits) return 1;
  if (in->w_router) return 2;
  return 3;
}

static int ids_valid(int64_t E, int64_t L, int64_t k, const int64_t* ids) {
  for (int64_t t = 0; t < L; ++t)
    for (int64_t j = 0; j < k; ++j) {
      const int64_t e = ids[t * k + j];
      if (e < 0 || e >= E) return 0;
      for (int64_t q = 0; q < j; ++q) if (ids[t * k + q] == e) return 0;
    }
  return 1;
}

/* Routing of the layer: fills ids, gates (and logits, counts, aux, z for cases 1 and 2).
 * `logits` receives the logits used ([L, E]) in cases 1 and 2. */
static int layer_route(const ref_layer* l, int64_t L, const ref_inputs* in, double* logits,
                       int64_t* ids, double* gates, int64_t* counts, double* aux, double* z) {
  const int64_t E = l->E, k = l->k;
  const int rc = ref_routing_case(in);
  if (in->topk_ids && !ids_valid(E, L, k, in->topk_ids)) return -1;
  if (rc == 3) {
    if (!in->topk_ids || !in->topk_gates) return -1;
    memcpy(ids, in->topk_ids, sizeof(int64_t) * (size_t)(L * k));
    memcpy(gates, in->topk_gates, sizeof(double) * (size_t)(L * k));
    if (counts) ref_counts(E, L, k, ids, counts);
    *aux = 0.0;
    *z = 0.0;
    return 0;
  }
  if (rc == 1) memcpy(logits, in->logits, sizeof(double) * (size_t)(L * E));
  else ref_logits(l, L, in->x, in->w_router, logits);
  ref_route(l, L, logits, in->topk_ids, ids, gates, counts, aux, z);
  return 0;
}

int ref_layer_forward(const ref_layer* l, int64_t L, const ref_inputs* in, ref_fwd_out* out) {
  const int64_t E = l->E, k = l->k;
  if (!in || !out || !out->y || !in->x || !in->w_gate_up || !in->w_down) return -1;
  double* logits = (double*)malloc(sizeof(double) * (size_t)(L * E + 1));
  int64_t* ids = (int64_t*)malloc(sizeof(int64_t) * (size_t)(L * k + 1));
  double* gates = (double*)malloc(sizeof(double) * (size_t)(L * k + 1));
  if (!logits || !ids || !gates) abort();
  double aux = 0.0, z = 0.0;
  int rc = layer_route(l, L, in, logits, ids, gates, out->counts, &aux, &z);
  if (rc == 0) {
    ref_forward(l, L, in->x, in->w_gate_up, in->w_down, ids, gates, out->y);
    if (out->ids) memcpy(out->ids, ids, sizeof(int64_t) * (size_t)(L * k));
    if (out->gates) memcpy(out->gates, gates, sizeof(double) * (size_t)(L * k));
    if (out->logits && ref_routing_case(in) != 3)
      memcpy(out->logits, logits, sizeof(double) * (size_t)(L * E));
    out->aux = aux;
    out->z = z;
  }
  free(logits);
  free(ids);
  free(gates);
  return rc;
}

int ref_layer_backward(const ref_layer* l, int64_t L, const ref_inputs* in, const double* dy,
                       double grad_aux, double grad_z, const ref_grads* g) {
  const int64_t E = l->E, k = l->k;
  if (!in || !g || !dy || !in->x || !in->w_gate_up || !in->w_down) return -1;
  double* logits = (double*)malloc(sizeof(double) * (size_t)(L * E + 1));
  double* dlogits = (double*)malloc(sizeof(double) * (size_t)(L * E + 1));
  int64_t* ids = (int64_t*)malloc(sizeof(int64_t) * (size_t)(L * k + 1));
  double* gates = (double*)malloc(sizeof(double) * (size_t)(L * k + 1));
  double* dgates = (double*)malloc(sizeof(double) * (size_t)(L * k + 1));
  if (!logits || !dlogits || !ids || !gates || !dgates) abort();
  double aux = 0.0, z = 0.0;
  const int rcase = ref_routing_case(in);
  int rc = layer_route(l, L, in, logits, ids, gates, NULL, &aux, &z);
  if (rc == 0) {
    ref_backward(l, L, in->x, in->w_gate_up, in->w_down, ids, gates, dy, g->dx, g->dw_gate_up,
                 g->dw_down, dgates);
    if (g->dgates) memcpy(g->dgates, dgates, sizeof(double) * (size_t)(L * k));
    if (rcase != 3) {
      ref_router_backward(l, L, logits, ids, dgates, grad_aux, grad_z, dlogits);
      if (g->dlogits) memcpy(g->dlogits, dlogits, sizeof(double) * (size_t)(L * E));
      if (rcase == 2) ref_router_weight_backward(l, L, in->x, in->w_router, dlogits, g->dw_router, g->dx);
    }
  }
  free(logits);
  free(dlogits);
  free(ids);
  free(gates);
  free(dgates);
  return rc;
}

double ref_layer_loss(const ref_layer* l, int64_t L, const ref_inputs* in, const double* dy,
                      double grad_aux, double grad_z, int64_t* ids_out) {
  double* y = (double*)malloc(sizeof(double) * (size_t)(L * l->d + 1));
  if (!y) abort();
  ref_fwd_out out;
  memset(&out, 0, sizeof out);
  out.y = y;
  out.ids = ids_out;
  if (ref_layer_forward(l, L, in, &out) != 0) {
    free(y);
    return NAN;
  }
  double loss = 0.0;
  for (int64_t i = 0; i < L * l->d; ++i) loss += y[i] * dy[i];
  loss += grad_aux * out.aux + grad_z * out.z;
  free(y);
  return loss;
}

/* ---------------------------------------------------------------------------------------- */
/* Plan by sorting                                                                           */
/* ---------------------------------------------------------------------------------------- */
typedef struct plan_pair {
  int64_t expert, token, slot_pos; /* slot_pos = t k + j */
} plan_pair;

static int pair_cmp(const void* a, const void* b) {
  const plan_pair* p = (const plan_pair*)a;
  const plan_pair* q = (const plan_pair*)b;
  if (p->expert != q->expert) return p->expert < q->expert ? -1 : 1;
  if (p->token != q->token) return p->token < q->token ? -1 : 1;
  return (p->slot_pos > q->slot_pos) - (p->slot_pos < q->slot_pos);
}

int ref_plan_sort(int64_t L, int64_t k, int64_t E, const int64_t* token_expert_indices,
                  int64_t* expert_token_indices, int64_t* expert_token_offsets,
                  int64_t* token_index_map) {
  if (L < 0 || k < 1 || E < 1) return -1;
  if (!ids_valid(E, L, k, token_expert_indices)) return -1;
  const int64_t n = L * k;
  plan_pair* pairs = (plan_pair*)malloc(sizeof(plan_pair) * (size_t)(n + 1));
  if (!pairs) return -1;
  for (int64_t i = 0; i < n; ++i) {
    pairs[i].expert = token_expert_indices[i];
    pairs[i].token = i / k;
    pairs[i].slot_pos = i;
  }
  qsort(pairs, (size_t)n, sizeof(plan_pair), pair_cmp);
  if (expert_token_offsets) {
    for (int64_t e = 0; e <= E; ++e) expert_token_offsets[e] = 0;
    for (int64_t i = 0; i < n; ++i) expert_token_offsets[pairs[i].expert + 1]++;
    for (int64_t e = 0; e < E; ++e) expert_token_offsets[e + 1] += expert_token_offsets[e];
  }
  for (int64_t i = 0; i < n; ++i) {
    if (expert_token_indices) expert_token_indices[i] = pairs[i].token;
    if (token_index_map) token_index_map[pairs[i].slot_pos] = i;
  }
  free(pairs);
  return 0;
}

/* ---------------------------------------------------------------------------------------- */
double ref_rel_l2(const double* a, const double* b, size_t n) {
  double num = 0.0, den = 0.0;
  for (size_t i = 0; i < n; ++i) {
    if (!isfinite(a[i])) return INFINITY;
    const double dd = a[i] - b[i];
    num += dd * dd;
    den += b[i] * b[i];
  }
  if (den < 1e-300) return sqrt(num) < 1e-30 ? 0.0 : INFINITY;
  return sqrt(num / den);
}
