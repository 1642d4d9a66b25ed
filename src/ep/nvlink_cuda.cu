#include "ep/nvlink_cuda.hpp"
#include "ep/owner.cuh"

#include <algorithm>

#include "cuda/cuda_check.hpp"
#include "cuda/row_arrival.cuh"
#include "util/align.hpp"

namespace moeblaze {
inline namespace v0 {
namespace ep {
namespace {

constexpr int kThreads = 512;
constexpr int kWarps = kThreads / 32;

__device__ char* peer_part(const Exchange& x, size_t offset, int peer) {
  return static_cast<char*>(ncclGetPeerPointer(x.window, offset, peer));
}

// The last s in [0, P) with start[s] <= i (start ascending, start[0] <= i): the rank of send i
// (start = dest_start) or the source of received row i (start = recv_offset).
__device__ int32_t last_at_or_below(const int32_t* start, int32_t P, int64_t i) {
  int32_t lo = 0, hi = P;
  while (hi - lo > 1) {
    const int32_t mid = (lo + hi) / 2;
    if (start[mid] <= i) lo = mid;
    else hi = mid;
  }
  return lo;
}

// Every rank walks its sends (by destination) and its received rows (by source) from rank + 1's
// on and ends with its own: the warps of a grid cover about one rank's rows at a time, and with
// every rank walking from rank 0's on, all of them stored into rank 0 first, then rank 1 (one
// destination's inbound links at a time). Item i0 of such a walk over [0, n) that starts at
// `first` (<= n), wrapping around.
__device__ __forceinline__ int64_t from_next_rank(int64_t i0, int64_t first, int64_t n) {
  return i0 + first < n ? i0 + first : i0 + first - n;
}

// One warp copies a row of `bytes` bytes: 16 bytes a lane where both ends allow it, each lane
// issuing kInFlight loads before its stores, so that a warp keeps 4 KiB of loads in flight
// instead of 512 bytes: one load at a time held a warp to a load latency per 512 bytes (about
// 9 GB/s per SM, perf/NOTES.md).
constexpr int kInFlight = 8;
__device__ void copy_row(char* dst, const char* src, int64_t bytes, int lane) {
  if ((reinterpret_cast<uintptr_t>(dst) | reinterpret_cast<uintptr_t>(src) | static_cast<uintptr_t>(bytes)) % 16 == 0) {
    const int64_t n = bytes / 16;
    const uint4* s = reinterpret_cast<const uint4*>(src);
    uint4* d = reinterpret_cast<uint4*>(dst);
    for (int64_t base = 0; base < n; base += 32 * kInFlight) {
      uint4 r[kInFlight];
#pragma unroll
      for (int u = 0; u < kInFlight; ++u) {
        const int64_t v = base + u * 32 + lane;
        if (v < n) r[u] = s[v];
      }
#pragma unroll
      for (int u = 0; u < kInFlight; ++u) {
        const int64_t v = base + u * 32 + lane;
        if (v < n) d[v] = r[u];
      }
    }
  } else {
    for (int64_t b = lane * 2; b < bytes; b += 64)  // rows of 2- and 4-byte elements: even lengths
      *reinterpret_cast<uint16_t*>(dst + b) = *reinterpret_cast<const uint16_t*>(src + b);
  }
}

// From the counts matrix in this rank's window part: matrix, the step's flag, and the send and
// receive offsets (thread 0 writes the scalars).
__device__ void derive_offsets(const Exchange& x, int64_t bound) {
  const int32_t P = x.layout.ranks, me = x.rank, W = P + 1;
  const int32_t* m = reinterpret_cast<const int32_t*>(x.local + x.layout.counts);
  for (int32_t i = threadIdx.x; i < P * W; i += blockDim.x) x.matrix[i] = m[i];
  if (threadIdx.x == 0) {
    int32_t flag = *x.flag;
    for (int32_t s = 0; s < P; ++s)
      if (s != me && m[s * W + P] != 0) flag |= kPeerFailed;
    for (int32_t q = 0; q < P; ++q) {
      int64_t into_q = 0;
      for (int32_t s = 0; s < P; ++s) into_q += m[s * W + q];
      if (into_q > bound) flag |= kRecvOverflow;
    }
    // Nothing moves after an overflow: every offset is 0 and no row is received.
    const bool none = (flag & kRecvOverflow) != 0;
    for (int32_t q = 0; q < P; ++q) {
      int32_t before = 0;
      for (int32_t s = 0; s < me; ++s) before += m[s * W + q];
      x.send_offset[q] = none ? 0 : before;
    }
    int32_t at = 0;
    for (int32_t s = 0; s <= P; ++s) {
      x.recv_offset[s] = none ? 0 : at;
      if (s < P) at += m[s * W + me];
    }
    *x.flag = flag;
  }
}

// This rank's row of the counts matrix: its rows per destination, then its flag.
__device__ int32_t counts_entry(const Exchange& x, const int32_t* dest_start, int32_t j) {
  return j < x.layout.ranks ? dest_start[j + 1] - dest_start[j] : *x.flag;
}

__global__ void __launch_bounds__(256) exchange_counts_kernel(Exchange x, const int32_t* dest_start, int64_t bound,
                                                              bool clear_ready) {
  const int32_t P = x.layout.ranks, me = x.rank, W = P + 1;
  ncclLsaBarrierSession<ncclCoopCta> bar{ncclCoopCta(), x.comm, ncclTeamLsa(x.comm), x.comm.lsaBarrier, 0};
  if (clear_ready) {  // the part is 256-byte aligned: 16-byte words, then the tail
    uint32_t* ready = reinterpret_cast<uint32_t*>(x.local + x.layout.ready);
    const int64_t R = x.layout.recv_rows, words = R / 4;
    for (int64_t i = threadIdx.x; i < words; i += blockDim.x) reinterpret_cast<uint4*>(ready)[i] = make_uint4(0, 0, 0, 0);
    for (int64_t i = words * 4 + threadIdx.x; i < R; i += blockDim.x) ready[i] = 0;
  }
  // Row `me` of every peer's matrix.
  for (int32_t i = threadIdx.x; i < P * W; i += blockDim.x) {
    const int32_t peer = i / W, j = i % W;
    reinterpret_cast<int32_t*>(peer_part(x, x.layout.counts, peer))[me * W + j] = counts_entry(x, dest_start, j);
  }
  __syncthreads();
  bar.sync(ncclCoopCta(), cuda::memory_order_acq_rel);
  derive_offsets(x, bound);
}

__global__ void __launch_bounds__(256) counts_row_kernel(Exchange x, const int32_t* dest_start) {
  int32_t* row = reinterpret_cast<int32_t*>(x.stage + x.stage_layout.counts);
  for (int32_t j = threadIdx.x; j <= x.layout.ranks; j += blockDim.x) row[j] = counts_entry(x, dest_start, j);
}

__global__ void __launch_bounds__(256) derive_offsets_kernel(Exchange x, int64_t bound) { derive_offsets(x, bound); }

// One warp per send's row, the sends spread over the grid: into the destination's window part
// at its receive row (NVLink), or, kStaged (HOST), into this rank's staging in send order, which
// ncclSend then moves (the same bytes at the same receive rows).
template <bool kStaged>
__global__ void __launch_bounds__(kThreads) dispatch_kernel(Exchange x, const char* rows, int64_t stride_bytes,
                                                            const int32_t* dest_start, const int32_t* send_token) {
  const WindowLayout& lay = kStaged ? x.stage_layout : x.layout;
  const int32_t P = lay.ranks, warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int64_t sends = rows && (*x.flag & kRecvOverflow) == 0 ? dest_start[P] : 0;
  const int64_t first = dest_start[(x.rank + 1) % P];
  for (int64_t i0 = blockIdx.x * static_cast<int64_t>(kWarps) + warp; i0 < sends; i0 += static_cast<int64_t>(gridDim.x) * kWarps) {
    const int64_t i = from_next_rank(i0, first, sends);
    const int32_t q = last_at_or_below(dest_start, P, i);  // the destination
    const int64_t r = kStaged ? i : x.send_offset[q] + (i - dest_start[q]);  // the row where it is written
    char* to = kStaged ? x.stage + lay.rows + r * lay.row_bytes : peer_part(x, lay.rows + r * lay.row_bytes, q);
    copy_row(to, rows + send_token[i] * stride_bytes, lay.row_bytes, lane);
  }
  if constexpr (!kStaged) {
    ncclLsaBarrierSession<ncclCoopCta> bar{ncclCoopCta(), x.comm, ncclTeamLsa(x.comm), x.comm.lsaBarrier, 1 + blockIdx.x};
    __syncthreads();
    bar.sync(ncclCoopCta(), cuda::memory_order_acq_rel);
  }
}

// Each send's metadata: its token and its place among the ranks the token reaches, the
// destination's local experts of the token in id order (-1 past them) and their gates. Each lane
// of a warp builds one send's entries in shared memory; then the warp stores each destination's
// run of sends, whose receive rows are consecutive, as consecutive words. A warp per send storing
// its entries in place took ~300 us for 44,638 sends at EP 4 (H200): a chain of dependent loads
// per send, and five small stores into the peers.
constexpr int kMetaThreads = 256;
constexpr int kMetaWarps = kMetaThreads / 32;
constexpr int kMetaWordsPerWarp = 32 * 34;  // 32 sends of up to 16 slots; at top_k = 64, 8 sends

template <bool kStaged>
__global__ void __launch_bounds__(kMetaThreads) metadata_kernel(Exchange x, const int32_t* dest_start,
                                                                const int32_t* send_token, const int32_t* ids,
                                                                const float* gates, int32_t k, int32_t epr,
                                                                int32_t first_barrier) {
  __shared__ int32_t words[kMetaWarps][kMetaWordsPerWarp];
  __shared__ int32_t start[65];
  const WindowLayout& lay = kStaged ? x.stage_layout : x.layout;
  const int32_t P = lay.ranks, S = lay.row_slots, warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  for (int32_t j = threadIdx.x; j <= P; j += blockDim.x) start[j] = dest_start[j];
  __syncthreads();
  const int64_t sends = (*x.flag & kRecvOverflow) == 0 ? start[P] : 0;
  const int32_t n = max(1, min(32, kMetaWordsPerWarp / (2 * S + 2)));  // sends per chunk
  int32_t* slot_id = words[warp];     // [n][S]
  int32_t* slot_gate = slot_id + n * S;  // [n][S], the gates' bits
  int32_t* meta = slot_gate + n * S;     // [n][2]
  for (int64_t c0 = (blockIdx.x * static_cast<int64_t>(kMetaWarps) + warp) * n; c0 < sends;
       c0 += static_cast<int64_t>(gridDim.x) * kMetaWarps * n) {
    const int32_t cn = static_cast<int32_t>(sends - c0 < n ? sends - c0 : n);
    int32_t q = -1;  // this lane's send's destination
    if (lane < cn) {
      q = last_at_or_below(start, P, c0 + lane);
      const int32_t t = send_token[c0 + lane];
      const int32_t* tid = ids + static_cast<int64_t>(t) * k;
      const float* tg = gates + static_cast<int64_t>(t) * k;
      int32_t* sid = slot_id + lane * S;
      int32_t* sg = slot_gate + lane * S;
      uint64_t ranks = 0;
      int32_t mine = 0;  // the token's experts on q
      for (int32_t j = 0; j < k; ++j) {
        const int32_t e = tid[j], o = owner_of(e, P, epr);
        if (o >= 0) ranks |= uint64_t{1} << o;
        if (o != q) continue;
        ++mine;
        int32_t place = 0;
        for (int32_t jj = 0; jj < k; ++jj) {
          const int32_t f = tid[jj];
          place += owner_of(f, P, epr) == q && f < e;
        }
        if (place < S) {  // always, unless a flagged saved plan repeats an id
          sid[place] = e - q * epr;
          sg[place] = __float_as_int(tg[j]);
        }
      }
      for (int32_t p = mine; p < S; ++p) {
        sid[p] = -1;
        sg[p] = __float_as_int(0.f);
      }
      meta[2 * lane] = t;
      meta[2 * lane + 1] = __popcll(ranks & ((uint64_t{1} << q) - 1));
    }
    __syncwarp();
    for (int32_t a = 0; a < cn;) {  // the chunk's runs of one destination
      const int32_t qa = __shfl_sync(0xffffffffu, q, a);
      const uint32_t past = __ballot_sync(0xffffffffu, lane > a && lane < cn && q != qa);
      const int32_t b = past ? __ffs(static_cast<int>(past)) - 1 : cn;
      const int64_t r = kStaged ? c0 + a : x.send_offset[qa] + (c0 + a - start[qa]);
      auto part = [&](size_t offset) {
        return reinterpret_cast<int32_t*>(kStaged ? x.stage + offset : peer_part(x, offset, qa));
      };
      int32_t* to_id = part(lay.ids + r * S * 4);
      int32_t* to_gate = part(lay.gates + r * S * 4);
      int32_t* to_meta = part(lay.meta + r * sizeof(int2));
      for (int32_t w = lane; w < (b - a) * S; w += 32) {
        to_id[w] = slot_id[a * S + w];
        to_gate[w] = slot_gate[a * S + w];
      }
      for (int32_t w = lane; w < (b - a) * 2; w += 32) to_meta[w] = meta[2 * a + w];
      a = b;
    }
    __syncwarp();
  }
  if constexpr (!kStaged) {
    ncclLsaBarrierSession<ncclCoopCta> bar{ncclCoopCta(), x.comm, ncclTeamLsa(x.comm), x.comm.lsaBarrier,
                                           first_barrier + blockIdx.x};
    __syncthreads();
    bar.sync(ncclCoopCta(), cuda::memory_order_acq_rel);
  }
}

// The rows alone, in turns of the destination's local experts: in turn e each warp sends, of
// its chunks of 32 consecutive sends, those whose lowest local expert is e (send_first, kept in
// [0, epr) so that every send has exactly one turn), and marks them arrived in batches, the
// last when the turn ends. Every warp is in about the same turn at a time, so a destination
// receives its experts' rows in about the order its GEMMs' tiles read them, from every source
// at once; where each row lands is the dispatch's fixed layout, never the timing.
__global__ void __launch_bounds__(kThreads) dispatch_rows_by_expert_kernel(Exchange x, const char* rows,
                                                                           int64_t stride_bytes,
                                                                           const int32_t* dest_start,
                                                                           const int32_t* send_token,
                                                                           const int32_t* send_first, int32_t epr) {
  const WindowLayout& lay = x.layout;
  const int32_t P = lay.ranks, lane = threadIdx.x % 32;
  const int64_t sends = (*x.flag & kRecvOverflow) == 0 ? dest_start[P] : 0;
  const int64_t warp = blockIdx.x * static_cast<int64_t>(kWarps) + threadIdx.x / 32;
  const int64_t warps = static_cast<int64_t>(gridDim.x) * kWarps;
  const int64_t chunks = (sends + 31) / 32, first = dest_start[(x.rank + 1) % P] / 32;
  for (int32_t e = 0; e < epr; ++e) {
    ArrivalMarks marks;  // this turn's rows are marked in batches, at the latest when the turn ends
    for (int64_t c0 = warp; c0 < chunks; c0 += warps) {
      const int64_t c = from_next_rank(c0, first, chunks);
      const int64_t mine = c * 32 + lane;
      const bool turn = mine < sends && min(max(send_first[mine], 0), epr - 1) == e;
      for (uint32_t m = __ballot_sync(0xffffffffu, turn); m; m &= m - 1) {
        const int64_t i = c * 32 + __ffs(static_cast<int>(m)) - 1;
        const int32_t q = last_at_or_below(dest_start, P, i);
        const int64_t r = x.send_offset[q] + (i - dest_start[q]);
        copy_row(peer_part(x, lay.rows + r * lay.row_bytes, q), rows + send_token[i] * stride_bytes, lay.row_bytes,
                 lane);
        marks.note(reinterpret_cast<uint32_t*>(peer_part(x, lay.ready + r * 4, q)), lane);
      }
    }
    marks.flush(lane);
  }
  ncclLsaBarrierSession<ncclCoopCta> bar{ncclCoopCta(), x.comm, ncclTeamLsa(x.comm), x.comm.lsaBarrier, blockIdx.x + 1};
  __syncthreads();
  bar.sync(ncclCoopCta(), cuda::memory_order_acq_rel);
}

// The return row of a received row's metadata (token, place among the token's ranks), or -1
// when either is out of range: written by this step's dispatch, checked all the same, so no
// byte can send a row astray.
__device__ int64_t return_row(const WindowLayout& lay, int2 m) {
  if (m.x < 0 || m.x >= lay.max_tokens || m.y < 0 || m.y >= lay.token_slots) return -1;
  return static_cast<int64_t>(m.x) * lay.token_slots + m.y;
}

__global__ void take_received_kernel(Exchange x, char* rows_out, bool mark_empty) {
  const WindowLayout& lay = x.layout;
  const int64_t n = x.recv_offset[lay.ranks];
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, warps = blockDim.x / 32;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(warps) + warp; i < lay.recv_rows;
       i += static_cast<int64_t>(gridDim.x) * warps) {
    int32_t* ids = reinterpret_cast<int32_t*>(x.local + lay.ids) + i * lay.row_slots;
    if (i >= n) {  // nothing arrived here this step: empty slots
      if (mark_empty)
        for (int32_t p = lane; p < lay.row_slots; p += 32) ids[p] = -1;
      continue;
    }
    if (rows_out) copy_row(rows_out + i * lay.row_bytes, x.local + lay.rows + i * lay.row_bytes, lay.row_bytes, lane);
  }
}

// kMeet: the peers are met at the end (an LSA barrier); without it the rows only go out, and a
// later return_rows_cuda's barrier covers them.
template <bool kMeet>
__global__ void __launch_bounds__(kThreads) return_kernel(Exchange x, const char* rows, const float* gates) {
  const WindowLayout& lay = x.layout;
  const int32_t P = lay.ranks, warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int64_t n = x.recv_offset[P];
  const int64_t first = x.recv_offset[(x.rank + 1) % P];
  for (int64_t i0 = blockIdx.x * static_cast<int64_t>(kWarps) + warp; i0 < n; i0 += static_cast<int64_t>(gridDim.x) * kWarps) {
    const int64_t i = from_next_rank(i0, first, n);
    const int32_t src = last_at_or_below(x.recv_offset, P, i);
    const int64_t r = return_row(lay, reinterpret_cast<const int2*>(x.local + lay.meta)[i]);
    if (r < 0) continue;
    if (rows) copy_row(peer_part(x, lay.ret_rows + r * lay.row_bytes, src), rows + i * lay.row_bytes, lay.row_bytes, lane);
    if (gates) {
      float* dst = reinterpret_cast<float*>(peer_part(x, lay.ret_gates + r * lay.row_slots * 4, src));
      for (int32_t p = lane; p < lay.row_slots; p += 32) dst[p] = gates[i * lay.row_slots + p];
    }
  }
  if constexpr (kMeet) {
    ncclLsaBarrierSession<ncclCoopCta> bar{ncclCoopCta(), x.comm, ncclTeamLsa(x.comm), x.comm.lsaBarrier,
                                           blockIdx.x + 1};
    __syncthreads();
    bar.sync(ncclCoopCta(), cuda::memory_order_acq_rel);
  }
}

__global__ void return_addresses_kernel(Exchange x, char** addr) {
  const WindowLayout& lay = x.layout;
  const int32_t P = lay.ranks;
  const int64_t n = x.recv_offset[P];
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < lay.recv_rows;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    char* dst = nullptr;
    if (i < n) {
      const int64_t r = return_row(lay, reinterpret_cast<const int2*>(x.local + lay.meta)[i]);
      if (r >= 0) dst = peer_part(x, lay.ret_rows + r * lay.row_bytes, last_at_or_below(x.recv_offset, P, i));
    }
    addr[i] = dst;
  }
}

// One warp per row: all-ones bytes, a NaN in every float format.
__global__ void poison_returns_kernel(Exchange x, char* const* addr, const int32_t* status) {
  if (*status == 0) return;
  const WindowLayout& lay = x.layout;
  const int lane = threadIdx.x % 32, warps = blockDim.x / 32;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(warps) + threadIdx.x / 32; i < lay.recv_rows;
       i += static_cast<int64_t>(gridDim.x) * warps) {
    char* row = addr[i];
    if (!row) continue;
    for (int64_t b = lane * 2; b < lay.row_bytes; b += 64) *reinterpret_cast<uint16_t*>(row + b) = 0xffff;
  }
}

// HOST: the rows (and gate gradients) that came back into the staging in send order go to the
// token's return rows at (token, place), which the staged dispatch recorded for each send.
__global__ void __launch_bounds__(kThreads) place_returned_kernel(Exchange x, const int32_t* dest_start, bool rows,
                                                                  bool gates) {
  const WindowLayout& lay = x.layout;
  const WindowLayout& st = x.stage_layout;
  const int32_t warp = threadIdx.x / 32, lane = threadIdx.x % 32, warps = blockDim.x / 32;
  const bool sent = (*x.flag & kRecvOverflow) == 0;
  const int64_t sends = sent ? dest_start[lay.ranks] : 0;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(warps) + warp; i < sends; i += static_cast<int64_t>(gridDim.x) * warps) {
    const int2 m = reinterpret_cast<const int2*>(x.stage + st.meta)[i];
    const int64_t r = return_row(lay, m);
    if (r < 0) continue;
    if (rows) copy_row(x.local + lay.ret_rows + r * lay.row_bytes, x.stage + st.rows + i * st.row_bytes, lay.row_bytes, lane);
    if (gates) {
      const float* src = reinterpret_cast<const float*>(x.stage + st.gates) + i * st.row_slots;
      float* dst = reinterpret_cast<float*>(x.local + lay.ret_gates) + r * lay.row_slots;
      for (int32_t p = lane; p < lay.row_slots; p += 32) dst[p] = src[p];
    }
  }
}

