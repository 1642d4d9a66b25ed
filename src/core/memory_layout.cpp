#include "core/memory_layout.hpp"

#include "util/align.hpp"

namespace moeblaze {
inline namespace v0 {

SavedRegions carve_saved(const LayerConfig& cfg, int64_t L, void* base, bool with_acts) {
  Carver c(base);
  const size_t slots = static_cast<size_t>(L * cfg.top_k);
  SavedRegions r;
  r.plan.token_expert_indices = c.take<int32_t>(slots);
  r.plan.gates = c.take<float>(slots);
  r.plan.expert_token_indices = c.take<int32_t>(slots);
  r.plan.token_index_map = c.take<int32_t>(slots);
  r.plan.expert_token_offsets = c.take<int32_t>(static_cast<size_t>(cfg.num_experts + 1));
  if (with_acts) {
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
