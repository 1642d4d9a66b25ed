/* Bitwise determinism of the CPU engine: forward (training) + backward with the same inputs
 * give the same bits on every run and for every NUM_THREADS (1, 2, 3, default), including
 * the saved buffer. */
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <setjmp.h>
#include <cmocka.h>

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "reference_moe.h"
#include "test_util.h"

enum { R_LOGITS = 1, R_WEIGHT = 2, R_CALLER = 3 };
enum { NBUF = 16 };

static uint64_t g_seed;

typedef struct det_cfg {
  const char* name;
  int64_t E, k, d, h, L, act, policy;
  const moeblaze_dtype_t* dt;
  int route;
  double aux, z;
  int64_t score, norm;
} det_cfg;

/* Every byte a run produces, by name. */
typedef struct det_run {
  const char* name[NBUF];
  void* buf[NBUF];
  size_t bytes[NBUF];
  int n;
} det_run;

static void keep(det_run* r, const char* name, void* buf, size_t bytes) {
  r->name[r->n] = name;
  r->buf[r->n] = buf;
  r->bytes[r->n] = bytes;
  r->n++;
}

typedef struct det_data {
  int64_t gh;
  void *x, *wgu, *wd, *wg, *lg, *ids, *gates, *dy;
  int64_t sx[2], swgu[3], swd[3], swg[2], slg[2], sk[2], sE[1], s1[1];
} det_data;

static void make_data(const det_cfg* c, det_data* D, uint64_t seed) {
  memset(D, 0, sizeof *D);
  const moeblaze_dtype_t t = *c->dt;
  D->gh = ref_gate_factor((int32_t)c->act) * c->h;
  D->sx[0] = c->L; D->sx[1] = c->d;
  D->swgu[0] = c->E; D->swgu[1] = c->d; D->swgu[2] = D->gh;
  D->swd[0] = c->E; D->swd[1] = c->h; D->swd[2] = c->d;
  D->swg[0] = c->E; D->swg[1] = c->d;
  D->slg[0] = c->L; D->slg[1] = c->E;
  D->sk[0] = c->L; D->sk[1] = c->k;
  D->sE[0] = c->E;
  D->s1[0] = 1;
  tu_rng r;
  tu_rng_seed(&r, seed);
  D->x = tu_alloc(t, (size_t)(c->L * c->d));
  tu_fill_normal(&r, D->x, t, (size_t)(c->L * c->d), 1.0);
  D->wgu = tu_alloc(t, (size_t)(c->E * c->d * D->gh));
  tu_fill_normal(&r, D->wgu, t, (size_t)(c->E * c->d * D->gh), 0.2);
  D->wd = tu_alloc(t, (size_t)(c->E * c->h * c->d));
  tu_fill_normal(&r, D->wd, t, (size_t)(c->E * c->h * c->d), 0.15);
  D->wg = tu_alloc(t, (size_t)(c->E * c->d));
  tu_fill_normal(&r, D->wg, t, (size_t)(c->E * c->d), 0.2);
  D->lg = tu_alloc(tu_f32, (size_t)(c->L * c->E));
  tu_fill_normal(&r, D->lg, tu_f32, (size_t)(c->L * c->E), 1.0);
  D->dy = tu_alloc(t, (size_t)(c->L * c->d));
  tu_fill_normal(&r, D->dy, t, (size_t)(c->L * c->d), 1.0);
  D->ids = tu_alloc(tu_i32, (size_t)(c->L * c->k));
  D->gates = tu_alloc(tu_f32, (size_t)(c->L * c->k));
  int64_t* perm = (int64_t*)malloc(sizeof(int64_t) * (size_t)c->E);
  assert_non_null(perm);
  for (int64_t tk = 0; tk < c->L; ++tk) {
    for (int64_t e = 0; e < c->E; ++e) perm[e] = e;
    for (int64_t j = 0; j < c->k; ++j) {
      int64_t q = j + tu_rng_below(&r, c->E - j);
      int64_t tmp = perm[j]; perm[j] = perm[q]; perm[q] = tmp;
      ((int32_t*)D->ids)[tk * c->k + j] = (int32_t)perm[j];
      ((float*)D->gates)[tk * c->k + j] = (float)(0.1 + 0.9 * tu_rng_uniform(&r));
    }
  }
  free(perm);
}

