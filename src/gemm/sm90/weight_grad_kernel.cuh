// The sm_90a weight-gradient kernel and its launch, as templates: the grouped GEMM's ring,
// consumers and register split, with the varlen-K producer (mainloop_k.cuh) and the
// weight-gradient epilogue. Each variant is instantiated in a generated translation unit
// (src/gemm/sm90/kernels.cmake). Compiled for sm_90a only.
#pragma once

#include "cuda/cuda_check.hpp"
#include "gemm/sm90/epilogue.cuh"
#include "gemm/sm90/kernel_variants.hpp"
#include "gemm/sm90/launch.cuh"
#include "gemm/sm90/mainloop_k.cuh"
#include "gemm/sm90/pipeline.cuh"
#include "gemm/sm90/tile_scheduler.cuh"
#include "util/vec8.cuh"

namespace moeblaze {
inline namespace v0 {
namespace gemm {
namespace sm90 {

constexpr int kWeightGradBlockN = 256;

namespace weight_grad_detail {

template <class T, int BN, bool TmaA, bool TmaB>
__global__ void __launch_bounds__(kThreads, 1) weight_grad_kernel(const __grid_constant__ WeightGradParams p,
                                                                      const __grid_constant__ WeightGradMaps maps,
                                                                      const __grid_constant__ EpilogueMaps out_maps) {
#if defined(__CUDA_ARCH__) && (__CUDA_ARCH__ >= 900)
  extern __shared__ __align__(1024) uint8_t smem_raw[];
  // full[s]: every producer thread's cp.async arrival + thread 0's (with the TMA bytes, if any).
  PipelineArrivals arrivals;
  arrivals.producer = PipelineArrivals::producer_count(true);
  const auto ring = init_ring<TileConfig<BN>>(smem_raw, arrivals);
  const int wg = threadIdx.x / 128;
  if (wg == 0) {
    regs_dealloc<kProducerRegs>();
    produce_weight_grad<T, BN, TmaA, TmaB>(p, maps, ring);
  } else {
    regs_alloc<kConsumerRegs>();
    TileStore ts = TileStore::make(ring.staging, wg - 1);
    const PersistentTileScheduler<WeightGradTiles<BN>> sched({p.sched.offsets, p.sched.num_experts, p.m, p.n});
    typename StageRing<TileConfig<BN>>::State st;
    float acc[1][BN / 2];
    for (const TileWork w : sched.walk()) {
      const WeightGradTile tile = sched.decode(w);
      const int num_kb = tile.k_blocks();
      consume_tile<T, BN, Major::kMN, Major::kMN>(ring, wg - 1, num_kb, st, acc);
      epilogue_weight_grad<T, BN>(p, out_maps, ts, tile.expert, tile.m0, tile.n0, num_kb, wg - 1, acc[0]);
    }
    ts.drain();
  }
#endif
}

}  // namespace weight_grad_detail

template <class T, bool TmaA, bool TmaB>
void launch_weight_grad(const WeightGradParams& p, const WeightGradMaps& maps, cudaStream_t s) {
  constexpr int BN = kWeightGradBlockN;
  using Cfg = TileConfig<BN>;
  auto* kernel = weight_grad_detail::weight_grad_kernel<T, BN, TmaA, TmaB>;
  const int64_t tiles = static_cast<int64_t>(p.sched.num_experts) * ((p.m + kBlockM - 1) / kBlockM) * ((p.n + BN - 1) / BN);
  const int grid = persistent_grid(kernel, Cfg::kSmemBytes, tiles, p.max_ctas);
  kernel<<<grid, kThreads, Cfg::kSmemBytes, s>>>(p, maps, gradient_maps(Elem<T>::kType, p));
  MOEBLAZE_CUDA_CHECK(cudaGetLastError());
}

}  // namespace sm90
}  // namespace gemm
}  // namespace v0
}  // namespace moeblaze
