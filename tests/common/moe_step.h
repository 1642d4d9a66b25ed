/* One small f32 training problem on the CPU engine, for the tests that need "a valid
 * forward/backward" and then perturb one thing: hardening, threads, soak. Each problem owns its
 * host buffers (256-byte aligned, GUARD trailing bytes of 0xA5 after each). */
#ifndef MOEBLAZE_MOE_STEP_H_
#define MOEBLAZE_MOE_STEP_H_

#include <stddef.h>
#include <stdint.h>

#include "moeblaze/moeblaze.h"

enum { MS_GUARD = 64 };

typedef struct ms_problem {
  int64_t L, E, k, d, h, gh;
  int64_t sx[2], sl[2], sw[3], sd[3], sk[2], se[1];
  float *x, *logits, *wgu, *wd, *y, *dy, *dx, *dwgu, *dwd, *dlogits;
  int32_t *ids, *tpe;
  void *ws, *saved;
  size_t ws_bytes, saved_bytes;
} ms_problem;

/* Random inputs from `seed`; workspace and saved buffers sized by the handle's queries. */
void ms_init(ms_problem* p, moeblaze_handle_t h, int64_t L, int64_t E, int64_t k, int64_t d, int64_t h_ffn,
             int gated, uint64_t seed);
void ms_free(ms_problem* p);
/* The argument lists: forward routes from logits and writes y, TOPK_INDICES and
 * TOKENS_PER_EXPERT; backward writes dx, dW_gate_up, dW_down and d logits. Return the count. */
size_t ms_forward_args(ms_problem* p, moeblaze_arg_t* a);
size_t ms_backward_args(ms_problem* p, moeblaze_arg_t* a);
moeblaze_status_t ms_forward(moeblaze_handle_t h, ms_problem* p);
moeblaze_status_t ms_backward(moeblaze_handle_t h, ms_problem* p);
/* 1 when every buffer's guard bytes are intact. */
int ms_guards_intact(const ms_problem* p);
/* Index of buffer `i` of the problem (0..ms_num_buffers()-1), its bytes. */
int ms_num_buffers(void);
void* ms_buffer(const ms_problem* p, int i, size_t* bytes);

#endif
