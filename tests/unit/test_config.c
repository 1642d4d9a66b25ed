/* The configuration object: introspection of every attribute, set/get round trips, defaults,
 * bounds, value types, unknown attributes, NULLs, and the handle's effective values. */
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <setjmp.h>
#include <cmocka.h>

#include <math.h>
#include <string.h>

#include "test_util.h"

static int cfg_setup(void** state) {
  moeblaze_config_t cfg = NULL;
  if (moeblaze_config_create(&cfg) != MOEBLAZE_STATUS_SUCCESS) return -1;
  *state = cfg;
  return 0;
}
static int cfg_teardown(void** state) { return (int)moeblaze_config_destroy(*state); }

static moeblaze_attr_info_t info_of(int attr) {
  moeblaze_attr_info_t info;
  memset(&info, 0, sizeof info);
  info.struct_size = sizeof info;
  assert_ok(moeblaze_attr_query((moeblaze_attr_t)attr, &info));
  return info;
}

static void every_attribute_round_trips(void** state) {
  moeblaze_config_t cfg = *state;
  for (int a = 0; a < MOEBLAZE_ATTR_COUNT; ++a) {
    moeblaze_attr_info_t info = info_of(a);
    assert_non_null(info.name);
    assert_true(strlen(info.name) > 0);
    assert_int_equal(info.struct_size, sizeof info);
    assert_int_equal(info.since_version,
                     MOEBLAZE_VERSION_ENCODE(0, a >= MOEBLAZE_ATTR_WINDOW_TOKENS ? 2 : 1, 0));
    if (info.value_type == MOEBLAZE_VALUE_I64) {
      int64_t v = -12345;
      if (!info.required) { /* the default reads back before anything is set */
        assert_ok(moeblaze_config_get_i64(cfg, (moeblaze_attr_t)a, &v));
        assert_int_equal(v, info.default_i64);
      }
      assert_ok(moeblaze_config_set_i64(cfg, (moeblaze_attr_t)a, info.max_i64));
      assert_ok(moeblaze_config_get_i64(cfg, (moeblaze_attr_t)a, &v));
      assert_int_equal(v, info.max_i64);
      assert_ok(moeblaze_config_set_i64(cfg, (moeblaze_attr_t)a, info.min_i64));
      assert_ok(moeblaze_config_get_i64(cfg, (moeblaze_attr_t)a, &v));
      assert_int_equal(v, info.min_i64);
      assert_status(moeblaze_config_set_i64(cfg, (moeblaze_attr_t)a, info.max_i64 + 1), MOEBLAZE_STATUS_INVALID_ARGUMENT);
      assert_status(moeblaze_config_set_i64(cfg, (moeblaze_attr_t)a, info.min_i64 - 1), MOEBLAZE_STATUS_INVALID_ARGUMENT);
      assert_status(moeblaze_config_set_f64(cfg, (moeblaze_attr_t)a, 1.0), MOEBLAZE_STATUS_ATTRIBUTE_TYPE_MISMATCH);
    } else if (info.value_type == MOEBLAZE_VALUE_F64) {
      double v = -1.0;
      assert_ok(moeblaze_config_get_f64(cfg, (moeblaze_attr_t)a, &v));
      assert_true(v == info.default_f64);
      assert_ok(moeblaze_config_set_f64(cfg, (moeblaze_attr_t)a, 0.125));
      assert_ok(moeblaze_config_get_f64(cfg, (moeblaze_attr_t)a, &v));
      assert_true(v == 0.125);
      assert_status(moeblaze_config_set_f64(cfg, (moeblaze_attr_t)a, -1.0), MOEBLAZE_STATUS_INVALID_ARGUMENT);
      assert_status(moeblaze_config_set_f64(cfg, (moeblaze_attr_t)a, NAN), MOEBLAZE_STATUS_INVALID_ARGUMENT);
      assert_status(moeblaze_config_set_i64(cfg, (moeblaze_attr_t)a, 1), MOEBLAZE_STATUS_ATTRIBUTE_TYPE_MISMATCH);
    } else {
      assert_int_equal(info.value_type, MOEBLAZE_VALUE_DTYPE);
      moeblaze_dtype_t v;
      assert_ok(moeblaze_config_get_dtype(cfg, (moeblaze_attr_t)a, &v));
      assert_ok(moeblaze_config_set_dtype(cfg, (moeblaze_attr_t)a, tu_f32));
      assert_ok(moeblaze_config_get_dtype(cfg, (moeblaze_attr_t)a, &v));
      assert_true(tu_dtype_eq(v, tu_f32));
      assert_status(moeblaze_config_set_dtype(cfg, (moeblaze_attr_t)a, tu_i32), MOEBLAZE_STATUS_INVALID_ARGUMENT);
      assert_status(moeblaze_config_set_i64(cfg, (moeblaze_attr_t)a, 1), MOEBLAZE_STATUS_ATTRIBUTE_TYPE_MISMATCH);
    }
  }
}

