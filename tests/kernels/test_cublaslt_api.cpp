// The lazily opened cuBLASLt (gemm/cublaslt_api): where the CUDA toolkit is installed (CI's
// machine has it, and no GPU), the loader opens libcublasLt and resolves every entry point the
// library calls, twice to the same table. Needs no GPU: nothing is called.
#include "gemm/cublaslt_api.hpp"

#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <setjmp.h>
extern "C" {
#include <cmocka.h>
}

namespace {

void resolves_every_entry_point(void**) {
  const moeblaze::gemm::CublasLtApi& api = moeblaze::gemm::cublaslt_api();
#define MOEBLAZE_CHECK_ENTRY(member, symbol) assert_non_null(reinterpret_cast<void*>(api.member));
  MOEBLAZE_CUBLASLT_ENTRY_POINTS(MOEBLAZE_CHECK_ENTRY)
#undef MOEBLAZE_CHECK_ENTRY
  assert_ptr_equal(&api, &moeblaze::gemm::cublaslt_api());
}

}  // namespace

int main() {
  const struct CMUnitTest tests[] = {cmocka_unit_test(resolves_every_entry_point)};
  return cmocka_run_group_tests(tests, nullptr, nullptr);
}
