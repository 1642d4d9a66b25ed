// One block's sanitised copy of a routing plan's expert offsets, for the device consumers of a
// plan that may have come from a caller's buffer (the GEMM schedule, the window plan): every
// offset clamped to [0, total], offsets[0] = 0, and never decreasing (a running maximum). A
// valid plan's offsets come out unchanged.
#pragma once

#include <cub/block/block_scan.cuh>

#include <cstdint>

namespace moeblaze {
inline namespace v0 {

struct OffsetsMaxOp {
  __device__ int32_t operator()(int32_t a, int32_t b) const { return a > b ? a : b; }
};

// Called by all Threads threads of the block; out[0..E] is complete when it returns.
template <int Threads>
__device__ void sanitize_offsets_block(const int32_t* offsets, int32_t E, int32_t total, int32_t* out) {
  using Scan = CUB_NS_QUALIFIER::BlockScan<int32_t, Threads>;
  __shared__ typename Scan::TempStorage tmp;
  __shared__ int32_t carry;
  if (threadIdx.x == 0) carry = 0;
  __syncthreads();
  for (int32_t base = 0; base <= E; base += Threads) {
    const int32_t e = base + threadIdx.x;
    int32_t run, v = e <= E && e > 0 ? min(max(offsets[e], 0), total) : 0;
    Scan(tmp).InclusiveScan(v, run, OffsetsMaxOp());
    run = max(run, carry);
    if (e <= E) out[e] = run;
    __syncthreads();
    if (threadIdx.x == Threads - 1) carry = run;
    __syncthreads();
  }
}

}  // namespace v0
}  // namespace moeblaze
