// What an expert-parallel layer holds of NCCL (docs/ep.md, "Transports"): the caller's
// communicator (borrowed, or owned when made from a unique id) and, made once at create, the
// memory its exchanges move rows through. NVLink: a device communicator with the LSA barriers
// its kernels use and one symmetric window (ncclMemAlloc + ncclCommWindowRegister). HOST: plain
// device memory (the same receive layout, then a staging area) that grouped ncclSend/ncclRecv
// read and write. Create and destroy are collective over the communicator.
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

// MOEBLAZE_ATTR_EP_TRANSPORT's values.
enum class EpTransport : int32_t { kAuto = 0, kNvlink = 1, kHost = 2 };

class EpComm {
 public:
  // Collective. NVLINK refuses (NOT_SUPPORTED) a group whose ranks are not all load/store peers;
  // AUTO takes HOST there. window_bytes: the NVLink window; host_bytes: HOST's memory.
  EpComm(ncclComm_t comm, bool owns_comm, EpTransport transport, size_t window_bytes, size_t host_bytes,
         int lsa_barriers, int device);
  ~EpComm();  // collective; never throws
  EpComm(const EpComm&) = delete;
  EpComm& operator=(const EpComm&) = delete;

  int rank() const { return rank_; }
  int ranks() const { return ranks_; }
  EpTransport transport() const { return transport_; }  // NVLINK or HOST, as made
  const ncclDevComm& device_comm() const { return dev_; }
  ncclWindow_t window() const { return window_; }
  char* local() const { return static_cast<char*>(mem_); }
  const NcclApi& api() const { return api_; }

  // Collective, synchronous (create only): every rank's value, in rank order.
  std::vector<uint64_t> all_gather(uint64_t value, cudaStream_t s) const;

  // HOST, collective, enqueued on s: every rank's `bytes` from send, in rank order into recv.
  void all_gather_bytes(const void* send, void* recv, size_t bytes, cudaStream_t s) const;
  // HOST, collective, enqueued on s: one NCCL group of the sends and receives below (byte
  // blocks; empty ones skipped).
  struct Block {
    void* data;
    size_t bytes;
    int32_t peer;
  };
  void send_recv(const Block* sends, int n_sends, const Block* recvs, int n_recvs, cudaStream_t s) const;

 private:
  void check(ncclResult_t r, const char* what) const;
  void release() noexcept;

  void make_window(size_t window_bytes, int lsa_barriers);
  void drop_window() noexcept;

  const NcclApi& api_;
  EpTransport transport_ = EpTransport::kNvlink;
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
