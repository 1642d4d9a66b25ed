// Device side of cuda/row_arrival.hpp: the sender's signal after a row, the reader's wait
// before one.
#pragma once

#include <cuda/atomic>

#include "cuda/row_arrival.hpp"

namespace moeblaze {
inline namespace v0 {
__device__ __forceinline__ uint64_t global_ns() {
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

// A warp's marks for the rows it stored: note() after each row keeps the row's mark in the next
// lane; flush() (at 32 held, and when the warp is done with a batch) marks them all arrived with
// one release fence at system scope. The warp barrier orders every lane's row stores before the
// fence; a fence waits for the warp's stores to reach their GPU, so one fence per row held a
// warp to a round trip per row.
struct ArrivalMarks {
  uint32_t* mine = nullptr;  // this lane's held mark (lane < held)
  int held = 0;              // the same in every lane

  __device__ __forceinline__ void note(uint32_t* ready, int lane) {
    if (lane == held) mine = ready;
    if (++held == 32) flush(lane);
  }
  __device__ __forceinline__ void flush(int lane) {
    if (held == 0) return;
    __syncwarp();
    ::cuda::atomic_thread_fence(::cuda::memory_order_release, ::cuda::thread_scope_system);
    if (lane < held) ::cuda::atomic_ref<uint32_t, ::cuda::thread_scope_system>(*mine).store(1u, ::cuda::memory_order_relaxed);
    held = 0;
  }
};

// After a warp stored one row (every lane's part): its mark at `ready`, which may lie on another GPU.
__device__ __forceinline__ void signal_row_arrived(uint32_t* ready, int lane) {
  ArrivalMarks m;
  m.note(ready, lane);
  m.flush(lane);
}

// Waits until rows[i] (i < N; negative: no row) have all arrived: relaxed polls of every
// pending row at once, then one acquire fence, so a tile's rows cost one round trip when they
// are there (one row: acquire polls, no fence). Returns at once when the step is already flagged; after the timeout it flags the
// step (late_bit) and returns, and the rows read are whatever the buffer holds.
template <int N>
__device__ __forceinline__ void wait_rows(const RowArrival& a, const int32_t (&rows)[N]) {
  if (!a.ready) return;
  using Ref = ::cuda::atomic_ref<const uint32_t, ::cuda::thread_scope_system>;
  uint32_t pending = 0;
#pragma unroll
  for (int i = 0; i < N; ++i)
    if (rows[i] >= 0) pending |= 1u << i;
  uint64_t start = 0;
  while (pending) {
#pragma unroll
    for (int i = 0; i < N; ++i)
      if ((pending >> i) & 1u)
        if (Ref(a.ready[rows[i]]).load(N == 1 ? ::cuda::memory_order_acquire : ::cuda::memory_order_relaxed) != 0)
          pending &= ~(1u << i);
    if (!pending) break;
    if (*reinterpret_cast<volatile int32_t*>(a.flag) != 0) return;  // the step failed: nothing to wait for
    const uint64_t now = global_ns();
    if (start == 0) start = now;
    if (now - start > a.timeout_ns) {
      atomicOr(a.flag, a.late_bit);
      return;
    }
    __nanosleep(128);
  }
  if constexpr (N > 1) ::cuda::atomic_thread_fence(::cuda::memory_order_acquire, ::cuda::thread_scope_system);
}

}  // namespace v0
}  // namespace moeblaze