size_t part(size_t& at, size_t bytes) {
  const size_t here = at;
  at = align_up(at + bytes, size_t{256});
  return here;
}

}  // namespace

WindowLayout window_layout(int32_t P, int64_t R, int64_t Lmax, int64_t row_bytes, int32_t row_slots, int32_t token_slots) {
  WindowLayout l;
  l.ranks = P;
  l.row_slots = row_slots;
  l.token_slots = token_slots;
  l.recv_rows = R;
  l.max_tokens = Lmax;
  l.row_bytes = row_bytes;
  size_t at = 0;
  const size_t rs = static_cast<size_t>(row_slots);
  l.counts = part(at, static_cast<size_t>(P) * (P + 1) * 4);
  l.rows = part(at, static_cast<size_t>(R * row_bytes));
  l.meta = part(at, static_cast<size_t>(R) * sizeof(int2));
  l.ids = part(at, static_cast<size_t>(R) * rs * 4);
  l.gates = part(at, static_cast<size_t>(R) * rs * 4);
  l.ret_rows = part(at, static_cast<size_t>(Lmax * token_slots * row_bytes));
  l.ret_gates = part(at, static_cast<size_t>(Lmax * token_slots) * rs * 4);
  l.ready = part(at, static_cast<size_t>(R) * 4);
  l.bytes = align_up(at, size_t{4096});
  return l;
}

