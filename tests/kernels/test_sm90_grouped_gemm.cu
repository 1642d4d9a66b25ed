// The sm_90a grouped GEMM (gemm/sm90) against a naive fp32 reference kernel on fresh random
// operands, outputs poisoned: both B layouts, block_n 128 and 256 and the ping-pong schedule,
// bf16 and fp16, gathered and contiguous A (contiguous A loads by TMA; run under
// MOEBLAZE_SM90_A_LOAD=cp.async for the cp.async path), uniform, skewed and single-expert
// routings with empty experts, n and K multiples of 8 but not of 64, one row, E = 256, every
// activation in the fused epilogue, out-of-range gather indices (zero rows, no stray reads),
// bitwise determinism, the staged (TMA-store) epilogue bitwise equal to the register one, rows
// placed per expert (and hostile placements), a grid capped below the SM count (the same bits),
// gathered rows that another stream stores while the GEMM waits for each (the same bits), and
// rows that never come (the step flagged after the timeout, the kernel finished).
// Exits 77 (skipped) without an sm_90 GPU.
#include "grouped_gemm_problem.cuh"

#include "cuda/row_arrival.cuh"

#include <cstring>
#include <numeric>

#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <setjmp.h>
extern "C" {
#include <cmocka.h>
}

using namespace ggp;
namespace sm90 = moeblaze::gemm::sm90;

