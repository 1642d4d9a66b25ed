/* The API contract: every entry point with bad input returns the documented status with a
 * message, never crashes, and writes nothing outside (or, on failure, inside) the caller's
 * buffers. Also: L = 0, device discovery without a GPU, thread-local messages, the log
 * callback, and destroy calls that leave the message alone. */
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <setjmp.h>
#include <cmocka.h>

#include <pthread.h>
#include <stdlib.h>
#include <string.h>

#include "test_util.h"

enum { L0 = 9, E0 = 5, K0 = 2, D0 = 8, H0 = 12, MAXL = 16, GUARD = 64 };

/* One valid CPU forward/backward setup; every test perturbs one thing. */
typedef struct fixture {
  moeblaze_handle_t h;
  int64_t sx[2], sl[2], sw[3], sd[3], sk[2], se[1], swg[2];
  float *x, *logits, *wgu, *wd, *y, *dy, *dx, *gw, *wg;
  int32_t* ids;
  void *ws, *saved;
  size_t ws_bytes, saved_bytes;
} fixture;

/* Buffers carry GUARD trailing bytes of 0xA5 so an overrun is visible. */
static float* guarded(size_t n) {
  float* p = tu_alloc_bytes(n * sizeof(float) + GUARD);
  memset((char*)p + n * sizeof(float), 0xA5, GUARD);
  return p;
}
static int guard_intact(const void* p, size_t bytes) {
  const unsigned char* g = (const unsigned char*)p + bytes;
  for (int i = 0; i < GUARD; ++i)
    if (g[i] != 0xA5) return 0;
  return 1;
}

static int setup(void** state) {
  fixture* f = calloc(1, sizeof *f);
  tu_layer l = tu_layer_default(E0, K0, D0, H0, MAXL, MOEBLAZE_ACTIVATION_SWIGLU);
  l.aux_coeff = 0.01;
  if (tu_create_cpu(&l, &f->h) != MOEBLAZE_STATUS_SUCCESS) return -1;
  tu_rng r;
  tu_rng_seed(&r, 7);
  f->sx[0] = L0; f->sx[1] = D0;
  f->sl[0] = L0; f->sl[1] = E0;
  f->sw[0] = E0; f->sw[1] = D0; f->sw[2] = 2 * H0;
  f->sd[0] = E0; f->sd[1] = H0; f->sd[2] = D0;
  f->sk[0] = L0; f->sk[1] = K0;
  f->se[0] = E0;
  f->swg[0] = E0; f->swg[1] = D0;
  f->x = guarded(L0 * D0); f->logits = guarded(L0 * E0); f->wgu = guarded(E0 * D0 * 2 * H0); f->wd = guarded(E0 * H0 * D0);
  f->y = guarded(L0 * D0); f->dy = guarded(L0 * D0); f->dx = guarded(L0 * D0); f->gw = guarded(L0 * K0);
  f->wg = guarded(E0 * D0);
  f->ids = (int32_t*)guarded(L0 * K0);
  tu_fill_normal(&r, f->x, tu_f32, L0 * D0, 1.0);
  tu_fill_normal(&r, f->logits, tu_f32, L0 * E0, 1.0);
  tu_fill_normal(&r, f->wgu, tu_f32, E0 * D0 * 2 * H0, 0.3);
  tu_fill_normal(&r, f->wd, tu_f32, E0 * H0 * D0, 0.3);
  tu_fill_normal(&r, f->dy, tu_f32, L0 * D0, 1.0);
  tu_fill_normal(&r, f->wg, tu_f32, E0 * D0, 0.3);
  for (int t = 0; t < L0; ++t)
    for (int j = 0; j < K0; ++j) { f->ids[t * K0 + j] = (t + 2 * j) % E0; f->gw[t * K0 + j] = 0.5f; }
  size_t wf, wb;
  moeblaze_get_workspace_size(f->h, MOEBLAZE_PASS_FORWARD_TRAINING, L0, &wf);
  moeblaze_get_workspace_size(f->h, MOEBLAZE_PASS_BACKWARD, L0, &wb);
  moeblaze_get_saved_size(f->h, L0, &f->saved_bytes);
  f->ws_bytes = wf > wb ? wf : wb;
  f->ws = tu_alloc_bytes(f->ws_bytes + 256);
  f->saved = tu_alloc_bytes(f->saved_bytes + 256);
  *state = f;
  return 0;
}
static int teardown(void** state) {
  fixture* f = *state;
  void* all[] = {f->x, f->logits, f->wgu, f->wd, f->y, f->dy, f->dx, f->gw, f->wg, f->ids, f->ws, f->saved};
  for (size_t i = 0; i < sizeof all / sizeof all[0]; ++i) tu_free(all[i]);
  moeblaze_destroy(f->h);
  free(f);
  return 0;
}

static moeblaze_arg_t A(int32_t kind, void* data, moeblaze_dtype_t t, int32_t nd, const int64_t* shape) {
  return tu_arg(kind, tu_tensor(data, t, nd, shape));
}
/* The valid forward argument list (routing from logits). Returns the count. */
static size_t fwd_args(fixture* f, moeblaze_arg_t* a) {
  size_t n = 0;
  a[n++] = A(MOEBLAZE_ARG_INPUT, f->x, tu_f32, 2, f->sx);
  a[n++] = A(MOEBLAZE_ARG_ROUTER_LOGITS, f->logits, tu_f32, 2, f->sl);
  a[n++] = A(MOEBLAZE_ARG_W_GATE_UP, f->wgu, tu_f32, 3, f->sw);
  a[n++] = A(MOEBLAZE_ARG_W_DOWN, f->wd, tu_f32, 3, f->sd);
  a[n++] = A(MOEBLAZE_ARG_OUTPUT, f->y, tu_f32, 2, f->sx);
  return n;
}
static moeblaze_status_t fwd(fixture* f, const moeblaze_arg_t* a, size_t n) {
  return moeblaze_forward(f->h, MOEBLAZE_PASS_FORWARD_TRAINING, a, n, f->ws, f->ws_bytes, f->saved, f->saved_bytes, NULL);
}
/* Asserts `want` from forward on the given args and that y was left untouched. check_args
 * sees the same descriptor problems; it reads no tensor data, so a bad expert id (data) and a
 * too-small buffer pass it. */
static void expect_forward_ex(fixture* f, const moeblaze_arg_t* a, size_t n, moeblaze_status_t want, int data_error) {
  memset(f->y, 0x3c, L0 * D0 * sizeof(float));
  assert_status(fwd(f, a, n), want);
  for (size_t i = 0; i < L0 * D0 * sizeof(float); ++i) assert_int_equal(((unsigned char*)f->y)[i], 0x3c);
  assert_true(guard_intact(f->y, L0 * D0 * sizeof(float)));
  assert_status(moeblaze_check_args(f->h, MOEBLAZE_PASS_FORWARD_TRAINING, a, n),
                want == MOEBLAZE_STATUS_INSUFFICIENT_WORKSPACE || data_error ? MOEBLAZE_STATUS_SUCCESS : want);
}
static void expect_forward(fixture* f, const moeblaze_arg_t* a, size_t n, moeblaze_status_t want) {
  expect_forward_ex(f, a, n, want, 0);
}

static void valid_call_succeeds_and_clears_the_message(void** state) {
  fixture* f = *state;
  moeblaze_arg_t a[8];
  size_t n = fwd_args(f, a);
  assert_status(moeblaze_config_create(NULL), MOEBLAZE_STATUS_INVALID_ARGUMENT);
  assert_true(moeblaze_get_last_error_message()[0] != '\0');
  assert_ok(fwd(f, a, n));
  assert_string_equal(moeblaze_get_last_error_message(), "");
  assert_true(guard_intact(f->y, L0 * D0 * sizeof(float)));
}

