// Expert parallelism's routing arithmetic (docs/ep.md), host definition: which ranks each of a
// rank's tokens travels to, where its row lies in a destination's receive buffer, and which of
// the destination's local experts the row feeds. The EP reference engine runs on it, and the
// device kernels are tested against it.
#pragma once

#include <cstdint>
#include <vector>

namespace moeblaze {
inline namespace v0 {
namespace ep {

// P ranks; rank r owns the global experts [r E_loc, (r + 1) E_loc), E_loc = E / P.
struct Placement {
  int32_t ranks = 1;
  int32_t num_experts = 0;

  int32_t experts_per_rank() const { return num_experts / ranks; }
  int32_t owner(int32_t e) const { return e / experts_per_rank(); }
  int32_t local(int32_t e) const { return e % experts_per_rank(); }
};

// Why P ranks cannot hold E experts, or nullptr.
const char* placement_error(int64_t ranks, int64_t num_experts);

// Bits of an EP step's error flag, beside the routing plan's (1, 2, 4); the same on the host and
// the device.
constexpr int32_t kRecvOverflow = 8;  // some rank would receive more rows than EP_MAX_RECV_TOKENS
constexpr int32_t kPeerFailed = 16;   // another rank's call failed its checks

// One rank's sends for one step. A token travels once to each rank that owns at least one of
// its experts; the sends to rank q are that rank's rows from this source, in token order.
struct SendPlan {
  int32_t ranks = 0;
  int32_t top_k = 0;
  int32_t row_slots = 0;    // min(k, E_loc): the most local experts one row can feed
  int32_t token_slots = 0;  // min(k, P): the most ranks one token can reach
  std::vector<int32_t> dest_start;    // [P + 1]: the sends to rank q are [dest_start[q], dest_start[q + 1])
  std::vector<int32_t> token;         // [sends]: the token of each send
  // [sends * row_slots]: the destination's local experts the row feeds, ascending (the order the
  // destination sums them in), and for each the token's top-k slot (where its gate is); -1 past
  // the row's experts.
  std::vector<int32_t> local_expert;
  std::vector<int32_t> topk_slot;
  // [L * token_slots]: each token's sends in rank order (the order its combine sums the
  // returning rows in); -1 past the token's ranks.
  std::vector<int32_t> token_send;

  int32_t sends() const { return static_cast<int32_t>(token.size()); }
  int32_t sends_to(int32_t q) const { return dest_start[q + 1] - dest_start[q]; }
};

// From the rank's top-k ids [L, k] (global ids, each in [0, E) and distinct within a token: the
// router's or the validated caller's).
SendPlan make_send_plan(const Placement& pl, const int32_t* topk_ids, int64_t num_tokens, int32_t top_k);

// A destination's receive layout: rows arrive ordered by source rank, then by the source's token
// order, so the layout depends only on the counts, never on arrival timing. counts[s] = rows
// source s sends here; returns [P + 1] offsets (the last is the total).
std::vector<int64_t> receive_offsets(const std::vector<int32_t>& counts);

}  // namespace ep
}  // namespace v0
}  // namespace moeblaze
