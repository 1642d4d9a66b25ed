// cuBLASLt, opened at its first use rather than linked: libmoeblaze.so carries no DT_NEEDED on
// libcublasLt, so it loads (and its CPU engine runs) on machines without the CUDA libraries.
// The CUDA runtime is linked statically and opens the driver itself on first use.
#pragma once

#include <cublasLt.h>

namespace moeblaze {
inline namespace v0 {
namespace gemm {

// The entry points the library calls, resolved from one dlopen'ed libcublasLt.
struct CublasLtApi {
  decltype(&cublasLtCreate) create;
  decltype(&cublasLtDestroy) destroy;
  decltype(&cublasLtMatmul) matmul;
  decltype(&cublasLtMatmulAlgoGetHeuristic) algo_get_heuristic;
  decltype(&cublasLtMatmulDescCreate) desc_create;
  decltype(&cublasLtMatmulDescDestroy) desc_destroy;
  decltype(&cublasLtMatmulDescSetAttribute) desc_set_attribute;
  decltype(&cublasLtMatmulPreferenceCreate) pref_create;
  decltype(&cublasLtMatmulPreferenceDestroy) pref_destroy;
  decltype(&cublasLtMatmulPreferenceSetAttribute) pref_set_attribute;
  decltype(&cublasLtMatrixLayoutCreate) layout_create;
  decltype(&cublasLtMatrixLayoutDestroy) layout_destroy;
};

// The process's cuBLASLt, opened once (thread-safe). Looked for by its soname through the
// loader's usual search (LD_LIBRARY_PATH, the library's RUNPATH, ld.so.cache), then in the
// toolkit's library directory seen at build time. Throws NOT_SUPPORTED, naming the library and
// dlerror()'s reason, when it cannot be opened or lacks an entry point.
const CublasLtApi& cublaslt_api();

}  // namespace gemm
}  // namespace v0
}  // namespace moeblaze