static void null_pointers(void** state) {
  fixture* f = *state;
  moeblaze_arg_t a[8];
  size_t n = fwd_args(f, a);
  size_t bytes;
  moeblaze_handle_t h;
  moeblaze_config_t cfg;
  assert_ok(moeblaze_config_create(&cfg));
  assert_status(moeblaze_create(NULL, cfg), MOEBLAZE_STATUS_INVALID_ARGUMENT);
  assert_status(moeblaze_create(&h, NULL), MOEBLAZE_STATUS_INVALID_ARGUMENT);
  moeblaze_config_destroy(cfg);
  assert_status(moeblaze_get_workspace_size(NULL, MOEBLAZE_PASS_BACKWARD, 1, &bytes), MOEBLAZE_STATUS_INVALID_ARGUMENT);
  assert_status(moeblaze_get_workspace_size(f->h, MOEBLAZE_PASS_BACKWARD, 1, NULL), MOEBLAZE_STATUS_INVALID_ARGUMENT);
  assert_status(moeblaze_get_saved_size(NULL, 1, &bytes), MOEBLAZE_STATUS_INVALID_ARGUMENT);
  assert_status(moeblaze_get_saved_size(f->h, 1, NULL), MOEBLAZE_STATUS_INVALID_ARGUMENT);
  assert_status(moeblaze_get_device_count(MOEBLAZE_DEVICE_CPU, NULL), MOEBLAZE_STATUS_INVALID_ARGUMENT);
  assert_status(moeblaze_check_args(NULL, MOEBLAZE_PASS_FORWARD_TRAINING, a, n), MOEBLAZE_STATUS_INVALID_ARGUMENT);
  assert_status(moeblaze_check_args(f->h, MOEBLAZE_PASS_FORWARD_TRAINING, NULL, n), MOEBLAZE_STATUS_INVALID_ARGUMENT);
  assert_status(moeblaze_forward(NULL, MOEBLAZE_PASS_FORWARD_TRAINING, a, n, f->ws, f->ws_bytes, f->saved, f->saved_bytes, NULL),
                MOEBLAZE_STATUS_INVALID_ARGUMENT);
  expect_forward(f, NULL, n, MOEBLAZE_STATUS_INVALID_ARGUMENT);
  assert_status(moeblaze_backward(NULL, a, n, f->saved, f->saved_bytes, f->ws, f->ws_bytes, NULL), MOEBLAZE_STATUS_INVALID_ARGUMENT);
  assert_status(moeblaze_route(NULL, a, n, f->ws, f->ws_bytes, NULL), MOEBLAZE_STATUS_INVALID_ARGUMENT);
  /* A NULL data pointer on a non-empty tensor. */
  a[0].tensor.data = NULL;
  expect_forward(f, a, n, MOEBLAZE_STATUS_INVALID_ARGUMENT);
  n = fwd_args(f, a);
  a[0].tensor.shape = NULL;
  expect_forward(f, a, n, MOEBLAZE_STATUS_INVALID_ARGUMENT);
  /* Workspace or saved NULL while bytes are needed. */
  n = fwd_args(f, a);
  assert_status(moeblaze_forward(f->h, MOEBLAZE_PASS_FORWARD_TRAINING, a, n, NULL, f->ws_bytes, f->saved,
                                 f->saved_bytes, NULL), MOEBLAZE_STATUS_INVALID_ARGUMENT);
  assert_status(moeblaze_forward(f->h, MOEBLAZE_PASS_FORWARD_TRAINING, a, n, f->ws, f->ws_bytes, NULL, f->saved_bytes, NULL),
                MOEBLAZE_STATUS_INVALID_ARGUMENT);
}

static void bad_create(void** state) {
  (void)state;
  moeblaze_handle_t h = NULL;
  tu_layer l = tu_layer_default(4, 5, 8, 8, 16, MOEBLAZE_ACTIVATION_SILU); /* k > E */
  assert_status(tu_create_cpu(&l, &h), MOEBLAZE_STATUS_INVALID_ARGUMENT);
  assert_null(h);
  moeblaze_config_t cfg;
  assert_ok(moeblaze_config_create(&cfg));
  assert_ok(moeblaze_config_set_i64(cfg, MOEBLAZE_ATTR_DEVICE_TYPE, MOEBLAZE_DEVICE_CPU));
  assert_status(moeblaze_create(&h, cfg), MOEBLAZE_STATUS_INVALID_ARGUMENT); /* required attributes missing */
  assert_non_null(strstr(moeblaze_get_last_error_message(), "num_experts"));
  assert_ok(moeblaze_config_set_i64(cfg, MOEBLAZE_ATTR_NUM_EXPERTS, 4));
  assert_ok(moeblaze_config_set_i64(cfg, MOEBLAZE_ATTR_TOP_K, 2));
  assert_ok(moeblaze_config_set_i64(cfg, MOEBLAZE_ATTR_HIDDEN_SIZE, 8));
  assert_ok(moeblaze_config_set_i64(cfg, MOEBLAZE_ATTR_FFN_HIDDEN_SIZE, 8));
  assert_ok(moeblaze_config_set_i64(cfg, MOEBLAZE_ATTR_MAX_TOKENS, 2000000000));
  assert_status(moeblaze_create(&h, cfg), MOEBLAZE_STATUS_INVALID_ARGUMENT); /* max_tokens * k >= 2^31 */
  assert_ok(moeblaze_config_set_i64(cfg, MOEBLAZE_ATTR_MAX_TOKENS, 16));
  assert_ok(moeblaze_config_set_i64(cfg, MOEBLAZE_ATTR_ENGINE, MOEBLAZE_ENGINE_CUDA_CUBLASLT));
  assert_status(moeblaze_create(&h, cfg), MOEBLAZE_STATUS_INVALID_ARGUMENT); /* CUDA engine on the CPU */
  assert_ok(moeblaze_config_set_i64(cfg, MOEBLAZE_ATTR_ENGINE, MOEBLAZE_ENGINE_AUTO));
  assert_ok(moeblaze_create(&h, cfg));
  moeblaze_destroy(h);
  moeblaze_config_destroy(cfg);
}

static void no_gpu_here(void** state) {
  (void)state;
  int32_t n = -1;
  assert_ok(moeblaze_get_device_count(MOEBLAZE_DEVICE_CPU, &n));
  assert_int_equal(n, 1);
  assert_status(moeblaze_get_device_count(7, &n), MOEBLAZE_STATUS_INVALID_ARGUMENT);
  assert_ok(moeblaze_get_device_count(MOEBLAZE_DEVICE_CUDA, &n));
  if (n > 0) {
    skip(); /* a GPU machine: the CUDA engine is tested in tests/gpu */
    return;
  }
  moeblaze_config_t cfg;
  assert_ok(moeblaze_config_create(&cfg));
  assert_ok(moeblaze_config_set_i64(cfg, MOEBLAZE_ATTR_NUM_EXPERTS, 4));
  assert_ok(moeblaze_config_set_i64(cfg, MOEBLAZE_ATTR_TOP_K, 2));
  assert_ok(moeblaze_config_set_i64(cfg, MOEBLAZE_ATTR_HIDDEN_SIZE, 8));
  assert_ok(moeblaze_config_set_i64(cfg, MOEBLAZE_ATTR_FFN_HIDDEN_SIZE, 8));
  assert_ok(moeblaze_config_set_i64(cfg, MOEBLAZE_ATTR_MAX_TOKENS, 16));
  moeblaze_handle_t h = NULL;
  assert_status(moeblaze_create(&h, cfg), MOEBLAZE_STATUS_ARCH_MISMATCH); /* device type defaults to CUDA */
  assert_null(h);
  assert_ok(moeblaze_config_set_i64(cfg, MOEBLAZE_ATTR_DEVICE_TYPE, MOEBLAZE_DEVICE_CUDA));
  assert_ok(moeblaze_config_set_i64(cfg, MOEBLAZE_ATTR_DEVICE_ID, 0));
  assert_status(moeblaze_create(&h, cfg), MOEBLAZE_STATUS_ARCH_MISMATCH);
  assert_null(h);
  assert_true(strlen(moeblaze_get_last_error_message()) > strlen("moeblaze_create: "));
  moeblaze_config_destroy(cfg);
}