WindowLayout stage_layout(const WindowLayout& l) {
  return window_layout(l.ranks, l.max_tokens * l.token_slots, 0, l.row_bytes, l.row_slots, l.token_slots);
}

int32_t exchange_barriers(int32_t ctas) { return 2 * ctas + 1; }

void exchange_counts_cuda(const Exchange& x, const int32_t* dest_start, int64_t bound, cudaStream_t s,
                          bool clear_ready) {
  exchange_counts_kernel<<<1, 256, 0, s>>>(x, dest_start, bound, clear_ready);
  MOEBLAZE_CUDA_LAUNCH_CHECK("ep_exchange_counts");
}

void dispatch_rows_cuda(const Exchange& x, const char* rows, int64_t stride_bytes, const int32_t* dest_start,
                        const int32_t* send_token, const int32_t* ids, const float* gates, int32_t k, int32_t epr,
                        cudaStream_t s) {
  const unsigned ctas = static_cast<unsigned>(x.ctas);
  if (x.stage)
    dispatch_kernel<true><<<ctas, kThreads, 0, s>>>(x, rows, stride_bytes, dest_start, send_token);
  else
    dispatch_kernel<false><<<ctas, kThreads, 0, s>>>(x, rows, stride_bytes, dest_start, send_token);
  MOEBLAZE_CUDA_LAUNCH_CHECK("ep_dispatch");
  if (ids) dispatch_metadata_cuda(x, dest_start, send_token, ids, gates, k, epr, s);
}

