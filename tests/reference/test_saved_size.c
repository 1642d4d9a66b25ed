/* moeblaze_get_saved_size equals the formula of docs/design.md ("Saved buffer") for every save
 * policy, activation dtype and gating, at L = 0, 1, small odd L, tile-ish boundaries and
 * MAX_TOKENS; it is monotone in L; L outside 0..MAX_TOKENS is rejected. */
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <setjmp.h>
#include <cmocka.h>

#include <stdio.h>
#include <string.h>

#include "test_util.h"

static uint64_t A(uint64_t x) { return (x + 255u) / 256u * 256u; }

/* docs/design.md, "Saved buffer": a 256-byte header block, then the regions in order, each on a
 * 256-byte boundary. */
static uint64_t formula(int64_t L, int64_t E, int64_t k, int64_t h, int64_t g, uint64_t s,
                        int64_t policy) {
  const uint64_t Lk = (uint64_t)L * (uint64_t)k;
  uint64_t b = 256 + 4 * A(4 * Lk) + A(4 * (uint64_t)(E + 1));
  if (policy == MOEBLAZE_SAVE_PREACT || policy == MOEBLAZE_SAVE_ALL) b += A(Lk * (uint64_t)g * (uint64_t)h * s);
  if (policy == MOEBLAZE_SAVE_ALL) b += A(Lk * (uint64_t)h * s);
  return b;
}

typedef struct sz_cfg {
  int64_t E, k, d, h, max_tokens, act;
  const moeblaze_dtype_t* dt;
} sz_cfg;

static void check_cfg(const sz_cfg* c) {
  const int64_t g = (c->act == MOEBLAZE_ACTIVATION_SWIGLU || c->act == MOEBLAZE_ACTIVATION_GEGLU) ? 2 : 1;
  const uint64_t s = tu_dtype_size(*c->dt);
  for (int64_t policy = 0; policy < 3; ++policy) {
    tu_layer l = tu_layer_default(c->E, c->k, c->d, c->h, c->max_tokens, c->act);
    l.save_policy = policy;
    l.act_dtype = *c->dt;
    l.weight_dtype = *c->dt;
    moeblaze_handle_t hd = NULL;
    assert_ok(tu_create_cpu(&l, &hd));
    const int64_t M = c->max_tokens;
    const int64_t Ls[] = {0, 1, 2, 3, 7, 37, 63, 64, 65, 127, 128, 129, 255, 256, 257, 1000,
                          4095, 4096, 4097, M / 2, M - 1, M};
    for (size_t i = 0; i < sizeof Ls / sizeof Ls[0]; ++i) {
      const int64_t L = Ls[i];
      if (L < 0 || L > M) continue;
      size_t got = 0;
      assert_ok(moeblaze_get_saved_size(hd, L, &got));
      const uint64_t want = formula(L, c->E, c->k, c->h, g, s, policy);
      if ((uint64_t)got != want)
        fail_msg("saved size E=%lld k=%lld h=%lld act=%lld dtype=%s policy=%lld L=%lld: got %zu, "
                 "formula %llu", (long long)c->E, (long long)c->k, (long long)c->h,
                 (long long)c->act, tu_dtype_name(*c->dt), (long long)policy, (long long)L, got,
                 (unsigned long long)want);
      assert_int_equal(got % MOEBLAZE_BUFFER_ALIGNMENT, 0);
    }
    /* monotone in L: dense sweep at the start, then a geometric one up to MAX_TOKENS */
    size_t prev = 0;
    for (int64_t L = 0;;) {
      size_t got = 0;
      assert_ok(moeblaze_get_saved_size(hd, L, &got));
      if (got < prev)
        fail_msg("saved size not monotone: L=%lld gives %zu < %zu (policy %lld)", (long long)L, got, prev, (long long)policy);
      prev = got;
      if (L == M) break;
      int64_t next = L < 600 ? L + 1 : L + L / 4;
      L = next > M ? M : next;
    }
    /* out of range */
    size_t dummy = 0;
    assert_status(moeblaze_get_saved_size(hd, M + 1, &dummy), MOEBLAZE_STATUS_INVALID_ARGUMENT);
    assert_status(moeblaze_get_saved_size(hd, -1, &dummy), MOEBLAZE_STATUS_INVALID_ARGUMENT);
    assert_status(moeblaze_get_saved_size(hd, 1, NULL), MOEBLAZE_STATUS_INVALID_ARGUMENT);
    assert_status(moeblaze_get_saved_size(NULL, 1, &dummy), MOEBLAZE_STATUS_INVALID_ARGUMENT);
    assert_ok(moeblaze_destroy(hd));
  }
}

