// The tile space of a grouped GEMM over the routing plan's expert ranges, shared by the host
// (sizing, tests) and the persistent device scheduler of the fused engine. Expert e owns rows
// [offsets[e], offsets[e+1]) of the gathered operand; its tiles are ceil(rows_e / block_m)
// row blocks times col_blocks column blocks. Tiles never cross an expert: the last row block of
// an expert is short and its rows past the expert's end are masked, not padded (the layer is
// dropless and unpadded). The only input is the device array of offsets: no host copy.
//
// The prefix counts row blocks, not tiles, so one prefix serves every GEMM of a call that
// shares block_m, whatever its column-block count.
#pragma once

#include <cstdint>

#include "util/dtype.hpp"

namespace moeblaze {
inline namespace v0 {
namespace gemm {

struct TileCoord {
  int32_t expert;     // e
  int32_t row0;       // first row (position in expert order) of the tile
  int32_t rows;       // rows of the tile that belong to e, in (0, block_m]
  int32_t col_block;  // column block index, in [0, col_blocks)
};

MOEBLAZE_HD int32_t row_blocks(int32_t rows, int32_t block_m) { return (rows + block_m - 1) / block_m; }

// prefix[e] = row blocks of experts before e, e in [0, E]; prefix[E] is the total. Serial (host,
// tests); the device computes the same numbers with a block scan (gemm/sm90/schedule).
MOEBLAZE_HD void row_block_prefix(const int32_t* offsets, int64_t num_experts, int32_t block_m, int32_t* prefix) {
  int32_t total = 0;
  for (int64_t e = 0; e < num_experts; ++e) {
    prefix[e] = total;
    total += row_blocks(offsets[e + 1] - offsets[e], block_m);
  }
  prefix[num_experts] = total;
}

// Work items of a GEMM with col_blocks column blocks.
MOEBLAZE_HD int64_t total_tiles(const int32_t* prefix, int64_t num_experts, int32_t col_blocks) {
  return static_cast<int64_t>(prefix[num_experts]) * col_blocks;
}

// Row blocks per raster group (expert_tile): a persistent grid's wave of ~132 consecutive work
// items then covers a few groups of 16 row blocks by ~8 column blocks, so both operands' panels
// stay in L2 (measured in perf/NOTES.md). Row blocks fastest over a whole expert instead made a
// wave sweep all of a coarse expert's rows for one or two column blocks: an A panel larger than
// L2 (conf4's down GEMM: 128 MB per expert) was read from DRAM once per column block.
constexpr int32_t kRasterRowBlocks = 16;

// The tile of work item `work` once its expert e is known (the last expert whose items start at
// or before it; decode_tile below, or the device's warp-wide search). Within the expert, its row
// blocks form groups of `group` (the last one shorter; group <= 0: one group of all of them);
// a group's items are contiguous, and within a group row blocks vary fastest, then column blocks.
MOEBLAZE_HD TileCoord expert_tile(int64_t work, int32_t e, const int32_t* offsets, const int32_t* prefix,
                                  int32_t block_m, int32_t col_blocks, int32_t group = kRasterRowBlocks) {
  const int32_t rows_e = offsets[e + 1] - offsets[e];
  const int64_t local = work - static_cast<int64_t>(prefix[e]) * col_blocks;
  const int32_t rbs = row_blocks(rows_e, block_m);
  const int32_t g = group > 0 && group < rbs ? group : rbs;
  const int64_t group_items = static_cast<int64_t>(g) * col_blocks;
  const int32_t first = static_cast<int32_t>(local / group_items) * g;  // the group's first row block
  const int32_t size = rbs - first < g ? rbs - first : g;
  const int64_t within = local - static_cast<int64_t>(first) * col_blocks;
  const int32_t rb = first + static_cast<int32_t>(within % size);
  TileCoord t;
  t.expert = e;
  t.col_block = static_cast<int32_t>(within / size);
  t.row0 = offsets[e] + rb * block_m;
  t.rows = rows_e - rb * block_m < block_m ? rows_e - rb * block_m : block_m;
  return t;
}

// The tile of work item `work` in [0, total_tiles). Expert e owns items
// [prefix[e] * col_blocks, prefix[e+1] * col_blocks), in expert_tile's order.
MOEBLAZE_HD TileCoord decode_tile(int64_t work, const int32_t* offsets, const int32_t* prefix, int64_t num_experts,
                                  int32_t block_m, int32_t col_blocks, int32_t group = kRasterRowBlocks) {
  int64_t lo = 0, hi = num_experts;  // the last e with prefix[e] * col_blocks <= work (skips empty experts)
  while (hi - lo > 1) {
    const int64_t mid = (lo + hi) / 2;
    if (static_cast<int64_t>(prefix[mid]) * col_blocks <= work) lo = mid;
    else hi = mid;
  }
  return expert_tile(work, static_cast<int32_t>(lo), offsets, prefix, block_m, col_blocks, group);
}

// Host bound on the tile count for sizing: at most ceil(rows / block_m) + E row blocks.
constexpr int64_t max_tiles(int64_t total_rows, int64_t num_experts, int32_t block_m, int32_t col_blocks) {
  return ((total_rows + block_m - 1) / block_m + num_experts) * col_blocks;
}

}  // namespace gemm
}  // namespace v0
}  // namespace moeblaze
