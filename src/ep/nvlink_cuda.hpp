// The NVLink transport of the expert-parallel layer (docs/ep.md, "Transports"): MoEBlaze's own
// kernels store into the peers' symmetric window through NCCL's device API (load/store
// pointers of an LSA team) and meet them at LSA barriers. Three exchanges per direction:
//   counts:   every rank stores its row counts per destination (and its error flag) into every
//             peer; after the barrier each rank holds the whole P x P matrix and derives where
//             its rows go and where its received rows come from (by source rank, then the
//             source's token order: the layout never depends on timing);
//   dispatch: each send's row (x or dy), and in forward its metadata (token, place among the
//             token's ranks, the destination's local experts in id order and their gates), into
//             the destination's receive rows;
//   return:   each received row's result (y part, dx part, gate gradients) into the token's
//             rank's return rows at (token, place), summed there in rank order.
// Every exchange ends in an acquire-release LSA barrier; stream order and the barriers keep a
// window from being overwritten while it is read (docs/ep.md).
#pragma once

#include <cuda_runtime.h>
#include <nccl.h>
#include <nccl_device.h>

#include <cstddef>
#include <cstdint>

#include "ep/send_plan.hpp"  // the error flag's bits

namespace moeblaze {
inline namespace v0 {
namespace ep {

// One rank's part of the symmetric window, byte offsets (each part 256-byte aligned).
struct WindowLayout {
  int32_t ranks = 0;        // P
  int32_t row_slots = 0;    // k_loc = min(k, E_loc)
  int32_t token_slots = 0;  // c = min(k, P)
  int64_t recv_rows = 0;    // R
  int64_t max_tokens = 0;   // L_max
  int64_t row_bytes = 0;    // d * element size
  size_t counts = 0;        // int32 [P][P + 1]: from each source, its counts per destination and its flag
  size_t rows = 0;          // [R, d] received rows (x in forward, dy in backward)
  size_t meta = 0;          // int2 [R]: each received row's token and place among the token's ranks
  size_t ids = 0;           // int32 [R, k_loc] local expert ids, -1 past the row's experts
  size_t gates = 0;         // fp32 [R, k_loc]
  size_t ret_rows = 0;      // [L_max c, d] returned rows
  size_t ret_gates = 0;     // fp32 [L_max c, k_loc] returned gate gradients
  size_t ready = 0;         // uint32 [R]: nonzero once received row r is there (rows sent beside the GEMMs)
  size_t bytes = 0;         // the whole part, a multiple of 4096 (NCCL's window alignment)
};
WindowLayout window_layout(int32_t ranks, int64_t recv_rows, int64_t max_tokens, int64_t row_bytes, int32_t row_slots,
                           int32_t token_slots);

// The device arrays a step's exchanges read and write on this rank.
struct Exchange {
  ncclDevComm comm;                   // NVLink only
  ncclWindow_t window = nullptr;      // NVLink only
  int32_t rank = 0;
  char* local = nullptr;              // this rank's window part (its local address)
  WindowLayout layout;
  // HOST: this rank's staging, laid out as a window part of L_max c rows with no return parts:
  // a send's row and metadata in send order (then the rows coming back, in the same order), and
  // in `counts` this rank's row of the counts matrix. Null on NVLink.
  char* stage = nullptr;
  WindowLayout stage_layout;
  int32_t ctas = 1;                   // CTAs that move rows (each with its own LSA barrier)
  int32_t* flag = nullptr;            // the step's error flag
  int32_t* matrix = nullptr;          // [P (P + 1)] the counts matrix (saved)
  int32_t* send_offset = nullptr;     // [P] where this rank's rows start in each destination
  int32_t* recv_offset = nullptr;     // [P + 1] received rows by source rank
};

// The staging a HOST exchange needs: window_layout(ranks, L_max c, 0, ...) of `layout`.
WindowLayout stage_layout(const WindowLayout& layout);

// The LSA barriers the exchanges need (the device communicator's lsaBarrierCount): the counts'
// the row exchanges' (one per CTA) and the metadata dispatch's (one per CTA), which may run
// beside a row dispatch.
int32_t exchange_barriers(int32_t ctas);

// counts: stores dest_start's per-destination counts and *flag into every peer, meets them, and
// fills matrix, send_offset and recv_offset. A rank over recv_bound rows sets kRecvOverflow on
// every rank (and then nothing is sent); another rank's flag sets kPeerFailed. With
// clear_ready, this rank's row-arrival marks are cleared before the barrier, so no peer's mark
// of this step can precede the clearing.
void exchange_counts_cuda(const Exchange& x, const int32_t* dest_start, int64_t recv_bound, cudaStream_t s,
                          bool clear_ready = false);

// HOST counts, around ncclAllGather of the row into the matrix: counts_row writes this rank's
// row (its rows per destination, then *flag) into the staging; derive_offsets fills matrix,
// send_offset and recv_offset from the gathered matrix, as exchange_counts does.
void counts_row_cuda(const Exchange& x, const int32_t* dest_start, cudaStream_t s);
void derive_offsets_cuda(const Exchange& x, int64_t recv_bound, cudaStream_t s);

// dispatch: send i carries row send_token[i] of `rows` (stride in elements, es bytes each) to its
// destination (HOST: to the staging, send order); with ids (the token's global top-k ids [L, k])
// and gates, the metadata too (dispatch_metadata_cuda, after the rows).
void dispatch_rows_cuda(const Exchange& x, const char* rows, int64_t row_stride_bytes, const int32_t* dest_start,
                        const int32_t* send_token, const int32_t* ids, const float* gates, int32_t k,
                        int32_t experts_per_rank, cudaStream_t s);

// The dispatch split in two, for rows that arrive while the local experts compute:
// dispatch_metadata_cuda stores each send's metadata alone (HOST: into the staging), meeting the
// peers on barriers of its own, so it may run beside the rows;
// dispatch_rows_by_expert_cuda stores the rows alone from `ctas` CTAs, in turns of the
// destination's local experts (a send goes in the turn of the lowest one its row feeds:
// send_first), marks each row arrived in the destination's `ready` after its bytes, and meets
// the peers when all its rows are out.
void dispatch_metadata_cuda(const Exchange& x, const int32_t* dest_start, const int32_t* send_token, const int32_t* ids,
                            const float* gates, int32_t k, int32_t experts_per_rank, cudaStream_t s);
void dispatch_rows_by_expert_cuda(const Exchange& x, const char* rows, int64_t row_stride_bytes,
                                  const int32_t* dest_start, const int32_t* send_token, const int32_t* send_first,
                                  int32_t experts_per_rank, int32_t ctas, cudaStream_t s);

// Loads the exchange kernels into the context now. Under lazy loading a kernel's first launch
// may wait for the device's running work, which must not be a GEMM waiting for that kernel's
// rows.
void preload_exchange_kernels();

// The receiving side after a forward dispatch: copies the received rows into `rows_out` (the
// saved buffer: backward needs them after the window is reused; null: no copy, as inference
// reads them in the window) and, with mark_empty, marks the local expert slots of the rows past
// the received count empty (-1).
void take_received_cuda(const Exchange& x, char* rows_out, cudaStream_t s, bool mark_empty = true);

// return: received row i of `rows` ([R, d], contiguous; null: none) and, when given, its gate
// gradients ([R, k_loc]) to the return rows of the token's rank, at the place the row's
// metadata in the window names.
void return_rows_cuda(const Exchange& x, const char* rows, const float* gates, cudaStream_t s);
// The rows alone, from `ctas` CTAs and without meeting the peers: a return_rows_cuda after them
// (stream-ordered) meets the peers for both.
void send_return_rows_cuda(const Exchange& x, const char* rows, int32_t ctas, cudaStream_t s);

// Where each received row's result goes when the local experts' combine stores it there itself
// (instead of return_rows_cuda moving it): addr[i] = the return row at (token, place) in the
// window of row i's source, null past the received rows or for metadata out of range.
// poison_returns_cuda fills those rows with NaN when *status != 0 (the local call failed).
// return_rows_cuda(x, nullptr, nullptr) then only meets the peers.
void return_addresses_cuda(const Exchange& x, char** addr, cudaStream_t s);
void poison_returns_cuda(const Exchange& x, char* const* addr, const int32_t* status, cudaStream_t s);

// HOST, after the rows (and gate gradients) of this rank's sends came back into the staging in
// send order: each goes to the token's return rows at the place its dispatch recorded.
void place_returned_cuda(const Exchange& x, const int32_t* dest_start, bool rows, bool gates, cudaStream_t s);

}  // namespace ep
}  // namespace v0
}  // namespace moeblaze
