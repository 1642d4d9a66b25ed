// Expert activations and their derivatives, shared by host and device code.
// Gated (SwiGLU, GeGLU): act = f(A) * B. Plain (ReLU, GELU, SiLU): act = f(H).
#pragma once

#include <cmath>
#include <type_traits>

#include "core/config.hpp"
#include "util/dtype.hpp"

namespace moeblaze {
inline namespace v0 {

// On the device: ex2.approx and rcp.approx, a few instructions instead of expf's range reduction
// and the IEEE division's Newton steps and slow path. The fused up GEMM computes it in an
// epilogue that no MMA overlaps, where it was ~30 instructions per element (perf/NOTES.md). Its relative error (ex2.approx's 2 + 1.2|u| ulps) stays under 1e-6 for |u| < 10 and 1e-5
// anywhere, far below bf16/fp16 rounding; exp(-u) overflowing to inf still gives 0. The .ftz
// forms: without them ex2 costs three more instructions (a range test and two scalings,
// for results below 2^-126), and those results vanish in 1 + e anyway, so the sigmoid is the
// same bits. Every device path (epilogues, elementwise kernels) shares it.
MOEBLAZE_HD float sigmoid_f(float u) {
#ifdef __CUDA_ARCH__
  float e, s;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(e) : "f"(u * -1.4426950408889634f));
  asm("rcp.approx.ftz.f32 %0, %1;" : "=f"(s) : "f"(1.f + e));
  return s;
#else
  return 1.f / (1.f + expf(-u));
#endif
}

// f(u) and f'(u) of the activation's nonlinearity (silu for SwiGLU, gelu for GeGLU), the one
// definition of both: the activation backward needs them together (one sigmoid or erf each),
// and act_fn takes f alone (the compiler drops df).
struct ActValueGrad {
  float f, df;
};

// One specialisation per activation and no primary definition: code instantiated for an
// activation that has none fails to compile. kPlain is the plain activation with the same f
// (kernels whose gating is a separate flag instantiate only the three nonlinearities).
template <Activation A>
struct Nonlinearity;
template <>
struct Nonlinearity<Activation::kRelu> {
  static constexpr Activation kPlain = Activation::kRelu;
  MOEBLAZE_HD static ActValueGrad at(float u) { return {u > 0.f ? u : 0.f, u > 0.f ? 1.f : 0.f}; }
};
template <>
struct Nonlinearity<Activation::kGelu> {
  static constexpr Activation kPlain = Activation::kGelu;
  MOEBLAZE_HD static ActValueGrad at(float u) {  // the exact (erf) form
    const float e = erff(u * 0.70710678118654752f);
    return {0.5f * u * (1.f + e), 0.5f * (1.f + e) + u * 0.39894228040143268f * expf(-0.5f * u * u)};
  }
};
template <>
struct Nonlinearity<Activation::kSilu> {
  static constexpr Activation kPlain = Activation::kSilu;
  MOEBLAZE_HD static ActValueGrad at(float u) {
    const float s = sigmoid_f(u), f = u * s;
    return {f, s + f * (1.f - s)};  // s (1 + u (1 - s)), one instruction fewer
  }
};
template <>
struct Nonlinearity<Activation::kSwiglu> : Nonlinearity<Activation::kSilu> {};
template <>
struct Nonlinearity<Activation::kGeglu> : Nonlinearity<Activation::kGelu> {};

template <Activation A>
using ActTag = std::integral_constant<Activation, A>;

// The one run-time dispatch on an activation: f(ActTag<A>{}). A case per enumerator and no
// default (the library builds with -Werror=switch), so a new activation is a compile error
// here until it has its case, and then in every kernel until it has its Nonlinearity.
// Activation values come from a validated configuration.
template <class F>
MOEBLAZE_HD decltype(auto) with_activation(Activation a, F&& f) {
  switch (a) {
    case Activation::kRelu: return f(ActTag<Activation::kRelu>{});
    case Activation::kGelu: return f(ActTag<Activation::kGelu>{});
    case Activation::kSilu: return f(ActTag<Activation::kSilu>{});
    case Activation::kSwiglu: return f(ActTag<Activation::kSwiglu>{});
    case Activation::kGeglu: return f(ActTag<Activation::kGeglu>{});
  }
  __builtin_unreachable();
}

template <Activation A>
MOEBLAZE_HD ActValueGrad act_value_grad(float u) {
  return Nonlinearity<A>::at(u);
}
MOEBLAZE_HD ActValueGrad act_value_grad(Activation a, float u) {
  return with_activation(a, [&](auto t) { return act_value_grad<decltype(t)::value>(u); });
}

// f(u).
template <Activation A>
MOEBLAZE_HD float act_fn(float u) {
  return Nonlinearity<A>::at(u).f;
}
MOEBLAZE_HD float act_fn(Activation a, float u) { return act_value_grad(a, u).f; }

// The activation backward at one element, the one definition of its products for every engine
// (the CPU engine, the elementwise CUDA pass, the dact GEMM's epilogue), before the caller rounds
// to its dtype (per element, or per packed pair in the epilogue). u is the pre-activation (gated:
// the gate half), b the up half (gated only; ignored otherwise), gd the gradient reaching act
// (dact, times the routing gate where the caller folds it in). act = f(u) b or f(u); du, db the
// gradients of u and b (db = 0 when plain).
struct ActBackward {
  float act, du, db;
};
template <Activation A>
MOEBLAZE_HD ActBackward act_backward(float u, float b, float gd) {
  const ActValueGrad v = act_value_grad<A>(u);
  if constexpr (is_gated(A)) return {v.f * b, gd * b * v.df, gd * v.f};
  return {v.f, gd * v.df, 0.f};
}
MOEBLAZE_HD ActBackward act_backward(Activation a, float u, float b, float gd) {
  return with_activation(a, [&](auto t) { return act_backward<decltype(t)::value>(u, b, gd); });
}

}  // namespace v0
}  // namespace moeblaze