static void free_data(det_data* D) {
  tu_free(D->x); tu_free(D->wgu); tu_free(D->wd); tu_free(D->wg); tu_free(D->lg);
  tu_free(D->ids); tu_free(D->gates); tu_free(D->dy);
}

static size_t inputs(const det_cfg* c, det_data* D, moeblaze_arg_t* a, int backward) {
  const moeblaze_dtype_t t = *c->dt;
  size_t n = 0;
  a[n++] = tu_arg(MOEBLAZE_ARG_INPUT, tu_tensor(D->x, t, 2, D->sx));
  a[n++] = tu_arg(MOEBLAZE_ARG_W_GATE_UP, tu_tensor(D->wgu, t, 3, D->swgu));
  a[n++] = tu_arg(MOEBLAZE_ARG_W_DOWN, tu_tensor(D->wd, t, 3, D->swd));
  if (c->route == R_LOGITS) a[n++] = tu_arg(MOEBLAZE_ARG_ROUTER_LOGITS, tu_tensor(D->lg, tu_f32, 2, D->slg));
  if (c->route == R_WEIGHT) a[n++] = tu_arg(MOEBLAZE_ARG_ROUTER_WEIGHT, tu_tensor(D->wg, t, 2, D->swg));
  if (c->route == R_CALLER && !backward) { /* backward: ids and gates come from the saved buffer */
    a[n++] = tu_arg(MOEBLAZE_ARG_TOPK_INDICES, tu_tensor(D->ids, tu_i32, 2, D->sk));
    a[n++] = tu_arg(MOEBLAZE_ARG_TOPK_WEIGHTS, tu_tensor(D->gates, tu_f32, 2, D->sk));
  }
  return n;
}

