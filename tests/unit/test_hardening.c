/* Hostile input on the CPU engine, one regression test per finding:
 *  - a saved buffer that forward did not write (zeros, 0xFF, random bytes, another handle's,
 *    another L, a torn header, each kind of corrupted routing plan) gets INVALID_ARGUMENT
 *    from backward, which then writes nothing (before: heap overflow under ASan, or SUCCESS
 *    with garbage gradients);
 *  - descriptors whose byte_offset or strides leave the address space, or whose outputs alias
 *    another argument, are rejected (before: a crash, or silent acceptance);
 *  - NaN and infinite router logits follow the documented ranking rule (ids always valid and
 *    distinct, nothing dropped), and NaN caller weights reach only their token's output;
 *  - the STATUS argument (the sync-free error contract) on an engine that checks on the host. */
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

enum { L0 = 9, E0 = 5, K0 = 2, D0 = 8, H0 = 12 };

static uint64_t A(uint64_t x) { return (x + 255u) / 256u * 256u; }

typedef struct fixture {
  moeblaze_handle_t h;
  ms_problem p;
} fixture;

static moeblaze_handle_t make_handle(int64_t activation, int64_t score_fn, int64_t normalize) {
  tu_layer l = tu_layer_default(E0, K0, D0, H0, 64, activation);
  l.score_fn = score_fn;
  l.normalize = normalize;
  moeblaze_handle_t h = NULL;
  if (tu_create_cpu(&l, &h) != MOEBLAZE_STATUS_SUCCESS) return NULL;
  return h;
}

static int setup(void** state) {
  fixture* f = calloc(1, sizeof *f);
  f->h = make_handle(MOEBLAZE_ACTIVATION_SWIGLU, MOEBLAZE_SCORE_SOFTMAX, 1);
  if (!f->h) return -1;
  ms_init(&f->p, f->h, L0, E0, K0, D0, H0, 1, tu_fresh_seed("hardening"));
  *state = f;
  return 0;
}
static int teardown(void** state) {
  fixture* f = *state;
  ms_free(&f->p);
  moeblaze_destroy(f->h);
  free(f);
  return 0;
}

/* Backward must fail with INVALID_ARGUMENT and leave every gradient's poisoned bytes alone. */
static void expect_backward_rejected(fixture* f, const char* what) {
  ms_problem* p = &f->p;
  const size_t dxb = (size_t)(p->L * p->d) * 4, dwb = (size_t)(p->E * p->d * p->gh) * 4;
  memset(p->dx, 0x3c, dxb);
  memset(p->dwgu, 0x3c, dwb);
  const moeblaze_status_t s = ms_backward(f->h, p);
  if (s != MOEBLAZE_STATUS_INVALID_ARGUMENT)
    fail_msg("%s: backward returned %s (%s), want INVALID_ARGUMENT", what, moeblaze_status_name(s),
             moeblaze_get_last_error_message());
  if (strstr(moeblaze_get_last_error_message(), "saved") == NULL)
    fail_msg("%s: the message does not name the saved buffer: %s", what, moeblaze_get_last_error_message());
  for (size_t i = 0; i < dxb; ++i)
    if (((unsigned char*)p->dx)[i] != 0x3c) fail_msg("%s: dx byte %zu was written", what, i);
  for (size_t i = 0; i < dwb; ++i)
    if (((unsigned char*)p->dwgu)[i] != 0x3c) fail_msg("%s: dW_gate_up byte %zu was written", what, i);
  assert_true(ms_guards_intact(p));
}

static void garbage_saved_buffers(void** state) {
  fixture* f = *state;
  ms_problem* p = &f->p;
  /* never written */
  memset(p->saved, 0, p->saved_bytes);
  expect_backward_rejected(f, "zeroed saved buffer");
  memset(p->saved, 0xff, p->saved_bytes);
  expect_backward_rejected(f, "0xFF saved buffer");
  tu_rng r;
  tu_rng_seed(&r, tu_fresh_seed("garbage_saved"));
  for (int rep = 0; rep < 20; ++rep) {
    for (size_t i = 0; i < p->saved_bytes; ++i) ((unsigned char*)p->saved)[i] = (unsigned char)tu_rng_next(&r);
    expect_backward_rejected(f, "random saved buffer");
  }
  /* a valid forward, then a torn header: every header byte flipped in turn */
  assert_ok(ms_forward(f->h, p));
  assert_ok(ms_backward(f->h, p));
  for (size_t b = 0; b < 40; ++b) {
    ((unsigned char*)p->saved)[b] ^= 0x10;
    expect_backward_rejected(f, "header byte flipped");
    ((unsigned char*)p->saved)[b] ^= 0x10;
  }
  assert_ok(ms_backward(f->h, p));
}

