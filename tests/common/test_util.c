#include "test_util.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

const moeblaze_dtype_t tu_f32 = MOEBLAZE_DTYPE_F32;
const moeblaze_dtype_t tu_f16 = MOEBLAZE_DTYPE_F16;
const moeblaze_dtype_t tu_bf16 = MOEBLAZE_DTYPE_BF16;
const moeblaze_dtype_t tu_i32 = MOEBLAZE_DTYPE_I32;
const moeblaze_dtype_t tu_i64 = MOEBLAZE_DTYPE_I64;

void tu_rng_seed(tu_rng* r, uint64_t seed) { r->state = seed; }
uint64_t tu_rng_next(tu_rng* r) {
  uint64_t z = (r->state += 0x9E3779B97F4A7C15ull);
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}
double tu_rng_uniform(tu_rng* r) { return (double)(tu_rng_next(r) >> 11) * (1.0 / 9007199254740992.0); }
double tu_rng_normal(tu_rng* r) {
  double u1 = tu_rng_uniform(r), u2 = tu_rng_uniform(r);
  if (u1 < 1e-300) u1 = 1e-300;
  return sqrt(-2.0 * log(u1)) * cos(6.283185307179586 * u2);
}
int64_t tu_rng_below(tu_rng* r, int64_t n) { return (int64_t)(tu_rng_next(r) % (uint64_t)n); }

uint64_t tu_fresh_seed(const char* test_name) {
  const char* env = getenv("MOEBLAZE_TEST_SEED");
  uint64_t seed;
  if (env && *env) {
    seed = strtoull(env, NULL, 0);
  } else {
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    seed = (uint64_t)ts.tv_nsec ^ ((uint64_t)ts.tv_sec << 20);
  }
  fprintf(stderr, "[seed] %s MOEBLAZE_TEST_SEED=%llu\n", test_name, (unsigned long long)seed);
  return seed;
}

size_t tu_dtype_size(moeblaze_dtype_t t) { return (size_t)t.bits / 8u; }
int tu_dtype_eq(moeblaze_dtype_t a, moeblaze_dtype_t b) {
  return a.code == b.code && a.bits == b.bits && a.lanes == b.lanes;
}
const char* tu_dtype_name(moeblaze_dtype_t t) {
  if (tu_dtype_eq(t, tu_f32)) return "f32";
  if (tu_dtype_eq(t, tu_f16)) return "f16";
  if (tu_dtype_eq(t, tu_bf16)) return "bf16";
  if (tu_dtype_eq(t, tu_i32)) return "i32";
  if (tu_dtype_eq(t, tu_i64)) return "i64";
  return "?";
}

static uint32_t f32_bits(float f) { uint32_t u; memcpy(&u, &f, 4); return u; }
static float bits_f32(uint32_t u) { float f; memcpy(&f, &u, 4); return f; }

uint16_t tu_f32_to_bf16(float f) {
  uint32_t u = f32_bits(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40u); /* quiet NaN */
  u += 0x7fffu + ((u >> 16) & 1u);
  return (uint16_t)(u >> 16);
}
float tu_bf16_to_f32(uint16_t h) { return bits_f32((uint32_t)h << 16); }

uint16_t tu_f32_to_f16(float f) {
  uint32_t x = f32_bits(f);
  uint32_t sign = (x >> 16) & 0x8000u;
  uint32_t ax = x & 0x7fffffffu;
  if (ax > 0x7f800000u) return (uint16_t)(sign | 0x7e00u);
  if (ax >= 0x477ff000u) return (uint16_t)(sign | 0x7c00u); /* overflow to inf after rounding */
  if (ax < 0x38800000u) {                                    /* subnormal or zero in f16 */
    float a = bits_f32(ax);
    /* scale so that the f16 subnormal ulp (2^-24) becomes 1, round to nearest even */
    float scaled = a * 16777216.0f;
    uint32_t q = (uint32_t)scaled;
    float rem = scaled - (float)q;
    if (rem > 0.5f || (rem == 0.5f && (q & 1u))) q++;
    return (uint16_t)(sign | q);
  }
  uint32_t exp = ((ax >> 23) - 127 + 15) << 10;
  uint32_t mant = ax & 0x7fffffu;
  uint32_t h = exp | (mant >> 13);
  uint32_t rest = mant & 0x1fffu;
  if (rest > 0x1000u || (rest == 0x1000u && (h & 1u))) h++;
  return (uint16_t)(sign | h);
}
float tu_f16_to_f32(uint16_t h) {
  uint32_t sign = ((uint32_t)h & 0x8000u) << 16;
  uint32_t exp = (h >> 10) & 0x1fu, mant = h & 0x3ffu;
  if (exp == 0) {
    float v = (float)mant * (1.0f / 16777216.0f);
    return sign ? -v : v;
  }
  if (exp == 31) return bits_f32(sign | 0x7f800000u | (mant << 13));
  return bits_f32(sign | ((exp - 15 + 127) << 23) | (mant << 13));
}