static void run_once(const det_cfg* c, det_data* D, int64_t threads, det_run* R) {
  const moeblaze_dtype_t t = *c->dt;
  const int64_t L = c->L, E = c->E, k = c->k, d = c->d, h = c->h, gh = D->gh;
  tu_layer tl = tu_layer_default(E, k, d, h, L, c->act);
  tl.save_policy = c->policy;
  tl.act_dtype = tl.weight_dtype = t;
  tl.aux_coeff = c->aux;
  tl.z_coeff = c->z;
  tl.score_fn = c->score;
  tl.normalize = c->norm;
  tl.num_threads = threads;
  moeblaze_handle_t hd = NULL;
  assert_ok(tu_create_cpu(&tl, &hd));
  size_t wf_b = 0, wb_b = 0, sv_b = 0;
  assert_ok(moeblaze_get_workspace_size(hd, MOEBLAZE_PASS_FORWARD_TRAINING, L, &wf_b));
  assert_ok(moeblaze_get_workspace_size(hd, MOEBLAZE_PASS_BACKWARD, L, &wb_b));
  assert_ok(moeblaze_get_saved_size(hd, L, &sv_b));
  void* wf = tu_alloc_bytes(wf_b);
  void* wb = tu_alloc_bytes(wb_b);
  void* sv = tu_alloc_bytes(sv_b);
  memset(R, 0, sizeof *R);

  void* y = tu_alloc(t, (size_t)(L * d));
  void* oids = tu_alloc(tu_i64, (size_t)(L * k));
  void* og = tu_alloc(tu_f32, (size_t)(L * k));
  void* cnt = tu_alloc(tu_i64, (size_t)E);
  void* aux = tu_alloc(tu_f32, 1);
  void* z = tu_alloc(tu_f32, 1);
  moeblaze_arg_t a[24];
  size_t n = inputs(c, D, a, 0);
  a[n++] = tu_arg(MOEBLAZE_ARG_OUTPUT, tu_tensor(y, t, 2, D->sx));
  a[n++] = tu_arg(MOEBLAZE_ARG_TOKENS_PER_EXPERT, tu_tensor(cnt, tu_i64, 1, D->sE));
  keep(R, "y", y, (size_t)(L * d) * tu_dtype_size(t));
  keep(R, "tokens_per_expert", cnt, (size_t)E * 8);
  if (c->route != R_CALLER) {
    a[n++] = tu_arg(MOEBLAZE_ARG_TOPK_INDICES, tu_tensor(oids, tu_i64, 2, D->sk));
    a[n++] = tu_arg(MOEBLAZE_ARG_TOPK_WEIGHTS, tu_tensor(og, tu_f32, 2, D->sk));
    a[n++] = tu_arg(MOEBLAZE_ARG_AUX_LOSS, tu_tensor(aux, tu_f32, 0, D->s1));
    a[n++] = tu_arg(MOEBLAZE_ARG_Z_LOSS, tu_tensor(z, tu_f32, 0, D->s1));
    keep(R, "topk_ids", oids, (size_t)(L * k) * 8);
    keep(R, "topk_weights", og, (size_t)(L * k) * 4);
    keep(R, "aux_loss", aux, 4);
    keep(R, "z_loss", z, 4);
  } else {
    tu_free(oids); tu_free(og); tu_free(aux); tu_free(z);
  }
  assert_ok(moeblaze_forward(hd, MOEBLAZE_PASS_FORWARD_TRAINING, a, n, wf, wf_b, sv, sv_b, NULL));
  keep(R, "saved", sv, sv_b);

  void* dx = tu_alloc(t, (size_t)(L * d));
  void* dwgu = tu_alloc(t, (size_t)(E * d * gh));
  void* dwd = tu_alloc(t, (size_t)(E * h * d));
  void* dg = tu_alloc(tu_f32, (size_t)(L * k));
  n = inputs(c, D, a, 1);
  a[n++] = tu_arg(MOEBLAZE_ARG_GRAD_OUTPUT, tu_tensor(D->dy, t, 2, D->sx));
  a[n++] = tu_arg(MOEBLAZE_ARG_GRAD_INPUT, tu_tensor(dx, t, 2, D->sx));
  a[n++] = tu_arg(MOEBLAZE_ARG_GRAD_W_GATE_UP, tu_tensor(dwgu, t, 3, D->swgu));
  a[n++] = tu_arg(MOEBLAZE_ARG_GRAD_W_DOWN, tu_tensor(dwd, t, 3, D->swd));
  a[n++] = tu_arg(MOEBLAZE_ARG_GRAD_TOPK_WEIGHTS, tu_tensor(dg, tu_f32, 2, D->sk));
  keep(R, "dx", dx, (size_t)(L * d) * tu_dtype_size(t));
  keep(R, "dW_gate_up", dwgu, (size_t)(E * d * gh) * tu_dtype_size(t));
  keep(R, "dW_down", dwd, (size_t)(E * h * d) * tu_dtype_size(t));
  keep(R, "d_topk_weights", dg, (size_t)(L * k) * 4);
  if (c->route == R_LOGITS) {
    void* dl = tu_alloc(tu_f32, (size_t)(L * E));
    a[n++] = tu_arg(MOEBLAZE_ARG_GRAD_ROUTER_LOGITS, tu_tensor(dl, tu_f32, 2, D->slg));
    keep(R, "d_logits", dl, (size_t)(L * E) * 4);
  }
  if (c->route == R_WEIGHT) {
    void* dwg = tu_alloc(t, (size_t)(E * d));
    a[n++] = tu_arg(MOEBLAZE_ARG_GRAD_ROUTER_WEIGHT, tu_tensor(dwg, t, 2, D->swg));
    keep(R, "dW_g", dwg, (size_t)(E * d) * tu_dtype_size(t));
  }
  assert_ok(moeblaze_backward(hd, a, n, sv, sv_b, wb, wb_b, NULL));
  tu_free(wf);
  tu_free(wb);
  assert_ok(moeblaze_destroy(hd));
}