static void wrong_dtype_shape_stride_device(void** state) {
  fixture* f = *state;
  moeblaze_arg_t a[8];
  size_t n = fwd_args(f, a);
  a[0].tensor.dtype = tu_bf16; /* x must be the activation dtype (f32 here) */
  expect_forward(f, a, n, MOEBLAZE_STATUS_INVALID_ARGUMENT);
  n = fwd_args(f, a);
  a[1].tensor.dtype = tu_i32; /* logits: f32 or the activation dtype */
  expect_forward(f, a, n, MOEBLAZE_STATUS_INVALID_ARGUMENT);
  n = fwd_args(f, a);
  a[4].tensor.dtype.lanes = 2;
  expect_forward(f, a, n, MOEBLAZE_STATUS_INVALID_ARGUMENT);
  const int64_t bad_w[3] = {E0, D0, H0}; /* SwiGLU needs 2h columns */
  n = fwd_args(f, a);
  a[2].tensor.shape = bad_w;
  expect_forward(f, a, n, MOEBLAZE_STATUS_INVALID_ARGUMENT);
  n = fwd_args(f, a);
  a[3].tensor.ndim = 2;
  expect_forward(f, a, n, MOEBLAZE_STATUS_INVALID_ARGUMENT);
  const int64_t short_y[2] = {L0 - 1, D0};
  n = fwd_args(f, a);
  a[4].tensor.shape = short_y;
  expect_forward(f, a, n, MOEBLAZE_STATUS_INVALID_ARGUMENT);
  const int64_t inner2[2] = {2 * D0, 2}; /* non-unit innermost stride */
  n = fwd_args(f, a);
  a[0].tensor.strides = inner2;
  expect_forward(f, a, n, MOEBLAZE_STATUS_INVALID_ARGUMENT);
  const int64_t overlap[2] = {D0 - 1, 1}; /* rows would overlap */
  n = fwd_args(f, a);
  a[4].tensor.strides = overlap;
  expect_forward(f, a, n, MOEBLAZE_STATUS_INVALID_ARGUMENT);
  const int64_t negative[2] = {-D0, 1};
  n = fwd_args(f, a);
  a[0].tensor.strides = negative;
  expect_forward(f, a, n, MOEBLAZE_STATUS_INVALID_ARGUMENT);
  n = fwd_args(f, a);
  a[1].tensor.device.device_type = MOEBLAZE_DEVICE_CUDA;
  expect_forward(f, a, n, MOEBLAZE_STATUS_INVALID_ARGUMENT);
  n = fwd_args(f, a);
  a[1].tensor.device.device_id = 1;
  expect_forward(f, a, n, MOEBLAZE_STATUS_INVALID_ARGUMENT);
  n = fwd_args(f, a);
  a[0].tensor.byte_offset = 2; /* misaligned for f32 */
  expect_forward(f, a, n, MOEBLAZE_STATUS_INVALID_ARGUMENT);
  /* A padded row stride is honoured, not rejected. */
  float* padded = guarded(L0 * (D0 + 3));
  for (int t = 0; t < L0; ++t) memcpy(padded + t * (D0 + 3), f->x + t * D0, D0 * sizeof(float));
  const int64_t pad_stride[2] = {D0 + 3, 1};
  n = fwd_args(f, a);
  a[0].tensor.data = padded;
  a[0].tensor.strides = pad_stride;
  assert_ok(fwd(f, a, n));
  tu_free(padded);
  /* Expert weights may be column-major per expert (nn.Linear's [out, in] through strides);
   * nothing else may, and the column-major layout gets the same overlap checks. */
  const int64_t gu_cols = 2 * H0;
  const int64_t neither[3] = {D0 * gu_cols * 2, 2, 2 * D0};  /* no unit stride in the last two */
  n = fwd_args(f, a);
  a[2].tensor.strides = neither;
  expect_forward(f, a, n, MOEBLAZE_STATUS_INVALID_ARGUMENT);
  assert_non_null(strstr(moeblaze_get_last_error_message(), "one of its last two dimensions must have stride 1"));
  const int64_t cols_overlap[3] = {D0 * gu_cols, 1, D0 - 1}; /* column pitch below its length */
  n = fwd_args(f, a);
  a[2].tensor.strides = cols_overlap;
  expect_forward(f, a, n, MOEBLAZE_STATUS_INVALID_ARGUMENT);
  const int64_t x_cols[2] = {1, L0}; /* x column-major: not accepted */
  n = fwd_args(f, a);
  a[0].tensor.strides = x_cols;
  expect_forward(f, a, n, MOEBLAZE_STATUS_INVALID_ARGUMENT);
  const int64_t wgu_t[3] = {D0 * gu_cols, 1, D0}, wd_t[3] = {H0 * D0, 1, H0};
  n = fwd_args(f, a);
  a[2].tensor.strides = wgu_t;
  a[3].tensor.strides = wd_t;
  assert_ok(fwd(f, a, n));
  /* Disjoint padded layouts are honoured: rows padded to a pitch, and experts spaced by
   * anything from the end of the previous expert's last row (not a whole pitch x rows). */
  float* want = guarded(L0 * D0);
  n = fwd_args(f, a);
  assert_ok(fwd(f, a, n));
  memcpy(want, f->y, L0 * D0 * sizeof(float));
  const int64_t pitch = gu_cols + 3, tight = (D0 - 1) * pitch + gu_cols;
  float* spaced = guarded(E0 * tight);
  for (int e = 0; e < E0; ++e)
    for (int r = 0; r < D0; ++r) memcpy(spaced + e * tight + r * pitch, f->wgu + (e * D0 + r) * gu_cols, gu_cols * sizeof(float));
  const int64_t spaced_strides[3] = {tight, pitch, 1};
  a[2].tensor.data = spaced;
  a[2].tensor.strides = spaced_strides;
  memset(f->y, 0x3c, L0 * D0 * sizeof(float));
  assert_ok(fwd(f, a, n));
  assert_memory_equal(f->y, want, L0 * D0 * sizeof(float));
  const int64_t one_short[3] = {tight - 1, pitch, 1}; /* the last row would run into the next expert */
  a[2].tensor.strides = one_short;
  expect_forward(f, a, n, MOEBLAZE_STATUS_INVALID_ARGUMENT);
  tu_free(spaced);
  tu_free(want);
}

static void tokens_and_buffers(void** state) {
  fixture* f = *state;
  moeblaze_arg_t a[8];
  size_t n = fwd_args(f, a), bytes;
  assert_status(moeblaze_get_workspace_size(f->h, MOEBLAZE_PASS_FORWARD_TRAINING, MAXL + 1, &bytes), MOEBLAZE_STATUS_INVALID_ARGUMENT);
  assert_status(moeblaze_get_workspace_size(f->h, (moeblaze_pass_t)9, 1, &bytes), MOEBLAZE_STATUS_INVALID_ARGUMENT);
  assert_status(moeblaze_get_saved_size(f->h, -1, &bytes), MOEBLAZE_STATUS_INVALID_ARGUMENT);
  /* L > MAX_TOKENS in the arguments */
  float* big = guarded((MAXL + 1) * E0 * 2 * 2);
  const int64_t bx[2] = {MAXL + 1, D0}, bl[2] = {MAXL + 1, E0};
  a[0].tensor.data = big; a[0].tensor.shape = bx;
  a[1].tensor.data = big; a[1].tensor.shape = bl;
  a[4].tensor.shape = bx;
  memset(f->y, 0x3c, L0 * D0 * sizeof(float));
  assert_status(fwd(f, a, n), MOEBLAZE_STATUS_INVALID_ARGUMENT);
  tu_free(big);
  n = fwd_args(f, a);
  /* Too small */
  assert_status(moeblaze_forward(f->h, MOEBLAZE_PASS_FORWARD_TRAINING, a, n, f->ws, 256, f->saved, f->saved_bytes, NULL),
                MOEBLAZE_STATUS_INSUFFICIENT_WORKSPACE);
  assert_status(moeblaze_forward(f->h, MOEBLAZE_PASS_FORWARD_TRAINING, a, n, f->ws, f->ws_bytes, f->saved, f->saved_bytes - 1, NULL),
                MOEBLAZE_STATUS_INSUFFICIENT_WORKSPACE);
  /* Misaligned */
  assert_status(moeblaze_forward(f->h, MOEBLAZE_PASS_FORWARD_TRAINING, a, n, (char*)f->ws + 8, f->ws_bytes, f->saved, f->saved_bytes, NULL),
                MOEBLAZE_STATUS_INVALID_ARGUMENT);
  assert_status(moeblaze_forward(f->h, MOEBLAZE_PASS_FORWARD_TRAINING, a, n, f->ws, f->ws_bytes, (char*)f->saved + 64, f->saved_bytes, NULL),
                MOEBLAZE_STATUS_INVALID_ARGUMENT);
  /* Backward with a too-small saved buffer */
  assert_ok(fwd(f, a, n));
  moeblaze_arg_t b[8];
  size_t nb = 0;
  b[nb++] = a[0]; b[nb++] = a[1]; b[nb++] = a[2]; b[nb++] = a[3];
  b[nb++] = A(MOEBLAZE_ARG_GRAD_OUTPUT, f->dy, tu_f32, 2, f->sx);
  b[nb++] = A(MOEBLAZE_ARG_GRAD_INPUT, f->dx, tu_f32, 2, f->sx);
  assert_status(moeblaze_backward(f->h, b, nb, f->saved, 256, f->ws, f->ws_bytes, NULL), MOEBLAZE_STATUS_INSUFFICIENT_WORKSPACE);
  assert_status(moeblaze_backward(f->h, b, nb, f->saved, f->saved_bytes, f->ws, 0, NULL), MOEBLAZE_STATUS_INSUFFICIENT_WORKSPACE);
  assert_ok(moeblaze_backward(f->h, b, nb, f->saved, f->saved_bytes, f->ws, f->ws_bytes, NULL));
  assert_true(guard_intact(f->dx, L0 * D0 * sizeof(float)));
  /* The pass must match the call */
  assert_status(moeblaze_forward(f->h, MOEBLAZE_PASS_BACKWARD, a, n, f->ws, f->ws_bytes, f->saved, f->saved_bytes, NULL),
                MOEBLAZE_STATUS_INVALID_ARGUMENT);
}

