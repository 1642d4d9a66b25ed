// perf/ep-lsa-bench: the floor of expert parallelism's NVLink dispatch (docs/ep.md) on one host.
// Every GPU of the machine is a rank (one thread each, one NCCL communicator made from a unique
// id); each rank's kernel stores a block of S bytes into every peer's symmetric window (NCCL
// device API: ncclGetLsaPointer on a window from ncclMemAlloc + ncclCommWindowRegister) with
// 16-byte stores from C CTAs, or with bulk copies through shared memory, then meets the peers at
// an LSA barrier. It checks every received byte and prints, per CTA count and way of storing,
// the time of one exchange and the bytes sent to peers per second per GPU (the all-to-all
// bandwidth that dispatch and combine can reach).
// Usage: ep-lsa-bench [MiB per peer, default 32] [iterations, default 20]
#include <cuda_runtime.h>
#include <nccl.h>
#include <nccl_device.h>

#include <cuda/ptx>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <thread>
#include <vector>

namespace {

#define CK(call)                                                                                 \
  do {                                                                                           \
    cudaError_t e_ = (call);                                                                     \
    if (e_ != cudaSuccess) {                                                                     \
      std::fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #call, cudaGetErrorString(e_)); \
      std::exit(1);                                                                              \
    }                                                                                            \
  } while (0)
#define NK(call)                                                                                 \
  do {                                                                                           \
    ncclResult_t r_ = (call);                                                                    \
    if (r_ != ncclSuccess) {                                                                     \
      std::fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #call, ncclGetErrorString(r_)); \
      std::exit(1);                                                                              \
    }                                                                                            \
  } while (0)

constexpr int kThreads = 512;
constexpr int kMaxCtas = 64;

__device__ __forceinline__ uint32_t pattern(int src, int dst, size_t word) {
  return static_cast<uint32_t>(word * 2654435761u) ^ (static_cast<uint32_t>(src) << 24) ^ (static_cast<uint32_t>(dst) << 16);
}

__global__ void fill_kernel(uint4* send, int rank, int ranks, size_t words_per_peer) {
  const size_t n = words_per_peer / 4 * ranks;
  for (size_t i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += static_cast<size_t>(gridDim.x) * blockDim.x) {
    const int dst = static_cast<int>(i / (words_per_peer / 4));
    const size_t w = (i % (words_per_peer / 4)) * 4;
    send[i] = make_uint4(pattern(rank, dst, w), pattern(rank, dst, w + 1), pattern(rank, dst, w + 2), pattern(rank, dst, w + 3));
  }
}

// Block q of `send` (bytes_per_peer) goes to peer q's window at offset rank * bytes_per_peer.
// Peers are visited starting after this rank, so the ranks do not all write to one peer at once.
__global__ void __launch_bounds__(kThreads) exchange_kernel(const uint4* send, ncclWindow_t win, size_t bytes_per_peer,
                                                            ncclDevComm comm) {
  ncclLsaBarrierSession<ncclCoopCta> bar{ncclCoopCta(), comm, ncclTeamLsa(comm), comm.lsaBarrier, blockIdx.x};
  bar.sync(ncclCoopCta(), cuda::memory_order_relaxed);  // the peers' windows are free to be written
  const int rank = comm.rank, ranks = comm.nRanks;
  const size_t vecs = bytes_per_peer / 16;
  for (int i = 1; i <= ranks; ++i) {
    const int peer = (rank + i) % ranks;
    uint4* dst = static_cast<uint4*>(ncclGetLsaPointer(win, static_cast<size_t>(rank) * bytes_per_peer, peer));
    const uint4* src = send + static_cast<size_t>(peer) * vecs;
    for (size_t v = blockIdx.x * blockDim.x + threadIdx.x; v < vecs; v += static_cast<size_t>(gridDim.x) * blockDim.x)
      dst[v] = src[v];
  }
  bar.sync(ncclCoopCta(), cuda::memory_order_release);  // every store of every rank has landed
}

// The same exchange by bulk copies: one thread per CTA loads a chunk of the send block into a
// shared-memory stage (cp.async.bulk, completing on the stage's mbarrier) and stores it into the
// peer's window (cp.async.bulk shared -> global), with kStages chunks in flight, so each SM keeps
// far more bytes on NVLink than its threads' 16-byte stores can.
// kStages stages of kChunk bytes; loads run kAhead chunks ahead of the stores.
template <int kStages, uint32_t kChunk, uint32_t kAhead>
struct Bulk {
  static constexpr int kSmem = kStages * kChunk + kStages * 8;
};

template <int kStages, uint32_t kChunk, uint32_t kAhead>
__global__ void __launch_bounds__(32) exchange_tma_kernel(const uint4* send, ncclWindow_t win, size_t bytes_per_peer,
                                                          ncclDevComm comm) {
  extern __shared__ __align__(128) unsigned char smem[];
  uint64_t* full = reinterpret_cast<uint64_t*>(smem + kStages * kChunk);
  ncclLsaBarrierSession<ncclCoopCta> bar{ncclCoopCta(), comm, ncclTeamLsa(comm), comm.lsaBarrier, blockIdx.x};
  bar.sync(ncclCoopCta(), cuda::memory_order_relaxed);
  if (threadIdx.x == 0) {
    const uint32_t chunk = kChunk;  // the copies take their size by reference
    for (int i = 0; i < kStages; ++i) cuda::ptx::mbarrier_init(&full[i], 1);
    cuda::ptx::fence_mbarrier_init(cuda::ptx::sem_release, cuda::ptx::scope_cluster);
    const int rank = comm.rank, ranks = comm.nRanks;
    const size_t chunks_per_peer = bytes_per_peer / kChunk, total = chunks_per_peer * ranks;
    // This CTA's chunks are c = blockIdx.x + it * gridDim.x; chunk c's peer and offset.
    auto peer_of = [&](size_t c) { return (rank + 1 + static_cast<int>(c / chunks_per_peer)) % ranks; };
    auto load = [&](uint32_t it) {
      const size_t c = blockIdx.x + static_cast<size_t>(it) * gridDim.x;
      if (c >= total) return;
      const uint32_t st = it % kStages;
      cuda::ptx::mbarrier_arrive_expect_tx(cuda::ptx::sem_release, cuda::ptx::scope_cta, cuda::ptx::space_shared,
                                           &full[st], chunk);
      cuda::ptx::cp_async_bulk(cuda::ptx::space_cluster, cuda::ptx::space_global, smem + st * kChunk,
                               reinterpret_cast<const unsigned char*>(send) +
                                   static_cast<size_t>(peer_of(c)) * bytes_per_peer + (c % chunks_per_peer) * kChunk,
                               chunk, &full[st]);
    };
    // A stage is reloaded once the store that read it kStages - kAhead chunks earlier has
    // finished reading it.
    for (uint32_t i = 0; i < kAhead; ++i) load(i);
    for (uint32_t it = 0; blockIdx.x + static_cast<size_t>(it) * gridDim.x < total; ++it) {
      const size_t c = blockIdx.x + static_cast<size_t>(it) * gridDim.x;
      const uint32_t st = it % kStages;
      while (!cuda::ptx::mbarrier_try_wait_parity(&full[st], (it / kStages) & 1)) {
      }
      unsigned char* dst = static_cast<unsigned char*>(
          ncclGetLsaPointer(win, static_cast<size_t>(rank) * bytes_per_peer + (c % chunks_per_peer) * kChunk, peer_of(c)));
      cuda::ptx::cp_async_bulk(cuda::ptx::space_global, cuda::ptx::space_shared, dst, smem + st * kChunk, chunk);
      cuda::ptx::cp_async_bulk_commit_group();
      cuda::ptx::cp_async_bulk_wait_group_read(cuda::ptx::n32_t<kStages - kAhead - 1>{});
      load(it + kAhead);
    }
    cuda::ptx::cp_async_bulk_wait_group(cuda::ptx::n32_t<0>{});  // every store complete
  }
  __syncthreads();
  bar.sync(ncclCoopCta(), cuda::memory_order_release);
}

__global__ void check_kernel(const uint32_t* recv, int rank, int ranks, size_t words_per_peer, unsigned long long* bad) {
  const size_t n = words_per_peer * ranks;
  unsigned long long b = 0;
  for (size_t i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += static_cast<size_t>(gridDim.x) * blockDim.x)
    b += recv[i] != pattern(static_cast<int>(i / words_per_peer), rank, i % words_per_peer);
  if (b) atomicAdd(bad, b);
}

constexpr int kModes = 5;
const char* const kModeNames[kModes] = {
    "16-byte stores, 512 threads", "bulk, 4 x 32 KiB, loads 2 ahead", "bulk, 3 x 64 KiB, loads 1 ahead",
    "bulk, 6 x 32 KiB, loads 3 ahead", "bulk, 3 x 64 KiB, loads 2 ahead"};

struct Result {
  float ms[kModes][8] = {};
  unsigned long long bad = 0;
};

void run_rank(int rank, int ranks, ncclUniqueId id, size_t bytes_per_peer, int iters, const std::vector<int>& ctas,
              Result* out) {
  CK(cudaSetDevice(rank));
  ncclComm_t comm;
  NK(ncclCommInitRank(&comm, ranks, id, rank));
  void *send = nullptr, *recv = nullptr;
  CK(cudaMalloc(&send, bytes_per_peer * ranks));
  NK(ncclMemAlloc(&recv, bytes_per_peer * ranks));
  ncclWindow_t win;
  NK(ncclCommWindowRegister(comm, recv, bytes_per_peer * ranks, &win, NCCL_WIN_COLL_SYMMETRIC));
  ncclDevComm dev;
  ncclDevCommRequirements reqs = {};  // NCCL 2.28: a plain struct, zero meaning "none"
  reqs.lsaBarrierCount = kMaxCtas;
  NK(ncclDevCommCreate(comm, &reqs, &dev));
  cudaStream_t s;
  CK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  fill_kernel<<<264, 256, 0, s>>>(static_cast<uint4*>(send), rank, ranks, bytes_per_peer / 4);
  cudaEvent_t t0, t1;
  CK(cudaEventCreate(&t0));
  CK(cudaEventCreate(&t1));
  unsigned long long* bad = nullptr;
  CK(cudaMalloc(&bad, sizeof(*bad)));
  // Mode 0: plain stores; modes 1-4: bulk copies (kModes names them).
  auto* k1 = exchange_tma_kernel<4, 32 << 10, 2>;
  auto* k2 = exchange_tma_kernel<3, 64 << 10, 1>;
  auto* k3 = exchange_tma_kernel<6, 32 << 10, 3>;
  auto* k4 = exchange_tma_kernel<3, 64 << 10, 2>;
  CK(cudaFuncSetAttribute(k1, cudaFuncAttributeMaxDynamicSharedMemorySize, Bulk<4, 32 << 10, 2>::kSmem));
  CK(cudaFuncSetAttribute(k2, cudaFuncAttributeMaxDynamicSharedMemorySize, Bulk<3, 64 << 10, 1>::kSmem));
  CK(cudaFuncSetAttribute(k3, cudaFuncAttributeMaxDynamicSharedMemorySize, Bulk<6, 32 << 10, 3>::kSmem));
  CK(cudaFuncSetAttribute(k4, cudaFuncAttributeMaxDynamicSharedMemorySize, Bulk<3, 64 << 10, 2>::kSmem));
  auto launch = [&](int mode, int n) {
    const uint4* src = static_cast<const uint4*>(send);
    if (mode == 0) exchange_kernel<<<n, kThreads, 0, s>>>(src, win, bytes_per_peer, dev);
    if (mode == 1) k1<<<n, 32, Bulk<4, 32 << 10, 2>::kSmem, s>>>(src, win, bytes_per_peer, dev);
    if (mode == 2) k2<<<n, 32, Bulk<3, 64 << 10, 1>::kSmem, s>>>(src, win, bytes_per_peer, dev);
    if (mode == 3) k3<<<n, 32, Bulk<6, 32 << 10, 3>::kSmem, s>>>(src, win, bytes_per_peer, dev);
    if (mode == 4) k4<<<n, 32, Bulk<3, 64 << 10, 2>::kSmem, s>>>(src, win, bytes_per_peer, dev);
  };
  for (int mode = 0; mode < kModes; ++mode)
    for (size_t c = 0; c < ctas.size(); ++c) {
      CK(cudaMemsetAsync(recv, 0, bytes_per_peer * ranks, s));
      CK(cudaMemsetAsync(bad, 0, sizeof(*bad), s));
      launch(mode, ctas[c]);  // warm-up, then checked
      CK(cudaGetLastError());
      check_kernel<<<264, 256, 0, s>>>(static_cast<const uint32_t*>(recv), rank, ranks, bytes_per_peer / 4, bad);
      unsigned long long h = 0;
      CK(cudaMemcpyAsync(&h, bad, sizeof(h), cudaMemcpyDeviceToHost, s));
      CK(cudaStreamSynchronize(s));
      out->bad += h;
      CK(cudaEventRecord(t0, s));
      for (int i = 0; i < iters; ++i) launch(mode, ctas[c]);
      CK(cudaEventRecord(t1, s));
      CK(cudaEventSynchronize(t1));
      float ms = 0;
      CK(cudaEventElapsedTime(&ms, t0, t1));
      out->ms[mode][c] = ms / iters;
    }
  NK(ncclDevCommDestroy(comm, &dev));
  NK(ncclCommWindowDeregister(comm, win));
  NK(ncclMemFree(recv));
  CK(cudaFree(send));
  CK(cudaFree(bad));
  NK(ncclCommDestroy(comm));
}

}  // namespace