static void documented_defaults(void** state) {
  moeblaze_config_t cfg = *state;
  int64_t v;
  moeblaze_dtype_t t;
  assert_ok(moeblaze_config_get_i64(cfg, MOEBLAZE_ATTR_ACTIVATION, &v));
  assert_int_equal(v, MOEBLAZE_ACTIVATION_SWIGLU);
  assert_ok(moeblaze_config_get_i64(cfg, MOEBLAZE_ATTR_SAVE_POLICY, &v));
  assert_int_equal(v, MOEBLAZE_SAVE_PREACT);
  assert_ok(moeblaze_config_get_i64(cfg, MOEBLAZE_ATTR_DETERMINISTIC, &v));
  assert_int_equal(v, 1);
  assert_ok(moeblaze_config_get_i64(cfg, MOEBLAZE_ATTR_DEVICE_TYPE, &v));
  assert_int_equal(v, MOEBLAZE_DEVICE_CUDA);
  assert_ok(moeblaze_config_get_dtype(cfg, MOEBLAZE_ATTR_ACTIVATION_DTYPE, &t));
  assert_true(tu_dtype_eq(t, tu_bf16));
  assert_ok(moeblaze_config_get_dtype(cfg, MOEBLAZE_ATTR_ACCUM_DTYPE, &t));
  assert_true(tu_dtype_eq(t, tu_f32));
}

static void unknown_attributes_and_nulls(void** state) {
  moeblaze_config_t cfg = *state;
  int64_t v;
  double f;
  moeblaze_dtype_t t;
  const int unknown[] = {MOEBLAZE_ATTR_COUNT, 999, -1};
  for (size_t i = 0; i < 3; ++i) {
    moeblaze_attr_t a = (moeblaze_attr_t)unknown[i];
    assert_status(moeblaze_config_set_i64(cfg, a, 1), MOEBLAZE_STATUS_UNKNOWN_ATTRIBUTE);
    assert_status(moeblaze_config_get_i64(cfg, a, &v), MOEBLAZE_STATUS_UNKNOWN_ATTRIBUTE);
    assert_status(moeblaze_config_set_f64(cfg, a, 1.0), MOEBLAZE_STATUS_UNKNOWN_ATTRIBUTE);
    assert_status(moeblaze_config_get_f64(cfg, a, &f), MOEBLAZE_STATUS_UNKNOWN_ATTRIBUTE);
    assert_status(moeblaze_config_set_dtype(cfg, a, tu_f32), MOEBLAZE_STATUS_UNKNOWN_ATTRIBUTE);
    assert_status(moeblaze_config_get_dtype(cfg, a, &t), MOEBLAZE_STATUS_UNKNOWN_ATTRIBUTE);
    moeblaze_attr_info_t info;
    info.struct_size = sizeof info;
    assert_status(moeblaze_attr_query(a, &info), MOEBLAZE_STATUS_UNKNOWN_ATTRIBUTE);
  }
  assert_status(moeblaze_config_create(NULL), MOEBLAZE_STATUS_INVALID_ARGUMENT);
  assert_status(moeblaze_config_set_i64(NULL, MOEBLAZE_ATTR_TOP_K, 1), MOEBLAZE_STATUS_INVALID_ARGUMENT);
  assert_status(moeblaze_config_get_i64(cfg, MOEBLAZE_ATTR_TOP_K, NULL), MOEBLAZE_STATUS_INVALID_ARGUMENT);
  assert_status(moeblaze_config_get_f64(NULL, MOEBLAZE_ATTR_AUX_LOSS_COEFF, &f), MOEBLAZE_STATUS_INVALID_ARGUMENT);
  assert_status(moeblaze_config_get_dtype(cfg, MOEBLAZE_ATTR_WEIGHT_DTYPE, NULL), MOEBLAZE_STATUS_INVALID_ARGUMENT);
  assert_status(moeblaze_attr_query(MOEBLAZE_ATTR_TOP_K, NULL), MOEBLAZE_STATUS_INVALID_ARGUMENT);
  assert_ok(moeblaze_config_destroy(NULL));
}

