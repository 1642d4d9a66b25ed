/* One handle shared by 8 threads, each running forward + backward with its own buffers, while
 * two more threads create and destroy handles and provoke errors: every thread's results equal
 * the single-threaded ones bit for bit, and every thread reads back its own error messages.
 * Run under ThreadSanitizer by scripts/test.sh (configuration 3). */
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <setjmp.h>
#include <cmocka.h>

#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "moe_step.h"
#include "test_util.h"

enum { WORKERS = 8, CHURNERS = 2, STEPS = 12, L0 = 40, E0 = 6, K0 = 2, D0 = 16, H0 = 24 };

typedef struct worker {
  moeblaze_handle_t h;
  ms_problem p;
  const ms_problem* want;  /* the single-threaded results for the same inputs */
  int failures;
  char why[256];
} worker;

static int same_results(const ms_problem* a, const ms_problem* b) {
  const size_t xd = (size_t)(a->L * a->d) * 4, w = (size_t)(a->E * a->d * a->gh) * 4, l = (size_t)(a->L * a->E) * 4;
  return !memcmp(a->y, b->y, xd) && !memcmp(a->dx, b->dx, xd) && !memcmp(a->dwgu, b->dwgu, w) &&
         !memcmp(a->dlogits, b->dlogits, l);
}

static void* work(void* arg) {
  worker* w = arg;
  for (int s = 0; s < STEPS && !w->failures; ++s) {
    moeblaze_status_t st = ms_forward(w->h, &w->p);
    if (st == MOEBLAZE_STATUS_SUCCESS) st = ms_backward(w->h, &w->p);
    if (st != MOEBLAZE_STATUS_SUCCESS) {
      snprintf(w->why, sizeof w->why, "step %d: %s", s, moeblaze_get_last_error_message());
      w->failures++;
    } else if (!same_results(&w->p, w->want) || !ms_guards_intact(&w->p)) {
      snprintf(w->why, sizeof w->why, "step %d: results differ from the single-threaded run", s);
      w->failures++;
    } else if (moeblaze_get_last_error_message()[0] != '\0') {
      snprintf(w->why, sizeof w->why, "step %d: a successful call left a message", s);
      w->failures++;
    }
  }
  return NULL;
}

/* Creates and destroys handles, and fails calls on purpose: the message must name this
 * thread's own failure, whatever the workers do meanwhile. */
static void* churn(void* arg) {
  int* failures = arg;
  for (int i = 0; i < 40; ++i) {
    tu_layer l = tu_layer_default(E0 + i % 3, K0, D0, H0, L0, MOEBLAZE_ACTIVATION_SILU);
    moeblaze_handle_t h = NULL;
    if (tu_create_cpu(&l, &h) != MOEBLAZE_STATUS_SUCCESS) ++*failures;
    size_t bytes;
    if (moeblaze_get_saved_size(h, L0 + 1000 + i, &bytes) != MOEBLAZE_STATUS_INVALID_ARGUMENT) ++*failures;
    char want[32];
    snprintf(want, sizeof want, "%d", L0 + 1000 + i);
    if (!strstr(moeblaze_get_last_error_message(), want)) ++*failures;
    moeblaze_destroy(h);
  }
  return NULL;
}

static void shared_handle(void** state) {
  (void)state;
  tu_layer l = tu_layer_default(E0, K0, D0, H0, L0, MOEBLAZE_ACTIVATION_SWIGLU);
  l.num_threads = 2; /* the engine's own pool runs inside each caller thread too */
  moeblaze_handle_t h = NULL;
  assert_ok(tu_create_cpu(&l, &h));
  const uint64_t seed = tu_fresh_seed("threads");
  ms_problem want[2];
  for (int i = 0; i < 2; ++i) {
    ms_init(&want[i], h, L0, E0, K0, D0, H0, 1, seed + (uint64_t)i);
    assert_ok(ms_forward(h, &want[i]));
    assert_ok(ms_backward(h, &want[i]));
  }
  worker w[WORKERS];
  pthread_t th[WORKERS + CHURNERS];
  int churn_failures[CHURNERS] = {0};
  for (int i = 0; i < WORKERS; ++i) {
    memset(&w[i], 0, sizeof w[i]);
    w[i].h = h;
    w[i].want = &want[i % 2];
    ms_init(&w[i].p, h, L0, E0, K0, D0, H0, 1, seed + (uint64_t)(i % 2));
    assert_int_equal(pthread_create(&th[i], NULL, work, &w[i]), 0);
  }
  for (int i = 0; i < CHURNERS; ++i) assert_int_equal(pthread_create(&th[WORKERS + i], NULL, churn, &churn_failures[i]), 0);
  for (int i = 0; i < WORKERS + CHURNERS; ++i) pthread_join(th[i], NULL);
  for (int i = 0; i < WORKERS; ++i) {
    if (w[i].failures) fail_msg("worker %d: %s", i, w[i].why);
    ms_free(&w[i].p);
  }
  for (int i = 0; i < CHURNERS; ++i) assert_int_equal(churn_failures[i], 0);
  for (int i = 0; i < 2; ++i) ms_free(&want[i]);
  moeblaze_destroy(h);
}

int main(void) {
  const struct CMUnitTest tests[] = {cmocka_unit_test(shared_handle)};
  return cmocka_run_group_tests(tests, NULL, NULL);
}
