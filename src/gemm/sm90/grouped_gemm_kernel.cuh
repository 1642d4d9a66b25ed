// The sm_90a persistent grouped GEMM kernel and its launch, as templates: each variant is
// instantiated in a translation unit of its own, generated at configure time
// (src/gemm/sm90/kernels.cmake), so that the CUDA build parallelises. Compiled for sm_90a only.
#pragma once

#include <type_traits>

#include "cuda/cuda_check.hpp"
#include "gemm/sm90/epilogue.cuh"
#include "gemm/sm90/epilogue_act_backward.cuh"
#include "gemm/sm90/epilogue_deferred.cuh"
#include "gemm/sm90/kernel_variants.hpp"
#include "gemm/sm90/launch.cuh"
#include "gemm/sm90/mainloop.cuh"
#include "gemm/sm90/pipeline.cuh"
#include "gemm/sm90/tile_scheduler.cuh"
#include "util/vec8.cuh"

namespace moeblaze {
inline namespace v0 {
namespace gemm {
namespace sm90 {
namespace grouped_gemm_detail {

// A fragment's epilogue: staged through shared memory to TMA stores when the maps allow it and
// the tile's rows all belong to its expert, from registers otherwise (rows placed by c_row
// always).
template <class T, int BN, EpilogueKind Epi>
__device__ __forceinline__ void epilogue(const GroupedGemmParams& p, const EpilogueParams& e, const EpilogueMaps& maps,
                                         TileStore& ts, const TileCoord& tc, int frag, const RowScales& scale,
                                         const float (&acc)[BN / 2]) {
  const bool staged = tile_staged(maps, tc);
  if constexpr (Epi == EpilogueKind::kStore) {
    if (e.c_row) epilogue_store_rows<T, BN>(p, e, tc, frag, scale, acc);  // never staged (epilogue_maps)
    else if (staged) epilogue_store_staged<T, BN>(p, maps, ts, tc, frag, scale, acc);
    else epilogue_store<T, BN>(p, e, tc, frag, acc);
  } else {
    epilogue_activation<T, BN>(p, e, maps, ts, staged, tc, frag, acc);
  }
}

// Two schedules for the consumer warpgroups (the producers are the same):
// - cooperative: both take every tile, rows [0, 64) and [64, 128); their epilogues run while
//   no MMA does;
// - ping-pong: warpgroup w takes the CTA's tiles w, w + 2, ... whole (two m64 fragments each).
//   MmaTurns alternates their MMAs: a warpgroup starts a tile's MMAs once the other has finished
//   its previous tile's, so one's epilogue overlaps the other's MMAs. Its ring position is
//   its tile's index times the K blocks per tile (the same for every tile).
// The producer's epilogue loads (mainloop.cuh): the activation backward's saved pre, or none.
template <class Loads>
__device__ __forceinline__ Loads make_loads(const GroupedGemmParams& p, const EpilogueParams& e, const EpilogueMaps& maps) {
  if constexpr (std::is_same_v<Loads, NoEpilogueLoads>) return {};
  else return Loads{p, e, maps};
}

// The cooperative consumers of a deferred activation epilogue (Defer =
// DeferredActivationOf<A, Gated>, the launch's nonlinearity and gating as template arguments,
// so the deferred boxes' arithmetic has no run-time dispatch): a full tile's outputs are staged
// half a box at a time under the next tile's k-blocks, a partial tile's stored from registers
// at once.
template <class T, int BN, Major BMajor, Activation A, bool Gated, class Cfg>
__device__ __forceinline__ void consume_activation_deferred(const GroupedGemmParams& p, const EpilogueParams& e,
                                                            const EpilogueMaps& maps, const StageRing<Cfg>& ring,
                                                            const PersistentTileScheduler<GroupedTiles>& sched,
                                                            int num_kb, TileStore& ts, int frag) {
  typename StageRing<Cfg>::State st;
  float acc[1][BN / 2];
  DeferredActivation<T, BN, A, Gated> deferred;
  for (const TileWork w : sched.walk()) {
    consume_tile<T, BN, BMajor>(ring, frag, num_kb, st, acc, NoTileInfo{}, [&](int) { deferred.stage_next(maps, ts); });
    deferred.flush(maps, ts);  // a tile of fewer k-blocks than turns
    const TileCoord tc = read_tile_slot(ring.tiles, w.j);
    if (activation_staged(p, e, tile_staged(maps, tc), tc)) {
      deferred.keep(p, e, tc, frag, acc[0]);
      continue;
    }
    epilogue_activation_as<T, BN, A, Gated>(p, e, tc, frag, acc[0]);
    deferred.clear();
  }
  deferred.flush(maps, ts);
}

// The activation-backward epilogue runs on the cooperative schedule only, its saved pre
// loaded into the ring after each tile's k-blocks (PreLoads).
template <class T, int BN, Major BMajor, EpilogueKind Epi, bool PingPong, class Defer>
__global__ void __launch_bounds__(kThreads, 1)
    grouped_gemm_kernel(const __grid_constant__ GroupedGemmParams p, const __grid_constant__ OperandMaps ab,
                        const __grid_constant__ EpilogueParams e, const __grid_constant__ EpilogueMaps maps) {
#if defined(__CUDA_ARCH__) && (__CUDA_ARCH__ >= 900)
  extern __shared__ __align__(1024) uint8_t smem_raw[];
  // full[s]: the TMA expect_tx, + every producer thread's cp.async arrival when A is gathered.
  constexpr bool kActBackward = Epi == EpilogueKind::kActivationBackward;
  static_assert(!kActBackward || !PingPong, "the activation backward runs on cooperative tiles");
  constexpr bool kDeferredActivation = !std::is_same_v<Defer, NoDeferral>;
  static_assert(!kDeferredActivation || (Epi == EpilogueKind::kActivation && !PingPong),
                "the deferred activation epilogue runs on cooperative tiles");
  PipelineArrivals arrivals;
  arrivals.producer = PipelineArrivals::producer_count(!ab.a_by_tma);
  arrivals.consumer_warps = PingPong ? 4 : 8;  // the warps that read a stage
  arrivals.per_warp = kActBackward ? 32 : 1;   // the pre stages are released thread by thread
  const auto ring = init_ring<TileConfig<BN>>(smem_raw, arrivals);
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
    const int num_kb = (p.k + kBlockK - 1) / kBlockK;
    const PersistentTileScheduler<GroupedTiles> sched({p.sched, column_blocks(p.n, p.gated, BN)});
    if constexpr (kDeferredActivation) {
      consume_activation_deferred<T, BN, BMajor, Defer::kPlain, Defer::kGated>(p, e, maps, ring, sched, num_kb, ts,
                                                                               wg - 1);
    } else if constexpr (PingPong) {
      const int me = wg - 1;
      float acc[2][BN / 2];
      uint32_t round = 0;
      for (const TileWork w : sched.walk(me, 2)) {
        // Tile j's MMAs wait for tile j - 1's (the other warpgroup's) to finish. Its ring
        // position: j tiles of num_kb k-blocks each come before it.
        ring.turns.wait(me, round++);
        typename StageRing<TileConfig<BN>>::State st{w.j * static_cast<uint32_t>(num_kb)};
        TileCoord tc;
        RowScales sc[2];
        consume_tile<T, BN, BMajor, Major::kK, 2>(ring, 0, num_kb, st, acc, [&] {
          tc = read_tile_slot(ring.tiles, w.j);
          sc[0] = load_row_scales(e, tc, 0);
          sc[1] = load_row_scales(e, tc, 1);
        });
        ring.turns.pass(me);
        epilogue<T, BN, Epi>(p, e, maps, ts, tc, 0, sc[0], acc[0]);
        epilogue<T, BN, Epi>(p, e, maps, ts, tc, 1, sc[1], acc[1]);
      }
    } else {
      typename StageRing<TileConfig<BN>>::State st;
      float acc[1][BN / 2];
      // kStore: a full tile's boxes are staged under the next tile's first k-blocks (registers
      // are scarce beside them: the tile's coordinates are read from its slot after the
      // mainloop, and its index from j).
      DeferredBoxes<BN> deferred;  // maps.defer is set for kStore only (epilogue_maps)
      for (const TileWork w : sched.walk()) {
        RowScales sc;
        consume_tile<T, BN, BMajor>(
            ring, wg - 1, num_kb, st, acc,
            [&] { sc = load_row_scales(e, read_tile_slot(ring.tiles, w.j), wg - 1); },
            [&](int kb) {
              if constexpr (Epi == EpilogueKind::kStore) deferred.stage_at(kb, maps.out, ts);
            });
        const TileCoord tc = read_tile_slot(ring.tiles, w.j);
        if constexpr (kActBackward) {
          act_backward_fragment<T, BN>(p, e, maps, ts, ring, st, tc, wg - 1, sc, acc[0]);
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

}  // namespace grouped_gemm_detail

template <class T, int BN, Major BMajor, EpilogueKind Epi, bool PingPong, class Defer>
void launch_grouped_gemm(const GroupedGemmParams& p, const EpilogueParams& e, cudaStream_t s) {
  using Cfg = TileConfig<BN>;
  auto* kernel = grouped_gemm_detail::grouped_gemm_kernel<T, BN, BMajor, Epi, PingPong, Defer>;
  const int64_t bound = max_tiles(p.sched.m_total, p.sched.num_experts, kBlockM, column_blocks(p.n, p.gated, BN));
  const int grid = persistent_grid(kernel, Cfg::kSmemBytes, bound, p.max_ctas);
  kernel<<<grid, kThreads, Cfg::kSmemBytes, s>>>(p, operand_maps(Elem<T>::kType, p, BN), e,
                                                 epilogue_maps(Elem<T>::kType, p, e));
  MOEBLAZE_CUDA_CHECK(cudaGetLastError());
}

}  // namespace sm90
}  // namespace gemm
}  // namespace v0
}  // namespace moeblaze
