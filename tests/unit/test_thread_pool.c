/* The CPU engine's worker pool is persistent: threads are created once per handle, not per
 * parallel loop or per call, and are gone after moeblaze_destroy. The test counts every
 * pthread_create of the process by interposing it (this executable exports the symbol; the
 * library's std::thread reaches it through libstdc++), so it cannot pass on an engine that
 * starts threads per loop (about 11 per forward+backward step before this pool existed).
 * Skipped under ASan/TSan, whose runtimes intercept pthread_create themselves. */
#define _GNU_SOURCE
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <setjmp.h>
#include <cmocka.h>

#include <dlfcn.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "moe_step.h"
#include "test_util.h"

static atomic_int created;

#ifndef TU_SANITIZED
int pthread_create(pthread_t* t, const pthread_attr_t* attr, void* (*fn)(void*), void* arg) {
  typedef int (*real_fn)(pthread_t*, const pthread_attr_t*, void* (*)(void*), void*);
  static real_fn real;
  if (!real) real = (real_fn)dlsym(RTLD_NEXT, "pthread_create");
  atomic_fetch_add(&created, 1);
  return real(t, attr, fn, arg);
}
#endif

/* Threads of this process now, from /proc/self/status. */
static int live_threads(void) {
  FILE* f = fopen("/proc/self/status", "r");
  char line[256];
  int n = -1;
  while (f && fgets(line, sizeof line, f))
    if (sscanf(line, "Threads: %d", &n) == 1) break;
  if (f) fclose(f);
  return n;
}

enum { WORKERS = 4, L0 = 96, E0 = 6, K0 = 2, D0 = 16, H0 = 24 };

static void threads_do_not_grow_with_calls(void** state) {
  (void)state;
  tu_layer l = tu_layer_default(E0, K0, D0, H0, L0, MOEBLAZE_ACTIVATION_SWIGLU);
  l.num_threads = WORKERS;
  moeblaze_handle_t h;
  assert_ok(tu_create_cpu(&l, &h));
  ms_problem p;
  ms_init(&p, h, L0, E0, K0, D0, H0, 1, 11);
  const int base_live = live_threads();
  assert_int_equal(atomic_load(&created), 0); /* creating a handle starts nothing */
  assert_ok(ms_forward(h, &p));
  assert_ok(ms_backward(h, &p));
  const int after_first = atomic_load(&created);
  if (after_first < 1 || after_first > WORKERS - 1)
    fail_msg("the first step created %d threads; a pool of %d workers has %d", after_first, WORKERS, WORKERS - 1);
  for (int i = 0; i < 50; ++i) {
    assert_ok(ms_forward(h, &p));
    assert_ok(ms_backward(h, &p));
  }
  if (atomic_load(&created) != after_first)
    fail_msg("50 more steps created %d more threads", atomic_load(&created) - after_first);
  assert_int_equal(live_threads(), base_live + after_first); /* the pool stays up between calls */
  /* a second handle has its own pool; destroying both joins every pool thread */
  moeblaze_handle_t h2;
  assert_ok(tu_create_cpu(&l, &h2));
  assert_ok(ms_forward(h2, &p));
  assert_int_equal(atomic_load(&created), 2 * after_first);
  moeblaze_destroy(h2);
  moeblaze_destroy(h);
  assert_int_equal(live_threads(), base_live);
  ms_free(&p);
}

int main(void) {
#ifdef TU_SANITIZED
  printf("sanitizer build: pthread_create belongs to the sanitizer runtime; skipped\n");
  return 77;
#else
  const struct CMUnitTest tests[] = {cmocka_unit_test(threads_do_not_grow_with_calls)};
  return cmocka_run_group_tests(tests, NULL, NULL);
#endif
}
