// NCCL, opened when an expert-parallel layer is created rather than linked: libmoeblaze.so
// carries no DT_NEEDED on libnccl, so it loads, and serves single-GPU layers, where no NCCL is
// installed. Which NCCL: the one already loaded in the process (the one that made the caller's
// communicator, e.g. PyTorch's), else MOEBLAZE_NCCL_LIBRARY, else libnccl.so.2 through the
// loader's usual search, else the CUDA toolkit's library directory seen at build time.
#pragma once

#include <nccl.h>
#include <nccl_device.h>

#include <cstdint>
#include <string>

namespace moeblaze {
inline namespace v0 {
namespace comm {

// The entry points the library calls: X(member, NCCL symbol), one list for the struct below and
// for the loader's dlsym calls.
#define MOEBLAZE_NCCL_ENTRY_POINTS(X)                 \
  X(get_version, ncclGetVersion)                      \
  X(get_error_string, ncclGetErrorString)             \
  X(get_unique_id, ncclGetUniqueId)                   \
  X(comm_init_rank, ncclCommInitRank)                 \
  X(comm_destroy, ncclCommDestroy)                    \
  X(comm_count, ncclCommCount)                        \
  X(comm_user_rank, ncclCommUserRank)                 \
  X(comm_cu_device, ncclCommCuDevice)                 \
  X(comm_get_async_error, ncclCommGetAsyncError)      \
  X(mem_alloc, ncclMemAlloc)                          \
  X(mem_free, ncclMemFree)                            \
  X(comm_window_register, ncclCommWindowRegister)     \
  X(comm_window_deregister, ncclCommWindowDeregister) \
  X(all_gather, ncclAllGather)                        \
  X(all_to_all, ncclAlltoAll)                         \
  X(send, ncclSend)                                   \
  X(recv, ncclRecv)                                   \
  X(group_start, ncclGroupStart)                      \
  X(group_end, ncclGroupEnd)                          \
  X(dev_comm_create, ncclDevCommCreate)               \
  X(dev_comm_destroy, ncclDevCommDestroy)

struct NcclApi {
#define MOEBLAZE_NCCL_MEMBER(member, symbol) decltype(&symbol) member;
  MOEBLAZE_NCCL_ENTRY_POINTS(MOEBLAZE_NCCL_MEMBER)
#undef MOEBLAZE_NCCL_MEMBER
  int version = 0;   // ncclGetVersion() of the loaded library
  std::string path;  // where it was loaded from
};

// The process's NCCL, opened once (thread-safe). Throws NOT_SUPPORTED, naming what was tried and
// why it failed, when no NCCL can be opened, an entry point is missing, or the loaded NCCL is
// not one this build's device code can talk to (nccl_version_error).
const NcclApi& nccl_api();

// Why a runtime NCCL of version `runtime` cannot serve device code built against `built`
// (NCCL_VERSION_CODE: major * 10000 + minor * 100 + patch), or an empty string. The device
// communicator's layout is fixed at compile time before NCCL 2.31, so until then the major and
// minor versions must match; from 2.31 the runtime must be at least as new as the build. The
// symmetric windows and the device API need 2.28 or later.
std::string nccl_version_error(int built, int runtime);

}  // namespace comm
}  // namespace v0
}  // namespace moeblaze
