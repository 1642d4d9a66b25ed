// The device send plan: tiles of kTile tokens, one thread per token. Pass 1 counts each tile's
// sends per destination (__syncthreads_count over the token's destination bit); one exclusive
// scan in (destination, tile) order gives every (destination, tile) block its first send;
// pass 2 places each token's sends by a block scan per destination, so sends to a rank are in
// token order.
#include <cub/block/block_scan.cuh>

#include "cuda/cuda_check.hpp"
#include "ep/owner.cuh"
#include "ep/send_plan_cuda.hpp"
#include "routing/scan_cuda.hpp"
#include "util/align.hpp"

// CUB lives in a private namespace (CUB_WRAPPED_NAMESPACE); CUB_NS_QUALIFIER names it.
namespace cubw = CUB_NS_QUALIFIER;

namespace moeblaze {
inline namespace v0 {
namespace ep {
namespace {

constexpr int kTile = 256;
constexpr int kMaxRanks = 64;  // destination masks are 64-bit

// The ranks token t reaches, as a bit mask.
__device__ uint64_t dest_mask(const int32_t* ids, int64_t t, int32_t k, int32_t P, int32_t epr) {
  uint64_t m = 0;
  for (int32_t j = 0; j < k; ++j) {
    const int32_t q = owner_of(ids[t * k + j], P, epr);
    if (q >= 0) m |= uint64_t{1} << q;
  }
  return m;
}

__global__ void __launch_bounds__(kTile) send_count_kernel(const int32_t* ids, int64_t L, int32_t k, int32_t P,
                                                           int32_t epr, int64_t tiles, int32_t* counts) {
  const int64_t t = blockIdx.x * static_cast<int64_t>(kTile) + threadIdx.x;
  const uint64_t m = t < L ? dest_mask(ids, t, k, P, epr) : 0;
  for (int32_t q = 0; q < P; ++q) {
    const int n = __syncthreads_count(static_cast<int>((m >> q) & 1));
    if (threadIdx.x == 0) counts[q * tiles + blockIdx.x] = n;
  }
}

__global__ void __launch_bounds__(kTile) send_place_kernel(const int32_t* ids, int64_t L, int32_t k, int32_t P,
                                                           int32_t epr, int64_t tiles, const int32_t* counts,
                                                           const int32_t* bases, int32_t c, int32_t* dest_start,
                                                           int32_t* send_token, int32_t* return_map,
                                                           int32_t* send_first) {
  using Scan = cubw::BlockScan<int32_t, kTile>;
  __shared__ typename Scan::TempStorage tmp;
  const int64_t t = blockIdx.x * static_cast<int64_t>(kTile) + threadIdx.x;
  const uint64_t m = t < L ? dest_mask(ids, t, k, P, epr) : 0;
  for (int32_t q = 0; q < P; ++q) {
    const int32_t mine = static_cast<int32_t>((m >> q) & 1);
    int32_t before;
    Scan(tmp).ExclusiveSum(mine, before);
    __syncthreads();
    if (mine) {
      const int32_t i = bases[q * tiles + blockIdx.x] + before;
      send_token[i] = static_cast<int32_t>(t);
      if (send_first) {
        int32_t first = epr;
        for (int32_t j = 0; j < k; ++j) {
          const int32_t e = ids[t * k + j];
          if (owner_of(e, P, epr) == q) first = min(first, e - q * epr);
        }
        send_first[i] = first;
      }
    }
  }
  if (t < L) {
    const int32_t n = __popcll(m);
    for (int32_t i = 0; i < c; ++i) return_map[t * c + i] = i < n ? static_cast<int32_t>(t * c + i) : -1;
  }
  if (blockIdx.x == 0 && threadIdx.x <= P) {
    const int32_t q = threadIdx.x;
    dest_start[q] = q < P ? bases[q * tiles] : bases[P * tiles - 1] + counts[P * tiles - 1];
  }
}

__global__ void empty_plan_kernel(int32_t P, int32_t* dest_start) {
  if (threadIdx.x <= P) dest_start[threadIdx.x] = 0;
}

__global__ void returned_gates_kernel(const int32_t* ids, int64_t L, int32_t k, int32_t P, int32_t epr, int32_t c,
                                      int32_t slots, const float* returned, float* dg_tok) {
  const int64_t t = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (t >= L) return;
  const uint64_t m = dest_mask(ids, t, k, P, epr);
  for (int32_t j = 0; j < k; ++j) {
    const int32_t e = ids[t * k + j], q = owner_of(e, P, epr);
    if (q < 0) {
      dg_tok[t * k + j] = 0.f;
      continue;
    }
    const int32_t i = __popcll(m & ((uint64_t{1} << q) - 1));  // q's place among the token's ranks
    int32_t r = 0;                                                // e's place among its experts on q
    for (int32_t jj = 0; jj < k; ++jj) {
      const int32_t o = ids[t * k + jj];
      r += owner_of(o, P, epr) == q && o < e;
    }
    dg_tok[t * k + j] = (i < c && r < slots) ? returned[(t * c + i) * slots + r] : 0.f;
  }
}

}  // namespace

size_t send_plan_scratch_bytes_cuda(int64_t L, int32_t P) {
  const int64_t n = std::max<int64_t>(ceil_div(L, kTile) * P, 1);
  Carver c;
  c.take<int32_t>(static_cast<size_t>(n));
  c.take<int32_t>(static_cast<size_t>(n));
  c.take<char>(routing::exclusive_scan_scratch_bytes(n));
  return c.size();
}

void build_send_plan_cuda(const int32_t* ids, int64_t L, int32_t k, int32_t P, int32_t epr, const DeviceSendPlan& plan,
                          void* scratch, cudaStream_t s) {
  if (P > kMaxRanks) fail(Status::kNotSupported, "expert parallelism over %d ranks (at most %d)", P, kMaxRanks);
  const int64_t tiles = ceil_div(L, kTile);
  if (tiles == 0) {
    empty_plan_kernel<<<1, kMaxRanks + 1, 0, s>>>(P, plan.dest_start);
    MOEBLAZE_CUDA_LAUNCH_CHECK("ep_empty_plan");
    return;
  }
  const int64_t n = tiles * P;
  Carver c(scratch);
  int32_t* counts = c.take<int32_t>(static_cast<size_t>(n));
  int32_t* bases = c.take<int32_t>(static_cast<size_t>(n));
  void* scan_tmp = c.take<char>(routing::exclusive_scan_scratch_bytes(n));
  const int32_t cmax = std::min(k, P);
  send_count_kernel<<<static_cast<unsigned>(tiles), kTile, 0, s>>>(ids, L, k, P, epr, tiles, counts);
  MOEBLAZE_CUDA_LAUNCH_CHECK("ep_send_count");
  routing::exclusive_scan_cuda(counts, bases, n, scan_tmp, s);
  send_place_kernel<<<static_cast<unsigned>(tiles), kTile, 0, s>>>(ids, L, k, P, epr, tiles, counts, bases, cmax,
                                                                   plan.dest_start, plan.send_token, plan.return_map,
                                                                   plan.send_first);
  MOEBLAZE_CUDA_LAUNCH_CHECK("ep_send_place");
}

void gather_returned_gates_cuda(const int32_t* ids, int64_t L, int32_t k, int32_t P, int32_t epr, int32_t slots,
                                const float* returned, float* dg_tok, cudaStream_t s) {
  if (L == 0) return;
  returned_gates_kernel<<<static_cast<unsigned>(ceil_div(L, 256)), 256, 0, s>>>(ids, L, k, P, epr, std::min(k, P),
                                                                                slots, returned, dg_tok);
  MOEBLAZE_CUDA_LAUNCH_CHECK("ep_returned_gates");
}

}  // namespace ep
}  // namespace v0
}  // namespace moeblaze
