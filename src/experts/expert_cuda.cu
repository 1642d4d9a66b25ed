#include "cuda/cuda_check.hpp"
#include "cuda/row_arrival.cuh"
#include "math/activation.hpp"
#include "experts/expert_cuda.hpp"
#include "util/align.hpp"
#include "util/dtype.hpp"
#include "util/vec8.cuh"

namespace moeblaze {
inline namespace v0 {
namespace experts {
namespace {

// One warp per output row (grid-stride), each lane moving 16-byte chunks (Vec) or elements;
// an index outside [0, src_rows) (a window row no expert covers, or a bad plan) gives a zero row.
template <class Vec>
__global__ void gather_rows_kernel(const char* src, int64_t src_stride_bytes, int64_t src_rows, const int32_t* rows,
                                   int64_t P, int64_t row_bytes, char* out, RowArrival arrival) {
  const int lane = threadIdx.x % 32;
  const int64_t warps = static_cast<int64_t>(gridDim.x) * (blockDim.x / 32);
  const int64_t n = row_bytes / static_cast<int64_t>(sizeof(Vec));
  for (int64_t p = blockIdx.x * static_cast<int64_t>(blockDim.x / 32) + threadIdx.x / 32; p < P; p += warps) {
    const int32_t r = rows[p];
    const Vec* in = reinterpret_cast<const Vec*>(src + static_cast<int64_t>(r) * src_stride_bytes);
    Vec* o = reinterpret_cast<Vec*>(out + p * row_bytes);
    if (r >= 0 && r < src_rows) {
      if (arrival.waits()) {  // rows stored by other GPUs while this kernel runs: read through L2
        const int32_t row[1] = {r};
        wait_rows(arrival, row);
#pragma unroll 4
        for (int64_t i = lane; i < n; i += 32) o[i] = __ldcg(in + i);
      } else {
#pragma unroll 4
        for (int64_t i = lane; i < n; i += 32) o[i] = __ldg(in + i);
      }
    } else {
      for (int64_t i = lane; i < n; i += 32) o[i] = Vec{};
    }
  }
}

__global__ void gates_to_positions_kernel(const int32_t* map, const float* gates, int64_t n, float* out) {
  const int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (i >= n) return;
  const int32_t pos = map[i];
  if (pos >= 0 && pos < n) out[pos] = gates[i];  // a bad saved map (fused engine: flagged on the device) is skipped
}

// One thread per 8 columns (vector path, h % 8 == 0) or per column.
template <class T, int W, Activation A>
__global__ void activation_forward_kernel(int64_t P, int64_t h, const T* pre, int64_t ld, T* act) {
  const int64_t chunks = h / W;
  constexpr bool gated = is_gated(A);
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < P * chunks;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t p = i / chunks, c = (i % chunks) * W;
    const T* row = pre + p * ld;
    float u[W], b[W], o[W];
    if (W == 8) {
      Elem<T>::load8(row + c, u);
      if (gated) Elem<T>::load8(row + h + c, b);
    } else {
      u[0] = Elem<T>::load1(row + c);
      if (gated) b[0] = Elem<T>::load1(row + h + c);
    }
#pragma unroll
    for (int q = 0; q < W; ++q) o[q] = gated ? act_fn<A>(u[q]) * b[q] : act_fn<A>(u[q]);
    if (W == 8) Elem<T>::store8(act + p * h + c, o);
    else Elem<T>::store1(act + p * h + c, o[0]);
  }
}

// One warp per row; lanes take W-column chunks in a fixed order, then a fixed-order shuffle
// reduction: dg is bitwise reproducible.
template <class T, int W, Activation A>
__global__ void activation_backward_kernel(int64_t P, int64_t h, const T* pre, const int32_t* pre_rows,
                                           const float* gate, const T* dact, int64_t ld_dact, T* dpre, T* gact,
                                           float* dg_pos, const int32_t* rows_done) {
  const int64_t p = blockIdx.x * static_cast<int64_t>(blockDim.x / 32) + threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  if (p >= P) return;
  if (rows_done && p >= static_cast<int64_t>(*rows_done)) {  // no GEMM wrote this row's dact
    if (lane == 0) dg_pos[p] = 0.f;
    return;
  }
  constexpr bool gated = is_gated(A);
  const int64_t ld = gated ? 2 * h : h;
  const T* pr = pre + (pre_rows ? static_cast<int64_t>(pre_rows[p]) : p) * ld;
  const T* ar = dact + p * ld_dact;
  T* dr = dpre + p * ld;
  T* gr = gact + p * h;
  const float g = gate[p];
  float dot = 0.f;
  for (int64_t c = lane * W; c < h; c += 32 * W) {
    float u[W], b[W], da[W], o1[W], o2[W], ga[W];
    if (W == 8) {
      Elem<T>::load8(pr + c, u);
      if (gated) Elem<T>::load8(pr + h + c, b);
      Elem<T>::load8(ar + c, da);
    } else {
      u[0] = Elem<T>::load1(pr + c);
      if (gated) b[0] = Elem<T>::load1(pr + h + c);
      da[0] = Elem<T>::load1(ar + c);
    }
#pragma unroll
    for (int q = 0; q < W; ++q) {
      const ActBackward v = act_backward<A>(u[q], gated ? b[q] : 0.f, g * da[q]);
      const float act = round_as<T>(v.act);
      dot += da[q] * act;
      o1[q] = v.du;
      o2[q] = v.db;
      ga[q] = g * act;
    }
    if (W == 8) {
      Elem<T>::store8(dr + c, o1);
      if (gated) Elem<T>::store8(dr + h + c, o2);
      Elem<T>::store8(gr + c, ga);
    } else {
      Elem<T>::store1(dr + c, o1[0]);
      if (gated) Elem<T>::store1(dr + h + c, o2[0]);
      Elem<T>::store1(gr + c, ga[0]);
    }
  }
  for (int o = 16; o > 0; o >>= 1) dot += __shfl_xor_sync(0xffffffffu, dot, o);
  if (lane == 0) dg_pos[p] = dot;
}

unsigned grid_for(int64_t n, int threads) {
  return static_cast<unsigned>(std::min<int64_t>(ceil_div(n, threads), int64_t{1} << 20));
}

}  // namespace

void gather_rows_cuda(const View& src, const int32_t* rows, int64_t P, int64_t d, void* out, cudaStream_t s,
                      const RowArrival& arrival) {
  if (P == 0) return;
  const int64_t es = static_cast<int64_t>(src.elem()), row_bytes = d * es, stride = src.stride[0] * es;
  const int64_t cap = arrival.waits() && arrival.max_ctas > 0 ? arrival.max_ctas : int64_t{1} << 16;
  const unsigned grid = static_cast<unsigned>(std::min<int64_t>(ceil_div(P, 8), cap));
  const bool vec = row_bytes % 16 == 0 && stride % 16 == 0 && reinterpret_cast<uintptr_t>(src.data) % 16 == 0 &&
                   reinterpret_cast<uintptr_t>(out) % 16 == 0;
  auto launch = [&](auto unit) {  // the copy unit: 16 bytes, or one element
    gather_rows_kernel<decltype(unit)>
        <<<grid, 256, 0, s>>>(src.data, stride, src.shape[0], rows, P, row_bytes, static_cast<char*>(out), arrival);
  };
  if (vec) launch(uint4{});
  else if (es == 2) launch(uint16_t{});
  else launch(uint32_t{});
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
  const bool vec = h % 8 == 0;
  MOEBLAZE_DISPATCH_FLOAT(dt, T, {
    const T* in = static_cast<const T*>(pre);
    T* out = static_cast<T*>(act);
    with_activation(a, [&](auto t) {
      constexpr Activation A = decltype(t)::value;
      if (vec) activation_forward_kernel<T, 8, A><<<grid_for(P * h / 8, 256), 256, 0, s>>>(P, h, in, ld, out);
      else activation_forward_kernel<T, 1, A><<<grid_for(P * h, 256), 256, 0, s>>>(P, h, in, ld, out);
    });
  });
  MOEBLAZE_CUDA_LAUNCH_CHECK("activation_forward");
}

void activation_backward_cuda(Activation a, DType dt, int64_t P, int64_t h, const void* pre, const int32_t* pre_rows,
                              const float* gate, const void* dact, int64_t ld_dact, void* dpre, void* gact,
                              float* dg_pos, cudaStream_t s, const int32_t* rows_done) {
  if (P == 0) return;
  const bool vec = h % 8 == 0 && ld_dact % 8 == 0;
  const unsigned blocks = static_cast<unsigned>(ceil_div(P, 8));
  MOEBLAZE_DISPATCH_FLOAT(dt, T, {
    const T* in = static_cast<const T*>(pre);
    const T* da = static_cast<const T*>(dact);
    T* dp = static_cast<T*>(dpre);
    T* ga = static_cast<T*>(gact);
    with_activation(a, [&](auto t) {
      constexpr Activation A = decltype(t)::value;
      if (vec)
        activation_backward_kernel<T, 8, A>
            <<<blocks, 256, 0, s>>>(P, h, in, pre_rows, gate, da, ld_dact, dp, ga, dg_pos, rows_done);
      else
        activation_backward_kernel<T, 1, A>
            <<<blocks, 256, 0, s>>>(P, h, in, pre_rows, gate, da, ld_dact, dp, ga, dg_pos, rows_done);
    });
  });
  MOEBLAZE_CUDA_LAUNCH_CHECK("activation_backward");
}

}  // namespace experts
}  // namespace v0
}  // namespace moeblaze
