/* Shared declarations of perf/moeblaze-bench. */
#ifndef MOEBLAZE_BENCH_H_
#define MOEBLAZE_BENCH_H_

#include <stddef.h>
#include <stdint.h>

#include "moeblaze/moeblaze.h"

/* One layer shape: tokens T, model dim d, expert FFN dim n, experts E, top-k k. */
typedef struct bench_config {
  char name[64];
  int64_t tokens, d, n, experts, k;
} bench_config;

/* Reads the "configs" array of a config file in either schema (paper-configs.json: d, experts,
 * k, batch, seq with n = 4 d; modern-configs.json: T, d, n, E, K); returns the count (<= max)
 * or -1. */
int bench_read_configs(const char* path, bench_config* out, int max);

/* One layer's host data for a step: routing from logits, everything in `dtype` storage. */
typedef struct bench_step {
  int64_t L, d, h, E, k;
  int32_t activation;
  moeblaze_dtype_t dtype;
  void *x, *logits, *w_gate_up, *w_down, *dy;        /* inputs */
  void *y, *dx, *dw_gate_up, *dw_down, *dlogits;     /* outputs */
} bench_step;

/* Max relative L2 error (over y, dx, dW_gate_up, dW_down, d logits) of the library's
 * outputs in `s` against the fp64 reference fed with the same (rounded) inputs. */
double bench_max_rel_error(const bench_step* s);

#endif
