// Eight-element vector access for the memory-bound kernels (and the pair stores of the GEMM
// epilogues): one 16-byte load or store per
// eight bf16/fp16 values (two for fp32), converted to and from fp32 with round-to-nearest-even,
// exactly as util/dtype.hpp rounds on the host.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

#include "util/dtype.hpp"

namespace moeblaze {
inline namespace v0 {

template <class T>
struct Elem;
template <>
struct Elem<float> {
  static constexpr DType kType = DType::kF32;
  __device__ static void load8(const float* p, float* f) {
    const float4 a = reinterpret_cast<const float4*>(p)[0], b = reinterpret_cast<const float4*>(p)[1];
    f[0] = a.x; f[1] = a.y; f[2] = a.z; f[3] = a.w; f[4] = b.x; f[5] = b.y; f[6] = b.z; f[7] = b.w;
  }
  __device__ static void store8(float* p, const float* f) {
    reinterpret_cast<float4*>(p)[0] = make_float4(f[0], f[1], f[2], f[3]);
    reinterpret_cast<float4*>(p)[1] = make_float4(f[4], f[5], f[6], f[7]);
  }
  __device__ static float load1(const float* p) { return *p; }
  __device__ static void store1(float* p, float v) { *p = v; }
  __device__ static void store2(float* p, float a, float b) { *reinterpret_cast<float2*>(p) = make_float2(a, b); }
};
template <>
struct Elem<__nv_bfloat16> {
  static constexpr DType kType = DType::kBF16;
  __device__ static void load8(const __nv_bfloat16* p, float* f) {
    const uint4 u = *reinterpret_cast<const uint4*>(p);
    const __nv_bfloat162* h = reinterpret_cast<const __nv_bfloat162*>(&u);
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const float2 v = __bfloat1622float2(h[i]);
      f[2 * i] = v.x;
      f[2 * i + 1] = v.y;
    }
  }
  __device__ static void store8(__nv_bfloat16* p, const float* f) {
    uint4 u;
    __nv_bfloat162* h = reinterpret_cast<__nv_bfloat162*>(&u);
#pragma unroll
    for (int i = 0; i < 4; ++i) h[i] = __floats2bfloat162_rn(f[2 * i], f[2 * i + 1]);
    *reinterpret_cast<uint4*>(p) = u;
  }
  __device__ static float load1(const __nv_bfloat16* p) { return __bfloat162float(*p); }
  __device__ static void store1(__nv_bfloat16* p, float v) { *p = __float2bfloat16_rn(v); }
  __device__ static void store2(__nv_bfloat16* p, float a, float b) {
    *reinterpret_cast<__nv_bfloat162*>(p) = __floats2bfloat162_rn(a, b);
  }
  // a and b rounded, a in the low half (the first element in memory).
  __device__ static uint32_t pack2(float a, float b) {
    const __nv_bfloat162 h = __floats2bfloat162_rn(a, b);
    return *reinterpret_cast<const uint32_t*>(&h);
  }
  // The two values of a pack2, widened back (exact: two bit operations).
  __device__ static float2 unpack2(uint32_t v) { return make_float2(__uint_as_float(v << 16), __uint_as_float(v & 0xffff0000u)); }
};
template <>
struct Elem<__half> {
  static constexpr DType kType = DType::kF16;
  __device__ static void load8(const __half* p, float* f) {
    const uint4 u = *reinterpret_cast<const uint4*>(p);
    const __half2* h = reinterpret_cast<const __half2*>(&u);
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const float2 v = __half22float2(h[i]);
      f[2 * i] = v.x;
      f[2 * i + 1] = v.y;
    }
  }
  __device__ static void store8(__half* p, const float* f) {
    uint4 u;
    __half2* h = reinterpret_cast<__half2*>(&u);
#pragma unroll
    for (int i = 0; i < 4; ++i) h[i] = __floats2half2_rn(f[2 * i], f[2 * i + 1]);
    *reinterpret_cast<uint4*>(p) = u;
  }
  __device__ static float load1(const __half* p) { return __half2float(*p); }
  __device__ static void store1(__half* p, float v) { *p = __float2half_rn(v); }
  __device__ static void store2(__half* p, float a, float b) { *reinterpret_cast<__half2*>(p) = __floats2half2_rn(a, b); }
  __device__ static uint32_t pack2(float a, float b) {
    const __half2 h = __floats2half2_rn(a, b);
    return *reinterpret_cast<const uint32_t*>(&h);
  }
  __device__ static float2 unpack2(uint32_t v) {
    return make_float2(__half2float(__ushort_as_half(static_cast<unsigned short>(v & 0xffffu))),
                       __half2float(__ushort_as_half(static_cast<unsigned short>(v >> 16))));
  }
};

// Runs `body` with T bound to the C++ type of a float DType.
#define MOEBLAZE_DISPATCH_FLOAT(dtype, T, ...)                 \
  switch (dtype) {                                            \
    case ::moeblaze::DType::kF32: {                           \
      using T = float;                                        \
      __VA_ARGS__;                                            \
    } break;                                                  \
    case ::moeblaze::DType::kBF16: {                          \
      using T = __nv_bfloat16;                                \
      __VA_ARGS__;                                            \
    } break;                                                  \
    default: {                                                \
      using T = __half;                                       \
      __VA_ARGS__;                                            \
    } break;                                                  \
  }

// v rounded to T and widened back (what storing and reloading would give).
template <class T>
__device__ __forceinline__ float round_as(float v) {
  T t;
  Elem<T>::store1(&t, v);
  return Elem<T>::load1(&t);
}

}  // namespace v0
}  // namespace moeblaze