static void foreign_saved_buffers(void** state) {
  fixture* f = *state;
  ms_problem* p = &f->p;
  /* written by a handle with another activation (same L, buffer big enough for both) */
  moeblaze_handle_t other = make_handle(MOEBLAZE_ACTIVATION_GEGLU, MOEBLAZE_SCORE_SOFTMAX, 1);
  assert_non_null(other);
  moeblaze_arg_t a[8];
  const size_t n = ms_forward_args(p, a);
  assert_ok(moeblaze_forward(other, MOEBLAZE_PASS_FORWARD_TRAINING, a, n, p->ws, p->ws_bytes, p->saved, p->saved_bytes, NULL));
  expect_backward_rejected(f, "saved buffer of another configuration");
  moeblaze_destroy(other);
  /* written for fewer tokens by this handle */
  const int64_t Ls[2] = {L0 - 3, D0}, Ll[2] = {L0 - 3, E0}, Lk[2] = {L0 - 3, K0};
  a[0].tensor.shape = Ls; a[1].tensor.shape = Ll; a[4].tensor.shape = Ls; a[5].tensor.shape = Lk;
  assert_ok(moeblaze_forward(f->h, MOEBLAZE_PASS_FORWARD_TRAINING, a, n, p->ws, p->ws_bytes, p->saved, p->saved_bytes, NULL));
  expect_backward_rejected(f, "saved buffer written for another L");
  assert_ok(ms_forward(f->h, p));
  assert_ok(ms_backward(f->h, p));
}

/* A valid header over a corrupted plan: each rule of the plan check. */
static void corrupted_plans(void** state) {
  fixture* f = *state;
  ms_problem* p = &f->p;
  const uint64_t Lk = (uint64_t)(L0 * K0), R = A(4 * Lk);
  char* base = p->saved;
  int32_t* tei = (int32_t*)(base + 256);
  int32_t* eti = (int32_t*)(base + 256 + 2 * R);
  int32_t* tim = (int32_t*)(base + 256 + 3 * R);
  int32_t* off = (int32_t*)(base + 256 + 4 * R);
  struct { int32_t* at; int32_t value; const char* what; } cases[] = {
      {&off[0], 1, "offsets[0] != 0"},
      {&off[2], -5, "offsets decrease"},
      {&off[E0], L0 * K0 + 7, "offsets[E] != L k"},
      {&off[E0], 1 << 30, "offsets[E] huge"},
      {&tei[3], E0, "expert id = E"},
      {&tei[3], -1, "expert id < 0"},
      {&tei[1], 0, "expert id repeated in a token (tei[0] is set to 0 too)"},
      {&tim[4], -1, "token_index_map < 0"},
      {&tim[4], L0 * K0, "token_index_map = L k"},
      {&tim[4], 0x7fffffff, "token_index_map huge"},
      {&eti[0], L0 + 100, "expert_token_indices out of range"},
      {&eti[0], -7, "expert_token_indices negative"},
  };
  for (size_t c = 0; c < sizeof cases / sizeof cases[0]; ++c) {
    assert_ok(ms_forward(f->h, p));
    if (c == 6) tei[0] = 0;
    const int32_t keep = *cases[c].at;
    if (keep == cases[c].value) *cases[c].at = cases[c].value + 1; /* still invalid for these rules */
    else *cases[c].at = cases[c].value;
    expect_backward_rejected(f, cases[c].what);
  }
  /* two slots swapped in token_index_map: every index in range, but not the plan's bijection */
  assert_ok(ms_forward(f->h, p));
  int32_t t = tim[0]; tim[0] = tim[2]; tim[2] = t;
  expect_backward_rejected(f, "token_index_map permuted");
  /* two tokens of one expert swapped, both lists kept consistent: a bijection still, but the
   * tokens no longer ascend within the expert (windows of tokens rely on the order) */
  assert_ok(ms_forward(f->h, p));
  int swapped = 0;
  for (int32_t e = 0; e < E0 && !swapped; ++e) {
    if (off[e + 1] - off[e] < 2) continue;
    const int32_t q = off[e], ta = eti[q], tb = eti[q + 1];
    for (int32_t j = 0; j < K0; ++j) {
      if (tim[ta * K0 + j] == q) tim[ta * K0 + j] = q + 1;
      if (tim[tb * K0 + j] == q + 1) tim[tb * K0 + j] = q;
    }
    eti[q] = tb;
    eti[q + 1] = ta;
    swapped = 1;
  }
  assert_true(swapped);
  expect_backward_rejected(f, "tokens out of order within an expert");
  assert_ok(ms_forward(f->h, p));
  assert_ok(ms_backward(f->h, p));
}

