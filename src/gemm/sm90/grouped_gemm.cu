// The sm_90a persistent grouped GEMM: kernel, schedule step and launch (compiled for sm_90a only).
#include <cub/block/block_scan.cuh>

// CUB lives in a private namespace (CUB_WRAPPED_NAMESPACE); CUB_NS_QUALIFIER names it.
namespace cubw = CUB_NS_QUALIFIER;

#include <algorithm>

#include "cuda/cuda_check.hpp"
#include "gemm/sm90/epilogue.cuh"
#include "gemm/sm90/epilogue_act_backward.cuh"
#include "gemm/sm90/epilogue_deferred.cuh"
#include "gemm/sm90/grouped_gemm.hpp"
#include "gemm/sm90/launch.cuh"
#include "gemm/sm90/mainloop.cuh"
#include "gemm/sm90/tensor_map.hpp"
#include "util/offsets_cuda.cuh"
#include "util/align.hpp"
#include "util/error.hpp"
#include "util/vec8.cuh"

namespace moeblaze {
inline namespace v0 {
namespace gemm {
namespace sm90 {
namespace {

constexpr int kScheduleThreads = 1024;

// One block: out_off = the sanitised offsets (util/offsets_cuda.cuh), then the row-block prefix.
__global__ void __launch_bounds__(kScheduleThreads) schedule_kernel(const int32_t* offsets, int32_t E, int32_t m_total,
                                                                    int32_t* out_off, int32_t* prefix) {
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

// A fragment's epilogue: staged through shared memory to TMA stores when the maps allow it and
// the tile's rows all belong to its expert, from registers otherwise.
template <class T, int BN, EpilogueKind Epi>
__device__ __forceinline__ void epilogue(const GroupedGemmParams& p, const EpilogueParams& e, const EpilogueMaps& maps,
                                         TileStore& ts, const TileCoord& tc, int frag, const RowScales& scale,
                                         const float (&acc)[BN / 2]) {
  const bool staged = tile_staged(maps, tc);
  if constexpr (Epi == EpilogueKind::kStore) {
    if (staged) epilogue_store_staged<T, BN>(p, maps, ts, tc, frag, scale, acc);
    else epilogue_store<T, BN>(p, e, tc, frag, acc);
  } else {
    epilogue_activation<T, BN>(p, e, maps, ts, staged, tc, frag, acc);
  }
}

// Two schedules for the consumer warpgroups (the producers are the same):
// - cooperative: both take every tile, rows [0, 64) and [64, 128); their epilogues run while
//   no MMA does;
// - ping-pong: warpgroup w takes the CTA's tiles w, w + 2, ... whole (two m64 fragments each).
//   turn[] alternates their MMAs: a warpgroup starts a tile's MMAs once the other has finished
//   its previous tile's, so one's epilogue overlaps the other's MMAs. Its ring position is
//   its tile's index times the K blocks per tile (the same for every tile).
// The producer's epilogue loads (mainloop.cuh): the activation backward's saved pre, or none.
template <class Loads>
__device__ __forceinline__ Loads make_loads(const GroupedGemmParams& p, const EpilogueParams& e, const EpilogueMaps& maps) {
  if constexpr (std::is_same_v<Loads, NoEpilogueLoads>) return {};
  else return Loads{p, e, maps};
}

// The activation-backward epilogue runs on the cooperative schedule only, its saved pre
// loaded into the ring after each tile's k-blocks (PreLoads).
template <class T, int BN, Major BMajor, EpilogueKind Epi, bool PingPong>
__global__ void __launch_bounds__(kThreads, 1)
    grouped_gemm_kernel(const __grid_constant__ GroupedGemmParams p, const __grid_constant__ OperandMaps ab,
                        const __grid_constant__ EpilogueParams e, const __grid_constant__ EpilogueMaps maps) {
#if defined(__CUDA_ARCH__) && (__CUDA_ARCH__ >= 900)
  extern __shared__ __align__(1024) uint8_t smem_raw[];
  // full[s]: the TMA expect_tx, + every producer thread's cp.async arrival when A is gathered.
  constexpr bool kActBackward = Epi == EpilogueKind::kActivationBackward;
  static_assert(!kActBackward || !PingPong, "the activation backward runs on cooperative tiles");
  const auto ring = init_ring<TileConfig<BN>>(smem_raw, ab.a_by_tma ? 1 : 129, PingPong ? 4 : 8, kActBackward ? 32 : 1);
  const int wg = threadIdx.x / 128;
  // Every tile has K > 0 (unsupported_reason), so every tile fills a first stage and the
  // consumers' on_first reads its slot.
  if (wg == 0) {
    regs_dealloc<kProducerRegs>();
    using Loads = std::conditional_t<kActBackward, PreLoads<BN>, NoEpilogueLoads>;
    const Loads loads = make_loads<Loads>(p, e, maps);
    if (ab.a_by_tma) produce_tma_a<T, BN, BMajor, Loads>(p, ab.a, ab.b, ring, loads);
    else produce<T, BN, BMajor, Loads>(p, ab.b, ring, loads);
  } else {
    regs_alloc<kConsumerRegs>();
    TileStore ts = TileStore::make(ring.staging, wg - 1);
    const int32_t E = p.sched.num_experts, cb = column_blocks(p.n, p.gated, BN);
    const int num_kb = (p.k + kBlockK - 1) / kBlockK;
    const int64_t total = total_tiles(p.sched.rb_prefix, E, cb);
    if constexpr (PingPong) {
      const int me = wg - 1;
      float acc[2][BN / 2];
      uint32_t round = 0;
      for (int64_t j = me; blockIdx.x + j * gridDim.x < total; j += 2, ++round) {
        // Tile j's MMAs wait for tile j - 1's (the other warpgroup's) to finish.
        if (j > 0) mbar_wait(&ring.turn[me], (me == 0 ? round - 1 : round) & 1);
        uint32_t it = static_cast<uint32_t>(j * num_kb);
        TileCoord tc;
        RowScales sc[2];
        consume_tile<T, BN, BMajor, Major::kK, 2>(ring, 0, num_kb, it, acc, [&] {
          tc = read_tile_slot(ring.tiles, j);
          sc[0] = load_row_scales(e, tc, 0);
          sc[1] = load_row_scales(e, tc, 1);
        });
        if (threadIdx.x % 128 == 0) cuda::ptx::mbarrier_arrive(&ring.turn[me ^ 1]);
        epilogue<T, BN, Epi>(p, e, maps, ts, tc, 0, sc[0], acc[0]);
        epilogue<T, BN, Epi>(p, e, maps, ts, tc, 1, sc[1], acc[1]);
      }
    } else {
      uint32_t it = 0;
      float acc[1][BN / 2];
      // kStore: a full tile's boxes are staged under the next tile's first k-blocks (registers
      // are scarce beside them: the tile's coordinates are read from its slot after the
      // mainloop, and its index from j).
      DeferredBoxes<BN> deferred;  // maps.defer is set for kStore only (epilogue_maps)
      for (uint32_t j = 0; blockIdx.x + static_cast<int64_t>(j) * gridDim.x < total; ++j) {
        RowScales sc;
        consume_tile<T, BN, BMajor>(
            ring, wg - 1, num_kb, it, acc,
            [&] { sc = load_row_scales(e, read_tile_slot(ring.tiles, j), wg - 1); },
            [&](int kb) {
              if constexpr (Epi == EpilogueKind::kStore) deferred.stage_at(kb, maps.out, ts);
            });
        const TileCoord tc = read_tile_slot(ring.tiles, j);
        if constexpr (kActBackward) {
          act_backward_fragment<T, BN>(p, e, maps, ts, ring, it, tc, wg - 1, sc, acc[0]);
        } else {
          if constexpr (Epi == EpilogueKind::kStore) {
            deferred.flush(maps.out, ts);  // a tile of fewer k-blocks than boxes
            if (maps.defer && tile_staged(maps, tc)) {
              keep_store<T, BN>(deferred, p, tc, wg - 1, sc, acc[0]);
              continue;
            }
          }
          epilogue<T, BN, Epi>(p, e, maps, ts, tc, wg - 1, sc, acc[0]);
          if constexpr (Epi == EpilogueKind::kStore) deferred.clear();
        }
      }
      if constexpr (Epi == EpilogueKind::kStore) deferred.flush(maps.out, ts);
    }
    ts.drain();
  }
#endif
}

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
  if (!staged_epilogue_allowed()) return m;
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
bool a_by_tma(const GroupedGemmParams& p) { return a_by_tma_allowed() && !p.a_index && p.a_rows > 0; }

template <class T, int BN, Major BMajor, EpilogueKind Epi, bool PingPong>
void launch(const GroupedGemmParams& p, const EpilogueParams& e, cudaStream_t s) {
  using Cfg = TileConfig<BN>;
  auto* kernel = grouped_gemm_kernel<T, BN, BMajor, Epi, PingPong>;
  const int64_t bound = max_tiles(p.sched.m_total, p.sched.num_experts, kBlockM, column_blocks(p.n, p.gated, BN));
  const int grid = persistent_grid(kernel, Cfg::kSmemBytes, bound);
  OperandMaps ab;
  ab.b = weight_tensor_map(Elem<T>::kType, p, tile_columns(p.gated, BN));
  ab.a_by_tma = a_by_tma(p);
  if (ab.a_by_tma) ab.a = rows_tensor_map(Elem<T>::kType, p.a, p.a_rows, p.k, p.lda);
  kernel<<<grid, kThreads, Cfg::kSmemBytes, s>>>(p, ab, e, epilogue_maps(Elem<T>::kType, p, e));
  MOEBLAZE_CUDA_CHECK(cudaGetLastError());
}

template <class T, int BN, bool PingPong>
void dispatch_major(const GroupedGemmParams& p, const EpilogueParams& e, cudaStream_t s) {
  if constexpr (!PingPong) {
    if (e.kind == EpilogueKind::kActivationBackward) {
      if (p.b_major == Major::kMN) launch<T, BN, Major::kMN, EpilogueKind::kActivationBackward, false>(p, e, s);
      else launch<T, BN, Major::kK, EpilogueKind::kActivationBackward, false>(p, e, s);
      return;
    }
  }
  const bool mn = p.b_major == Major::kMN, store = e.kind == EpilogueKind::kStore;
  if (mn && store) launch<T, BN, Major::kMN, EpilogueKind::kStore, PingPong>(p, e, s);
  else if (mn) launch<T, BN, Major::kMN, EpilogueKind::kActivation, PingPong>(p, e, s);
  else if (store) launch<T, BN, Major::kK, EpilogueKind::kStore, PingPong>(p, e, s);
  else launch<T, BN, Major::kK, EpilogueKind::kActivation, PingPong>(p, e, s);
}

// Ping-pong tiles are 128 x 128 per warpgroup: its two m64n128 fragments hold as many
// accumulators as one m64n256 fragment of a cooperative 128 x 256 tile.
template <class T>
void dispatch(const KernelChoice& kc, const GroupedGemmParams& p, const EpilogueParams& e, cudaStream_t s) {
  if (kc.schedule == ConsumerSchedule::kPingPong) dispatch_major<T, 128, true>(p, e, s);
  else if (kc.block_n == 256) dispatch_major<T, 256, false>(p, e, s);
  else dispatch_major<T, 128, false>(p, e, s);
}

}  // namespace

size_t schedule_bytes(int64_t num_experts) { return 2 * align_up(sizeof(int32_t) * (num_experts + 1), 256); }

Schedule make_schedule(const int32_t* offsets, int64_t num_experts, int64_t m_total, void* workspace, cudaStream_t s) {
  Schedule sc;
  int32_t* off = static_cast<int32_t*>(workspace);
  int32_t* prefix = reinterpret_cast<int32_t*>(static_cast<char*>(workspace) + schedule_bytes(num_experts) / 2);
  schedule_kernel<<<1, kScheduleThreads, 0, s>>>(offsets, static_cast<int32_t>(num_experts), static_cast<int32_t>(m_total),
                                                 off, prefix);
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
  if (p.k <= 0 || p.n <= 0 || p.k % 8 || p.n % 8 || p.lda % 8 || p.ldb % 8)
    return "K and N must be positive multiples of 8, and the operands' leading dimensions multiples of 8";
  if (!aligned16(p.a) || !aligned16(p.b)) return "operands must be 16-byte aligned";
  // The weights' TMA map (tensor_map.cpp): every stride a multiple of 16 bytes below 2^40.
  const int64_t es = static_cast<int64_t>(dtype_size(dt)), max_stride = int64_t{1} << 40;
  if (p.b_expert_stride % 8 || p.b_expert_stride < 0 || p.b_expert_stride * es >= max_stride ||
      p.ldb * es >= max_stride || p.lda * es >= max_stride)
    return "the weights' expert stride must be a non-negative multiple of 8 elements, and every stride below 2^40 bytes";
  if (p.gated && e.kind != EpilogueKind::kActivation) return "gated tiles pair columns for the activation epilogue only";
  if (e.kind == EpilogueKind::kStore && (e.ldc % 2 || reinterpret_cast<uintptr_t>(e.c) % 4))
    return "the output's leading dimension must be even and the output 4-byte aligned";
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
  kc = choose_kernel(p, e.kind, kc);
  if (dt == DType::kBF16) dispatch<__nv_bfloat16>(kc, p, e, s);
  else dispatch<__half>(kc, p, e, s);
}

}  // namespace sm90
}  // namespace gemm
}  // namespace v0
}  // namespace moeblaze
