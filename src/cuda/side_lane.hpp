// A second stream that a call may put work on beside its own kernels (an expert-parallel
// layer's local call: the returning dx rows sent beside the weight-gradient GEMMs), forked
// from and joined to the call's stream by the two events, which a CUDA graph capture records as
// edges. Host-side types only, so that engines without CUDA can carry it.
#pragma once

#include <cstdint>

namespace moeblaze {
inline namespace v0 {

// Work a caller hands to the lane, enqueued on the stream it is given.
class LaneWork {
 public:
  virtual void enqueue(void* stream) const = 0;

 protected:
  ~LaneWork() = default;
};

struct SideLane {
  void* stream = nullptr;  // cudaStream_t; null: no lane
  void* fork = nullptr;    // cudaEvent_t, recorded on the call's stream, waited for on the lane
  void* join = nullptr;    // cudaEvent_t, recorded on the lane, waited for on the call's stream
  int32_t ctas = 0;        // the CTAs work on the lane takes
  int32_t gemm_ctas = 0;   // the CTAs of persistent GEMMs beside it, so that the lane finds SMs
  // Enqueued exactly once per backward that computes dx, once dx is final: on the lane beside
  // the weight-gradient GEMMs where the engine can, else on the call's stream after them.
  const LaneWork* after_dx = nullptr;

  bool present() const { return stream != nullptr; }
};

}  // namespace v0
}  // namespace moeblaze
