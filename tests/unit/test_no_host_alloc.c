/* forward, backward and route allocate no host memory once a handle is warm: the only
 * allocations on the CPU engine's call path are its worker threads, started by the handle's
 * first parallel loop. The test counts every malloc, calloc, realloc and aligned allocation of
 * the process (pool threads included) by interposing them over glibc's own entry points (this
 * executable exports them). Skipped under ASan/TSan, whose runtimes own the allocator. */
#define _GNU_SOURCE
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <setjmp.h>
#include <cmocka.h>

#include <errno.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "moe_step.h"
#include "test_util.h"

static atomic_int counting;
static atomic_long allocations;

#ifndef TU_SANITIZED
extern void* __libc_malloc(size_t);
extern void* __libc_calloc(size_t, size_t);
extern void* __libc_realloc(void*, size_t);
extern void* __libc_memalign(size_t, size_t);
extern void __libc_free(void*);

static void count(void) {
  if (atomic_load_explicit(&counting, memory_order_relaxed)) atomic_fetch_add(&allocations, 1);
}
void* malloc(size_t n) { count(); return __libc_malloc(n); }
void* calloc(size_t n, size_t s) { count(); return __libc_calloc(n, s); }
void* realloc(void* p, size_t n) { count(); return __libc_realloc(p, n); }
void free(void* p) { __libc_free(p); }
void* memalign(size_t a, size_t n) { count(); return __libc_memalign(a, n); }
void* aligned_alloc(size_t a, size_t n) { count(); return __libc_memalign(a, n); }
int posix_memalign(void** out, size_t a, size_t n) {
  count();
  void* p = __libc_memalign(a, n);
  if (!p) return ENOMEM;
  *out = p;
  return 0;
}
#endif

enum { WORKERS = 4, L0 = 96, E0 = 6, K0 = 2, D0 = 16, H0 = 24, CALLS = 20 };

static long counted(void (*fn)(moeblaze_handle_t, ms_problem*), moeblaze_handle_t h, ms_problem* p) {
  atomic_store(&allocations, 0);
  atomic_store(&counting, 1);
  for (int i = 0; i < CALLS; ++i) fn(h, p);
  atomic_store(&counting, 0);
  return atomic_load(&allocations);
}

static moeblaze_status_t last;
static void forward(moeblaze_handle_t h, ms_problem* p) {
  if (!last) last = ms_forward(h, p);
}
static void backward(moeblaze_handle_t h, ms_problem* p) {
  if (!last) last = ms_backward(h, p);
}
static float gates[L0 * K0];
static void route(moeblaze_handle_t h, ms_problem* p) {
  moeblaze_arg_t a[8];
  ms_forward_args(p, a);
  /* logits, then the routing outputs */
  const moeblaze_arg_t r[4] = {a[1], a[5], a[6], tu_arg(MOEBLAZE_ARG_TOPK_WEIGHTS, tu_tensor(gates, tu_f32, 2, p->sk))};
  if (!last) last = moeblaze_route(h, r, 4, p->ws, p->ws_bytes, NULL);
  if (last) fprintf(stderr, "route: %s\n", moeblaze_get_last_error_message());
}

static void warm_calls_allocate_nothing(void** state) {
  (void)state;
#ifdef TU_SANITIZED
  skip();
#endif
  const int64_t activations[2] = {MOEBLAZE_ACTIVATION_SWIGLU, MOEBLAZE_ACTIVATION_GELU};
  for (int act = 0; act < 2; ++act)
    for (int threads = 1; threads <= WORKERS; threads += WORKERS - 1) {
      tu_layer l = tu_layer_default(E0, K0, D0, H0, L0, activations[act]);
      l.num_threads = threads;
      l.aux_coeff = 0.01;
      l.z_coeff = 0.001;
      moeblaze_handle_t h;
      assert_ok(tu_create_cpu(&l, &h));
      ms_problem p;
      ms_init(&p, h, L0, E0, K0, D0, H0, act == 0, tu_fresh_seed("no_host_alloc"));
      assert_ok(ms_forward(h, &p)); /* warm: the pool's threads start here */
      assert_ok(ms_backward(h, &p));
      last = MOEBLAZE_STATUS_SUCCESS;
      const long f = counted(forward, h, &p), b = counted(backward, h, &p), r = counted(route, h, &p);
      assert_int_equal(last, MOEBLAZE_STATUS_SUCCESS);
      if (f || b || r)
        fail_msg("%d threads, activation %lld: %d calls each allocated %ld (forward), %ld (backward), %ld (route) "
                 "times", threads, (long long)activations[act], CALLS, f, b, r);
      ms_free(&p);
      moeblaze_destroy(h);
    }
  /* the counter works: a failing call allocates its message */
  atomic_store(&allocations, 0);
  atomic_store(&counting, 1);
  moeblaze_status_t s = moeblaze_config_create(NULL);
  atomic_store(&counting, 0);
  assert_int_equal(s, MOEBLAZE_STATUS_INVALID_ARGUMENT);
  assert_true(atomic_load(&allocations) > 0);
}

int main(void) {
  const struct CMUnitTest tests[] = {cmocka_unit_test(warm_calls_allocate_nothing)};
  return cmocka_run_group_tests(tests, NULL, NULL);
}
