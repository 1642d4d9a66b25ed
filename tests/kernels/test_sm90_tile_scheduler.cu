// The sm_90a persistent tile scheduler (gemm/sm90/tile_scheduler.cuh) on its own:
//   - the walk: over grids of 1 to 200 CTAs and 0 to 1,000 work items, every item is visited
//     exactly once by each warp role, at its CTA's index j, and the two ping-pong walks
//     (0, 2) and (1, 2) split a CTA's walk between them;
//   - GroupedTiles' warp-wide decode against the host's decode_tile (gemm/grouped_tiles.hpp) on
//     random routings with empty experts, 1 to 1,000 experts, raster groups of 16 and whole experts;
//   - WeightGradTiles: every (expert, row block, column block) exactly once, experts slowest.
// Exits 77 (skipped) without an sm_90 GPU.
#include "gemm/sm90/tile_scheduler.cuh"

#include "grouped_gemm_problem.cuh"

#include <cstdio>
#include <cstdlib>
#include <random>
#include <vector>

#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <setjmp.h>
extern "C" {
#include <cmocka.h>
}

using namespace moeblaze;
namespace sm90 = moeblaze::gemm::sm90;

namespace {


template <class T>
T* to_device(const std::vector<T>& h) {
  T* d = nullptr;
  GGP_CK(cudaMalloc(&d, std::max<size_t>(1, h.size()) * sizeof(T)));
  if (!h.empty()) GGP_CK(cudaMemcpy(d, h.data(), h.size() * sizeof(T), cudaMemcpyHostToDevice));
  return d;
}
template <class T>
std::vector<T> to_host(const T* d, size_t n) {
  std::vector<T> h(n);
  if (n) GGP_CK(cudaMemcpy(h.data(), d, n * sizeof(T), cudaMemcpyDeviceToHost));
  return h;
}

// A tile space of `n` items that decode to themselves.
struct CountTiles {
  int64_t n;
  __device__ int64_t count() const { return n; }
  __device__ int64_t decode(int64_t w) const { return w; }
};

// Role r of 3 (warps 0, 1, 2 of the block): the whole walk, the ping-pong walk (0, 2), and
// (1, 2). visits[r][item] counts the visits; bad counts items whose j or decode is wrong.
__global__ void walk_kernel(int64_t n, int* visits, int* bad) {
  const int role = threadIdx.x / 32;
  if (threadIdx.x % 32) return;
  const sm90::PersistentTileScheduler<CountTiles> sched(CountTiles{n});
  const uint32_t first = role == 2 ? 1 : 0, step = role == 0 ? 1 : 2;
  uint32_t expect_j = first;
  for (const sm90::TileWork w : sched.walk(first, step)) {
    const bool ok = w.j == expect_j && w.item == blockIdx.x + static_cast<int64_t>(w.j) * gridDim.x &&
                    sched.decode(w) == w.item && w.item < n;
    if (!ok) atomicAdd(bad, 1);
    if (w.item >= 0 && w.item < n) atomicAdd(&visits[(role == 0 ? 0 : 1) * n + w.item], 1);
    expect_j += step;
  }
}

void walk_visits_every_item_once(void**) {
  int checked = 0;
  for (int grid : {1, 3, 132, 200})
    for (int64_t n : {0, 1, 131, 132, 133, 1000}) {
      int *visits = nullptr, *bad = nullptr;
      GGP_CK(cudaMalloc(&visits, std::max<int64_t>(1, 2 * n) * sizeof(int)));
      GGP_CK(cudaMalloc(&bad, sizeof(int)));
      GGP_CK(cudaMemset(visits, 0, std::max<int64_t>(1, 2 * n) * sizeof(int)));
      GGP_CK(cudaMemset(bad, 0, sizeof(int)));
      walk_kernel<<<grid, 96>>>(n, visits, bad);
      GGP_CK(cudaDeviceSynchronize());
      const std::vector<int> v = to_host(visits, 2 * n);
      assert_int_equal(to_host(bad, 1)[0], 0);
      for (int64_t i = 0; i < 2 * n; ++i) assert_int_equal(v[i], 1);  // whole walk; the two halves together
      checked += static_cast<int>(n);
      GGP_CK(cudaFree(visits));
      GGP_CK(cudaFree(bad));
    }
  std::printf("walks: %d items over 24 grid/size pairs, each visited once per role\n", checked);
}

// Every work item decoded by one warp; lane 0 writes the coordinates (lanes must agree).
__global__ void grouped_decode_kernel(sm90::Schedule sc, int32_t col_blocks, gemm::TileCoord* out, int64_t* total,
                                      int* disagree) {
  const sm90::PersistentTileScheduler<sm90::GroupedTiles> sched(sm90::GroupedTiles{sc, col_blocks});
  const int warps = blockDim.x / 32, warp = threadIdx.x / 32;
  if (blockIdx.x == 0 && threadIdx.x == 0) *total = sched.total();
  for (int64_t w = static_cast<int64_t>(blockIdx.x) * warps + warp; w < sched.total();
       w += static_cast<int64_t>(gridDim.x) * warps) {
    const gemm::TileCoord t = sched.decode(sm90::TileWork{w, 0});
    const int32_t e0 = __shfl_sync(0xffffffffu, t.expert, 0), r0 = __shfl_sync(0xffffffffu, t.row0, 0);
    if (e0 != t.expert || r0 != t.row0) atomicAdd(disagree, 1);
    if (threadIdx.x % 32 == 0) out[w] = t;
  }
}

void grouped_decode_matches_host(void**) {
  std::mt19937_64 rng(20261126);
  int cases = 0;
  int64_t items = 0;
  for (int32_t E : {1, 2, 31, 32, 33, 128, 257, 1000})
    for (int32_t group : {gemm::kRasterRowBlocks, 0})
      for (int32_t cb : {1, 3, 8}) {
        // Rows per expert: random, a quarter of the experts empty, now and then one large.
        std::vector<int32_t> off(E + 1, 0);
        for (int32_t e = 0; e < E; ++e) {
          const uint64_t r = rng();
          const int32_t rows = r % 4 == 0 ? 0 : r % 17 == 1 ? static_cast<int32_t>(rng() % 5000) : static_cast<int32_t>(rng() % 300);
          off[e + 1] = off[e] + rows;
        }
        std::vector<int32_t> prefix(E + 1);
        gemm::row_block_prefix(off.data(), E, sm90::kBlockM, prefix.data());
        int32_t *d_off = to_device(off), *d_prefix = to_device(prefix);
        sm90::Schedule sc;
        sc.offsets = d_off;
        sc.rb_prefix = d_prefix;
        sc.num_experts = E;
        sc.m_total = off[E];
        sc.raster_group = group;
        const int64_t total = gemm::total_tiles(prefix.data(), E, cb);
        gemm::TileCoord* d_out = nullptr;
        int64_t* d_total = nullptr;
        int* d_disagree = nullptr;
        GGP_CK(cudaMalloc(&d_out, std::max<int64_t>(1, total) * sizeof(gemm::TileCoord)));
        GGP_CK(cudaMalloc(&d_total, sizeof(int64_t)));
        GGP_CK(cudaMalloc(&d_disagree, sizeof(int)));
        GGP_CK(cudaMemset(d_disagree, 0, sizeof(int)));
        grouped_decode_kernel<<<66, 256>>>(sc, cb, d_out, d_total, d_disagree);
        GGP_CK(cudaDeviceSynchronize());
        assert_int_equal(to_host(d_total, 1)[0], total);
        assert_int_equal(to_host(d_disagree, 1)[0], 0);
        const std::vector<gemm::TileCoord> got = to_host(d_out, total);
        for (int64_t w = 0; w < total; ++w) {
          const gemm::TileCoord want = gemm::decode_tile(w, off.data(), prefix.data(), E, sm90::kBlockM, cb, group);
          assert_int_equal(got[w].expert, want.expert);
          assert_int_equal(got[w].row0, want.row0);
          assert_int_equal(got[w].rows, want.rows);
          assert_int_equal(got[w].col_block, want.col_block);
        }
        items += total;
        ++cases;
        GGP_CK(cudaFree(d_off));
        GGP_CK(cudaFree(d_prefix));
        GGP_CK(cudaFree(d_out));
        GGP_CK(cudaFree(d_total));
        GGP_CK(cudaFree(d_disagree));
      }
  std::printf("grouped decode: %d routings, %lld tiles equal to the host's decode_tile\n", cases,
              static_cast<long long>(items));
}

constexpr int kGradBlockN = 256;

__global__ void weight_grad_decode_kernel(const int32_t* offsets, int32_t E, int32_t m, int32_t n, sm90::WeightGradTile* out,
                                          int* kblocks) {
  const sm90::PersistentTileScheduler<sm90::WeightGradTiles<kGradBlockN>> sched({offsets, E, m, n});
  if (threadIdx.x) return;
  for (const sm90::TileWork w : sched.walk()) {
    out[w.item] = sched.decode(w);
    kblocks[w.item] = out[w.item].k_blocks();
  }
}

void weight_grad_tiles(void**) {
  const int32_t E = 37, m = 392, n = 776;  // 4 row blocks (the last short), 4 column blocks
  std::vector<int32_t> off(E + 1, 0);
  std::mt19937_64 rng(7);
  for (int32_t e = 0; e < E; ++e) off[e + 1] = off[e] + (e % 5 == 0 ? 0 : static_cast<int32_t>(rng() % 700));
  const int32_t mb = (m + sm90::kBlockM - 1) / sm90::kBlockM, nb = (n + kGradBlockN - 1) / kGradBlockN;
  const int64_t total = static_cast<int64_t>(E) * mb * nb;
  int32_t* d_off = to_device(off);
  sm90::WeightGradTile* d_out = nullptr;
  int* d_kb = nullptr;
  GGP_CK(cudaMalloc(&d_out, total * sizeof(sm90::WeightGradTile)));
  GGP_CK(cudaMalloc(&d_kb, total * sizeof(int)));
  weight_grad_decode_kernel<<<13, 32>>>(d_off, E, m, n, d_out, d_kb);
  GGP_CK(cudaDeviceSynchronize());
  const std::vector<sm90::WeightGradTile> got = to_host(d_out, total);
  const std::vector<int> kb = to_host(d_kb, total);
  // Expert slowest, then column blocks, row blocks fastest: item (e, cb, rb).
  int64_t w = 0;
  for (int32_t e = 0; e < E; ++e)
    for (int32_t c = 0; c < nb; ++c)
      for (int32_t r = 0; r < mb; ++r, ++w) {
        assert_int_equal(got[w].expert, e);
        assert_int_equal(got[w].m0, r * sm90::kBlockM);
        assert_int_equal(got[w].n0, c * kGradBlockN);
        assert_int_equal(got[w].p0, off[e]);
        assert_int_equal(got[w].p1, off[e + 1]);
        assert_int_equal(kb[w], (off[e + 1] - off[e] + sm90::kBlockK - 1) / sm90::kBlockK);
      }
  std::printf("weight-gradient tiles: %lld decoded in order\n", static_cast<long long>(total));
  GGP_CK(cudaFree(d_off));
  GGP_CK(cudaFree(d_out));
  GGP_CK(cudaFree(d_kb));
}

}  // namespace

int main() {
  ggp::skip_without_sm90();
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(walk_visits_every_item_once),
      cmocka_unit_test(grouped_decode_matches_host),
      cmocka_unit_test(weight_grad_tiles),
  };
  return cmocka_run_group_tests(tests, nullptr, nullptr);
}
