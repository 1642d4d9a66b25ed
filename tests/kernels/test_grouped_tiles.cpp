// The grouped GEMM's tile space (gemm/grouped_tiles.hpp) against a brute-force enumeration:
// every (expert, row block, column block) exactly once and in the raster order, tiles inside
// their expert, short last blocks, empty experts skipped, all tokens on one expert, the host
// bound respected, several raster group sizes; random routings from the same generator as the
// plan tests.
#include <algorithm>
#include <random>
#include <tuple>
#include <vector>

#include "gemm/grouped_tiles.hpp"

// cmocka.h defines a fail() macro: include it after the library headers.
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <setjmp.h>
extern "C" {
#include <cmocka.h>
}

using namespace moeblaze::gemm;

namespace {

// Every tile in the expected order: experts in order, each expert's row blocks in groups of
// `group` (the last one shorter; group <= 0: one group), and within a group row blocks fastest,
// then column blocks.
void check(const std::vector<int32_t>& counts, int32_t bm, int32_t nb, int32_t group) {
  const int64_t E = static_cast<int64_t>(counts.size());
  std::vector<int32_t> off(E + 1, 0);
  for (int64_t e = 0; e < E; ++e) off[e + 1] = off[e] + counts[e];
  std::vector<int32_t> prefix(E + 1);
  row_block_prefix(off.data(), E, bm, prefix.data());
  const int64_t tiles = total_tiles(prefix.data(), E, nb);
  // brute force: (expert, row0, rows, col_block) for every tile, in work order
  std::vector<std::tuple<int32_t, int32_t, int32_t, int32_t>> want, got;
  for (int32_t e = 0; e < E; ++e) {
    const int32_t rbs = (counts[e] + bm - 1) / bm, g = group > 0 ? group : std::max(rbs, 1);
    for (int32_t first = 0; first < rbs; first += g)
      for (int32_t c = 0; c < nb; ++c)
        for (int32_t rb = first; rb < std::min(rbs, first + g); ++rb)
          want.emplace_back(e, off[e] + rb * bm, std::min(bm, counts[e] - rb * bm), c);
  }
  assert_int_equal(tiles, static_cast<int64_t>(want.size()));
  assert_true(tiles <= max_tiles(off[E], E, bm, nb));
  for (int64_t w = 0; w < tiles; ++w) {
    const TileCoord t = decode_tile(w, off.data(), prefix.data(), E, bm, nb, group);
    assert_true(t.rows > 0 && t.rows <= bm);
    assert_true(t.row0 >= off[t.expert] && t.row0 + t.rows <= off[t.expert + 1]);  // never crosses an expert
    got.emplace_back(t.expert, t.row0, t.rows, t.col_block);
  }
  assert_true(want == got);
}

void check_groups(const std::vector<int32_t>& counts, int32_t bm, int32_t nb) {
  for (int32_t group : {kRasterRowBlocks, 0, 1, 2, 3, 1000}) check(counts, bm, nb, group);
}

void edges(void**) {
  check_groups({5}, 4, 1);
  check_groups({0, 0, 7, 0}, 4, 3);                // empty experts around one
  check_groups({64, 0, 0, 0, 0, 0, 0, 0}, 64, 2);  // all rows on one expert, exact multiple
  check_groups({1, 1, 1, 1}, 128, 5);
  check_groups({0, 0, 0}, 64, 4);                  // no rows at all
  check_groups({129, 127, 128}, 128, 1);
  check_groups({33 * 128 + 5, 16 * 128, 0, 17 * 128}, 128, 7);  // groups of 16 with a short last one
}

void random_routings(void**) {
  std::mt19937_64 rng(12345);
  for (int rep = 0; rep < 300; ++rep) {
    const int64_t E = 1 + static_cast<int64_t>(rng() % 300);
    std::vector<int32_t> counts(E);
    const bool skewed = rng() % 2;
    for (auto& c : counts) c = static_cast<int32_t>(skewed ? (rng() % 8 == 0 ? rng() % 2000 : 0) : rng() % 300);
    const int32_t bm = static_cast<int32_t>(std::vector<int32_t>{16, 32, 64, 128, 192, 256}[rng() % 6]);
    check(counts, bm, 1 + static_cast<int32_t>(rng() % 9), static_cast<int32_t>(rng() % 20));
  }
}

}  // namespace

int main() {
  const struct CMUnitTest tests[] = {cmocka_unit_test(edges), cmocka_unit_test(random_routings)};
  return cmocka_run_group_tests(tests, nullptr, nullptr);
}