static void zero_tokens(void** state) {
  fixture* f = *state;
  moeblaze_arg_t a[8];
  size_t n = fwd_args(f, a), ws = 0, sv = 0;
  const int64_t zx[2] = {0, D0}, zl[2] = {0, E0};
  a[0].tensor.shape = zx; a[1].tensor.shape = zl; a[4].tensor.shape = zx;
  float aux = -1.f;
  int64_t counts[E0];
  memset(counts, 0x7f, sizeof counts);
  const int64_t se[1] = {E0};
  a[n++] = A(MOEBLAZE_ARG_AUX_LOSS, &aux, tu_f32, 0, NULL);
  a[n++] = A(MOEBLAZE_ARG_TOKENS_PER_EXPERT, counts, tu_i64, 1, se);
  assert_ok(moeblaze_get_workspace_size(f->h, MOEBLAZE_PASS_FORWARD_TRAINING, 0, &ws));
  assert_ok(moeblaze_get_saved_size(f->h, 0, &sv));
  assert_ok(moeblaze_forward(f->h, MOEBLAZE_PASS_FORWARD_TRAINING, a, n, f->ws, ws, f->saved, sv, NULL));
  assert_true(aux == 0.f);
  for (int e = 0; e < E0; ++e) assert_int_equal(counts[e], 0);
}

/* Caller-given ids: out of range (>= E, negative, beyond 32 bits for I64) or repeated within a
 * token fail with INVALID_ARGUMENT before anything is written: y, TOKENS_PER_EXPERT and the
 * saved buffer keep their pre-filled bytes, and the guard bytes after every output stay
 * intact. check_args reads no data, so it accepts the same descriptors. */
/* moeblaze_assert_status on a CPU handle reads the host scalar at once: 0 passes, anything else
 * is INVALID_ARGUMENT with the cause of the pass in the message; bad arguments are refused. */
static void assert_status_on_cpu(void** state) {
  fixture* f = *state;
  int32_t* st = (int32_t*)guarded(1);
  const moeblaze_tensor_t t = tu_tensor(st, tu_i32, 0, NULL);
  *st = 0;
  for (int p = 0; p <= MOEBLAZE_PASS_BACKWARD_LAST_USE; ++p) assert_ok(moeblaze_assert_status(f->h, (moeblaze_pass_t)p, &t, NULL));
  *st = MOEBLAZE_STATUS_INVALID_ARGUMENT;
  assert_int_equal(moeblaze_assert_status(f->h, MOEBLAZE_PASS_FORWARD_TRAINING, &t, NULL), MOEBLAZE_STATUS_INVALID_ARGUMENT);
  assert_non_null(strstr(moeblaze_get_last_error_message(), "caller expert id"));
  assert_int_equal(moeblaze_assert_status(f->h, MOEBLAZE_PASS_BACKWARD, &t, NULL), MOEBLAZE_STATUS_INVALID_ARGUMENT);
  assert_non_null(strstr(moeblaze_get_last_error_message(), "saved buffer"));
  assert_int_equal(moeblaze_assert_status(f->h, MOEBLAZE_PASS_BACKWARD_LAST_USE, &t, NULL), MOEBLAZE_STATUS_INVALID_ARGUMENT);
  assert_non_null(strstr(moeblaze_get_last_error_message(), "saved buffer"));
  *st = 0;
  assert_int_equal(moeblaze_assert_status(NULL, MOEBLAZE_PASS_BACKWARD, &t, NULL), MOEBLAZE_STATUS_INVALID_ARGUMENT);
  assert_int_equal(moeblaze_assert_status(f->h, MOEBLAZE_PASS_BACKWARD, NULL, NULL), MOEBLAZE_STATUS_INVALID_ARGUMENT);
  assert_int_equal(moeblaze_assert_status(f->h, (moeblaze_pass_t)5, &t, NULL), MOEBLAZE_STATUS_INVALID_ARGUMENT);
  assert_int_equal(moeblaze_assert_status(f->h, (moeblaze_pass_t)-1, &t, NULL), MOEBLAZE_STATUS_INVALID_ARGUMENT);
  moeblaze_tensor_t bad = t;
  bad.dtype = tu_i64;
  assert_int_equal(moeblaze_assert_status(f->h, MOEBLAZE_PASS_BACKWARD, &bad, NULL), MOEBLAZE_STATUS_INVALID_ARGUMENT);
  bad = t;
  bad.data = NULL;
  assert_int_equal(moeblaze_assert_status(f->h, MOEBLAZE_PASS_BACKWARD, &bad, NULL), MOEBLAZE_STATUS_INVALID_ARGUMENT);
  bad = t;
  bad.device.device_type = MOEBLAZE_DEVICE_CUDA;
  assert_int_equal(moeblaze_assert_status(f->h, MOEBLAZE_PASS_BACKWARD, &bad, NULL), MOEBLAZE_STATUS_INVALID_ARGUMENT);
  const int64_t two = 2;
  bad = tu_tensor(st, tu_i32, 1, &two);
  assert_int_equal(moeblaze_assert_status(f->h, MOEBLAZE_PASS_BACKWARD, &bad, NULL), MOEBLAZE_STATUS_INVALID_ARGUMENT);
  assert_true(guard_intact(st, sizeof *st));
  tu_free(st);
}

static void caller_ids_are_validated(void** state) {
  fixture* f = *state;
  int64_t* ids64 = (int64_t*)guarded(2 * L0 * K0);
  int64_t* counts = (int64_t*)guarded(2 * E0);
  const size_t cb = E0 * sizeof(int64_t);
  const int64_t bad64[] = {E0, -1, (int64_t)1 << 32, ((int64_t)1 << 32) + 1, INT64_MIN};
  const size_t nbad32 = 3, nbad64 = sizeof bad64 / sizeof bad64[0] + 1;
  for (int wide = 0; wide < 2; ++wide) {
    const size_t ncase = wide ? nbad64 : nbad32;
    for (size_t v = 0; v < ncase; ++v) {
      for (int t = 0; t < L0; ++t)
        for (int j = 0; j < K0; ++j) {
          f->ids[t * K0 + j] = (t + 2 * j) % E0;
          ids64[t * K0 + j] = f->ids[t * K0 + j];
        }
      const int dup = v == ncase - 1; /* the last case: token 3 names one expert twice */
      if (wide) ids64[7] = dup ? ids64[6] : bad64[v];
      else f->ids[7] = dup ? f->ids[6] : (v == 0 ? E0 : -1);
      moeblaze_arg_t a[8];
      size_t n = 0;
      a[n++] = A(MOEBLAZE_ARG_INPUT, f->x, tu_f32, 2, f->sx);
      a[n++] = A(MOEBLAZE_ARG_W_GATE_UP, f->wgu, tu_f32, 3, f->sw);
      a[n++] = A(MOEBLAZE_ARG_W_DOWN, f->wd, tu_f32, 3, f->sd);
      a[n++] = A(MOEBLAZE_ARG_OUTPUT, f->y, tu_f32, 2, f->sx);
      a[n++] = wide ? A(MOEBLAZE_ARG_TOPK_INDICES, ids64, tu_i64, 2, f->sk)
                    : A(MOEBLAZE_ARG_TOPK_INDICES, f->ids, tu_i32, 2, f->sk);
      a[n++] = A(MOEBLAZE_ARG_TOPK_WEIGHTS, f->gw, tu_f32, 2, f->sk);
      a[n++] = A(MOEBLAZE_ARG_TOKENS_PER_EXPERT, counts, tu_i64, 1, f->se);
      memset(counts, 0x11, cb);
      memset(f->saved, 0x5e, f->saved_bytes);
      expect_forward_ex(f, a, n, MOEBLAZE_STATUS_INVALID_ARGUMENT, 1);
      for (size_t i = 0; i < cb; ++i) assert_int_equal(((unsigned char*)counts)[i], 0x11);
      for (size_t i = 0; i < f->saved_bytes; ++i)
        if (((unsigned char*)f->saved)[i] != 0x5e) fail_msg("case %zu (%s ids): saved byte %zu was written", v, wide ? "i64" : "i32", i);
      assert_true(guard_intact(counts, cb));
      assert_true(guard_intact(wide ? (void*)ids64 : (void*)f->ids, L0 * K0 * (wide ? 8 : 4)));
      /* inference fails the same way */
      memset(f->y, 0x3c, L0 * D0 * sizeof(float));
      assert_status(moeblaze_forward(f->h, MOEBLAZE_PASS_FORWARD_INFERENCE, a, n, f->ws, f->ws_bytes, NULL, 0, NULL),
                    MOEBLAZE_STATUS_INVALID_ARGUMENT);
      for (size_t i = 0; i < L0 * D0 * sizeof(float); ++i) assert_int_equal(((unsigned char*)f->y)[i], 0x3c);
      /* repaired, the same arguments succeed and stay inside their buffers */
      if (wide) ids64[7] = (3 + 2) % E0;
      else f->ids[7] = (3 + 2) % E0;
      assert_ok(fwd(f, a, n));
      int64_t total = 0;
      for (int e = 0; e < E0; ++e) total += counts[e];
      assert_int_equal(total, L0 * K0);
      assert_true(guard_intact(f->y, L0 * D0 * sizeof(float)));
      assert_true(guard_intact(counts, cb));
    }
  }
  tu_free(ids64);
  tu_free(counts);
}

