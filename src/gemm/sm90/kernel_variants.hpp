// The compiled variants of the sm_90a kernels. Each launch template below is instantiated in a
// translation unit of its own per dtype and tile schedule, generated at configure time
// (src/gemm/sm90/kernels.cmake), so that the CUDA build parallelises; the host side
// (grouped_gemm.cu, weight_grad.cu) only declares them. MOEBLAZE_SM90_BF16 and
// MOEBLAZE_SM90_FP16 (0 or 1) say which dtypes this build compiled: a development build may
// leave one out (the CMake option MOEBLAZE_SM90_DTYPES), and then refuses it with a clear reason.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include "gemm/sm90/params.hpp"
#include "util/dtype.hpp"

#ifndef MOEBLAZE_SM90_BF16
#define MOEBLAZE_SM90_BF16 1
#endif
#ifndef MOEBLAZE_SM90_FP16
#define MOEBLAZE_SM90_FP16 1
#endif

namespace moeblaze {
inline namespace v0 {
namespace gemm {
namespace sm90 {

constexpr bool kernels_compiled(DType dt) {
  return (dt == DType::kBF16 && MOEBLAZE_SM90_BF16) || (dt == DType::kF16 && MOEBLAZE_SM90_FP16);
}
constexpr const char* kDtypeLeftOut =
    "this build left out the sm_90a kernels of this dtype (CMake option MOEBLAZE_SM90_DTYPES)";

// The activation epilogue deferred under the next tile's k-blocks for one nonlinearity A (plain:
// ReLU, SiLU) and gating, in a kernel of its own (epilogue_deferred.cuh's DeferredActivation),
// or the kernel's usual epilogues (NoDeferral).
struct NoDeferral {};
template <Activation A, bool Gated>
struct DeferredActivationOf {
  static constexpr Activation kPlain = A;
  static constexpr bool kGated = Gated;
};

// grouped_gemm_kernel.cuh: one persistent grid of the varlen-M grouped GEMM. Variants: BN 128
// ping-pong (kStore, kActivation), BN 128 and 256 cooperative (kStore, kActivation,
// kActivationBackward), each for both B majors; and BN 256 cooperative kActivation deferred
// for ReLU, SiLU and SwiGLU (activation_epilogue_deferred).
template <class T, int BN, Major BMajor, EpilogueKind Epi, bool PingPong, class Defer = NoDeferral>
void launch_grouped_gemm(const GroupedGemmParams& p, const EpilogueParams& e, cudaStream_t s);

// act_backward_kernel.cuh: the dact GEMM with the activation backward on epilogue warps
// (cooperative 128 x 256 tiles), for both B majors.
template <class T, Major BMajor>
void launch_act_backward_warpgroup(const GroupedGemmParams& p, const EpilogueParams& e, cudaStream_t s);

// weight_grad_kernel.cuh: one persistent grid of the varlen-K weight gradients; TmaA / TmaB say
// which operands are read in expert order by TMA (all four combinations).
template <class T, bool TmaA, bool TmaB>
void launch_weight_grad(const WeightGradParams& p, const WeightGradMaps& maps, cudaStream_t s);

// Host helpers of the launches, compiled once (grouped_gemm.cu, weight_grad.cu).
EpilogueMaps epilogue_maps(DType dt, const GroupedGemmParams& p, const EpilogueParams& e);
// The mainloop's TMA maps for BN-wide tiles: the weights', and A's where A is in expert order.
OperandMaps operand_maps(DType dt, const GroupedGemmParams& p, int bn);
EpilogueMaps gradient_maps(DType dt, const WeightGradParams& p);

}  // namespace sm90
}  // namespace gemm
}  // namespace v0
}  // namespace moeblaze
