#include "gemm/cublaslt_api.hpp"

#include <dlfcn.h>

#include <mutex>
#include <string>

#include "util/error.hpp"

#ifndef MOEBLAZE_CUBLASLT_SONAME
#error "MOEBLAZE_CUBLASLT_SONAME (e.g. libcublasLt.so.13) comes from src/CMakeLists.txt"
#endif
#ifndef MOEBLAZE_CUDA_LIBRARY_DIR
#define MOEBLAZE_CUDA_LIBRARY_DIR ""
#endif

namespace moeblaze {
inline namespace v0 {
namespace gemm {
namespace {

struct Loaded {
  CublasLtApi api{};
  std::string error;  // empty when api is complete
};

template <class Fn>
void resolve(void* lib, const char* name, Fn& fn, std::string& error) {
  fn = reinterpret_cast<Fn>(dlsym(lib, name));
  if (!fn && error.empty()) error = std::string(MOEBLAZE_CUBLASLT_SONAME " has no ") + name;
}

Loaded load() {
  Loaded out;
  void* lib = dlopen(MOEBLAZE_CUBLASLT_SONAME, RTLD_NOW | RTLD_LOCAL);
  std::string why = lib ? "" : dlerror();
  if (!lib && MOEBLAZE_CUDA_LIBRARY_DIR[0] != '\0') {
    lib = dlopen(MOEBLAZE_CUDA_LIBRARY_DIR "/" MOEBLAZE_CUBLASLT_SONAME, RTLD_NOW | RTLD_LOCAL);
    if (!lib) why += std::string("; ") + dlerror();
  }
  if (!lib) {
    out.error = "cannot load " MOEBLAZE_CUBLASLT_SONAME " (the CUDA engines need cuBLASLt; put its directory on "
                "LD_LIBRARY_PATH): " + why;
    return out;
  }
#define MOEBLAZE_CUBLASLT_RESOLVE(member, symbol) resolve(lib, #symbol, out.api.member, out.error);
  MOEBLAZE_CUBLASLT_ENTRY_POINTS(MOEBLAZE_CUBLASLT_RESOLVE)
#undef MOEBLAZE_CUBLASLT_RESOLVE
  // The handle stays open for the process's life: cuBLASLt objects may outlive any one caller.
  return out;
}

}  // namespace

const CublasLtApi& cublaslt_api() {
  static Loaded loaded;
  static std::once_flag once;
  std::call_once(once, [] { loaded = load(); });
  if (!loaded.error.empty()) fail(Status::kNotSupported, "%s", loaded.error.c_str());
  return loaded.api;
}

}  // namespace gemm
}  // namespace v0
}  // namespace moeblaze
