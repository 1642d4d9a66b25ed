// Expert parallelism's routing arithmetic on the device (the GPU form of ep/send_plan.hpp, the
// same rules): which ranks each token travels to and in what order, the per-destination send
// lists, and the token-side maps of the rows that come back. Atomic-free and sort-free, like the
// routing plan: a count pass over tiles of tokens, one scan, a place pass.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

#include "core/memory_layout.hpp"

namespace moeblaze {
inline namespace v0 {
namespace ep {

// The device send plan of one rank's L tokens over P ranks (E_loc experts each), c = min(k, P).
struct DeviceSendPlan {
  int32_t* dest_start = nullptr;  // [P + 1] sends to rank q are [dest_start[q], dest_start[q + 1])
  int32_t* send_token = nullptr;  // [L c] the token of each send (first dest_start[P] entries)
  // [L c] the return row (t c + i) of the token's i-th destination rank, -1 past its ranks: the
  // map the token-order combine sums the returned rows through, in rank order.
  int32_t* return_map = nullptr;
  // [L c] the destination's lowest local expert the send's row feeds: the row is sent in that
  // expert's turn, so a destination's rows arrive in the order its GEMMs read them (null: not
  // needed, rows sent before the GEMMs).
  int32_t* send_first = nullptr;
};

size_t send_plan_scratch_bytes_cuda(int64_t L, int32_t ranks);

// From the rank's top-k ids [L, k] (global, valid: the router's or the checked caller's).
void build_send_plan_cuda(const int32_t* topk_ids, int64_t L, int32_t k, int32_t ranks, int32_t experts_per_rank,
                          const DeviceSendPlan& plan, void* scratch, cudaStream_t s);

// Backward's gate gradients in token order: dg_tok[t k + j] = returned[(t c + i) k_loc + r],
// where the token's j-th expert lives on its i-th destination rank and is the r-th of its
// experts there in id order (the order the destination's row lists them in).
void gather_returned_gates_cuda(const int32_t* topk_ids, int64_t L, int32_t k, int32_t ranks, int32_t experts_per_rank,
                                int32_t row_slots, const float* returned, float* dg_tok, cudaStream_t s);

}  // namespace ep
}  // namespace v0
}  // namespace moeblaze
