// Every tuning and engine-choice rule of the sm_90a path in one place, each with the
// measurement it rests on (perf/NOTES.md), and the environment knobs that override them (read
// once per process; docs/integration.md lists them). Host code on plain values: the kernels see
// only what these rules decide, through their parameter structs.
#pragma once

#include <cstdint>

#include "gemm/sm90/params.hpp"

namespace moeblaze {
inline namespace v0 {
namespace gemm {
namespace sm90 {

// ---- engine choice -------------------------------------------------------------------------

// Whether AUTO takes the fused engine over cuBLASLt for a layer it can serve (both engines
// measured in one session on the H100, bf16 fwd+bwd).
bool fused_engine_auto(int64_t hidden, int64_t ffn_hidden, int64_t num_experts, int64_t top_k);

// ---- the fused engine's token windows ------------------------------------------------------

// The automatic window keeps a backward window's row buffers near this many bytes,
constexpr int64_t kWindowBudgetBytes = int64_t{2} << 30;
// never below this many tokens (smaller windows starve the GEMMs of rows),
constexpr int64_t kMinWindowTokens = 1024;
// and a call whose rows fit one window of at most this many bytes runs as one window: windows
// cost 3-9% of a coarse layer's step (per-window GEMM tails and launches, the fp32
// weight-gradient sums), and below this size the bound they buy is not needed.
constexpr int64_t kOneWindowBytes = int64_t{8} << 30;

// ---- the backward's copy of dy and x into expert order -------------------------------------

// Whether the backward copies dy's and x's rows into expert order once per window, into the
// window's dx-parts buffer (free until the dx GEMM, so no workspace is added): dy's rows then
// feed the dact GEMM and dW_down, x's rows dW_gate_up, each by TMA instead of the producer's
// 16-byte cp.async gathers, which hold the weight gradients to ~78% of a dense GEMM against
// ~92% on an expert-order copy. The copy moves 2 d bytes per position and tensor twice; the
// weight gradients it speeds up do 2 d (g h + h) FLOPs per position, so it pays from
// g h + h ~ 4,600 weight-gradient columns. Measured: -3 to -7% fwd+bwd at g h + h =
// 6,144-43,008, +2.5% at 3,072. MOEBLAZE_FUSED_PREGATHER=always|never overrides it.
bool pregather(int64_t gate_up_cols, int64_t ffn_hidden);

// ---- expert parallelism: the exchanges under the local experts' GEMMs ---------------------

// Whether an expert-parallel layer on the NVLink transport, whose local experts run on the
// fused engine, dispatches its x and dy rows on a second stream while the local up and dact
// GEMMs run, each GEMM tile waiting for its own rows (cuda/row_arrival.hpp), instead of before
// them. The GEMMs that wait run on 16 fewer SMs for their whole length, so it pays only where
// the rows are many for the GEMM's work: where a token's rows (the ranks it reaches under
// uniform routing, P (1 - C(E - E/P, k) / C(E, k)), d es bytes each) are at least 2e-4 bytes per
// FLOP of its up GEMM (2 k d g h). Measured on 4 H100s, 16,384 tokens per rank, rows beside /
// before: Qwen3-30B-A3B-like EP 4 (2.9e-4) 10.83 / 11.62 ms, OLMoE-like EP 4 (2.2e-4) 12.68 /
// 13.51; slower at EP 2 (1.2-1.6e-4: +0.4 ms on both) and on Mixtral-like (2.7-3.2e-5:
// +0.7-2.5 ms); with the arrival marks batched (faster senders), still slower at EP 2 (Qwen3-,
// OLMoE-, Mixtral-like 8.977 / 8.858, 11.165 / 10.813, 60.359 / 58.451 ms beside / before).
// Never where the senders' CTAs (send_ctas, EP_COMM_SMS when set) would take more
// than a quarter of the device's SMs from the GEMMs. MOEBLAZE_EP_OVERLAP=0 turns it off, =1 on
// wherever it can run.
bool ep_overlap(int32_t ranks, int64_t num_experts, int64_t top_k, int64_t gate_up_cols, int64_t elem_bytes,
                int32_t send_ctas, int32_t sms);

// CTAs of the overlapped row dispatch when EP_COMM_SMS leaves it to the library: the waiting
// GEMMs run on the other SMs for their whole length, so the dispatch gets few. 16 CTAs of row
// stores moved 136-140 GB/s per GPU (perf/NOTES.md, the NVLink floor): at EP 4 on the
// Qwen3-30B-A3B-like layer its 181 MB take ~1.3 ms, under the ~1.4 ms up GEMM.
constexpr int32_t kEpOverlapCtas = 16;

// Whether such a layer's forward local combine stores each received row's y part straight into
// the window of the rank it returns to, instead of into local rows that a return exchange of 64
// CTAs then moves. Measured on 4 H100s, 16,384 tokens per rank, fwd+bwd with the backward's dx
// parts returned the same way, combine / return exchange: Qwen3-30B-A3B-like EP 2 8.656 /
// 8.869 ms, EP 4 10.779 / 10.930; OLMoE-like EP 2 10.701 / 10.984, EP 4 12.749 / 12.937. (The
// backward now sends its dx parts beside the weight-gradient GEMMs instead.)
// MOEBLAZE_EP_RETURN=kernel turns it off.
bool ep_returns_from_combine();

// ---- the grouped GEMM ----------------------------------------------------------------------

// How the two consumer warpgroups share the work (grouped_gemm.cu): both on every 128 x BN tile
// (cooperative), or each on its own 128 x 128 tiles, alternating their MMAs so that one's
// epilogue overlaps the other's MMAs (ping-pong); or, for the activation backward only, both on
// every 128 x 256 tile with the epilogue on warps of its own under the next tile's MMAs
// (epilogue warps).
enum class ConsumerSchedule : int32_t { kAuto = 0, kCooperative = 1, kPingPong = 2, kEpilogueWarpgroup = 3 };

struct KernelChoice {
  int block_n = 0;  // cooperative: 128 or 256 (0: choose from n); ping-pong: 128
  ConsumerSchedule schedule = ConsumerSchedule::kAuto;
  // Set by choose_kernel, not asked for: the activation epilogue deferred under the next tile's
  // k-blocks (activation_epilogue_deferred's activations, cooperative 128 x 256 tiles, staged
  // and deferred stores allowed, and p.gated matching the activation's gating).
  bool deferred_activation = false;
};

// The kernel a choice resolves to for these parameters and epilogue (every field set).
// Cooperative 128 x 256 tiles wherever the output has 256 columns: ping-pong won on the short-K
// store epilogues (the fine-grained down GEMMs, K = 256..768) only while the cooperative tile's
// epilogue stalled its MMAs; with that epilogue drained by TMA under the next tile, the larger
// tile's reuse wins there too (fwd+bwd 1.5-6% faster at n = 256..768).
// The activation backward never runs ping-pong: on the epilogue warps (128 x 256 tiles) where
// they win (act_backward_in_epilogue says where) or when asked for, unless their 16-byte stores
// cannot address the outputs; else on cooperative tiles with the in-ring epilogue, 256 wide
// from 256 columns, except gated activations at K <= 768, whose 128-wide tiles take half the
// ring for pre, so that the next tile's first k-blocks load under the epilogue (one H200, the
// dact GEMM with the epilogue: (32768, 512, 2048, 16, 4) SwiGLU 1.21-1.25 -> 1.06-1.12 ms,
// (65536, 512, 2048, 4, 1) 0.56-0.57 -> 0.54-0.55, (40960, 768, 256, 128, 8) 0.54-0.60 ->
// 0.45-0.48; 128-wide tiles lose at K = 1024 on (65536, 1024, 4096, 8, 2) and for SiLU).
// MOEBLAZE_SM90_SCHEDULE=cooperative|pingpong|epilogue-warpgroup overrides the schedule.
KernelChoice choose_kernel(const GroupedGemmParams& p, const EpilogueParams& e, KernelChoice kc);

// Whether the dact GEMM (K = d, n = h) carries the activation backward in its epilogue
// (EpilogueKind::kActivationBackward, when unsupported_reason allows it) rather than leave it to
// a separate pass.
// - In the ring (the cooperative tile's epilogue, pre loaded into operand stages): K <= 1024,
//   or K <= 2048 when dy comes in expert order (by TMA); gated activations from h = 2048, or at
//   any h with K <= 768 (128-wide tiles: choose_kernel).
//   Measured: with dy gathered, dropping the pass wins at K = 512 and evens out at K = 1024,
//   and the mainloop loses more than the pass costs at K = 1536-2048 and beyond; with dy's
//   rows in expert order it wins at K = 2048 too (fwd+bwd 1.5-3% at conf4 and conf7, SiLU;
//   1-3% on the paper's SwiGLU layers, h = 2048-8192). A gated 256-wide tile takes the whole
//   ring for pre: at h = 256 (K = 768) it cost more than the pass (1.5%); 128-wide, 0.453-0.476
//   ms against the GEMM and the pass's 0.472-0.488 (one H200, (40960, 768, 256, 128, 8)).
// - On the epilogue warps (gemm/sm90/act_backward_warpgroup.cuh), from h = 256: dy gathered
//   with 1024 < K <= 2048, dy in expert order with K > 2048. Measured on an H200 against the
//   separate pass, SwiGLU fwd+bwd: (32768, 2048, 768, 128, 8) 14.634 / 14.763 ms, (32768, 4096,
//   2048, 64, 4) 34.914 / 35.201, (8192, 7168, 2048, 256, 8) 47.015 / 47.788; slower with dy
//   gathered at K = 4096 ((32768, 4096, 1024, 128, 8) 37.035 / 36.660: the gather on two warps
//   instead of four costs 15% of the mainloop) and at K = 768 ((40960, 768, 256, 128, 8) 3.072
//   / 2.984: the epilogue's traffic outlasts the short mainloop).
// MOEBLAZE_SM90_ACT_BACKWARD=separate|epilogue forces either.
bool act_backward_in_epilogue(const GroupedGemmParams& dact, bool gated);

// Row blocks per raster group of the tile order (gemm/grouped_tiles.hpp): 16, so that a wave of
// the persistent grid keeps both operands' panels in L2. MOEBLAZE_SM90_RASTER=<row blocks>
// overrides it (0: a whole expert).
int32_t raster_group();

// A in expert order is loaded by TMA (else by the producer's cp.async, as gathered rows are):
// MOEBLAZE_SM90_A_LOAD=cp.async turns it off.
bool a_by_tma_allowed();

// Epilogue stores: staged through shared memory and stored by TMA where the tile allows it, and
// for the store epilogue deferred under the next tile's MMAs (10-43% faster GEMMs, 7-12% faster
// fwd+bwd). MOEBLAZE_SM90_EPILOGUE=registers turns staging off, =staged keeps staging without
// deferring; MOEBLAZE_SANITIZER_INIT_GEMM_OUTPUTS=1 (a compute-sanitizer initcheck aid) stores
// from registers too.
bool staged_epilogue_allowed();
bool deferred_epilogue_allowed();

// Top-1 layers: the down GEMM stores y, and the dx GEMM dx, straight at their tokens' rows
// (EpilogueParams::c_row, from registers), where the combine would only copy each token's one
// row: no combine kernel (its read and write of L d elements) and no rows in between, for an
// epilogue that stores from registers instead of by deferred TMA boxes. Prediction and
// measurement: perf/NOTES.md. MOEBLAZE_FUSED_TOKEN_ORDER_STORES=0 keeps the combine.
bool token_order_stores_allowed();

// The activation epilogue deferred too (its act computed from the kept pre under the next
// tile's k-blocks, gemm/sm90/epilogue_deferred.cuh), on cooperative 128 x 256 tiles, for ReLU,
// SiLU and SwiGLU: their kept pairs and arithmetic fit beside the next tile's accumulators in a
// kernel of their own (GELU's erf does not: it spilled). Up GEMM ms on one H200 (one call, two
// rounds, deferred / staged only): SiLU conf1 0.318, 0.317 / 0.334, 0.334; conf5 0.614, 0.619
// / 0.662, 0.642; conf3 4.291, 4.325 / 4.389, 4.378; SwiGLU (32768, 2048, 768, 128, 8) 2.714,
// 2.751 / 2.890, 2.839; conf2 4.062, 4.036 / 4.217, 4.198; conf1, conf5 and d = 768-1536 within
// 1%. ReLU's up GEMM at conf1 0.287, 0.282 against 0.308, 0.303.
constexpr bool activation_epilogue_deferred(Activation a) {
  return a == Activation::kRelu || a == Activation::kSilu || a == Activation::kSwiglu;
}

}  // namespace sm90
}  // namespace gemm
}  // namespace v0
}  // namespace moeblaze
