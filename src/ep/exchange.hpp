// Expert parallelism's data movement on the host, over a Transport (docs/ep.md, "A step"):
// the count exchange that fixes every destination's receive layout, the dispatch of
// send-ordered rows into it, and the way back (a combine's rows, a dispatch's backward).
// Rows are opaque byte records: token rows, their experts and gates, or results.
#pragma once

#include <cstdint>
#include <vector>

#include "ep/send_plan.hpp"
#include "ep/transport.hpp"

namespace moeblaze {
inline namespace v0 {
namespace ep {

// The count exchange's result on one rank: its receive offsets ([P + 1], by source rank:
// receive_offsets) and the step's error flag.
struct Counts {
  std::vector<int64_t> recv_off;
  int32_t flag = 0;
};

// Collective: every rank sends every rank its rows per destination and its error flag `flag`,
// so each holds the whole P x P matrix (as the device exchange does). A rank that would receive
// more than recv_bound rows (0: no bound) sets kRecvOverflow on every rank, and then nothing is
// received anywhere (every offset 0); another rank's nonzero flag sets kPeerFailed.
Counts exchange_counts(Transport& t, const SendPlan& sp, int64_t recv_bound = 0, int32_t flag = 0);

// Collective: throws Error(kInvalidArgument) on every rank, naming the first rank whose digest
// differs from rank 0's, unless all ranks passed the same value (a configuration's fingerprint).
void require_same_config(Transport& t, uint64_t digest);

// Collective: send_rows [sends, row_bytes] in the plan's send order (grouped by destination)
// go to their destinations; recv [recv_off[P], row_bytes] receives this rank's rows in receive
// order.
void dispatch_rows(Transport& t, const SendPlan& sp, const std::vector<int64_t>& recv_off, const void* send_rows,
                   int64_t row_bytes, void* recv);

// Collective, the reverse: recv_rows [recv_off[P], row_bytes] in receive order go back to the
// ranks they came from and land in send_rows [sends, row_bytes] in the plan's send order.
void return_rows(Transport& t, const SendPlan& sp, const std::vector<int64_t>& recv_off, const void* recv_rows,
                 int64_t row_bytes, void* send_rows);

}  // namespace ep
}  // namespace v0
}  // namespace moeblaze
