// The stage ring's synchronisation, in one place: a position in the ring (stage index and
// barrier phase), the producer/consumer protocol over its full and empty mbarriers, with the
// arrival counts it was initialised with, and the ping-pong warpgroups' order of MMAs. Every
// sm_90a kernel's warp roles go through these types; none does index, phase or arrival
// arithmetic of its own (the model is CUTLASS's PipelineTmaAsync and OrderedSequenceBarrier).
//
// Protocol, per stage fill:
//   producer  acquire(st) -> copies (TMA with expect_tx, cp.async, or stores) -> arrival(s) on full
//   consumer  wait(st)    -> reads the stage                                 -> release(st) on empty
// and both advance their state by one. The first round's acquire passes at once (the empty
// barriers start in the phase before the one a release completes).
#pragma once

#include <cuda/ptx>

#include <cstdint>

#include "gemm/sm90/ptx.cuh"

namespace moeblaze {
inline namespace v0 {
namespace gemm {
namespace sm90 {

// The producer warpgroup's threads (the gathering cp.async copies come from all of them).
constexpr uint32_t kProducerThreads = 128;

// A position in a ring of S stages: its count of fills so far; the stage is count % S, and
// the barrier phase of that stage's current round is (count / S) & 1.
template <int S>
struct PipelineState {
  uint32_t count = 0;
  __device__ __forceinline__ uint32_t index() const { return count % S; }
  __device__ __forceinline__ uint32_t phase() const { return (count / S) & 1u; }
  __device__ __forceinline__ void advance(uint32_t n = 1) { count += n; }
};

// Who completes each phase of the ring's barriers.
struct PipelineArrivals {
  // full[s]: one elected producer thread's arrive_expect_tx (every operand by TMA), or that
  // plus each producer thread's cp.async arrival (gathered operands): gathered(true).
  uint32_t producer = 1;
  // empty[s]: the consumer warps that read each stage (8 when two warpgroups share a tile, 4
  // under ping-pong) ...
  uint32_t consumer_warps = 8;
  // ... each releasing per_warp arrivals: 1, lane 0 for its warp; 32, so that every thread can
  // release its own share (release_thread: compute-sanitizer's racecheck orders a thread's
  // reads before the producer's refill only through that thread's own arrival).
  uint32_t per_warp = 1;

  __host__ __device__ static constexpr uint32_t producer_count(bool gathered, uint32_t threads = kProducerThreads) {
    return gathered ? threads + 1 : 1;
  }
};

template <int S>
class StagePipeline {
 public:
  static constexpr int kStages = S;
  using State = PipelineState<S>;

  // barriers: 2 S mbarriers in shared memory (full, then empty). Thread 0 initialises them;
  // the caller makes them visible to the block (a block barrier) before any other use.
  __device__ __forceinline__ static StagePipeline init(uint64_t* barriers, const PipelineArrivals& a) {
    StagePipeline pipe;
    pipe.full_ = barriers;
    pipe.empty_ = barriers + S;
    pipe.per_warp_ = a.per_warp;
    if (threadIdx.x == 0) {
      for (int s = 0; s < S; ++s) {
        cuda::ptx::mbarrier_init(&pipe.full_[s], a.producer);
        cuda::ptx::mbarrier_init(&pipe.empty_[s], a.consumer_warps * a.per_warp);
      }
    }
    return pipe;
  }

  // Producer side.
  __device__ __forceinline__ void acquire(State st) const { mbar_wait(&empty_[st.index()], st.phase() ^ 1u); }
  // The full barrier that TMA copies into stage st complete their bytes on.
  __device__ __forceinline__ uint64_t* full_barrier(State st) const { return &full_[st.index()]; }
  // The elected thread's arrival, announcing the bytes TMA brings into the stage (0: none).
  __device__ __forceinline__ void arrive_expect_tx(State st, uint32_t bytes) const {
    using namespace cuda::ptx;
    if (bytes) mbarrier_arrive_expect_tx(sem_release, scope_cta, space_shared, &full_[st.index()], bytes);
    else mbarrier_arrive(&full_[st.index()]);
  }
  // A producer thread's arrival once its earlier cp.async copies have landed.
  __device__ __forceinline__ void arrive_cp_async(State st) const {
    cuda::ptx::cp_async_mbarrier_arrive_noinc(&full_[st.index()]);
  }
  // A producer thread's plain arrival (its stores, if any, made before it).
  __device__ __forceinline__ void arrive(State st) const { cuda::ptx::mbarrier_arrive(&full_[st.index()]); }

  // Consumer side.
  __device__ __forceinline__ void wait(State st) const { mbar_wait(&full_[st.index()], st.phase()); }
  // A consumer warp's release (every lane calls it; lane 0 arrives for the warp).
  __device__ __forceinline__ void release(State st) const {
    if ((threadIdx.x & 31) == 0) cuda::ptx::mbarrier_arrive(&empty_[st.index()], per_warp_);
  }
  // One thread's own share of its warp's release (a ring made with per_warp = 32).
  __device__ __forceinline__ void release_thread(State st) const { cuda::ptx::mbarrier_arrive(&empty_[st.index()]); }

 private:
  uint64_t* full_;
  uint64_t* empty_;
  uint32_t per_warp_;
};

// Ping-pong's order of MMAs between the two consumer warpgroups: warpgroup w's tiles are the
// CTA's tiles w, w + 2, ... (its round r is tile 2 r + w), and it starts a tile's MMAs once the
// other warpgroup's MMAs of the previous tile are done, so one's epilogue overlaps the other's MMAs.
struct MmaTurns {
  uint64_t* turn;  // [2]: turn[w] completes when warpgroup w may start its next tile's MMAs

  // barriers: 2 mbarriers in shared memory, initialised by thread 0 (visible after a block barrier).
  __device__ __forceinline__ static MmaTurns init(uint64_t* barriers) {
    if (threadIdx.x == 0) {
      cuda::ptx::mbarrier_init(&barriers[0], 1);
      cuda::ptx::mbarrier_init(&barriers[1], 1);
    }
    return MmaTurns{barriers};
  }
  // Before warpgroup `me`'s round `round`: waits for the other's previous tile (none before tile 0).
  __device__ __forceinline__ void wait(int me, uint32_t round) const {
    if (me == 0 && round == 0) return;
    mbar_wait(&turn[me], (me == 0 ? round - 1 : round) & 1u);
  }
  // After warpgroup `me`'s MMAs of a tile are done: the other's turn (one thread arrives).
  __device__ __forceinline__ void pass(int me) const {
    if (threadIdx.x % 128 == 0) cuda::ptx::mbarrier_arrive(&turn[me ^ 1]);
  }
};

}  // namespace sm90
}  // namespace gemm
}  // namespace v0
}  // namespace moeblaze
