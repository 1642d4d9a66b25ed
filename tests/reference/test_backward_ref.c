/* Backward of the CPU engine against the fp64 reference's analytic backward: every gradient
 * (dx, dW_gate_up, dW_down, d logits, dW_g, d top-k weights) for every activation x save
 * policy x dtype and the three routing inputs, with nonzero aux/z coefficients, explicit
 * GRAD_AUX_LOSS / GRAD_Z_LOSS scalars, and MOEBLAZE_ARG_FLAG_ACCUMULATE. */
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

enum { M_E = 6, M_K = 2, M_D = 24, M_H = 40, M_L = 37 };

static uint64_t case_seed(uint64_t salt) { return g_seed + 0x9E3779B97F4A7C15ull * (salt + 1); }

/* One combination: the three routing inputs (caller ids as I32 and I64); the variants rotate
 * explicit loss scalars and accumulation so that each combination sees both. */
static void test_matrix(void** state) {
  const matrix_state* m = (const matrix_state*)*state;
  const moeblaze_dtype_t dt = *k_dtypes[m->dt];
  const int idx = m->act * 3 + m->policy;
  const uint64_t salt = (uint64_t)(m->dt * 100 + idx) * 10;
  int variant = 0;
  for (int route = HX_ROUTE_LOGITS; route <= HX_ROUTE_CALLER; ++route) {
    const int nvar = route == HX_ROUTE_CALLER ? 2 : 1;
    for (int v = 0; v < nvar; ++v, ++variant) {
      hx_case c = hx_case_make(M_E, M_K, M_D, M_H, M_L, m->act, m->policy, dt, route,
                               case_seed(salt + (uint64_t)(route * 2 + v)));
      c.lay.score_fn = (idx % 2) ? MOEBLAZE_SCORE_SIGMOID : MOEBLAZE_SCORE_SOFTMAX;
      c.lay.normalize = (idx / 2) % 2;
      c.lay.aux_coeff = 0.05;
      c.lay.z_coeff = 0.01;
      c.router_dtype = ((idx + route) % 2) ? dt : tu_f32;
      if (route == HX_ROUTE_CALLER) c.ids_dtype = v ? tu_i64 : tu_i32;
      else c.ids_dtype = (idx % 3 == 1) ? tu_i32 : tu_i64;
      c.explicit_scalars = (idx + variant) % 2;
      c.grad_aux = 0.75;
      c.grad_z = 2.5;
      c.accumulate = ((idx + variant) / 2) % 2;
      hx_check_backward(&c);
    }
  }
}

/* Every routing input, with and without explicit loss scalars / accumulation. */
static void run_all_routes(hx_case base, uint64_t salt) {
  for (int route = HX_ROUTE_LOGITS; route <= HX_ROUTE_CALLER; ++route) {
    hx_case c = base;
    c.route = route;
    c.seed = case_seed(salt + (uint64_t)route);
    hx_check_backward(&c);
  }
}

static void test_loss_scalars(void** state) {
  (void)state;
  /* aux and z dominate the router gradient here; explicit scalars of several signs, zero too */
  const double vals[4][2] = {{1.0, 1.0}, {0.0, 3.0}, {-2.0, 0.0}, {0.5, -1.5}};
  for (int i = 0; i < 4; ++i) {
    hx_case c = hx_case_make(M_E, M_K, M_D, M_H, M_L, MOEBLAZE_ACTIVATION_SWIGLU,
                             MOEBLAZE_SAVE_PREACT, tu_f32, HX_ROUTE_LOGITS, 0);
    c.lay.aux_coeff = 0.5;
    c.lay.z_coeff = 0.2;
    c.lay.score_fn = i % 2 ? MOEBLAZE_SCORE_SIGMOID : MOEBLAZE_SCORE_SOFTMAX;
    c.lay.normalize = i / 2;
    c.explicit_scalars = 1;
    c.grad_aux = vals[i][0];
    c.grad_z = vals[i][1];
    run_all_routes(c, 6000 + (uint64_t)i * 10);
  }
  /* coefficients zero: the router gets only the expert path */
  hx_case c = hx_case_make(M_E, M_K, M_D, M_H, M_L, MOEBLAZE_ACTIVATION_GELU, MOEBLAZE_SAVE_ALL,
                           tu_f32, HX_ROUTE_LOGITS, 0);
  c.explicit_scalars = 1;
  c.grad_aux = 4.0;
  c.grad_z = 4.0;
  run_all_routes(c, 6050);
}

