// Tile shape and shared-memory budget of the sm_90a grouped GEMM, visible to the host (launch,
// workspace sizing) and to the kernel.
#pragma once

#include <cstdint>

#include "util/dtype.hpp"

namespace moeblaze {
inline namespace v0 {
namespace gemm {
namespace sm90 {

constexpr int kBlockM = 128;         // two consumer warpgroups of 64 rows
constexpr int kBlockK = 64;          // one 128-byte swizzle row of bf16/fp16
constexpr int kThreads = 384;        // producer warpgroup + two consumer warpgroups
constexpr int kProducerRegs = 72;    // setmaxnreg split: 128 * 72 + 256 * 216 = 384 * 168 (56 spills the gather loop)
constexpr int kConsumerRegs = 216;
// setmaxnreg moves registers within the block's launch allocation (384 threads x 168, the most
// ptxas gives a 384-thread block of one CTA per SM): a split that asks for more than the
// decreases free never gets them, and the block hangs.
constexpr int kLaunchRegs = 168;
static_assert(kProducerRegs * 128 + kConsumerRegs * 256 <= kLaunchRegs * kThreads, "register split");

// A staging box: 64 rows of 64 bf16/fp16 (128 bytes, swizzled as TMA's SWIZZLE_128B box), two per
// consumer warpgroup so one is filled while the other's TMA store reads it.
constexpr int kStagingBoxBytes = 64 * 128;
constexpr int kStagingBoxes = 4;

// The producer hands each tile's coordinates to the consumers through a ring of this many
// 16-byte slots (gemm/sm90/mainloop.cuh). A consumer reads its tile's slot at any time before it
// starts its next tile; the producer rewrites the slot kTileSlots tiles later, after waiting for
// the release of the stage kStages iterations earlier, which belongs to that next tile or a later
// one as long as kTileSlots - 1 >= kStages (every tile has at least one k-block).
constexpr int kTileSlots = 8;
constexpr int kTileSlotBytes = 16;

// Output columns a tile covers: BN, or BN/2 of each half when gated (gate and up columns
// side by side); and the column blocks of an n-column problem.
MOEBLAZE_HD int32_t tile_columns(int32_t gated, int bn) { return gated ? bn / 2 : bn; }
MOEBLAZE_HD int32_t column_blocks(int32_t n, int32_t gated, int bn) {
  return (n + tile_columns(gated, bn) - 1) / tile_columns(gated, bn);
}

// Operand stages per tile shape: 192 KB of operands either way.
MOEBLAZE_HD constexpr int default_stages(int bn) { return bn == 256 ? 4 : 6; }

template <int BN, int Stages = default_stages(BN), int StagingBytes = kStagingBoxes * kStagingBoxBytes>
struct TileConfig {
  static_assert(BN == 128 || BN == 256, "block_n is 128 or 256");
  static constexpr int kBlockN = BN;
  static constexpr int kABytes = kBlockM * kBlockK * 2;  // 16 KB
  static constexpr int kBBytes = BN * kBlockK * 2;       // 16 or 32 KB
  static constexpr int kStageBytes = kABytes + kBBytes;
  static constexpr int kStages = Stages;
  // The epilogue's staging (gemm/sm90/epilogue_tma.cuh): by default two 64 x 64 boxes per
  // consumer warpgroup, 32 KB; the epilogue warps' whole tile (ActBackwardWarpgroupConfig).
  static constexpr int kStagingBytes = StagingBytes;
  // + 1 KB to align the stages to the 1024-byte swizzle atom, + the stage barriers, the two
  // ping-pong turn barriers, the two barriers of the epilogue hand-off and the tile slots (the
  // default configurations: 230,624 bytes of the 232,448 a block may have).
  static constexpr int kSmemBytes =
      kStages * kStageBytes + kStagingBytes + 1024 + 2 * kStages * 8 + 2 * 8 + 2 * 8 + kTileSlots * kTileSlotBytes;
  static_assert(kTileSlots - 1 >= kStages, "a tile slot must outlive its readers' tile");
  static_assert(kSmemBytes <= 232448, "more shared memory than a block may have");
};

// The activation-backward dact GEMM (cooperative tiles, gemm/sm90/epilogue_act_backward.cuh):
// after a tile's k-blocks the producer loads the tile's saved pre into further ring stages of
// four 64 x 64 boxes each (32 KB of a stage), which the epilogue reads, overwrites with dpre and
// stores from: 128 columns of the tile's 128 rows per stage, or, gated, 64 columns of gate and
// up. Its dg partial sums come one per row and kActBackwardBlockN columns.
constexpr int kActBackwardBlockN = 128;
constexpr int kPreBoxBytes = 64 * 128;  // 64 rows x 64 columns of bf16/fp16
MOEBLAZE_HD constexpr int pre_stages(int bn, bool gated) { return gated ? bn / 64 : bn / kActBackwardBlockN; }
static_assert(4 * kPreBoxBytes <= TileConfig<128>::kStageBytes, "a pre stage's boxes fit an operand stage");
MOEBLAZE_HD int32_t act_backward_dg_parts(int64_t h) { return column_blocks(static_cast<int32_t>(h), 0, kActBackwardBlockN); }

// The activation backward on epilogue warps (gemm/sm90/act_backward_warpgroup.cuh): the first
// warpgroup's last two warps compute a tile's activation backward from its dact, which the
// consumers hand over in shared memory (the staging area: 128 x 256 of bf16/fp16, 64 KB) before
// they go on to the next tile's MMAs; its first two warps produce. Three operand stages make
// room for it (the gathered dact mainloop loses nothing at three stages where K >= 2048:
// perf/NOTES.md). A fourth warpgroup cannot be had: at 512 threads a thread may start with 128
// registers, and ptxas then refuses the m64n256 wgmma (it needs ~154 whatever setmaxnreg later
// grants). Every warp keeps the 168 registers a 384-thread block starts with.
constexpr int kActBackwardWarpgroupBlockN = 256;
using ActBackwardWarpgroupConfig = TileConfig<kActBackwardWarpgroupBlockN, 3, kBlockM * kActBackwardWarpgroupBlockN * 2>;
constexpr int kActBackwardProducerThreads = 64;  // warps 0-1
constexpr int kActBackwardEpilogueThreads = 128 - kActBackwardProducerThreads;  // warps 2-3

}  // namespace sm90
}  // namespace gemm
}  // namespace v0
}  // namespace moeblaze
