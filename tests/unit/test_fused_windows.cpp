// The fused engine's automatic token windows (engines/fused/window.hpp), host only: one window for
// the coarse layers at their benchmark sizes, 2 GiB windows where the token capacity is decided,
// the row buffers bounded independently of L, WINDOW_BYTES as a budget and WINDOW_TOKENS taken
// as given. docs/memory.md
// states the rule; perf/NOTES.md the measurements behind it.
#include <algorithm>
#include <cstdint>

#include "engines/fused/window.hpp"

// cmocka.h defines a fail() macro: include it after the library headers.
#include <stdarg.h>
#include <stddef.h>
#include <setjmp.h>
extern "C" {
#include <cmocka.h>
}

using moeblaze::Activation;
using moeblaze::DType;
using moeblaze::FusedWindows;
using moeblaze::LayerConfig;
using moeblaze::SavePolicy;

namespace {

LayerConfig layer(int64_t E, int64_t k, int64_t d, int64_t h, Activation a, SavePolicy pol = SavePolicy::kSavePreact) {
  LayerConfig c{};
  c.num_experts = E;
  c.top_k = k;
  c.hidden = d;
  c.ffn_hidden = h;
  c.activation = a;
  c.act_dtype = c.weight_dtype = DType::kBF16;
  c.accum_dtype = DType::kF32;
  c.save_policy = pol;
  return c;
}

// The row bytes a window of w tokens holds (what the budget bounds).
int64_t row_bytes(const LayerConfig& c, int64_t w) { return w * moeblaze::fused_window_bytes_per_token(c); }

void coarse_layers_run_one_window(void**) {
  // the paper's conf2/3/4 at their benchmark sizes: 3-9% faster as one window
  for (Activation a : {Activation::kSilu, Activation::kSwiglu}) {
    const FusedWindows conf2 = moeblaze::fused_windows(layer(8, 2, 1024, 4096, a), 65536);
    const FusedWindows conf3 = moeblaze::fused_windows(layer(16, 4, 1024, 4096, a), 65536);
    const FusedWindows conf4 = moeblaze::fused_windows(layer(16, 4, 2048, 8192, a), 32768);
    assert_int_equal(conf2.count, 1);
    assert_int_equal(conf3.count, 1);
    assert_int_equal(conf4.count, 1);
    assert_int_equal(conf4.tokens, 32768);
  }
  // conf4 SwiGLU's one window holds ~7 GiB of rows: no more than the cap
  assert_true(row_bytes(layer(16, 4, 2048, 8192, Activation::kSwiglu), 32768) <= moeblaze::gemm::sm90::kOneWindowBytes);
}

void large_calls_keep_budget_windows(void**) {
  // the max-tokens shape (conf4 SwiGLU) near its capacity, under both policies: RECOMPUTE_UP's
  // dpre lies over its recomputed pre, so its window rows are SAVE_PREACT's
  const LayerConfig recompute = layer(16, 4, 2048, 8192, Activation::kSwiglu, SavePolicy::kRecomputeUp);
  assert_int_equal(moeblaze::fused_window_bytes_per_token(recompute),
                   moeblaze::fused_window_bytes_per_token(layer(16, 4, 2048, 8192, Activation::kSwiglu)));
  for (const auto& [c, L] : {std::pair{layer(16, 4, 2048, 8192, Activation::kSwiglu), int64_t{491520}},
                             std::pair{recompute, int64_t{491520}}}) {
    const FusedWindows w = moeblaze::fused_windows(c, L);
    const int64_t per_token = moeblaze::fused_window_bytes_per_token(c);
    assert_true(w.count > 1);
    assert_int_equal(w.tokens, std::max(moeblaze::gemm::sm90::kMinWindowTokens, moeblaze::gemm::sm90::kWindowBudgetBytes / per_token));
    assert_true(row_bytes(c, w.tokens) <= moeblaze::gemm::sm90::kWindowBudgetBytes);
    assert_int_equal(w.count, (L + w.tokens - 1) / w.tokens);
  }
}

void rows_bounded_independently_of_l(void**) {
  const LayerConfig layers[] = {layer(16, 4, 2048, 8192, Activation::kSwiglu), layer(128, 8, 4096, 1024, Activation::kSwiglu),
                                layer(4, 1, 512, 2048, Activation::kSilu),
                                layer(64, 8, 2048, 1024, Activation::kGelu, SavePolicy::kRecomputeUp)};
  for (const LayerConfig& c : layers) {
    const int64_t bound = std::max(moeblaze::gemm::sm90::kOneWindowBytes,
                                   moeblaze::gemm::sm90::kWindowBudgetBytes + 2 * moeblaze::fused_weight_grad_sum_bytes(c));
    for (int64_t L = 1; L <= (int64_t{1} << 26); L = L * 3 / 2 + 1) {
      const FusedWindows w = moeblaze::fused_windows(c, L);
      assert_true(w.tokens >= 1 && w.tokens <= L);
      assert_int_equal(w.count, (L + w.tokens - 1) / w.tokens);
      // a window never holds more rows than the bound (the minimum window aside)
      if (w.tokens > moeblaze::gemm::sm90::kMinWindowTokens) assert_true(row_bytes(c, w.tokens) <= bound);
    }
  }
}

// Where the fp32 sums outweigh the windows' rows, one window: the local experts of a
// DeepSeek-V3-like layer at EP 4 (64 of 256 experts, 65,536 received rows of 8 slots) need
// ~17.7 GB of rows as one window against 2 GiB windows plus 11.3 GB of sums read and written
// by each of about nine windows.
void sums_heavier_than_windows_run_one_window(void**) {
  const LayerConfig c = layer(64, 8, 7168, 2048, Activation::kSwiglu);
  const int64_t per_token = moeblaze::fused_window_bytes_per_token(c), sums = moeblaze::fused_weight_grad_sum_bytes(c);
  assert_true(sums > moeblaze::gemm::sm90::kWindowBudgetBytes);
  assert_true(65536 * per_token > moeblaze::gemm::sm90::kWindowBudgetBytes + sums);  // one window needs more memory
  const FusedWindows w = moeblaze::fused_windows(c, 65536);
  assert_int_equal(w.count, 1);
  // past the windows plus twice the sums, windows again
  const int64_t budget_w = moeblaze::gemm::sm90::kWindowBudgetBytes / per_token;
  const int64_t past = (budget_w * per_token + 2 * sums) / per_token + 1;
  assert_true(moeblaze::fused_windows(c, past).count > 1);
}

// WINDOW_BYTES: the rows of one window, or of each window plus the fp32 sums, within the budget;
// never below the minimum window.
void window_bytes_budget(void**) {
  LayerConfig c = layer(16, 4, 2048, 8192, Activation::kSwiglu);
  const int64_t per_token = moeblaze::fused_window_bytes_per_token(c), sums = moeblaze::fused_weight_grad_sum_bytes(c);
  c.window_bytes = 32768 * per_token;  // conf4's call exactly
  FusedWindows w = moeblaze::fused_windows(c, 32768);
  assert_int_equal(w.count, 1);
  c.window_bytes = int64_t{4} << 30;  // less than the call's 7 GiB: windows and sums within 4 GiB
  w = moeblaze::fused_windows(c, 32768);
  assert_true(w.count > 1);
  assert_int_equal(w.tokens, (c.window_bytes - sums) / per_token);
  assert_true(row_bytes(c, w.tokens) + sums <= c.window_bytes);
  assert_true(row_bytes(c, w.tokens + 1) + sums > c.window_bytes);
  assert_int_equal(w.count, (32768 + w.tokens - 1) / w.tokens);
  c.window_bytes = sums;  // no room for rows beside the sums: the minimum window
  w = moeblaze::fused_windows(c, 32768);
  assert_int_equal(w.tokens, moeblaze::gemm::sm90::kMinWindowTokens);
  // the budget wins over the automatic rule's one window (conf4 runs as one window without it)
  c.window_bytes = int64_t{2} << 30;
  assert_true(moeblaze::fused_windows(c, 32768).count > 1);
  c.window_bytes = 0;
  assert_int_equal(moeblaze::fused_windows(c, 32768).count, 1);
}

void window_tokens_as_given(void**) {
  LayerConfig c = layer(16, 4, 2048, 8192, Activation::kSwiglu);
  c.window_tokens = 4096;
  FusedWindows w = moeblaze::fused_windows(c, 32768);
  assert_int_equal(w.tokens, 4096);
  assert_int_equal(w.count, 8);
  w = moeblaze::fused_windows(c, 1000);  // fewer tokens than the window
  assert_int_equal(w.tokens, 1000);
  assert_int_equal(w.count, 1);
  c.window_tokens = 0;
  w = moeblaze::fused_windows(c, 0);  // no tokens: one empty window
  assert_int_equal(w.tokens, 1);
  assert_int_equal(w.count, 1);
}

// A last-use backward writes dpre over the saved pre only where the window's rows are the
// call's plan positions: one window of all L tokens, under a policy that saves pre.
void dpre_over_saved_pre_needs_one_window(void**) {
  for (const SavePolicy pol : {SavePolicy::kSavePreact, SavePolicy::kSaveAll, SavePolicy::kRecomputeUp}) {
    LayerConfig c = layer(16, 4, 2048, 8192, Activation::kSwiglu, pol);
    const bool saves_pre = pol != SavePolicy::kRecomputeUp;
    assert_int_equal(moeblaze::fused_dpre_over_saved_pre(c, 32768, moeblaze::fused_windows(c, 32768)), saves_pre);
    assert_false(moeblaze::fused_dpre_over_saved_pre(c, 491520, moeblaze::fused_windows(c, 491520)));  // windows
    assert_false(moeblaze::fused_dpre_over_saved_pre(c, 0, moeblaze::fused_windows(c, 0)));  // an empty call
    c.window_tokens = 1000;
    assert_false(moeblaze::fused_dpre_over_saved_pre(c, 32768, moeblaze::fused_windows(c, 32768)));
    assert_int_equal(moeblaze::fused_dpre_over_saved_pre(c, 1000, moeblaze::fused_windows(c, 1000)), saves_pre);
  }
}

}  // namespace

int main() {
  const struct CMUnitTest tests[] = {cmocka_unit_test(coarse_layers_run_one_window), cmocka_unit_test(large_calls_keep_budget_windows),
                                     cmocka_unit_test(rows_bounded_independently_of_l),
                                     cmocka_unit_test(sums_heavier_than_windows_run_one_window),
                                     cmocka_unit_test(window_bytes_budget),
                                     cmocka_unit_test(window_tokens_as_given),
                                     cmocka_unit_test(dpre_over_saved_pre_needs_one_window)};
  return cmocka_run_group_tests(tests, nullptr, nullptr);
}
