#include "ep/exchange.hpp"

namespace moeblaze {
inline namespace v0 {
namespace ep {

namespace {

// Block offsets and sizes in bytes of rows grouped by rank: starts[r] .. starts[r + 1].
template <class Int>
void blocks(const std::vector<Int>& starts, int64_t row_bytes, std::vector<int64_t>& off, std::vector<int64_t>& bytes) {
  const size_t P = starts.size() - 1;
  off.resize(P);
  bytes.resize(P);
  for (size_t r = 0; r < P; ++r) {
    off[r] = static_cast<int64_t>(starts[r]) * row_bytes;
    bytes[r] = static_cast<int64_t>(starts[r + 1] - starts[r]) * row_bytes;
  }
}

}  // namespace

std::vector<int64_t> exchange_counts(Transport& t, const SendPlan& sp) {
  const int32_t P = t.ranks();
  std::vector<int32_t> send(P), recv(P);
  for (int32_t q = 0; q < P; ++q) send[q] = sp.sends_to(q);
  std::vector<int64_t> off(P), bytes(P, sizeof(int32_t));
  for (int32_t q = 0; q < P; ++q) off[q] = q * static_cast<int64_t>(sizeof(int32_t));
  t.all_to_all(send.data(), off.data(), bytes.data(), recv.data(), off.data(), bytes.data());
  return receive_offsets(recv);
}

void dispatch_rows(Transport& t, const SendPlan& sp, const std::vector<int64_t>& recv_off, const void* send_rows,
                   int64_t row_bytes, void* recv) {
  std::vector<int64_t> s_off, s_bytes, r_off, r_bytes;
  blocks(sp.dest_start, row_bytes, s_off, s_bytes);
  blocks(recv_off, row_bytes, r_off, r_bytes);
  t.all_to_all(send_rows, s_off.data(), s_bytes.data(), recv, r_off.data(), r_bytes.data());
}

void return_rows(Transport& t, const SendPlan& sp, const std::vector<int64_t>& recv_off, const void* recv_rows,
                 int64_t row_bytes, void* send_rows) {
  std::vector<int64_t> s_off, s_bytes, r_off, r_bytes;
  blocks(recv_off, row_bytes, s_off, s_bytes);
  blocks(sp.dest_start, row_bytes, r_off, r_bytes);
  t.all_to_all(recv_rows, s_off.data(), s_bytes.data(), send_rows, r_off.data(), r_bytes.data());
}

}  // namespace ep
}  // namespace v0
}  // namespace moeblaze
