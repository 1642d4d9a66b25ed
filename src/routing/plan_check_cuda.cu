// Device-side checks of a routing plan that came from outside (a caller's saved buffer). Each
// thread tests one slot or one offset and reads an index only after checking it is in range,
// so any bytes in the buffer are safe to check. A violation sets bit kPlanInvalid of *flag.
#include "cuda/chained_launch.cuh"
#include "cuda/cuda_check.hpp"
#include "routing/plan_check_cuda.hpp"
#include "util/align.hpp"

namespace moeblaze {
inline namespace v0 {
namespace routing {
namespace {

__global__ void validate_plan_kernel(const int32_t* tei, const int32_t* eti, const int32_t* tim, const int32_t* off,
                                     int64_t L, int64_t k, int64_t E, bool empty_slots, int32_t* flag) {
  cuda::wait_for_prior_grids();
  cuda::allow_next_grid();
  const int64_t P = L * k;
  // Slots [0, P), offsets [P, P + E + 1), and with empty slots the positions [P + E + 1, 2 P + E + 1).
  const int64_t n = P + E + 1 + (empty_slots ? P : 0);
  bool bad = false;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    if (i >= P + E + 1) {
      // Every position below off[E] is some slot's: its token is in range and one of the token's
      // slots maps to it. With every slot full, off[E] == P makes the slots' injection onto the
      // positions a bijection; with empty slots this check does.
      const int64_t p = i - (P + E + 1);
      const int32_t end = off[E];
      if (p >= end || end < 0 || end > P) continue;  // a bad off[E] is the offsets' own error
      const int32_t t = eti[p];
      if (t < 0 || t >= L) { bad = true; continue; }
      bool hit = false;
      for (int64_t q = 0; q < k; ++q) hit |= tim[t * k + q] == p;
      bad |= !hit;
      continue;
    }
    if (i >= P) {  // offsets: 0 first, never decreasing, L*k last (at most L*k with empty slots)
      const int64_t e = i - P;
      if (e == 0) bad |= off[0] != 0;
      else bad |= off[e] < off[e - 1];
      if (e == E) bad |= empty_slots ? (off[E] < 0 || off[E] > P) : off[E] != P;
      continue;
    }
    const int64_t t = i / k, j = i % k;
    const int32_t e = tei[i];
    if (empty_slots && e == -1) {  // an empty slot has no position
      bad |= tim[i] != -1;
      continue;
    }
    if (e < 0 || e >= E) { bad = true; continue; }
    for (int64_t q = 0; q < j; ++q) bad |= tei[t * k + q] == e;
    const int32_t pos = tim[i];
    if (pos < 0 || pos >= P || pos < off[e] || pos >= off[e + 1]) { bad = true; continue; }
    bad |= eti[pos] != t;
    // Tokens ascend within an expert (windows of tokens find their rows by binary search).
    if (pos + 1 < off[e + 1]) bad |= eti[pos + 1] <= t;
  }
  if (bad) atomicOr(flag, kPlanInvalid);
}

}  // namespace

void validate_plan_cuda(const RoutingPlan& plan, int64_t L, int64_t k, int64_t E, bool empty_slots, int32_t* flag,
                        cudaStream_t s) {
  const int64_t n = L * k + E + 1 + (empty_slots ? L * k : 0);
  const unsigned blocks = static_cast<unsigned>(std::min<int64_t>(ceil_div(n, 256), 4096));
  cuda::launch_chained(validate_plan_kernel, blocks, 256, 0, s, plan.token_expert_indices, plan.expert_token_indices,
                       plan.token_index_map, plan.expert_token_offsets, L, k, E, empty_slots, flag);
  MOEBLAZE_CUDA_LAUNCH_CHECK("validate_plan");
}

}  // namespace routing
}  // namespace v0
}  // namespace moeblaze
