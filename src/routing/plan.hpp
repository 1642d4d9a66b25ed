// The routing plan (the paper's four index lists), built atomic-free and without a sort in
// three passes over tiles of tokens: dense token-expert map -> per-expert counts and offsets
// -> location map. The dense map is tiled so scratch stays O(T E + (L/T) E), never O(L E).
#pragma once

#include <cstddef>
#include <cstdint>

#include "core/memory_layout.hpp"
#include "core/view.hpp"
#include "util/thread_pool.hpp"

namespace moeblaze {
inline namespace v0 {
namespace routing {

struct PlanGeometry {
  int64_t tile_tokens;  // T
  int64_t num_tiles;    // ceil(L / T)
};
PlanGeometry plan_geometry(int64_t num_tokens, int64_t num_experts);

// Scratch for build_plan: per-(tile, expert) counts plus one T x E dense tile per worker.
size_t plan_scratch_bytes(int64_t num_tokens, int64_t num_experts, int workers);

// Checks caller-given ids (int32 or int64 rows of a strided [L, k] view): each in [0, E) and
// distinct within a token. Throws Error(kInvalidArgument) naming the first bad token. Writes
// the ids, as int32, to token_expert_indices only when all are valid.
// A token that `mask` (TOKEN_MASK, when present) masks gets k empty slots (-1), its ids unread.
void import_topk_ids(const char* ids, bool ids_are_i64, int64_t row_stride_elems, int64_t num_tokens,
                     int64_t k, int64_t num_experts, const View& mask, int32_t* token_expert_indices);

// Builds expert_token_indices, expert_token_offsets and token_index_map of `plan` from its
// token_expert_indices (which must be valid; -1 is an empty slot, given no position). Deterministic for any worker count; the scratch
// holds one dense tile per pool worker (plan_scratch_bytes with pool.workers()).
void build_plan(RoutingPlan& plan, int64_t num_tokens, int64_t k, int64_t num_experts, void* scratch,
                const ThreadPool& pool);

// Checks a plan that came from outside (a caller's saved buffer) before any of its indices is
// followed: offsets start at 0, never decrease and end at L*k; every id is in [0, E) and
// distinct within its token; every slot (t, j) maps to a position of its expert's range that
// holds token t (so token_index_map is a bijection and expert_token_indices lies in [0, L));
// tokens ascend within each expert's range, as build_plan writes them. An id of -1 is an empty
// slot (a masked token's): it has no position (token_index_map -1), and the positions end at
// off[E] <= L*k, one per filled slot.
// Throws Error(kInvalidArgument) naming the first violation. O(L k^2), reads only [L*k] and
// [E+1] entries.
void validate_plan(const RoutingPlan& plan, int64_t num_tokens, int64_t k, int64_t num_experts);

}  // namespace routing
}  // namespace v0
}  // namespace moeblaze
