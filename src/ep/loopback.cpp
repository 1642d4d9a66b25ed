// The in-process transport: the ranks post their send buffers, meet at a barrier, each copies
// its incoming blocks out of the senders' buffers, and they meet again before any sender may
// reuse its buffer.
#include <condition_variable>
#include <cstring>
#include <mutex>
#include <vector>

#include "ep/transport.hpp"
#include "util/error.hpp"

namespace moeblaze {
inline namespace v0 {
namespace ep {

struct LoopbackGroup::State {
  explicit State(int32_t p) : ranks(p), posted(p) {}
  struct Posted {
    const unsigned char* send = nullptr;
    const int64_t* off = nullptr;
    const int64_t* bytes = nullptr;
  };
  const int32_t ranks;
  std::vector<Posted> posted;
  std::mutex mu;
  std::condition_variable cv;
  int32_t arrived = 0;
  uint64_t generation = 0;

  void barrier() {
    std::unique_lock<std::mutex> lock(mu);
    const uint64_t gen = generation;
    if (++arrived == ranks) {
      arrived = 0;
      ++generation;
      cv.notify_all();
    } else {
      cv.wait(lock, [&] { return generation != gen; });
    }
  }
};

namespace {

class LoopbackTransport final : public Transport {
 public:
  LoopbackTransport(LoopbackGroup::State* s, int32_t r) : s_(s), rank_(r) {}
  int32_t rank() const override { return rank_; }
  int32_t ranks() const override { return s_->ranks; }
  void all_to_all(const void* send, const int64_t* send_off, const int64_t* send_bytes, void* recv,
                  const int64_t* recv_off, const int64_t* recv_bytes) override {
    s_->posted[rank_] = {static_cast<const unsigned char*>(send), send_off, send_bytes};
    s_->barrier();
    bool sizes_agree = true;
    for (int32_t src = 0; src < s_->ranks; ++src) {
      const LoopbackGroup::State::Posted& p = s_->posted[src];
      const int64_t n = p.bytes[rank_];
      if (n != recv_bytes[src]) {
        sizes_agree = false;
        continue;
      }
      if (n > 0) std::memcpy(static_cast<unsigned char*>(recv) + recv_off[src], p.send + p.off[rank_], n);
    }
    s_->barrier();
    if (!sizes_agree) fail(Status::kInternalError, "EP loopback: a rank sent another byte count than the receiver expects");
  }

 private:
  LoopbackGroup::State* s_;
  int32_t rank_;
};

}  // namespace

LoopbackGroup::LoopbackGroup(int32_t ranks) : state_(std::make_unique<State>(ranks)) {}
LoopbackGroup::~LoopbackGroup() = default;

std::unique_ptr<Transport> LoopbackGroup::transport(int32_t rank) {
  return std::make_unique<LoopbackTransport>(state_.get(), rank);
}

}  // namespace ep
}  // namespace v0
}  // namespace moeblaze
