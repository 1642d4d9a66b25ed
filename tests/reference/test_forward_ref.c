/* Forward of the CPU engine against the fp64 reference: every activation x save policy x
 * dtype, the three routing inputs (caller ids as I32 and I64), and the edge cases. */
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <setjmp.h>
#include <cmocka.h>

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "harness.h"

static uint64_t g_seed;
static const moeblaze_dtype_t* k_dtypes[3] = {&tu_f32, &tu_f16, &tu_bf16};

typedef struct matrix_state {
  int act, policy, dt;
} matrix_state;

/* Shape of the matrix: small and odd. */
enum { M_E = 6, M_K = 2, M_D = 24, M_H = 40, M_L = 37 };

static uint64_t case_seed(uint64_t salt) { return g_seed + 0x9E3779B97F4A7C15ull * (salt + 1); }

/* One combination, all routing inputs. The combination index also varies the score function,
 * renormalisation, router tensor dtype and id dtype so that every pairing is covered. */
static void test_matrix(void** state) {
  const matrix_state* m = (const matrix_state*)*state;
  const moeblaze_dtype_t dt = *k_dtypes[m->dt];
  const int idx = m->act * 3 + m->policy;
  const uint64_t salt = (uint64_t)(m->dt * 100 + idx) * 10;
  for (int route = HX_ROUTE_LOGITS; route <= HX_ROUTE_CALLER; ++route) {
    const int nvar = route == HX_ROUTE_CALLER ? 2 : 1;
    for (int v = 0; v < nvar; ++v) {
      hx_case c = hx_case_make(M_E, M_K, M_D, M_H, M_L, m->act, m->policy, dt, route,
                               case_seed(salt + (uint64_t)(route * 2 + v)));
      c.lay.score_fn = (idx % 2) ? MOEBLAZE_SCORE_SIGMOID : MOEBLAZE_SCORE_SOFTMAX;
      c.lay.normalize = (idx / 2) % 2;
      c.lay.aux_coeff = 0.05;
      c.lay.z_coeff = 0.01;
      c.router_dtype = ((idx + route) % 2) ? dt : tu_f32;
      if (route == HX_ROUTE_CALLER) c.ids_dtype = v ? tu_i64 : tu_i32;
      else c.ids_dtype = (idx % 3 == 1) ? tu_i32 : tu_i64;
      c.inference_too = (route == HX_ROUTE_LOGITS) || (route == HX_ROUTE_CALLER && v == 0);
      hx_check_forward(&c);
    }
  }
}

/* ---- edge cases ---- */
static void run_all_routes(hx_case base, uint64_t salt) {
  for (int route = HX_ROUTE_LOGITS; route <= HX_ROUTE_CALLER; ++route) {
    hx_case c = base;
    c.route = route;
    c.seed = case_seed(salt + (uint64_t)route);
    hx_check_forward(&c);
  }
}

/* nn.Linear-style weights (column-major per expert, through strides, with and without row
 * padding): every activation and dtype; inference gives the training bits */
static void test_transposed_weights(void** state) {
  (void)state;
  for (int act = 0; act < 5; ++act)
    for (int dt = 0; dt < 3; ++dt) {
      hx_case c = hx_case_make(M_E, M_K, M_D, M_H, M_L, act, (act + dt) % 3, *k_dtypes[dt],
                               HX_ROUTE_LOGITS + (act + dt) % 3, case_seed(5400 + (uint64_t)(act * 3 + dt)));
      c.weights_transposed = 1 + (act + dt) % 2;
      c.inference_too = 1;
      hx_check_forward(&c);
    }
}

static void test_empty_expert(void** state) {
  (void)state;
  for (int dt = 0; dt < 3; dt += 2) {
    hx_case c = hx_case_make(M_E, M_K, M_D, M_H, M_L, MOEBLAZE_ACTIVATION_SWIGLU,
                             MOEBLAZE_SAVE_PREACT, *k_dtypes[dt], HX_ROUTE_LOGITS, 0);
    c.pattern = HX_PAT_EMPTY_EXPERT;
    c.lay.aux_coeff = 0.02;
    c.lay.z_coeff = 0.003;
    run_all_routes(c, 5000 + (uint64_t)dt * 10);
  }
}