int main(int argc, char** argv) {
  const size_t mib = argc > 1 ? std::strtoull(argv[1], nullptr, 10) : 32;
  const int iters = argc > 2 ? std::atoi(argv[2]) : 20;
  int ranks = 0;
  CK(cudaGetDeviceCount(&ranks));
  if (ranks < 2) {
    std::printf("ep-lsa-bench needs at least 2 GPUs (found %d)\n", ranks);
    return 77;
  }
  int version = 0;
  NK(ncclGetVersion(&version));
  const size_t bytes = mib << 20;
  const std::vector<int> ctas = {4, 8, 16, 32};
  ncclUniqueId id;
  NK(ncclGetUniqueId(&id));
  std::vector<Result> res(ranks);
  std::vector<std::thread> threads;
  for (int r = 0; r < ranks; ++r) threads.emplace_back(run_rank, r, ranks, id, bytes, iters, ctas, &res[r]);
  for (std::thread& t : threads) t.join();
  unsigned long long bad = 0;
  for (const Result& r : res) bad += r.bad;
  std::printf("NCCL %d (headers %d), %d GPUs, %zu MiB to each peer, %d iterations\n", version, NCCL_VERSION_CODE, ranks,
              mib, iters);
  std::printf("| CTAs | stores | ms per exchange (slowest rank) | GB/s sent to peers per GPU |\n|---|---|---|---|\n");
  for (int mode = 0; mode < kModes; ++mode)
    for (size_t c = 0; c < ctas.size(); ++c) {
      float ms = 0;
      for (const Result& r : res) ms = std::max(ms, r.ms[mode][c]);
      std::printf("| %d | %s | %.3f | %.1f |\n", ctas[c], kModeNames[mode], ms,
                  static_cast<double>(bytes) * (ranks - 1) / (ms * 1e-3) / 1e9);
    }
  std::printf("received bytes checked: %s (%llu bad words)\n", bad ? "FAIL" : "all equal", bad);
  return bad ? 1 : 0;
}
