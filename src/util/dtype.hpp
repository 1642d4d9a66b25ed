// Element types and the 16-bit float conversions shared by host and device code.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>

#if defined(__CUDACC__)
#define MOEBLAZE_HD __host__ __device__ __forceinline__
#else
#define MOEBLAZE_HD inline
#endif

namespace moeblaze {
inline namespace v0 {

enum class DType : int32_t { kF32 = 0, kF16 = 1, kBF16 = 2, kI32 = 3, kI64 = 4, kInvalid = 5 };

// DLPack (code, bits, lanes) -> DType; kInvalid for anything the library does not know.
inline DType dtype_from_dlpack(uint8_t code, uint8_t bits, uint16_t lanes) {
  if (lanes != 1) return DType::kInvalid;
  if (code == 2 && bits == 32) return DType::kF32;
  if (code == 2 && bits == 16) return DType::kF16;
  if (code == 4 && bits == 16) return DType::kBF16;
  if (code == 0 && bits == 32) return DType::kI32;
  if (code == 0 && bits == 64) return DType::kI64;
  return DType::kInvalid;
}
inline void dtype_to_dlpack(DType t, uint8_t* code, uint8_t* bits) {
  switch (t) {
    case DType::kF32: *code = 2; *bits = 32; return;
    case DType::kF16: *code = 2; *bits = 16; return;
    case DType::kBF16: *code = 4; *bits = 16; return;
    case DType::kI32: *code = 0; *bits = 32; return;
    case DType::kI64: *code = 0; *bits = 64; return;
    default: *code = 255; *bits = 0; return;
  }
}
MOEBLAZE_HD size_t dtype_size(DType t) {
  switch (t) {
    case DType::kF16: case DType::kBF16: return 2;
    case DType::kF32: case DType::kI32: return 4;
    case DType::kI64: return 8;
    default: return 0;
  }
}
inline bool is_float(DType t) { return t == DType::kF32 || t == DType::kF16 || t == DType::kBF16; }
const char* dtype_name(DType t);

MOEBLAZE_HD uint32_t f32_bits(float f) { uint32_t u; memcpy(&u, &f, 4); return u; }
MOEBLAZE_HD float bits_f32(uint32_t u) { float f; memcpy(&f, &u, 4); return f; }

// Round-to-nearest-even conversions; NaN stays NaN.
MOEBLAZE_HD uint16_t f32_to_bf16(float f) {
  uint32_t u = f32_bits(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x40u);
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}
MOEBLAZE_HD float bf16_to_f32(uint16_t h) { return bits_f32(static_cast<uint32_t>(h) << 16); }

MOEBLAZE_HD uint16_t f32_to_f16(float f) {
  uint32_t x = f32_bits(f);
  uint32_t sign = (x >> 16) & 0x8000u;
  uint32_t ax = x & 0x7fffffffu;
  if (ax > 0x7f800000u) return static_cast<uint16_t>(sign | 0x7e00u);
  if (ax >= 0x477ff000u) return static_cast<uint16_t>(sign | 0x7c00u);
  if (ax < 0x38800000u) {  // f16 subnormal or zero: count units of 2^-24, round half to even
    float scaled = bits_f32(ax) * 16777216.0f;  // exact: a power-of-two scale
    uint32_t q = static_cast<uint32_t>(scaled);
    float rem = scaled - static_cast<float>(q);
    if (rem > 0.5f || (rem == 0.5f && (q & 1u))) q++;
    return static_cast<uint16_t>(sign | q);
  }
  uint32_t h = (((ax >> 23) - 112u) << 10) | ((ax & 0x7fffffu) >> 13);
  uint32_t rest = ax & 0x1fffu;
  if (rest > 0x1000u || (rest == 0x1000u && (h & 1u))) h++;
  return static_cast<uint16_t>(sign | h);
}
MOEBLAZE_HD float f16_to_f32(uint16_t h) {
  uint32_t sign = (static_cast<uint32_t>(h) & 0x8000u) << 16;
  uint32_t exp = (h >> 10) & 0x1fu, mant = h & 0x3ffu;
  if (exp == 0) {
    float v = static_cast<float>(mant) * (1.0f / 16777216.0f);
    return sign ? -v : v;
  }
  if (exp == 31) return bits_f32(sign | 0x7f800000u | (mant << 13));
  return bits_f32(sign | ((exp + 112u) << 23) | (mant << 13));
}

// Element i of a float buffer of type t, widened to fp32.
MOEBLAZE_HD float load_f32(const void* p, DType t, int64_t i) {
  if (t == DType::kF32) return static_cast<const float*>(p)[i];
  if (t == DType::kBF16) return bf16_to_f32(static_cast<const uint16_t*>(p)[i]);
  return f16_to_f32(static_cast<const uint16_t*>(p)[i]);
}
// Stores v rounded to t.
MOEBLAZE_HD void store_f32(void* p, DType t, int64_t i, float v) {
  if (t == DType::kF32) static_cast<float*>(p)[i] = v;
  else if (t == DType::kBF16) static_cast<uint16_t*>(p)[i] = f32_to_bf16(v);
  else static_cast<uint16_t*>(p)[i] = f32_to_f16(v);
}
// v rounded to t and widened back: what a 16-bit GEMM output would hold.
MOEBLAZE_HD float round_to(DType t, float v) {
  if (t == DType::kBF16) return bf16_to_f32(f32_to_bf16(v));
  if (t == DType::kF16) return f16_to_f32(f32_to_f16(v));
  return v;
}

}  // namespace v0
}  // namespace moeblaze