/* ---- descriptors ---- */
static void byte_offsets_and_strides(void** state) {
  fixture* f = *state;
  ms_problem* p = &f->p;
  moeblaze_arg_t a[8];
  const size_t n = ms_forward_args(p, a);
  const uint64_t bad_offsets[] = {(uint64_t)1 << 62, ~(uint64_t)0, ~(uint64_t)0 - 255, (uint64_t)INT64_MAX, 2};
  for (size_t i = 0; i < sizeof bad_offsets / sizeof bad_offsets[0]; ++i)
    for (size_t which = 0; which < n; ++which) {
      moeblaze_arg_t b[8];
      memcpy(b, a, sizeof b);
      b[which].tensor.byte_offset = bad_offsets[i];
      assert_status(moeblaze_check_args(f->h, MOEBLAZE_PASS_FORWARD_TRAINING, b, n), MOEBLAZE_STATUS_INVALID_ARGUMENT);
      assert_status(moeblaze_forward(f->h, MOEBLAZE_PASS_FORWARD_TRAINING, b, n, p->ws, p->ws_bytes, p->saved, p->saved_bytes, NULL),
                    MOEBLAZE_STATUS_INVALID_ARGUMENT);
    }
  /* strides whose extent overflows */
  const int64_t huge[2] = {(int64_t)1 << 62, 1}, neg[2] = {-8, 1};
  a[0].tensor.strides = huge;
  assert_status(moeblaze_check_args(f->h, MOEBLAZE_PASS_FORWARD_TRAINING, a, n), MOEBLAZE_STATUS_INVALID_ARGUMENT);
  a[0].tensor.strides = neg;
  assert_status(moeblaze_check_args(f->h, MOEBLAZE_PASS_FORWARD_TRAINING, a, n), MOEBLAZE_STATUS_INVALID_ARGUMENT);
  a[0].tensor.strides = NULL;
  /* a valid byte_offset into a larger buffer is honoured */
  float* big = tu_alloc(tu_f32, (size_t)(L0 * D0 + 16));
  memcpy(big + 16, p->x, (size_t)(L0 * D0) * 4);
  a[0].tensor.data = big;
  a[0].tensor.byte_offset = 64;
  float* y2 = tu_alloc(tu_f32, (size_t)(L0 * D0));
  a[4].tensor.data = y2;
  assert_ok(moeblaze_forward(f->h, MOEBLAZE_PASS_FORWARD_TRAINING, a, n, p->ws, p->ws_bytes, p->saved, p->saved_bytes, NULL));
  assert_ok(ms_forward(f->h, p));
  assert_memory_equal(y2, p->y, (size_t)(L0 * D0) * 4);
  tu_free(big);
  tu_free(y2);
}

