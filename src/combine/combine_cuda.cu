#include "combine/combine_cuda.hpp"
#include "cuda/chained_launch.cuh"
#include "cuda/cuda_check.hpp"
#include "util/align.hpp"
#include "util/dtype.hpp"
#include "util/vec8.cuh"

namespace moeblaze {
inline namespace v0 {
namespace combine {
namespace {

// Up to kStagedPicks picks per token are staged in shared memory first: the row loads then wait
// on nothing but themselves, not on a map load each (the map read once per token, not per
// column chunk and pick).
constexpr int kStagedPicks = 32;

// Whether every row of a matrix at `data` with rows `ld` elements of `elem` bytes apart starts
// 16-byte aligned, so that 8 elements move as one vector.
bool rows_aligned16(const void* data, int64_t ld, size_t elem) {
  return (ld * static_cast<int64_t>(elem)) % 16 == 0 && reinterpret_cast<uintptr_t>(data) % 16 == 0;
}
bool rows_take_vectors(const View& out, int64_t d) {
  return d % 8 == 0 && rows_aligned16(out.data, out.stride[0], out.elem());
}

// acc += w row[0, W): the slots' rows and the per-pick term rows alike.
template <class T, int W>
__device__ __forceinline__ void add_weighted_row(float (&acc)[W], const T* in, float w) {
  float v[W];
  if (W == 8) Elem<T>::load8(in, v);
  else v[0] = Elem<T>::load1(in);
#pragma unroll
  for (int q = 0; q < W; ++q) acc[q] += w * v[q];
}

template <class T, int W, bool kStaged, bool kRowOut>
__global__ void combine_rows_kernel(const int32_t* map, const float* gates, int64_t k, int64_t d, const T* src,
                                    TokenTerms terms, T* out, int64_t out_stride, bool accumulate,
                                    char* const* row_out, const int32_t* first, int64_t first_base) {
  __shared__ int32_t s_pos[kStaged ? kStagedPicks : 1];
  __shared__ float s_weight[kStaged ? kStagedPicks : 1];
  __shared__ int32_t s_term_id[kStaged ? kStagedPicks : 1];
  __shared__ float s_term_coef[kStaged ? kStagedPicks : 1];
  int64_t t = blockIdx.x;
  if (kRowOut && first) {  // block b takes row (first + b) mod L: blocks start in about index order
    const int64_t L = gridDim.x;
    t = (t + ((*first - first_base) % L + L) % L) % L;
  }
  T* row = out + t * out_stride;
  if constexpr (kRowOut) {
    row = reinterpret_cast<T*>(row_out[t]);
    if (!row) return;  // the whole block: no barrier is passed before this
  }
  // A position outside [0, L k) only comes from a bad saved plan, which the fused engine flags on
  // the device and answers with NaN outputs: read nothing for it.
  const int64_t rows = static_cast<int64_t>(gridDim.x) * k;
  if (kStaged) {
    if (threadIdx.x < k) {
      const int64_t pos = map[t * k + threadIdx.x];
      s_pos[threadIdx.x] = pos < 0 || pos >= rows ? -1 : static_cast<int32_t>(pos);
      s_weight[threadIdx.x] = gates ? gates[t * k + threadIdx.x] : 1.f;
    }
    if (threadIdx.x < terms.picks) {
      const int64_t id = terms.ids[t * terms.picks + threadIdx.x];
      s_term_id[threadIdx.x] = id < 0 || id >= terms.count ? -1 : static_cast<int32_t>(id);
      s_term_coef[threadIdx.x] = terms.coef[t * terms.picks + threadIdx.x];
    }
    __syncthreads();
  }
  for (int64_t c = threadIdx.x * W; c < d; c += blockDim.x * W) {
    float acc[W], v[W];
#pragma unroll
    for (int q = 0; q < W; ++q) acc[q] = 0.f;
    for (int64_t j = 0; j < k; ++j) {
      const int64_t pos = kStaged ? s_pos[j] : map[t * k + j];
      if (pos < 0 || pos >= rows) continue;
      add_weighted_row<T, W>(acc, src + pos * d + c, kStaged ? s_weight[j] : gates ? gates[t * k + j] : 1.f);
    }
    if (terms.dense_f32)
#pragma unroll
      for (int q = 0; q < W; ++q) acc[q] += terms.dense_f32[t * d + c + q];
    for (int64_t j = 0; j < terms.picks; ++j) {
      const int64_t id = kStaged ? s_term_id[j] : terms.ids[t * terms.picks + j];
      if (id < 0 || id >= terms.count) continue;
      add_weighted_row<T, W>(acc, static_cast<const T*>(terms.rows) + id * terms.ld + c,
                             kStaged ? s_term_coef[j] : terms.coef[t * terms.picks + j]);
    }
    if (accumulate) {
      if (W == 8) Elem<T>::load8(row + c, v);
      else v[0] = Elem<T>::load1(row + c);
#pragma unroll
      for (int q = 0; q < W; ++q) acc[q] += v[q];
    }
    if (W == 8) Elem<T>::store8(row + c, acc);
    else Elem<T>::store1(row + c, acc[0]);
  }
}

template <class T, int W, bool kRowOut>
void launch_combine(const int32_t* map, const float* gates, int64_t L, int64_t k, int64_t d, const T* in,
                    const TokenTerms& terms, T* out, int64_t out_stride, bool accumulate, char* const* row_out,
                    const int32_t* first, int64_t first_base, int threads, cudaStream_t s) {
  if (k <= kStagedPicks && terms.picks <= kStagedPicks)  // threads >= 32: a thread per staged pick
    combine_rows_kernel<T, W, true, kRowOut><<<static_cast<unsigned>(L), threads, 0, s>>>(
        map, gates, k, d, in, terms, out, out_stride, accumulate, row_out, first, first_base);
  else
    combine_rows_kernel<T, W, false, kRowOut><<<static_cast<unsigned>(L), threads, 0, s>>>(
        map, gates, k, d, in, terms, out, out_stride, accumulate, row_out, first, first_base);
}

// A thread per token reads its slots (coalesced at k = 1); each warp then zeroes its unrouted
// tokens' rows one after the other, all 32 lanes on a row, so a call without them costs one
// read of the map.
template <class T, int W>
__global__ void zero_unrouted_rows_kernel(const int32_t* map, int64_t L, int64_t k, int64_t d, T* out, int64_t stride) {
  cuda::wait_for_prior_grids();
  cuda::allow_next_grid();
  const int64_t t = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  const int lane = threadIdx.x % 32;
  bool routed = t >= L;  // past the tokens: nothing to zero
  for (int64_t j = 0; j < k && !routed; ++j) {
    const int32_t pos = map[t * k + j];
    routed = pos >= 0 && pos < L * k;
  }
  float zero[W] = {};
  for (unsigned todo = __ballot_sync(0xffffffffu, !routed); todo; todo &= todo - 1) {
    T* row = out + (t - lane + __ffs(todo) - 1) * stride;
    for (int64_t c = lane * W; c < d; c += 32 * W) {
      if (W == 8) Elem<T>::store8(row + c, zero);
      else Elem<T>::store1(row + c, zero[0]);
    }
  }
}

__global__ void to_token_order_kernel(const int32_t* map, const float* v, int64_t n, int64_t parts, int64_t ld,
                                      const int32_t* rows_done, float* out) {
  cuda::wait_for_prior_grids();
  cuda::allow_next_grid();
  const int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (i >= n) return;
  const int32_t pos = map[i];
  const int64_t done = rows_done ? *rows_done : n;
  float sum = 0.f;  // a bad saved map reads nothing; the parts in a fixed order
  if (pos >= 0 && pos < n && pos < done)
    for (int64_t c = 0; c < parts; ++c) sum += v[c * ld + pos];
  out[i] = sum;
}

__global__ void store_rows_kernel(const float* src, const float* add, int64_t rows, int64_t cols, char* out, DType t,
                                  int64_t stride, bool accumulate) {
  cuda::wait_for_prior_grids();
  cuda::allow_next_grid();
  const int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (i >= rows * cols) return;
  const int64_t r = i / cols, c = i % cols;
  char* row = out + r * stride * static_cast<int64_t>(dtype_size(t));
  float v = src[i];
  if (add) v += add[i];
  if (accumulate) v += load_f32(row, t, c);
  store_f32(row, t, c, v);
}

}  // namespace

void combine_rows_cuda(const int32_t* map, const float* gates, int64_t L, int64_t k, int64_t d, const void* src,
                       const TokenTerms& extra, const View& out, cudaStream_t s, char* const* row_out,
                       const int32_t* row_out_first, int64_t first_base) {
  if (L == 0) return;
  // Vector path when every row start is 16-byte aligned (row_out: the caller's promise for d % 8 == 0),
  // the per-pick rows' included.
  const bool terms_vec = !extra.rows || rows_aligned16(extra.rows, extra.ld, out.elem());
  const bool vec = (row_out ? d % 8 == 0 : rows_take_vectors(out, d)) && terms_vec;
  const int threads = static_cast<int>(std::min<int64_t>(256, std::max<int64_t>(32, ceil_div(d, vec ? 8 : 1))));
  const bool acc = out.accumulate && !row_out;
  MOEBLAZE_DISPATCH_FLOAT(out.dtype, T, {
    const T* in = static_cast<const T*>(src);
    T* o = reinterpret_cast<T*>(out.data);
    const int64_t ld = out.stride[0];
    if (row_out) {
      if (vec) launch_combine<T, 8, true>(map, gates, L, k, d, in, extra, o, ld, acc, row_out, row_out_first, first_base,
                                          threads, s);
      else launch_combine<T, 1, true>(map, gates, L, k, d, in, extra, o, ld, acc, row_out, row_out_first, first_base,
                                      threads, s);
    } else {
      if (vec) launch_combine<T, 8, false>(map, gates, L, k, d, in, extra, o, ld, acc, nullptr, nullptr, 0, threads, s);
      else launch_combine<T, 1, false>(map, gates, L, k, d, in, extra, o, ld, acc, nullptr, nullptr, 0, threads, s);
    }
  });
  MOEBLAZE_CUDA_LAUNCH_CHECK("combine_rows");
}

void zero_unrouted_rows_cuda(const int32_t* map, int64_t L, int64_t k, int64_t d, const View& out, cudaStream_t s) {
  if (L == 0 || d == 0) return;
  const bool vec = rows_take_vectors(out, d);
  const unsigned blocks = static_cast<unsigned>(ceil_div(L, 256));
  MOEBLAZE_DISPATCH_FLOAT(out.dtype, T, {
    T* o = reinterpret_cast<T*>(out.data);
    if (vec) cuda::launch_chained(zero_unrouted_rows_kernel<T, 8>, blocks, 256, 0, s, map, L, k, d, o, out.stride[0]);
    else cuda::launch_chained(zero_unrouted_rows_kernel<T, 1>, blocks, 256, 0, s, map, L, k, d, o, out.stride[0]);
  });
  MOEBLAZE_CUDA_LAUNCH_CHECK("zero_unrouted_rows");
}

void to_token_order_cuda(const int32_t* token_index_map, int64_t L, int64_t k, const float* v, float* out, cudaStream_t s,
                        int64_t parts, int64_t ld, const int32_t* rows_done) {
  const int64_t n = L * k;
  if (n == 0) return;
  cuda::launch_chained(to_token_order_kernel, static_cast<unsigned>(ceil_div(n, 256)), 256, 0, s, token_index_map, v, n,
                       parts, ld, rows_done, out);
  MOEBLAZE_CUDA_LAUNCH_CHECK("to_token_order");
}

void store_f32_rows_cuda(const float* src, int64_t rows, int64_t cols, const View& out, cudaStream_t s,
                         const float* add) {
  if (rows * cols == 0) return;
  cuda::launch_chained(store_rows_kernel, static_cast<unsigned>(ceil_div(rows * cols, 256)), 256, 0, s, src, add, rows,
                       cols, out.data, out.dtype, out.stride[0], out.accumulate);
  MOEBLAZE_CUDA_LAUNCH_CHECK("store_rows");
}

}  // namespace combine
}  // namespace v0
}  // namespace moeblaze
