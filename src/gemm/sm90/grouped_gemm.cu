// The sm_90a persistent grouped GEMM's host side: the schedule step, the refusals, the epilogue's
// store maps and the dispatch to the compiled kernel variants (grouped_gemm_kernel.cuh). Compiled
// for sm_90a only.
#include <cub/block/block_scan.cuh>

// CUB lives in a private namespace (CUB_WRAPPED_NAMESPACE); CUB_NS_QUALIFIER names it.
namespace cubw = CUB_NS_QUALIFIER;

#include <algorithm>

#include "cuda/chained_launch.cuh"
#include "cuda/cuda_check.hpp"
#include "gemm/sm90/grouped_gemm.hpp"
#include "gemm/sm90/heuristics.hpp"
#include "gemm/sm90/kernel_variants.hpp"
#include "gemm/sm90/launch.cuh"
#include "gemm/sm90/tensor_map.hpp"
#include "gemm/sm90/tile_config.hpp"
#include "math/activation.hpp"
#include "util/align.hpp"
#include "util/error.hpp"
#include "util/offsets_cuda.cuh"

namespace moeblaze {
inline namespace v0 {
namespace gemm {
namespace sm90 {
namespace {

constexpr int kScheduleThreads = 1024;

// One block: out_off = the sanitised offsets (util/offsets_cuda.cuh), then the row-block prefix.
__global__ void __launch_bounds__(kScheduleThreads) schedule_kernel(const int32_t* offsets, int32_t E, int32_t m_total,
                                                                    int32_t* out_off, int32_t* prefix) {
  cuda::wait_for_prior_grids();
  cuda::allow_next_grid();
  using Scan = cubw::BlockScan<int32_t, kScheduleThreads>;
  __shared__ typename Scan::TempStorage tmp;
  __shared__ int32_t carry_sum;
  sanitize_offsets_block<kScheduleThreads>(offsets, E, m_total, out_off);
  if (threadIdx.x == 0) carry_sum = 0;
  __syncthreads();
  for (int32_t base = 0; base < E; base += kScheduleThreads) {
    const int32_t e = base + threadIdx.x;
    const int32_t blocks = e < E ? row_blocks(out_off[e + 1] - out_off[e], kBlockM) : 0;
    int32_t excl, total;
    Scan(tmp).ExclusiveSum(blocks, excl, total);
    if (e < E) prefix[e] = carry_sum + excl;
    __syncthreads();
    if (threadIdx.x == 0) carry_sum += total;
    __syncthreads();
  }
  if (threadIdx.x == 0) prefix[E] = carry_sum;
}

}  // namespace

// The TMA store maps of the epilogue's outputs; enabled only when every output it writes can be
// addressed by TMA (16-byte aligned, row strides multiples of 16 bytes).
EpilogueMaps epilogue_maps(DType dt, const GroupedGemmParams& p, const EpilogueParams& e) {
  EpilogueMaps m;
  if (p.sched.m_total <= 0) return m;
  // The activation backward's pre and dpre: [rows][2][n] when gated (gate and up halves).
  const int halves = e.kind == EpilogueKind::kActivationBackward && is_gated(e.activation) ? 2 : 1;
  if (e.kind == EpilogueKind::kActivationBackward &&  // the loads' map (unsupported_reason checked TMA can)
      !output_tensor_map(dt, e.pre, e.pre_out_rows ? e.pre_out_rows : p.sched.m_total, p.n, halves, e.ld_pre,
                         &m.pre_load))
    fail(Status::kInternalError, "the activation-backward epilogue's pre map could not be encoded");
  if (!staged_epilogue_allowed() || e.c_row) return m;  // rows placed one by one: no box
  const int64_t act_rows = e.act_out_rows ? e.act_out_rows : p.sched.m_total;
  const int64_t pre_rows = e.pre_out_rows ? e.pre_out_rows : p.sched.m_total;
  bool ok;
  if (e.kind == EpilogueKind::kStore) {
    ok = output_tensor_map(dt, e.c, p.sched.m_total, p.n, 1, e.ldc, &m.out);
  } else if (e.kind == EpilogueKind::kActivationBackward) {
    ok = output_tensor_map(dt, e.act, p.sched.m_total, p.n, 1, e.ld_act, &m.out) &&
         output_tensor_map(dt, e.c, p.sched.m_total, p.n, halves, e.ldc, &m.pre);
  } else {
    ok = e.act || e.pre;
    if (e.act) ok = ok && output_tensor_map(dt, e.act, act_rows, p.n, 1, e.ld_act, &m.out);
    if (e.pre) ok = ok && output_tensor_map(dt, e.pre, pre_rows, p.n, p.gated ? 2 : 1, e.ld_pre, &m.pre);
  }
  m.enabled = ok;
  m.defer = ok && e.kind == EpilogueKind::kStore && deferred_epilogue_allowed();
  return m;
}

// A in expert order goes by TMA (unsupported_reason has checked the alignment TMA needs).
OperandMaps operand_maps(DType dt, const GroupedGemmParams& p, int bn) {
  OperandMaps ab;
  ab.b = weight_tensor_map(dt, p, tile_columns(p.gated, bn));
  ab.a_by_tma = a_by_tma_allowed() && !p.a_index && p.a_rows > 0;
  if (ab.a_by_tma) ab.a = rows_tensor_map(dt, p.a, p.a_rows, p.k, p.lda);
  return ab;
}

namespace {

// The deferred activation epilogue's kernel for the launch's activation, B major BMajor
// (choose_kernel's deferred_activation said it has one).
template <class T, Major BMajor>
void launch_deferred_activation(const GroupedGemmParams& p, const EpilogueParams& e, cudaStream_t s) {
  with_activation(e.activation, [&](auto a) {
    constexpr Activation kAct = decltype(a)::value;
    if constexpr (activation_epilogue_deferred(kAct)) {
      using Defer = DeferredActivationOf<Nonlinearity<kAct>::kPlain, is_gated(kAct)>;
      launch_grouped_gemm<T, 256, BMajor, EpilogueKind::kActivation, false, Defer>(p, e, s);
    }
  });
}

template <class T, int BN, bool PingPong>
void dispatch_major(const GroupedGemmParams& p, const EpilogueParams& e, cudaStream_t s) {
  if constexpr (!PingPong) {
    if (e.kind == EpilogueKind::kActivationBackward) {
      if (p.b_major == Major::kMN) launch_grouped_gemm<T, BN, Major::kMN, EpilogueKind::kActivationBackward, false>(p, e, s);
      else launch_grouped_gemm<T, BN, Major::kK, EpilogueKind::kActivationBackward, false>(p, e, s);
      return;
    }
  }
  const bool mn = p.b_major == Major::kMN, store = e.kind == EpilogueKind::kStore;
  if (mn && store) launch_grouped_gemm<T, BN, Major::kMN, EpilogueKind::kStore, PingPong>(p, e, s);
  else if (mn) launch_grouped_gemm<T, BN, Major::kMN, EpilogueKind::kActivation, PingPong>(p, e, s);
  else if (store) launch_grouped_gemm<T, BN, Major::kK, EpilogueKind::kStore, PingPong>(p, e, s);
  else launch_grouped_gemm<T, BN, Major::kK, EpilogueKind::kActivation, PingPong>(p, e, s);
}

// Ping-pong tiles are 128 x 128 per warpgroup: its two m64n128 fragments hold as many
// accumulators as one m64n256 fragment of a cooperative 128 x 256 tile.
template <class T>
void dispatch(const KernelChoice& kc, const GroupedGemmParams& p, const EpilogueParams& e, cudaStream_t s) {
  if (kc.schedule == ConsumerSchedule::kEpilogueWarpgroup) {
    if (p.b_major == Major::kMN) launch_act_backward_warpgroup<T, Major::kMN>(p, e, s);
    else launch_act_backward_warpgroup<T, Major::kK>(p, e, s);
  } else if (kc.deferred_activation) {
    if (p.b_major == Major::kMN) launch_deferred_activation<T, Major::kMN>(p, e, s);
    else launch_deferred_activation<T, Major::kK>(p, e, s);
  } else if (kc.schedule == ConsumerSchedule::kPingPong) dispatch_major<T, 128, true>(p, e, s);
  else if (kc.block_n == 256) dispatch_major<T, 256, false>(p, e, s);
  else dispatch_major<T, 128, false>(p, e, s);
}

}  // namespace

bool kernels_built(DType dt) { return kernels_compiled(dt); }

size_t schedule_bytes(int64_t num_experts) { return 2 * align_up(sizeof(int32_t) * (num_experts + 1), 256); }

Schedule make_schedule(const int32_t* offsets, int64_t num_experts, int64_t m_total, void* workspace, cudaStream_t s) {
  Schedule sc;
  int32_t* off = static_cast<int32_t*>(workspace);
  int32_t* prefix = reinterpret_cast<int32_t*>(static_cast<char*>(workspace) + schedule_bytes(num_experts) / 2);
  cuda::launch_chained(schedule_kernel, 1, kScheduleThreads, 0, s, offsets, static_cast<int32_t>(num_experts),
                       static_cast<int32_t>(m_total), off, prefix);
  MOEBLAZE_CUDA_CHECK(cudaGetLastError());
  sc.offsets = off;
  sc.rb_prefix = prefix;
  sc.num_experts = static_cast<int32_t>(num_experts);
  sc.m_total = static_cast<int32_t>(m_total);
  sc.raster_group = raster_group();
  return sc;
}

const char* unsupported_reason(DType dt, const GroupedGemmParams& p, const EpilogueParams& e) {
  if (dt != DType::kBF16 && dt != DType::kF16) return "the sm_90a grouped GEMM takes bf16 or fp16 operands";
  if (!kernels_compiled(dt)) return kDtypeLeftOut;
  if (p.k <= 0 || p.n <= 0 || p.k % 8 || p.n % 8 || p.lda % 8 || p.ldb % 8)
    return "K and N must be positive multiples of 8, and the operands' leading dimensions multiples of 8";
  if (!aligned16(p.a) || !aligned16(p.b)) return "operands must be 16-byte aligned";
  // The weights' TMA map (tensor_map.cpp): every stride a multiple of 16 bytes below 2^40.
  const int64_t es = static_cast<int64_t>(dtype_size(dt)), max_stride = int64_t{1} << 40;
  if (p.b_expert_stride % 8 || p.b_expert_stride < 0 || p.b_expert_stride * es >= max_stride ||
      p.ldb * es >= max_stride || p.lda * es >= max_stride)
    return "the weights' expert stride must be a non-negative multiple of 8 elements, and every stride below 2^40 bytes";
  if (p.arrival.waits() && (!p.a_index || !p.arrival.flag))
    return "rows still arriving are waited for on gathered A only, with the step's flag";
  if (p.gated && e.kind != EpilogueKind::kActivation) return "gated tiles pair columns for the activation epilogue only";
  if (e.kind == EpilogueKind::kStore && !e.c_row && (e.ldc % 2 || reinterpret_cast<uintptr_t>(e.c) % 4))
    return "the output's leading dimension must be even and the output 4-byte aligned";
  if (e.c_row && (e.kind != EpilogueKind::kStore || e.ldc < p.n || e.c_rows < 0))
    return "rows placed by c_row are the store epilogue's, into an output whose leading dimension covers n";
  if (e.kind == EpilogueKind::kActivationBackward) {
    if (p.gated) return "the activation-backward epilogue's GEMM is not gated (dact = dy W_down^T, n = h)";
    if (!e.c || !e.act || !e.pre || !e.dg) return "the activation-backward epilogue needs pre, dpre, g act and dg";
    // Gated activations: pre and dpre hold the gate half, then the up half (2n columns).
    const int64_t pre_cols = (is_gated(e.activation) ? 2 : 1) * static_cast<int64_t>(p.n);
    if (!aligned16(e.pre) || e.ld_pre % 8 || e.ld_pre < pre_cols)
      return "the activation-backward epilogue reads pre by TMA: 16-byte aligned rows of at least its columns";
    if (e.ldc < pre_cols || e.ld_act < p.n)
      return "the activation-backward outputs' leading dimensions must cover their columns";
    if (e.ldc % 2 || e.ld_act % 2 || reinterpret_cast<uintptr_t>(e.c) % 4 || reinterpret_cast<uintptr_t>(e.act) % 4)
      return "the activation-backward outputs' leading dimensions must be even and the outputs 4-byte aligned";
    if (e.ld_dg < p.sched.m_total) return "the dg partial sums' leading dimension must cover the rows";
  }
  if (e.kind == EpilogueKind::kActivation &&
      (e.ld_act % 2 || (e.pre && e.ld_pre % 2) || reinterpret_cast<uintptr_t>(e.act) % 4 ||
       reinterpret_cast<uintptr_t>(e.pre) % 4))
    return "the activation outputs' leading dimensions must be even and the outputs 4-byte aligned";
  return nullptr;
}

void grouped_gemm(DType dt, const GroupedGemmParams& p, const EpilogueParams& e, KernelChoice kc, cudaStream_t s) {
  if (const char* why = unsupported_reason(dt, p, e)) fail(Status::kNotSupported, "%s", why);
  kc = choose_kernel(p, e, kc);
#if MOEBLAZE_SM90_BF16
  if (dt == DType::kBF16) dispatch<__nv_bfloat16>(kc, p, e, s);
#endif
#if MOEBLAZE_SM90_FP16
  if (dt == DType::kF16) dispatch<__half>(kc, p, e, s);
#endif
}

}  // namespace sm90
}  // namespace gemm
}  // namespace v0
}  // namespace moeblaze