static void test_one_expert(void** state) {
  (void)state;
  /* every token has expert 2 in slot 0 (k = 2), for all three routing inputs */
  hx_case c = hx_case_make(M_E, M_K, M_D, M_H, M_L, MOEBLAZE_ACTIVATION_GEGLU,
                           MOEBLAZE_SAVE_ALL, tu_f32, HX_ROUTE_LOGITS, 0);
  c.pattern = HX_PAT_ONE_EXPERT;
  c.lay.aux_coeff = 0.02;
  c.lay.z_coeff = 0.003;
  run_all_routes(c, 5100);
  /* k = 1: literally all tokens on one expert */
  hx_case c1 = hx_case_make(M_E, 1, M_D, M_H, M_L, MOEBLAZE_ACTIVATION_SILU,
                            MOEBLAZE_SAVE_RECOMPUTE_UP, tu_bf16, HX_ROUTE_LOGITS, 0);
  c1.pattern = HX_PAT_ONE_EXPERT;
  c1.lay.aux_coeff = 0.02;
  c1.lay.normalize = 1;
  run_all_routes(c1, 5110);
}

static void test_k_equals_e(void** state) {
  (void)state;
  for (int norm = 0; norm < 2; ++norm) {
    hx_case c = hx_case_make(4, 4, 16, 20, 23, MOEBLAZE_ACTIVATION_SWIGLU, MOEBLAZE_SAVE_PREACT,
                             norm ? tu_bf16 : tu_f32, HX_ROUTE_LOGITS, 0);
    c.lay.normalize = norm;
    c.lay.score_fn = norm ? MOEBLAZE_SCORE_SIGMOID : MOEBLAZE_SCORE_SOFTMAX;
    c.lay.aux_coeff = 0.1;
    c.lay.z_coeff = 0.01;
    run_all_routes(c, 5200 + (uint64_t)norm * 10);
  }
  /* E = k = 1 */
  hx_case c = hx_case_make(1, 1, 8, 12, 9, MOEBLAZE_ACTIVATION_RELU, MOEBLAZE_SAVE_ALL, tu_f32,
                           HX_ROUTE_LOGITS, 0);
  c.lay.aux_coeff = 0.1;
  c.lay.z_coeff = 0.01;
  run_all_routes(c, 5250);
}

static void test_single_token(void** state) {
  (void)state;
  for (int a = 0; a < 5; ++a) {
    hx_case c = hx_case_make(M_E, M_K, M_D, M_H, 1, a, (MOEBLAZE_SAVE_PREACT + a) % 3,
                             *k_dtypes[a % 3], HX_ROUTE_LOGITS, 0);
    c.lay.aux_coeff = 0.05;
    c.lay.z_coeff = 0.01;
    c.lay.max_tokens = 64;
    run_all_routes(c, 5300 + (uint64_t)a * 10);
  }
}

static void test_zero_tokens(void** state) {
  (void)state;
  for (int dt = 0; dt < 3; ++dt) {
    hx_case c = hx_case_make(M_E, M_K, M_D, M_H, 0, MOEBLAZE_ACTIVATION_SWIGLU,
                             MOEBLAZE_SAVE_PREACT, *k_dtypes[dt], HX_ROUTE_LOGITS, 0);
    c.lay.aux_coeff = 0.05;
    c.lay.z_coeff = 0.01;
    c.lay.max_tokens = 16;
    c.ids_dtype = dt == 1 ? tu_i32 : tu_i64;
    c.inference_too = 1;
    run_all_routes(c, 5400 + (uint64_t)dt * 10);
  }
}

static void test_mixed_dtypes(void** state) {
  (void)state;
  const moeblaze_dtype_t* pairs[4][2] = {
      {&tu_bf16, &tu_f32}, {&tu_f32, &tu_bf16}, {&tu_f16, &tu_bf16}, {&tu_bf16, &tu_f16}};
  for (int p = 0; p < 4; ++p) {
    hx_case c = hx_case_make(M_E, M_K, M_D, M_H, M_L, p % 2 ? MOEBLAZE_ACTIVATION_GELU
                                                            : MOEBLAZE_ACTIVATION_SWIGLU,
                             (MOEBLAZE_SAVE_PREACT + p) % 3, *pairs[p][0], HX_ROUTE_LOGITS, 0);
    c.lay.weight_dtype = *pairs[p][1];
    c.lay.aux_coeff = 0.05;
    c.lay.z_coeff = 0.01;
    c.router_dtype = p % 2 ? *pairs[p][0] : tu_f32;
    run_all_routes(c, 5500 + (uint64_t)p * 10);
  }
}

