// Rows of an operand that other GPUs are still storing while a kernel reads them (the
// expert-parallel dispatch running beside the local experts' GEMMs): row r may be read once
// ready[r] is nonzero, which its sender stores with release semantics at system scope after
// the row's bytes. Kernels that take one wait per row before they read it; an unset `ready`
// means every row is already there.
#pragma once

#include <cstdint>

#include "util/dtype.hpp"  // MOEBLAZE_HD

namespace moeblaze {
inline namespace v0 {

// How long a row may take before the step is flagged and the kernel reads on (a peer that
// stopped, or left the collective sequence): far beyond any exchange, short of a hang.
constexpr uint64_t kRowArrivalTimeoutNs = 20ull * 1000 * 1000 * 1000;

struct RowArrival {
  const uint32_t* ready = nullptr;  // [rows] nonzero once the row is there; null: all are
  // The step's error flag: a nonzero value when the wait starts means the step already failed
  // (nothing is waited for); a row that does not arrive within the timeout sets late_bit.
  int32_t* flag = nullptr;
  int32_t late_bit = 0;
  // Persistent kernels that wait take at most this many CTAs (0: one per SM), so that the
  // senders' CTAs always find SMs: a wait can never hold every SM.
  int32_t max_ctas = 0;
  uint64_t timeout_ns = kRowArrivalTimeoutNs;

  MOEBLAZE_HD bool waits() const { return ready != nullptr; }
};

}  // namespace v0
}  // namespace moeblaze
