/* The expert-parallel entry points' refusals and the symmetric-size query, on any machine: NULL
 * pointers, a NULL communicator, E not divisible by the ranks, and the size against the window
 * formula of docs/ep.md. A build without expert parallelism answers NOT_SUPPORTED. */
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <setjmp.h>
#include <cmocka.h>

#include <string.h>

#include "test_util.h"

static moeblaze_config_t config(int64_t E, int64_t k, int64_t d, int64_t h, int64_t L, int64_t act) {
  moeblaze_config_t cfg = NULL;
  assert_ok(moeblaze_config_create(&cfg));
  assert_ok(moeblaze_config_set_i64(cfg, MOEBLAZE_ATTR_NUM_EXPERTS, E));
  assert_ok(moeblaze_config_set_i64(cfg, MOEBLAZE_ATTR_TOP_K, k));
  assert_ok(moeblaze_config_set_i64(cfg, MOEBLAZE_ATTR_HIDDEN_SIZE, d));
  assert_ok(moeblaze_config_set_i64(cfg, MOEBLAZE_ATTR_FFN_HIDDEN_SIZE, h));
  assert_ok(moeblaze_config_set_i64(cfg, MOEBLAZE_ATTR_MAX_TOKENS, L));
  assert_ok(moeblaze_config_set_i64(cfg, MOEBLAZE_ATTR_ACTIVATION, act));
  return cfg;
}

static int built_with_ep(void) {
  moeblaze_config_t cfg = config(8, 2, 64, 32, 16, MOEBLAZE_ACTIVATION_SILU);
  size_t bytes = 0;
  const moeblaze_status_t s = moeblaze_get_symmetric_size(cfg, 2, &bytes);
  moeblaze_config_destroy(cfg);
  return s != MOEBLAZE_STATUS_NOT_SUPPORTED;
}

static void create_refuses_null_pointers(void** state) {
  (void)state;
  moeblaze_config_t cfg = config(8, 2, 64, 32, 16, MOEBLAZE_ACTIVATION_SILU);
  moeblaze_handle_t h = (moeblaze_handle_t)(uintptr_t)1;
  int comm = 0;
  assert_int_equal(moeblaze_create_ep(NULL, cfg, &comm, NULL), MOEBLAZE_STATUS_INVALID_ARGUMENT);
  assert_int_equal(moeblaze_create_ep(&h, NULL, &comm, NULL), MOEBLAZE_STATUS_INVALID_ARGUMENT);
  assert_int_equal(moeblaze_create_ep(&h, cfg, NULL, NULL), MOEBLAZE_STATUS_INVALID_ARGUMENT);
  assert_null(h);
  assert_non_null(strstr(moeblaze_get_last_error_message(), "nccl_comm"));
  moeblaze_config_destroy(cfg);
}

static void create_from_unique_id_refuses_bad_arguments(void** state) {
  (void)state;
  moeblaze_config_t cfg = config(8, 2, 64, 32, 16, MOEBLAZE_ACTIVATION_SILU);
  unsigned char id[128] = {0};
  moeblaze_handle_t h = (moeblaze_handle_t)(uintptr_t)1;
  assert_int_equal(moeblaze_create_ep_from_unique_id(NULL, cfg, id, 128, 2, 0, NULL), MOEBLAZE_STATUS_INVALID_ARGUMENT);
  assert_int_equal(moeblaze_create_ep_from_unique_id(&h, cfg, NULL, 128, 2, 0, NULL), MOEBLAZE_STATUS_INVALID_ARGUMENT);
  assert_null(h);
  assert_int_equal(moeblaze_create_ep_from_unique_id(&h, cfg, id, 128, 0, 0, NULL), MOEBLAZE_STATUS_INVALID_ARGUMENT);
  assert_int_equal(moeblaze_create_ep_from_unique_id(&h, cfg, id, 128, 2, 2, NULL), MOEBLAZE_STATUS_INVALID_ARGUMENT);
  assert_non_null(strstr(moeblaze_get_last_error_message(), "rank"));
  assert_int_equal(moeblaze_create_ep_from_unique_id(&h, cfg, id, 128, 2, -1, NULL), MOEBLAZE_STATUS_INVALID_ARGUMENT);
  if (built_with_ep()) {  /* checked before any NCCL call: no device or library is touched */
    assert_int_equal(moeblaze_create_ep_from_unique_id(&h, cfg, id, 64, 2, 0, NULL), MOEBLAZE_STATUS_INVALID_ARGUMENT);
    assert_non_null(strstr(moeblaze_get_last_error_message(), "unique_id_bytes"));
  } else {
    assert_int_equal(moeblaze_create_ep_from_unique_id(&h, cfg, id, 128, 2, 0, NULL), MOEBLAZE_STATUS_NOT_SUPPORTED);
  }
  assert_null(h);
  moeblaze_config_destroy(cfg);
}

static size_t up(size_t v, size_t a) { return (v + a - 1) / a * a; }

