#include "core/layer.hpp"

#include <cstdint>

#include "core/device_errors.hpp"
#include "core/memory_layout.hpp"
#include "cuda/status_assert.hpp"
#include "util/align.hpp"
#include "util/error.hpp"

namespace moeblaze {
inline namespace v0 {

Layer::Layer(const ConfigValues& values) : cfg_(LayerConfig::from_values(values)) {
  if (cfg_.ep_size > 1 || cfg_.ep_rank > 0)
    fail(Status::kInvalidArgument, "EP_SIZE = %d and EP_RANK = %d ask for an expert-parallel layer: create it with "
         "moeblaze_create_ep on a communicator", cfg_.ep_size, cfg_.ep_rank);
  engine_ = create_engine(cfg_, &decision_);
}

void Layer::check_tokens(int64_t L) const {
  if (L < 0 || L > cfg_.max_tokens)
    fail(Status::kInvalidArgument, "num_tokens = %lld is outside [0, MAX_TOKENS = %lld]", static_cast<long long>(L),
         static_cast<long long>(cfg_.max_tokens));
}

namespace {

// A pass value a size query or a status assertion takes: one of moeblaze_pass_t's.
void check_pass(Pass pass) {
  const int p = static_cast<int>(pass);
  if (p < 0 || p > static_cast<int>(Pass::kBackwardLastUse)) fail(Status::kInvalidArgument, "unknown pass %d", p);
}

// The call whose arguments (and device-side status) a pass has: a last-use backward's are backward's.
Pass arguments_of(Pass pass) { return pass == Pass::kBackwardLastUse ? Pass::kBackward : pass; }

}  // namespace

size_t Layer::workspace_size(Pass pass, int64_t L) const {
  check_pass(pass);
  check_tokens(L);
  return align_up(pass == Pass::kBackwardLastUse ? engine_->last_use_workspace_size(L) : engine_->workspace_size(pass, L));
}

size_t Layer::saved_size(int64_t L) const {
  check_tokens(L);
  return engine_->saved_size(cfg_, L);
}

void Layer::check_buffer(const char* what, const void* p, size_t have, size_t need) const {
  if (have < need)
    fail(Status::kInsufficientWorkspace, "%s is %zu bytes but this call needs %zu (query the size first)", what, have, need);
  if (need > 0 && !p) fail(Status::kInvalidArgument, "%s is NULL but this call needs %zu bytes", what, need);
  if (p && reinterpret_cast<uintptr_t>(p) % kBufferAlignment != 0)
    fail(Status::kInvalidArgument, "%s is not aligned to MOEBLAZE_BUFFER_ALIGNMENT (%zu bytes)", what, kBufferAlignment);
}

namespace {

// SEQUENCE_LENGTHS: at most one sequence per token (and at least one for a call with tokens),
// each at least 1, summing to the call's tokens. The lengths are host memory on the CPU engine,
// checked here; on a GPU they are device memory, checked on the device (the call's status).
void check_sequence_lengths(const LayerConfig& cfg, const CallArgs& a) {
  const View& n = a.sequence_lengths;
  if (!n.present) return;
  if (cfg.aux_loss_form != 0)
    fail(Status::kInvalidArgument, "SEQUENCE_LENGTHS gives DeepSeek-V3's sequence-wise balance loss, which has no "
                                   "Hugging Face form: set AUX_LOSS_FORM to SWITCH or pass no SEQUENCE_LENGTHS");
  if (n.shape[0] > a.num_tokens || (n.shape[0] == 0 && a.num_tokens > 0))
    fail(Status::kInvalidArgument, "SEQUENCE_LENGTHS holds %lld sequences for a call of %lld tokens",
         static_cast<long long>(n.shape[0]), static_cast<long long>(a.num_tokens));
  if (cfg.device_type != kDeviceCpu) return;
  int64_t sum = 0;
  for (int64_t q = 0; q < n.shape[0]; ++q) {
    const int64_t len = n.index(q);
    if (len < 1 || len > a.num_tokens)
      fail(Status::kInvalidArgument, "SEQUENCE_LENGTHS[%lld] = %lld; each must be from 1 to the call's %lld tokens",
           static_cast<long long>(q), static_cast<long long>(len), static_cast<long long>(a.num_tokens));
    sum += len;
  }
  if (sum != a.num_tokens)
    fail(Status::kInvalidArgument, "SEQUENCE_LENGTHS sum to %lld but the call has %lld tokens", static_cast<long long>(sum),
         static_cast<long long>(a.num_tokens));
}

}  // namespace

CallArgs Layer::check(Pass pass, const RawArg* args, size_t num_args) const {
  CallArgs a = decode_args(cfg_, arguments_of(pass), args, num_args);
  check_sequence_lengths(cfg_, a);
  return a;
}

void Layer::forward(Pass pass, const RawArg* args, size_t n, void* ws, size_t ws_bytes, void* saved, size_t saved_bytes,
                    void* stream) const {
  if (pass != Pass::kForwardTraining && pass != Pass::kForwardInference)
    fail(Status::kInvalidArgument, "moeblaze_forward takes FORWARD_TRAINING or FORWARD_INFERENCE, not %s", pass_name(pass));
  CallArgs a = decode_args(cfg_, pass, args, n);
  check_sequence_lengths(cfg_, a);
  const size_t ws_need = workspace_size(pass, a.num_tokens);
  check_buffer("workspace", ws, ws_bytes, ws_need);
  const bool training = pass == Pass::kForwardTraining;
  const size_t saved_need = training ? saved_size(a.num_tokens) : 0;
  if (training) check_buffer("saved", saved, saved_bytes, saved_need);
  const CallBuffer buffers[] = {{"workspace", ws, ws_need, true}, {"saved", saved, saved_need, true}};
  check_call_buffers(a, pass, buffers, training ? 2 : 1);
  engine_->forward(pass, a, ws, pass == Pass::kForwardTraining ? saved : nullptr, stream);
}

void Layer::backward(const RawArg* args, size_t n, void* saved, size_t saved_bytes, void* ws, size_t ws_bytes,
                     void* stream, bool last_use) const {
  CallArgs a = decode_args(cfg_, Pass::kBackward, args, n);
  check_sequence_lengths(cfg_, a);
  const size_t saved_need = saved_size(a.num_tokens),
               ws_need = workspace_size(last_use ? Pass::kBackwardLastUse : Pass::kBackward, a.num_tokens);
  check_buffer("saved", saved, saved_bytes, saved_need);
  check_buffer("workspace", ws, ws_bytes, ws_need);
  const CallBuffer buffers[] = {{"saved", saved, saved_need, last_use}, {"workspace", ws, ws_need, true}};
  check_call_buffers(a, Pass::kBackward, buffers, 2);
  engine_->backward(a, saved, last_use, ws, stream);
}

void Layer::route(const RawArg* args, size_t n, void* ws, size_t ws_bytes, void* stream) const {
  CallArgs a = decode_args(cfg_, Pass::kRoute, args, n);
  check_sequence_lengths(cfg_, a);
  const size_t ws_need = workspace_size(Pass::kRoute, a.num_tokens);
  check_buffer("workspace", ws, ws_bytes, ws_need);
  const CallBuffer buffers[] = {{"workspace", ws, ws_need, true}};
  check_call_buffers(a, Pass::kRoute, buffers, 1);
  engine_->route(a, ws, stream);
}

void Layer::assert_status(Pass pass, const RawTensor* status, void* stream) const {
  check_pass(pass);
  pass = arguments_of(pass);
  if (!status) fail(Status::kInvalidArgument, "status is NULL");
  const View v = decode_status(cfg_, *status);
  const cuda::StatusSite site = pass == Pass::kBackward ? cuda::StatusSite::kBackward
                                : pass == Pass::kRoute  ? cuda::StatusSite::kRoute
                                                        : cuda::StatusSite::kForward;
  if (cfg_.device_type == kDeviceCuda) {
    cuda::assert_status(reinterpret_cast<const int32_t*>(v.data), site, cfg_.device_id, stream);
    return;
  }
  if (*reinterpret_cast<const int32_t*>(v.data) != 0)
    fail(Status::kInvalidArgument, "%s", site == cuda::StatusSite::kForward    ? MOEBLAZE_DEVICE_ERROR_FORWARD
                                         : site == cuda::StatusSite::kBackward ? MOEBLAZE_DEVICE_ERROR_BACKWARD
                                                                               : MOEBLAZE_DEVICE_ERROR_ROUTE);
}

}  // namespace v0
}  // namespace moeblaze