static void aliasing_outputs(void** state) {
  fixture* f = *state;
  ms_problem* p = &f->p;
  moeblaze_arg_t a[8], b[10];
  const size_t n = ms_forward_args(p, a);
  const size_t nb = ms_backward_args(p, b);
  /* forward: y over x (in place), y half over x, ids over logits, two outputs on one buffer */
  struct { int out, in; size_t byte_shift; const char* what; } fc[] = {
      {4, 0, 0, "OUTPUT == INPUT"}, {4, 0, 4 * D0, "OUTPUT overlaps INPUT by all but a row"},
      {5, 1, 0, "TOPK_INDICES over ROUTER_LOGITS"}, {6, 4, 0, "TOKENS_PER_EXPERT over OUTPUT"},
      {4, 2, 0, "OUTPUT over W_GATE_UP"}};
  for (size_t c = 0; c < sizeof fc / sizeof fc[0]; ++c) {
    moeblaze_arg_t t[8];
    memcpy(t, a, sizeof t);
    t[fc[c].out].tensor.data = (char*)t[fc[c].in].tensor.data + fc[c].byte_shift;
    memset(p->x, 0, 0);
    const moeblaze_status_t s = moeblaze_check_args(f->h, MOEBLAZE_PASS_FORWARD_TRAINING, t, n);
    if (s != MOEBLAZE_STATUS_INVALID_ARGUMENT) fail_msg("%s accepted", fc[c].what);
    assert_non_null(strstr(moeblaze_get_last_error_message(), "overlap"));
  }
  /* backward: dx over dy, dW_down over dW_gate_up, d logits over logits */
  assert_ok(ms_forward(f->h, p));
  struct { int out, in; const char* what; } bc[] = {
      {5, 4, "GRAD_INPUT == GRAD_OUTPUT"}, {7, 6, "GRAD_W_DOWN over GRAD_W_GATE_UP"}, {8, 1, "GRAD_ROUTER_LOGITS over ROUTER_LOGITS"}};
  for (size_t c = 0; c < sizeof bc / sizeof bc[0]; ++c) {
    moeblaze_arg_t t[10];
    memcpy(t, b, sizeof t);
    t[bc[c].out].tensor.data = t[bc[c].in].tensor.data;
    const moeblaze_status_t s = moeblaze_backward(f->h, t, nb, p->saved, p->saved_bytes, p->ws, p->ws_bytes, NULL);
    if (s != MOEBLAZE_STATUS_INVALID_ARGUMENT) fail_msg("%s accepted", bc[c].what);
  }
  /* inputs may share memory: x doubles as dy */
  b[4].tensor.data = p->x;
  assert_ok(moeblaze_backward(f->h, b, nb, p->saved, p->saved_bytes, p->ws, p->ws_bytes, NULL));
}

/* An output placed inside the call's own workspace or saved buffer (or an input inside the
 * workspace, which the call overwrites) is refused before anything is written: the combine
 * would otherwise follow plan indices that the output had overwritten. */
