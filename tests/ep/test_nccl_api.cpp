// NCCL opened at run time (src/comm/nccl_api): the version rule for the device code, on version
// pairs either side of NCCL 2.31 and the 2.28 floor; and the loader on this machine: with an
// NCCL installed, every entry point resolved from one library whose major.minor equal the
// headers'; without one, NOT_SUPPORTED with a message that says what was tried.
#include "comm/nccl_api.hpp"

#include <cstdio>
#include <cstring>

#include "util/error.hpp"

#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <setjmp.h>
extern "C" {
#include <cmocka.h>
}

using moeblaze::comm::nccl_version_error;

namespace {

bool refused(int built, int runtime, const char* mentions) {
  const std::string why = nccl_version_error(built, runtime);
  std::printf("built %d, runtime %d: %s\n", built, runtime, why.empty() ? "accepted" : why.c_str());
  return !why.empty() && (!mentions || why.find(mentions) != std::string::npos);
}

void version_rule(void**) {
  assert_true(nccl_version_error(22809, 22809).empty());
  assert_true(refused(22809, 22803, "2.28.3"));              // another patch of 2.28: its layout differs
  assert_true(refused(22809, 22903, "2.29.3"));              // a newer minor before 2.31
  assert_true(refused(22903, 22809, "2.28.9"));              // an older one
  assert_true(refused(22809, 23100, "2.31.0"));              // built before 2.31: the layout may differ
  assert_true(nccl_version_error(23100, 23203).empty());     // both from 2.31: versioned layout
  assert_true(refused(23200, 23100, "older"));
  assert_true(refused(22703, 22703, "too old"));             // no symmetric windows before 2.28
  assert_true(refused(22809, 2804, "2.8.4"));                // an NCCL 2.8 code (major * 1000 + ...)
}

void loader(void**) {
  try {
    const moeblaze::comm::NcclApi& api = moeblaze::comm::nccl_api();
    std::printf("NCCL %d loaded from %s\n", api.version, api.path.c_str());
    assert_false(api.path.empty());
    assert_int_equal(api.version / 100, NCCL_VERSION_CODE / 100);
#define CHECK_ENTRY(member, symbol) assert_non_null(reinterpret_cast<void*>(api.member));
    MOEBLAZE_NCCL_ENTRY_POINTS(CHECK_ENTRY)
#undef CHECK_ENTRY
    assert_non_null(api.get_error_string(ncclInvalidArgument));
    // The same object on every call.
    assert_ptr_equal(&moeblaze::comm::nccl_api(), &api);
  } catch (const moeblaze::Error& e) {
    std::printf("no usable NCCL here: %s\n", e.what());
    assert_int_equal(static_cast<int>(e.status()), static_cast<int>(moeblaze::Status::kNotSupported));
    assert_non_null(std::strstr(e.what(), "NCCL"));
  }
}

}  // namespace

int main() {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(version_rule),
      cmocka_unit_test(loader),
  };
  return cmocka_run_group_tests(tests, nullptr, nullptr);
}