static void symmetric_size_follows_the_formula(void** state) {
  (void)state;
  size_t bytes = 0;
  moeblaze_config_t cfg = config(12, 5, 96, 40, 300, MOEBLAZE_ACTIVATION_SWIGLU);
  assert_int_equal(moeblaze_get_symmetric_size(NULL, 2, &bytes), MOEBLAZE_STATUS_INVALID_ARGUMENT);
  assert_int_equal(moeblaze_get_symmetric_size(cfg, 2, NULL), MOEBLAZE_STATUS_INVALID_ARGUMENT);
  assert_int_equal(moeblaze_get_symmetric_size(cfg, 0, &bytes), MOEBLAZE_STATUS_INVALID_ARGUMENT);
  if (!built_with_ep()) {
    assert_int_equal(moeblaze_get_symmetric_size(cfg, 2, &bytes), MOEBLAZE_STATUS_NOT_SUPPORTED);
    moeblaze_config_destroy(cfg);
    return;
  }
  assert_int_equal(moeblaze_get_symmetric_size(cfg, 5, &bytes), MOEBLAZE_STATUS_INVALID_ARGUMENT);  /* 12 % 5 */
  assert_non_null(strstr(moeblaze_get_last_error_message(), "12"));
  const int64_t ranks[] = {1, 2, 3, 4, 6, 12};
  for (size_t i = 0; i < sizeof ranks / sizeof ranks[0]; ++i) {
    const size_t P = (size_t)ranks[i], E = 12, k = 5, d = 96, L = 300, es = 2;
    const size_t kl = k < E / P ? k : E / P, c = k < P ? k : P, R = P * L;
    size_t at = 0;
    at = up(at + P * (P + 1) * 4, 256);   /* counts and flags */
    at = up(at + R * d * es, 256);        /* received rows */
    at = up(at + R * 8, 256);             /* each row's token and place */
    at = up(at + R * kl * 4, 256);        /* local expert ids */
    at = up(at + R * kl * 4, 256);        /* gates */
    at = up(at + L * c * d * es, 256);    /* returned rows */
    at = up(at + L * c * kl * 4, 256);    /* returned gate gradients */
    at = up(at + R * 4, 256);             /* row-arrival marks */
    assert_ok(moeblaze_get_symmetric_size(cfg, (int32_t)P, &bytes));
    assert_int_equal(bytes, up(at, 4096));
  }
  moeblaze_config_destroy(cfg);
}

/* A single-device handle reports EP_SIZE 1 and EP_RANK 0; a config that expects a group is
 * refused by moeblaze_create (it asks for moeblaze_create_ep). */
static void single_device_handles_report_one_rank(void** state) {
  (void)state;
  tu_layer l = tu_layer_default(4, 2, 8, 16, 32, MOEBLAZE_ACTIVATION_SILU);
  moeblaze_handle_t h = NULL;
  assert_ok(tu_create_cpu(&l, &h));
  int64_t v = -7;
  assert_ok(moeblaze_handle_get_i64(h, MOEBLAZE_ATTR_EP_SIZE, &v));
  assert_int_equal(v, 1);
  assert_ok(moeblaze_handle_get_i64(h, MOEBLAZE_ATTR_EP_RANK, &v));
  assert_int_equal(v, 0);
  assert_ok(moeblaze_handle_get_i64(h, MOEBLAZE_ATTR_EP_MAX_RECV_TOKENS, &v));
  assert_int_equal(v, 0);
  moeblaze_destroy(h);
  moeblaze_config_t cfg = config(4, 2, 8, 16, 32, MOEBLAZE_ACTIVATION_SILU);
  assert_ok(moeblaze_config_set_i64(cfg, MOEBLAZE_ATTR_DEVICE_TYPE, MOEBLAZE_DEVICE_CPU));
  assert_ok(moeblaze_config_set_i64(cfg, MOEBLAZE_ATTR_EP_SIZE, 2));
  h = NULL;
  assert_int_equal(moeblaze_create(&h, cfg), MOEBLAZE_STATUS_INVALID_ARGUMENT);
  assert_null(h);
  assert_non_null(strstr(moeblaze_get_last_error_message(), "moeblaze_create_ep"));
  assert_ok(moeblaze_config_set_i64(cfg, MOEBLAZE_ATTR_EP_SIZE, 1));  /* a group of one is a single device */
  assert_ok(moeblaze_create(&h, cfg));
  moeblaze_destroy(h);
  assert_int_equal(moeblaze_config_set_i64(cfg, MOEBLAZE_ATTR_EP_COMM_SMS, 129), MOEBLAZE_STATUS_INVALID_ARGUMENT);
  assert_int_equal(moeblaze_config_set_i64(cfg, MOEBLAZE_ATTR_EP_RANK, -2), MOEBLAZE_STATUS_INVALID_ARGUMENT);
  moeblaze_config_destroy(cfg);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(single_device_handles_report_one_rank),
      cmocka_unit_test(create_refuses_null_pointers),
      cmocka_unit_test(create_from_unique_id_refuses_bad_arguments),
      cmocka_unit_test(symmetric_size_follows_the_formula),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
