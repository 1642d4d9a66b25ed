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
#include <sched.h>
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

/* ---- log callbacks that call the library ---- */

typedef struct reentry {
  int calls;
  char outer_seen[256];
} reentry;

/* Makes a failing call of its own, then uninstalls itself: neither may deadlock, the nested
 * failure is not delivered back into the callback, and the outer call keeps its message. */
static void fail_then_uninstall(void* user, int32_t level, const char* func, const char* msg) {
  reentry* r = user;
  (void)level;
  (void)func;
  r->calls++;
  strncpy(r->outer_seen, msg, sizeof r->outer_seen - 1);
  moeblaze_config_create(NULL);
  moeblaze_set_log_callback(NULL, NULL, 0);
}

static void second_sink(void* user, int32_t level, const char* func, const char* msg) {
  (void)level;
  (void)func;
  (void)msg;
  ++*(int*)user;
}
static int second_calls;
static void replace_with_second(void* user, int32_t level, const char* func, const char* msg) {
  (void)func;
  (void)msg;
  (void)level;
  ++*(int*)user;
  moeblaze_set_log_callback(second_sink, &second_calls, MOEBLAZE_LOG_ERROR);
}

static void log_callback_reentry(void** state) {
  (void)state;
  reentry r;
  memset(&r, 0, sizeof r);
  assert_ok(moeblaze_set_log_callback(fail_then_uninstall, &r, MOEBLAZE_LOG_ERROR));
  moeblaze_config_t cfg;
  assert_ok(moeblaze_config_create(&cfg));
  assert_status(moeblaze_config_set_i64(cfg, MOEBLAZE_ATTR_TOP_K, -5), MOEBLAZE_STATUS_INVALID_ARGUMENT);
  assert_int_equal(r.calls, 1);
  assert_non_null(strstr(moeblaze_get_last_error_message(), "moeblaze_config_set_i64"));
  assert_string_equal(moeblaze_get_last_error_message(), r.outer_seen);
  /* it uninstalled itself */
  assert_status(moeblaze_config_set_i64(cfg, MOEBLAZE_ATTR_TOP_K, -5), MOEBLAZE_STATUS_INVALID_ARGUMENT);
  assert_int_equal(r.calls, 1);
  /* a callback that installs another one: the next message goes to the new one */
  int first_calls = 0;
  second_calls = 0;
  assert_ok(moeblaze_set_log_callback(replace_with_second, &first_calls, MOEBLAZE_LOG_ERROR));
  assert_status(moeblaze_config_set_i64(cfg, MOEBLAZE_ATTR_TOP_K, -5), MOEBLAZE_STATUS_INVALID_ARGUMENT);
  assert_status(moeblaze_config_set_i64(cfg, MOEBLAZE_ATTR_TOP_K, -5), MOEBLAZE_STATUS_INVALID_ARGUMENT);
  assert_int_equal(first_calls, 1);
  assert_int_equal(second_calls, 1);
  assert_ok(moeblaze_set_log_callback(NULL, NULL, 0));
  moeblaze_config_destroy(cfg);
}

/* Many threads fail (and log) while the main thread replaces and removes the callback: once
 * set_log_callback returns, the callback it replaced is running on no thread, so its
 * user_data may be freed. */
enum { LOGGERS = 6 };
typedef struct sink_state {
  pthread_mutex_t mutex;
  int inside, calls, retired;
  int late;  /* calls that began after the sink was retired */
} sink_state;
static void counting_sink(void* user, int32_t level, const char* func, const char* msg) {
  sink_state* s = user;
  (void)level;
  (void)func;
  (void)msg;
  pthread_mutex_lock(&s->mutex);
  if (s->retired) s->late++;
  s->inside++;
  s->calls++;
  pthread_mutex_unlock(&s->mutex);
  moeblaze_config_create(NULL); /* a failing call from inside the callback, on any thread */
  pthread_mutex_lock(&s->mutex);
  s->inside--;
  pthread_mutex_unlock(&s->mutex);
}
static int loggers_stop;
static void* log_noise(void* arg) {
  (void)arg;
  int32_t n;
  while (!__atomic_load_n(&loggers_stop, __ATOMIC_RELAXED)) moeblaze_get_device_count(77, &n);
  return NULL;
}

static void log_callback_replaced_under_load(void** state) {
  (void)state;
  pthread_t t[LOGGERS];
  __atomic_store_n(&loggers_stop, 0, __ATOMIC_RELAXED);
  for (int i = 0; i < LOGGERS; ++i) assert_int_equal(pthread_create(&t[i], NULL, log_noise, NULL), 0);
  for (int round = 0; round < 50; ++round) {
    sink_state* s = calloc(1, sizeof *s);
    pthread_mutex_init(&s->mutex, NULL);
    assert_ok(moeblaze_set_log_callback(counting_sink, s, MOEBLAZE_LOG_ERROR));
    for (int spin = 0; spin < 2000; ++spin) {
      pthread_mutex_lock(&s->mutex);
      const int calls = s->calls;
      pthread_mutex_unlock(&s->mutex);
      if (calls >= 3) break;
      sched_yield();
    }
    assert_ok(moeblaze_set_log_callback(NULL, NULL, 0));
    pthread_mutex_lock(&s->mutex);
    assert_int_equal(s->inside, 0);
    s->retired = 1;
    pthread_mutex_unlock(&s->mutex);
    for (int spin = 0; spin < 100; ++spin) sched_yield();
    pthread_mutex_lock(&s->mutex);
    assert_int_equal(s->late, 0);
    pthread_mutex_unlock(&s->mutex);
    pthread_mutex_destroy(&s->mutex);
    free(s);
  }
  __atomic_store_n(&loggers_stop, 1, __ATOMIC_RELAXED);
  for (int i = 0; i < LOGGERS; ++i) pthread_join(t[i], NULL);
}

int main(void) {
  const struct CMUnitTest tests[] = {cmocka_unit_test(shared_handle), cmocka_unit_test(log_callback_reentry),
                                     cmocka_unit_test(log_callback_replaced_under_load)};
  return cmocka_run_group_tests(tests, NULL, NULL);
}
