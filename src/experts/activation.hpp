// Expert activations and their derivatives, shared by host and device code.
// Gated (SwiGLU, GeGLU): act = f(A) * B. Plain (ReLU, GELU, SiLU): act = f(H).
#pragma once

#include <cmath>

#include "core/config.hpp"
#include "util/dtype.hpp"

namespace moeblaze {
inline namespace v0 {

MOEBLAZE_HD float sigmoid_f(float u) { return 1.f / (1.f + expf(-u)); }

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
