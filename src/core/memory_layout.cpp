#include "core/memory_layout.hpp"

#include "core/args.hpp"
#include "util/align.hpp"
#include "util/error.hpp"

namespace moeblaze {
inline namespace v0 {
namespace {

// FNV-1a over 64-bit words: stable across builds and platforms (no std::hash).
struct Fnv {
  uint64_t h = 0xcbf29ce484222325ull;
  Fnv& add(uint64_t v) {
    for (int i = 0; i < 8; ++i) {
      h ^= (v >> (8 * i)) & 0xffu;
      h *= 0x100000001b3ull;
    }
    return *this;
  }
};

uint64_t header_check(const SavedHeader& s) {
  return Fnv()
      .add(s.magic)
      .add(s.layout_version)
      .add(s.config_fingerprint)
      .add(static_cast<uint64_t>(s.num_tokens))
      .add(static_cast<uint32_t>(s.pass))
      .add(static_cast<uint32_t>(s.engine))
      .h;
}

}  // namespace

uint64_t saved_fingerprint(const LayerConfig& c) {
  // Everything that decides the saved layout or how backward reads it. Not MAX_TOKENS (the
  // layout depends on L alone), NUM_THREADS (results do not) or the loss coefficients.
  Fnv f = Fnv()
      .add(static_cast<uint64_t>(c.num_experts))
      .add(static_cast<uint64_t>(c.top_k))
      .add(static_cast<uint64_t>(c.hidden))
      .add(static_cast<uint64_t>(c.ffn_hidden))
      .add(static_cast<uint64_t>(c.activation))
      .add(static_cast<uint64_t>(c.score_fn))
      .add(c.normalize_topk)
      .add(static_cast<uint64_t>(c.act_dtype))
      .add(static_cast<uint64_t>(c.weight_dtype))
      .add(static_cast<uint64_t>(c.save_policy))
      .add(static_cast<uint64_t>(c.engine))
      .add(static_cast<uint64_t>(static_cast<uint32_t>(c.device_type)));
  // Only when set, so that every single-GPU layer's value is unchanged.
  if (c.empty_slots) f.add(0x656d707479ull);
  if (c.ep_ranks != 1) f.add(static_cast<uint64_t>(c.ep_ranks)).add(static_cast<uint64_t>(c.ep_max_recv_tokens));
  return f.h;
}

SavedHeader make_saved_header(const LayerConfig& cfg, int64_t L) {
  SavedHeader s{};
  s.magic = kSavedMagic;
  s.layout_version = kSavedLayoutVersion;
  s.config_fingerprint = saved_fingerprint(cfg);
  s.num_tokens = L;
  s.pass = static_cast<int32_t>(Pass::kForwardTraining);
  s.engine = static_cast<int32_t>(cfg.engine);
  s.check = header_check(s);
  return s;
}

SavedHeader spent_saved_header(const LayerConfig& cfg, int64_t L) {
  SavedHeader s = make_saved_header(cfg, L);
  s.pass = static_cast<int32_t>(Pass::kBackwardLastUse);
  s.check = header_check(s);
  return s;
}

void check_saved_header(const SavedHeader& got, const LayerConfig& cfg, int64_t L) {
  const SavedHeader want = make_saved_header(cfg, L);
  const char* what = "saved buffer";
  if (got.magic != want.magic)
    fail(Status::kInvalidArgument, "%s was not written by a training forward of this library (bad magic 0x%08x)", what,
         got.magic);
  if (header_check(got) != got.check)
    fail(Status::kInvalidArgument, "%s header is corrupt (its check value does not match)", what);
  if (got.layout_version != want.layout_version)
    fail(Status::kInvalidArgument, "%s has layout version %u; this library reads version %u", what, got.layout_version,
         want.layout_version);
  if (got.config_fingerprint != want.config_fingerprint || got.engine != want.engine)
    fail(Status::kInvalidArgument, "%s was written by a handle with another configuration or engine", what);
  if (got.pass == static_cast<int32_t>(Pass::kBackwardLastUse))
    fail(Status::kInvalidArgument, "%s was spent by moeblaze_backward_last_use: run a training forward again", what);
  if (got.pass != want.pass)
    fail(Status::kInvalidArgument, "%s was written by pass %d, not by a training forward", what, got.pass);
  if (got.num_tokens != L)
    fail(Status::kInvalidArgument, "%s was written for num_tokens = %lld but backward has num_tokens = %lld", what,
         static_cast<long long>(got.num_tokens), static_cast<long long>(L));
}

SavedRegions carve_saved(const LayerConfig& cfg, int64_t L, void* base, bool saved_buffer) {
  Carver c(base);
  const size_t slots = static_cast<size_t>(L * cfg.top_k);
  SavedRegions r;
  if (saved_buffer) r.header = c.take<SavedHeader>(1);
  r.plan.token_expert_indices = c.take<int32_t>(slots);
  r.plan.gates = c.take<float>(slots);
  r.plan.expert_token_indices = c.take<int32_t>(slots);
  r.plan.token_index_map = c.take<int32_t>(slots);
  r.plan.expert_token_offsets = c.take<int32_t>(static_cast<size_t>(cfg.num_experts + 1));
  if (saved_buffer) {
    const size_t s = dtype_size(cfg.act_dtype);
    if (cfg.save_policy != SavePolicy::kRecomputeUp)
      r.preact = c.take<char>(slots * static_cast<size_t>(cfg.gate_up_cols()) * s);
    if (cfg.save_policy == SavePolicy::kSaveAll)
      r.act = c.take<char>(slots * static_cast<size_t>(cfg.ffn_hidden) * s);
  }
  r.bytes = c.size();
  return r;
}

}  // namespace v0
}  // namespace moeblaze