static void accum_dtype_and_struct_size(void** state) {
  moeblaze_config_t cfg = *state;
  assert_status(moeblaze_config_set_dtype(cfg, MOEBLAZE_ATTR_ACCUM_DTYPE, tu_f16), MOEBLAZE_STATUS_NOT_SUPPORTED);
  moeblaze_attr_info_t info;
  memset(&info, 0x5a, sizeof info);
  const size_t too_small[] = {0, 4, offsetof(moeblaze_attr_info_t, name) + sizeof(const char*) - 1};
  for (size_t i = 0; i < 3; ++i) { /* smaller than the first two fields */
    info.struct_size = too_small[i];
    assert_status(moeblaze_attr_query(MOEBLAZE_ATTR_TOP_K, &info), MOEBLAZE_STATUS_VERSION_MISMATCH);
  }
  /* a newer, larger struct: the library writes only its own size */
  unsigned char big[sizeof(moeblaze_attr_info_t) + 32];
  memset(big, 0x77, sizeof big);
  ((moeblaze_attr_info_t*)big)->struct_size = sizeof big;
  assert_ok(moeblaze_attr_query(MOEBLAZE_ATTR_NUM_EXPERTS, (moeblaze_attr_info_t*)big));
  assert_string_equal(((moeblaze_attr_info_t*)big)->name, "num_experts");
  for (size_t i = sizeof(moeblaze_attr_info_t); i < sizeof big; ++i) assert_int_equal(big[i], 0x77);
  /* An older, shorter struct: only its prefix is written. */
  unsigned char buf[sizeof(moeblaze_attr_info_t) + 16];
  memset(buf, 0x5a, sizeof buf);
  moeblaze_attr_info_t* small = (moeblaze_attr_info_t*)buf;
  small->struct_size = offsetof(moeblaze_attr_info_t, value_type) + sizeof(int32_t);
  assert_ok(moeblaze_attr_query(MOEBLAZE_ATTR_TOP_K, small));
  assert_string_equal(small->name, "top_k");
  for (size_t i = small->struct_size; i < sizeof buf; ++i) assert_int_equal(buf[i], 0x5a);
}