namespace {

double tolerance(DType dt) { return dt == DType::kBF16 ? 1e-2 : 2e-3; }

// The kernels under test, as bn codes in the messages: 128 and 256 cooperative, -128 ping-pong.
const int kBlockNs[] = {128, 256, -128};
sm90::KernelChoice kernel_choice(int bn) {
  sm90::KernelChoice kc;
  kc.block_n = bn < 0 ? -bn : bn;
  kc.schedule = bn < 0 ? sm90::ConsumerSchedule::kPingPong : sm90::ConsumerSchedule::kCooperative;
  return kc;
}

// ld_pad: extra columns per output row, which must keep their poison (8: the 16-byte store
// path with padding; 2: an ld that is not a multiple of 8, the pair-store path).
// max_ctas: the persistent grid capped (0: one CTA per SM).
std::vector<uint16_t> run_store(const Problem& P, int bn, bool scaled, Check* c, int64_t ld_pad = 0,
                                int32_t max_ctas = 0) {
  const int64_t ld = P.s.n + ld_pad;
  void* out = alloc_poisoned(P.s.m_total * ld);
  sm90::EpilogueParams e;
  e.kind = sm90::EpilogueKind::kStore;
  e.c = out;
  e.ldc = ld;
  e.row_scale = scaled ? P.d_scale : nullptr;
  sm90::GroupedGemmParams p = P.params();
  p.max_ctas = max_ctas;
  sm90::grouped_gemm(P.dt, p, e, kernel_choice(bn), nullptr);
  GGP_CK(cudaDeviceSynchronize());
  *c = compare(out, P.s.m_total, P.s.n, ld, P.dt, want_store(P, scaled));
  std::vector<uint16_t> bits(std::max<int64_t>(P.s.m_total * ld, 1));
  GGP_CK(cudaMemcpy(bits.data(), out, P.s.m_total * ld * 2, cudaMemcpyDeviceToHost));
  cudaFree(out);
  return bits;
}

void expect_store(const Shape& s, DType dt, int bn, uint64_t seed, bool bad = false) {
  Problem P = make_problem(s, dt, seed, bad);
  Check c;
  run_store(P, bn, seed % 2 == 0, &c);
  if (c.rel_err > tolerance(dt) || c.unwritten || c.clobbered)
    std::printf("store m=%lld E=%d n=%d k=%d gather=%d major=%d skew=%g bn=%d %s: rel %.3g unwritten %lld\n",
                static_cast<long long>(s.m_total), s.E, s.n, s.k, s.gather, static_cast<int>(s.b_major), s.skew, bn,
                dtype_name(dt), c.rel_err, static_cast<long long>(c.unwritten));
  assert_true(c.rel_err <= tolerance(dt));
  assert_int_equal(c.unwritten, 0);
  free_problem(P);
}

const Major kMajors[] = {Major::kMN, Major::kK};
const DType kTypes[] = {DType::kBF16, DType::kF16};

void store_shapes(void**) {
  uint64_t seed = 1;
  for (DType dt : kTypes)
    for (Major mj : kMajors)
      for (int bn : kBlockNs) {
        expect_store({1000, 700, 8, 200, 136, false, true, mj, 0.0}, dt, bn, seed++);       // n, K not multiples of 64
        expect_store({3000, 3000, 16, 264, 520, false, false, mj, 1.2}, dt, bn, seed++);    // skewed, contiguous A
        expect_store({1, 1, 1, 8, 8, false, true, mj, 0.0}, dt, bn, seed++);                // one row, E = 1
        expect_store({2000, 500, 12, 128, 64, false, true, mj, -1.0}, dt, bn, seed++);      // all rows on one expert
        // contiguous A (by TMA): one row; all rows on one expert (its last tile reads past A)
        expect_store({1, 1, 1, 8, 8, false, false, mj, 0.0}, dt, bn, seed++);
        expect_store({2000, 2000, 12, 128, 72, false, false, mj, -1.0}, dt, bn, seed++);
      }
}

void many_experts(void**) {
  expect_store({8192, 1024, 256, 256, 192, false, true, Major::kMN, 0.0}, DType::kBF16, 256, 77);
  expect_store({8192, 1024, 256, 96, 256, false, true, Major::kK, 0.5}, DType::kBF16, 128, 78);
  expect_store({8192, 1024, 256, 136, 200, false, true, Major::kMN, 0.8}, DType::kBF16, -128, 79);
  // contiguous A: most tiles partial, their rows past the expert read the next expert's rows
  expect_store({8192, 8192, 256, 136, 200, false, false, Major::kK, 0.5}, DType::kBF16, 256, 80);
  expect_store({8192, 8192, 256, 256, 136, false, false, Major::kMN, 0.0}, DType::kF16, -128, 81);
}

void bad_indices(void**) {
  expect_store({1000, 300, 4, 128, 128, false, true, Major::kMN, 0.0}, DType::kBF16, 128, 9, true);
  expect_store({1000, 300, 4, 128, 128, false, true, Major::kK, 0.0}, DType::kF16, 256, 10, true);
  expect_store({1000, 300, 4, 128, 128, false, true, Major::kMN, 0.0}, DType::kBF16, -128, 11, true);
}

sm90::EpilogueParams activation_params(Activation a, void* pre, int64_t ld_pre, void* act, int64_t ld_act) {
  sm90::EpilogueParams e;
  e.kind = sm90::EpilogueKind::kActivation;
  e.activation = a;
  e.pre = pre;
  e.ld_pre = ld_pre;
  e.act = act;
  e.ld_act = ld_act;
  return e;
}

// The activation epilogue against the reference; ld_pad as run_store's, on both outputs.
void expect_activation(Activation a, DType dt, int bn, Major mj, uint64_t seed, int64_t ld_pad) {
  const bool gated = is_gated(a);
  Problem P = make_problem({1200, 800, 6, 136, 200, gated, true, mj, 0.7}, dt, seed);
  const int64_t n = P.s.n, nc = P.ncols(), ld_pre = nc + ld_pad, ld_act = n + ld_pad;
  void* pre = alloc_poisoned(P.s.m_total * ld_pre);
  void* act = alloc_poisoned(P.s.m_total * ld_act);
  const sm90::EpilogueParams e = activation_params(a, pre, ld_pre, act, ld_act);
  sm90::grouped_gemm(dt, P.params(), e, kernel_choice(bn), nullptr);
  GGP_CK(cudaDeviceSynchronize());
  std::vector<float> want_pre = reference(P);
  for (auto& v : want_pre) v = round_to(v, dt);
  const Check cp = compare(pre, P.s.m_total, nc, ld_pre, dt, want_pre);
  const Check ca = compare(act, P.s.m_total, n, ld_act, dt, want_act(P, a));
  if (cp.rel_err > tolerance(dt) || ca.rel_err > tolerance(dt) || cp.unwritten || ca.unwritten || cp.clobbered ||
      ca.clobbered)
    std::printf("act %d %s bn=%d major=%d pad=%lld: pre rel %.3g (unwritten %lld, clobbered %lld) act rel %.3g "
                "(unwritten %lld, clobbered %lld)\n",
                static_cast<int>(a), dtype_name(dt), bn, static_cast<int>(mj), static_cast<long long>(ld_pad),
                cp.rel_err, static_cast<long long>(cp.unwritten), static_cast<long long>(cp.clobbered), ca.rel_err,
                static_cast<long long>(ca.unwritten), static_cast<long long>(ca.clobbered));
  assert_true(cp.rel_err <= tolerance(dt) && ca.rel_err <= tolerance(dt));
  assert_int_equal(cp.unwritten + ca.unwritten, 0);
  assert_int_equal(cp.clobbered + ca.clobbered, 0);
  cudaFree(pre);
  cudaFree(act);
  free_problem(P);
}

void activations(void**) {
  const Activation acts[] = {Activation::kRelu, Activation::kGelu, Activation::kSilu, Activation::kSwiglu,
                             Activation::kGeglu};
  uint64_t seed = 100;
  for (DType dt : kTypes)
    for (Activation a : acts)
      for (int bn : kBlockNs)
        for (Major mj : kMajors) expect_activation(a, dt, bn, mj, seed++, 0);
}

// Padded output rows: the 16-byte store path (ld a multiple of 8) and the pair-store path (an
// ld that is not), for both epilogues; the padding keeps its poison.
void padded_outputs(void**) {
  uint64_t seed = 500;
  for (int64_t pad : {8, 2})
    for (int bn : kBlockNs) {
      expect_activation(Activation::kSwiglu, DType::kBF16, bn, Major::kMN, seed++, pad);
      expect_activation(Activation::kGelu, DType::kF16, bn, Major::kK, seed++, pad);
      Problem P = make_problem({1500, 600, 5, 264, 136, false, true, Major::kMN, 0.5}, DType::kBF16, seed++);
      Check c;
      run_store(P, bn, true, &c, pad);
      if (c.rel_err > tolerance(DType::kBF16) || c.unwritten || c.clobbered)
        std::printf("store pad=%lld bn=%d: rel %.3g unwritten %lld clobbered %lld\n", static_cast<long long>(pad), bn,
                    c.rel_err, static_cast<long long>(c.unwritten), static_cast<long long>(c.clobbered));
      assert_true(c.rel_err <= tolerance(DType::kBF16));
      assert_int_equal(c.unwritten + c.clobbered, 0);
      free_problem(P);
    }
}

// The valid columns of a [rows, ld] output, as bits.
std::vector<uint16_t> valid_bits(const void* d, int64_t rows, int64_t cols, int64_t ld) {
  const std::vector<uint16_t> h = download_bits(d, rows * ld);
  std::vector<uint16_t> v;
  for (int64_t p = 0; p < rows; ++p) v.insert(v.end(), h.begin() + p * ld, h.begin() + p * ld + cols);
  return v;
}

// pre and act of the activation epilogue, valid columns as bits, with rows padded by ld_pad;
// `outputs`: bit 0 pre, bit 1 act (an output left out is not written, its bits empty).
void run_activation_bits(const Problem& P, Activation a, int bn, int64_t ld_pad, std::vector<uint16_t>* pre_bits,
                         std::vector<uint16_t>* act_bits, int outputs = 3) {
  const int64_t n = P.s.n, nc = P.ncols(), ld_pre = nc + ld_pad, ld_act = n + ld_pad;
  void* pre = outputs & 1 ? alloc_poisoned(P.s.m_total * ld_pre) : nullptr;
  void* act = outputs & 2 ? alloc_poisoned(P.s.m_total * ld_act) : nullptr;
  const sm90::EpilogueParams e = activation_params(a, pre, ld_pre, act, ld_act);
  sm90::grouped_gemm(P.dt, P.params(), e, kernel_choice(bn), nullptr);
  GGP_CK(cudaDeviceSynchronize());
  *pre_bits = pre ? valid_bits(pre, P.s.m_total, nc, ld_pre) : std::vector<uint16_t>{};
  *act_bits = act ? valid_bits(act, P.s.m_total, n, ld_act) : std::vector<uint16_t>{};
  cudaFree(pre);
  cudaFree(act);
}

// The store staged through TMA (rows padded to a multiple of 8 elements) and from registers (ld
// not a multiple of 8): whether their valid columns are the same bits. *staged: the staged run
// against the reference.
bool store_paths_agree(const Problem& P, int bn, Check* staged) {
  Check c2;
  const std::vector<uint16_t> s8 = run_store(P, bn, true, staged, 8), s2 = run_store(P, bn, true, &c2, 2);
  const int64_t n = P.s.n;
  for (int64_t p = 0; p < P.s.m_total; ++p)
    if (!std::equal(s8.begin() + p * (n + 8), s8.begin() + p * (n + 8) + n, s2.begin() + p * (n + 2))) {
      std::printf("store: staged != registers: bn=%d\n", bn);
      return false;
    }
  return true;
}

// The activation epilogue's outputs (run_activation_bits' `outputs`) staged and from registers:
// whether they are the same bits.
bool activation_paths_agree(const Problem& Q, Activation a, int bn, int outputs) {
  std::vector<uint16_t> pre0, act0, pre2, act2;
  run_activation_bits(Q, a, bn, 0, &pre0, &act0, outputs);
  run_activation_bits(Q, a, bn, 2, &pre2, &act2, outputs);
  if (pre0 == pre2 && act0 == act2) return true;
  std::printf("activation: staged != registers: act %d bn=%d outputs=%d\n", static_cast<int>(a), bn, outputs);
  return false;
}

// Full tiles go through shared memory and TMA stores when the outputs allow it (rows padded to a
// multiple of 8 elements), from registers otherwise (ld not a multiple of 8): the same bits.
void staged_matches_registers(void**) {
  uint64_t seed = 900;
  for (int bn : kBlockNs) {
    Problem P = make_problem({3000, 1000, 5, 200, 136, false, true, Major::kMN, 0.3}, DType::kBF16, seed++);
    Check c;
    assert_true(store_paths_agree(P, bn, &c));
    free_problem(P);
    for (Activation a : {Activation::kSwiglu, Activation::kGelu}) {
      Problem Q = make_problem({2500, 900, 4, 136, 264, is_gated(a), true, Major::kK, 0.4}, DType::kF16, seed++);
      assert_true(activation_paths_agree(Q, a, bn, 3));
      free_problem(Q);
    }
  }
}

// Many tiles per CTA (the persistent grid is at most one CTA per SM): full tiles keep their
// store boxes for the next tile's mainloop (gemm/sm90/epilogue_deferred.cuh) between partial
// ones (register path) and the last tile (flushed), and the staging buffers alternate across
// tiles. The same bits as the register path, for the store (K = 136: three k-blocks, fewer
// than a 128 x 256 tile's four boxes, so they are flushed before the next tile's epilogue) and
// for the activation epilogue with pre and act, pre alone and act alone (deferred where
// choose_kernel defers it: ReLU, SiLU and SwiGLU on the 256-wide tiles; K = 72 for the plain
// ones: two k-blocks for a tile's eight turns, so most are flushed).
void deferred_matches_registers(void**) {
  uint64_t seed = 970;
  for (int bn : kBlockNs) {
    Problem P = make_problem({40000, 12000, 5, 264, 136, false, true, Major::kK, 0.3}, DType::kBF16, seed++);
    Check c8;
    assert_true(store_paths_agree(P, bn, &c8));
    assert_true(c8.rel_err <= tolerance(P.dt) && c8.unwritten == 0 && c8.clobbered == 0);
    free_problem(P);
    for (Activation a : {Activation::kSwiglu, Activation::kSilu, Activation::kGeglu, Activation::kRelu})
      for (int outputs : {3, 1, 2}) {
        const int32_t k = a == Activation::kSwiglu ? 520 : 72;
        Problem Q = make_problem({50000, 16000, 4, 200, k, is_gated(a), true, Major::kMN, 0.4}, DType::kF16, seed++);
        assert_true(activation_paths_agree(Q, a, bn, outputs));
        free_problem(Q);
      }
  }
}

// Rows placed per expert (the fused engine's windows writing at the call's positions): expert
// e's rows at expert_row[e] + (p - offsets[e]). Placed in reverse expert order after 64 guard
// rows, inside an output of out_rows rows followed by 64 more guard rows; then hostile starts
// (past the end, negative) must not write outside [0, out_rows).
// The store epilogue with rows placed one by one (c_row: a top-1 layer's y and dx at their
// tokens), against the plain definition: each problem row p scaled, rounded and stored at row
// c_row[p]; indices outside [0, c_rows), and the rows they would have named, left alone; the
// padding columns and the memory around the output untouched. Two layouts: 8-byte stores
// (ld = n), and one element at a time (ld = n + 3, C 2 bytes past an 8-byte boundary).
void token_rows(void**) {
  uint64_t seed = 1300;
  for (int bn : kBlockNs)
    for (int layout = 0; layout < 2; ++layout)
      for (bool hostile : {false, true}) {
        Problem P = make_problem({1500, 600, 5, 264, 136, false, true, Major::kMN, 0.5}, DType::kBF16, seed++);
        const int64_t m = P.s.m_total, n = P.s.n, ld = layout ? n + 3 : n, lead = layout, guard = 16 * ld;
        std::mt19937_64 rng(seed);
        std::vector<int32_t> row(m);
        std::iota(row.begin(), row.end(), 0);
        std::shuffle(row.begin(), row.end(), rng);
        std::vector<int32_t> dead;  // rows whose index was spoiled: never written
        if (hostile)
          for (int64_t p = 0; p < m; p += 17) {
            dead.push_back(row[p]);
            row[p] = p % 2 ? static_cast<int32_t>(-1 - p) : static_cast<int32_t>(m + p);
          }
        int32_t* d_row = nullptr;
        GGP_CK(cudaMalloc(&d_row, sizeof(int32_t) * m));
        GGP_CK(cudaMemcpy(d_row, row.data(), sizeof(int32_t) * m, cudaMemcpyHostToDevice));
        const int64_t total = lead + 2 * guard + m * ld, at = lead + guard;
        void* buf = alloc_poisoned(total);
        sm90::EpilogueParams e;
        e.kind = sm90::EpilogueKind::kStore;
        e.c = static_cast<uint16_t*>(buf) + at;
        e.ldc = ld;
        e.row_scale = P.d_scale;
        e.c_row = d_row;
        e.c_rows = static_cast<int32_t>(m);
        sm90::grouped_gemm(P.dt, P.params(), e, kernel_choice(bn), nullptr);
        GGP_CK(cudaDeviceSynchronize());
        const std::vector<uint16_t> h = download_bits(buf, total);
        const std::vector<float> want = want_store(P, true);
        int64_t outside = 0, dead_written = 0;
        for (int64_t i = 0; i < total; ++i)
          if ((i < at || i >= at + m * ld) && h[i] != 0xFFFF) ++outside;
        for (int32_t t : dead)
          for (int64_t j = 0; j < ld; ++j) dead_written += h[at + t * ld + j] != 0xFFFF;
        // Un-place the rows (a spoiled one stands in as its exact rounded value) and compare.
        std::vector<uint16_t> up(m * ld, 0xFFFF);
        for (int64_t p = 0; p < m; ++p)
          for (int64_t j = 0; j < n; ++j)
            up[p * ld + j] = row[p] >= 0 && row[p] < m ? h[at + row[p] * ld + j] : to_half_bits(want[p * n + j], P.dt);
        for (int64_t p = 0; p < m; ++p)
          if (row[p] >= 0 && row[p] < m)
            for (int64_t j = n; j < ld; ++j) up[p * ld + j] = h[at + row[p] * ld + j];
        const Check c = compare_bits(up, m, n, ld, P.dt, want);
        if (c.rel_err > tolerance(P.dt) || c.unwritten || c.clobbered || outside || dead_written)
          std::printf("token rows bn=%d layout=%d hostile=%d: rel %.3g unwritten %lld clobbered %lld outside %lld dead %lld\n",
                      bn, layout, hostile, c.rel_err, static_cast<long long>(c.unwritten),
                      static_cast<long long>(c.clobbered), static_cast<long long>(outside),
                      static_cast<long long>(dead_written));
        assert_true(c.rel_err <= tolerance(P.dt));
        assert_int_equal(c.unwritten + c.clobbered + outside + dead_written, 0);
        cudaFree(buf);
        cudaFree(d_row);
        free_problem(P);
      }
}

void placed_rows(void**) {
  uint64_t seed = 950;
  for (int bn : kBlockNs)
    for (bool hostile : {false, true}) {
      const Activation a = Activation::kSwiglu;
      Problem P = make_problem({1700, 800, 6, 136, 200, true, true, Major::kMN, 0.5}, DType::kBF16, seed++);
      const int64_t m = P.s.m_total, n = P.s.n, nc = P.ncols(), guard = 64, out_rows = m + 2 * guard;
      std::vector<int32_t> row(P.s.E);
      for (int e = 0; e < P.s.E; ++e) row[e] = static_cast<int32_t>(guard + (m - P.offsets[e + 1]));
      if (hostile) {
        row[0] = static_cast<int32_t>(out_rows - 3);
        row[1] = -100;
      }
      int32_t* d_row = nullptr;
      GGP_CK(cudaMalloc(&d_row, sizeof(int32_t) * P.s.E));
      GGP_CK(cudaMemcpy(d_row, row.data(), sizeof(int32_t) * P.s.E, cudaMemcpyHostToDevice));
      // [guard][out_rows][guard] rows of each output; the kernel sees the middle.
      void* pre = alloc_poisoned((out_rows + 2 * guard) * nc);
      void* act = alloc_poisoned((out_rows + 2 * guard) * n);
      sm90::EpilogueParams e =
          activation_params(a, static_cast<uint16_t*>(pre) + guard * nc, nc, static_cast<uint16_t*>(act) + guard * n, n);
      e.pre_expert_row = d_row;
      e.pre_out_rows = static_cast<int32_t>(out_rows);
      e.act_expert_row = d_row;
      e.act_out_rows = static_cast<int32_t>(out_rows);
      sm90::grouped_gemm(P.dt, P.params(), e, kernel_choice(bn), nullptr);
      GGP_CK(cudaDeviceSynchronize());
      const std::vector<uint16_t> hp = download_bits(pre, (out_rows + 2 * guard) * nc),
                                  ha = download_bits(act, (out_rows + 2 * guard) * n);
      auto poisoned = [](const std::vector<uint16_t>& h, int64_t from, int64_t to) {
        for (int64_t i = from; i < to; ++i)
          if (h[i] != 0xFFFF) return false;
        return true;
      };
      // Outside [0, out_rows): never written.
      assert_true(poisoned(hp, 0, guard * nc) && poisoned(hp, (guard + out_rows) * nc, (out_rows + 2 * guard) * nc));
      assert_true(poisoned(ha, 0, guard * n) && poisoned(ha, (guard + out_rows) * n, (out_rows + 2 * guard) * n));
      if (!hostile) {  // un-place the rows and compare; the unplaced rows keep their poison
        std::vector<uint16_t> up(m * nc), ua(m * n);
        for (int ex = 0; ex < P.s.E; ++ex)
          for (int64_t p = P.offsets[ex]; p < P.offsets[ex + 1]; ++p) {
            const int64_t r = guard + row[ex] + (p - P.offsets[ex]);
            std::copy(hp.begin() + r * nc, hp.begin() + (r + 1) * nc, up.begin() + p * nc);
            std::copy(ha.begin() + r * n, ha.begin() + (r + 1) * n, ua.begin() + p * n);
          }
        std::vector<float> want_pre = reference(P);
        for (auto& v : want_pre) v = round_to(v, P.dt);
        const Check cp = compare_bits(up, m, nc, nc, P.dt, want_pre), ca = compare_bits(ua, m, n, n, P.dt, want_act(P, a));
        if (cp.rel_err > tolerance(P.dt) || ca.rel_err > tolerance(P.dt) || cp.unwritten || ca.unwritten)
          std::printf("placed bn=%d: pre rel %.3g unwritten %lld, act rel %.3g unwritten %lld\n", bn, cp.rel_err,
                      static_cast<long long>(cp.unwritten), ca.rel_err, static_cast<long long>(ca.unwritten));
        assert_true(cp.rel_err <= tolerance(P.dt) && ca.rel_err <= tolerance(P.dt));
        assert_int_equal(cp.unwritten + ca.unwritten, 0);
        assert_true(poisoned(hp, guard * nc, 2 * guard * nc) && poisoned(hp, (guard + out_rows - guard) * nc, (guard + out_rows) * nc));
      }
      cudaFree(pre);
      cudaFree(act);
      cudaFree(d_row);
      free_problem(P);
    }
}

void deterministic(void**) {
  Problem P = make_problem({5000, 2000, 16, 256, 512, false, true, Major::kMN, 0.9}, DType::kBF16, 42);
  Check c;
  for (int bn : kBlockNs) {
    const std::vector<uint16_t> a = run_store(P, bn, true, &c), b = run_store(P, bn, true, &c),
                                d = run_store(P, bn, true, &c);
    assert_true(a == b && b == d);
  }
  free_problem(P);
}

// A grid capped below the SM count (SMs left to another stream's kernels): every tile still
// computed, the same bits as the full grid.
void capped_grid(void**) {
  Problem P = make_problem({5000, 2000, 16, 256, 512, false, true, Major::kMN, 0.9}, DType::kBF16, 11);
  Check c;
  for (int bn : kBlockNs) {
    const std::vector<uint16_t> full = run_store(P, bn, true, &c);
    for (int32_t ctas : {1, 7}) {
      assert_true(run_store(P, bn, true, &c, 0, ctas) == full);
      assert_true(c.rel_err <= tolerance(P.dt));
      assert_int_equal(c.unwritten, 0);
    }
  }
  free_problem(P);
}

// Stores A's rows into `a` from `saved` after a delay, last row first, each marked arrived after
// its bytes: a sender on another stream, as an expert-parallel dispatch is to the local GEMMs.
__global__ void send_rows_late_kernel(const uint16_t* saved, uint16_t* a, int64_t rows, int64_t cols, uint32_t* ready,
                                      uint64_t delay_ns) {
  const uint64_t t0 = moeblaze::global_ns();
  while (moeblaze::global_ns() - t0 < delay_ns) __nanosleep(1000);
  const int lane = threadIdx.x % 32;
  const int64_t warps = static_cast<int64_t>(gridDim.x) * (blockDim.x / 32);
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x / 32) + threadIdx.x / 32; i < rows; i += warps) {
    const int64_t r = rows - 1 - i;
    for (int64_t c = lane; c < cols; c += 32) a[r * cols + c] = saved[r * cols + c];
    moeblaze::signal_row_arrived(ready + r, lane);
  }
}

