/* Shared driver of the reference tests: random layer data in the library's storage dtypes,
 * one library forward/backward on the CPU engine, the fp64 reference fed with the same
 * (rounded) data, and the comparisons. Include after <cmocka.h>. */
#ifndef MOEBLAZE_REF_HARNESS_H_
#define MOEBLAZE_REF_HARNESS_H_

#include <stddef.h>
#include <stdint.h>

#include "moeblaze/moeblaze.h"
#include "reference_moe.h"
#include "test_util.h"

/* Routing input of a case (the C API's three cases). */
enum { HX_ROUTE_LOGITS = 1, HX_ROUTE_WEIGHT = 2, HX_ROUTE_CALLER = 3 };

/* How the routing data are drawn. */
enum {
  HX_PAT_RANDOM = 0,      /* random logits / W_g / caller ids */
  HX_PAT_EMPTY_EXPERT = 1,/* expert E-1 receives no token (all routing cases) */
  HX_PAT_ONE_EXPERT = 2,  /* every token has expert min(2, E-1) in slot 0 (all routing cases) */
  HX_PAT_TIES = 3         /* exact ties: logits from {-1, 0, 0.5, 1}; W_g rows E-1 = 0 and
                             2 = 1 (bit-identical logits in any implementation). Top-k must
                             match the reference exactly (ties go to the lower id). */
};

typedef struct hx_case {
  tu_layer lay;                  /* handle config (dtypes, policy, activation, coeffs, threads) */
  int64_t L;                     /* tokens in the call */
  int route;                     /* HX_ROUTE_* */
  moeblaze_dtype_t router_dtype; /* logits, top-k weights and their gradients: F32 or act dtype */
  moeblaze_dtype_t ids_dtype;    /* top-k ids and token counts: I32 or I64 */
  int pattern;                   /* HX_PAT_* */
  int weights_transposed;        /* W_gate_up, W_down and their gradients go to the library
                                    column-major per expert (nn.Linear's [out, in], through
                                    strides), with weights_transposed - 1 padding elements
                                    per physical row */
  uint64_t seed;
  /* backward only */
  int accumulate;                /* MOEBLAZE_ARG_FLAG_ACCUMULATE on every gradient output */
  int explicit_scalars;          /* pass GRAD_AUX_LOSS / GRAD_Z_LOSS (values below) */
  double grad_aux, grad_z;
  unsigned grad_mask;            /* 0: every gradient; else bit i requests gradient i of
                                    (dx, dW_gate_up, dW_down, d_topk_weights, d_logits|dW_g) */
  int inference_too;             /* forward: also run FORWARD_INFERENCE and compare bits */
} hx_case;

/* A case with the defaults for the given shape/options (route from logits, F32 router
 * tensors, I64 ids, random pattern, no accumulation). */
hx_case hx_case_make(int64_t E, int64_t k, int64_t d, int64_t h, int64_t L, int64_t activation,
                     int64_t policy, moeblaze_dtype_t dtype, int route, uint64_t seed);

/* A random case: shapes (L 0..89, E 1..10, k 1..min(E, 4), d 1..40, h 1..48), activation,
 * policy, activation/weight/router/id dtypes, score function, renormalisation, coefficients,
 * thread count, routing input, weight layout and (backward) accumulation / explicit scalars. */
hx_case hx_case_random(uint64_t seed);

/* Short text describing a case, for failure messages (static buffer per thread-less use). */
const char* hx_describe(const hx_case* c);

/* Runs forward (training; optionally inference too) on the CPU engine and checks y, top-k ids
 * and weights, tokens per expert, aux and z against the reference. Fails the test on error. */
void hx_check_forward(const hx_case* c);

/* Runs forward (training) then backward and checks every gradient against the reference. */
void hx_check_backward(const hx_case* c);

/* Name of an activation / save policy (lower case). */
const char* hx_act_name(int64_t a);
const char* hx_policy_name(int64_t p);
const char* hx_route_name(int r);

/* Builds and runs a CMocka group from a dynamically built list (names are copied). */
typedef struct hx_tests {
  struct CMUnitTest* tests;
  size_t n, cap;
} hx_tests;
void hx_tests_add(hx_tests* t, const char* name, void (*fn)(void**), void* state);
int hx_tests_run(hx_tests* t, const char* group);

#endif