static void handle_reads_back_effective_values(void** state) {
  (void)state;
  tu_layer l = tu_layer_default(8, 2, 16, 32, 64, MOEBLAZE_ACTIVATION_GELU);
  l.aux_coeff = 0.25;
  moeblaze_handle_t h;
  assert_ok(tu_create_cpu(&l, &h));
  int64_t v;
  double f;
  moeblaze_dtype_t t;
  assert_ok(moeblaze_handle_get_i64(h, MOEBLAZE_ATTR_ENGINE, &v));
  assert_int_equal(v, MOEBLAZE_ENGINE_CPU);
  assert_ok(moeblaze_handle_get_i64(h, MOEBLAZE_ATTR_DEVICE_ID, &v));
  assert_int_equal(v, 0);
  assert_ok(moeblaze_handle_get_i64(h, MOEBLAZE_ATTR_TOP_K, &v));
  assert_int_equal(v, 2);
  assert_ok(moeblaze_handle_get_i64(h, MOEBLAZE_ATTR_ACTIVATION, &v));
  assert_int_equal(v, MOEBLAZE_ACTIVATION_GELU);
  assert_ok(moeblaze_handle_get_f64(h, MOEBLAZE_ATTR_AUX_LOSS_COEFF, &f));
  assert_true(f == 0.25);
  assert_ok(moeblaze_handle_get_dtype(h, MOEBLAZE_ATTR_ACTIVATION_DTYPE, &t));
  assert_true(tu_dtype_eq(t, tu_f32));
  assert_ok(moeblaze_handle_get_i64(h, MOEBLAZE_ATTR_DEVICE_TYPE, &v));
  assert_int_equal(v, MOEBLAZE_DEVICE_CPU);
  /* every attribute reads back through the getter of its own type, and only that one */
  for (int a = 0; a < MOEBLAZE_ATTR_COUNT; ++a) {
    moeblaze_attr_info_t info = info_of(a);
    const moeblaze_status_t si = moeblaze_handle_get_i64(h, (moeblaze_attr_t)a, &v);
    const moeblaze_status_t sf = moeblaze_handle_get_f64(h, (moeblaze_attr_t)a, &f);
    const moeblaze_status_t sd = moeblaze_handle_get_dtype(h, (moeblaze_attr_t)a, &t);
    assert_int_equal(si, info.value_type == MOEBLAZE_VALUE_I64 ? MOEBLAZE_STATUS_SUCCESS : MOEBLAZE_STATUS_ATTRIBUTE_TYPE_MISMATCH);
    assert_int_equal(sf, info.value_type == MOEBLAZE_VALUE_F64 ? MOEBLAZE_STATUS_SUCCESS : MOEBLAZE_STATUS_ATTRIBUTE_TYPE_MISMATCH);
    assert_int_equal(sd, info.value_type == MOEBLAZE_VALUE_DTYPE ? MOEBLAZE_STATUS_SUCCESS : MOEBLAZE_STATUS_ATTRIBUTE_TYPE_MISMATCH);
    if (info.value_type == MOEBLAZE_VALUE_I64) {
      assert_true(v >= info.min_i64 && v <= info.max_i64);
    }
  }
  assert_status(moeblaze_handle_get_i64(h, (moeblaze_attr_t)777, &v), MOEBLAZE_STATUS_UNKNOWN_ATTRIBUTE);
  assert_status(moeblaze_handle_get_f64(h, MOEBLAZE_ATTR_TOP_K, &f), MOEBLAZE_STATUS_ATTRIBUTE_TYPE_MISMATCH);
  assert_status(moeblaze_handle_get_i64(NULL, MOEBLAZE_ATTR_TOP_K, &v), MOEBLAZE_STATUS_INVALID_ARGUMENT);
  assert_status(moeblaze_handle_get_dtype(h, MOEBLAZE_ATTR_WEIGHT_DTYPE, NULL), MOEBLAZE_STATUS_INVALID_ARGUMENT);
  assert_ok(moeblaze_destroy(h));
}

/* WINDOW_TOKENS is 0 (automatic) .. MAX_TOKENS: set checks the attribute's own bounds (the
 * order of the sets is free), create refuses a window above MAX_TOKENS. */
static void window_tokens_range(void** state) {
  (void)state;
  tu_layer l = tu_layer_default(4, 2, 8, 16, 64, MOEBLAZE_ACTIVATION_SILU);
  moeblaze_handle_t h = NULL;
  l.window_tokens = 64;
  assert_ok(tu_create_cpu(&l, &h));
  moeblaze_destroy(h);
  l.window_tokens = 65;
  assert_status(tu_create_cpu(&l, &h), MOEBLAZE_STATUS_INVALID_ARGUMENT);
  assert_non_null(strstr(moeblaze_get_last_error_message(), "window_tokens = 65 exceeds max_tokens = 64"));
  moeblaze_config_t cfg = NULL;
  assert_ok(moeblaze_config_create(&cfg));
  assert_status(moeblaze_config_set_i64(cfg, MOEBLAZE_ATTR_WINDOW_TOKENS, -1), MOEBLAZE_STATUS_INVALID_ARGUMENT);
  assert_status(moeblaze_config_set_i64(cfg, MOEBLAZE_ATTR_WINDOW_TOKENS, (int64_t)1 << 31), MOEBLAZE_STATUS_INVALID_ARGUMENT);
  moeblaze_config_destroy(cfg);
}

