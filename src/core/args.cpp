#include "core/args.hpp"

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <utility>

#include "util/error.hpp"

namespace moeblaze {
inline namespace v0 {
namespace {

// No user-space address (host or CUDA unified addressing) reaches 2^57: x86-64 with 5-level
// paging and 52-bit ARM64 stay below it. A view that would, wrapped or was given a wild
// byte_offset.
constexpr uint64_t kMaxAddress = uint64_t{1} << 57;
// An expected extent that any length from 1 to the call's tokens meets (SEQUENCE_LENGTHS).
constexpr int64_t kAnyLength = -2;

enum Use : uint8_t { kNo = 0, kOptional = 1, kRequired = 2 };
enum class Role : uint8_t { kInput, kOutput, kGradOutput };
enum class TypeRule : uint8_t { kAct, kWeight, kRouter, kIndex, kScalarF32, kScalarI32, kF32 };

struct KindInfo {
  ArgKind kind;
  const char* name;
  Role role;
  TypeRule type;
  // Use per pass: forward training, forward inference, backward, route.
  Use use[4];
};

const KindInfo kKinds[] = {
    {ArgKind::kInput, "INPUT", Role::kInput, TypeRule::kAct, {kRequired, kRequired, kRequired, kOptional}},
    {ArgKind::kRouterWeight, "ROUTER_WEIGHT", Role::kInput, TypeRule::kWeight, {kOptional, kOptional, kOptional, kOptional}},
    {ArgKind::kRouterLogits, "ROUTER_LOGITS", Role::kInput, TypeRule::kRouter, {kOptional, kOptional, kOptional, kOptional}},
    // Backward accepts it (frameworks pass the forward's arguments again) and does not read it.
    {ArgKind::kExpertBias, "EXPERT_BIAS", Role::kInput, TypeRule::kF32, {kOptional, kOptional, kOptional, kOptional}},
    {ArgKind::kWGateUp, "W_GATE_UP", Role::kInput, TypeRule::kWeight, {kRequired, kRequired, kRequired, kNo}},
    {ArgKind::kWDown, "W_DOWN", Role::kInput, TypeRule::kWeight, {kRequired, kRequired, kRequired, kNo}},
    // In backward the saved buffer holds the ids and gates; the caller's copies are accepted
    // (frameworks pass the forward's arguments again) and not read.
    {ArgKind::kTopkIndices, "TOPK_INDICES", Role::kInput, TypeRule::kIndex, {kOptional, kOptional, kOptional, kRequired}},
    {ArgKind::kTopkWeights, "TOPK_WEIGHTS", Role::kInput, TypeRule::kRouter, {kOptional, kOptional, kOptional, kRequired}},
    {ArgKind::kSequenceLengths, "SEQUENCE_LENGTHS", Role::kInput, TypeRule::kIndex, {kOptional, kOptional, kOptional, kOptional}},
    // Backward accepts it and does not read it: the saved plan marks the masked tokens.
    {ArgKind::kTokenMask, "TOKEN_MASK", Role::kInput, TypeRule::kIndex, {kOptional, kOptional, kOptional, kOptional}},
    {ArgKind::kOutput, "OUTPUT", Role::kOutput, TypeRule::kAct, {kRequired, kRequired, kNo, kNo}},
    {ArgKind::kAuxLoss, "AUX_LOSS", Role::kOutput, TypeRule::kScalarF32, {kOptional, kOptional, kNo, kOptional}},
    {ArgKind::kTokensPerExpert, "TOKENS_PER_EXPERT", Role::kOutput, TypeRule::kIndex, {kOptional, kOptional, kNo, kOptional}},
    {ArgKind::kZLoss, "Z_LOSS", Role::kOutput, TypeRule::kScalarF32, {kOptional, kOptional, kNo, kOptional}},
    {ArgKind::kStatus, "STATUS", Role::kOutput, TypeRule::kScalarI32, {kOptional, kOptional, kOptional, kOptional}},
    {ArgKind::kGradOutput, "GRAD_OUTPUT", Role::kInput, TypeRule::kAct, {kNo, kNo, kRequired, kNo}},
    {ArgKind::kGradAuxLoss, "GRAD_AUX_LOSS", Role::kInput, TypeRule::kScalarF32, {kNo, kNo, kOptional, kNo}},
    {ArgKind::kGradZLoss, "GRAD_Z_LOSS", Role::kInput, TypeRule::kScalarF32, {kNo, kNo, kOptional, kNo}},
    {ArgKind::kGradInput, "GRAD_INPUT", Role::kGradOutput, TypeRule::kAct, {kNo, kNo, kOptional, kNo}},
    {ArgKind::kGradRouterWeight, "GRAD_ROUTER_WEIGHT", Role::kGradOutput, TypeRule::kWeight, {kNo, kNo, kOptional, kNo}},
    {ArgKind::kGradRouterLogits, "GRAD_ROUTER_LOGITS", Role::kGradOutput, TypeRule::kRouter, {kNo, kNo, kOptional, kNo}},
    {ArgKind::kGradWGateUp, "GRAD_W_GATE_UP", Role::kGradOutput, TypeRule::kWeight, {kNo, kNo, kOptional, kNo}},
    {ArgKind::kGradWDown, "GRAD_W_DOWN", Role::kGradOutput, TypeRule::kWeight, {kNo, kNo, kOptional, kNo}},
    {ArgKind::kGradTopkWeights, "GRAD_TOPK_WEIGHTS", Role::kGradOutput, TypeRule::kRouter, {kNo, kNo, kOptional, kNo}},
};
constexpr size_t kNumKinds = sizeof(kKinds) / sizeof(kKinds[0]);

const KindInfo* find_kind(int32_t kind) {
  for (const KindInfo& k : kKinds)
    if (static_cast<int32_t>(k.kind) == kind) return &k;
  return nullptr;
}

View* slot(CallArgs& c, ArgKind k) {
  switch (k) {
    case ArgKind::kInput: return &c.x;
    case ArgKind::kRouterWeight: return &c.router_weight;
    case ArgKind::kRouterLogits: return &c.logits;
    case ArgKind::kExpertBias: return &c.expert_bias;
    case ArgKind::kWGateUp: return &c.w_gate_up;
    case ArgKind::kWDown: return &c.w_down;
    case ArgKind::kTopkIndices: return &c.topk_ids;
    case ArgKind::kTopkWeights: return &c.topk_weights;
    case ArgKind::kSequenceLengths: return &c.sequence_lengths;
    case ArgKind::kTokenMask: return &c.token_mask;
    case ArgKind::kOutput: return &c.y;
    case ArgKind::kAuxLoss: return &c.aux_loss;
    case ArgKind::kTokensPerExpert: return &c.tokens_per_expert;
    case ArgKind::kZLoss: return &c.z_loss;
    case ArgKind::kStatus: return &c.status;
    case ArgKind::kGradOutput: return &c.dy;
    case ArgKind::kGradAuxLoss: return &c.grad_aux;
    case ArgKind::kGradZLoss: return &c.grad_z;
    case ArgKind::kGradInput: return &c.dx;
    case ArgKind::kGradRouterWeight: return &c.d_router_weight;
    case ArgKind::kGradRouterLogits: return &c.d_logits;
    case ArgKind::kGradWGateUp: return &c.d_w_gate_up;
    case ArgKind::kGradWDown: return &c.d_w_down;
    case ArgKind::kGradTopkWeights: return &c.d_topk_weights;
  }
  return nullptr;
}

// Expected shape of a kind; -1 marks the token dimension (filled once L is known).
int expected_shape(const LayerConfig& cfg, ArgKind k, int64_t L, int64_t* s) {
  const int64_t E = cfg.num_experts, d = cfg.hidden, h = cfg.ffn_hidden, K = cfg.top_k;
  switch (k) {
    case ArgKind::kInput: case ArgKind::kOutput: case ArgKind::kGradOutput: case ArgKind::kGradInput:
      s[0] = L; s[1] = d; return 2;
    case ArgKind::kRouterWeight: case ArgKind::kGradRouterWeight: s[0] = E; s[1] = d; return 2;
    case ArgKind::kRouterLogits: case ArgKind::kGradRouterLogits: s[0] = L; s[1] = E; return 2;
    // The handle's own experts: all of them, or an expert-parallel rank's E / P.
    case ArgKind::kWGateUp: case ArgKind::kGradWGateUp: s[0] = cfg.local_experts(); s[1] = d; s[2] = cfg.gate_up_cols(); return 3;
    case ArgKind::kWDown: case ArgKind::kGradWDown: s[0] = cfg.local_experts(); s[1] = h; s[2] = d; return 3;
    case ArgKind::kTopkIndices: case ArgKind::kTopkWeights: case ArgKind::kGradTopkWeights:
      s[0] = L; s[1] = K; return 2;
    case ArgKind::kTokensPerExpert: case ArgKind::kExpertBias: s[0] = E; return 1;
    case ArgKind::kSequenceLengths: s[0] = kAnyLength; return 1;
    case ArgKind::kTokenMask: s[0] = L; return 1;
    case ArgKind::kAuxLoss: case ArgKind::kZLoss: case ArgKind::kGradAuxLoss: case ArgKind::kGradZLoss:
    case ArgKind::kStatus:
      return 0;
  }
  return 0;
}

void shape_str(char* buf, size_t n, int nd, const int64_t* s) {
  size_t used = 0;
  used += snprintf(buf + used, n - used, "[");
  for (int i = 0; i < nd && used < n; ++i)
    used += snprintf(buf + used, n - used, "%s%lld", i ? ", " : "", static_cast<long long>(s[i]));
  if (used < n) snprintf(buf + used, n - used, "]");
}

void check_dtype(const LayerConfig& cfg, const KindInfo& ki, DType t) {
  bool ok = false;
  const char* want = "";
  switch (ki.type) {
    case TypeRule::kAct: ok = t == cfg.act_dtype; want = dtype_name(cfg.act_dtype); break;
    case TypeRule::kWeight: ok = t == cfg.weight_dtype; want = dtype_name(cfg.weight_dtype); break;
    case TypeRule::kRouter: ok = t == DType::kF32 || t == cfg.act_dtype; want = "f32 or the activation dtype"; break;
    case TypeRule::kIndex: ok = t == DType::kI32 || t == DType::kI64; want = "i32 or i64"; break;
    case TypeRule::kScalarF32: ok = t == DType::kF32; want = "f32"; break;
    case TypeRule::kScalarI32: ok = t == DType::kI32; want = "i32"; break;
    case TypeRule::kF32: ok = t == DType::kF32; want = "f32"; break;
  }
  if (!ok) fail(Status::kInvalidArgument, "%s has dtype %s; expected %s", ki.name, dtype_name(t), want);
}

// The expert weights and their gradients may come column-major per expert (View::transposed).
bool takes_transposed(ArgKind k) {
  return k == ArgKind::kWGateUp || k == ArgKind::kWDown || k == ArgKind::kGradWGateUp || k == ArgKind::kGradWDown;
}

View make_view(const LayerConfig& cfg, const KindInfo& ki, const RawArg& a, int64_t L) {
  const RawTensor& t = a.tensor;
  if (t.device_type != cfg.device_type || t.device_id != cfg.device_id)
    fail(Status::kInvalidArgument, "%s lives on device (type %d, id %d) but the handle is on (type %d, id %d)",
         ki.name, t.device_type, t.device_id, cfg.device_type, cfg.device_id);
  DType dt = dtype_from_dlpack(t.code, t.bits, t.lanes);
  if (dt == DType::kInvalid)
    fail(Status::kInvalidArgument, "%s has an unsupported dtype (code %u, bits %u, lanes %u)", ki.name, t.code, t.bits, t.lanes);
  check_dtype(cfg, ki, dt);

  int64_t want[3] = {0, 0, 0};
  int nd = expected_shape(cfg, ki.kind, L, want);
  View v;
  v.present = true;
  v.accumulate = (a.flags & kArgFlagAccumulate) != 0;
  v.dtype = dt;
  v.ndim = nd;
  if (nd == 0) {  // scalar: ndim 0, or ndim 1 with shape [1]
    bool ok = t.ndim == 0 || (t.ndim == 1 && t.shape && t.shape[0] == 1);
    if (!ok) fail(Status::kInvalidArgument, "%s must be a scalar (ndim 0, or ndim 1 with shape [1])", ki.name);
  } else {
    if (t.ndim != nd || !t.shape) {
      char w[96];
      shape_str(w, sizeof w, nd, want);
      fail(Status::kInvalidArgument, "%s must have %d dimensions %s; got ndim %d%s", ki.name, nd, w, t.ndim,
           t.shape ? "" : " with a NULL shape");
    }
    for (int i = 0; i < nd; ++i) {
      if (want[i] == kAnyLength) {
        if (t.shape[i] < 1 || t.shape[i] > std::max<int64_t>(L, 1))
          fail(Status::kInvalidArgument, "%s has %lld entries; expected 1 to %lld (one per sequence of the call's tokens)",
               ki.name, static_cast<long long>(t.shape[i]), static_cast<long long>(std::max<int64_t>(L, 1)));
        want[i] = t.shape[i];
      }
      if (t.shape[i] != want[i]) {
        char w[96], g[96];
        shape_str(w, sizeof w, nd, want);
        shape_str(g, sizeof g, nd, t.shape);
        fail(Status::kInvalidArgument, "%s has shape %s; expected %s", ki.name, g, w);
      }
      v.shape[i] = want[i];
    }
    // An expert-weight matrix stored column-major (nn.Linear's [out, in] seen through swapped
    // strides) is taken as its physical row-major array with the transposed flag (core/view.hpp).
    int64_t strides[3] = {0, 0, 0};
    for (int i = 0; t.strides && i < nd; ++i) strides[i] = t.strides[i];
    if (t.strides && takes_transposed(ki.kind) && v.shape[2] > 1 && strides[2] != 1) {
      if (v.shape[1] > 1 && strides[1] != 1)
        fail(Status::kInvalidArgument, "%s has strides [%lld, %lld, %lld]: one of its last two dimensions must have "
             "stride 1 (row-major, or column-major per expert as nn.Linear stores [out, in])", ki.name,
             static_cast<long long>(strides[0]), static_cast<long long>(strides[1]), static_cast<long long>(strides[2]));
      v.transposed = true;
      std::swap(v.shape[1], v.shape[2]);
      std::swap(strides[1], strides[2]);
      strides[2] = 1;  // a unit dimension's stride is free; the physical rows are unit-stride
    }
    // Strides: NULL means row-major contiguous. Otherwise the innermost stride must be 1 and
    // every outer stride must step past the whole extent of the block inside it (its last
    // element included): no two elements share an address and none is reordered. Padding
    // between blocks is free, so an expert stride may lie anywhere from that extent upwards.
    int64_t extent = 1;  // elements from the first to one past the last of the inner block
    for (int i = nd - 1; i >= 0; --i) {
      int64_t s = t.strides ? strides[i] : extent;
      if (v.shape[i] > 1) {
        if (i == nd - 1 && s != 1)
          fail(Status::kInvalidArgument, "%s has innermost stride %lld; only unit-stride rows are supported", ki.name,
               static_cast<long long>(s));
        if (i < nd - 1 && s < extent)
          fail(Status::kInvalidArgument, "%s has stride[%d] = %lld < %lld, the extent of the block inside it: elements "
               "would overlap or be reordered", ki.name, i, static_cast<long long>(s), static_cast<long long>(extent));
      }
      v.stride[i] = (v.shape[i] > 1) ? s : extent;
      int64_t step = 0;
      if (__builtin_mul_overflow(v.stride[i], v.shape[i] > 1 ? v.shape[i] - 1 : 0, &step) ||
          __builtin_add_overflow(step, extent, &extent))
        fail(Status::kInvalidArgument, "%s: stride[%d] = %lld times its extent overflows 64 bits", ki.name, i,
             static_cast<long long>(v.stride[i]));
    }
  }
  int64_t count = 1;
  for (int i = 0; i < nd; ++i) count *= v.shape[i];
  if (count > 0 || nd == 0) {
    if (!t.data) fail(Status::kInvalidArgument, "%s has a NULL data pointer", ki.name);
    // The whole view, data + byte_offset up to its last element, must lie inside the address
    // space: no pointer arithmetic below may wrap.
    uint64_t last = 0;  // element offset of the last element
    for (int i = 0; i < nd; ++i) last += static_cast<uint64_t>(v.shape[i] - 1) * static_cast<uint64_t>(v.stride[i]);
    uint64_t span = 0, begin = 0, end = 0;
    const uint64_t es = dtype_size(dt);
    if (__builtin_mul_overflow(last + 1, es, &span) ||
        __builtin_add_overflow(static_cast<uint64_t>(reinterpret_cast<uintptr_t>(t.data)), t.byte_offset, &begin) ||
        __builtin_add_overflow(begin, span, &end) || end > kMaxAddress)
      fail(Status::kInvalidArgument, "%s: data + byte_offset (%llu) + its extent (%llu bytes) leaves the address space",
           ki.name, static_cast<unsigned long long>(t.byte_offset), static_cast<unsigned long long>(span));
    if (begin % es != 0)
      fail(Status::kInvalidArgument, "%s data + byte_offset is not aligned to its %zu-byte elements", ki.name, dtype_size(dt));
    v.data = reinterpret_cast<char*>(static_cast<uintptr_t>(begin));
    v.span_bytes = static_cast<size_t>(span);
  }
  return v;
}

// Whether the call writes this argument: outputs and gradient outputs, and the router outputs
// TOPK_INDICES / TOPK_WEIGHTS when the call routes (they are inputs only for caller routing).
bool is_written(const KindInfo& ki, Pass pass, RoutingMode mode) {
  if (ki.role != Role::kInput) return true;
  const bool router_out = ki.kind == ArgKind::kTopkIndices || ki.kind == ArgKind::kTopkWeights;
  return router_out && pass != Pass::kBackward && mode != RoutingMode::kCallerTopK;
}

struct Range {
  const char* name;
  uintptr_t lo, hi;
  bool written;
};

// No two ranges may share a byte when either is written: no engine supports in-place updates,
// and a read after an aliased write would be silently wrong (or, for the plan indices kept in
// the workspace and the saved buffer, a wild read). The test is on byte intervals, so it is
// conservative for interleaved strided views. Only pairs whose later member is at index
// `first` or beyond are tested: the pairs among r[0, first) were checked before.
void check_disjoint(const Range* r, size_t n, size_t first = 0) {
  for (size_t b = first; b < n; ++b)
    for (size_t a = 0; a < b; ++a)
      if ((r[a].written || r[b].written) && r[a].lo < r[b].hi && r[b].lo < r[a].hi)
        fail(Status::kInvalidArgument, "%s and %s overlap in memory; %s is written by this call, so they must not alias",
             r[a].name, r[b].name, r[a].written ? r[a].name : r[b].name);
}

// The argument views as ranges (views without elements take no bytes); returns how many.
size_t argument_ranges(const CallArgs& c, Pass pass, Range* r) {
  size_t n = 0;
  for (size_t i = 0; i < kNumKinds; ++i) {
    const View* v = slot(const_cast<CallArgs&>(c), kKinds[i].kind);
    if (!v->present || v->span_bytes == 0) continue;
    const uintptr_t lo = reinterpret_cast<uintptr_t>(v->data);
    r[n++] = {kKinds[i].name, lo, lo + v->span_bytes, is_written(kKinds[i], pass, c.mode)};
  }
  return n;
}

void check_no_overlap(const CallArgs& c, Pass pass) {
  Range r[kNumKinds];
  check_disjoint(r, argument_ranges(c, pass, r));
}

}  // namespace

void check_call_buffers(const CallArgs& c, Pass pass, const CallBuffer* buffers, size_t num_buffers) {
  constexpr size_t kMaxBuffers = 2;
  if (num_buffers > kMaxBuffers) fail(Status::kInternalError, "check_call_buffers takes at most %zu buffers", kMaxBuffers);
  Range r[kNumKinds + kMaxBuffers];
  const size_t num_arg_ranges = argument_ranges(c, pass, r);  // disjoint already (decode_args)
  size_t n = num_arg_ranges;
  for (size_t i = 0; i < num_buffers; ++i) {
    const CallBuffer& b = buffers[i];
    if (!b.data || b.bytes == 0) continue;
    const uintptr_t lo = reinterpret_cast<uintptr_t>(b.data);
    uintptr_t hi = 0;
    if (__builtin_add_overflow(lo, b.bytes, &hi) || hi > kMaxAddress)
      fail(Status::kInvalidArgument, "%s (%zu bytes) leaves the address space", b.name, b.bytes);
    r[n++] = {b.name, lo, hi, b.written};
  }
  check_disjoint(r, n, num_arg_ranges);
}

const char* pass_name(Pass p) {
  switch (p) {
    case Pass::kForwardTraining: return "forward (training)";
    case Pass::kForwardInference: return "forward (inference)";
    case Pass::kBackward: return "backward";
    case Pass::kRoute: return "route";
    case Pass::kBackwardLastUse: return "backward (last use)";
  }
  return "?";
}

View decode_status(const LayerConfig& cfg, const RawTensor& status) {
  const RawArg a{static_cast<int32_t>(ArgKind::kStatus), 0u, status};
  return make_view(cfg, *find_kind(a.kind), a, 0);
}

CallArgs decode_args(const LayerConfig& cfg, Pass pass, const RawArg* args, size_t num_args) {
  const int p = static_cast<int>(pass);
  if (p < 0 || p > 3) fail(Status::kInvalidArgument, "unknown pass %d", p);
  if (num_args > 0 && !args) fail(Status::kInvalidArgument, "args is NULL but num_args = %zu", num_args);

  // First pass over the array: kinds, flags, duplicates; find the token count.
  const RawArg* by_kind[kNumKinds] = {};
  for (size_t i = 0; i < num_args; ++i) {
    const KindInfo* ki = find_kind(args[i].kind);
    if (!ki) fail(Status::kInvalidArgument, "args[%zu] has unknown argument kind %d", i, args[i].kind);
    size_t idx = static_cast<size_t>(ki - kKinds);
    if (ki->use[p] == kNo) fail(Status::kInvalidArgument, "%s is not an argument of %s", ki->name, pass_name(pass));
    if (by_kind[idx]) fail(Status::kInvalidArgument, "%s is given twice", ki->name);
    if (args[i].flags & ~kArgFlagAccumulate)
      fail(Status::kInvalidArgument, "%s has unknown flag bits 0x%x", ki->name, args[i].flags & ~kArgFlagAccumulate);
    if ((args[i].flags & kArgFlagAccumulate) && ki->role != Role::kGradOutput)
      fail(Status::kInvalidArgument, "MOEBLAZE_ARG_FLAG_ACCUMULATE is only valid on gradient outputs, not on %s", ki->name);
    by_kind[idx] = &args[i];
  }
  for (size_t i = 0; i < kNumKinds; ++i)
    if (kKinds[i].use[p] == kRequired && !by_kind[i])
      fail(Status::kInvalidArgument, "%s requires the %s argument", pass_name(pass), kKinds[i].name);

  // The token count comes from the first token-shaped argument present.
  CallArgs c;
  int64_t L = -1;
  const ArgKind token_kinds[] = {ArgKind::kInput, ArgKind::kRouterLogits, ArgKind::kTopkIndices};
  for (ArgKind k : token_kinds) {
    const RawArg* a = by_kind[find_kind(static_cast<int32_t>(k)) - kKinds];
    if (a && a->tensor.ndim >= 1 && a->tensor.shape) { L = a->tensor.shape[0]; break; }
  }
  if (L < 0) fail(Status::kInvalidArgument, "cannot tell the number of tokens: pass INPUT or ROUTER_LOGITS");
  if (L > cfg.max_tokens)
    fail(Status::kInvalidArgument, "num_tokens = %lld exceeds MAX_TOKENS = %lld", static_cast<long long>(L),
         static_cast<long long>(cfg.max_tokens));
  c.num_tokens = L;

  for (size_t i = 0; i < kNumKinds; ++i)
    if (by_kind[i]) *slot(c, kKinds[i].kind) = make_view(cfg, kKinds[i], *by_kind[i], L);

  // Routing mode and the rules that depend on it.
  if (c.logits.present && c.router_weight.present)
    fail(Status::kInvalidArgument, "ROUTER_LOGITS and ROUTER_WEIGHT are mutually exclusive");
  if (c.logits.present) c.mode = RoutingMode::kLogits;
  else if (c.router_weight.present) c.mode = RoutingMode::kRouterWeight;
  else c.mode = RoutingMode::kCallerTopK;

  if (c.mode == RoutingMode::kRouterWeight && !c.x.present)
    fail(Status::kInvalidArgument, "routing from ROUTER_WEIGHT needs INPUT");
  if (pass == Pass::kRoute && c.mode == RoutingMode::kCallerTopK)
    fail(Status::kInvalidArgument, "route needs ROUTER_LOGITS, or INPUT and ROUTER_WEIGHT");
  if ((pass == Pass::kForwardTraining || pass == Pass::kForwardInference) && c.mode == RoutingMode::kCallerTopK) {
    if (!c.topk_ids.present || !c.topk_weights.present)
      fail(Status::kInvalidArgument,
           "no routing input: pass ROUTER_LOGITS, or ROUTER_WEIGHT, or both TOPK_INDICES and TOPK_WEIGHTS");
    if (c.aux_loss.present || c.z_loss.present)
      fail(Status::kInvalidArgument, "AUX_LOSS and Z_LOSS need router scores: route from ROUTER_LOGITS or ROUTER_WEIGHT");
  }
  if (c.expert_bias.present && c.mode == RoutingMode::kCallerTopK && pass != Pass::kBackward)
    fail(Status::kInvalidArgument, "EXPERT_BIAS applies to the library's routing: pass ROUTER_LOGITS or ROUTER_WEIGHT, "
                                   "not TOPK_INDICES and TOPK_WEIGHTS");
  check_no_overlap(c, pass);
  if (pass == Pass::kBackward) {
    if (c.d_logits.present && c.mode != RoutingMode::kLogits)
      fail(Status::kInvalidArgument, "GRAD_ROUTER_LOGITS needs ROUTER_LOGITS among the backward arguments");
    if (c.d_router_weight.present && c.mode != RoutingMode::kRouterWeight)
      fail(Status::kInvalidArgument, "GRAD_ROUTER_WEIGHT needs ROUTER_WEIGHT among the backward arguments");
  }
  return c;
}

}  // namespace v0
}  // namespace moeblaze
