// The expert-parallel layer's forward and backward on the host (docs/ep.md, "A step"), over any
// Transport:
// the reference that the device path is tested against and what an EP handle on the CPU runs.
// Inputs are fp32 activations and the rank's routing; the weights are the rank's local experts
// in any float dtype and either layout (core/view.hpp), as the CPU engine reads them.
#pragma once

#include <cstdint>

#include "core/config.hpp"
#include "core/view.hpp"
#include "ep/send_plan.hpp"
#include "ep/transport.hpp"

namespace moeblaze {
inline namespace v0 {
namespace ep {

struct HostForwardArgs {
  Activation activation = Activation::kSwiglu;
  int64_t hidden = 0;  // d
  int64_t ffn = 0;     // h
  int32_t top_k = 0;
  int64_t tokens = 0;               // L, this rank's
  const float* x = nullptr;         // [L, d]
  const int32_t* topk_ids = nullptr;  // [L, k], global expert ids, distinct per token
  const float* gates = nullptr;     // [L, k]
  View w_gate_up;                   // [E_loc, d, g h]: this rank's experts
  View w_down;                      // [E_loc, h, d]
  int64_t max_recv_rows = 0;        // EP_MAX_RECV_TOKENS: 0 dropless, else the most rows a rank receives
  int32_t flag = 0;                 // this rank's error flag going in (e.g. its routing failed checks)
};

// Collective. y [L, d]: for each token, sum over the ranks owning its experts, in rank order, of
// that rank's sum over the token's experts there, in expert-id order, of gate * expert(x).
// fp32 throughout (the experts' GEMMs through experts/expert_mlp, fp32 accumulation).
// Returns the step's error flag, the same on every rank: with kRecvOverflow or kPeerFailed set
// (a rank over max_recv_rows; another rank's nonzero flag) every output is NaN, as on the device.
int32_t host_forward(Transport& tr, const Placement& pl, const HostForwardArgs& a, float* y);

// The backward's outputs, all overwritten: dx [L, d] (the expert path's part), dgates [L, k],
// and this rank's experts' weight gradients, dense fp32: dw_gate_up [E_loc, d, g h] and
// dw_down [E_loc, h, d], summed over every rank's rows in receive order.
struct HostBackwardOut {
  float* dx = nullptr;
  float* dgates = nullptr;
  float* dw_gate_up = nullptr;
  float* dw_down = nullptr;
};

// Collective, given dy [L, d]: dispatches x again beside dy (no saved state), recomputes each
// expert's up GEMM and activation, and returns each row's partial dx (its experts in id order)
// and gate gradients <dy, o_e> to the token's rank, which sums the partial dx in rank order.
// Returns the step's error flag, as host_forward.
int32_t host_backward(Transport& tr, const Placement& pl, const HostForwardArgs& a, const float* dy,
                      const HostBackwardOut& out);

}  // namespace ep
}  // namespace v0
}  // namespace moeblaze
