/* The benchmark's error column: one step of the library against the fp64 reference
 * (tests/common/reference_moe), fed with the same rounded inputs. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "bench.h"
#include "reference_moe.h"

static double load(const void* p, moeblaze_dtype_t t, size_t i) {
  if (t.bits == 32) return ((const float*)p)[i];
  uint16_t h = ((const uint16_t*)p)[i];
  uint32_t u;
  float f;
  if (t.code == 4) {
    u = (uint32_t)h << 16;
  } else { /* f16 */
    uint32_t sign = ((uint32_t)h & 0x8000u) << 16, exp = (h >> 10) & 0x1fu, mant = h & 0x3ffu;
    if (exp == 0) return (sign ? -1.0 : 1.0) * (double)mant * ldexp(1.0, -24);
    u = exp == 31 ? (sign | 0x7f800000u | (mant << 13)) : (sign | ((exp + 112u) << 23) | (mant << 13));
  }
  memcpy(&f, &u, 4);
  return f;
}

static double* widen(const void* p, moeblaze_dtype_t t, size_t n) {
  double* out = malloc(sizeof(double) * (n ? n : 1));
  for (size_t i = 0; i < n; ++i) out[i] = load(p, t, i);
  return out;
}

double bench_max_rel_error(const bench_step* s) {
  const int64_t gh = ref_gate_factor(s->activation) * s->h;
  const moeblaze_dtype_t f32 = MOEBLAZE_DTYPE_F32;
  const size_t nx = (size_t)(s->L * s->d), nl = (size_t)(s->L * s->E), nwgu = (size_t)(s->E * s->d * gh),
               nwd = (size_t)(s->E * s->h * s->d);
  ref_layer l;
  memset(&l, 0, sizeof l);
  l.E = s->E; l.k = s->k; l.d = s->d; l.h = s->h;
  l.activation = s->activation;
  l.score_fn = REF_SCORE_SOFTMAX;
  double *x = widen(s->x, s->dtype, nx), *logits = widen(s->logits, f32, nl), *wgu = widen(s->w_gate_up, s->dtype, nwgu),
         *wd = widen(s->w_down, s->dtype, nwd), *dy = widen(s->dy, s->dtype, nx);
  double *y = malloc(sizeof(double) * nx), *dx = malloc(sizeof(double) * nx), *dwgu = malloc(sizeof(double) * nwgu),
         *dwd = malloc(sizeof(double) * nwd), *dlog = malloc(sizeof(double) * nl);
  ref_inputs in;
  memset(&in, 0, sizeof in);
  in.x = x; in.w_gate_up = wgu; in.w_down = wd; in.logits = logits;
  ref_fwd_out out;
  memset(&out, 0, sizeof out);
  out.y = y;
  ref_grads g;
  memset(&g, 0, sizeof g);
  g.dx = dx; g.dw_gate_up = dwgu; g.dw_down = dwd; g.dlogits = dlog;
  double worst = NAN;
  if (ref_layer_forward(&l, s->L, &in, &out) == 0 && ref_layer_backward(&l, s->L, &in, dy, 1.0, 1.0, &g) == 0) {
    const void* got[5] = {s->y, s->dx, s->dw_gate_up, s->dw_down, s->dlogits};
    const double* want[5] = {y, dx, dwgu, dwd, dlog};
    const moeblaze_dtype_t types[5] = {s->dtype, s->dtype, s->dtype, s->dtype, f32};
    const size_t counts[5] = {nx, nx, nwgu, nwd, nl};
    worst = 0.0;
    for (int i = 0; i < 5; ++i) {
      double* a = widen(got[i], types[i], counts[i]);
      double e = ref_rel_l2(a, want[i], counts[i]);
      if (!(e <= worst)) worst = e; /* NaN propagates */
      free(a);
    }
  }
  free(x); free(logits); free(wgu); free(wd); free(dy);
  free(y); free(dx); free(dwgu); free(dwd); free(dlog);
  return worst;
}