static void free_run(det_run* R) {
  for (int i = 0; i < R->n; ++i) tu_free(R->buf[i]);
  R->n = 0;
}

static void compare(const det_cfg* c, const det_run* a, const det_run* b, const char* label) {
  assert_int_equal(a->n, b->n);
  for (int i = 0; i < a->n; ++i) {
    assert_int_equal(a->bytes[i], b->bytes[i]);
    if (memcmp(a->buf[i], b->buf[i], a->bytes[i]) != 0) {
      size_t first = 0;
      const unsigned char* p = (const unsigned char*)a->buf[i];
      const unsigned char* q = (const unsigned char*)b->buf[i];
      while (first < a->bytes[i] && p[first] == q[first]) ++first;
      fail_msg("%s: %s differs (first differing byte %zu of %zu) [%s]", label, a->name[i], first,
               a->bytes[i], c->name);
    }
  }
}

static void test_det(void** state) {
  const det_cfg* c = (const det_cfg*)*state;
  det_data D;
  make_data(c, &D, g_seed ^ (uint64_t)(c->L * 131 + c->act * 7 + c->route));
  det_run base, other;
  run_once(c, &D, 1, &base);
  const int64_t threads[5] = {1, 2, 3, 0, 0};
  for (int i = 0; i < 5; ++i) {
    char label[64];
    snprintf(label, sizeof label, "NUM_THREADS=%lld (run %d) vs NUM_THREADS=1", (long long)threads[i], i);
    run_once(c, &D, threads[i], &other);
    compare(c, &base, &other, label);
    free_run(&other);
  }
  free_run(&base);
  free_data(&D);
}

int main(void) {
  g_seed = tu_fresh_seed("test_determinism");
  static const det_cfg cfgs[] = {
      {"swiglu bf16 preact logits softmax", 8, 3, 32, 48, 700, MOEBLAZE_ACTIVATION_SWIGLU,
       MOEBLAZE_SAVE_PREACT, &tu_bf16, R_LOGITS, 0.01, 0.001, 0, 0},
      {"relu f32 saveall W_g sigmoid norm", 8, 2, 24, 40, 517, MOEBLAZE_ACTIVATION_RELU,
       MOEBLAZE_SAVE_ALL, &tu_f32, R_WEIGHT, 0.02, 0.002, 1, 1},
      {"geglu f16 recompute caller", 6, 2, 16, 24, 611, MOEBLAZE_ACTIVATION_GEGLU,
       MOEBLAZE_SAVE_RECOMPUTE_UP, &tu_f16, R_CALLER, 0, 0, 0, 0},
      {"silu bf16 preact logits norm", 16, 4, 16, 32, 1029, MOEBLAZE_ACTIVATION_SILU,
       MOEBLAZE_SAVE_PREACT, &tu_bf16, R_LOGITS, 0.01, 0.001, 0, 1},
  };
  struct CMUnitTest tests[4];
  memset(tests, 0, sizeof tests);
  static const char* names[4] = {"determinism_swiglu_bf16_logits", "determinism_relu_f32_wg",
                                 "determinism_geglu_f16_caller", "determinism_silu_bf16_logits_E16"};
  for (int i = 0; i < 4; ++i) {
    tests[i].name = names[i];
    tests[i].test_func = test_det;
    tests[i].initial_state = (void*)&cfgs[i];
  }
  return cmocka_run_group_tests_name("determinism", tests, NULL, NULL);
}
