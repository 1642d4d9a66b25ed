/* Version and build queries agree with the header and the VERSION file. */
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <setjmp.h>
#include <cmocka.h>

#include <stdio.h>
#include <string.h>

#include "test_util.h"

static void versions_agree(void** state) {
  (void)state;
  assert_int_equal(moeblaze_get_version(), MOEBLAZE_VERSION);
  assert_int_equal(MOEBLAZE_VERSION, MOEBLAZE_VERSION_ENCODE(0, 2, 0));
  assert_int_equal(moeblaze_get_abi_version(), MOEBLAZE_ABI_VERSION);
  char want[32];
  snprintf(want, sizeof want, "%d.%d.%d", MOEBLAZE_VERSION_MAJOR, MOEBLAZE_VERSION_MINOR, MOEBLAZE_VERSION_PATCH);
  assert_string_equal(moeblaze_get_version_string(), want);
  assert_string_equal(moeblaze_get_version_string(), "0.2.0");
  assert_int_equal(moeblaze_get_abi_version(), 0);
  assert_int_equal(MOEBLAZE_ABI_VERSION, 0);
  assert_int_equal(MOEBLAZE_VERSION, 2000u);
  /* the encoding orders versions */
  assert_true(MOEBLAZE_VERSION_ENCODE(0, 9, 999) < MOEBLAZE_VERSION_ENCODE(1, 0, 0));
  assert_true(MOEBLAZE_VERSION_ENCODE(0, 1, 999) < MOEBLAZE_VERSION_ENCODE(0, 2, 0));
  /* static strings: the same pointer on every call */
  assert_ptr_equal(moeblaze_get_version_string(), moeblaze_get_version_string());
}

static void build_info_names_the_version(void** state) {
  (void)state;
  const char* info = moeblaze_get_build_info();
  assert_non_null(info);
  assert_non_null(strstr(info, moeblaze_get_version_string()));
  assert_non_null(strstr(info, "ABI 0"));
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(versions_agree),
      cmocka_unit_test(build_info_names_the_version),
  };
  return cmocka_run_group_tests_name("version", tests, NULL, NULL);
}
