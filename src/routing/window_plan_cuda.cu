// The window plan's two steps: one block finds each expert's run of window tokens by binary
// search and scans the run lengths into the window's offsets; then one thread per window row
// looks up its call position, token, slot and gate.
#include <cub/block/block_scan.cuh>

// CUB lives in a private namespace (CUB_WRAPPED_NAMESPACE); CUB_NS_QUALIFIER names it.
namespace cubw = CUB_NS_QUALIFIER;

#include "cuda/chained_launch.cuh"
#include "cuda/cuda_check.hpp"
#include "routing/window_plan_cuda.hpp"
#include "util/offsets_cuda.cuh"

namespace moeblaze {
inline namespace v0 {
namespace routing {
namespace {

constexpr int kRangeThreads = 1024;

// The first position in [lo, hi) whose token is >= t (hi if none).
__device__ int32_t lower_bound(const int32_t* eti, int32_t lo, int32_t hi, int32_t t) {
  while (lo < hi) {
    const int32_t mid = lo + (hi - lo) / 2;
    if (eti[mid] < t) lo = mid + 1;
    else hi = mid;
  }
  return lo;
}

// call_off = the plan's offsets, sanitised as the GEMM schedule does; first[e] = the call
// position of expert e's first window row; win_off = the exclusive scan of the run lengths,
// capped at the window's rows. A window of the whole call (`whole`) takes each expert's whole
// range without searching it: the same runs for a plan that keeps validate_plan's rules.
__global__ void __launch_bounds__(kRangeThreads) window_ranges_kernel(const int32_t* off, const int32_t* eti, int32_t E,
                                                                      int32_t P, int32_t t0, int32_t t1, int32_t rows,
                                                                      bool whole, int32_t* call_off, int32_t* first,
                                                                      int32_t* win_off) {
  cuda::wait_for_prior_grids();
  cuda::allow_next_grid();
  using Scan = cubw::BlockScan<int32_t, kRangeThreads>;
  __shared__ typename Scan::TempStorage tmp;
  __shared__ int32_t carry;
  sanitize_offsets_block<kRangeThreads>(off, E, P, call_off);
  if (threadIdx.x == 0) carry = 0;
  __syncthreads();
  for (int32_t base = 0; base < E; base += kRangeThreads) {
    const int32_t e = base + threadIdx.x;
    int32_t count = 0;
    if (e < E) {
      const int32_t hi = call_off[e + 1];
      const int32_t a = whole ? call_off[e] : lower_bound(eti, call_off[e], hi, t0);
      first[e] = a;
      count = (whole ? hi : lower_bound(eti, a, hi, t1)) - a;
    }
    int32_t excl, total;
    Scan(tmp).ExclusiveSum(count, excl, total);
    if (e < E) win_off[e] = min(carry + excl, rows);
    __syncthreads();
    if (threadIdx.x == 0) carry = min(carry + total, rows);
    __syncthreads();
  }
  if (threadIdx.x == 0) win_off[E] = carry;
}

// A 16-byte load that stays where it is written. As relaxed gpu-scope loads, ptxas issues a
// step's loads in program order, all before the compares; as plain loads it sank the gates'
// loads below the compares, each waiting for the ids first.
__device__ __forceinline__ uint4 load16(const void* p) {
  uint4 v;
  asm volatile("ld.relaxed.gpu.global.v4.u32 {%0, %1, %2, %3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "l"(p));
  return v;
}
__device__ __forceinline__ uint32_t lane(const uint4& v, int i) {
  return i == 0 ? v.x : i == 1 ? v.y : i == 2 ? v.z : v.w;
}

// The slot j < k of token row `ids` (k entries) that holds g, first match, or -1, and its gate.
// kVec (4 or 8, dividing k, both rows 16-byte aligned): kVec slots and their gates a step, their
// 16-byte loads issued together, where one slot at a time waited for each load in turn.
template <int kVec>
__device__ int64_t find_slot(const int32_t* ids, const float* gates, int64_t k, int32_t g, float* gate) {
  if constexpr (kVec == 0) {
    for (int64_t j = 0; j < k; ++j)
      if (ids[j] == g) {
        *gate = gates[j];
        return j;
      }
  } else {
    for (int64_t j0 = 0; j0 < k; j0 += kVec) {
      uint4 v[kVec / 4], w[kVec / 4];
#pragma unroll
      for (int q = 0; q < kVec / 4; ++q) w[q] = load16(gates + j0 + 4 * q);  // first: the compares wait on ids
#pragma unroll
      for (int q = 0; q < kVec / 4; ++q) v[q] = load16(ids + j0 + 4 * q);
      int found = -1;  // the first match: selects from the last slot back, no branch per slot
      uint32_t gw = 0;
#pragma unroll
      for (int u = kVec - 1; u >= 0; --u)
        if (static_cast<int32_t>(lane(v[u / 4], u % 4)) == g) found = u, gw = lane(w[u / 4], u % 4);
      if (found >= 0) {
        *gate = __uint_as_float(gw);
        return j0 + found;
      }
    }
  }
  return -1;
}

// whole: a window of the whole call, whose row r is call position r (first[e] = win_off[e] =
// the sanitised offsets), so no search.
template <int kVec>
__global__ void window_rows_kernel(const int32_t* eti, const int32_t* tim, const float* gates, int64_t L, int64_t k,
                                   int32_t E, int32_t P, int32_t t0, int32_t t1, int32_t rows, bool whole,
                                   const int32_t* first, const int32_t* win_off, int32_t* call_row, int32_t* token,
                                   float* gate, int32_t* win_tim) {
  cuda::wait_for_prior_grids();
  cuda::allow_next_grid();
  const int32_t r = blockIdx.x * blockDim.x + threadIdx.x;
  if (r >= rows) return;
  if (r >= win_off[E]) {  // only a plan that breaks the rules leaves rows uncovered
    call_row[r] = 0;
    token[r] = -1;
    gate[r] = 0.f;
    return;
  }
  int32_t g = r;
  if (!whole) {
    int32_t lo = 0, hi = E;  // the expert whose window range holds r
    while (hi - lo > 1) {
      const int32_t mid = (lo + hi) / 2;
      if (win_off[mid] <= r) lo = mid;
      else hi = mid;
    }
    g = min(max(first[lo] + (r - win_off[lo]), 0), P - 1);
  }
  const int32_t t = eti[g];
  float gv = 0.f;
  if (t >= t0 && t < t1 && t < L) {
    const int64_t j = find_slot<kVec>(tim + t * k, gates + t * k, k, g, &gv);
    if (j >= 0) win_tim[(t - t0) * k + j] = r;
  }
  call_row[r] = g;
  token[r] = t;
  gate[r] = gv;
}

}  // namespace

WindowPlan carve_window_plan(Carver& c, int64_t E, int64_t window, int64_t k) {
  const size_t rows = static_cast<size_t>(window * k);
  WindowPlan w;
  w.offsets = c.take<int32_t>(static_cast<size_t>(E + 1));
  w.call_row = c.take<int32_t>(rows);
  w.token = c.take<int32_t>(rows);
  w.gate = c.take<float>(rows);
  w.token_index_map = c.take<int32_t>(rows);
  w.scratch = c.take<int32_t>(static_cast<size_t>(2 * E + 1));
  w.expert_call_row = w.scratch + E + 1;
  return w;
}

void build_window_plan_cuda(const RoutingPlan& plan, int64_t L, int64_t k, int64_t E, int64_t t0, int64_t rows,
                            const WindowPlan& w, cudaStream_t s) {
  const int32_t P = static_cast<int32_t>(L * k), wr = static_cast<int32_t>(rows * k);
  const int32_t a = static_cast<int32_t>(t0), b = static_cast<int32_t>(t0 + rows);
  const bool whole = t0 == 0 && rows == L;
  int32_t* call_off = w.scratch;
  int32_t* first = w.expert_call_row;
  cuda::launch_chained(window_ranges_kernel, 1, kRangeThreads, 0, s, plan.expert_token_offsets,
                       plan.expert_token_indices, static_cast<int32_t>(E), P, a, b, wr, whole, call_off, first,
                       w.offsets);
  MOEBLAZE_CUDA_LAUNCH_CHECK("window_ranges");
  if (wr == 0) return;
  MOEBLAZE_CUDA_CHECK(cudaMemsetAsync(w.token_index_map, 0xff, sizeof(int32_t) * wr, s));
  const bool rows16 = aligned16(plan.token_index_map) && aligned16(plan.gates);
  auto* kernel = rows16 && k % 8 == 0 ? window_rows_kernel<8> : rows16 && k % 4 == 0 ? window_rows_kernel<4>
                                                                                     : window_rows_kernel<0>;
  cuda::launch_chained(kernel, static_cast<unsigned>(ceil_div(wr, 256)), 256, 0, s, plan.expert_token_indices,
                       plan.token_index_map, plan.gates, L, k, static_cast<int32_t>(E), P, a, b, wr, whole, first,
                       w.offsets, w.call_row, w.token, w.gate, w.token_index_map);
  MOEBLAZE_CUDA_LAUNCH_CHECK("window_rows");
}

}  // namespace routing
}  // namespace v0
}  // namespace moeblaze
