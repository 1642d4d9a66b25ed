// What expert parallelism needs from a transport, on the host: one collective, an all-to-all of
// variable-size byte blocks among the group's ranks. The NCCL transports (docs/ep.md) and the
// in-process loopback below implement it; the EP data movement (ep/exchange.hpp) is written
// against this interface only.
#pragma once

#include <cstdint>
#include <memory>

namespace moeblaze {
inline namespace v0 {
namespace ep {

class Transport {
 public:
  virtual ~Transport() = default;
  virtual int32_t rank() const = 0;
  virtual int32_t ranks() const = 0;
  // Collective (every rank calls it, in the same order as every other collective): the block
  // [send + send_off[q], + send_bytes[q]) goes to rank q and the block from rank s lands at
  // recv + recv_off[s]; recv_bytes[s] must equal what s sends here (else a failure on this rank).
  // Returns once this rank's blocks have arrived and its send buffer may be reused.
  virtual void all_to_all(const void* send, const int64_t* send_off, const int64_t* send_bytes, void* recv,
                          const int64_t* recv_off, const int64_t* recv_bytes) = 0;
};

// P ranks as threads of one process (the reference in tests): ranks(r) is rank r's transport,
// to be used by one thread; the group outlives them.
class LoopbackGroup {
 public:
  explicit LoopbackGroup(int32_t ranks);
  ~LoopbackGroup();
  LoopbackGroup(const LoopbackGroup&) = delete;
  LoopbackGroup& operator=(const LoopbackGroup&) = delete;
  std::unique_ptr<Transport> transport(int32_t rank);

  struct State;

 private:
  std::unique_ptr<State> state_;
};

}  // namespace ep
}  // namespace v0
}  // namespace moeblaze
