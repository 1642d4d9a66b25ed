#include "core/needs.hpp"

namespace moeblaze {
inline namespace v0 {

Needs needs_of(const LayerConfig& cfg, Pass pass, const CallArgs& a) {
  Needs n;
  if (pass != Pass::kBackward) return n;  // forward and route decide nothing beyond the arguments
  const bool routed = a.mode != RoutingMode::kCallerTopK;
  n.router_adds_dx = a.mode == RoutingMode::kRouterWeight && a.dx.present;
  n.router_grad = routed && (a.d_logits.present || a.d_router_weight.present || n.router_adds_dx);
  n.dpre = a.dx.present || a.d_w_gate_up.present;
  n.recompute_up = cfg.save_policy == SavePolicy::kRecomputeUp;
  return n;
}

}  // namespace v0
}  // namespace moeblaze
