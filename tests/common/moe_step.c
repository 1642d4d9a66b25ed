#include "moe_step.h"

#include <stdlib.h>
#include <string.h>

#include "test_util.h"

static void* guarded(size_t bytes) {
  char* b = tu_alloc_bytes(bytes + MS_GUARD);
  memset(b + bytes, 0xA5, MS_GUARD);
  return b;
}

/* Every buffer of the problem and its size, in one table (the guard check walks it). */
#define MS_BUFFERS(X)                                                     \
  X(x, p->L * p->d * 4) X(logits, p->L * p->E * 4) X(wgu, p->E * p->d * p->gh * 4) \
  X(wd, p->E * p->h * p->d * 4) X(y, p->L * p->d * 4) X(dy, p->L * p->d * 4)          \
  X(dx, p->L * p->d * 4) X(dwgu, p->E * p->d * p->gh * 4) X(dwd, p->E * p->h * p->d * 4) \
  X(dlogits, p->L * p->E * 4) X(ids, p->L * p->k * 4) X(tpe, p->E * 4) X(ws, p->ws_bytes) X(saved, p->saved_bytes)

int ms_num_buffers(void) {
#define COUNT(name, bytes) +1
  return 0 MS_BUFFERS(COUNT);
#undef COUNT
}

void* ms_buffer(const ms_problem* p, int i, size_t* bytes) {
  int n = 0;
#define PICK(name, sz)                              \
  if (n++ == i) {                                   \
    *bytes = (size_t)(sz);                          \
    return (void*)p->name;                          \
  }
  MS_BUFFERS(PICK)
#undef PICK
  *bytes = 0;
  return NULL;
}

void ms_init(ms_problem* p, moeblaze_handle_t h, int64_t L, int64_t E, int64_t k, int64_t d, int64_t h_ffn, int gated,
             uint64_t seed) {
  memset(p, 0, sizeof *p);
  p->L = L; p->E = E; p->k = k; p->d = d; p->h = h_ffn; p->gh = gated ? 2 * h_ffn : h_ffn;
  p->sx[0] = L; p->sx[1] = d;
  p->sl[0] = L; p->sl[1] = E;
  p->sw[0] = E; p->sw[1] = d; p->sw[2] = p->gh;
  p->sd[0] = E; p->sd[1] = h_ffn; p->sd[2] = d;
  p->sk[0] = L; p->sk[1] = k;
  p->se[0] = E;
  size_t wf = 0, wb = 0;
  moeblaze_get_workspace_size(h, MOEBLAZE_PASS_FORWARD_TRAINING, L, &wf);
  moeblaze_get_workspace_size(h, MOEBLAZE_PASS_BACKWARD, L, &wb);
  moeblaze_get_saved_size(h, L, &p->saved_bytes);
  p->ws_bytes = wf > wb ? wf : wb;
#define ALLOC(name, bytes) p->name = guarded((size_t)(bytes));
  MS_BUFFERS(ALLOC)
#undef ALLOC
  tu_rng r;
  tu_rng_seed(&r, seed);
  tu_fill_normal(&r, p->x, tu_f32, (size_t)(L * d), 1.0);
  tu_fill_normal(&r, p->logits, tu_f32, (size_t)(L * E), 1.0);
  tu_fill_normal(&r, p->wgu, tu_f32, (size_t)(E * d * p->gh), 0.3);
  tu_fill_normal(&r, p->wd, tu_f32, (size_t)(E * h_ffn * d), 0.3);
  tu_fill_normal(&r, p->dy, tu_f32, (size_t)(L * d), 1.0);
}

void ms_free(ms_problem* p) {
#define FREE(name, bytes) tu_free(p->name);
  MS_BUFFERS(FREE)
#undef FREE
  memset(p, 0, sizeof *p);
}

/* x, logits and the two weights: the inputs both passes take. */
static size_t input_args(ms_problem* p, moeblaze_arg_t* a) {
  size_t n = 0;
  a[n++] = tu_arg(MOEBLAZE_ARG_INPUT, tu_tensor(p->x, tu_f32, 2, p->sx));
  a[n++] = tu_arg(MOEBLAZE_ARG_ROUTER_LOGITS, tu_tensor(p->logits, tu_f32, 2, p->sl));
  a[n++] = tu_arg(MOEBLAZE_ARG_W_GATE_UP, tu_tensor(p->wgu, tu_f32, 3, p->sw));
  a[n++] = tu_arg(MOEBLAZE_ARG_W_DOWN, tu_tensor(p->wd, tu_f32, 3, p->sd));
  return n;
}

size_t ms_forward_args(ms_problem* p, moeblaze_arg_t* a) {
  size_t n = input_args(p, a);
  a[n++] = tu_arg(MOEBLAZE_ARG_OUTPUT, tu_tensor(p->y, tu_f32, 2, p->sx));
  a[n++] = tu_arg(MOEBLAZE_ARG_TOPK_INDICES, tu_tensor(p->ids, tu_i32, 2, p->sk));
  a[n++] = tu_arg(MOEBLAZE_ARG_TOKENS_PER_EXPERT, tu_tensor(p->tpe, tu_i32, 1, p->se));
  return n;
}

size_t ms_backward_args(ms_problem* p, moeblaze_arg_t* a) {
  size_t n = input_args(p, a);
  a[n++] = tu_arg(MOEBLAZE_ARG_GRAD_OUTPUT, tu_tensor(p->dy, tu_f32, 2, p->sx));
  a[n++] = tu_arg(MOEBLAZE_ARG_GRAD_INPUT, tu_tensor(p->dx, tu_f32, 2, p->sx));
  a[n++] = tu_arg(MOEBLAZE_ARG_GRAD_W_GATE_UP, tu_tensor(p->dwgu, tu_f32, 3, p->sw));
  a[n++] = tu_arg(MOEBLAZE_ARG_GRAD_W_DOWN, tu_tensor(p->dwd, tu_f32, 3, p->sd));
  a[n++] = tu_arg(MOEBLAZE_ARG_GRAD_ROUTER_LOGITS, tu_tensor(p->dlogits, tu_f32, 2, p->sl));
  return n;
}

moeblaze_status_t ms_forward(moeblaze_handle_t h, ms_problem* p) {
  moeblaze_arg_t a[8];
  const size_t n = ms_forward_args(p, a);
  return moeblaze_forward(h, MOEBLAZE_PASS_FORWARD_TRAINING, a, n, p->ws, p->ws_bytes, p->saved, p->saved_bytes, NULL);
}

moeblaze_status_t ms_backward(moeblaze_handle_t h, ms_problem* p) {
  moeblaze_arg_t a[10];
  const size_t n = ms_backward_args(p, a);
  return moeblaze_backward(h, a, n, p->saved, p->saved_bytes, p->ws, p->ws_bytes, NULL);
}

int ms_guards_intact(const ms_problem* p) {
  for (int i = 0; i < ms_num_buffers(); ++i) {
    size_t bytes;
    const unsigned char* b = ms_buffer(p, i, &bytes);
    for (int g = 0; g < MS_GUARD; ++g)
      if (b[bytes + g] != 0xA5) return 0;
  }
  return 1;
}
