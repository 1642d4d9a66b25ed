// The expert-parallel engine: a thin orchestrator over the shared GPU router (on the token's
// rank), the device send plan (ep/send_plan_cuda), the exchanges (ep/nvlink_cuda: NVLink
// through NCCL's device API, or HOST: the same kernels into a staging area and grouped
// ncclSend/ncclRecv, after the counts reach the host) and a
// single-GPU engine for the rank's E / P experts, which runs on the received rows as a layer of
// R = EP_MAX_RECV_TOKENS tokens whose slots may be empty (LayerConfig::empty_slots):
//   forward:  route + plan, send plan, counts, dispatch x (rows and their experts), take the
//             received rows, local forward, return the y parts, sum them in rank order;
//   backward: check the saved buffer, send plan again (from the saved, checked routing), counts,
//             dispatch dy (and the row metadata again, so nothing the caller hands back decides
//             where a row is written), local backward (weight gradients complete), return the
//             dx parts and gate gradients, router backward, sum the dx parts in rank order.
// All on the caller's stream, no allocation; on NVLink no host synchronisation (capturable),
// on HOST one per pass (the counts, which size the NCCL transfers).
#include "engines/ep/ep_engine.hpp"

#include <cuda_runtime.h>

#include <algorithm>
#include <array>
#include <cstring>
#include <memory>

#include "combine/combine_cuda.hpp"
#include "comm/ep_comm.hpp"
#include "core/memory_layout.hpp"
#include "core/needs.hpp"
#include "cuda/async_status.hpp"
#include "cuda/cuda_check.hpp"
#include "cuda/device_guard.hpp"
#include "cuda/saved_header_cuda.hpp"
#include "engines/cuda_router.hpp"
#include "ep/nvlink_cuda.hpp"
#include "ep/send_plan.hpp"
#include "ep/send_plan_cuda.hpp"
#include "gemm/cublaslt.hpp"
#include "gemm/sm90/heuristics.hpp"
#include "routing/plan_check_cuda.hpp"
#include "util/align.hpp"
#include "util/error.hpp"

