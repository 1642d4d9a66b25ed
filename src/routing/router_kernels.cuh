// What the router's kernels share (routing/router_cuda.cu, router_loss_cuda.cu,
// router_backward_cuda.cu): the block shape, the token mask, the score function, and the
// dispatch of a launch on the token groups' shape (routing/token_group.cuh).
#pragma once

#include <cmath>
#include <cstdint>
#include <type_traits>

#include "routing/router_cuda.hpp"
#include "routing/token_group.cuh"
#include "util/align.hpp"

namespace moeblaze {
inline namespace v0 {
namespace routing {
namespace router_detail {

constexpr int kWarpsPerBlock = 8;

__device__ __forceinline__ bool masked(const TokenMask& m, int64_t t) {
  if (!m.data) return false;
  return m.i64 ? static_cast<const int64_t*>(m.data)[t * m.stride] == 0
               : static_cast<const int32_t*>(m.data)[t * m.stride] == 0;
}

__device__ __forceinline__ float score(ScoreFn fn, float l, float lse) {
  return fn == ScoreFn::kSoftmax ? expf(l - lse) : 1.f / (1.f + expf(-l));
}

inline unsigned blocks_for(int64_t n, int threads) { return static_cast<unsigned>(ceil_div(n, threads)); }

// f(per, width) as integral constants for E experts (token_group.cuh): the experts cached per
// lane, and the lanes per token when it is a whole warp (32), else 0 (known at run time; only
// one expert per lane has fewer than 32 lanes).
template <class F>
void with_group_shape(int64_t E, F&& f) {
  using std::integral_constant;
  const int width = token_group_width(E);
  switch (experts_per_lane(E, width)) {
    case 1:
      if (width == 32) f(integral_constant<int, 1>{}, integral_constant<int, 32>{});
      else f(integral_constant<int, 1>{}, integral_constant<int, 0>{});
      break;
    case 2: f(integral_constant<int, 2>{}, integral_constant<int, 32>{}); break;
    case 4: f(integral_constant<int, 4>{}, integral_constant<int, 32>{}); break;
    case 8: f(integral_constant<int, 8>{}, integral_constant<int, 32>{}); break;
    default: f(integral_constant<int, 0>{}, integral_constant<int, 32>{}); break;
  }
}

}  // namespace router_detail
}  // namespace routing
}  // namespace v0
}  // namespace moeblaze
