/* Every status has a name and a sentence; unknown values get a non-NULL fallback. */
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <setjmp.h>
#include <cmocka.h>

#include <string.h>

#include "test_util.h"

static void every_status_has_a_name_and_string(void** state) {
  (void)state;
  static const char* names[] = {
      "MOEBLAZE_STATUS_SUCCESS", "MOEBLAZE_STATUS_INVALID_ARGUMENT", "MOEBLAZE_STATUS_NOT_SUPPORTED",
      "MOEBLAZE_STATUS_INSUFFICIENT_WORKSPACE", "MOEBLAZE_STATUS_OUT_OF_HOST_MEMORY", "MOEBLAZE_STATUS_OUT_OF_DEVICE_MEMORY",
      "MOEBLAZE_STATUS_CUDA_ERROR", "MOEBLAZE_STATUS_CUBLAS_ERROR", "MOEBLAZE_STATUS_ARCH_MISMATCH",
      "MOEBLAZE_STATUS_VERSION_MISMATCH", "MOEBLAZE_STATUS_UNKNOWN_ATTRIBUTE", "MOEBLAZE_STATUS_ATTRIBUTE_TYPE_MISMATCH",
      "MOEBLAZE_STATUS_INTERNAL_ERROR"};
  for (int s = 0; s <= MOEBLAZE_STATUS_INTERNAL_ERROR; ++s) {
    assert_string_equal(moeblaze_status_name((moeblaze_status_t)s), names[s]);
    const char* text = moeblaze_status_string((moeblaze_status_t)s);
    assert_non_null(text);
    assert_true(strlen(text) > 10);
    /* names and sentences are distinct per status */
    for (int o = 0; o < s; ++o) {
      assert_string_not_equal(moeblaze_status_name((moeblaze_status_t)o), names[s]);
      assert_string_not_equal(moeblaze_status_string((moeblaze_status_t)o), text);
    }
  }
  /* the getters of static data leave the last-error message alone */
  assert_int_equal(moeblaze_config_create(NULL), MOEBLAZE_STATUS_INVALID_ARGUMENT);
  const char* msg = moeblaze_get_last_error_message();
  assert_true(msg[0] != '\0');
  (void)moeblaze_status_name(MOEBLAZE_STATUS_SUCCESS);
  (void)moeblaze_status_string(MOEBLAZE_STATUS_SUCCESS);
  assert_true(moeblaze_get_last_error_message()[0] != '\0');
}

static void unknown_status_values_are_safe(void** state) {
  (void)state;
  const int unknown[] = {13, 99, -1, (int)0x80000000, 0x7fffffff};
  for (size_t i = 0; i < sizeof unknown / sizeof unknown[0]; ++i) {
    assert_string_equal(moeblaze_status_name((moeblaze_status_t)unknown[i]), "MOEBLAZE_STATUS_UNKNOWN");
    assert_non_null(moeblaze_status_string((moeblaze_status_t)unknown[i]));
    assert_true(strlen(moeblaze_status_string((moeblaze_status_t)unknown[i])) > 0);
  }
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(every_status_has_a_name_and_string),
      cmocka_unit_test(unknown_status_values_are_safe),
  };
  return cmocka_run_group_tests_name("status", tests, NULL, NULL);
}