static void arguments_inside_call_buffers(void** state) {
  fixture* f = *state;
  ms_problem* p = &f->p;
  moeblaze_arg_t a[8], b[10];
  const size_t n = ms_forward_args(p, a);
  const size_t nb = ms_backward_args(p, b);
  assert_true(p->saved_bytes >= 64 && p->ws_bytes >= 64);
  char* saved = p->saved;
  char* ws = p->ws;
  /* forward: {argument index, buffer, byte shift} */
  struct { int arg; char* buf; size_t shift; const char* what; } fc[] = {
      {4, saved, 0, "OUTPUT at the start of the saved buffer"},
      {4, saved, p->saved_bytes - 4, "OUTPUT over the saved buffer's last bytes"},
      {4, ws, 0, "OUTPUT inside the workspace"},
      {5, saved, 0, "TOPK_INDICES inside the saved buffer"},
      {6, ws, 0, "TOKENS_PER_EXPERT inside the workspace"},
      {0, ws, 0, "INPUT inside the workspace"}};
  for (size_t c = 0; c < sizeof fc / sizeof fc[0]; ++c) {
    moeblaze_arg_t t[8];
    memcpy(t, a, sizeof t);
    t[fc[c].arg].tensor.data = fc[c].buf + fc[c].shift;
    memset(saved, 0x3c, p->saved_bytes);
    const moeblaze_status_t s =
        moeblaze_forward(f->h, MOEBLAZE_PASS_FORWARD_TRAINING, t, n, p->ws, p->ws_bytes, p->saved, p->saved_bytes, NULL);
    if (s != MOEBLAZE_STATUS_INVALID_ARGUMENT) fail_msg("forward: %s accepted (%s)", fc[c].what, moeblaze_status_name(s));
    if (!strstr(moeblaze_get_last_error_message(), "overlap")) fail_msg("%s: %s", fc[c].what, moeblaze_get_last_error_message());
    for (size_t i = 0; i < p->saved_bytes; ++i)
      if ((unsigned char)saved[i] != 0x3c) fail_msg("forward: %s: saved byte %zu was written", fc[c].what, i);
  }
  /* the workspace and the saved buffer may not overlap each other */
  assert_status(moeblaze_forward(f->h, MOEBLAZE_PASS_FORWARD_TRAINING, a, n, p->saved, p->ws_bytes, p->saved,
                                 p->saved_bytes, NULL), MOEBLAZE_STATUS_INVALID_ARGUMENT);
  /* backward: gradients inside the saved buffer or the workspace, dy inside the workspace */
  assert_ok(ms_forward(f->h, p));
  struct { int arg; char* buf; const char* what; } bc[] = {
      {5, saved, "GRAD_INPUT inside the saved buffer"}, {6, saved, "GRAD_W_GATE_UP inside the saved buffer"},
      {5, ws, "GRAD_INPUT inside the workspace"}, {4, ws, "GRAD_OUTPUT inside the workspace"}};
  for (size_t c = 0; c < sizeof bc / sizeof bc[0]; ++c) {
    moeblaze_arg_t t[10];
    memcpy(t, b, sizeof t);
    t[bc[c].arg].tensor.data = bc[c].buf;
    const moeblaze_status_t s = moeblaze_backward(f->h, t, nb, p->saved, p->saved_bytes, p->ws, p->ws_bytes, NULL);
    if (s != MOEBLAZE_STATUS_INVALID_ARGUMENT) fail_msg("backward: %s accepted (%s)", bc[c].what, moeblaze_status_name(s));
    if (!strstr(moeblaze_get_last_error_message(), "overlap")) fail_msg("%s: %s", bc[c].what, moeblaze_get_last_error_message());
  }
  assert_status(moeblaze_backward(f->h, b, nb, p->saved, p->saved_bytes, p->saved, p->ws_bytes, NULL),
                MOEBLAZE_STATUS_INVALID_ARGUMENT);
  /* the saved buffer survived every refusal: backward still runs on it */
  assert_ok(ms_backward(f->h, p));
  /* route: an output inside the workspace */
  const int64_t sk[2] = {L0, K0};
  float gw[L0 * K0];
  moeblaze_arg_t r[3] = {a[1], a[5], tu_arg(MOEBLAZE_ARG_TOPK_WEIGHTS, tu_tensor(gw, tu_f32, 2, sk))};
  r[1].tensor.data = ws;
  assert_status(moeblaze_route(f->h, r, 3, p->ws, p->ws_bytes, NULL), MOEBLAZE_STATUS_INVALID_ARGUMENT);
  assert_true(ms_guards_intact(p));
}

/* ---- non-finite router inputs ---- */
static void route_ids(moeblaze_handle_t h, float* logits, int64_t L, int32_t* ids, float* gates, int32_t* tpe) {
  const int64_t sl[2] = {L, E0}, sk[2] = {L, K0}, se[1] = {E0};
  moeblaze_arg_t r[4] = {tu_arg(MOEBLAZE_ARG_ROUTER_LOGITS, tu_tensor(logits, tu_f32, 2, sl)),
                         tu_arg(MOEBLAZE_ARG_TOPK_INDICES, tu_tensor(ids, tu_i32, 2, sk)),
                         tu_arg(MOEBLAZE_ARG_TOPK_WEIGHTS, tu_tensor(gates, tu_f32, 2, sk)),
                         tu_arg(MOEBLAZE_ARG_TOKENS_PER_EXPERT, tu_tensor(tpe, tu_i32, 1, se))};
  size_t ws = 0;
  assert_ok(moeblaze_get_workspace_size(h, MOEBLAZE_PASS_ROUTE, L, &ws));
  void* w = tu_alloc_bytes(ws);
  assert_ok(moeblaze_route(h, r, 4, w, ws, NULL));
  tu_free(w);
}

