#include "ep/send_plan.hpp"

#include <algorithm>

namespace moeblaze {
inline namespace v0 {
namespace ep {

const char* placement_error(int64_t ranks, int64_t num_experts) {
  if (ranks < 1) return "the EP group needs at least one rank";
  if (num_experts < ranks) return "every rank must own at least one expert (NUM_EXPERTS >= ranks)";
  if (num_experts % ranks) return "NUM_EXPERTS must be a multiple of the EP group's size";
  return nullptr;
}

SendPlan make_send_plan(const Placement& pl, const int32_t* topk_ids, int64_t num_tokens, int32_t top_k) {
  SendPlan sp;
  const int32_t P = pl.ranks;
  sp.ranks = P;
  sp.top_k = top_k;
  sp.row_slots = std::min(top_k, pl.experts_per_rank());
  sp.token_slots = std::min(top_k, P);
  // Counting pass, then placement: sends grouped by destination, token order within each.
  std::vector<int32_t> count(P, 0);
  std::vector<char> reaches(P);
  for (int64_t t = 0; t < num_tokens; ++t) {
    std::fill(reaches.begin(), reaches.end(), 0);
    for (int32_t j = 0; j < top_k; ++j) reaches[pl.owner(topk_ids[t * top_k + j])] = 1;
    for (int32_t q = 0; q < P; ++q) count[q] += reaches[q];
  }
  sp.dest_start.assign(P + 1, 0);
  for (int32_t q = 0; q < P; ++q) sp.dest_start[q + 1] = sp.dest_start[q] + count[q];
  const int32_t sends = sp.dest_start[P];
  sp.token.assign(sends, -1);
  sp.local_expert.assign(static_cast<size_t>(sends) * sp.row_slots, -1);
  sp.topk_slot.assign(static_cast<size_t>(sends) * sp.row_slots, -1);
  sp.token_send.assign(static_cast<size_t>(num_tokens) * sp.token_slots, -1);
  std::vector<int32_t> next(sp.dest_start.begin(), sp.dest_start.end() - 1);
  std::vector<int32_t> order(top_k);
  for (int64_t t = 0; t < num_tokens; ++t) {
    const int32_t* ids = topk_ids + t * top_k;
    // The token's slots in expert-id order: a rank's experts are then consecutive and ascending.
    for (int32_t j = 0; j < top_k; ++j) order[j] = j;
    std::sort(order.begin(), order.end(), [&](int32_t a, int32_t b) { return ids[a] < ids[b]; });
    int32_t reached = 0, send = -1, filled = 0, rank = -1;
    for (int32_t j : order) {
      const int32_t q = pl.owner(ids[j]);
      if (q != rank) {  // the next destination, in rank order
        rank = q;
        send = next[q]++;
        filled = 0;
        sp.token[send] = static_cast<int32_t>(t);
        sp.token_send[t * sp.token_slots + reached++] = send;
      }
      sp.local_expert[static_cast<size_t>(send) * sp.row_slots + filled] = pl.local(ids[j]);
      sp.topk_slot[static_cast<size_t>(send) * sp.row_slots + filled] = j;
      ++filled;
    }
  }
  return sp;
}

std::vector<int64_t> receive_offsets(const std::vector<int32_t>& counts) {
  std::vector<int64_t> off(counts.size() + 1, 0);
  for (size_t s = 0; s < counts.size(); ++s) off[s + 1] = off[s] + counts[s];
  return off;
}

}  // namespace ep
}  // namespace v0
}  // namespace moeblaze
