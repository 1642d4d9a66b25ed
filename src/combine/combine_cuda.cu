#include "combine/combine_cuda.hpp"
#include "cuda/cuda_check.hpp"
#include "util/align.hpp"
#include "util/dtype.hpp"

namespace moeblaze {
inline namespace v0 {
namespace combine {
namespace {

__global__ void combine_kernel(const int32_t* map, const float* gates, int64_t k, int64_t d, const char* O, DType ot,
                               char* y, DType yt, int64_t y_stride) {
  const int64_t t = blockIdx.x;
  const int64_t es = static_cast<int64_t>(dtype_size(ot));
  char* yr = y + t * y_stride * static_cast<int64_t>(dtype_size(yt));
  for (int64_t c = threadIdx.x; c < d; c += blockDim.x) {
    float acc = 0.f;
    for (int64_t j = 0; j < k; ++j)
      acc += gates[t * k + j] * load_f32(O + static_cast<int64_t>(map[t * k + j]) * d * es, ot, c);
    store_f32(yr, yt, c, acc);
  }
}

__global__ void reduce_dx_kernel(const int32_t* map, int64_t k, int64_t d, const char* part, DType pt, const float* extra,
                                 char* dx, DType xt, int64_t stride, bool accumulate) {
  const int64_t t = blockIdx.x;
  const int64_t es = static_cast<int64_t>(dtype_size(pt));
  char* row = dx + t * stride * static_cast<int64_t>(dtype_size(xt));
  for (int64_t c = threadIdx.x; c < d; c += blockDim.x) {
    float acc = 0.f;
    for (int64_t j = 0; j < k; ++j) acc += load_f32(part + static_cast<int64_t>(map[t * k + j]) * d * es, pt, c);
    if (extra) acc += extra[t * d + c];
    if (accumulate) acc += load_f32(row, xt, c);
    store_f32(row, xt, c, acc);
  }
}

__global__ void to_token_order_kernel(const int32_t* map, const float* v, int64_t n, float* out) {
  const int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (i < n) out[i] = v[map[i]];
}

__global__ void store_rows_kernel(const float* src, int64_t rows, int64_t cols, char* out, DType t, int64_t stride,
                                  bool accumulate) {
  const int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (i >= rows * cols) return;
  const int64_t r = i / cols, c = i % cols;
  char* row = out + r * stride * static_cast<int64_t>(dtype_size(t));
  float v = src[i];
  if (accumulate) v += load_f32(row, t, c);
  store_f32(row, t, c, v);
}

}  // namespace

void combine_outputs_cuda(const RoutingPlan& plan, int64_t L, int64_t k, int64_t d, const void* O, DType ot, const View& y,
                          cudaStream_t s) {
  if (L == 0) return;
  combine_kernel<<<static_cast<unsigned>(L), 128, 0, s>>>(plan.token_index_map, plan.gates, k, d,
                                                          static_cast<const char*>(O), ot, y.data, y.dtype, y.stride[0]);
  MOEBLAZE_CUDA_LAUNCH_CHECK("combine");
}

void reduce_dx_cuda(const RoutingPlan& plan, int64_t L, int64_t k, int64_t d, const void* part, DType pt,
                    const float* extra, const View& dx, cudaStream_t s) {
  if (L == 0) return;
  reduce_dx_kernel<<<static_cast<unsigned>(L), 128, 0, s>>>(plan.token_index_map, k, d, static_cast<const char*>(part),
                                                            pt, extra, dx.data, dx.dtype, dx.stride[0], dx.accumulate);
  MOEBLAZE_CUDA_LAUNCH_CHECK("reduce_dx");
}

void to_token_order_cuda(const RoutingPlan& plan, int64_t L, int64_t k, const float* v, float* out, cudaStream_t s) {
  const int64_t n = L * k;
  if (n == 0) return;
  to_token_order_kernel<<<static_cast<unsigned>(ceil_div(n, 256)), 256, 0, s>>>(plan.token_index_map, v, n, out);
  MOEBLAZE_CUDA_LAUNCH_CHECK("to_token_order");
}

void store_f32_rows_cuda(const float* src, int64_t rows, int64_t cols, const View& out, cudaStream_t s) {
  if (rows * cols == 0) return;
  store_rows_kernel<<<static_cast<unsigned>(ceil_div(rows * cols, 256)), 256, 0, s>>>(src, rows, cols, out.data, out.dtype,
                                                                                      out.stride[0], out.accumulate);
  MOEBLAZE_CUDA_LAUNCH_CHECK("store_rows");
}

}  // namespace combine
}  // namespace v0
}  // namespace moeblaze
