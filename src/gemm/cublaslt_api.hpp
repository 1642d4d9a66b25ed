// cuBLASLt, opened at its first use rather than linked: libmoeblaze.so carries no DT_NEEDED on
// libcublasLt, so it loads (and its CPU engine runs) on machines without the CUDA libraries.
// The CUDA runtime is linked statically and opens the driver itself on first use.
#pragma once

#include <cublasLt.h>

namespace moeblaze {
inline namespace v0 {
namespace gemm {

// The entry points the library calls: X(member, cuBLASLt symbol), one list for the struct
// below and for the loader's dlsym calls.
#define MOEBLAZE_CUBLASLT_ENTRY_POINTS(X)                          \
  X(create, cublasLtCreate)                                        \
  X(destroy, cublasLtDestroy)                                      \
  X(matmul, cublasLtMatmul)                                        \
  X(algo_get_heuristic, cublasLtMatmulAlgoGetHeuristic)            \
  X(desc_init, cublasLtMatmulDescInit_internal)                    \
  X(desc_set_attribute, cublasLtMatmulDescSetAttribute)            \
  X(pref_init, cublasLtMatmulPreferenceInit_internal)              \
  X(pref_set_attribute, cublasLtMatmulPreferenceSetAttribute)      \
  X(layout_init, cublasLtMatrixLayoutInit_internal)

// The entry points, resolved from one dlopen'ed libcublasLt.
struct CublasLtApi {
#define MOEBLAZE_CUBLASLT_MEMBER(member, symbol) decltype(&symbol) member;
  MOEBLAZE_CUBLASLT_ENTRY_POINTS(MOEBLAZE_CUBLASLT_MEMBER)
#undef MOEBLAZE_CUBLASLT_MEMBER
};

// The process's cuBLASLt, opened once (thread-safe). Looked for by its soname through the
// loader's usual search (LD_LIBRARY_PATH, the library's RUNPATH, ld.so.cache), then in the
// toolkit's library directory seen at build time. Throws NOT_SUPPORTED, naming the library and
// dlerror()'s reason, when it cannot be opened or lacks an entry point.
const CublasLtApi& cublaslt_api();

}  // namespace gemm
}  // namespace v0
}  // namespace moeblaze
