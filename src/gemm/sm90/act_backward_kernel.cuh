// The sm_90a dact GEMM with the activation backward on epilogue warps
// (gemm/sm90/act_backward_warpgroup.cuh) and its launch, as templates instantiated per dtype in
// a generated translation unit (src/gemm/sm90/kernels.cmake). Compiled for sm_90a only.
#pragma once

#include "cuda/cuda_check.hpp"
#include "gemm/sm90/act_backward_warpgroup.cuh"
#include "gemm/sm90/kernel_variants.hpp"
#include "gemm/sm90/launch.cuh"
#include "gemm/sm90/mainloop.cuh"
#include "gemm/sm90/tile_scheduler.cuh"

namespace moeblaze {
inline namespace v0 {
namespace gemm {
namespace sm90 {
namespace grouped_gemm_detail {

// Warps 0-1 produce (as in grouped_gemm_kernel, the gather on 64 threads), 2-3 are the epilogue,
// warpgroups 1 and 2 consume each tile cooperatively and hand its dact over. All walk the CTA's
// same tile sequence.
template <class T, Major BMajor>
__global__ void __launch_bounds__(kThreads, 1)
    act_backward_warpgroup_kernel(const __grid_constant__ GroupedGemmParams p, const __grid_constant__ OperandMaps ab,
                                  const __grid_constant__ EpilogueParams e) {
#if defined(__CUDA_ARCH__) && (__CUDA_ARCH__ >= 900)
  using Cfg = ActBackwardWarpgroupConfig;
  constexpr int BN = Cfg::kBlockN;
  extern __shared__ __align__(1024) uint8_t smem_raw[];
  PipelineArrivals arrivals;
  arrivals.producer = PipelineArrivals::producer_count(!ab.a_by_tma, kActBackwardProducerThreads);
  arrivals.consumer_warps = 8;
  const auto ring = init_ring<Cfg>(smem_raw, arrivals, act_backward_handoff());
  const int wg = threadIdx.x / 128;
  // Every warp keeps the block's 168 registers: the epilogue warps' batched loads need them, and
  // the consumers' mainloop fits.
  if (wg == 0) {
    if (threadIdx.x >= kActBackwardProducerThreads) act_backward_warpgroup<T, BN>(p, e, ring);
    else if (ab.a_by_tma) produce_tma_a<T, BN, BMajor>(p, ab.a, ab.b, ring);
    else produce<T, BN, BMajor, NoEpilogueLoads, kActBackwardProducerThreads>(p, ab.b, ring);
  } else {
    const int num_kb = (p.k + kBlockK - 1) / kBlockK;
    const PersistentTileScheduler<GroupedTiles> sched({p.sched, column_blocks(p.n, 0, BN)});
    typename StageRing<Cfg>::State st;
    PipelineState<1> hs;
    float acc[1][BN / 2];
    for (const TileWork w : sched.walk()) {
      (void)w;
      consume_tile<T, BN, BMajor>(ring, wg - 1, num_kb, st, acc);
      hand_off_dact<T, BN>(ring, hs, wg - 1, acc[0]);
    }
  }
#endif
}

}  // namespace grouped_gemm_detail

template <class T, Major BMajor>
void launch_act_backward_warpgroup(const GroupedGemmParams& p, const EpilogueParams& e, cudaStream_t s) {
  using Cfg = ActBackwardWarpgroupConfig;
  constexpr int BN = Cfg::kBlockN;
  auto* kernel = grouped_gemm_detail::act_backward_warpgroup_kernel<T, BMajor>;
  const int64_t bound = max_tiles(p.sched.m_total, p.sched.num_experts, kBlockM, column_blocks(p.n, 0, BN));
  const int grid = persistent_grid(kernel, Cfg::kSmemBytes, bound, p.max_ctas);
  kernel<<<grid, kThreads, Cfg::kSmemBytes, s>>>(p, operand_maps(Elem<T>::kType, p, BN), e);
  MOEBLAZE_CUDA_CHECK(cudaGetLastError());
}

}  // namespace sm90
}  // namespace gemm
}  // namespace v0
}  // namespace moeblaze
