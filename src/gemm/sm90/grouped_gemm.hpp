// Host interface of the sm_90a grouped GEMM (gemm/sm90/params.hpp says what it computes).
// Everything is stream-ordered and sync-free: the expert offsets stay on the device.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

#include "gemm/sm90/params.hpp"
#include "util/dtype.hpp"

namespace moeblaze {
inline namespace v0 {
namespace gemm {
namespace sm90 {

// Workspace of a schedule for E experts (two int32 arrays of E + 1), 256-byte aligned.
size_t schedule_bytes(int64_t num_experts);

// Sanitises offsets[0..E] into [0, m_total], non-decreasing, and writes the row-block prefix of
// block_m = kBlockM rows, into `workspace` (schedule_bytes). One small launch.
Schedule make_schedule(const int32_t* offsets, int64_t num_experts, int64_t m_total, void* workspace, cudaStream_t s);

// Why this GEMM cannot run here, or nullptr. The kernel needs: dtype bf16 or fp16; K, n, lda,
// ldb (and the epilogue's leading dimensions) multiples of 8 elements; 16-byte aligned a, b.
const char* unsupported_reason(DType dt, const GroupedGemmParams& p, const EpilogueParams& e);

// How the two consumer warpgroups share the work (grouped_gemm.cu): both on every 128 x BN tile
// (cooperative), or each on its own 128 x 128 tiles, alternating their MMAs so that one's
// epilogue overlaps the other's MMAs (ping-pong).
enum class ConsumerSchedule : int32_t { kAuto = 0, kCooperative = 1, kPingPong = 2 };

struct KernelChoice {
  int block_n = 0;  // cooperative: 128 or 256 (0: choose from n); ping-pong: 128
  ConsumerSchedule schedule = ConsumerSchedule::kAuto;
};

// The kernel a choice resolves to for these parameters and epilogue (every field set).
KernelChoice choose_kernel(const GroupedGemmParams& p, EpilogueKind epilogue, KernelChoice kc);

// Whether the dact GEMM dact (K = d, n = h) should carry the activation backward in its epilogue
// (EpilogueKind::kActivationBackward, when unsupported_reason allows it) rather than leave it to
// a separate pass: for K <= 1024, or K <= 2048 when dy comes in expert order (by TMA); gated
// activations only from h = 2048. Measured (perf/NOTES.md): with dy
// gathered, dropping the pass wins at K = 512 and evens out at K = 1024, and the mainloop loses
// more than the pass costs at K = 1536-2048 and beyond (plain and gated alike); with dy's rows
// copied into expert order it wins at K = 2048 too (fwd+bwd 1.5-3% at conf4 and conf7,
// SiLU; 1-3% on the paper's SwiGLU layers, h = 2048-8192). A gated tile takes twice the pre
// stages: at h = 256 (SonicMoE's n = 256, K = 768) they cost more than the pass (1.5%); h = 512
// and 1024 were not measured and keep the pass. MOEBLAZE_SM90_ACT_BACKWARD=separate|epilogue
// forces either (a measurement knob, not part of the API).
bool act_backward_in_epilogue(const GroupedGemmParams& dact, bool gated);

// Launches one persistent grid on the current device.
void grouped_gemm(DType dt, const GroupedGemmParams& p, const EpilogueParams& e, KernelChoice kc, cudaStream_t s);

}  // namespace sm90
}  // namespace gemm
}  // namespace v0
}  // namespace moeblaze
