// Expert activations and their derivatives, shared by host and device code.
// Gated (SwiGLU, GeGLU): act = f(A) * B. Plain (ReLU, GELU, SiLU): act = f(H).
#pragma once

#include <cmath>

#include "core/config.hpp"
#include "util/dtype.hpp"

namespace moeblaze {
inline namespace v0 {

// On the device: ex2.approx and rcp.approx (__expf, __fdividef), a few instructions instead of
// expf's range reduction and the IEEE division's Newton steps and slow path. The fused up GEMM
// computes it in an epilogue that no MMA overlaps, where it was ~30 instructions per element
// (perf/NOTES.md, step 10). Its relative error (__expf's 2 + 1.2|u| ulps) stays under 1e-6 for
// |u| < 10 and 1e-5 anywhere, far below bf16/fp16 rounding; exp(-u) overflowing to inf still
// gives 0. Every device path (epilogues, elementwise kernels) shares it.
MOEBLAZE_HD float sigmoid_f(float u) {
#ifdef __CUDA_ARCH__
  return __fdividef(1.f, 1.f + __expf(-u));
#else
  return 1.f / (1.f + expf(-u));
#endif
}

// f(u) of the activation's nonlinearity (silu for SwiGLU, gelu for GeGLU).
MOEBLAZE_HD float act_fn(Activation a, float u) {
  switch (a) {
    case Activation::kRelu: return u > 0.f ? u : 0.f;
    case Activation::kGelu: case Activation::kGeglu: return 0.5f * u * (1.f + erff(u * 0.70710678118654752f));
    default: return u * sigmoid_f(u);  // SiLU, SwiGLU
  }
}

// f'(u).
MOEBLAZE_HD float act_grad(Activation a, float u) {
  switch (a) {
    case Activation::kRelu: return u > 0.f ? 1.f : 0.f;
    case Activation::kGelu: case Activation::kGeglu:
      return 0.5f * (1.f + erff(u * 0.70710678118654752f)) + u * 0.39894228040143268f * expf(-0.5f * u * u);
    default: {
      const float s = sigmoid_f(u);
      return s * (1.f + u * (1.f - s));
    }
  }
}

}  // namespace v0
}  // namespace moeblaze