/* WINDOW_BYTES is 0 (automatic) .. 2^62, and create refuses it beside WINDOW_TOKENS. */
static void window_bytes_range(void** state) {
  (void)state;
  tu_layer l = tu_layer_default(4, 2, 8, 16, 64, MOEBLAZE_ACTIVATION_SILU);
  moeblaze_handle_t h = NULL;
  l.window_bytes = (int64_t)3 << 30;
  assert_ok(tu_create_cpu(&l, &h));
  int64_t v = 0;
  assert_ok(moeblaze_handle_get_i64(h, MOEBLAZE_ATTR_WINDOW_BYTES, &v));
  assert_int_equal(v, (int64_t)3 << 30);
  moeblaze_destroy(h);
  h = NULL;
  l.window_tokens = 32;
  assert_status(tu_create_cpu(&l, &h), MOEBLAZE_STATUS_INVALID_ARGUMENT);
  assert_null(h);
  assert_non_null(strstr(moeblaze_get_last_error_message(), "window_tokens = 32 and window_bytes = 3221225472 are both set"));
  moeblaze_config_t cfg = NULL;
  assert_ok(moeblaze_config_create(&cfg));
  assert_status(moeblaze_config_set_i64(cfg, MOEBLAZE_ATTR_WINDOW_BYTES, -1), MOEBLAZE_STATUS_INVALID_ARGUMENT);
  assert_status(moeblaze_config_set_i64(cfg, MOEBLAZE_ATTR_WINDOW_BYTES, ((int64_t)1 << 62) + 1),
                MOEBLAZE_STATUS_INVALID_ARGUMENT);
  assert_ok(moeblaze_config_set_i64(cfg, MOEBLAZE_ATTR_WINDOW_BYTES, (int64_t)1 << 62));
  moeblaze_config_destroy(cfg);
}

/* INFO (level 3) carries the decisions create takes: the engine, the device, and how. */
typedef struct info_log { int infos; char msg[512]; } info_log;
static void keep_info(void* user, int32_t level, const char* func, const char* msg) {
  info_log* c = user;
  if (level != MOEBLAZE_LOG_INFO || strcmp(func, "moeblaze_create") != 0) return;
  c->infos++;
  strncpy(c->msg, msg, sizeof c->msg - 1);
}
static void create_logs_its_decision(void** state) {
  (void)state;
  info_log c;
  memset(&c, 0, sizeof c);
  tu_layer l = tu_layer_default(4, 2, 8, 16, 64, MOEBLAZE_ACTIVATION_SILU);
  moeblaze_handle_t h = NULL;
  assert_ok(moeblaze_set_log_callback(keep_info, &c, MOEBLAZE_LOG_WARN));
  assert_ok(tu_create_cpu(&l, &h)); /* below the INFO level: nothing */
  moeblaze_destroy(h);
  assert_int_equal(c.infos, 0);
  assert_ok(moeblaze_set_log_callback(keep_info, &c, MOEBLAZE_LOG_INFO));
  assert_ok(tu_create_cpu(&l, &h));
  moeblaze_destroy(h);
  assert_ok(moeblaze_set_log_callback(NULL, NULL, 0));
  assert_int_equal(c.infos, 1);
  assert_non_null(strstr(c.msg, "engine cpu on the CPU"));
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test_setup_teardown(every_attribute_round_trips, cfg_setup, cfg_teardown),
      cmocka_unit_test_setup_teardown(documented_defaults, cfg_setup, cfg_teardown),
      cmocka_unit_test_setup_teardown(unknown_attributes_and_nulls, cfg_setup, cfg_teardown),
      cmocka_unit_test_setup_teardown(accum_dtype_and_struct_size, cfg_setup, cfg_teardown),
      cmocka_unit_test(handle_reads_back_effective_values),
      cmocka_unit_test(window_tokens_range),
      cmocka_unit_test(window_bytes_range),
      cmocka_unit_test(create_logs_its_decision),
  };
  return cmocka_run_group_tests_name("config", tests, NULL, NULL);
}
