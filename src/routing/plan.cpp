#include "routing/plan.hpp"

#include <algorithm>
#include <cstring>

#include "util/align.hpp"
#include "util/error.hpp"
#include "util/thread_pool.hpp"

namespace moeblaze {
inline namespace v0 {
namespace routing {

PlanGeometry plan_geometry(int64_t L, int64_t E) {
  // About 1 MiB of dense map per tile, between 64 and 4096 tokens.
  int64_t T = std::clamp<int64_t>((int64_t{1} << 20) / std::max<int64_t>(E, 1), 64, 4096);
  return {T, ceil_div(L, T)};
}

size_t plan_scratch_bytes(int64_t L, int64_t E, int workers) {
  PlanGeometry g = plan_geometry(L, E);
  Carver c;
  c.take<int32_t>(static_cast<size_t>(g.num_tiles * E));
  c.take<uint8_t>(static_cast<size_t>(g.tile_tokens * E) * static_cast<size_t>(workers));
  return c.size();
}

void import_topk_ids(const char* ids, bool i64, int64_t stride, int64_t L, int64_t k, int64_t E, const View& mask,
                     int32_t* out) {
  auto is_masked = [&](int64_t t) { return mask.present && mask.index(t) == 0; };
  for (int64_t t = 0; t < L; ++t) {
    if (is_masked(t)) continue;  // its ids are not read
    for (int64_t j = 0; j < k; ++j) {
      const int64_t id = i64 ? reinterpret_cast<const int64_t*>(ids)[t * stride + j]
                             : reinterpret_cast<const int32_t*>(ids)[t * stride + j];
      if (id < 0 || id >= E)
        fail(Status::kInvalidArgument, "TOPK_INDICES[%lld][%lld] = %lld is outside [0, %lld)", static_cast<long long>(t),
             static_cast<long long>(j), static_cast<long long>(id), static_cast<long long>(E));
      for (int64_t i = 0; i < j; ++i) {
        const int64_t prev = i64 ? reinterpret_cast<const int64_t*>(ids)[t * stride + i]
                                 : reinterpret_cast<const int32_t*>(ids)[t * stride + i];
        if (prev == id)
          fail(Status::kInvalidArgument, "TOPK_INDICES row %lld names expert %lld twice", static_cast<long long>(t),
               static_cast<long long>(id));
      }
    }
  }
  for (int64_t t = 0; t < L; ++t)
    for (int64_t j = 0; j < k; ++j)
      out[t * k + j] = is_masked(t) ? -1
                                    : static_cast<int32_t>(i64 ? reinterpret_cast<const int64_t*>(ids)[t * stride + j]
                                                               : reinterpret_cast<const int32_t*>(ids)[t * stride + j]);
}

void validate_plan(const RoutingPlan& plan, int64_t L, int64_t k, int64_t E) {
  const int32_t* off = plan.expert_token_offsets;
  const int64_t P = L * k;
  if (off[0] != 0) fail(Status::kInvalidArgument, "saved routing plan: expert_token_offsets[0] = %d, not 0", off[0]);
  for (int64_t e = 0; e < E; ++e)
    if (off[e + 1] < off[e])
      fail(Status::kInvalidArgument, "saved routing plan: expert_token_offsets decreases at expert %lld", static_cast<long long>(e));
  if (off[E] > P)
    fail(Status::kInvalidArgument, "saved routing plan: expert_token_offsets[E] = %d exceeds L*k = %lld", off[E],
         static_cast<long long>(P));
  int64_t filled = 0;
  for (int64_t t = 0; t < L; ++t)
    for (int64_t j = 0; j < k; ++j) {
      const int32_t e = plan.token_expert_indices[t * k + j];
      if (e == -1) {  // an empty slot (a masked token): no position
        if (plan.token_index_map[t * k + j] != -1)
          fail(Status::kInvalidArgument, "saved routing plan: empty slot (%lld, %lld) maps to a position",
               static_cast<long long>(t), static_cast<long long>(j));
        continue;
      }
      ++filled;
      if (e < 0 || e >= E)
        fail(Status::kInvalidArgument, "saved routing plan: expert id %d of token %lld is outside [0, %lld)", e,
             static_cast<long long>(t), static_cast<long long>(E));
      for (int64_t i = 0; i < j; ++i)
        if (plan.token_expert_indices[t * k + i] == e)
          fail(Status::kInvalidArgument, "saved routing plan: token %lld names expert %d twice", static_cast<long long>(t), e);
      const int32_t pos = plan.token_index_map[t * k + j];
      if (pos < off[e] || pos >= off[e + 1] || plan.expert_token_indices[pos] != t)
        fail(Status::kInvalidArgument, "saved routing plan: slot (%lld, %lld) does not map to a position of expert %d holding its token",
             static_cast<long long>(t), static_cast<long long>(j), e);
      if (pos + 1 < off[e + 1] && plan.expert_token_indices[pos + 1] <= t)
        fail(Status::kInvalidArgument, "saved routing plan: the tokens of expert %d do not ascend at position %d", e, pos);
    }
  if (filled != off[E])  // the slots' positions, distinct, must be exactly [0, off[E])
    fail(Status::kInvalidArgument, "saved routing plan: %lld filled slots for %d positions", static_cast<long long>(filled),
         off[E]);
}

namespace {

// Pass 1 for one tile: dense[r][e] = slot + 1 of token t0 + r's pair with expert e, else 0.
// Each row is written by this worker alone and a token's experts are distinct: no collisions.
void fill_dense_tile(const int32_t* token_expert, int64_t t0, int64_t rows, int64_t k, int64_t E, uint8_t* dense) {
  std::memset(dense, 0, static_cast<size_t>(rows * E));
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t j = 0; j < k; ++j) {
      const int32_t e = token_expert[(t0 + r) * k + j];
      if (e >= 0) dense[r * E + e] = static_cast<uint8_t>(j + 1);  // -1: an empty slot
    }
}

}  // namespace

void build_plan(RoutingPlan& plan, int64_t L, int64_t k, int64_t E, void* scratch, const ThreadPool& pool) {
  const int workers = pool.workers();
  PlanGeometry g = plan_geometry(L, E);
  Carver c(scratch);
  int32_t* tile_counts = c.take<int32_t>(static_cast<size_t>(g.num_tiles * E));
  uint8_t* dense_tiles = c.take<uint8_t>(static_cast<size_t>(g.tile_tokens * E) * static_cast<size_t>(workers));
  const size_t tile_bytes = static_cast<size_t>(g.tile_tokens * E);

  // Pass 1 + 2a: dense map of each tile, then its per-expert column counts.
  pool.parallel_for(g.num_tiles, [&](int64_t tile, int w) {
    uint8_t* dense = dense_tiles + tile_bytes * static_cast<size_t>(w);
    const int64_t t0 = tile * g.tile_tokens, rows = std::min(g.tile_tokens, L - t0);
    fill_dense_tile(plan.token_expert_indices, t0, rows, k, E, dense);
    int32_t* counts = tile_counts + tile * E;
    for (int64_t e = 0; e < E; ++e) counts[e] = 0;
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t e = 0; e < E; ++e) counts[e] += dense[r * E + e] != 0;
  });

  // Pass 2b: one exclusive scan in (expert, tile) order gives the expert offsets and, in
  // place of each count, the first position of that (tile, expert) block.
  int32_t running = 0;
  for (int64_t e = 0; e < E; ++e) {
    plan.expert_token_offsets[e] = running;
    for (int64_t tile = 0; tile < g.num_tiles; ++tile) {
      int32_t n = tile_counts[tile * E + e];
      tile_counts[tile * E + e] = running;
      running += n;
    }
  }
  plan.expert_token_offsets[E] = running;

  // Pass 3: rebuild each tile's dense map; walking it in token order, each expert's cursor
  // (block base + local rank) is the destination: the location map, without atomics.
  pool.parallel_for(g.num_tiles, [&](int64_t tile, int w) {
    uint8_t* dense = dense_tiles + tile_bytes * static_cast<size_t>(w);
    const int64_t t0 = tile * g.tile_tokens, rows = std::min(g.tile_tokens, L - t0);
    fill_dense_tile(plan.token_expert_indices, t0, rows, k, E, dense);
    int32_t* cursor = tile_counts + tile * E;  // this tile's bases, consumed as cursors
    for (int64_t r = 0; r < rows; ++r) {
      const int32_t t = static_cast<int32_t>(t0 + r);
      for (int64_t j = 0; j < k; ++j)  // an empty slot has no position
        if (plan.token_expert_indices[static_cast<int64_t>(t) * k + j] < 0) plan.token_index_map[static_cast<int64_t>(t) * k + j] = -1;
      for (int64_t e = 0; e < E; ++e) {
        const uint8_t slot = dense[r * E + e];
        if (!slot) continue;
        const int32_t pos = cursor[e]++;
        plan.expert_token_indices[pos] = t;
        plan.token_index_map[static_cast<int64_t>(t) * k + (slot - 1)] = pos;
      }
    }
  });
}

}  // namespace routing
}  // namespace v0
}  // namespace moeblaze
