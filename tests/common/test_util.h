/* Shared helpers for the CMocka tests: status assertions, a seeded RNG, dtype conversion,
 * tensor descriptors, poisoning and error norms. Include after <cmocka.h>. */
#ifndef MOEBLAZE_TEST_UTIL_H_
#define MOEBLAZE_TEST_UTIL_H_

#include <stddef.h>
#include <stdint.h>

#include "moeblaze/moeblaze.h"

/* Fails the test with the library's own diagnosis when a call does not succeed. */
#define assert_ok(call)                                                              \
  do {                                                                               \
    moeblaze_status_t s_ = (call);                                                   \
    if (s_ != MOEBLAZE_STATUS_SUCCESS)                                               \
      fail_msg("%s -> %s: %s", #call, moeblaze_status_name(s_),                      \
               moeblaze_get_last_error_message());                                   \
  } while (0)
/* Asserts a specific status and that a failing status left a non-empty message. */
#define assert_status(call, want)                                                    \
  do {                                                                               \
    moeblaze_status_t s_ = (call);                                                   \
    if (s_ != (want))                                                                \
      fail_msg("%s -> %s (%s), want %s", #call, moeblaze_status_name(s_),            \
               moeblaze_get_last_error_message(), moeblaze_status_name(want));       \
    if ((want) != MOEBLAZE_STATUS_SUCCESS && moeblaze_get_last_error_message()[0] == '\0') \
      fail_msg("%s failed without an error message", #call);                         \
  } while (0)

/* TU_SANITIZED: built under ASan or TSan, whose runtimes own the allocator and pthread_create
 * (the tests that interpose those skip themselves). */
#if defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_THREAD__)
#define TU_SANITIZED 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer) || __has_feature(thread_sanitizer)
#define TU_SANITIZED 1
#endif
#endif

/* ---- deterministic RNG (splitmix64) ---- */
typedef struct tu_rng { uint64_t state; } tu_rng;
void tu_rng_seed(tu_rng* r, uint64_t seed);
uint64_t tu_rng_next(tu_rng* r);
double tu_rng_uniform(tu_rng* r);              /* [0, 1) */
double tu_rng_normal(tu_rng* r);               /* N(0, 1) */
int64_t tu_rng_below(tu_rng* r, int64_t n);    /* [0, n) */
/* A seed that differs between runs unless MOEBLAZE_TEST_SEED is set (printed for replay). */
uint64_t tu_fresh_seed(const char* test_name);

/* ---- dtypes ---- */
extern const moeblaze_dtype_t tu_f32, tu_f16, tu_bf16, tu_i32, tu_i64;
size_t tu_dtype_size(moeblaze_dtype_t t);
int tu_dtype_eq(moeblaze_dtype_t a, moeblaze_dtype_t b);
const char* tu_dtype_name(moeblaze_dtype_t t);
uint16_t tu_f32_to_bf16(float f);               /* round to nearest even */
float tu_bf16_to_f32(uint16_t h);
uint16_t tu_f32_to_f16(float f);                /* round to nearest even */
float tu_f16_to_f32(uint16_t h);
/* Element i of a buffer of dtype t, as double / stored from double (rounded to t). */
double tu_load(const void* buf, moeblaze_dtype_t t, size_t i);
void tu_store(void* buf, moeblaze_dtype_t t, size_t i, double v);

/* ---- host buffers and tensors ---- */
/* A host buffer of n elements of dtype t, 256-byte aligned; free with tu_free. */
void* tu_alloc(moeblaze_dtype_t t, size_t n);
void* tu_alloc_bytes(size_t bytes);             /* 256-byte aligned */
void tu_free(void* p);
void tu_fill_normal(tu_rng* r, void* buf, moeblaze_dtype_t t, size_t n, double scale);
void tu_poison(void* buf, moeblaze_dtype_t t, size_t n); /* NaN for floats, INT_MIN for ints */
void tu_to_f64(const void* buf, moeblaze_dtype_t t, size_t n, double* out);

/* Expert weights stored column-major per expert, as nn.Linear keeps [out, in]: the logical
 * [E, R, C] tensor lies in a physical [E, C, pitch] array (pitch >= R) and is passed with
 * strides {C * pitch, 1, pitch}. tu_transposed_copy returns that array for a logical row-major
 * src (padding poisoned; E * C * pitch elements); tu_from_transposed writes the logical
 * row-major tensor of such an array into dst; tu_transposed_strides fills the 3 strides. */
void* tu_transposed_copy(const void* src, moeblaze_dtype_t t, int64_t E, int64_t R, int64_t C, int64_t pitch);
void tu_from_transposed(const void* phys, moeblaze_dtype_t t, int64_t E, int64_t R, int64_t C, int64_t pitch, void* dst);
void tu_transposed_strides(int64_t R, int64_t C, int64_t pitch, int64_t* strides);

/* A contiguous CPU tensor descriptor; `shape` must outlive the descriptor. */
moeblaze_tensor_t tu_tensor(void* data, moeblaze_dtype_t t, int32_t ndim, const int64_t* shape);
moeblaze_arg_t tu_arg(int32_t kind, moeblaze_tensor_t t);

/* ---- comparison ---- */
/* ||a - b|| / max(||b||, tiny); returns +inf if a has a NaN or Inf. */
double tu_rel_err(const double* a, const double* b, size_t n);
/* Tolerance on tu_rel_err by storage dtype: f32 1e-5, f16/bf16 2e-2. */
double tu_tol(moeblaze_dtype_t t);

/* ---- handles ---- */
typedef struct tu_layer {
  int64_t experts, top_k, d, h, max_tokens;
  int64_t activation, score_fn, normalize, save_policy;
  double aux_coeff, z_coeff;
  moeblaze_dtype_t act_dtype, weight_dtype;
  int64_t num_threads; /* 0 = default */
  int64_t engine;      /* MOEBLAZE_ENGINE_*; 0 = AUTO */
  int64_t window_tokens; /* MOEBLAZE_ATTR_WINDOW_TOKENS; 0 = automatic */
  int64_t window_bytes;  /* MOEBLAZE_ATTR_WINDOW_BYTES; 0 = automatic */
  double route_scale;    /* MOEBLAZE_ATTR_ROUTE_SCALE; 0 = the default (1) */
} tu_layer;
/* Defaults: CPU device, softmax, no renormalisation, PREACT, f32, no aux/z loss. */
tu_layer tu_layer_default(int64_t E, int64_t k, int64_t d, int64_t h, int64_t max_tokens,
                          int64_t activation);
/* Creates a CPU handle for the layer; returns the status of moeblaze_create. */
moeblaze_status_t tu_create_cpu(const tu_layer* l, moeblaze_handle_t* out);
/* The same layer on MOEBLAZE_DEVICE_CPU or MOEBLAZE_DEVICE_CUDA (device 0). */
moeblaze_status_t tu_create_on(const tu_layer* l, int32_t device_type, moeblaze_handle_t* out);

#endif