static void argument_list_rules(void** state) {
  fixture* f = *state;
  moeblaze_arg_t a[10];
  size_t n = fwd_args(f, a);
  a[n] = a[0]; /* duplicated kind */
  expect_forward(f, a, n + 1, MOEBLAZE_STATUS_INVALID_ARGUMENT);
  a[n] = a[0];
  a[n].kind = 4; /* reserved, unknown */
  expect_forward(f, a, n + 1, MOEBLAZE_STATUS_INVALID_ARGUMENT);
  a[n].kind = 12345;
  expect_forward(f, a, n + 1, MOEBLAZE_STATUS_INVALID_ARGUMENT);
  n = fwd_args(f, a);
  a[4].flags = 0x4; /* unknown flag bit */
  expect_forward(f, a, n, MOEBLAZE_STATUS_INVALID_ARGUMENT);
  n = fwd_args(f, a);
  a[4].flags = MOEBLAZE_ARG_FLAG_ACCUMULATE; /* not a gradient output */
  expect_forward(f, a, n, MOEBLAZE_STATUS_INVALID_ARGUMENT);
  n = fwd_args(f, a);
  a[n++] = A(MOEBLAZE_ARG_ROUTER_WEIGHT, f->wg, tu_f32, 2, f->swg); /* with ROUTER_LOGITS */
  expect_forward(f, a, n, MOEBLAZE_STATUS_INVALID_ARGUMENT);
  n = fwd_args(f, a);
  a[1] = A(MOEBLAZE_ARG_TOPK_INDICES, f->ids, tu_i32, 2, f->sk);
  a[n++] = A(MOEBLAZE_ARG_TOPK_WEIGHTS, f->gw, tu_f32, 2, f->sk);
  float aux;
  a[n++] = A(MOEBLAZE_ARG_AUX_LOSS, &aux, tu_f32, 0, NULL); /* no scores with caller routing */
  expect_forward(f, a, n, MOEBLAZE_STATUS_INVALID_ARGUMENT);
  n = fwd_args(f, a);
  expect_forward(f, a, n - 1, MOEBLAZE_STATUS_INVALID_ARGUMENT); /* OUTPUT missing */
  n = fwd_args(f, a);
  a[n++] = A(MOEBLAZE_ARG_GRAD_INPUT, f->dx, tu_f32, 2, f->sx); /* a backward argument */
  expect_forward(f, a, n, MOEBLAZE_STATUS_INVALID_ARGUMENT);
  n = fwd_args(f, a);
  const int64_t vec[1] = {2};
  a[n++] = A(MOEBLAZE_ARG_AUX_LOSS, &aux, tu_f32, 1, vec); /* a scalar must have one element */
  expect_forward(f, a, n, MOEBLAZE_STATUS_INVALID_ARGUMENT);
  /* GRAD_ROUTER_WEIGHT needs ROUTER_WEIGHT in backward */
  n = fwd_args(f, a);
  assert_ok(fwd(f, a, n));
  moeblaze_arg_t b[8];
  size_t nb = 0;
  b[nb++] = a[0]; b[nb++] = a[1]; b[nb++] = a[2]; b[nb++] = a[3];
  b[nb++] = A(MOEBLAZE_ARG_GRAD_OUTPUT, f->dy, tu_f32, 2, f->sx);
  b[nb++] = A(MOEBLAZE_ARG_GRAD_ROUTER_WEIGHT, f->wg, tu_f32, 2, f->swg);
  assert_status(moeblaze_backward(f->h, b, nb, f->saved, f->saved_bytes, f->ws, f->ws_bytes, NULL), MOEBLAZE_STATUS_INVALID_ARGUMENT);
  assert_status(moeblaze_check_args(f->h, MOEBLAZE_PASS_BACKWARD, b, nb), MOEBLAZE_STATUS_INVALID_ARGUMENT);
  /* route needs logits or W_g, and its TOPK outputs */
  moeblaze_arg_t r[2] = {A(MOEBLAZE_ARG_INPUT, f->x, tu_f32, 2, f->sx), A(MOEBLAZE_ARG_TOPK_INDICES, f->ids, tu_i32, 2, f->sk)};
  assert_status(moeblaze_route(f->h, r, 2, f->ws, f->ws_bytes, NULL), MOEBLAZE_STATUS_INVALID_ARGUMENT);
}

