// The sm_90a weight-gradient GEMM's host side: the refusals, the gradient's store map and the
// dispatch to the compiled kernel variants (weight_grad_kernel.cuh). Compiled for sm_90a only.
#include "gemm/sm90/heuristics.hpp"
#include "gemm/sm90/kernel_variants.hpp"
#include "gemm/sm90/launch.cuh"
#include "gemm/sm90/tensor_map.hpp"
#include "gemm/sm90/weight_grad.hpp"
#include "util/error.hpp"

namespace moeblaze {
inline namespace v0 {
namespace gemm {
namespace sm90 {
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

namespace {

// An operand in expert order comes by TMA; a gathered one (or an empty one) by cp.async.
template <class T>
void dispatch(DType dt, const WeightGradParams& p, cudaStream_t s) {
  WeightGradMaps maps;
  const bool tma_a = !p.a_index && p.a_rows > 0, tma_b = !p.b_index && p.b_rows > 0;
  if (tma_a) maps.a = rows_tensor_map(dt, p.a, p.a_rows, p.m, p.lda);
  if (tma_b) maps.b = rows_tensor_map(dt, p.b, p.b_rows, p.n, p.ldb);
  if (!tma_a && tma_b) launch_weight_grad<T, false, true>(p, maps, s);  // the layer's case: x or dy gathered
  else if (!tma_a) launch_weight_grad<T, false, false>(p, maps, s);
  else if (tma_b) launch_weight_grad<T, true, true>(p, maps, s);
  else launch_weight_grad<T, true, false>(p, maps, s);
}

}  // namespace

const char* weight_grad_unsupported_reason(DType dt, const WeightGradParams& p) {
  if (dt != DType::kBF16 && dt != DType::kF16) return "the sm_90a weight-gradient GEMM takes bf16 or fp16 operands";
  if (!kernels_compiled(dt)) return kDtypeLeftOut;
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
#if MOEBLAZE_SM90_BF16
  if (dt == DType::kBF16) dispatch<__nv_bfloat16>(dt, p, s);
#endif
#if MOEBLAZE_SM90_FP16
  if (dt == DType::kF16) dispatch<__half>(dt, p, s);
#endif
}

}  // namespace sm90
}  // namespace gemm
}  // namespace v0
}  // namespace moeblaze