void dispatch_metadata_cuda(const Exchange& x, const int32_t* dest_start, const int32_t* send_token, const int32_t* ids,
                            const float* gates, int32_t k, int32_t epr, cudaStream_t s) {
  // Barriers ctas + 1 .. 2 ctas: a row dispatch may hold 1 .. ctas at the same time.
  const unsigned ctas = static_cast<unsigned>(x.ctas);
  if (x.stage)
    metadata_kernel<true><<<ctas, kMetaThreads, 0, s>>>(x, dest_start, send_token, ids, gates, k, epr, x.ctas + 1);
  else
    metadata_kernel<false><<<ctas, kMetaThreads, 0, s>>>(x, dest_start, send_token, ids, gates, k, epr, x.ctas + 1);
  MOEBLAZE_CUDA_LAUNCH_CHECK("ep_dispatch_metadata");
}

void dispatch_rows_by_expert_cuda(const Exchange& x, const char* rows, int64_t stride_bytes, const int32_t* dest_start,
                                  const int32_t* send_token, const int32_t* send_first, int32_t epr, int32_t ctas,
                                  cudaStream_t s) {
  const unsigned grid = static_cast<unsigned>(std::clamp(ctas, 1, x.ctas));  // barriers 1 .. ctas
  dispatch_rows_by_expert_kernel<<<grid, kThreads, 0, s>>>(x, rows, stride_bytes, dest_start, send_token, send_first,
                                                           epr);
  MOEBLAZE_CUDA_LAUNCH_CHECK("ep_dispatch_rows_by_expert");
}

