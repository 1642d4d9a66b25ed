#include "comm/nccl_api.hpp"

#include <dlfcn.h>

#include <cstdlib>
#include <mutex>

#include "util/error.hpp"

#ifndef MOEBLAZE_CUDA_LIBRARY_DIR
#define MOEBLAZE_CUDA_LIBRARY_DIR ""
#endif

namespace moeblaze {
inline namespace v0 {
namespace comm {
namespace {

struct Loaded {
  NcclApi api{};
  std::string error;  // empty when api is usable
};

// NCCL_VERSION_CODE: major * 1000 + minor * 100 + patch up to 2.8, major * 10000 + minor * 100 +
// patch from 2.9.
void decode(int code, int* major, int* minor, int* patch) {
  const bool old = code < 10000;
  *major = old ? code / 1000 : code / 10000;
  *minor = old ? code / 100 % 10 : code / 100 % 100;
  *patch = code % 100;
}

std::string version_string(int code) {
  int major, minor, patch;
  decode(code, &major, &minor, &patch);
  return std::to_string(major) + "." + std::to_string(minor) + "." + std::to_string(patch);
}

// The NCCL already in the process: a loaded library that defines ncclGetVersion, reopened by its
// path (RTLD_NOLOAD) so that every symbol comes from that one library.
void* already_loaded(std::string* path) {
  void* sym = dlsym(RTLD_DEFAULT, "ncclGetVersion");
  Dl_info info;
  if (!sym || !dladdr(sym, &info) || !info.dli_fname) return nullptr;
  void* lib = dlopen(info.dli_fname, RTLD_NOW | RTLD_NOLOAD);
  if (lib) *path = info.dli_fname;
  return lib;
}

void* open_library(std::string* path, std::string* why) {
  if (void* lib = already_loaded(path)) return lib;
  std::string candidates[3];
  int n = 0;
  if (const char* env = std::getenv("MOEBLAZE_NCCL_LIBRARY"); env && *env) candidates[n++] = env;
  candidates[n++] = "libnccl.so.2";
  if (MOEBLAZE_CUDA_LIBRARY_DIR[0] != '\0') candidates[n++] = std::string(MOEBLAZE_CUDA_LIBRARY_DIR) + "/libnccl.so.2";
  for (int i = 0; i < n; ++i) {
    if (void* lib = dlopen(candidates[i].c_str(), RTLD_NOW | RTLD_LOCAL)) {
      *path = candidates[i];
      return lib;
    }
    *why += (why->empty() ? "" : "; ") + std::string(dlerror());
  }
  return nullptr;
}

Loaded load() {
  Loaded out;
  std::string why;
  void* lib = open_library(&out.api.path, &why);
  if (!lib) {
    out.error = "cannot load NCCL (expert parallelism needs libnccl.so.2; MOEBLAZE_NCCL_LIBRARY names another): " + why;
    return out;
  }
#define MOEBLAZE_NCCL_RESOLVE(member, symbol)                                                           \
  out.api.member = reinterpret_cast<decltype(out.api.member)>(dlsym(lib, #symbol));                   \
  if (!out.api.member && out.error.empty()) out.error = out.api.path + " has no " #symbol " (NCCL 2.28 or later is needed)";
  MOEBLAZE_NCCL_ENTRY_POINTS(MOEBLAZE_NCCL_RESOLVE)
#undef MOEBLAZE_NCCL_RESOLVE
  if (!out.error.empty()) return out;
  if (out.api.get_version(&out.api.version) != ncclSuccess) {
    out.error = out.api.path + ": ncclGetVersion failed";
    return out;
  }
  const std::string bad = nccl_version_error(NCCL_VERSION_CODE, out.api.version);
  if (!bad.empty()) out.error = out.api.path + ": " + bad;
  // The library stays open for the process's life: communicators may outlive any one handle.
  return out;
}

}  // namespace

std::string nccl_version_error(int built, int runtime) {
  int major, minor, patch, bmajor, bminor, bpatch;
  decode(runtime, &major, &minor, &patch);
  decode(built, &bmajor, &bminor, &bpatch);
  if (major < 2 || (major == 2 && minor < 28))
    return "NCCL " + version_string(runtime) + " is too old: expert parallelism needs NCCL 2.28 or later";
  // Before 2.31 the device API's structures (ncclDevCommRequirements, ncclDevComm) carry no size
  // or version and changed between patch releases: only the exact version built against is safe.
  const bool fixed_layout = built < NCCL_VERSION(2, 31, 0) || runtime < NCCL_VERSION(2, 31, 0);
  if (fixed_layout && runtime != built)
    return "NCCL " + version_string(runtime) + " is loaded but this libmoeblaze was built against NCCL " +
           version_string(built) +
           ": before NCCL 2.31 the versions must match exactly (build against the NCCL the process loads, e.g. "
           "PyTorch's nvidia-nccl wheel, with -DMOEBLAZE_NCCL_INCLUDE_DIR=<its include directory>)";
  if (!fixed_layout && runtime < built)
    return "NCCL " + version_string(runtime) + " is older than the NCCL " + version_string(built) +
           " this libmoeblaze was built against";
  return {};
}

const NcclApi& nccl_api() {
  static Loaded loaded;
  static std::once_flag once;
  std::call_once(once, [] { loaded = load(); });
  if (!loaded.error.empty()) fail(Status::kNotSupported, "%s", loaded.error.c_str());
  return loaded.api;
}

}  // namespace comm
}  // namespace v0
}  // namespace moeblaze