/* Every status-returning entry point, with each pointer parameter NULL in turn. */
static void every_entry_point_rejects_null(void** state) {
  fixture* f = *state;
  moeblaze_arg_t a[8];
  const size_t n = fwd_args(f, a);
  moeblaze_config_t cfg;
  moeblaze_handle_t h;
  int64_t i64;
  double f64;
  moeblaze_dtype_t dt;
  size_t bytes;
  moeblaze_attr_info_t info;
  memset(&info, 0, sizeof info);
  info.struct_size = sizeof info;
  assert_ok(moeblaze_config_create(&cfg));
  /* config */
  assert_status(moeblaze_config_create(NULL), MOEBLAZE_STATUS_INVALID_ARGUMENT);
  assert_status(moeblaze_config_set_i64(NULL, MOEBLAZE_ATTR_TOP_K, 1), MOEBLAZE_STATUS_INVALID_ARGUMENT);
  assert_status(moeblaze_config_set_f64(NULL, MOEBLAZE_ATTR_Z_LOSS_COEFF, 0.5), MOEBLAZE_STATUS_INVALID_ARGUMENT);
  assert_status(moeblaze_config_set_dtype(NULL, MOEBLAZE_ATTR_WEIGHT_DTYPE, tu_f32), MOEBLAZE_STATUS_INVALID_ARGUMENT);
  assert_status(moeblaze_config_get_i64(NULL, MOEBLAZE_ATTR_TOP_K, &i64), MOEBLAZE_STATUS_INVALID_ARGUMENT);
  assert_status(moeblaze_config_get_i64(cfg, MOEBLAZE_ATTR_TOP_K, NULL), MOEBLAZE_STATUS_INVALID_ARGUMENT);
  assert_status(moeblaze_config_get_f64(NULL, MOEBLAZE_ATTR_Z_LOSS_COEFF, &f64), MOEBLAZE_STATUS_INVALID_ARGUMENT);
  assert_status(moeblaze_config_get_f64(cfg, MOEBLAZE_ATTR_Z_LOSS_COEFF, NULL), MOEBLAZE_STATUS_INVALID_ARGUMENT);
  assert_status(moeblaze_config_get_dtype(NULL, MOEBLAZE_ATTR_WEIGHT_DTYPE, &dt), MOEBLAZE_STATUS_INVALID_ARGUMENT);
  assert_status(moeblaze_config_get_dtype(cfg, MOEBLAZE_ATTR_WEIGHT_DTYPE, NULL), MOEBLAZE_STATUS_INVALID_ARGUMENT);
  assert_status(moeblaze_attr_query(MOEBLAZE_ATTR_TOP_K, NULL), MOEBLAZE_STATUS_INVALID_ARGUMENT);
  /* handle */
  assert_status(moeblaze_get_device_count(MOEBLAZE_DEVICE_CPU, NULL), MOEBLAZE_STATUS_INVALID_ARGUMENT);
  assert_status(moeblaze_get_device_count(MOEBLAZE_DEVICE_CUDA, NULL), MOEBLAZE_STATUS_INVALID_ARGUMENT);
  assert_status(moeblaze_create(NULL, cfg), MOEBLAZE_STATUS_INVALID_ARGUMENT);
  assert_status(moeblaze_create(&h, NULL), MOEBLAZE_STATUS_INVALID_ARGUMENT);
  assert_status(moeblaze_handle_get_i64(NULL, MOEBLAZE_ATTR_TOP_K, &i64), MOEBLAZE_STATUS_INVALID_ARGUMENT);
  assert_status(moeblaze_handle_get_i64(f->h, MOEBLAZE_ATTR_TOP_K, NULL), MOEBLAZE_STATUS_INVALID_ARGUMENT);
  assert_status(moeblaze_handle_get_f64(NULL, MOEBLAZE_ATTR_Z_LOSS_COEFF, &f64), MOEBLAZE_STATUS_INVALID_ARGUMENT);
  assert_status(moeblaze_handle_get_f64(f->h, MOEBLAZE_ATTR_Z_LOSS_COEFF, NULL), MOEBLAZE_STATUS_INVALID_ARGUMENT);
  assert_status(moeblaze_handle_get_dtype(NULL, MOEBLAZE_ATTR_WEIGHT_DTYPE, &dt), MOEBLAZE_STATUS_INVALID_ARGUMENT);
  assert_status(moeblaze_handle_get_dtype(f->h, MOEBLAZE_ATTR_WEIGHT_DTYPE, NULL), MOEBLAZE_STATUS_INVALID_ARGUMENT);
  /* sizes */
  for (int p = MOEBLAZE_PASS_FORWARD_TRAINING; p <= MOEBLAZE_PASS_BACKWARD_LAST_USE; ++p) {
    assert_status(moeblaze_get_workspace_size(NULL, (moeblaze_pass_t)p, 1, &bytes), MOEBLAZE_STATUS_INVALID_ARGUMENT);
    assert_status(moeblaze_get_workspace_size(f->h, (moeblaze_pass_t)p, 1, NULL), MOEBLAZE_STATUS_INVALID_ARGUMENT);
  }
  assert_status(moeblaze_get_saved_size(NULL, 1, &bytes), MOEBLAZE_STATUS_INVALID_ARGUMENT);
  assert_status(moeblaze_get_saved_size(f->h, 1, NULL), MOEBLAZE_STATUS_INVALID_ARGUMENT);
  /* execution: NULL handle, NULL argument array (with and without a count) */
  for (int p = MOEBLAZE_PASS_FORWARD_TRAINING; p <= MOEBLAZE_PASS_BACKWARD_LAST_USE; ++p) {
    assert_status(moeblaze_check_args(NULL, (moeblaze_pass_t)p, a, n), MOEBLAZE_STATUS_INVALID_ARGUMENT);
    assert_status(moeblaze_check_args(f->h, (moeblaze_pass_t)p, NULL, n), MOEBLAZE_STATUS_INVALID_ARGUMENT);
    assert_status(moeblaze_check_args(f->h, (moeblaze_pass_t)p, NULL, 0), MOEBLAZE_STATUS_INVALID_ARGUMENT);
  }
  assert_status(moeblaze_forward(NULL, MOEBLAZE_PASS_FORWARD_TRAINING, a, n, f->ws, f->ws_bytes, f->saved, f->saved_bytes, NULL),
                MOEBLAZE_STATUS_INVALID_ARGUMENT);
  assert_status(moeblaze_forward(f->h, MOEBLAZE_PASS_FORWARD_INFERENCE, NULL, n, f->ws, f->ws_bytes, NULL, 0, NULL),
                MOEBLAZE_STATUS_INVALID_ARGUMENT);
  assert_status(moeblaze_forward(f->h, MOEBLAZE_PASS_FORWARD_TRAINING, NULL, 0, f->ws, f->ws_bytes, f->saved, f->saved_bytes, NULL),
                MOEBLAZE_STATUS_INVALID_ARGUMENT);
  assert_status(moeblaze_backward(NULL, a, n, f->saved, f->saved_bytes, f->ws, f->ws_bytes, NULL), MOEBLAZE_STATUS_INVALID_ARGUMENT);
  assert_status(moeblaze_backward(f->h, NULL, n, f->saved, f->saved_bytes, f->ws, f->ws_bytes, NULL), MOEBLAZE_STATUS_INVALID_ARGUMENT);
  assert_status(moeblaze_backward_last_use(NULL, a, n, f->saved, f->saved_bytes, f->ws, f->ws_bytes, NULL),
                MOEBLAZE_STATUS_INVALID_ARGUMENT);
  assert_status(moeblaze_backward_last_use(f->h, NULL, n, f->saved, f->saved_bytes, f->ws, f->ws_bytes, NULL),
                MOEBLAZE_STATUS_INVALID_ARGUMENT);
  assert_status(moeblaze_route(NULL, a, n, f->ws, f->ws_bytes, NULL), MOEBLAZE_STATUS_INVALID_ARGUMENT);
  assert_status(moeblaze_route(f->h, NULL, n, f->ws, f->ws_bytes, NULL), MOEBLAZE_STATUS_INVALID_ARGUMENT);
  /* NULL is valid where documented: destroy calls and removing the log callback. */
  assert_ok(moeblaze_config_destroy(NULL));
  assert_ok(moeblaze_destroy(NULL));
  assert_ok(moeblaze_set_log_callback(NULL, NULL, 0));
  /* Pure getters never return NULL. */
  assert_non_null(moeblaze_get_version_string());
  assert_non_null(moeblaze_get_build_info());
  assert_non_null(moeblaze_get_last_error_message());
  assert_ok(moeblaze_config_destroy(cfg));
}

/* The backward argument list matching fwd_args (routing from logits). Returns the count. */
static size_t bwd_args(fixture* f, moeblaze_arg_t* b) {
  size_t n = fwd_args(f, b) - 1; /* drop OUTPUT */
  b[n++] = A(MOEBLAZE_ARG_GRAD_OUTPUT, f->dy, tu_f32, 2, f->sx);
  b[n++] = A(MOEBLAZE_ARG_GRAD_INPUT, f->dx, tu_f32, 2, f->sx);
  return n;
}

/* A NULL workspace (or saved buffer) is accepted exactly when the queried size is 0; a
 * buffer that is too small is INSUFFICIENT_WORKSPACE whether or not it is NULL. */
static void null_workspace_only_when_not_needed(void** state) {
  fixture* f = *state;
  int exercised_zero = 0;
  const int64_t Ls[2] = {0, L0};
  for (int li = 0; li < 2; ++li) {
    const int64_t L = Ls[li];
    const int64_t sx[2] = {L, D0}, sl[2] = {L, E0}, sk[2] = {L, K0};
    moeblaze_arg_t a[8], b[8], r[4];
    size_t n = fwd_args(f, a), nb = bwd_args(f, b), nr = 0;
    a[0].tensor.shape = sx; a[1].tensor.shape = sl; a[4].tensor.shape = sx;
    b[0].tensor.shape = sx; b[1].tensor.shape = sl; b[4].tensor.shape = sx; b[5].tensor.shape = sx;
    r[nr++] = A(MOEBLAZE_ARG_ROUTER_LOGITS, f->logits, tu_f32, 2, sl);
    r[nr++] = A(MOEBLAZE_ARG_TOPK_INDICES, f->ids, tu_i32, 2, sk);
    r[nr++] = A(MOEBLAZE_ARG_TOPK_WEIGHTS, f->gw, tu_f32, 2, sk);
    size_t need[4], saved = 0;
    for (int p = 0; p < 4; ++p) assert_ok(moeblaze_get_workspace_size(f->h, (moeblaze_pass_t)p, L, &need[p]));
    assert_ok(moeblaze_get_saved_size(f->h, L, &saved));
    assert_true(saved > 0); /* the expert offsets are always saved */
    for (int p = 0; p < 4; ++p) {
      moeblaze_status_t s_null, s_null_zero;
      if (p == MOEBLAZE_PASS_BACKWARD) {
        assert_ok(moeblaze_forward(f->h, MOEBLAZE_PASS_FORWARD_TRAINING, a, n, f->ws, f->ws_bytes, f->saved, saved, NULL));
        s_null = moeblaze_backward(f->h, b, nb, f->saved, saved, NULL, need[p], NULL);
        s_null_zero = moeblaze_backward(f->h, b, nb, f->saved, saved, NULL, 0, NULL);
      } else if (p == MOEBLAZE_PASS_ROUTE) {
        s_null = moeblaze_route(f->h, r, nr, NULL, need[p], NULL);
        s_null_zero = moeblaze_route(f->h, r, nr, NULL, 0, NULL);
      } else {
        s_null = moeblaze_forward(f->h, (moeblaze_pass_t)p, a, n, NULL, need[p], f->saved, saved, NULL);
        s_null_zero = moeblaze_forward(f->h, (moeblaze_pass_t)p, a, n, NULL, 0, f->saved, saved, NULL);
      }
      if (need[p] == 0) {
        exercised_zero = 1;
        assert_int_equal(s_null, MOEBLAZE_STATUS_SUCCESS);
        assert_int_equal(s_null_zero, MOEBLAZE_STATUS_SUCCESS);
        assert_string_equal(moeblaze_get_last_error_message(), "");
      } else {
        assert_int_equal(s_null, MOEBLAZE_STATUS_INVALID_ARGUMENT);
        assert_int_equal(s_null_zero, MOEBLAZE_STATUS_INSUFFICIENT_WORKSPACE);
        assert_true(moeblaze_get_last_error_message()[0] != '\0');
      }
    }
    /* The saved buffer is never optional for training forward and backward. */
    assert_status(moeblaze_forward(f->h, MOEBLAZE_PASS_FORWARD_TRAINING, a, n, f->ws, f->ws_bytes, NULL, saved, NULL),
                  MOEBLAZE_STATUS_INVALID_ARGUMENT);
    assert_status(moeblaze_forward(f->h, MOEBLAZE_PASS_FORWARD_TRAINING, a, n, f->ws, f->ws_bytes, NULL, 0, NULL),
                  MOEBLAZE_STATUS_INSUFFICIENT_WORKSPACE);
    assert_status(moeblaze_backward(f->h, b, nb, NULL, saved, f->ws, f->ws_bytes, NULL), MOEBLAZE_STATUS_INVALID_ARGUMENT);
    /* Inference ignores the saved buffer entirely. */
    assert_ok(moeblaze_forward(f->h, MOEBLAZE_PASS_FORWARD_INFERENCE, a, n, f->ws, f->ws_bytes, NULL, 0, NULL));
  }
  if (!exercised_zero) print_message("note: no pass needs 0 workspace bytes on this engine; the NULL-accepted branch was not reached\n");
}

