// What an expert-parallel layer holds of NCCL (docs/ep.md, "Transports"): the caller's
// communicator (borrowed, or owned when made from a unique id), a device communicator with the
// LSA barriers its kernels use, and one symmetric window (ncclMemAlloc + ncclCommWindowRegister)
// made once at create. Create and destroy are collective over the communicator.
#pragma once

#include <cuda_runtime.h>
#include <nccl.h>
#include <nccl_device.h>

#include <cstddef>
#include <cstdint>
#include <vector>

#include "comm/nccl_api.hpp"

namespace moeblaze {
inline namespace v0 {
namespace comm {

class EpComm {
 public:
  // Collective. Refuses (NOT_SUPPORTED) a group whose ranks are not all load/store peers.
  EpComm(ncclComm_t comm, bool owns_comm, size_t window_bytes, int lsa_barriers, int device);
  ~EpComm();  // collective; never throws
  EpComm(const EpComm&) = delete;
  EpComm& operator=(const EpComm&) = delete;

  int rank() const { return rank_; }
  int ranks() const { return ranks_; }
  const ncclDevComm& device_comm() const { return dev_; }
  ncclWindow_t window() const { return window_; }
  char* local() const { return static_cast<char*>(mem_); }
  const NcclApi& api() const { return api_; }

  // Collective, synchronous (create only): every rank's value, in rank order.
  std::vector<uint64_t> all_gather(uint64_t value, cudaStream_t s) const;

 private:
  void check(ncclResult_t r, const char* what) const;
  void release() noexcept;

  const NcclApi& api_;
  ncclComm_t comm_ = nullptr;
  bool owns_comm_ = false;
  int rank_ = 0, ranks_ = 1, device_ = 0;
  ncclDevComm dev_{};
  bool dev_made_ = false;
  void* mem_ = nullptr;
  ncclWindow_t window_ = nullptr;
};

}  // namespace comm
}  // namespace v0
}  // namespace moeblaze