double tu_load(const void* buf, moeblaze_dtype_t t, size_t i) {
  if (tu_dtype_eq(t, tu_f32)) return ((const float*)buf)[i];
  if (tu_dtype_eq(t, tu_bf16)) return tu_bf16_to_f32(((const uint16_t*)buf)[i]);
  if (tu_dtype_eq(t, tu_f16)) return tu_f16_to_f32(((const uint16_t*)buf)[i]);
  if (tu_dtype_eq(t, tu_i32)) return ((const int32_t*)buf)[i];
  if (tu_dtype_eq(t, tu_i64)) return (double)((const int64_t*)buf)[i];
  return NAN;
}
void tu_store(void* buf, moeblaze_dtype_t t, size_t i, double v) {
  if (tu_dtype_eq(t, tu_f32)) ((float*)buf)[i] = (float)v;
  else if (tu_dtype_eq(t, tu_bf16)) ((uint16_t*)buf)[i] = tu_f32_to_bf16((float)v);
  else if (tu_dtype_eq(t, tu_f16)) ((uint16_t*)buf)[i] = tu_f32_to_f16((float)v);
  else if (tu_dtype_eq(t, tu_i32)) ((int32_t*)buf)[i] = (int32_t)v;
  else if (tu_dtype_eq(t, tu_i64)) ((int64_t*)buf)[i] = (int64_t)v;
}

void* tu_alloc_bytes(size_t bytes) {
  size_t n = (bytes + 255u) / 256u * 256u;
  if (n == 0) n = 256;
  void* p = aligned_alloc(256, n);
  if (p) memset(p, 0xA5, n);
  return p;
}
void* tu_alloc(moeblaze_dtype_t t, size_t n) { return tu_alloc_bytes(n * tu_dtype_size(t)); }
void tu_free(void* p) { free(p); }

void tu_fill_normal(tu_rng* r, void* buf, moeblaze_dtype_t t, size_t n, double scale) {
  for (size_t i = 0; i < n; ++i) tu_store(buf, t, i, scale * tu_rng_normal(r));
}
void tu_poison(void* buf, moeblaze_dtype_t t, size_t n) {
  if (tu_dtype_eq(t, tu_i32)) {
    for (size_t i = 0; i < n; ++i) ((int32_t*)buf)[i] = INT32_MIN;
  } else if (tu_dtype_eq(t, tu_i64)) {
    for (size_t i = 0; i < n; ++i) ((int64_t*)buf)[i] = INT64_MIN;
  } else {
    for (size_t i = 0; i < n; ++i) tu_store(buf, t, i, NAN);
  }
}
void tu_to_f64(const void* buf, moeblaze_dtype_t t, size_t n, double* out) {
  for (size_t i = 0; i < n; ++i) out[i] = tu_load(buf, t, i);
}

void* tu_transposed_copy(const void* src, moeblaze_dtype_t t, int64_t E, int64_t R, int64_t C, int64_t pitch) {
  const size_t n = (size_t)(E * C * pitch);
  void* phys = tu_alloc(t, n + 1);
  tu_poison(phys, t, n);
  for (int64_t e = 0; e < E; ++e)
    for (int64_t r = 0; r < R; ++r)
      for (int64_t c = 0; c < C; ++c)
        tu_store(phys, t, (size_t)((e * C + c) * pitch + r), tu_load(src, t, (size_t)((e * R + r) * C + c)));
  return phys;
}
void tu_from_transposed(const void* phys, moeblaze_dtype_t t, int64_t E, int64_t R, int64_t C, int64_t pitch, void* dst) {
  for (int64_t e = 0; e < E; ++e)
    for (int64_t r = 0; r < R; ++r)
      for (int64_t c = 0; c < C; ++c)
        tu_store(dst, t, (size_t)((e * R + r) * C + c), tu_load(phys, t, (size_t)((e * C + c) * pitch + r)));
}
void tu_transposed_strides(int64_t R, int64_t C, int64_t pitch, int64_t* strides) {
  (void)R;
  strides[0] = C * pitch;
  strides[1] = 1;
  strides[2] = pitch;
}

moeblaze_tensor_t tu_tensor(void* data, moeblaze_dtype_t t, int32_t ndim, const int64_t* shape) {
  moeblaze_tensor_t x;
  memset(&x, 0, sizeof x);
  x.data = data;
  x.device.device_type = MOEBLAZE_DEVICE_CPU;
  x.device.device_id = 0;
  x.ndim = ndim;
  x.dtype = t;
  x.shape = shape;
  x.strides = NULL;
  x.byte_offset = 0;
  return x;
}
moeblaze_arg_t tu_arg(int32_t kind, moeblaze_tensor_t t) {
  moeblaze_arg_t a;
  a.kind = kind;
  a.flags = 0;
  a.tensor = t;
  return a;
}