void counts_row_cuda(const Exchange& x, const int32_t* dest_start, cudaStream_t s) {
  counts_row_kernel<<<1, 256, 0, s>>>(x, dest_start);
  MOEBLAZE_CUDA_LAUNCH_CHECK("ep_counts_row");
}

void derive_offsets_cuda(const Exchange& x, int64_t recv_bound, cudaStream_t s) {
  derive_offsets_kernel<<<1, 256, 0, s>>>(x, recv_bound);
  MOEBLAZE_CUDA_LAUNCH_CHECK("ep_derive_offsets");
}

void place_returned_cuda(const Exchange& x, const int32_t* dest_start, bool rows, bool gates, cudaStream_t s) {
  place_returned_kernel<<<static_cast<unsigned>(x.ctas), kThreads, 0, s>>>(x, dest_start, rows, gates);
  MOEBLAZE_CUDA_LAUNCH_CHECK("ep_place_returned");
}

void preload_exchange_kernels() {
  cudaFuncAttributes a;
  MOEBLAZE_CUDA_CHECK(cudaFuncGetAttributes(&a, exchange_counts_kernel));
  MOEBLAZE_CUDA_CHECK(cudaFuncGetAttributes(&a, dispatch_kernel<false>));
  MOEBLAZE_CUDA_CHECK(cudaFuncGetAttributes(&a, metadata_kernel<false>));
  MOEBLAZE_CUDA_CHECK(cudaFuncGetAttributes(&a, dispatch_rows_by_expert_kernel));
  MOEBLAZE_CUDA_CHECK(cudaFuncGetAttributes(&a, take_received_kernel));
  MOEBLAZE_CUDA_CHECK(cudaFuncGetAttributes(&a, return_kernel<true>));
  MOEBLAZE_CUDA_CHECK(cudaFuncGetAttributes(&a, return_kernel<false>));
}

