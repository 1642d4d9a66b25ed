#include <cstdarg>
#include <cstdio>

#include "util/dtype.hpp"
#include "util/error.hpp"

namespace moeblaze {
inline namespace v0 {

void fail(Status status, const char* fmt, ...) {
  char buf[1024];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(buf, sizeof buf, fmt, ap);
  va_end(ap);
  throw Error(status, buf);
}

const char* dtype_name(DType t) {
  switch (t) {
    case DType::kF32: return "f32";
    case DType::kF16: return "f16";
    case DType::kBF16: return "bf16";
    case DType::kI32: return "i32";
    case DType::kI64: return "i64";
    default: return "invalid";
  }
}

}  // namespace v0
}  // namespace moeblaze

#include <algorithm>

#include "util/rows.hpp"

namespace moeblaze {
inline namespace v0 {

void load_row(const void* src, DType t, int64_t n, float* dst) {
  if (t == DType::kF32) {
    const float* s = static_cast<const float*>(src);
    std::copy(s, s + n, dst);
  } else if (t == DType::kBF16) {
    const uint16_t* s = static_cast<const uint16_t*>(src);
    for (int64_t i = 0; i < n; ++i) dst[i] = bf16_to_f32(s[i]);
  } else {
    const uint16_t* s = static_cast<const uint16_t*>(src);
    for (int64_t i = 0; i < n; ++i) dst[i] = f16_to_f32(s[i]);
  }
}

void store_strided(void* dst, DType t, int64_t n, int64_t stride, const float* src, bool accumulate) {
  for (int64_t i = 0; i < n; ++i) {
    float v = src[i];
    if (accumulate) v += load_f32(dst, t, i * stride);
    store_f32(dst, t, i * stride, v);
  }
}

}  // namespace v0
}  // namespace moeblaze