static void non_finite_logits(void** state) {
  (void)state;
  const float nan = NAN, inf = INFINITY;
  enum { L = 6 };
  /* rows: all NaN; one NaN; one +inf; all -inf; mixed; finite */
  float logits[L * E0] = {nan, nan, nan, nan, nan,   0.5f, nan, 2.f, 1.f, 0.f,   0.f, 1.f, inf, 3.f, 2.f,
                          -inf, -inf, -inf, -inf, -inf,   nan, -inf, 1.f, inf, -2.f,   0.1f, 0.4f, 0.3f, 0.2f, 0.0f};
  /* softmax: any NaN, any +inf or an all -inf row makes every score NaN -> the lowest ids */
  const int32_t want_softmax[L * K0] = {0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 1, 2};
  /* sigmoid: scores rank directly; NaN below -inf, ties to the lower id */
  const int32_t want_sigmoid[L * K0] = {0, 1, 2, 3, 2, 3, 0, 1, 3, 2, 1, 2};
  for (int fn = 0; fn < 2; ++fn) {
    moeblaze_handle_t h = make_handle(MOEBLAZE_ACTIVATION_SILU, fn ? MOEBLAZE_SCORE_SIGMOID : MOEBLAZE_SCORE_SOFTMAX, 0);
    assert_non_null(h);
    int32_t ids[L * K0], tpe[E0];
    float gates[L * K0];
    route_ids(h, logits, L, ids, gates, tpe);
    const int32_t* want = fn ? want_sigmoid : want_softmax;
    int64_t total = 0;
    for (int e = 0; e < E0; ++e) total += tpe[e];
    assert_int_equal(total, L * K0); /* nothing dropped */
    for (int i = 0; i < L * K0; ++i)
      if (ids[i] != want[i]) fail_msg("%s: ids[%d] = %d, want %d", fn ? "sigmoid" : "softmax", i, ids[i], want[i]);
    assert_true(isnan(gates[0]) && isnan(gates[1]));        /* all-NaN row: NaN gates */
    assert_true(isfinite(gates[10]) && isfinite(gates[11])); /* finite row: finite gates */
    /* the same ids on every run */
    int32_t again[L * K0];
    route_ids(h, logits, L, again, gates, tpe);
    assert_memory_equal(again, ids, sizeof ids);
    moeblaze_destroy(h);
  }
}

static void nan_caller_weights_stay_in_their_token(void** state) {
  fixture* f = *state;
  ms_problem* p = &f->p;
  float gw[L0 * K0];
  int32_t ids[L0 * K0];
  for (int t = 0; t < L0; ++t)
    for (int j = 0; j < K0; ++j) { ids[t * K0 + j] = (t + j) % E0; gw[t * K0 + j] = 0.5f; }
  gw[2 * K0 + 1] = NAN;
  gw[5 * K0] = INFINITY;
  moeblaze_arg_t a[8];
  size_t n = 0;
  a[n++] = tu_arg(MOEBLAZE_ARG_INPUT, tu_tensor(p->x, tu_f32, 2, p->sx));
  a[n++] = tu_arg(MOEBLAZE_ARG_W_GATE_UP, tu_tensor(p->wgu, tu_f32, 3, p->sw));
  a[n++] = tu_arg(MOEBLAZE_ARG_W_DOWN, tu_tensor(p->wd, tu_f32, 3, p->sd));
  a[n++] = tu_arg(MOEBLAZE_ARG_OUTPUT, tu_tensor(p->y, tu_f32, 2, p->sx));
  a[n++] = tu_arg(MOEBLAZE_ARG_TOPK_INDICES, tu_tensor(ids, tu_i32, 2, p->sk));
  a[n++] = tu_arg(MOEBLAZE_ARG_TOPK_WEIGHTS, tu_tensor(gw, tu_f32, 2, p->sk));
  assert_ok(moeblaze_forward(f->h, MOEBLAZE_PASS_FORWARD_INFERENCE, a, n, p->ws, p->ws_bytes, NULL, 0, NULL));
  for (int t = 0; t < L0; ++t)
    for (int c = 0; c < D0; ++c) {
      const float v = p->y[t * D0 + c];
      if (t == 2 && !isnan(v)) fail_msg("y[2][%d] = %g: a NaN gate must reach its token's output", c, v);
      if (t != 2 && t != 5 && !isfinite(v)) fail_msg("y[%d][%d] = %g: a non-finite gate leaked into another token", t, c, v);
    }
}

