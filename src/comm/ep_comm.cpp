#include "comm/ep_comm.hpp"

#include "cuda/cuda_check.hpp"
#include "cuda/device_guard.hpp"
#include "util/error.hpp"

namespace moeblaze {
inline namespace v0 {
namespace comm {

void EpComm::check(ncclResult_t r, const char* what) const {
  if (r != ncclSuccess) fail(Status::kInternalError, "NCCL %s failed: %s", what, api_.get_error_string(r));
}

EpComm::EpComm(ncclComm_t comm, bool owns_comm, EpTransport transport, size_t window_bytes, size_t host_bytes,
               int lsa_barriers, int device)
    : api_(nccl_api()), comm_(comm), owns_comm_(owns_comm), device_(device) {
  cuda::DeviceGuard guard(device_);
  try {
    check(api_.comm_count(comm_, &ranks_), "ncclCommCount");
    check(api_.comm_user_rank(comm_, &rank_), "ncclCommUserRank");
    int dev = -1;
    check(api_.comm_cu_device(comm_, &dev), "ncclCommCuDevice");
    if (dev != device_)
      fail(Status::kInvalidArgument, "the communicator's rank runs on device %d but the layer's DEVICE_ID is %d", dev, device_);
    transport_ = transport == EpTransport::kHost ? EpTransport::kHost : EpTransport::kNvlink;
    size_t bytes = host_bytes;
    if (transport_ == EpTransport::kNvlink) {
      make_window(window_bytes, lsa_barriers);
      bytes = window_bytes;
      if (dev_.lsaSize != ranks_) {
        if (transport == EpTransport::kNvlink)
          fail(Status::kNotSupported,
               "the NVLink transport needs every rank to be a load/store peer, but only %d of the %d ranks are "
               "(NCCL's LSA team); EP_TRANSPORT = HOST or AUTO moves rows with ncclSend/ncclRecv",
               dev_.lsaSize, ranks_);
        drop_window();  // AUTO: every rank sees the same team, so every rank falls back together
        transport_ = EpTransport::kHost;
        bytes = host_bytes;
      }
    }
    if (transport_ == EpTransport::kHost) MOEBLAZE_CUDA_CHECK(cudaMalloc(&mem_, host_bytes));
    // The counts area must start from zero flags; the rest is written before it is read.
    MOEBLAZE_CUDA_CHECK(cudaMemset(mem_, 0, bytes));
    MOEBLAZE_CUDA_CHECK(cudaDeviceSynchronize());
  } catch (...) {
    release();
    throw;
  }
}

void EpComm::make_window(size_t window_bytes, int lsa_barriers) {
  check(api_.mem_alloc(&mem_, window_bytes), "ncclMemAlloc");
  check(api_.comm_window_register(comm_, mem_, window_bytes, &window_, NCCL_WIN_COLL_SYMMETRIC), "ncclCommWindowRegister");
  ncclDevCommRequirements req = {};
  req.lsaBarrierCount = lsa_barriers;
  check(api_.dev_comm_create(comm_, &req, &dev_), "ncclDevCommCreate");
  dev_made_ = true;
}

void EpComm::drop_window() noexcept {
  cudaDeviceSynchronize();  // no step of this layer may still be using the window
  if (window_) api_.comm_window_deregister(comm_, window_);
  if (mem_) api_.mem_free(mem_);
  if (dev_made_) api_.dev_comm_destroy(comm_, &dev_);
  window_ = nullptr;
  mem_ = nullptr;
  dev_made_ = false;
  dev_ = ncclDevComm{};
}

void EpComm::all_gather_bytes(const void* send, void* recv, size_t bytes, cudaStream_t s) const {
  check(api_.all_gather(send, recv, bytes, ncclUint8, comm_, s), "ncclAllGather");
}

void EpComm::send_recv(const Block* sends, int n_sends, const Block* recvs, int n_recvs, cudaStream_t s) const {
  check(api_.group_start(), "ncclGroupStart");
  ncclResult_t r = ncclSuccess;
  for (int i = 0; i < n_sends && r == ncclSuccess; ++i)
    if (sends[i].bytes) r = api_.send(sends[i].data, sends[i].bytes, ncclUint8, sends[i].peer, comm_, s);
  for (int i = 0; i < n_recvs && r == ncclSuccess; ++i)
    if (recvs[i].bytes) r = api_.recv(recvs[i].data, recvs[i].bytes, ncclUint8, recvs[i].peer, comm_, s);
  const ncclResult_t end = api_.group_end();  // always closes the group
  check(r, "ncclSend/ncclRecv");
  check(end, "ncclGroupEnd");
}

std::vector<uint64_t> EpComm::all_gather(uint64_t value, cudaStream_t s) const {
  cuda::DeviceGuard guard(device_);
  uint64_t* buf = nullptr;
  MOEBLAZE_CUDA_CHECK(cudaMalloc(&buf, sizeof(uint64_t) * (ranks_ + 1)));
  std::vector<uint64_t> out(static_cast<size_t>(ranks_));
  try {
    MOEBLAZE_CUDA_CHECK(cudaMemcpyAsync(buf + ranks_, &value, sizeof(uint64_t), cudaMemcpyHostToDevice, s));
    check(api_.all_gather(buf + ranks_, buf, 1, ncclUint64, comm_, s), "ncclAllGather");
    MOEBLAZE_CUDA_CHECK(cudaMemcpyAsync(out.data(), buf, sizeof(uint64_t) * ranks_, cudaMemcpyDeviceToHost, s));
    MOEBLAZE_CUDA_CHECK(cudaStreamSynchronize(s));
  } catch (...) {
    cudaFree(buf);
    throw;
  }
  cudaFree(buf);
  return out;
}

void EpComm::release() noexcept {
  int previous = -1;
  cudaGetDevice(&previous);
  cudaSetDevice(device_);
  if (transport_ == EpTransport::kHost) {
    cudaDeviceSynchronize();  // no step of this layer may still be using its memory
    if (mem_) cudaFree(mem_);
    mem_ = nullptr;
  }
  drop_window();
  if (owns_comm_ && comm_) api_.comm_destroy(comm_);
  comm_ = nullptr;
  if (previous >= 0) cudaSetDevice(previous);
}

EpComm::~EpComm() { release(); }

}  // namespace comm
}  // namespace v0
}  // namespace moeblaze