static void test_sizes(void** state) {
  (void)state;
  static const sz_cfg cfgs[] = {
      {6, 2, 24, 40, 37, MOEBLAZE_ACTIVATION_SWIGLU, &tu_bf16},
      {6, 2, 24, 40, 4096, MOEBLAZE_ACTIVATION_SILU, &tu_bf16},
      {8, 3, 16, 24, 100000, MOEBLAZE_ACTIVATION_GEGLU, &tu_f16},
      {64, 8, 64, 96, 1 << 20, MOEBLAZE_ACTIVATION_RELU, &tu_f32},
      {128, 8, 2048, 1024, 65536, MOEBLAZE_ACTIVATION_SWIGLU, &tu_bf16},
      {1, 1, 1, 1, 1, MOEBLAZE_ACTIVATION_GELU, &tu_f32},
      {4, 4, 8, 5, 999, MOEBLAZE_ACTIVATION_SWIGLU, &tu_f32},
      {65536, 64, 8, 8, (int64_t)((1ll << 31) - 1) / 64, MOEBLAZE_ACTIVATION_SWIGLU, &tu_bf16},
  };
  for (size_t i = 0; i < sizeof cfgs / sizeof cfgs[0]; ++i) check_cfg(&cfgs[i]);
}

/* The per-token numbers docs/design.md quotes (bf16 SwiGLU: 16 k + 4 k h; SiLU: 16 k + 2 k h;
 * SAVE_ALL adds k h s) hold up to the 256-byte rounding. */
static void test_per_token(void** state) {
  (void)state;
  const int64_t E = 8, k = 2, h = 128, L = 4096;
  const int64_t acts[2] = {MOEBLAZE_ACTIVATION_SWIGLU, MOEBLAZE_ACTIVATION_SILU};
  for (int a = 0; a < 2; ++a) {
    size_t sz[3];
    for (int64_t p = 0; p < 3; ++p) {
      tu_layer l = tu_layer_default(E, k, 64, h, L, acts[a]);
      l.save_policy = p;
      l.act_dtype = l.weight_dtype = tu_bf16;
      moeblaze_handle_t hd = NULL;
      assert_ok(tu_create_cpu(&l, &hd));
      assert_ok(moeblaze_get_saved_size(hd, L, &sz[p]));
      assert_ok(moeblaze_destroy(hd));
    }
    const int64_t g = a == 0 ? 2 : 1;
    /* L = 4096 and these k, h make every region a multiple of 256: exact per-token figures, plus
     * the header block and the offsets block */
    assert_int_equal(sz[MOEBLAZE_SAVE_RECOMPUTE_UP], (size_t)(L * 16 * k + 512));
    assert_int_equal(sz[MOEBLAZE_SAVE_PREACT], (size_t)(L * (16 * k + k * g * h * 2) + 512));
    assert_int_equal(sz[MOEBLAZE_SAVE_ALL], (size_t)(L * (16 * k + k * g * h * 2 + k * h * 2) + 512));
  }
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_sizes),
      cmocka_unit_test(test_per_token),
  };
  return cmocka_run_group_tests_name("saved_size", tests, NULL, NULL);
}