// A store into a fresh poisoned output whose gathered rows wait for their marks in `ready`
// (cleared here, with the flag), flag bit 4 on a timeout.
sm90::GroupedGemmParams waiting_store(const Problem& P, uint32_t* ready, int32_t* flag, sm90::EpilogueParams* e) {
  GGP_CK(cudaMemset(ready, 0, P.s.a_rows * 4));
  GGP_CK(cudaMemset(flag, 0, 4));
  e->c = alloc_poisoned(P.s.m_total * P.s.n);
  e->ldc = P.s.n;
  sm90::GroupedGemmParams p = P.params();
  p.arrival.ready = ready;
  p.arrival.flag = flag;
  p.arrival.late_bit = 4;
  return p;
}

// The gathered rows arrive while the GEMM runs: its producers wait for each tile's rows (the
// grid capped so that the sender finds SMs); the result is the same bits as with every row there.
void arriving_rows(void**) {
  Problem P = make_problem({6000, 2500, 16, 256, 512, false, true, Major::kMN, 0.5}, DType::kBF16, 21);
  Check c;
  int sms = 0;
  GGP_CK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  const int64_t elems = P.s.a_rows * P.s.k;
  void* saved = nullptr;
  uint32_t* ready = nullptr;
  int32_t* flag = nullptr;
  GGP_CK(cudaMalloc(&saved, elems * 2));
  GGP_CK(cudaMemcpy(saved, P.d_a, elems * 2, cudaMemcpyDeviceToDevice));
  GGP_CK(cudaMalloc(&ready, P.s.a_rows * 4));
  GGP_CK(cudaMalloc(&flag, 4));
  cudaFuncAttributes attr;  // loaded before the GEMM waits: a lazy load at its launch could wait for the GEMM
  GGP_CK(cudaFuncGetAttributes(&attr, send_rows_late_kernel));
  cudaStream_t gemm_stream, send_stream;
  GGP_CK(cudaStreamCreateWithFlags(&gemm_stream, cudaStreamNonBlocking));
  GGP_CK(cudaStreamCreateWithFlags(&send_stream, cudaStreamNonBlocking));
  for (int bn : kBlockNs) {
    const std::vector<uint16_t> full = run_store(P, bn, true, &c);
    GGP_CK(cudaMemset(P.d_a, 0xff, elems * 2));  // NaN rows until they arrive
    sm90::EpilogueParams e;
    e.row_scale = P.d_scale;
    sm90::GroupedGemmParams p = waiting_store(P, ready, flag, &e);
    p.max_ctas = p.arrival.max_ctas = sms - 8;
    assert_null(sm90::unsupported_reason(P.dt, p, e));
    sm90::grouped_gemm(P.dt, p, e, kernel_choice(bn), gemm_stream);
    send_rows_late_kernel<<<8, 256, 0, send_stream>>>(static_cast<const uint16_t*>(saved), static_cast<uint16_t*>(P.d_a),
                                                       P.s.a_rows, P.s.k, ready, 2000000);
    GGP_CK(cudaGetLastError());
    GGP_CK(cudaDeviceSynchronize());
    std::vector<uint16_t> bits(P.s.m_total * P.s.n);
    GGP_CK(cudaMemcpy(bits.data(), e.c, bits.size() * 2, cudaMemcpyDeviceToHost));
    int32_t h_flag = -1;
    GGP_CK(cudaMemcpy(&h_flag, flag, 4, cudaMemcpyDeviceToHost));
    assert_int_equal(h_flag, 0);
    assert_true(bits == full);
    cudaFree(e.c);
  }
  // Rows that never come: the wait gives up after its timeout, flags the step and finishes.
  sm90::EpilogueParams e;
  sm90::GroupedGemmParams p = waiting_store(P, ready, flag, &e);
  p.arrival.timeout_ns = 2000000;
  sm90::grouped_gemm(P.dt, p, e, kernel_choice(256), gemm_stream);
  GGP_CK(cudaStreamSynchronize(gemm_stream));
  int32_t h_flag = 0;
  GGP_CK(cudaMemcpy(&h_flag, flag, 4, cudaMemcpyDeviceToHost));
  assert_int_equal(h_flag, 4);
  // Contiguous A cannot wait (it loads by TMA): refused before anything is enqueued.
  p.a_index = nullptr;
  assert_non_null(sm90::unsupported_reason(P.dt, p, e));
  cudaFree(e.c);
  cudaFree(saved);
  cudaFree(ready);
  cudaFree(flag);
  cudaStreamDestroy(gemm_stream);
  cudaStreamDestroy(send_stream);
  free_problem(P);
}

void no_rows(void**) {  // m_total = 0: no tiles, nothing launched past the schedule, no error
  Problem P = make_problem({0, 10, 4, 64, 64, false, true, Major::kMN, 0.0}, DType::kBF16, 3);
  Check c;
  for (int bn : kBlockNs) run_store(P, bn, false, &c);
  assert_int_equal(cudaGetLastError(), cudaSuccess);
  free_problem(P);
}

}  // namespace

int main() {
  skip_without_sm90();
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(store_shapes),   cmocka_unit_test(many_experts),  cmocka_unit_test(bad_indices),
      cmocka_unit_test(activations),    cmocka_unit_test(padded_outputs), cmocka_unit_test(deterministic),
      cmocka_unit_test(no_rows),        cmocka_unit_test(capped_grid),        cmocka_unit_test(staged_matches_registers), cmocka_unit_test(deferred_matches_registers),
      cmocka_unit_test(placed_rows),    cmocka_unit_test(arriving_rows), cmocka_unit_test(token_rows)};
  return cmocka_run_group_tests(tests, nullptr, nullptr);
}