/* More tokens than one tile of the plan builder, more experts, k = 3, default threads. */
static void test_many_tokens(void** state) {
  (void)state;
  hx_case c = hx_case_make(9, 3, 16, 24, 613, MOEBLAZE_ACTIVATION_SWIGLU, MOEBLAZE_SAVE_PREACT,
                           tu_bf16, HX_ROUTE_LOGITS, 0);
  c.lay.aux_coeff = 0.01;
  c.lay.z_coeff = 0.001;
  c.lay.normalize = 1;
  c.lay.max_tokens = 1000;
  run_all_routes(c, 5600);
  hx_case f = c;
  f.lay.act_dtype = f.lay.weight_dtype = tu_f32;
  f.lay.activation = MOEBLAZE_ACTIVATION_RELU;
  f.lay.save_policy = MOEBLAZE_SAVE_ALL;
  f.lay.score_fn = MOEBLAZE_SCORE_SIGMOID;
  f.ids_dtype = tu_i32;
  run_all_routes(f, 5610);
}

/* Exact ties in the router: top-k must pick the lower id, in the reference's order. */
static void test_ties(void** state) {
  (void)state;
  for (int v = 0; v < 8; ++v) {
    hx_case c = hx_case_make(7, 1 + v % 4, M_D, M_H, M_L, MOEBLAZE_ACTIVATION_SWIGLU,
                             MOEBLAZE_SAVE_PREACT, v % 2 ? tu_bf16 : tu_f32,
                             v < 4 ? HX_ROUTE_LOGITS : HX_ROUTE_WEIGHT, case_seed(5700 + (uint64_t)v));
    c.pattern = HX_PAT_TIES;
    c.lay.score_fn = (v / 2) % 2 ? MOEBLAZE_SCORE_SIGMOID : MOEBLAZE_SCORE_SOFTMAX;
    c.lay.normalize = v % 3 == 0;
    c.lay.aux_coeff = 0.05;
    c.lay.z_coeff = 0.01;
    c.router_dtype = v % 2 ? tu_bf16 : tu_f32;
    hx_check_forward(&c);
    hx_check_backward(&c);
  }
}

/* Random shapes and options, different on every run (replay with MOEBLAZE_TEST_SEED). */
static void test_random(void** state) {
  (void)state;
  const char* one = getenv("MOEBLAZE_REF_CASE_SEED"); /* replay one case by its case_seed */
  const char* cnt = getenv("MOEBLAZE_REF_RANDOM_CASES"); /* soak: more random cases */
  const uint64_t n = one ? 1u : cnt ? strtoull(cnt, NULL, 0) : 40u;
  for (uint64_t i = 0; i < n; ++i) {
    const hx_case c = hx_case_random(one ? strtoull(one, NULL, 0) : case_seed(9000 + i));
    hx_check_forward(&c);
  }
}

int main(void) {
  g_seed = tu_fresh_seed("test_forward_ref");
  static matrix_state ms[3 * 5 * 3];
  hx_tests T;
  memset(&T, 0, sizeof T);
  int i = 0;
  for (int dt = 0; dt < 3; ++dt)
    for (int a = 0; a < 5; ++a)
      for (int p = 0; p < 3; ++p, ++i) {
        ms[i].act = a;
        ms[i].policy = p;
        ms[i].dt = dt;
        char name[96];
        snprintf(name, sizeof name, "forward_%s_%s_%s", hx_act_name(a), hx_policy_name(p),
                 tu_dtype_name(*k_dtypes[dt]));
        hx_tests_add(&T, name, test_matrix, &ms[i]);
      }
  hx_tests_add(&T, "forward_empty_expert", test_empty_expert, NULL);
  hx_tests_add(&T, "forward_transposed_weights", test_transposed_weights, NULL);
  hx_tests_add(&T, "forward_one_expert", test_one_expert, NULL);
  hx_tests_add(&T, "forward_k_equals_E", test_k_equals_e, NULL);
  hx_tests_add(&T, "forward_single_token", test_single_token, NULL);
  hx_tests_add(&T, "forward_zero_tokens", test_zero_tokens, NULL);
  hx_tests_add(&T, "forward_mixed_dtypes", test_mixed_dtypes, NULL);
  hx_tests_add(&T, "forward_many_tokens", test_many_tokens, NULL);
  hx_tests_add(&T, "forward_ties", test_ties, NULL);
  hx_tests_add(&T, "forward_random_shapes", test_random, NULL);
  return hx_tests_run(&T, "forward_ref");
}