static void test_accumulate(void** state) {
  (void)state;
  for (int dt = 0; dt < 3; ++dt) {
    hx_case c = hx_case_make(M_E, M_K, M_D, M_H, M_L, (MOEBLAZE_ACTIVATION_RELU + dt) % 5,
                             (MOEBLAZE_SAVE_PREACT + dt) % 3, *k_dtypes[dt], HX_ROUTE_LOGITS, 0);
    c.lay.aux_coeff = 0.05;
    c.lay.z_coeff = 0.01;
    c.accumulate = 1;
    c.router_dtype = dt == 2 ? tu_bf16 : tu_f32;
    run_all_routes(c, 6100 + (uint64_t)dt * 10);
  }
}

/* nn.Linear-style weights and gradients (column-major per expert, through strides, with and
 * without row padding): every activation and dtype, accumulation, zero tokens, an empty expert */
static void test_transposed_weights(void** state) {
  (void)state;
  for (int act = 0; act < 5; ++act)
    for (int dt = 0; dt < 3; ++dt) {
      hx_case c = hx_case_make(M_E, M_K, M_D, M_H, act == 4 ? 0 : M_L, act, (act + dt) % 3, *k_dtypes[dt],
                               HX_ROUTE_LOGITS + (act + dt) % 3, case_seed(6400 + (uint64_t)(act * 3 + dt)));
      c.weights_transposed = 1 + (act + dt) % 2;
      c.accumulate = dt == 1;
      c.pattern = act == 3 ? HX_PAT_EMPTY_EXPERT : HX_PAT_RANDOM;
      c.lay.aux_coeff = 0.05;
      hx_check_backward(&c);
    }
}

/* an expert with no tokens */
static void test_empty_expert(void** state) {
  (void)state;
  hx_case c = hx_case_make(M_E, M_K, M_D, M_H, M_L, MOEBLAZE_ACTIVATION_SWIGLU,
                           MOEBLAZE_SAVE_PREACT, tu_f32, HX_ROUTE_LOGITS, 0);
  c.pattern = HX_PAT_EMPTY_EXPERT;
  c.lay.aux_coeff = 0.05;
  c.lay.z_coeff = 0.01;
  run_all_routes(c, 6200);
  c.lay.act_dtype = c.lay.weight_dtype = tu_bf16;
  c.accumulate = 1;
  run_all_routes(c, 6210);
}

/* all tokens on one expert (k = 1) and on one expert in slot 0 (k = 2): a confident router */
static void test_one_expert(void** state) {
  (void)state;
  hx_case o = hx_case_make(M_E, 1, M_D, M_H, M_L, MOEBLAZE_ACTIVATION_GEGLU,
                           MOEBLAZE_SAVE_RECOMPUTE_UP, tu_f32, HX_ROUTE_LOGITS, 0);
  o.pattern = HX_PAT_ONE_EXPERT;
  o.lay.aux_coeff = 0.05;
  o.lay.z_coeff = 0.01;
  o.lay.normalize = 1;
  run_all_routes(o, 6220);
  o.lay.top_k = 2;
  o.lay.normalize = 0;
  o.lay.activation = MOEBLAZE_ACTIVATION_SILU;
  run_all_routes(o, 6230);
}

static void test_k_equals_e(void** state) {
  (void)state;
  hx_case ke = hx_case_make(4, 4, 16, 20, 23, MOEBLAZE_ACTIVATION_SWIGLU, MOEBLAZE_SAVE_ALL,
                            tu_f32, HX_ROUTE_LOGITS, 0);
  ke.lay.aux_coeff = 0.1;
  ke.lay.z_coeff = 0.01;
  run_all_routes(ke, 6240);
  ke.lay.normalize = 1;
  ke.lay.score_fn = MOEBLAZE_SCORE_SIGMOID;
  run_all_routes(ke, 6250);
}

static void test_single_token(void** state) {
  (void)state;
  hx_case one = hx_case_make(M_E, M_K, M_D, M_H, 1, MOEBLAZE_ACTIVATION_GELU,
                             MOEBLAZE_SAVE_PREACT, tu_f32, HX_ROUTE_LOGITS, 0);
  one.lay.aux_coeff = 0.05;
  one.lay.z_coeff = 0.01;
  one.lay.max_tokens = 8;
  run_all_routes(one, 6260);
}

