// The layer configuration: attribute table (names, types, bounds, defaults) and the
// validated, immutable LayerConfig a handle is built from.
#pragma once

#include <cstdint>

#include "util/dtype.hpp"

namespace moeblaze {
inline namespace v0 {

// Values equal the public enums (checked in src/api).
enum class Attr : int32_t {
  kNumExperts = 0, kTopK = 1, kHiddenSize = 2, kFfnHiddenSize = 3, kMaxTokens = 4,
  kActivation = 5, kScoreFunction = 6, kNormalizeTopK = 7, kAuxLossCoeff = 8, kZLossCoeff = 9,
  kActivationDtype = 10, kWeightDtype = 11, kAccumDtype = 12, kSavePolicy = 13,
  kDeterministic = 14, kDeviceType = 15, kDeviceId = 16, kEngine = 17, kNumThreads = 18,
  kWindowTokens = 19, kEpMaxRecvTokens = 20, kEpTransport = 21, kEpCommSms = 22, kEpSize = 23, kEpRank = 24,
  kNumExpertGroups = 25, kTopkGroups = 26, kRouteScale = 27, kAuxLossForm = 28, kWindowBytes = 29,
};
constexpr int kAttrCount = 30;
// The largest TOP_K a layer takes (the attribute's bound; kernels size per-token buffers by it).
constexpr int64_t kMaxTopK = 64;

enum class Activation : int32_t { kRelu = 0, kGelu = 1, kSilu = 2, kSwiglu = 3, kGeglu = 4 };
enum class ScoreFn : int32_t { kSoftmax = 0, kSigmoid = 1 };
enum class SavePolicy : int32_t { kSavePreact = 0, kRecomputeUp = 1, kSaveAll = 2 };
enum class EngineKind : int32_t { kAuto = 0, kCpu = 1, kCudaCublasLt = 2, kCudaFused = 3 };
enum class ValueType : int32_t { kI64 = 0, kF64 = 1, kDType = 2 };
constexpr int32_t kDeviceCpu = 1;
constexpr int32_t kDeviceCuda = 2;

MOEBLAZE_HD constexpr bool is_gated(Activation a) { return a == Activation::kSwiglu || a == Activation::kGeglu; }

struct AttrInfo {
  const char* name;
  ValueType type;
  bool required;
  int64_t min_i64, max_i64, default_i64;
  double default_f64;
  DType default_dtype;
  int32_t since_minor = 1;  // the 0.x release that introduced it
};
// nullptr for unknown attributes.
const AttrInfo* attr_info(int32_t attr);

// Raw attribute values as set by the user (the C config object).
struct ConfigValues {
  int64_t i64[kAttrCount];
  double f64[kAttrCount];
  DType dtype[kAttrCount];
  bool set[kAttrCount];
  ConfigValues();
  void set_i64(int32_t attr, int64_t v);
  void set_f64(int32_t attr, double v);
  void set_dtype(int32_t attr, DType v);
  int64_t get_i64(int32_t attr) const;
  double get_f64(int32_t attr) const;
  DType get_dtype(int32_t attr) const;
};

// Validated layer description; immutable once a handle owns it.
struct LayerConfig {
  int64_t num_experts, top_k, hidden, ffn_hidden, max_tokens;
  Activation activation;
  ScoreFn score_fn;
  bool normalize_topk;
  double aux_loss_coeff, z_loss_coeff;
  DType act_dtype, weight_dtype, accum_dtype;
  SavePolicy save_policy;
  bool deterministic;
  int32_t device_type, device_id;
  EngineKind engine;
  int32_t num_threads;
  int64_t window_tokens;  // 0: automatic (engines/fused/window.hpp)
  int64_t window_bytes;   // 0: automatic; else the windows' memory budget (engines/fused/window.hpp)
  // Routing options beyond softmax/sigmoid top-k (docs/routing.md).
  int64_t num_expert_groups = 1, topk_groups = 0;  // 0: no group limit
  double route_scale = 1.0;
  int32_t aux_loss_form = 0;  // moeblaze_aux_loss_form_t
  // The batch-wise balance loss's coefficient in the Switch form: k times AUX_LOSS_COEFF for
  // the Hugging Face form (docs/routing.md).
  double balance_coeff() const { return aux_loss_coeff * (aux_loss_form == 1 ? static_cast<double>(top_k) : 1.0); }
  // Internal, never an attribute: caller ids may be -1, an empty slot that routes nothing (no
  // expert row, nothing added to y, a zero gate gradient). The expert-parallel layer's local
  // experts run on received rows that feed 1..k of them.
  bool empty_slots = false;
  // Expert parallelism (docs/ep.md): the attributes, then what create found. ep_size and ep_rank
  // are what the caller expects (0 / -1: anything); ep_ranks and ep_rank_of the group's size and
  // this layer's rank (1 and 0 on one GPU); the handle's weights hold num_experts / ep_ranks experts.
  int64_t ep_max_recv_tokens = 0;
  int32_t ep_transport = 0;
  int32_t ep_comm_sms = 0;
  int32_t ep_size = 0;
  int32_t ep_rank = -1;
  int32_t ep_ranks = 1;
  int32_t ep_rank_of = 0;

  int64_t gate_up_cols() const { return (is_gated(activation) ? 2 : 1) * ffn_hidden; }
  int64_t local_experts() const { return num_experts / ep_ranks; }
  // Checks required attributes and cross-attribute rules; throws Error.
  static LayerConfig from_values(const ConfigValues& v);
  ConfigValues to_values() const;
};

}  // namespace v0
}  // namespace moeblaze
