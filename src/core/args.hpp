// Argument decoding: the C argument array (kind, flags, DLTensor) becomes validated views.
// Every check a call makes on its arguments happens here, on the host, before any work.
#pragma once

#include <cstddef>
#include <cstdint>

#include "core/config.hpp"
#include "core/view.hpp"
#include "cuda/row_arrival.hpp"
#include "cuda/side_lane.hpp"
#include "util/dtype.hpp"

namespace moeblaze {
inline namespace v0 {

// kBackwardLastUse names moeblaze_backward_last_use's workspace; its arguments are backward's.
enum class Pass : int32_t { kForwardTraining = 0, kForwardInference = 1, kBackward = 2, kRoute = 3, kBackwardLastUse = 4 };

enum class ArgKind : int32_t {
  kInput = 1, kRouterWeight = 2, kRouterLogits = 3, kExpertBias = 4, kWGateUp = 5, kWDown = 6,
  kTopkIndices = 7, kTopkWeights = 8, kSequenceLengths = 9, kTokenMask = 10,
  kOutput = 32, kAuxLoss = 33, kTokensPerExpert = 34, kZLoss = 35, kStatus = 36,
  kGradOutput = 64, kGradAuxLoss = 65, kGradZLoss = 66,
  kGradInput = 96, kGradRouterWeight = 97, kGradRouterLogits = 98, kGradWGateUp = 100,
  kGradWDown = 101, kGradTopkWeights = 102,
};
constexpr uint32_t kArgFlagAccumulate = 0x1u;

// Layout-identical to moeblaze_tensor_t / moeblaze_arg_t (static_asserts in src/api).
struct RawTensor {
  void* data;
  int32_t device_type, device_id;
  int32_t ndim;
  uint8_t code, bits;
  uint16_t lanes;
  const int64_t* shape;
  const int64_t* strides;
  uint64_t byte_offset;
};
struct RawArg {
  int32_t kind;
  uint32_t flags;
  RawTensor tensor;
};

enum class RoutingMode : int32_t { kLogits = 0, kRouterWeight = 1, kCallerTopK = 2 };

struct CallArgs {
  int64_t num_tokens = 0;
  RoutingMode mode = RoutingMode::kLogits;
  View x, router_weight, logits, expert_bias, w_gate_up, w_down, topk_ids, topk_weights, sequence_lengths, token_mask;
  View y, aux_loss, tokens_per_expert, z_loss, status;
  View dy, grad_aux, grad_z;
  View dx, d_router_weight, d_logits, d_w_gate_up, d_w_down, d_topk_weights;
  // Internal (an expert-parallel layer's local call): x's rows in forward, dy's in backward,
  // still arriving from other GPUs while the call runs; engines that cannot wait ignore it, and
  // their caller waits for every row first.
  RowArrival arrival;
  // Internal (an expert-parallel layer's local call): where the token-order combine stores row t
  // of y in forward: out_rows[t], none where null, instead of the dense view.
  // Engines that cannot take it ignore it, and their caller moves the dense rows.
  char* const* out_rows = nullptr;
  // With out_rows: the row (of the call's rows) the combine starts from, the rows before it
  // going last; null: row 0. Ranks that store into each other start at different destinations.
  const int32_t* out_rows_first = nullptr;
  // Internal (an expert-parallel layer's local call): a stream beside the call's, on which an
  // engine enqueues the lane's work once dx is final (cuda/side_lane.hpp). Only the fused
  // engine takes it (on the lane, or on the call's stream where it cannot go beside), so an
  // expert-parallel layer hands it to no other.
  SideLane side;
};

// Decodes and validates args for `pass`; throws Error(kInvalidArgument) naming the problem.
CallArgs decode_args(const LayerConfig& cfg, Pass pass, const RawArg* args, size_t num_args);

// A buffer of the call besides its arguments (the workspace, the saved buffer): the bytes the
// call touches, and whether it writes them.
struct CallBuffer {
  const char* name;
  const void* data;
  size_t bytes;
  bool written;
};

// Refuses a call whose buffers share a byte with an argument or with each other where either
// side is written (an OUTPUT inside the saved buffer would overwrite the plan that the combine
// then follows). Run after decode_args, which checked the arguments among themselves: only
// the pairs with a buffer are tested here. Before anything is written.
void check_call_buffers(const CallArgs& c, Pass pass, const CallBuffer* buffers, size_t num_buffers);

// A STATUS scalar on its own (moeblaze_assert_status): int32, on the handle's device.
View decode_status(const LayerConfig& cfg, const RawTensor& status);

const char* pass_name(Pass p);

}  // namespace v0
}  // namespace moeblaze