double tu_rel_err(const double* a, const double* b, size_t n) {
  double num = 0.0, den = 0.0;
  for (size_t i = 0; i < n; ++i) {
    if (!isfinite(a[i])) return INFINITY;
    double dd = a[i] - b[i];
    num += dd * dd;
    den += b[i] * b[i];
  }
  if (den < 1e-300) return sqrt(num) < 1e-30 ? 0.0 : INFINITY;
  return sqrt(num / den);
}
double tu_tol(moeblaze_dtype_t t) { return tu_dtype_eq(t, tu_f32) ? 1e-5 : 2e-2; }

tu_layer tu_layer_default(int64_t E, int64_t k, int64_t d, int64_t h, int64_t max_tokens,
                          int64_t activation) {
  tu_layer l;
  memset(&l, 0, sizeof l);
  l.experts = E; l.top_k = k; l.d = d; l.h = h; l.max_tokens = max_tokens;
  l.activation = activation;
  l.score_fn = MOEBLAZE_SCORE_SOFTMAX;
  l.normalize = 0;
  l.save_policy = MOEBLAZE_SAVE_PREACT;
  l.act_dtype = tu_f32;
  l.weight_dtype = tu_f32;
  return l;
}

moeblaze_status_t tu_create_on(const tu_layer* l, int32_t device_type, moeblaze_handle_t* out) {
  moeblaze_config_t cfg = NULL;
  moeblaze_status_t s = moeblaze_config_create(&cfg);
  if (s != MOEBLAZE_STATUS_SUCCESS) return s;
#define TU_SET(call) do { s = (call); if (s != MOEBLAZE_STATUS_SUCCESS) goto done; } while (0)
  TU_SET(moeblaze_config_set_i64(cfg, MOEBLAZE_ATTR_DEVICE_TYPE, device_type));
  if (device_type == MOEBLAZE_DEVICE_CUDA) TU_SET(moeblaze_config_set_i64(cfg, MOEBLAZE_ATTR_DEVICE_ID, 0));
  TU_SET(moeblaze_config_set_i64(cfg, MOEBLAZE_ATTR_NUM_EXPERTS, l->experts));
  TU_SET(moeblaze_config_set_i64(cfg, MOEBLAZE_ATTR_TOP_K, l->top_k));
  TU_SET(moeblaze_config_set_i64(cfg, MOEBLAZE_ATTR_HIDDEN_SIZE, l->d));
  TU_SET(moeblaze_config_set_i64(cfg, MOEBLAZE_ATTR_FFN_HIDDEN_SIZE, l->h));
  TU_SET(moeblaze_config_set_i64(cfg, MOEBLAZE_ATTR_MAX_TOKENS, l->max_tokens));
  TU_SET(moeblaze_config_set_i64(cfg, MOEBLAZE_ATTR_ACTIVATION, l->activation));
  TU_SET(moeblaze_config_set_i64(cfg, MOEBLAZE_ATTR_SCORE_FUNCTION, l->score_fn));
  TU_SET(moeblaze_config_set_i64(cfg, MOEBLAZE_ATTR_NORMALIZE_TOPK, l->normalize));
  TU_SET(moeblaze_config_set_i64(cfg, MOEBLAZE_ATTR_SAVE_POLICY, l->save_policy));
  TU_SET(moeblaze_config_set_f64(cfg, MOEBLAZE_ATTR_AUX_LOSS_COEFF, l->aux_coeff));
  TU_SET(moeblaze_config_set_f64(cfg, MOEBLAZE_ATTR_Z_LOSS_COEFF, l->z_coeff));
  TU_SET(moeblaze_config_set_dtype(cfg, MOEBLAZE_ATTR_ACTIVATION_DTYPE, l->act_dtype));
  TU_SET(moeblaze_config_set_dtype(cfg, MOEBLAZE_ATTR_WEIGHT_DTYPE, l->weight_dtype));
  if (device_type == MOEBLAZE_DEVICE_CPU) TU_SET(moeblaze_config_set_i64(cfg, MOEBLAZE_ATTR_NUM_THREADS, l->num_threads));
  if (l->engine) TU_SET(moeblaze_config_set_i64(cfg, MOEBLAZE_ATTR_ENGINE, l->engine));
  if (l->window_tokens) TU_SET(moeblaze_config_set_i64(cfg, MOEBLAZE_ATTR_WINDOW_TOKENS, l->window_tokens));
  if (l->window_bytes) TU_SET(moeblaze_config_set_i64(cfg, MOEBLAZE_ATTR_WINDOW_BYTES, l->window_bytes));
  if (l->route_scale != 0.0) TU_SET(moeblaze_config_set_f64(cfg, MOEBLAZE_ATTR_ROUTE_SCALE, l->route_scale));
#undef TU_SET
  s = moeblaze_create(out, cfg);
done:
  moeblaze_config_destroy(cfg);
  return s;
}

moeblaze_status_t tu_create_cpu(const tu_layer* l, moeblaze_handle_t* out) {
  return tu_create_on(l, MOEBLAZE_DEVICE_CPU, out);
}
