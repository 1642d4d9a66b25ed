#include "grad_conditioning.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

double tu_err_against(const double* a, const double* b, size_t n, double scale2) {
  double num = 0, den = 0;
  for (size_t j = 0; j < n; ++j) {
    if (!isfinite(a[j])) return INFINITY;
    num += (a[j] - b[j]) * (a[j] - b[j]), den += b[j] * b[j];
  }
  den = den > scale2 ? den : scale2;
  if (den < 1e-300) return sqrt(num) < 1e-30 ? 0.0 : INFINITY;
  return sqrt(num / den);
}

double tu_gate_grad_scale2(const tu_layer* layer, int64_t L, const void* x, const void* wgu, const void* wd,
                           const int32_t* routed, const void* dy, double* gate_grad_scales) {
  const int64_t k = layer->top_k, P = L * k, d = layer->d, E = layer->experts, h = layer->h;
  const int gated = layer->activation == MOEBLAZE_ACTIVATION_SWIGLU || layer->activation == MOEBLAZE_ACTIVATION_GEGLU;
  const int64_t gh = (gated ? 2 : 1) * h;
  const moeblaze_dtype_t at = layer->act_dtype, wt = layer->weight_dtype;
  if (P == 0) return 0.0;
  tu_layer l = *layer;
  l.top_k = 1;
  l.max_tokens = P;
  l.engine = MOEBLAZE_ENGINE_CPU;
  l.window_tokens = 0;
  moeblaze_handle_t hd = NULL;
  if (tu_create_on(&l, MOEBLAZE_DEVICE_CPU, &hd) != MOEBLAZE_STATUS_SUCCESS) return NAN;
  const size_t esz = tu_dtype_size(at);
  void* xs = tu_alloc(at, (size_t)(P * d) + 1);
  void* ys = tu_alloc(at, (size_t)(P * d) + 1);
  int32_t* ids = tu_alloc(tu_i32, (size_t)P + 1);
  float* ones = tu_alloc(tu_f32, (size_t)P + 1);
  int64_t* tpe = tu_alloc(tu_i64, (size_t)E);
  for (int64_t q = 0; q < P; ++q) {
    memcpy((char*)xs + (size_t)(q * d) * esz, (const char*)x + (size_t)(q / k * d) * esz, (size_t)d * esz);
    ids[q] = routed[q];
    ones[q] = 1.f;
  }
  const int64_t sx[2] = {P, d}, sgu[3] = {E, d, gh}, sd[3] = {E, h, d}, sk[2] = {P, 1}, se[1] = {E};
  const moeblaze_arg_t f[] = {tu_arg(MOEBLAZE_ARG_INPUT, tu_tensor(xs, at, 2, sx)),
                              tu_arg(MOEBLAZE_ARG_W_GATE_UP, tu_tensor((void*)wgu, wt, 3, sgu)),
                              tu_arg(MOEBLAZE_ARG_W_DOWN, tu_tensor((void*)wd, wt, 3, sd)),
                              tu_arg(MOEBLAZE_ARG_OUTPUT, tu_tensor(ys, at, 2, sx)),
                              tu_arg(MOEBLAZE_ARG_TOKENS_PER_EXPERT, tu_tensor(tpe, tu_i64, 1, se)),
                              tu_arg(MOEBLAZE_ARG_TOPK_INDICES, tu_tensor(ids, tu_i32, 2, sk)),
                              tu_arg(MOEBLAZE_ARG_TOPK_WEIGHTS, tu_tensor(ones, tu_f32, 2, sk))};
  size_t wsz = 0;
  double scale = NAN;
  void* ws = NULL;
  if (moeblaze_get_workspace_size(hd, MOEBLAZE_PASS_FORWARD_INFERENCE, P, &wsz) == MOEBLAZE_STATUS_SUCCESS) {
    ws = tu_alloc_bytes(wsz + 1);
    if (moeblaze_forward(hd, MOEBLAZE_PASS_FORWARD_INFERENCE, f, sizeof f / sizeof f[0], ws, wsz, NULL, 0, NULL) ==
        MOEBLAZE_STATUS_SUCCESS) {
      scale = 0;
      for (int64_t q = 0; q < P; ++q) {
        double sq = 0;
        for (int64_t i = 0; i < d; ++i)
          sq += fabs(tu_load(dy, at, (size_t)(q / k * d + i))) * fabs(tu_load(ys, at, (size_t)(q * d + i)));
        scale += sq * sq;
        if (gate_grad_scales) gate_grad_scales[q] = sq;
      }
    }
  }
  tu_free(ws); tu_free(xs); tu_free(ys); tu_free(ids); tu_free(ones); tu_free(tpe);
  moeblaze_destroy(hd);
  return scale;
}

double tu_router_grad_scale2(int64_t L, int64_t k, int64_t d, const float* gates, const double* gate_grad_scales,
                             const void* x, moeblaze_dtype_t at) {
  double* sx = x ? calloc((size_t)d, sizeof(double)) : NULL;
  double scale = 0;
  for (int64_t t = 0; t < L; ++t) {
    double st = 0;
    for (int64_t j = 0; j < k; ++j) st += fabs(gates[t * k + j]) * gate_grad_scales[t * k + j];
    scale += st * st;
    if (sx)
      for (int64_t q = 0; q < d; ++q) sx[q] += st * fabs(tu_load(x, at, (size_t)(t * d + q)));
  }
  if (sx) {
    scale = 0;
    for (int64_t q = 0; q < d; ++q) scale += sx[q] * sx[q];
    free(sx);
  }
  return scale;
}
