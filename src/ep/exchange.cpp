#include "ep/exchange.hpp"

#include "util/error.hpp"

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

// Every rank's `row` of W values, gathered into [P][W] on every rank.
template <class T>
std::vector<T> all_gather(Transport& t, const std::vector<T>& row) {
  const int32_t P = t.ranks();
  const int64_t W = static_cast<int64_t>(row.size()), b = W * static_cast<int64_t>(sizeof(T));
  std::vector<int64_t> send_off(P, 0), recv_off(P), bytes(P, b);
  for (int32_t q = 0; q < P; ++q) recv_off[q] = q * b;
  std::vector<T> all(static_cast<size_t>(P * W));
  t.all_to_all(row.data(), send_off.data(), bytes.data(), all.data(), recv_off.data(), bytes.data());
  return all;
}

}  // namespace

Counts exchange_counts(Transport& t, const SendPlan& sp, int64_t bound, int32_t flag) {
  const int32_t P = t.ranks(), me = t.rank(), W = P + 1;
  std::vector<int32_t> row(static_cast<size_t>(W));
  for (int32_t q = 0; q < P; ++q) row[q] = sp.sends_to(q);
  row[P] = flag;
  const std::vector<int32_t> m = all_gather(t, row);
  Counts c;
  c.flag = flag;
  for (int32_t s = 0; s < P; ++s)
    if (s != me && m[s * W + P] != 0) c.flag |= kPeerFailed;
  for (int32_t q = 0; q < P && bound > 0; ++q) {
    int64_t into_q = 0;
    for (int32_t s = 0; s < P; ++s) into_q += m[s * W + q];
    if (into_q > bound) c.flag |= kRecvOverflow;
  }
  std::vector<int32_t> from(static_cast<size_t>(P), 0);
  if (!(c.flag & kRecvOverflow))
    for (int32_t s = 0; s < P; ++s) from[s] = m[s * W + me];
  c.recv_off = receive_offsets(from);
  return c;
}

void require_same_config(Transport& t, uint64_t digest) {
  const std::vector<uint64_t> all = all_gather(t, std::vector<uint64_t>{digest});
  for (int32_t r = 0; r < t.ranks(); ++r)
    if (all[r] != all[0])
      fail(Status::kInvalidArgument, "rank %d passed a configuration that differs from rank 0's (every rank of an "
                                     "expert-parallel layer must pass the same one)", r);
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
