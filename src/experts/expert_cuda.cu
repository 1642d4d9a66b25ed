#include "cuda/cuda_check.hpp"
#include "experts/activation.hpp"
#include "experts/expert_cuda.hpp"
#include "util/align.hpp"
#include "util/dtype.hpp"

namespace moeblaze {
inline namespace v0 {
namespace experts {
namespace {

__global__ void gather_rows_kernel(const char* src, DType t, int64_t stride, const int32_t* rows, const float* scale,
                                   int64_t P, int64_t d, char* out) {
  const int64_t p = blockIdx.x;
  if (p >= P) return;
  const int64_t es = static_cast<int64_t>(dtype_size(t));
  const char* in = src + static_cast<int64_t>(rows[p]) * stride * es;
  char* o = out + p * d * es;
  if (!scale) {
    // Plain copy, 16 bytes per thread where the row allows it.
    const int64_t bytes = d * es;
    if ((bytes % 16 == 0) && (reinterpret_cast<uintptr_t>(in) % 16 == 0) && (reinterpret_cast<uintptr_t>(o) % 16 == 0)) {
      for (int64_t i = threadIdx.x; i < bytes / 16; i += blockDim.x)
        reinterpret_cast<uint4*>(o)[i] = reinterpret_cast<const uint4*>(in)[i];
    } else {
      for (int64_t i = threadIdx.x; i < bytes; i += blockDim.x) o[i] = in[i];
    }
    return;
  }
  const float g = scale[p];
  for (int64_t i = threadIdx.x; i < d; i += blockDim.x) store_f32(o, t, i, g * load_f32(in, t, i));
}

__global__ void gates_to_positions_kernel(const int32_t* map, const float* gates, int64_t n, float* out) {
  const int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (i < n) out[map[i]] = gates[i];
}

__global__ void activation_forward_kernel(Activation a, DType dt, int64_t P, int64_t h, const char* pre, int64_t ld,
                                          char* act) {
  const int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (i >= P * h) return;
  const int64_t p = i / h, c = i % h;
  const int64_t es = static_cast<int64_t>(dtype_size(dt));
  const char* row = pre + p * ld * es;
  float v = act_fn(a, load_f32(row, dt, c));
  if (is_gated(a)) v *= load_f32(row, dt, h + c);
  store_f32(act, dt, i, v);
}

// One warp per position: dg = <dact, act> in fixed lane order, then the in-place backward.
__global__ void activation_backward_kernel(Activation a, DType dt, int64_t P, int64_t h, const char* pre,
                                           const char* act, const float* gate, char* dpre, float* dg_pos) {
  const int64_t p = blockIdx.x * static_cast<int64_t>(blockDim.x / 32) + threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  if (p >= P) return;
  const bool gated = is_gated(a);
  const int64_t ld = gated ? 2 * h : h;
  const int64_t es = static_cast<int64_t>(dtype_size(dt));
  const char* pr = pre + p * ld * es;
  const char* ar = act + p * h * es;
  char* dr = dpre + p * ld * es;
  const float g = gate[p];
  float dot = 0.f;
  for (int64_t c = lane; c < h; c += 32) {
    const float dact = load_f32(dr, dt, c);
    dot += dact * load_f32(ar, dt, c);
    const float u = load_f32(pr, dt, c);
    const float gd = g * dact;
    if (gated) {
      const float b = load_f32(pr, dt, h + c);
      store_f32(dr, dt, c, gd * b * act_grad(a, u));
      store_f32(dr, dt, h + c, gd * act_fn(a, u));
    } else {
      store_f32(dr, dt, c, gd * act_grad(a, u));
    }
  }
  for (int o = 16; o > 0; o >>= 1) dot += __shfl_xor_sync(0xffffffffu, dot, o);
  if (lane == 0) dg_pos[p] = dot;
}

}  // namespace

void gather_rows_cuda(const View& src, const int32_t* rows, const float* scale, int64_t P, int64_t d, void* out,
                      cudaStream_t s) {
  if (P == 0) return;
  gather_rows_kernel<<<static_cast<unsigned>(P), 128, 0, s>>>(src.data, src.dtype, src.stride[0], rows, scale, P, d,
                                                              static_cast<char*>(out));
  MOEBLAZE_CUDA_LAUNCH_CHECK("gather_rows");
}

void gates_to_positions_cuda(const RoutingPlan& plan, int64_t L, int64_t k, float* out, cudaStream_t s) {
  const int64_t n = L * k;
  if (n == 0) return;
  gates_to_positions_kernel<<<static_cast<unsigned>(ceil_div(n, 256)), 256, 0, s>>>(plan.token_index_map, plan.gates, n, out);
  MOEBLAZE_CUDA_LAUNCH_CHECK("gates_to_positions");
}

void activation_forward_cuda(Activation a, DType dt, int64_t P, int64_t h, const void* pre, int64_t ld, void* act,
                             cudaStream_t s) {
  if (P * h == 0) return;
  activation_forward_kernel<<<static_cast<unsigned>(ceil_div(P * h, 256)), 256, 0, s>>>(
      a, dt, P, h, static_cast<const char*>(pre), ld, static_cast<char*>(act));
  MOEBLAZE_CUDA_LAUNCH_CHECK("activation_forward");
}

void activation_backward_cuda(Activation a, DType dt, int64_t P, int64_t h, const void* pre, const void* act,
                              const float* gate, void* dpre, float* dg_pos, cudaStream_t s) {
  if (P == 0) return;
  activation_backward_kernel<<<static_cast<unsigned>(ceil_div(P, 8)), 256, 0, s>>>(
      a, dt, P, h, static_cast<const char*>(pre), static_cast<const char*>(act), gate, static_cast<char*>(dpre), dg_pos);
  MOEBLAZE_CUDA_LAUNCH_CHECK("activation_backward");
}

}  // namespace experts
}  // namespace v0
}  // namespace moeblaze