namespace moeblaze {
inline namespace v0 {
namespace {

// CTAs that move rows. The exchanges do not overlap the expert GEMMs yet, so they may take half
// of an H100's SMs: 16-byte stores from 64 CTAs reached 236-249 GB/s per GPU to a peer, from 16
// CTAs 136-140 (perf/NOTES.md, the NVLink floor). A constant, not the device's SM count, so that
// every rank derives the same configuration.
constexpr int32_t kDefaultCtas = 64;
constexpr int32_t kLocalFailed = 32;      // the local experts' engine flagged its call
constexpr int32_t kRowsLate = 64;         // rows from a peer did not arrive in time (RowArrival)

int64_t recv_bound(const LayerConfig& g, int32_t P, int64_t max_recv) {
  return max_recv > 0 ? max_recv : static_cast<int64_t>(P) * g.max_tokens;
}

// The local experts' layer: E / P experts, min(k, E / P) slots per received row, R rows.
LayerConfig local_config(const LayerConfig& g, int32_t P, int64_t R) {
  LayerConfig l = g;
  l.num_experts = g.num_experts / P;
  l.top_k = std::min<int64_t>(g.top_k, l.num_experts);
  l.max_tokens = R;
  l.window_tokens = 0;  // the caller's tokens are not the local rows; a WINDOW_BYTES budget holds as given
  l.aux_loss_coeff = l.z_loss_coeff = 0.0;
  // Routing (groups, scale) is the EP router's, on the global configuration; the local
  // experts take the gates it made.
  l.num_expert_groups = 1;
  l.topk_groups = 0;
  l.route_scale = 1.0;
  l.empty_slots = true;
  l.ep_ranks = 1;
  return l;
}

ep::WindowLayout layout_of(const LayerConfig& g, int32_t P, int64_t R) {
  const int32_t k_loc = static_cast<int32_t>(std::min<int64_t>(g.top_k, g.num_experts / P));
  const int32_t c = static_cast<int32_t>(std::min<int64_t>(g.top_k, P));
  return ep::window_layout(P, R, g.max_tokens, g.hidden * static_cast<int64_t>(dtype_size(g.act_dtype)), k_loc, c);
}

void check_placement(int64_t ranks, int64_t E) {
  if (const char* why = ep::placement_error(ranks, E))
    fail(Status::kInvalidArgument, "%s (NUM_EXPERTS = %lld, %lld ranks)", why, static_cast<long long>(E),
         static_cast<long long>(ranks));
}

View dense(void* p, DType t, int64_t rows, int64_t cols) {
  View v;
  v.present = true;
  v.data = static_cast<char*>(p);
  v.dtype = t;
  v.ndim = cols > 0 ? 2 : 0;
  v.shape[0] = rows;
  v.shape[1] = cols;
  v.stride[0] = cols;
  v.stride[1] = 1;
  v.span_bytes = static_cast<size_t>(std::max<int64_t>(rows * std::max<int64_t>(cols, 1), 1)) * dtype_size(t);
  return v;
}

struct EpSaved {
  SavedHeader* header = nullptr;
  RoutingPlan plan;          // the rank's own tokens over all E experts
  char* recv_x = nullptr;    // [R, d] the received x rows
  void* local = nullptr;     // the local engine's saved buffer
  size_t bytes = 0;
};

struct EpWork {
  RouterWork router;
  ep::DeviceSendPlan send;
  void* send_scratch = nullptr;
  int32_t* matrix = nullptr;
  int32_t* send_offset = nullptr;
  int32_t* recv_offset = nullptr;
  int32_t* local_status = nullptr;
  void* rows = nullptr;          // [R, d] y parts (forward) or dx parts (backward)
  char** ret_addr = nullptr;     // [R] where the local combine stores each row's result (NVLink, fused local engine)
  float* dg_recv = nullptr;      // backward: [R, k_loc]
  float* dg_tok = nullptr;       // backward: [L, k]
  EpSaved inference;             // forward inference: what training keeps in saved
  void* local_ws = nullptr;
  size_t bytes = 0;
};

// The second stream the rows are sent on beside the local GEMMs, and the events that fork it from
// and join it to the caller's stream. A member, so that what was made is released also when the
// engine's constructor fails part way.
struct SideStream {
  cudaStream_t stream = nullptr;
  cudaEvent_t fork = nullptr, join = nullptr;
  SideStream() = default;
  SideStream(const SideStream&) = delete;
  SideStream& operator=(const SideStream&) = delete;
  ~SideStream() {
    if (fork) cudaEventDestroy(fork);
    if (join) cudaEventDestroy(join);
    if (stream) cudaStreamDestroy(stream);
  }
  // The highest priority, so that the senders' CTAs are placed before the GEMMs' when both wait.
  void create() {
    int least = 0, greatest = 0;
    MOEBLAZE_CUDA_CHECK(cudaDeviceGetStreamPriorityRange(&least, &greatest));
    MOEBLAZE_CUDA_CHECK(cudaStreamCreateWithPriority(&stream, cudaStreamNonBlocking, greatest));
    MOEBLAZE_CUDA_CHECK(cudaEventCreateWithFlags(&fork, cudaEventDisableTiming));
    MOEBLAZE_CUDA_CHECK(cudaEventCreateWithFlags(&join, cudaEventDisableTiming));
  }
};

// What the HOST transport knows on the host after a step's count exchange: the rows this rank
// sends to and receives from each rank, at which offsets (in rows), or nothing after an overflow.
struct HostCounts {
  std::array<int64_t, 65> send_start{}, recv_start{};  // [P + 1] prefix sums
};

class EpEngine final : public Engine {
 public:
  EpEngine(const LayerConfig& g, const LayerConfig& l, std::unique_ptr<Engine> local,
           std::unique_ptr<comm::EpComm> comm, int64_t R, int32_t ctas, int32_t row_ctas)
      : g_(g), l_(l), local_(std::move(local)), comm_(std::move(comm)), R_(R), ctas_(ctas), row_ctas_(row_ctas) {
    P_ = comm_->ranks();
    epr_ = static_cast<int32_t>(g_.num_experts / P_);
    c_ = static_cast<int32_t>(std::min<int64_t>(g_.top_k, P_));
    layout_ = layout_of(g_, P_, R_);
    stage_layout_ = ep::stage_layout(layout_);
    cuda::DeviceGuard guard(g_.device_id);
    gemm_ = std::make_unique<gemm::CublasLtGemm>();
    router_ = std::make_unique<CudaRouter>(g_, *gemm_);
    if (host()) MOEBLAZE_CUDA_CHECK(cudaMallocHost(&host_matrix_, sizeof(int32_t) * (P_ * (P_ + 1) + 1)));
    // Rows sent beside the local GEMMs: on a second stream forked from and joined to the
    // caller's by events, which a CUDA graph capture records as edges.
    int dev = 0;
    MOEBLAZE_CUDA_CHECK(cudaGetDevice(&dev));
    MOEBLAZE_CUDA_CHECK(cudaDeviceGetAttribute(&sms_, cudaDevAttrMultiProcessorCount, dev));
    overlap_ = !host() && local_->kind() == EngineKind::kCudaFused &&
               gemm::sm90::ep_overlap(P_, g_.num_experts, g_.top_k, g_.gate_up_cols(),
                                      static_cast<int64_t>(dtype_size(g_.act_dtype)), row_ctas_, sms_);
    returns_from_combine_ =
        !host() && local_->kind() == EngineKind::kCudaFused && gemm::sm90::ep_returns_from_combine();
    lane_ = !host() && local_->kind() == EngineKind::kCudaFused;
    if (overlap_) ep::preload_exchange_kernels();  // loaded now, not at a launch that would wait for a waiting GEMM
    if (lane_) side_.create();
  }
  ~EpEngine() override {
    if (host_matrix_) cudaFreeHost(host_matrix_);
  }
  EngineKind kind() const override { return local_->kind(); }
  size_t workspace_size(Pass pass, int64_t L) const override { return carve_work(pass, L, nullptr).bytes; }
  size_t saved_size(const LayerConfig&, int64_t L) const override { return carve_ep_saved(L, nullptr).bytes; }
  void forward(Pass pass, const CallArgs& a, void* ws, void* saved, void* stream) const override;
  void backward(const CallArgs& a, void* saved, bool last_use, void* ws, void* stream) const override;
  void route(const CallArgs& a, void* ws, void* stream) const override;
  void refuse_capture_if_local_syncs(cudaStream_t s, const char* what) const;

 private:
  // The saved regions (saved_buffer), or, for inference, the plan in the workspace (the local
  // experts read the received rows in the window); a route needs the plan alone.
  EpSaved carve_ep_saved_into(Carver& c, int64_t L, void* base, bool saved_buffer, bool plan_only = false) const {
    EpSaved sv;
    const size_t start = c.size();
    if (saved_buffer) sv.header = c.take<SavedHeader>(1);
    const SavedRegions r = carve_saved(g_, L, base ? static_cast<char*>(base) + c.size() : nullptr, false);
    c.take<char>(r.bytes);
    sv.plan = r.plan;
    if (plan_only) {
      sv.bytes = c.size() - start;
      return sv;
    }
    // Inference reads the received rows in the window, where nothing overwrites them before
    // the next step's count exchange; training keeps a copy for backward.
    if (saved_buffer) {
      sv.recv_x = c.take<char>(static_cast<size_t>(R_ * layout_.row_bytes));
      sv.local = c.take<char>(local_->saved_size(l_, R_));
    }
    sv.bytes = c.size() - start;
    return sv;
  }
  EpSaved carve_ep_saved(int64_t L, void* base) const {
    Carver c(base);
    return carve_ep_saved_into(c, L, base, true);
  }
  EpWork carve_work(Pass pass, int64_t L, void* base) const;
  bool host() const { return comm_->transport() == comm::EpTransport::kHost; }
  ep::Exchange exchange(const EpWork& w) const {
    ep::Exchange x;
    x.comm = comm_->device_comm();
    x.window = comm_->window();
    x.rank = comm_->rank();
    x.local = comm_->local();
    x.layout = layout_;
    if (host()) {
      x.stage = comm_->local() + layout_.bytes;
      x.stage_layout = stage_layout_;
    }
    x.ctas = ctas_;
    x.flag = w.router.error_flag;
    x.matrix = w.matrix;
    x.send_offset = w.send_offset;
    x.recv_offset = w.recv_offset;
    return x;
  }
  // The local experts' call on the received rows.
  CallArgs local_args(const CallArgs& a, const EpWork& w, const char* recv_x) const {
    CallArgs la;
    la.num_tokens = R_;
    la.mode = RoutingMode::kCallerTopK;
    la.x = dense(const_cast<char*>(recv_x), g_.act_dtype, R_, g_.hidden);
    la.topk_ids = dense(comm_->local() + layout_.ids, DType::kI32, R_, l_.top_k);
    la.topk_weights = dense(comm_->local() + layout_.gates, DType::kF32, R_, l_.top_k);
    la.w_gate_up = a.w_gate_up;
    la.w_down = a.w_down;
    la.status = dense(w.local_status, DType::kI32, 0, 0);
    return la;
  }

  // The rows this rank receives, as the local call's GEMMs wait for them.
  RowArrival arrival(const EpWork& w) const {
    RowArrival r;
    r.ready = reinterpret_cast<const uint32_t*>(comm_->local() + layout_.ready);
    r.flag = w.router.error_flag;
    r.late_bit = kRowsLate;
    r.max_ctas = std::max(1, sms_ - row_ctas_);
    return r;
  }
  // Starts the rows' dispatch on the second stream, after everything enqueued on s so far (the
  // counts exchange and the metadata): `rows` ([L, d], row stride in bytes) go out by expert
  // turns, and in a training forward the received rows are then copied into the saved buffer.
  void send_rows_beside(const ep::Exchange& x, const EpWork& w, const View& rows, char* keep, cudaStream_t s) const {
    MOEBLAZE_CUDA_CHECK(cudaEventRecord(side_.fork, s));
    MOEBLAZE_CUDA_CHECK(cudaStreamWaitEvent(side_.stream, side_.fork, 0));
    ep::dispatch_rows_by_expert_cuda(x, rows.data, rows.stride[0] * static_cast<int64_t>(rows.elem()),
                                     w.send.dest_start, w.send.send_token, w.send.send_first, epr_, row_ctas_,
                                     side_.stream);
    if (keep) ep::take_received_cuda(x, keep, side_.stream, /*mark_empty=*/false);
    MOEBLAZE_CUDA_CHECK(cudaEventRecord(side_.join, side_.stream));
  }
  void join_rows(cudaStream_t s) const { MOEBLAZE_CUDA_CHECK(cudaStreamWaitEvent(s, side_.join, 0)); }
  // The local backward's dx rows go back on the second stream, from few CTAs, while its
  // weight-gradient GEMMs run on the other SMs; the gate gradients' return meets the peers after.
  struct SendDxRows final : LaneWork {
    ep::Exchange x;
    const char* rows = nullptr;
    int32_t ctas = 0;
    void enqueue(void* stream) const override {
      ep::send_return_rows_cuda(x, rows, ctas, static_cast<cudaStream_t>(stream));
    }
  };
  SideLane lane(const SendDxRows& work) const {
    SideLane l;
    l.stream = side_.stream;
    l.fork = side_.fork;
    l.join = side_.join;
    l.ctas = work.ctas;
    l.gemm_ctas = std::max(1, sms_ - work.ctas);
    l.after_dx = &work;
    return l;
  }
  // A large EP_COMM_SMS still leaves the GEMMs most SMs.
  int32_t lane_ctas() const { return std::min(row_ctas_, std::max(1, sms_ / 4)); }

  // The local combine's rows straight to the ranks they return to: their addresses, from the
  // received rows' metadata (in the window once the dispatch's metadata barrier has passed).
  void return_from_combine(const ep::Exchange& x, const EpWork& w, CallArgs& la, cudaStream_t s) const {
    ep::return_addresses_cuda(x, w.ret_addr, s);
    la.out_rows = w.ret_addr;
    // From the next rank's rows on (the received rows are by source rank): with every rank
    // storing in source order, all of them stored into rank 0 first, then rank 1, ..., and the
    // last ranks' combines took 1.7x the first's.
    la.out_rows_first = w.recv_offset + (comm_->rank() + 1) % P_;
  }
  // After the local call: NaN rows where it failed, then the return's barrier alone.
  void finish_return_from_combine(const ep::Exchange& x, const EpWork& w, cudaStream_t s) const {
    ep::poison_returns_cuda(x, w.ret_addr, w.local_status, s);
    ep::return_rows_cuda(x, nullptr, nullptr, s);
  }

  // The step's three exchanges on either transport (ep/nvlink_cuda.hpp says what each moves).
  HostCounts exchange_counts(const ep::Exchange& x, const EpWork& w, cudaStream_t s) const;
  void dispatch(const ep::Exchange& x, const EpWork& w, const HostCounts& hc, const View& rows, const RoutingPlan& plan,
                cudaStream_t s) const;
  void give_back(const ep::Exchange& x, const EpWork& w, const HostCounts& hc, const char* rows, const float* gates,
                 cudaStream_t s) const;

  LayerConfig g_, l_;
  std::unique_ptr<Engine> local_;
  std::unique_ptr<comm::EpComm> comm_;
  int64_t R_;
  int32_t ctas_, row_ctas_, P_ = 1, epr_ = 1, c_ = 1;
  bool overlap_ = false;  // rows sent beside the local GEMMs
  bool returns_from_combine_ = false;  // the forward's local combine stores the returning rows into the peers
  bool lane_ = false;  // a second stream (side_): the rows beside the GEMMs, the dx rows beside the weight gradients
  int sms_ = 0;
  SideStream side_;
  ep::WindowLayout layout_, stage_layout_;
  int32_t* host_matrix_ = nullptr;  // HOST: pinned [P (P + 1)] counts matrix, then the step's flag
  std::unique_ptr<gemm::CublasLtGemm> gemm_;
  std::unique_ptr<CudaRouter> router_;
};

EpWork EpEngine::carve_work(Pass pass, int64_t L, void* base) const {
  Carver c(base);
  EpWork w;
  void* gemm_ws = c.take<char>(gemm::CublasLtGemm::kWorkspaceBytes);
  w.router = router_->carve(c, pass, L, L, gemm_ws);
  if (pass == Pass::kRoute || pass == Pass::kForwardInference)
    w.inference = carve_ep_saved_into(c, L, base, false, pass == Pass::kRoute);
  if (pass == Pass::kRoute) {
    w.bytes = c.size();
    return w;
  }
  const size_t Lc = static_cast<size_t>(std::max<int64_t>(L * c_, 1));
  w.send.dest_start = c.take<int32_t>(static_cast<size_t>(P_ + 1));
  w.send.send_token = c.take<int32_t>(Lc);
  w.send.return_map = c.take<int32_t>(Lc);
  if (overlap_) w.send.send_first = c.take<int32_t>(Lc);
  w.send_scratch = c.take<char>(ep::send_plan_scratch_bytes_cuda(L, P_));
  w.matrix = c.take<int32_t>(static_cast<size_t>(P_ * (P_ + 1)));
  w.send_offset = c.take<int32_t>(static_cast<size_t>(P_));
  w.recv_offset = c.take<int32_t>(static_cast<size_t>(P_ + 1));
  w.local_status = c.take<int32_t>(1);
  w.rows = c.take<char>(static_cast<size_t>(R_ * layout_.row_bytes));
  if (lane_) w.ret_addr = c.take<char*>(static_cast<size_t>(R_));  // the forward's combine, the backward's poison
  if (pass == Pass::kBackward) {
    w.dg_recv = c.take<float>(static_cast<size_t>(R_ * l_.top_k));
    w.dg_tok = c.take<float>(static_cast<size_t>(std::max<int64_t>(L * g_.top_k, 1)));
  }
  w.local_ws = c.take<char>(local_->workspace_size(pass, R_));
  w.bytes = c.size();
  return w;
}

HostCounts EpEngine::exchange_counts(const ep::Exchange& x, const EpWork& w, cudaStream_t s) const {
  HostCounts hc;
  if (!host()) {
    ep::exchange_counts_cuda(x, w.send.dest_start, R_, s, overlap_);
    return hc;
  }
  const int32_t W = P_ + 1, me = comm_->rank();
  ep::counts_row_cuda(x, w.send.dest_start, s);
  comm_->all_gather_bytes(x.stage + stage_layout_.counts, x.local + layout_.counts, sizeof(int32_t) * W, s);
  ep::derive_offsets_cuda(x, R_, s);
  // The matrix, then the step's flag after derive_offsets: the transfers' sizes, or none after
  // an overflow (derive_offsets' decision, the same on every rank).
  int32_t* host_flag = host_matrix_ + P_ * W;
  MOEBLAZE_CUDA_CHECK(cudaMemcpyAsync(host_matrix_, w.matrix, sizeof(int32_t) * P_ * W, cudaMemcpyDeviceToHost, s));
  MOEBLAZE_CUDA_CHECK(cudaMemcpyAsync(host_flag, x.flag, sizeof(int32_t), cudaMemcpyDeviceToHost, s));
  MOEBLAZE_CUDA_CHECK(cudaStreamSynchronize(s));
  const bool overflow = (*host_flag & ep::kRecvOverflow) != 0;
  for (int32_t q = 0; q < P_; ++q) {
    hc.send_start[q + 1] = hc.send_start[q] + (overflow ? 0 : std::max(host_matrix_[me * W + q], 0));
    hc.recv_start[q + 1] = hc.recv_start[q] + (overflow ? 0 : std::max(host_matrix_[q * W + me], 0));
  }
  return hc;
}

// HOST: blocks of `unit` bytes per row, [start[q], start[q + 1]) of `base` for each rank q.
static int add_blocks(comm::EpComm::Block* out, int n, char* base, const std::array<int64_t, 65>& start, int32_t P,
                      size_t unit) {
  for (int32_t q = 0; q < P; ++q)
    out[n++] = {base + start[q] * unit, static_cast<size_t>(start[q + 1] - start[q]) * unit, q};
  return n;
}

void EpEngine::dispatch(const ep::Exchange& x, const EpWork& w, const HostCounts& hc, const View& rows,
                        const RoutingPlan& plan, cudaStream_t s) const {
  ep::dispatch_rows_cuda(x, rows.data, rows.stride[0] * static_cast<int64_t>(rows.elem()), w.send.dest_start,
                         w.send.send_token, plan.token_expert_indices, plan.gates, static_cast<int32_t>(g_.top_k), epr_,
                         s);
  if (!host()) return;
  // The staged rows and their experts and gates, each rank's block at its receive rows.
  std::array<comm::EpComm::Block, 3 * 64> sends, recvs;
  const size_t slots = static_cast<size_t>(layout_.row_slots) * 4, rb = static_cast<size_t>(layout_.row_bytes);
  int ns = 0, nr = 0;
  for (const auto& [stage_part, recv_part, unit] : {std::tuple{stage_layout_.rows, layout_.rows, rb},
                                                     std::tuple{stage_layout_.ids, layout_.ids, slots},
                                                     std::tuple{stage_layout_.gates, layout_.gates, slots}}) {
    ns = add_blocks(sends.data(), ns, x.stage + stage_part, hc.send_start, P_, unit);
    nr = add_blocks(recvs.data(), nr, x.local + recv_part, hc.recv_start, P_, unit);
  }
  comm_->send_recv(sends.data(), ns, recvs.data(), nr, s);
}

void EpEngine::give_back(const ep::Exchange& x, const EpWork& w, const HostCounts& hc, const char* rows,
                         const float* gates, cudaStream_t s) const {
  if (!host()) {
    ep::return_rows_cuda(x, rows, gates, s);
    return;
  }
  // Each received block back to its source, which takes it into its staging in send order.
  std::array<comm::EpComm::Block, 2 * 64> sends, recvs;
  int ns = 0, nr = 0;
  if (rows) {
    ns = add_blocks(sends.data(), ns, const_cast<char*>(rows), hc.recv_start, P_, static_cast<size_t>(layout_.row_bytes));
    nr = add_blocks(recvs.data(), nr, x.stage + stage_layout_.rows, hc.send_start, P_,
                    static_cast<size_t>(layout_.row_bytes));
  }
  if (gates) {
    const size_t slots = static_cast<size_t>(layout_.row_slots) * 4;
    ns = add_blocks(sends.data(), ns, reinterpret_cast<char*>(const_cast<float*>(gates)), hc.recv_start, P_, slots);
    nr = add_blocks(recvs.data(), nr, x.stage + stage_layout_.gates, hc.send_start, P_, slots);
  }
  comm_->send_recv(sends.data(), ns, recvs.data(), nr, s);
  ep::place_returned_cuda(x, w.send.dest_start, rows != nullptr, gates != nullptr, s);
}

void EpEngine::route(const CallArgs& a, void* ws, void* stream) const {
  cuda::DeviceGuard guard(g_.device_id);
  cudaStream_t s = static_cast<cudaStream_t>(stream);
  EpWork w = carve_work(Pass::kRoute, a.num_tokens, ws);
  router_->route_and_plan(a, w.inference.plan, w.router, s);
  router_->write_outputs(a, w.inference.plan, w.router, s);
  cuda::write_status(w.router.error_flag, a.status, s);
}

// The HOST transport reads the counts on the host, and the cuBLASLt local engine its expert
// offsets, which a capture forbids: refuse before the route and the exchanges are enqueued, so
// the caller's capture stays intact.
void EpEngine::refuse_capture_if_local_syncs(cudaStream_t s, const char* what) const {
  const bool lt = local_->kind() == EngineKind::kCudaCublasLt;
  if (!lt && !host()) return;
  cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
  MOEBLAZE_CUDA_CHECK(cudaStreamIsCapturing(s, &capture));
  if (capture == cudaStreamCaptureStatusNone) return;
  if (host())
    fail(Status::kNotSupported,
         "the expert-parallel %s on the HOST transport synchronises the stream (the row counts to the host, which "
         "size the ncclSend/ncclRecv transfers) and cannot be captured in a CUDA graph; nothing was enqueued and the "
         "capture is intact (the NVLink transport is capturable)", what);
  fail(Status::kNotSupported,
       "the expert-parallel %s on the cuBLASLt local engine synchronises the stream (expert offsets to the host) "
       "and cannot be captured in a CUDA graph; nothing was enqueued and the capture is intact (the fused engine "
       "is capturable)", what);
}

void EpEngine::forward(Pass pass, const CallArgs& a, void* ws, void* saved, void* stream) const {
  cuda::DeviceGuard guard(g_.device_id);
  cudaStream_t s = static_cast<cudaStream_t>(stream);
  refuse_capture_if_local_syncs(s, "forward");
  const int64_t L = a.num_tokens;
  const int32_t k = static_cast<int32_t>(g_.top_k);
  EpWork w = carve_work(pass, L, ws);
  EpSaved sv = pass == Pass::kForwardTraining ? carve_ep_saved(L, saved) : w.inference;
  const ep::Exchange x = exchange(w);
  int32_t* flag = w.router.error_flag;

  if (sv.header) MOEBLAZE_CUDA_CHECK(cudaMemsetAsync(sv.header, 0, sizeof(SavedHeader), s));
  router_->route_and_plan(a, sv.plan, w.router, s);
  router_->write_outputs(a, sv.plan, w.router, s);
  ep::build_send_plan_cuda(sv.plan.token_expert_indices, L, k, P_, epr_, w.send, w.send_scratch, s);
  const HostCounts hc = exchange_counts(x, w, s);
  CallArgs la;
  if (overlap_) {  // the local GEMMs read the rows in the window as they arrive
    // The metadata first: the local plan, and so the up GEMM, waits for it; the rows need not.
    ep::dispatch_metadata_cuda(x, w.send.dest_start, w.send.send_token, sv.plan.token_expert_indices, sv.plan.gates,
                               k, epr_, s);
    send_rows_beside(x, w, a.x, sv.recv_x, s);
    ep::take_received_cuda(x, nullptr, s);
    la = local_args(a, w, comm_->local() + layout_.rows);
    la.arrival = arrival(w);
  } else {
    dispatch(x, w, hc, a.x, sv.plan, s);
    ep::take_received_cuda(x, sv.recv_x, s);
    la = local_args(a, w, sv.recv_x ? sv.recv_x : comm_->local() + layout_.rows);
  }
  la.y = dense(w.rows, g_.act_dtype, R_, g_.hidden);
  if (returns_from_combine_) return_from_combine(x, w, la, s);
  local_->forward(pass, la, w.local_ws, sv.local, s);
  if (overlap_) join_rows(s);
  cuda::flag_if_status(w.local_status, flag, kLocalFailed, s);
  if (returns_from_combine_) finish_return_from_combine(x, w, s);
  else give_back(x, w, hc, static_cast<const char*>(w.rows), nullptr, s);
  combine::combine_rows_cuda(w.send.return_map, nullptr, L, c_, g_.hidden, comm_->local() + layout_.ret_rows, {},
                             a.y, s);
  cuda::CallEnd end;
  end.outputs[0] = &a.y;
  end.status = a.status;
  end.insufficient_bits = ep::kRecvOverflow;
  end.internal_bits = kRowsLate;
  end.header_dst = sv.header;
  end.header = make_saved_header(g_, L);
  cuda::end_call(flag, end, s);
}

void EpEngine::backward(const CallArgs& a, void* saved, bool last_use, void* ws, void* stream) const {
  cuda::DeviceGuard guard(g_.device_id);
  cudaStream_t s = static_cast<cudaStream_t>(stream);
  refuse_capture_if_local_syncs(s, "backward");
  const int64_t L = a.num_tokens;
  const int32_t k = static_cast<int32_t>(g_.top_k);
  EpWork w = carve_work(Pass::kBackward, L, ws);
  const EpSaved sv = carve_ep_saved(L, saved);
  const ep::Exchange x = exchange(w);
  int32_t* flag = w.router.error_flag;
  const Needs needs = needs_of(g_, Pass::kBackward, a);

  MOEBLAZE_CUDA_CHECK(cudaMemsetAsync(flag, 0, sizeof(int32_t), s));
  cuda::check_saved_header_cuda(make_saved_header(g_, L), sv.header, flag, routing::kSavedHeaderInvalid, s);
  // Empty slots: a TOKEN_MASK's masked tokens (they reach no rank and get zero rows).
  routing::validate_plan_cuda(sv.plan, L, k, g_.num_experts, true, flag, s);
  // Where the rows go is derived again from the checked routing, not read from the saved bytes.
  ep::build_send_plan_cuda(sv.plan.token_expert_indices, L, k, P_, epr_, w.send, w.send_scratch, s);
  const HostCounts hc = exchange_counts(x, w, s);
  if (overlap_) {  // the dact GEMM reads dy's rows in the window as they arrive (the metadata first, as in forward)
    ep::dispatch_metadata_cuda(x, w.send.dest_start, w.send.send_token, sv.plan.token_expert_indices, sv.plan.gates,
                               k, epr_, s);
    send_rows_beside(x, w, a.dy, nullptr, s);
  } else {
    dispatch(x, w, hc, a.dy, sv.plan, s);
  }
  CallArgs la = local_args(a, w, sv.recv_x);
  if (overlap_) la.arrival = arrival(w);
  la.dy = dense(comm_->local() + layout_.rows, g_.act_dtype, R_, g_.hidden);
  if (a.dx.present) la.dx = dense(w.rows, g_.act_dtype, R_, g_.hidden);
  la.d_w_gate_up = a.d_w_gate_up;
  la.d_w_down = a.d_w_down;
  la.d_topk_weights = dense(w.dg_recv, DType::kF32, R_, l_.top_k);
  // The dx parts go back from the local call once final, beside its weight gradients.
  SendDxRows send_dx;
  const bool dx_beside = lane_ && a.dx.present;
  if (dx_beside) {
    ep::return_addresses_cuda(x, w.ret_addr, s);  // where poison_returns_cuda writes, should the call fail
    send_dx.x = x;
    send_dx.rows = static_cast<const char*>(w.rows);
    send_dx.ctas = lane_ctas();
    la.side = lane(send_dx);
  }
  // The local call reads its saved buffer only: its workspace is sized for a plain backward.
  local_->backward(la, sv.local, false, w.local_ws, s);
  if (overlap_) join_rows(s);
  cuda::flag_if_status(w.local_status, flag, kLocalFailed, s);
  if (dx_beside) ep::poison_returns_cuda(x, w.ret_addr, w.local_status, s);
  // The gate gradients (and the dx parts, unless they went beside) go back, then the barrier.
  give_back(x, w, hc, a.dx.present && !dx_beside ? static_cast<const char*>(w.rows) : nullptr, w.dg_recv, s);
  ep::gather_returned_gates_cuda(sv.plan.token_expert_indices, L, k, P_, epr_, static_cast<int32_t>(l_.top_k),
                                 reinterpret_cast<const float*>(comm_->local() + layout_.ret_gates), w.dg_tok, s);
  const combine::TokenTerms router_dx = router_->backward(a, needs, sv.plan, w.dg_tok, w.router, s);
  if (a.dx.present) {
    combine::combine_rows_cuda(w.send.return_map, nullptr, L, c_, g_.hidden, comm_->local() + layout_.ret_rows,
                               router_dx, a.dx, s);
    router_->add_router_dx(a, needs, a.dx, w.router, s);
  }
  if (a.d_topk_weights.present) combine::store_f32_rows_cuda(w.dg_tok, L, k, a.d_topk_weights, s);
  cuda::CallEnd end{{&a.dx, &a.d_w_gate_up, &a.d_w_down, &a.d_topk_weights, &a.d_logits, &a.d_router_weight},
                    a.status,
                    ep::kRecvOverflow,
                    kRowsLate};
  if (last_use) {
    end.header_dst = sv.header;
    end.header = spent_saved_header(g_, L);
    end.header_unless_flag = false;
  }
  cuda::end_call(flag, end, s);
}

}  // namespace

size_t ep_symmetric_bytes(const LayerConfig& cfg, int32_t ranks) {
  check_placement(ranks, cfg.num_experts);
  const ep::WindowLayout lay = layout_of(cfg, ranks, recv_bound(cfg, ranks, cfg.ep_max_recv_tokens));
  return cfg.ep_transport == static_cast<int32_t>(comm::EpTransport::kHost) ? lay.bytes + ep::stage_layout(lay).bytes
                                                                             : lay.bytes;
}

std::unique_ptr<Engine> make_ep_engine(LayerConfig& cfg, const EpOptions& opt, std::string* decision) {
  if (!opt.nccl_comm && opt.unique_id_bytes != sizeof(ncclUniqueId))
    fail(Status::kInvalidArgument, "unique_id_bytes = %zu but an ncclUniqueId has %zu bytes", opt.unique_id_bytes,
         sizeof(ncclUniqueId));
  if (cfg.device_type != kDeviceCuda) fail(Status::kNotSupported, "expert parallelism runs on CUDA devices only");
  cudaStream_t s = static_cast<cudaStream_t>(opt.stream);
  cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
  MOEBLAZE_CUDA_CHECK(cudaStreamIsCapturing(s, &capture));
  if (capture != cudaStreamCaptureStatusNone)
    fail(Status::kInvalidArgument, "an expert-parallel layer cannot be created while its stream is capturing "
                                   "(create registers memory with NCCL)");
  const comm::NcclApi& api = comm::nccl_api();
  ncclComm_t nc = static_cast<ncclComm_t>(opt.nccl_comm);
  const bool own = nc == nullptr;  // made below from the unique id, once everything else checks
  int P = opt.ranks, rank = opt.rank;
  if (!own) {
    if (api.comm_count(nc, &P) != ncclSuccess || api.comm_user_rank(nc, &rank) != ncclSuccess)
      fail(Status::kInvalidArgument, "nccl_comm is not a usable NCCL communicator");
  }
  check_placement(P, cfg.num_experts);
  if (P > 64) fail(Status::kNotSupported, "expert parallelism over %d ranks (at most 64)", P);
  if (cfg.ep_size != 0 && cfg.ep_size != P)
    fail(Status::kInvalidArgument, "EP_SIZE = %d but the communicator has %d ranks", cfg.ep_size, P);
  if (cfg.ep_rank != -1 && cfg.ep_rank != rank)
    fail(Status::kInvalidArgument, "EP_RANK = %d but this is rank %d of the communicator", cfg.ep_rank, rank);
  const int64_t R = recv_bound(cfg, P, cfg.ep_max_recv_tokens);
  if (R * std::min<int64_t>(cfg.top_k, cfg.num_experts / P) > 2147483647LL)
    fail(Status::kInvalidArgument, "the receive bound (%lld rows) times the local slots must stay below 2^31",
         static_cast<long long>(R));
  const int32_t ctas = cfg.ep_comm_sms > 0 ? cfg.ep_comm_sms : kDefaultCtas;
  // The rows sent beside the local GEMMs take fewer CTAs, unless EP_COMM_SMS names the count.
  const int32_t row_ctas = cfg.ep_comm_sms > 0 ? ctas : std::min(ctas, gemm::sm90::kEpOverlapCtas);
  cfg.ep_ranks = P;
  cfg.ep_rank_of = rank;
  LayerConfig l = local_config(cfg, P, R);
  std::unique_ptr<Engine> local = create_engine(l, decision);
  cfg.device_id = l.device_id;
  cfg.engine = l.engine;
  if (own) {  // collective; from here on the EpComm owns it (and destroys it if create fails)
    cuda::DeviceGuard guard(cfg.device_id);
    ncclUniqueId id;
    std::memcpy(&id, opt.unique_id, sizeof id);
    const ncclResult_t r = api.comm_init_rank(&nc, P, id, rank);
    if (r != ncclSuccess) fail(Status::kInternalError, "NCCL ncclCommInitRank failed: %s", api.get_error_string(r));
  }
  const ep::WindowLayout lay = layout_of(cfg, P, R);
  auto comm = std::make_unique<comm::EpComm>(nc, own, static_cast<comm::EpTransport>(cfg.ep_transport), lay.bytes,
                                             lay.bytes + ep::stage_layout(lay).bytes, ep::exchange_barriers(ctas),
                                             cfg.device_id);
  // Every rank must have passed the same configuration.
  const uint64_t digest = saved_fingerprint(cfg) ^ (static_cast<uint64_t>(cfg.max_tokens) * 0x9e3779b97f4a7c15ull) ^
                          (static_cast<uint64_t>(R) << 17) ^ (static_cast<uint64_t>(ctas) << 48) ^
                          (static_cast<uint64_t>(comm->transport()) << 60);
  const std::vector<uint64_t> all = comm->all_gather(digest, s);
  for (int r = 0; r < P; ++r)
    if (all[r] != all[0])
      fail(Status::kInvalidArgument, "rank %d passed a configuration that differs from rank 0's (every rank of an "
                                     "expert-parallel layer must pass the same one)", r);
  if (decision)
    *decision += ", expert-parallel rank " + std::to_string(comm->rank()) + " of " + std::to_string(P) + " (" +
                 std::to_string(cfg.num_experts / P) + " local experts, " +
                 (comm->transport() == comm::EpTransport::kHost ? "HOST" : "NVLink") + " transport)";
  return std::make_unique<EpEngine>(cfg, l, std::move(local), std::move(comm), R, ctas, row_ctas);
}

}  // namespace v0
}  // namespace moeblaze
