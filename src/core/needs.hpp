// What a call must compute, decided once from the configuration, the pass and the arguments,
// so that every engine makes the same choices (was a copy of this logic per engine).
#pragma once

#include "core/args.hpp"
#include "core/config.hpp"

namespace moeblaze {
inline namespace v0 {

struct Needs {
  bool router_grad = false;     // backward: go back through the router (d logits, dW_g, dx part)
  bool router_adds_dx = false;  // backward: dx += d logits W_g (routing from ROUTER_WEIGHT)
  bool dpre = false;            // backward: dA/dB or dH (for dx or dW_gate_up)
  bool recompute_up = false;    // backward: no saved pre-activations; rerun the up GEMM
};

Needs needs_of(const LayerConfig& cfg, Pass pass, const CallArgs& args);

}  // namespace v0
}  // namespace moeblaze
