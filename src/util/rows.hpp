// Host row conversions between storage dtypes and fp32 working rows.
#pragma once

#include <cstdint>

#include "util/dtype.hpp"

namespace moeblaze {
inline namespace v0 {

// dst[0..n) = src (dtype t) widened to fp32.
void load_row(const void* src, DType t, int64_t n, float* dst);
// dst[i * stride] (dtype t) = src[i] rounded to t; with accumulate, dst = round(dst + src)
// computed in fp32. A stride other than 1 writes a column of a row-major array.
void store_strided(void* dst, DType t, int64_t n, int64_t stride, const float* src, bool accumulate);
inline void store_row(void* dst, DType t, int64_t n, const float* src, bool accumulate) {
  store_strided(dst, t, n, 1, src, accumulate);
}

}  // namespace v0
}  // namespace moeblaze