/* MOEBLAZE_ARG_STATUS: an I32 scalar every pass accepts; this engine checks on the host, so a
 * successful call writes 0 and a failing call writes nothing, STATUS included. */
static void status_argument(void** state) {
  fixture* f = *state;
  ms_problem* p = &f->p;
  int32_t status = 0x5a5a5a5a;
  moeblaze_arg_t a[10], b[12];
  size_t n = ms_forward_args(p, a), nb = ms_backward_args(p, b);
  a[n++] = tu_arg(MOEBLAZE_ARG_STATUS, tu_tensor(&status, tu_i32, 0, NULL));
  assert_ok(moeblaze_forward(f->h, MOEBLAZE_PASS_FORWARD_TRAINING, a, n, p->ws, p->ws_bytes, p->saved, p->saved_bytes, NULL));
  assert_int_equal(status, 0);
  status = 0x5a5a5a5a;
  b[nb++] = a[n - 1];
  assert_ok(moeblaze_backward(f->h, b, nb, p->saved, p->saved_bytes, p->ws, p->ws_bytes, NULL));
  assert_int_equal(status, 0);
  /* a rejected backward (zeroed saved buffer) leaves STATUS alone */
  status = 0x5a5a5a5a;
  memset(p->saved, 0, p->saved_bytes);
  assert_status(moeblaze_backward(f->h, b, nb, p->saved, p->saved_bytes, p->ws, p->ws_bytes, NULL), MOEBLAZE_STATUS_INVALID_ARGUMENT);
  assert_int_equal(status, 0x5a5a5a5a);
  /* route reports too */
  const int64_t sk[2] = {L0, K0};
  float gw[L0 * K0];
  moeblaze_arg_t r[4] = {a[1], a[5], tu_arg(MOEBLAZE_ARG_TOPK_WEIGHTS, tu_tensor(gw, tu_f32, 2, sk)), a[n - 1]};
  assert_ok(moeblaze_route(f->h, r, 4, p->ws, p->ws_bytes, NULL));
  assert_int_equal(status, 0);
  /* only an I32 scalar */
  float fstatus;
  int32_t two[2];
  const int64_t s2[1] = {2};
  a[n - 1] = tu_arg(MOEBLAZE_ARG_STATUS, tu_tensor(&fstatus, tu_f32, 0, NULL));
  assert_status(moeblaze_check_args(f->h, MOEBLAZE_PASS_FORWARD_TRAINING, a, n), MOEBLAZE_STATUS_INVALID_ARGUMENT);
  a[n - 1] = tu_arg(MOEBLAZE_ARG_STATUS, tu_tensor(two, tu_i32, 1, s2));
  assert_status(moeblaze_check_args(f->h, MOEBLAZE_PASS_FORWARD_TRAINING, a, n), MOEBLAZE_STATUS_INVALID_ARGUMENT);
  /* nor may it alias another argument */
  a[n - 1] = tu_arg(MOEBLAZE_ARG_STATUS, tu_tensor(p->tpe, tu_i32, 0, NULL));
  assert_status(moeblaze_check_args(f->h, MOEBLAZE_PASS_FORWARD_TRAINING, a, n), MOEBLAZE_STATUS_INVALID_ARGUMENT);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test_setup_teardown(garbage_saved_buffers, setup, teardown),
      cmocka_unit_test_setup_teardown(foreign_saved_buffers, setup, teardown),
      cmocka_unit_test_setup_teardown(corrupted_plans, setup, teardown),
      cmocka_unit_test_setup_teardown(byte_offsets_and_strides, setup, teardown),
      cmocka_unit_test_setup_teardown(aliasing_outputs, setup, teardown),
      cmocka_unit_test_setup_teardown(arguments_inside_call_buffers, setup, teardown),
      cmocka_unit_test(non_finite_logits),
      cmocka_unit_test_setup_teardown(nan_caller_weights_stay_in_their_token, setup, teardown),
      cmocka_unit_test_setup_teardown(status_argument, setup, teardown),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
