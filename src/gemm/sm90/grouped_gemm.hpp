// Host interface of the sm_90a grouped GEMM (gemm/sm90/params.hpp says what it computes).
// Everything is stream-ordered and sync-free: the expert offsets stay on the device.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

#include "gemm/sm90/heuristics.hpp"
#include "gemm/sm90/params.hpp"
#include "util/dtype.hpp"

namespace moeblaze {
inline namespace v0 {
namespace gemm {
namespace sm90 {

// Whether this build compiled the sm_90a kernels of dtype dt (kernel_variants.hpp).
bool kernels_built(DType dt);

// Workspace of a schedule for E experts (two int32 arrays of E + 1), 256-byte aligned.
size_t schedule_bytes(int64_t num_experts);

// Sanitises offsets[0..E] into [0, m_total], non-decreasing, and writes the row-block prefix of
// block_m = kBlockM rows, into `workspace` (schedule_bytes). One small launch.
Schedule make_schedule(const int32_t* offsets, int64_t num_experts, int64_t m_total, void* workspace, cudaStream_t s);

// Why this GEMM cannot run here, or nullptr. The kernel needs: dtype bf16 or fp16; K, n, lda,
// ldb (and the epilogue's leading dimensions) multiples of 8 elements; 16-byte aligned a, b.
const char* unsupported_reason(DType dt, const GroupedGemmParams& p, const EpilogueParams& e);

// Launches one persistent grid on the current device.
void grouped_gemm(DType dt, const GroupedGemmParams& p, const EpilogueParams& e, KernelChoice kc, cudaStream_t s);

}  // namespace sm90
}  // namespace gemm
}  // namespace v0
}  // namespace moeblaze