/* Backward and route reject bad descriptors too, and leave their outputs untouched. */
static void backward_and_route_validate(void** state) {
  fixture* f = *state;
  moeblaze_arg_t a[8], b[10];
  size_t n = fwd_args(f, a), nb;
  assert_ok(fwd(f, a, n));
  const size_t dxb = L0 * D0 * sizeof(float);
  const int64_t inner2[2] = {2 * D0, 2}, short_x[2] = {L0 - 1, D0};
  for (int c = 0; c < 7; ++c) {
    nb = bwd_args(f, b);
    switch (c) {
      case 0: b[4].tensor.dtype = tu_bf16; break;                   /* dy dtype */
      case 1: b[5].tensor.strides = inner2; break;                  /* dx inner stride */
      case 2: b[5].tensor.shape = short_x; break;                   /* dx shape */
      case 3: b[5].tensor.device.device_type = MOEBLAZE_DEVICE_CUDA; break;
      case 4: b[nb - 1].kind = MOEBLAZE_ARG_OUTPUT; break;          /* a forward-only kind */
      case 5: b[5].flags = 0x80000000u; break;                      /* unknown flag bit */
      case 6: b[4].flags = MOEBLAZE_ARG_FLAG_ACCUMULATE; break;     /* dy is an input */
    }
    memset(f->dx, 0x3c, dxb);
    assert_status(moeblaze_backward(f->h, b, nb, f->saved, f->saved_bytes, f->ws, f->ws_bytes, NULL),
                  MOEBLAZE_STATUS_INVALID_ARGUMENT);
    assert_status(moeblaze_check_args(f->h, MOEBLAZE_PASS_BACKWARD, b, nb), MOEBLAZE_STATUS_INVALID_ARGUMENT);
    for (size_t i = 0; i < dxb; ++i) assert_int_equal(((unsigned char*)f->dx)[i], 0x3c);
    assert_true(guard_intact(f->dx, dxb));
  }
  /* GRAD_OUTPUT missing */
  nb = bwd_args(f, b);
  b[4] = b[5];
  assert_status(moeblaze_backward(f->h, b, nb - 1, f->saved, f->saved_bytes, f->ws, f->ws_bytes, NULL),
                MOEBLAZE_STATUS_INVALID_ARGUMENT);
  /* ACCUMULATE on a gradient output is valid */
  nb = bwd_args(f, b);
  b[5].flags = MOEBLAZE_ARG_FLAG_ACCUMULATE;
  memset(f->dx, 0, dxb);
  assert_ok(moeblaze_backward(f->h, b, nb, f->saved, f->saved_bytes, f->ws, f->ws_bytes, NULL));
  assert_true(guard_intact(f->dx, dxb));
  /* route */
  moeblaze_arg_t r[4];
  r[0] = A(MOEBLAZE_ARG_ROUTER_LOGITS, f->logits, tu_f32, 2, f->sl);
  r[1] = A(MOEBLAZE_ARG_TOPK_INDICES, f->ids, tu_i32, 2, f->sk);
  r[2] = A(MOEBLAZE_ARG_TOPK_WEIGHTS, f->gw, tu_f32, 2, f->sk);
  memset(f->ids, 0x3c, L0 * K0 * sizeof(int32_t));
  r[1].flags = MOEBLAZE_ARG_FLAG_ACCUMULATE; /* not a gradient output */
  assert_status(moeblaze_route(f->h, r, 3, f->ws, f->ws_bytes, NULL), MOEBLAZE_STATUS_INVALID_ARGUMENT);
  r[1].flags = 0;
  r[1].tensor.dtype = tu_f32; /* ids are I32 or I64 */
  assert_status(moeblaze_route(f->h, r, 3, f->ws, f->ws_bytes, NULL), MOEBLAZE_STATUS_INVALID_ARGUMENT);
  r[1].tensor.dtype = tu_i32;
  assert_status(moeblaze_route(f->h, r, 2, f->ws, f->ws_bytes, NULL), MOEBLAZE_STATUS_INVALID_ARGUMENT); /* no TOPK_WEIGHTS */
  r[3] = A(MOEBLAZE_ARG_ROUTER_WEIGHT, f->wg, tu_f32, 2, f->swg);
  assert_status(moeblaze_route(f->h, r, 4, f->ws, f->ws_bytes, NULL), MOEBLAZE_STATUS_INVALID_ARGUMENT); /* logits and W_g */
  for (size_t i = 0; i < L0 * K0 * sizeof(int32_t); ++i) assert_int_equal(((unsigned char*)f->ids)[i], 0x3c);
  assert_true(guard_intact(f->ids, L0 * K0 * sizeof(int32_t)));
  assert_ok(moeblaze_route(f->h, r, 3, f->ws, f->ws_bytes, NULL));
  assert_true(guard_intact(f->ids, L0 * K0 * sizeof(int32_t)));
  assert_true(guard_intact(f->gw, L0 * K0 * sizeof(float)));
  /* L > MAX_TOKENS and inconsistent L between tensors */
  const int64_t big[2] = {MAXL + 1, E0}, other[2] = {L0 + 1, E0};
  r[0].tensor.shape = big;
  assert_status(moeblaze_check_args(f->h, MOEBLAZE_PASS_ROUTE, r, 3), MOEBLAZE_STATUS_INVALID_ARGUMENT);
  r[0].tensor.shape = other;
  assert_status(moeblaze_check_args(f->h, MOEBLAZE_PASS_ROUTE, r, 3), MOEBLAZE_STATUS_INVALID_ARGUMENT);
}

/* The saved buffer's last use: the same results as backward, bit for bit; the buffer is then
 * spent, and a later backward on it is refused with that reason (and writes nothing) until a
 * training forward writes it again. Its workspace query exists and is at most backward's. */
