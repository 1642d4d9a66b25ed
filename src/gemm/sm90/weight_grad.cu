// The sm_90a weight-gradient GEMM: the grouped GEMM's ring, consumers and register split, with
// the varlen-K producer (mainloop_k.cuh) and the weight-gradient epilogue. Compiled for sm_90a only.
#include "gemm/sm90/epilogue.cuh"
#include "gemm/sm90/heuristics.hpp"
#include "gemm/sm90/launch.cuh"
#include "gemm/sm90/mainloop_k.cuh"
#include "gemm/sm90/tensor_map.hpp"
#include "gemm/sm90/weight_grad.hpp"
#include "util/error.hpp"
#include "util/vec8.cuh"

namespace moeblaze {
inline namespace v0 {
namespace gemm {
namespace sm90 {
namespace {

constexpr int kWeightGradBlockN = 256;

template <class T, int BN, bool TmaA, bool TmaB>
__global__ void __launch_bounds__(kThreads, 1) weight_grad_kernel(const __grid_constant__ WeightGradParams p,
                                                                      const __grid_constant__ WeightGradMaps maps,
                                                                      const __grid_constant__ EpilogueMaps out_maps) {
#if defined(__CUDA_ARCH__) && (__CUDA_ARCH__ >= 900)
  extern __shared__ __align__(1024) uint8_t smem_raw[];
  // full[s]: every producer thread's cp.async arrival + thread 0's (with the TMA bytes, if any).
  const auto ring = init_ring<TileConfig<BN>>(smem_raw, 129);
  const int wg = threadIdx.x / 128;
  if (wg == 0) {
    regs_dealloc<kProducerRegs>();
    produce_weight_grad<T, BN, TmaA, TmaB>(p, maps, ring);
  } else {
    regs_alloc<kConsumerRegs>();
    TileStore ts = TileStore::make(ring.staging, wg - 1);
    const int32_t mb = (p.m + kBlockM - 1) / kBlockM, nb = (p.n + BN - 1) / BN;
    const int64_t total = static_cast<int64_t>(p.sched.num_experts) * mb * nb;
    uint32_t it = 0;
    float acc[1][BN / 2];
    for (int64_t w = blockIdx.x; w < total; w += gridDim.x) {
      const WeightGradTile tile = decode_weight_grad_tile<BN>(p, w);
      const int num_kb = weight_grad_k_blocks(tile);
      consume_tile<T, BN, Major::kMN, Major::kMN>(ring, wg - 1, num_kb, it, acc);
      epilogue_weight_grad<T, BN>(p, out_maps, ts, tile.expert, tile.m0, tile.n0, num_kb, wg - 1, acc[0]);
    }
    ts.drain();
  }
#endif
}

// The epilogue's TMA store map where TMA can address the output; else it stores from registers.
// A window that keeps fp32 sums (acc32_store) stages them to [E][m][n] fp32; otherwise the
// gradient itself, [E][m][n] (transposed: [E][n][m]) with row stride ldc, unless accumulating
// onto it (a read-modify-write of the caller's gradient stays with the registers).
EpilogueMaps gradient_maps(DType dt, const WeightGradParams& p) {
  EpilogueMaps m;
  if (!staged_epilogue_allowed()) return m;
  if (p.acc32 && p.acc32_store) {
    m.enabled = expert_matrices_tensor_map(DType::kF32, p.acc32, p.sched.num_experts, p.m, p.n, p.n,
                                           static_cast<int64_t>(p.m) * p.n, &m.out);
    return m;
  }
  if (p.accumulate) return m;
  const int64_t rows = p.c_transposed ? p.n : p.m, cols = p.c_transposed ? p.m : p.n;
  m.enabled = expert_matrices_tensor_map(dt, p.c, p.sched.num_experts, rows, cols, p.ldc, p.c_expert_stride, &m.out);
  return m;
}

template <class T, bool TmaA, bool TmaB>
void launch(const WeightGradParams& p, const WeightGradMaps& maps, cudaStream_t s) {
  constexpr int BN = kWeightGradBlockN;
  using Cfg = TileConfig<BN>;
  auto* kernel = weight_grad_kernel<T, BN, TmaA, TmaB>;
  const int64_t tiles = static_cast<int64_t>(p.sched.num_experts) * ((p.m + kBlockM - 1) / kBlockM) * ((p.n + BN - 1) / BN);
  const int grid = persistent_grid(kernel, Cfg::kSmemBytes, tiles);
  kernel<<<grid, kThreads, Cfg::kSmemBytes, s>>>(p, maps, gradient_maps(Elem<T>::kType, p));
  MOEBLAZE_CUDA_CHECK(cudaGetLastError());
}

// An operand in expert order comes by TMA; a gathered one (or an empty one) by cp.async.
template <class T>
void dispatch(const WeightGradParams& p, cudaStream_t s) {
  WeightGradMaps maps;
  const bool tma_a = !p.a_index && p.a_rows > 0, tma_b = !p.b_index && p.b_rows > 0;
  if (tma_a) maps.a = rows_tensor_map(Elem<T>::kType, p.a, p.a_rows, p.m, p.lda);
  if (tma_b) maps.b = rows_tensor_map(Elem<T>::kType, p.b, p.b_rows, p.n, p.ldb);
  if (!tma_a && tma_b) launch<T, false, true>(p, maps, s);  // the layer's case: x or dy gathered
  else if (!tma_a) launch<T, false, false>(p, maps, s);
  else if (tma_b) launch<T, true, true>(p, maps, s);
  else launch<T, true, false>(p, maps, s);
}

}  // namespace

const char* weight_grad_unsupported_reason(DType dt, const WeightGradParams& p) {
  if (dt != DType::kBF16 && dt != DType::kF16) return "the sm_90a weight-gradient GEMM takes bf16 or fp16 operands";
  if (p.m <= 0 || p.n <= 0 || p.m % 8 || p.n % 8 || p.lda % 8 || p.ldb % 8)
    return "the gradient's rows and columns and the operands' leading dimensions must be multiples of 8";
  if (!aligned16(p.a) || !aligned16(p.b)) return "operands must be 16-byte aligned";
  const int64_t es = static_cast<int64_t>(dtype_size(dt)), max_stride = int64_t{1} << 40;
  if (p.lda * es >= max_stride || p.ldb * es >= max_stride)  // the operands' TMA maps (tensor_map.cpp)
    return "the operands' leading dimensions must stay below 2^40 bytes";
  if (p.ldc % 2 || p.c_expert_stride % 2 || reinterpret_cast<uintptr_t>(p.c) % 4)
    return "the gradient's strides must be even and the gradient 4-byte aligned";
  if (p.acc32 && reinterpret_cast<uintptr_t>(p.acc32) % 8) return "the fp32 partial sums must be 8-byte aligned";
  return nullptr;
}

void weight_grad(DType dt, const WeightGradParams& p, cudaStream_t s) {
  if (const char* why = weight_grad_unsupported_reason(dt, p)) fail(Status::kNotSupported, "%s", why);
  if (p.sched.num_experts == 0) return;
  if (dt == DType::kBF16) dispatch<__nv_bfloat16>(p, s);
  else dispatch<__half>(p, s);
}

}  // namespace sm90
}  // namespace gemm
}  // namespace v0
}  // namespace moeblaze
