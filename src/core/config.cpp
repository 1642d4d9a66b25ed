#include "core/config.hpp"

#include <cmath>

#include "util/error.hpp"

namespace moeblaze {
inline namespace v0 {
namespace {

constexpr int64_t kMaxI32 = 2147483647;

// Indexed by Attr; order and names are part of the documented interface (attr_query).
const AttrInfo kAttrTable[kAttrCount] = {
    {"num_experts", ValueType::kI64, true, 1, 65536, 0, 0.0, DType::kInvalid},
    {"top_k", ValueType::kI64, true, 1, kMaxTopK, 0, 0.0, DType::kInvalid},
    {"hidden_size", ValueType::kI64, true, 1, 1 << 20, 0, 0.0, DType::kInvalid},
    {"ffn_hidden_size", ValueType::kI64, true, 1, 1 << 20, 0, 0.0, DType::kInvalid},
    {"max_tokens", ValueType::kI64, true, 1, kMaxI32, 0, 0.0, DType::kInvalid},
    {"activation", ValueType::kI64, false, 0, 4, 3, 0.0, DType::kInvalid},
    {"score_function", ValueType::kI64, false, 0, 1, 0, 0.0, DType::kInvalid},
    {"normalize_topk", ValueType::kI64, false, 0, 1, 0, 0.0, DType::kInvalid},
    {"aux_loss_coeff", ValueType::kF64, false, 0, 0, 0, 0.0, DType::kInvalid},
    {"z_loss_coeff", ValueType::kF64, false, 0, 0, 0, 0.0, DType::kInvalid},
    {"activation_dtype", ValueType::kDType, false, 0, 0, 0, 0.0, DType::kBF16},
    {"weight_dtype", ValueType::kDType, false, 0, 0, 0, 0.0, DType::kBF16},
    {"accum_dtype", ValueType::kDType, false, 0, 0, 0, 0.0, DType::kF32},
    {"save_policy", ValueType::kI64, false, 0, 2, 0, 0.0, DType::kInvalid},
    {"deterministic", ValueType::kI64, false, 0, 1, 1, 0.0, DType::kInvalid},
    {"device_type", ValueType::kI64, false, 1, 2, kDeviceCuda, 0.0, DType::kInvalid},
    {"device_id", ValueType::kI64, false, -1, 1023, -1, 0.0, DType::kInvalid},
    {"engine", ValueType::kI64, false, 0, 3, 0, 0.0, DType::kInvalid},
    {"num_threads", ValueType::kI64, false, 0, 1024, 0, 0.0, DType::kInvalid},
    {"window_tokens", ValueType::kI64, false, 0, kMaxI32, 0, 0.0, DType::kInvalid, 2},
    {"ep_max_recv_tokens", ValueType::kI64, false, 0, kMaxI32, 0, 0.0, DType::kInvalid, 2},
    {"ep_transport", ValueType::kI64, false, 0, 2, 0, 0.0, DType::kInvalid, 2},
    {"ep_comm_sms", ValueType::kI64, false, 0, 128, 0, 0.0, DType::kInvalid, 2},
    {"ep_size", ValueType::kI64, false, 0, 1024, 0, 0.0, DType::kInvalid, 2},
    {"ep_rank", ValueType::kI64, false, -1, 1023, -1, 0.0, DType::kInvalid, 2},
    {"num_expert_groups", ValueType::kI64, false, 1, 65536, 1, 0.0, DType::kInvalid, 2},
    {"topk_groups", ValueType::kI64, false, 0, 65536, 0, 0.0, DType::kInvalid, 2},
    {"route_scale", ValueType::kF64, false, 0, 0, 0, 1.0, DType::kInvalid, 2},
    {"aux_loss_form", ValueType::kI64, false, 0, 1, 0, 0.0, DType::kInvalid, 2},
    {"window_bytes", ValueType::kI64, false, 0, int64_t{1} << 62, 0, 0.0, DType::kInvalid, 2},
};

const AttrInfo& checked(int32_t attr, ValueType want) {
  const AttrInfo* info = attr_info(attr);
  if (!info) fail(Status::kUnknownAttribute, "unknown attribute %d (this library knows 0..%d)", attr, kAttrCount - 1);
  if (info->type != want) {
    static const char* names[] = {"i64", "f64", "dtype"};
    fail(Status::kAttributeTypeMismatch, "attribute %s has value type %s, not %s", info->name,
         names[static_cast<int>(info->type)], names[static_cast<int>(want)]);
  }
  return *info;
}

}  // namespace

const AttrInfo* attr_info(int32_t attr) {
  if (attr < 0 || attr >= kAttrCount) return nullptr;
  return &kAttrTable[attr];
}

ConfigValues::ConfigValues() {
  for (int a = 0; a < kAttrCount; ++a) {
    i64[a] = kAttrTable[a].default_i64;
    f64[a] = kAttrTable[a].default_f64;
    dtype[a] = kAttrTable[a].default_dtype;
    set[a] = false;
  }
}

void ConfigValues::set_i64(int32_t attr, int64_t v) {
  const AttrInfo& info = checked(attr, ValueType::kI64);
  if (v < info.min_i64 || v > info.max_i64)
    fail(Status::kInvalidArgument, "%s = %lld is outside [%lld, %lld]", info.name,
         static_cast<long long>(v), static_cast<long long>(info.min_i64),
         static_cast<long long>(info.max_i64));
  i64[attr] = v;
  set[attr] = true;
}

void ConfigValues::set_f64(int32_t attr, double v) {
  const AttrInfo& info = checked(attr, ValueType::kF64);
  if (!std::isfinite(v) || v < 0.0) fail(Status::kInvalidArgument, "%s = %g must be finite and >= 0", info.name, v);
  f64[attr] = v;
  set[attr] = true;
}

void ConfigValues::set_dtype(int32_t attr, DType v) {
  const AttrInfo& info = checked(attr, ValueType::kDType);
  if (!is_float(v)) fail(Status::kInvalidArgument, "%s must be a float dtype (f32, f16 or bf16), got %s", info.name, dtype_name(v));
  if (attr == static_cast<int32_t>(Attr::kAccumDtype) && v != DType::kF32)
    fail(Status::kNotSupported, "accum_dtype %s is not supported: version 0.1 accumulates in f32", dtype_name(v));
  dtype[attr] = v;
  set[attr] = true;
}

int64_t ConfigValues::get_i64(int32_t attr) const { checked(attr, ValueType::kI64); return i64[attr]; }
double ConfigValues::get_f64(int32_t attr) const { checked(attr, ValueType::kF64); return f64[attr]; }
DType ConfigValues::get_dtype(int32_t attr) const { checked(attr, ValueType::kDType); return dtype[attr]; }

LayerConfig LayerConfig::from_values(const ConfigValues& v) {
  for (int a = 0; a < kAttrCount; ++a)
    if (kAttrTable[a].required && !v.set[a]) fail(Status::kInvalidArgument, "required attribute %s is not set", kAttrTable[a].name);
  auto I = [&](Attr a) { return v.i64[static_cast<int>(a)]; };
  LayerConfig c;
  c.num_experts = I(Attr::kNumExperts);
  c.top_k = I(Attr::kTopK);
  c.hidden = I(Attr::kHiddenSize);
  c.ffn_hidden = I(Attr::kFfnHiddenSize);
  c.max_tokens = I(Attr::kMaxTokens);
  c.activation = static_cast<Activation>(I(Attr::kActivation));
  c.score_fn = static_cast<ScoreFn>(I(Attr::kScoreFunction));
  c.normalize_topk = I(Attr::kNormalizeTopK) != 0;
  c.aux_loss_coeff = v.f64[static_cast<int>(Attr::kAuxLossCoeff)];
  c.z_loss_coeff = v.f64[static_cast<int>(Attr::kZLossCoeff)];
  c.act_dtype = v.dtype[static_cast<int>(Attr::kActivationDtype)];
  c.weight_dtype = v.dtype[static_cast<int>(Attr::kWeightDtype)];
  c.accum_dtype = v.dtype[static_cast<int>(Attr::kAccumDtype)];
  c.save_policy = static_cast<SavePolicy>(I(Attr::kSavePolicy));
  c.deterministic = I(Attr::kDeterministic) != 0;
  c.device_type = static_cast<int32_t>(I(Attr::kDeviceType));
  c.device_id = static_cast<int32_t>(I(Attr::kDeviceId));
  c.engine = static_cast<EngineKind>(I(Attr::kEngine));
  c.num_threads = static_cast<int32_t>(I(Attr::kNumThreads));
  c.window_tokens = I(Attr::kWindowTokens);
  c.window_bytes = I(Attr::kWindowBytes);
  c.ep_max_recv_tokens = I(Attr::kEpMaxRecvTokens);
  c.ep_transport = static_cast<int32_t>(I(Attr::kEpTransport));
  c.ep_comm_sms = static_cast<int32_t>(I(Attr::kEpCommSms));
  c.ep_size = static_cast<int32_t>(I(Attr::kEpSize));
  c.ep_rank = static_cast<int32_t>(I(Attr::kEpRank));
  c.num_expert_groups = I(Attr::kNumExpertGroups);
  c.topk_groups = I(Attr::kTopkGroups);
  c.route_scale = v.f64[static_cast<int>(Attr::kRouteScale)];
  c.aux_loss_form = static_cast<int32_t>(I(Attr::kAuxLossForm));

  if (c.top_k > c.num_experts)
    fail(Status::kInvalidArgument, "top_k = %lld exceeds num_experts = %lld", static_cast<long long>(c.top_k),
         static_cast<long long>(c.num_experts));
  if (c.window_tokens > c.max_tokens)
    fail(Status::kInvalidArgument, "window_tokens = %lld exceeds max_tokens = %lld (0 chooses the window automatically)",
         static_cast<long long>(c.window_tokens), static_cast<long long>(c.max_tokens));
  if (c.window_tokens > 0 && c.window_bytes > 0)
    fail(Status::kInvalidArgument,
         "window_tokens = %lld and window_bytes = %lld are both set: the window is given by one of them",
         static_cast<long long>(c.window_tokens), static_cast<long long>(c.window_bytes));
  if (c.num_experts % c.num_expert_groups != 0)
    fail(Status::kInvalidArgument, "num_expert_groups = %lld does not divide num_experts = %lld",
         static_cast<long long>(c.num_expert_groups), static_cast<long long>(c.num_experts));
  if (c.topk_groups > c.num_expert_groups)
    fail(Status::kInvalidArgument, "topk_groups = %lld exceeds num_expert_groups = %lld",
         static_cast<long long>(c.topk_groups), static_cast<long long>(c.num_expert_groups));
  if (c.topk_groups > 0 && c.topk_groups * (c.num_experts / c.num_expert_groups) < c.top_k)
    fail(Status::kInvalidArgument,
         "topk_groups = %lld groups of %lld experts hold fewer than top_k = %lld experts",
         static_cast<long long>(c.topk_groups), static_cast<long long>(c.num_experts / c.num_expert_groups),
         static_cast<long long>(c.top_k));
  if (c.max_tokens * c.top_k > kMaxI32)
    fail(Status::kInvalidArgument, "max_tokens * top_k = %lld must stay below 2^31 (int32 routing indices)",
         static_cast<long long>(c.max_tokens * c.top_k));
  return c;
}

ConfigValues LayerConfig::to_values() const {
  ConfigValues v;
  auto S = [&](Attr a, int64_t x) { v.i64[static_cast<int>(a)] = x; v.set[static_cast<int>(a)] = true; };
  S(Attr::kNumExperts, num_experts);
  S(Attr::kTopK, top_k);
  S(Attr::kHiddenSize, hidden);
  S(Attr::kFfnHiddenSize, ffn_hidden);
  S(Attr::kMaxTokens, max_tokens);
  S(Attr::kActivation, static_cast<int64_t>(activation));
  S(Attr::kScoreFunction, static_cast<int64_t>(score_fn));
  S(Attr::kNormalizeTopK, normalize_topk ? 1 : 0);
  S(Attr::kSavePolicy, static_cast<int64_t>(save_policy));
  S(Attr::kDeterministic, deterministic ? 1 : 0);
  S(Attr::kDeviceType, device_type);
  S(Attr::kDeviceId, device_id);
  S(Attr::kEngine, static_cast<int64_t>(engine));
  S(Attr::kNumThreads, num_threads);
  S(Attr::kWindowTokens, window_tokens);
  S(Attr::kWindowBytes, window_bytes);
  S(Attr::kEpMaxRecvTokens, ep_max_recv_tokens);
  S(Attr::kEpTransport, ep_transport);
  S(Attr::kEpCommSms, ep_comm_sms);
  S(Attr::kEpSize, ep_ranks);    // a handle reports what it is
  S(Attr::kEpRank, ep_rank_of);
  S(Attr::kNumExpertGroups, num_expert_groups);
  S(Attr::kTopkGroups, topk_groups);
  S(Attr::kAuxLossForm, aux_loss_form);
  v.f64[static_cast<int>(Attr::kRouteScale)] = route_scale;
  v.f64[static_cast<int>(Attr::kAuxLossCoeff)] = aux_loss_coeff;
  v.f64[static_cast<int>(Attr::kZLossCoeff)] = z_loss_coeff;
  v.dtype[static_cast<int>(Attr::kActivationDtype)] = act_dtype;
  v.dtype[static_cast<int>(Attr::kWeightDtype)] = weight_dtype;
  v.dtype[static_cast<int>(Attr::kAccumDtype)] = accum_dtype;
  return v;
}

}  // namespace v0
}  // namespace moeblaze