static void backward_last_use(void** state) {
  fixture* f = *state;
  moeblaze_arg_t a[8], b[10];
  const size_t n = fwd_args(f, a), nb = bwd_args(f, b);
  const size_t dxb = L0 * D0 * sizeof(float);
  size_t wb = 0, wl = 0;
  assert_ok(moeblaze_get_workspace_size(f->h, MOEBLAZE_PASS_BACKWARD, L0, &wb));
  assert_ok(moeblaze_get_workspace_size(f->h, MOEBLAZE_PASS_BACKWARD_LAST_USE, L0, &wl));
  assert_true(wl <= wb);
  assert_status(moeblaze_get_workspace_size(f->h, (moeblaze_pass_t)(MOEBLAZE_PASS_BACKWARD_LAST_USE + 1), L0, &wl),
                MOEBLAZE_STATUS_INVALID_ARGUMENT);
  assert_ok(moeblaze_check_args(f->h, MOEBLAZE_PASS_BACKWARD_LAST_USE, b, nb));
  assert_status(moeblaze_forward(f->h, MOEBLAZE_PASS_BACKWARD_LAST_USE, a, n, f->ws, f->ws_bytes, f->saved,
                                 f->saved_bytes, NULL), MOEBLAZE_STATUS_INVALID_ARGUMENT);
  float* plain = tu_alloc_bytes(dxb);
  assert_ok(fwd(f, a, n));
  assert_ok(moeblaze_backward(f->h, b, nb, f->saved, f->saved_bytes, f->ws, f->ws_bytes, NULL));
  memcpy(plain, f->dx, dxb);
  assert_ok(moeblaze_backward(f->h, b, nb, f->saved, f->saved_bytes, f->ws, f->ws_bytes, NULL)); /* still readable */
  assert_memory_equal(plain, f->dx, dxb);
  memset(f->dx, 0x3c, dxb);
  assert_ok(moeblaze_backward_last_use(f->h, b, nb, f->saved, f->saved_bytes, f->ws, wb, NULL));
  assert_memory_equal(plain, f->dx, dxb);
  assert_true(guard_intact(f->dx, dxb));
  for (int rep = 0; rep < 2; ++rep) {
    memset(f->dx, 0x3c, dxb);
    const moeblaze_status_t st = rep ? moeblaze_backward_last_use(f->h, b, nb, f->saved, f->saved_bytes, f->ws, wb, NULL)
                                     : moeblaze_backward(f->h, b, nb, f->saved, f->saved_bytes, f->ws, wb, NULL);
    assert_status(st, MOEBLAZE_STATUS_INVALID_ARGUMENT);
    assert_non_null(strstr(moeblaze_get_last_error_message(), "spent"));
    for (size_t i = 0; i < dxb; ++i) assert_int_equal(((unsigned char*)f->dx)[i], 0x3c);
  }
  assert_ok(fwd(f, a, n)); /* a training forward makes it readable again */
  assert_ok(moeblaze_backward_last_use(f->h, b, nb, f->saved, f->saved_bytes, f->ws, wb, NULL));
  assert_memory_equal(plain, f->dx, dxb);
  /* An input inside the saved buffer: read-only for backward, written over by its last use. */
  assert_true(f->saved_bytes >= dxb + 256);
  assert_ok(fwd(f, a, n));
  moeblaze_arg_t in_saved[10];
  memcpy(in_saved, b, nb * sizeof b[0]);
  in_saved[4].tensor.data = (char*)f->saved + f->saved_bytes - dxb; /* dy */
  assert_status(moeblaze_check_args(f->h, MOEBLAZE_PASS_BACKWARD_LAST_USE, in_saved, nb), MOEBLAZE_STATUS_SUCCESS);
  assert_status(moeblaze_backward_last_use(f->h, in_saved, nb, f->saved, f->saved_bytes, f->ws, wb, NULL),
                MOEBLAZE_STATUS_INVALID_ARGUMENT);
  assert_ok(moeblaze_backward(f->h, in_saved, nb, f->saved, f->saved_bytes, f->ws, wb, NULL));
  tu_free(plain);
}

static void* error_in_thread(void* p) {
  (void)p;
  moeblaze_status_t s = moeblaze_config_create(NULL);
  const char* msg = moeblaze_get_last_error_message();
  return (void*)(intptr_t)(s == MOEBLAZE_STATUS_INVALID_ARGUMENT && msg[0] != '\0');
}

static void* message_is_empty(void* p) {
  (void)p;
  return (void*)(intptr_t)(moeblaze_get_last_error_message()[0] == '\0');
}

static void messages_are_thread_local(void** state) {
  (void)state;
  int32_t n;
  assert_ok(moeblaze_get_device_count(MOEBLAZE_DEVICE_CPU, &n)); /* clears this thread's message */
  pthread_t th;
  void* ok = NULL;
  assert_int_equal(pthread_create(&th, NULL, error_in_thread, NULL), 0);
  pthread_join(th, &ok);
  assert_true(ok != NULL);
  assert_string_equal(moeblaze_get_last_error_message(), ""); /* the other thread's error is not ours */
  /* and ours is not theirs: a fresh thread starts with "" while this one holds an error */
  assert_status(moeblaze_get_saved_size(NULL, 1, NULL), MOEBLAZE_STATUS_INVALID_ARGUMENT);
  char mine[512];
  strncpy(mine, moeblaze_get_last_error_message(), sizeof mine - 1);
  mine[sizeof mine - 1] = '\0';
  void* empty = NULL;
  assert_int_equal(pthread_create(&th, NULL, message_is_empty, NULL), 0);
  pthread_join(th, &empty);
  assert_true(empty != NULL);
  assert_int_equal(pthread_create(&th, NULL, error_in_thread, NULL), 0);
  pthread_join(th, &ok);
  assert_true(ok != NULL);
  assert_string_equal(moeblaze_get_last_error_message(), mine);
}

static void destroy_keeps_the_message(void** state) {
  (void)state;
  moeblaze_config_t cfg;
  assert_ok(moeblaze_config_create(&cfg));
  assert_status(moeblaze_config_set_i64(cfg, MOEBLAZE_ATTR_TOP_K, -5), MOEBLAZE_STATUS_INVALID_ARGUMENT);
  char before[512];
  strncpy(before, moeblaze_get_last_error_message(), sizeof before - 1);
  before[sizeof before - 1] = '\0';
  assert_ok(moeblaze_config_destroy(cfg));
  assert_ok(moeblaze_destroy(NULL));
  assert_string_equal(moeblaze_get_last_error_message(), before);
}

typedef struct log_capture { int calls; int32_t level; char func[64]; char msg[512]; } log_capture;
static void capture(void* user, int32_t level, const char* func, const char* msg) {
  log_capture* c = user;
  c->calls++;
  c->level = level;
  strncpy(c->func, func, sizeof c->func - 1);
  strncpy(c->msg, msg, sizeof c->msg - 1);
}

static void log_callback(void** state) {
  (void)state;
  log_capture c;
  memset(&c, 0, sizeof c);
  const int32_t bad_levels[] = {-1, 5, 9, INT32_MIN, INT32_MAX};
  for (size_t i = 0; i < sizeof bad_levels / sizeof bad_levels[0]; ++i)
    assert_status(moeblaze_set_log_callback(capture, &c, bad_levels[i]), MOEBLAZE_STATUS_INVALID_ARGUMENT);
  assert_int_equal(c.calls, 0); /* a rejected installation installs nothing */
  /* min_level 0 installs the callback but delivers nothing (errors are level 1). */
  assert_ok(moeblaze_set_log_callback(capture, &c, 0));
  assert_status(moeblaze_config_create(NULL), MOEBLAZE_STATUS_INVALID_ARGUMENT);
  assert_int_equal(c.calls, 0);
  assert_ok(moeblaze_set_log_callback(capture, &c, MOEBLAZE_LOG_ERROR));
  assert_status(moeblaze_config_create(NULL), MOEBLAZE_STATUS_INVALID_ARGUMENT);
  assert_int_equal(c.calls, 1);
  assert_int_equal(c.level, MOEBLAZE_LOG_ERROR);
  assert_string_equal(c.func, "moeblaze_config_create");
  assert_string_equal(c.msg, moeblaze_get_last_error_message());
  /* a successful call logs nothing at ERROR; another failing entry point names itself */
  int32_t n;
  assert_ok(moeblaze_get_device_count(MOEBLAZE_DEVICE_CPU, &n));
  assert_int_equal(c.calls, 1);
  assert_ok(moeblaze_set_log_callback(capture, &c, MOEBLAZE_LOG_DEBUG));
  const int before = c.calls;
  assert_status(moeblaze_get_device_count(MOEBLAZE_DEVICE_CPU, NULL), MOEBLAZE_STATUS_INVALID_ARGUMENT);
  assert_true(c.calls > before);
  assert_int_equal(c.level, MOEBLAZE_LOG_ERROR);
  assert_string_equal(c.func, "moeblaze_get_device_count");
  assert_string_equal(c.msg, moeblaze_get_last_error_message());
  const int after = c.calls;
  assert_ok(moeblaze_set_log_callback(NULL, NULL, 0));
  assert_status(moeblaze_config_create(NULL), MOEBLAZE_STATUS_INVALID_ARGUMENT);
  assert_int_equal(c.calls, after); /* removed */
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test_setup_teardown(valid_call_succeeds_and_clears_the_message, setup, teardown),
      cmocka_unit_test_setup_teardown(null_pointers, setup, teardown),
      cmocka_unit_test_setup_teardown(every_entry_point_rejects_null, setup, teardown),
      cmocka_unit_test_setup_teardown(null_workspace_only_when_not_needed, setup, teardown),
      cmocka_unit_test_setup_teardown(backward_and_route_validate, setup, teardown),
      cmocka_unit_test_setup_teardown(backward_last_use, setup, teardown),
      cmocka_unit_test(bad_create),
      cmocka_unit_test(no_gpu_here),
      cmocka_unit_test_setup_teardown(wrong_dtype_shape_stride_device, setup, teardown),
      cmocka_unit_test_setup_teardown(tokens_and_buffers, setup, teardown),
      cmocka_unit_test_setup_teardown(zero_tokens, setup, teardown),
      cmocka_unit_test_setup_teardown(caller_ids_are_validated, setup, teardown),
      cmocka_unit_test_setup_teardown(assert_status_on_cpu, setup, teardown),
      cmocka_unit_test_setup_teardown(argument_list_rules, setup, teardown),
      cmocka_unit_test(messages_are_thread_local),
      cmocka_unit_test(destroy_keeps_the_message),
      cmocka_unit_test(log_callback),
  };
  return cmocka_run_group_tests_name("api_contract", tests, NULL, NULL);
}