/* L = 0: weight gradients are zero (or untouched when accumulating) */
static void test_zero_tokens(void** state) {
  (void)state;
  for (int acc = 0; acc < 2; ++acc) {
    hx_case zt = hx_case_make(M_E, M_K, M_D, M_H, 0, MOEBLAZE_ACTIVATION_SWIGLU,
                              MOEBLAZE_SAVE_PREACT, acc ? tu_bf16 : tu_f32, HX_ROUTE_LOGITS, 0);
    zt.lay.aux_coeff = 0.05;
    zt.lay.z_coeff = 0.01;
    zt.lay.max_tokens = 16;
    zt.accumulate = acc;
    run_all_routes(zt, 6270 + (uint64_t)acc * 10);
  }
}

static void test_mixed_dtypes(void** state) {
  (void)state;
  hx_case mx = hx_case_make(M_E, M_K, M_D, M_H, M_L, MOEBLAZE_ACTIVATION_SWIGLU,
                            MOEBLAZE_SAVE_RECOMPUTE_UP, tu_bf16, HX_ROUTE_LOGITS, 0);
  mx.lay.weight_dtype = tu_f32;
  mx.lay.aux_coeff = 0.05;
  mx.lay.z_coeff = 0.01;
  run_all_routes(mx, 6300);
  mx.lay.act_dtype = tu_f32;
  mx.lay.weight_dtype = tu_bf16;
  mx.router_dtype = tu_f32;
  run_all_routes(mx, 6310);
}

/* many tokens (several plan tiles), E = 9, k = 3 */
static void test_many_tokens(void** state) {
  (void)state;
  hx_case big = hx_case_make(9, 3, 16, 24, 613, MOEBLAZE_ACTIVATION_SWIGLU, MOEBLAZE_SAVE_PREACT,
                             tu_f32, HX_ROUTE_LOGITS, 0);
  big.lay.aux_coeff = 0.01;
  big.lay.z_coeff = 0.001;
  big.lay.normalize = 1;
  run_all_routes(big, 6320);
}

/* Each gradient output alone, and all but one: the router gradient must not depend on
 * GRAD_TOPK_WEIGHTS being requested, nor dx on the weight gradients, and so on. */
static void test_subsets(void** state) {
  (void)state;
  for (unsigned i = 0; i < 5; ++i)
    for (int all_but = 0; all_but < 2; ++all_but) {
      hx_case c = hx_case_make(M_E, M_K, M_D, M_H, M_L, i % 2 ? MOEBLAZE_ACTIVATION_SWIGLU : MOEBLAZE_ACTIVATION_GELU,
                               (MOEBLAZE_SAVE_PREACT + i) % 3, i == 3 ? tu_bf16 : tu_f32, HX_ROUTE_LOGITS, 0);
      c.lay.aux_coeff = 0.05;
      c.lay.z_coeff = 0.01;
      c.lay.normalize = (int64_t)(i % 2);
      c.grad_mask = all_but ? (31u & ~(1u << i)) : (1u << i);
      run_all_routes(c, 6400 + i * 10 + (uint64_t)all_but * 100);
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
    hx_check_backward(&c);
  }
}

int main(void) {
  g_seed = tu_fresh_seed("test_backward_ref");
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
        snprintf(name, sizeof name, "backward_%s_%s_%s", hx_act_name(a), hx_policy_name(p),
                 tu_dtype_name(*k_dtypes[dt]));
        hx_tests_add(&T, name, test_matrix, &ms[i]);
      }
  hx_tests_add(&T, "backward_loss_scalars", test_loss_scalars, NULL);
  hx_tests_add(&T, "backward_accumulate", test_accumulate, NULL);
  hx_tests_add(&T, "backward_empty_expert", test_empty_expert, NULL);
  hx_tests_add(&T, "backward_transposed_weights", test_transposed_weights, NULL);
  hx_tests_add(&T, "backward_one_expert", test_one_expert, NULL);
  hx_tests_add(&T, "backward_k_equals_E", test_k_equals_e, NULL);
  hx_tests_add(&T, "backward_single_token", test_single_token, NULL);
  hx_tests_add(&T, "backward_zero_tokens", test_zero_tokens, NULL);
  hx_tests_add(&T, "backward_mixed_dtypes", test_mixed_dtypes, NULL);
  hx_tests_add(&T, "backward_many_tokens", test_many_tokens, NULL);
  hx_tests_add(&T, "backward_gradient_subsets", test_subsets, NULL);
  hx_tests_add(&T, "backward_random_shapes", test_random, NULL);
  return hx_tests_run(&T, "backward_ref");
}