void return_addresses_cuda(const Exchange& x, char** addr, cudaStream_t s) {
  const int64_t blocks = std::clamp<int64_t>(ceil_div(x.layout.recv_rows, 256), 1, 1024);
  return_addresses_kernel<<<static_cast<unsigned>(blocks), 256, 0, s>>>(x, addr);
  MOEBLAZE_CUDA_LAUNCH_CHECK("ep_return_addresses");
}

void poison_returns_cuda(const Exchange& x, char* const* addr, const int32_t* status, cudaStream_t s) {
  const int64_t blocks = std::clamp<int64_t>(ceil_div(x.layout.recv_rows, 8), 1, 1024);
  poison_returns_kernel<<<static_cast<unsigned>(blocks), 256, 0, s>>>(x, addr, status);
  MOEBLAZE_CUDA_LAUNCH_CHECK("ep_poison_returns");
}

void take_received_cuda(const Exchange& x, char* rows_out, cudaStream_t s, bool mark_empty) {
  const int64_t blocks = std::clamp<int64_t>(ceil_div(x.layout.recv_rows, 8), 1, 1024);
  take_received_kernel<<<static_cast<unsigned>(blocks), 256, 0, s>>>(x, rows_out, mark_empty);
  MOEBLAZE_CUDA_LAUNCH_CHECK("ep_take_received");
}

void return_rows_cuda(const Exchange& x, const char* rows, const float* gates, cudaStream_t s) {
  return_kernel<true><<<static_cast<unsigned>(x.ctas), kThreads, 0, s>>>(x, rows, gates);
  MOEBLAZE_CUDA_LAUNCH_CHECK("ep_return");
}

void send_return_rows_cuda(const Exchange& x, const char* rows, int32_t ctas, cudaStream_t s) {
  return_kernel<false><<<static_cast<unsigned>(std::max(ctas, 1)), kThreads, 0, s>>>(x, rows, nullptr);
  MOEBLAZE_CUDA_LAUNCH_CHECK("ep_send_return_rows");
}

}  // namespace ep
}  // namespace v0
}  // namespace moeblaze
