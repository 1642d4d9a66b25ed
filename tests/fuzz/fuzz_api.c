/* libFuzzer target for the whole C API (clang, ASan + UBSan). The input is read as a stream of
 * choices; a missing byte reads as 0 and 0 always means "the valid choice", so short inputs are
 * valid forward/backward runs and every byte steers one thing away from valid:
 *   config: every attribute, in and out of range, unknown attributes, setters of the wrong type;
 *   routing options: expert groups, the route scale and the loss form; the EXPERT_BIAS,
 *           SEQUENCE_LENGTHS (valid splits of the tokens, then corrupted) and TOKEN_MASK arguments;
 *   calls:  forward (training, inference), backward (after a real forward, or on a foreign
 *           saved buffer: zeros, 0xFF, fuzz bytes, a valid one with flipped bytes), route,
 *           check_args with any pass value;
 *   args:   dropped, duplicated or unknown kinds, the STATUS output, flags, ndim 0..8, zero / negative / huge
 *           extents, strides, dtypes, devices, byte offsets (misaligned, past the address
 *           space), misaligned data, caller ids out of range or repeated, NaN and Inf values;
 *   buffers: workspace and saved sizes exact, short, NULL or misaligned.
 * Every buffer handed to the library has canary bytes before and after it; they are checked
 * after every call (and ASan checks everything else). A descriptor whose extent this harness
 * cannot allocate (above kCap) is only given to moeblaze_check_args, which reads no data. */
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "moeblaze/moeblaze.h"

enum { kCanary = 64, kMaxArgs = 24, kMaxBufs = 128 };
static const size_t kCap = (size_t)2 << 20; /* larger tensors: check_args only */

/* ---- the input as a stream of choices ---- */
typedef struct rd { const uint8_t* p; size_t n, i; } rd;
static uint8_t u8(rd* r) { return r->i < r->n ? r->p[r->i++] : 0; }
static uint64_t u64(rd* r) {
  uint64_t v = 0;
  for (int i = 0; i < 8; ++i) v |= (uint64_t)u8(r) << (8 * i);
  return v;
}
/* dflt unless the byte says otherwise: nearby, zero, negative, huge, or raw. */
static int64_t pick(rd* r, int64_t dflt) {
  const uint8_t b = u8(r);
  switch (b % 16) {
    case 10: return 0;
    case 11: return -1;
    case 12: return dflt + 1;
    case 13: return dflt - 1;
    case 14: return (int64_t)(u64(r) >> (b >> 4));
    case 15: return (int64_t)u8(r) - 16;
    default: return dflt;
  }
}

/* ---- canary-guarded buffers, all freed at the end of one input ---- */
typedef struct buf { unsigned char* base; size_t bytes; } buf;
typedef struct pool { buf b[kMaxBufs]; int n; } pool;

static void* guarded(pool* p, size_t bytes, size_t misalign) {
  if (p->n == kMaxBufs) return NULL;
  const size_t total = kCanary + 256 + bytes + kCanary;
  unsigned char* m = malloc(total);
  if (!m) return NULL;
  memset(m, 0xC5, total);
  /* data at a 256-byte boundary inside the block, plus `misalign` */
  uintptr_t d = ((uintptr_t)m + kCanary + 255) & ~(uintptr_t)255;
  d += misalign;
  unsigned char* data = (unsigned char*)d;
  memset(data, 0, bytes);
  p->b[p->n].base = m;
  p->b[p->n].bytes = total;
  p->n++;
  return data;
}
/* Everything in a block outside the data window must still be 0xC5. */
typedef struct window { const unsigned char* lo; const unsigned char* hi; } window;
static window windows[kMaxBufs];
static void check_canaries(const pool* p) {
  for (int i = 0; i < p->n; ++i) {
    const unsigned char* m = p->b[i].base;
    for (size_t j = 0; j < p->b[i].bytes; ++j) {
      const unsigned char* at = m + j;
      if (at >= windows[i].lo && at < windows[i].hi) continue;
      if (*at != 0xC5) {
        fprintf(stderr, "fuzz_api: canary byte %zu of buffer %d overwritten\n", j, i);
        abort();
      }
    }
  }
}
static void* alloc(pool* p, size_t bytes, size_t misalign) {
  void* d = guarded(p, bytes, misalign);
  if (d) {
    windows[p->n - 1].lo = d;
    windows[p->n - 1].hi = (unsigned char*)d + bytes;
  }
  return d;
}
static void free_pool(pool* p) {
  for (int i = 0; i < p->n; ++i) free(p->b[i].base);
  p->n = 0;
}

/* ---- the layer ---- */
typedef struct layer { int64_t E, k, d, h, gh, L, seqs; moeblaze_dtype_t at, wt; int caller_i64; } layer;

static const moeblaze_dtype_t kDtypes[6] = {{2, 32, 1}, {4, 16, 1}, {2, 16, 1}, {0, 32, 1}, {2, 64, 1}, {7, 8, 2}};

static moeblaze_handle_t make_handle(rd* r, layer* ly) {
  ly->E = 2 + u8(r) % 7;
  ly->k = 1 + u8(r) % ly->E;
  ly->d = 8 + 4 * (u8(r) % 4);
  ly->h = 16 + 8 * (u8(r) % 3);
  ly->L = 1 + u8(r) % 20;
  const int64_t act = u8(r) % 6, gated = act == MOEBLAZE_ACTIVATION_SWIGLU || act == MOEBLAZE_ACTIVATION_GEGLU;
  ly->gh = (gated ? 2 : 1) * ly->h;
  ly->at = kDtypes[u8(r) % 3];
  ly->wt = u8(r) % 4 == 3 ? kDtypes[u8(r) % 6] : ly->at;
  moeblaze_config_t cfg = NULL;
  if (moeblaze_config_create(&cfg)) return NULL;
  static const int32_t devices[4] = {MOEBLAZE_DEVICE_CPU, MOEBLAZE_DEVICE_CUDA, 0, 7};
  moeblaze_config_set_i64(cfg, MOEBLAZE_ATTR_DEVICE_TYPE, devices[u8(r) % 4]);
  moeblaze_config_set_i64(cfg, MOEBLAZE_ATTR_NUM_EXPERTS, pick(r, ly->E));
  moeblaze_config_set_i64(cfg, MOEBLAZE_ATTR_TOP_K, pick(r, ly->k));
  moeblaze_config_set_i64(cfg, MOEBLAZE_ATTR_HIDDEN_SIZE, pick(r, ly->d));
  moeblaze_config_set_i64(cfg, MOEBLAZE_ATTR_FFN_HIDDEN_SIZE, pick(r, ly->h));
  moeblaze_config_set_i64(cfg, MOEBLAZE_ATTR_MAX_TOKENS, pick(r, 64));
  moeblaze_config_set_i64(cfg, MOEBLAZE_ATTR_ACTIVATION, act);
  moeblaze_config_set_i64(cfg, MOEBLAZE_ATTR_SCORE_FUNCTION, pick(r, u8(r) % 2));
  moeblaze_config_set_i64(cfg, MOEBLAZE_ATTR_NORMALIZE_TOPK, pick(r, u8(r) % 2));
  moeblaze_config_set_i64(cfg, MOEBLAZE_ATTR_SAVE_POLICY, pick(r, u8(r) % 3));
  moeblaze_config_set_i64(cfg, MOEBLAZE_ATTR_NUM_THREADS, pick(r, 1 + u8(r) % 4)); /* 1 by default: fast */
  moeblaze_config_set_f64(cfg, MOEBLAZE_ATTR_AUX_LOSS_COEFF, u8(r) % 3 == 1 ? 0.01 : (u8(r) == 7 ? NAN : 0.0));
  moeblaze_config_set_f64(cfg, MOEBLAZE_ATTR_Z_LOSS_COEFF, u8(r) % 3 == 1 ? 0.001 : (u8(r) == 7 ? -INFINITY : 0.0));
  if (u8(r) % 4 == 1) {  /* the routing options of current models (docs/routing.md) */
    moeblaze_config_set_i64(cfg, MOEBLAZE_ATTR_NUM_EXPERT_GROUPS, pick(r, ly->E % 2 ? 1 : 2));
    moeblaze_config_set_i64(cfg, MOEBLAZE_ATTR_TOPK_GROUPS, pick(r, 1));
    moeblaze_config_set_f64(cfg, MOEBLAZE_ATTR_ROUTE_SCALE, (double)pick(r, 5) / 2.0);
    moeblaze_config_set_i64(cfg, MOEBLAZE_ATTR_AUX_LOSS_FORM, u8(r) % 3);
  }
  moeblaze_config_set_dtype(cfg, MOEBLAZE_ATTR_ACTIVATION_DTYPE, ly->at);
  moeblaze_config_set_dtype(cfg, MOEBLAZE_ATTR_WEIGHT_DTYPE, ly->wt);
  /* free-form attribute writes and reads, any attribute number, any setter */
  for (int n = u8(r) % 4; n > 0; --n) {
    const int32_t attr = (int32_t)u8(r) - 2;
    int64_t v;
    double f;
    moeblaze_dtype_t t;
    switch (u8(r) % 6) {
      case 0: moeblaze_config_set_i64(cfg, (moeblaze_attr_t)attr, pick(r, 1)); break;
      case 1: moeblaze_config_set_f64(cfg, (moeblaze_attr_t)attr, (double)pick(r, 1) / 3.0); break;
      case 2: moeblaze_config_set_dtype(cfg, (moeblaze_attr_t)attr, kDtypes[u8(r) % 6]); break;
      case 3: moeblaze_config_get_i64(cfg, (moeblaze_attr_t)attr, &v); break;
      case 4: moeblaze_config_get_f64(cfg, (moeblaze_attr_t)attr, &f); break;
      default: moeblaze_config_get_dtype(cfg, (moeblaze_attr_t)attr, &t); break;
    }
  }
  moeblaze_handle_t h = NULL;
  moeblaze_create(&h, cfg);
  moeblaze_config_destroy(cfg);
  if (h) {  /* the handle's effective values are what the arguments must match */
    moeblaze_handle_get_i64(h, MOEBLAZE_ATTR_NUM_EXPERTS, &ly->E);
    moeblaze_handle_get_i64(h, MOEBLAZE_ATTR_TOP_K, &ly->k);
    moeblaze_handle_get_i64(h, MOEBLAZE_ATTR_HIDDEN_SIZE, &ly->d);
    moeblaze_handle_get_i64(h, MOEBLAZE_ATTR_FFN_HIDDEN_SIZE, &ly->h);
    int64_t a = 0;
    moeblaze_handle_get_i64(h, MOEBLAZE_ATTR_ACTIVATION, &a);
    ly->gh = (a == MOEBLAZE_ACTIVATION_SWIGLU || a == MOEBLAZE_ACTIVATION_GEGLU ? 2 : 1) * ly->h;
  }
  return h;
}

/* ---- arguments ---- */
/* One argument; shape/strides pointers are bound to this slot's arrays by bind() just before
 * a call, since mutations copy slots around. */
typedef struct slot {
  moeblaze_arg_t a;
  int64_t shape[8], strides[8];
  int no_shape, has_strides;
  size_t misalign;
} slot;

static int shape_of(const layer* ly, int32_t kind, int64_t* s) {
  const int64_t L = ly->L, E = ly->E, d = ly->d, h = ly->h, k = ly->k;
  switch (kind) {
    case MOEBLAZE_ARG_INPUT: case MOEBLAZE_ARG_OUTPUT: case MOEBLAZE_ARG_GRAD_OUTPUT: case MOEBLAZE_ARG_GRAD_INPUT:
      s[0] = L; s[1] = d; return 2;
    case MOEBLAZE_ARG_ROUTER_WEIGHT: case MOEBLAZE_ARG_GRAD_ROUTER_WEIGHT: s[0] = E; s[1] = d; return 2;
    case MOEBLAZE_ARG_ROUTER_LOGITS: case MOEBLAZE_ARG_GRAD_ROUTER_LOGITS: s[0] = L; s[1] = E; return 2;
    case MOEBLAZE_ARG_W_GATE_UP: case MOEBLAZE_ARG_GRAD_W_GATE_UP: s[0] = E; s[1] = d; s[2] = ly->gh; return 3;
    case MOEBLAZE_ARG_W_DOWN: case MOEBLAZE_ARG_GRAD_W_DOWN: s[0] = E; s[1] = h; s[2] = d; return 3;
    case MOEBLAZE_ARG_TOPK_INDICES: case MOEBLAZE_ARG_TOPK_WEIGHTS: case MOEBLAZE_ARG_GRAD_TOPK_WEIGHTS:
      s[0] = L; s[1] = k; return 2;
    case MOEBLAZE_ARG_TOKENS_PER_EXPERT: case MOEBLAZE_ARG_EXPERT_BIAS: s[0] = E; return 1;
    case MOEBLAZE_ARG_SEQUENCE_LENGTHS: s[0] = ly->seqs; return 1;
    case MOEBLAZE_ARG_TOKEN_MASK: s[0] = L; return 1;
    default: return 0;  /* scalars */
  }
}

static moeblaze_dtype_t dtype_of(const layer* ly, int32_t kind) {
  static const moeblaze_dtype_t f32 = {2, 32, 1}, i32 = {0, 32, 1}, i64 = {0, 64, 1};
  switch (kind) {
    case MOEBLAZE_ARG_INPUT: case MOEBLAZE_ARG_OUTPUT: case MOEBLAZE_ARG_GRAD_OUTPUT: case MOEBLAZE_ARG_GRAD_INPUT: return ly->at;
    case MOEBLAZE_ARG_ROUTER_WEIGHT: case MOEBLAZE_ARG_GRAD_ROUTER_WEIGHT: case MOEBLAZE_ARG_W_GATE_UP:
    case MOEBLAZE_ARG_GRAD_W_GATE_UP: case MOEBLAZE_ARG_W_DOWN: case MOEBLAZE_ARG_GRAD_W_DOWN: return ly->wt;
    case MOEBLAZE_ARG_TOPK_INDICES: return ly->caller_i64 ? i64 : i32;
    case MOEBLAZE_ARG_TOKENS_PER_EXPERT: case MOEBLAZE_ARG_TOKEN_MASK: return i32;
    case MOEBLAZE_ARG_SEQUENCE_LENGTHS: return i64;
    default: return f32;
  }
}

static void add(slot* s, size_t* n, const layer* ly, int32_t kind) {
  if (*n == kMaxArgs) return;
  slot* x = &s[(*n)++];
  memset(x, 0, sizeof *x);
  x->a.kind = kind;
  x->a.tensor.device.device_type = MOEBLAZE_DEVICE_CPU;
  x->a.tensor.ndim = shape_of(ly, kind, x->shape);
  x->a.tensor.dtype = dtype_of(ly, kind);
}

/* The canonical argument list of a call: mode 0 logits, 1 router weight, 2 caller top-k; extras
 * (bits): 1 EXPERT_BIAS, 2 SEQUENCE_LENGTHS, 4 TOKEN_MASK. */
static size_t canonical(slot* s, const layer* ly, int pass, int mode, int extras) {
  size_t n = 0;
  const int fwd = pass == MOEBLAZE_PASS_FORWARD_TRAINING || pass == MOEBLAZE_PASS_FORWARD_INFERENCE;
  if (pass != MOEBLAZE_PASS_ROUTE || mode == 1) add(s, &n, ly, MOEBLAZE_ARG_INPUT);
  if (mode == 0) add(s, &n, ly, MOEBLAZE_ARG_ROUTER_LOGITS);
  if (mode == 1) add(s, &n, ly, MOEBLAZE_ARG_ROUTER_WEIGHT);
  if (pass != MOEBLAZE_PASS_ROUTE) {
    add(s, &n, ly, MOEBLAZE_ARG_W_GATE_UP);
    add(s, &n, ly, MOEBLAZE_ARG_W_DOWN);
  }
  if (mode == 2 || pass == MOEBLAZE_PASS_ROUTE) {
    add(s, &n, ly, MOEBLAZE_ARG_TOPK_INDICES);
    add(s, &n, ly, MOEBLAZE_ARG_TOPK_WEIGHTS);
  }
  if ((extras & 1) && mode != 2) add(s, &n, ly, MOEBLAZE_ARG_EXPERT_BIAS);
  if (extras & 2) add(s, &n, ly, MOEBLAZE_ARG_SEQUENCE_LENGTHS);
  if (extras & 4) add(s, &n, ly, MOEBLAZE_ARG_TOKEN_MASK);
  if (fwd) {
    add(s, &n, ly, MOEBLAZE_ARG_OUTPUT);
    add(s, &n, ly, MOEBLAZE_ARG_TOKENS_PER_EXPERT);
    if (mode != 2) { add(s, &n, ly, MOEBLAZE_ARG_AUX_LOSS); add(s, &n, ly, MOEBLAZE_ARG_Z_LOSS); }
  }
  if (pass == MOEBLAZE_PASS_BACKWARD) {
    add(s, &n, ly, MOEBLAZE_ARG_GRAD_OUTPUT);
    add(s, &n, ly, MOEBLAZE_ARG_GRAD_INPUT);
    add(s, &n, ly, MOEBLAZE_ARG_GRAD_W_GATE_UP);
    add(s, &n, ly, MOEBLAZE_ARG_GRAD_W_DOWN);
    add(s, &n, ly, MOEBLAZE_ARG_GRAD_TOPK_WEIGHTS);
    if (mode == 0) add(s, &n, ly, MOEBLAZE_ARG_GRAD_ROUTER_LOGITS);
    if (mode == 1) add(s, &n, ly, MOEBLAZE_ARG_GRAD_ROUTER_WEIGHT);
    if (mode != 2) add(s, &n, ly, MOEBLAZE_ARG_GRAD_AUX_LOSS);
  }
  return n;
}

static const int32_t kKinds[] = {1, 2, 3, 5, 6, 7, 8, 9, 10, 32, 33, 34, 35, 36, 64, 65, 66, 96, 97, 98, 100, 101, 102, 0, 4, 99, -5};

static void mutate(rd* r, slot* s, size_t* n) {
  for (int m = u8(r) % 5; m > 0 && *n > 0; --m) {
    slot* x = &s[u8(r) % *n];
    switch (u8(r) % 13) {
      case 0: *x = s[--*n]; break;                                             /* drop */
      case 1: if (*n < kMaxArgs) s[(*n)++] = *x; break;                        /* duplicate */
      case 2: x->a.kind = kKinds[u8(r) % (sizeof kKinds / sizeof kKinds[0])]; break;
      case 3: x->a.flags = (uint32_t)u8(r) << (u8(r) % 32); break;
      case 4: x->a.tensor.ndim = (int32_t)(u8(r) % 9) - (u8(r) == 9 ? 3 : 0); break;
      case 5: x->shape[u8(r) % 8] = pick(r, 1); break;
      case 6:
        if (!x->has_strides) {  /* start from the contiguous strides */
          int64_t c = 1;
          for (int i = x->a.tensor.ndim - 1; i >= 0 && i < 8; --i) {  /* wraps on purpose for huge shapes */
            x->strides[i] = c;
            c = (int64_t)((uint64_t)c * (uint64_t)(x->shape[i] > 0 ? x->shape[i] : 1));
          }
        }
        x->strides[u8(r) % 8] = pick(r, 1);
        x->has_strides = 1;
        break;
      case 7: x->a.tensor.dtype = kDtypes[u8(r) % 6]; break;
      case 8: x->a.tensor.device.device_type = (int32_t)u8(r) % 4; x->a.tensor.device.device_id = (int32_t)pick(r, 0); break;
      case 9: {
        static const uint64_t offs[] = {1, 2, 3, 4, 64, (uint64_t)1 << 57, (uint64_t)1 << 62, ~(uint64_t)0,
                                        ~(uint64_t)0 - 255, (uint64_t)INT64_MAX};
        x->a.tensor.byte_offset = offs[u8(r) % 10];
        break;
      }
      case 10: x->no_shape = 1; break;
      case 12:  /* append the asynchronous STATUS output (an I32 scalar) */
        if (*n < kMaxArgs) {
          slot* st = &s[(*n)++];
          memset(st, 0, sizeof *st);
          st->a.kind = MOEBLAZE_ARG_STATUS;
          st->a.tensor.device.device_type = MOEBLAZE_DEVICE_CPU;
          st->a.tensor.dtype = (moeblaze_dtype_t){0, 32, 1};
        }
        break;
      default: x->misalign = 1 + u8(r) % 3; break;
    }
  }
}

/* ---- buffers for the arguments ---- */
/* Bytes the descriptor covers from data + byte_offset; 0 when it is malformed (the library must
 * reject it, so a small buffer is given); SIZE_MAX when too large to allocate here. */
static size_t extent(const slot* x) {
  const moeblaze_tensor_t* t = &x->a.tensor;
  if (x->no_shape && t->ndim > 0) return 0;
  if (t->ndim < 0 || t->ndim > 8 || t->dtype.bits == 0 || t->dtype.bits % 8 || t->dtype.lanes == 0) return 0;
  __int128 last = 0, contiguous = 1;
  for (int i = t->ndim - 1; i >= 0; --i) {
    if (x->shape[i] < 0) return 0;
    if (x->shape[i] == 0) return 16;
    const __int128 st = x->has_strides ? (x->strides[i] < 0 ? -(__int128)x->strides[i] : x->strides[i]) : contiguous;
    last += (__int128)(x->shape[i] - 1) * st;
    contiguous *= x->shape[i];
    if (last > (__int128)kCap || contiguous > (__int128)kCap) return SIZE_MAX;
  }
  const __int128 bytes = (last + 1) * (t->dtype.bits / 8) * t->dtype.lanes;
  return bytes > (__int128)kCap ? SIZE_MAX : (size_t)bytes;
}

typedef struct rng { uint64_t s; } rng;
static uint32_t next(rng* g) {
  g->s = g->s * 6364136223846793005ull + 1442695040888963407ull;
  return (uint32_t)(g->s >> 33);
}

/* Fills a buffer with small values of the descriptor's dtype (valid distinct ids for
 * TOPK_INDICES), then plants the input's specials: NaN, Inf, out-of-range or repeated ids. */
static void fill(rd* r, rng* g, const slot* x, unsigned char* data, size_t bytes, const layer* ly) {
  const moeblaze_dtype_t t = x->a.tensor.dtype;
  const size_t es = t.bits / 8 ? t.bits / 8 : 1, n = bytes / es;
  const int32_t kind = x->a.kind;
  for (size_t i = 0; i < n; ++i) {
    unsigned char* at = data + i * es;
    if (t.code == 0) {  /* integers: ids; sequence lengths splitting L; a mask keeping 2 of 3 */
      int64_t id = ((int64_t)(i / (size_t)ly->k) + (int64_t)(i % (size_t)ly->k)) % ly->E;
      if (kind == MOEBLAZE_ARG_SEQUENCE_LENGTHS) {
        const int64_t B = ly->seqs > 0 ? ly->seqs : 1, q = (int64_t)i;
        id = ly->L / B + (q < ly->L % B ? 1 : 0);
      } else if (kind == MOEBLAZE_ARG_TOKEN_MASK) {
        id = i % 3 != 1;
      }
      if (es == 8) memcpy(at, &id, 8);
      else if (es == 4) { int32_t v = (int32_t)id; memcpy(at, &v, 4); }
      else memset(at, (int)id, es);
    } else if (es == 4) {
      float v = ((float)(next(g) % 2001) - 1000.f) / 1000.f;
      memcpy(at, &v, 4);
    } else if (es == 2) {
      uint16_t v = (uint16_t)(t.code == 4 ? 0x3c00 + next(g) % 0x300 : 0x3000 + next(g) % 0x0c00);
      v |= (uint16_t)((next(g) & 1) << 15);
      memcpy(at, &v, 2);
    } else {
      memset(at, (int)(next(g) & 0x3f), es);
    }
  }
  for (int m = u8(r) % 3; m > 0 && n > 0; --m) {
    unsigned char* at = data + (size_t)(u8(r) % n) * es;
    static const float fs[3] = {NAN, INFINITY, -INFINITY};
    static const uint16_t hs[2][3] = {{0x7e00, 0x7c00, 0xfc00}, {0x7fc0, 0x7f80, 0xff80}};
    const int which = u8(r) % 3;
    if (t.code == 0) {
      const int64_t id = pick(r, ly->E);
      if (es == 8) memcpy(at, &id, 8);
      else if (es == 4) { int32_t v = (int32_t)id; memcpy(at, &v, 4); }
    } else if (es == 4) {
      memcpy(at, &fs[which], 4);
    } else if (es == 2) {
      memcpy(at, &hs[t.code == 4][which], 2);
    }
  }
}

/* Binds pointers and gives every argument a guarded buffer. Returns 0 when some descriptor is
 * too large to back with memory (the call is then only checked, never run). */
static int back(rd* r, rng* g, pool* p, slot* s, size_t n, const layer* ly) {
  int runnable = 1;
  for (size_t i = 0; i < n; ++i) {
    slot* x = &s[i];
    x->a.tensor.shape = x->no_shape ? NULL : x->shape;
    x->a.tensor.strides = x->has_strides ? x->strides : NULL;
    size_t bytes = extent(x);
    if (bytes == SIZE_MAX) {
      runnable = 0;
      x->a.tensor.data = (void*)(uintptr_t)0x1000; /* never dereferenced: check_args only */
      continue;
    }
    const uint64_t off = x->a.tensor.byte_offset;
    const size_t lead = off <= 4096 ? (size_t)off : 0; /* larger offsets must be rejected */
    unsigned char* d = alloc(p, lead + (bytes ? bytes : 64), x->misalign);
    if (!d) return 0;
    fill(r, g, x, d + lead, bytes, ly);
    x->a.tensor.data = d;
  }
  return runnable;
}

static moeblaze_arg_t flat[kMaxArgs];
static const moeblaze_arg_t* args_of(const slot* s, size_t n) {
  for (size_t i = 0; i < n; ++i) flat[i] = s[i].a;
  return flat;
}

/* A workspace or saved buffer for `need` bytes: exact, one short, NULL, or misaligned. */
static void* scratch(rd* r, pool* p, size_t need, size_t* bytes) {
  const int how = u8(r) % 6;
  if (need > kCap * 4) { *bytes = 0; return NULL; }
  *bytes = how == 1 && need > 0 ? need - 1 : need;
  if (how == 2) return NULL;
  return alloc(p, *bytes ? *bytes : 1, how == 3 ? 8 : 0);
}

int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  rd r = {data, size, 0};
  layer ly;
  memset(&ly, 0, sizeof ly);
  moeblaze_handle_t h = make_handle(&r, &ly);
  if (!h) return 0;
  pool p = {{{0}}, 0};
  rng g = {0x9e3779b97f4a7c15ull ^ size};
  void* saved = NULL;  /* the last training forward's saved buffer */
  size_t saved_bytes = 0;
  for (int call = 1 + u8(&r) % 3; call > 0; --call) {
    const int op = u8(&r) % 6, mode = u8(&r) % 3;
    ly.caller_i64 = u8(&r) % 2;
    ly.L = pick(&r, ly.L);
    const int extras = u8(&r) % 8;
    ly.seqs = ly.L > 0 ? 1 + u8(&r) % (ly.L < 4 ? ly.L : 4) : 1;
    slot s[kMaxArgs];
    size_t n = 0, ws_bytes = 0, need = 0;
    if (op == 4) {  /* check_args: any pass value, any arguments, no data read */
      const int pass = (int)pick(&r, u8(&r) % 5);
      n = canonical(s, &ly, pass == MOEBLAZE_PASS_BACKWARD_LAST_USE ? MOEBLAZE_PASS_BACKWARD : pass < 0 || pass > 3 ? 0 : pass,
                    mode, extras);
      mutate(&r, s, &n);
      back(&r, &g, &p, s, n, &ly);
      moeblaze_check_args(h, (moeblaze_pass_t)pass, args_of(s, n), n);
    } else if (op == 5) {  /* size queries with any pass and token count */
      size_t b;
      moeblaze_get_workspace_size(h, (moeblaze_pass_t)pick(&r, u8(&r) % 5), pick(&r, ly.L), &b);
      moeblaze_get_saved_size(h, pick(&r, ly.L), &b);
    } else {
      const int pass = op == 1 ? MOEBLAZE_PASS_FORWARD_INFERENCE : op == 2 ? MOEBLAZE_PASS_ROUTE
                     : op == 3 ? MOEBLAZE_PASS_BACKWARD : MOEBLAZE_PASS_FORWARD_TRAINING;
      n = canonical(s, &ly, pass, mode, extras);
      mutate(&r, s, &n);
      const int runnable = back(&r, &g, &p, s, n, &ly);
      const moeblaze_arg_t* a = args_of(s, n);
      /* the compute stays small: the instrumented CPU engine is slow, and the API surface, not
       * the arithmetic, is what is being fuzzed */
      const double work = (double)ly.L * (double)ly.k * (double)ly.d * (double)(ly.gh + ly.h) + (double)ly.L * (double)ly.E;
      if (!runnable || ly.L < 0 || work > (double)(1 << 21) || moeblaze_get_workspace_size(h, (moeblaze_pass_t)pass, ly.L, &need)) {
        moeblaze_check_args(h, (moeblaze_pass_t)pass, a, n);
      } else {
        void* ws = scratch(&r, &p, need, &ws_bytes);
        if (pass == MOEBLAZE_PASS_ROUTE) {
          moeblaze_route(h, a, n, ws, ws_bytes, NULL);
        } else if (pass == MOEBLAZE_PASS_BACKWARD) {
          size_t sneed = 0;
          if (!saved && moeblaze_get_saved_size(h, ly.L, &sneed) == MOEBLAZE_STATUS_SUCCESS)
            saved = scratch(&r, &p, sneed, &saved_bytes);
          if (u8(&r) & 1) moeblaze_backward_last_use(h, a, n, saved, saved_bytes, ws, ws_bytes, NULL);
          else moeblaze_backward(h, a, n, saved, saved_bytes, ws, ws_bytes, NULL);
        } else {
          size_t sneed = 0;
          if (pass == MOEBLAZE_PASS_FORWARD_TRAINING && moeblaze_get_saved_size(h, ly.L, &sneed) == MOEBLAZE_STATUS_SUCCESS)
            saved = scratch(&r, &p, sneed, &saved_bytes);
          moeblaze_forward(h, (moeblaze_pass_t)pass, a, n, ws, ws_bytes, saved, saved_bytes, NULL);
          check_canaries(&p);
          if (pass == MOEBLAZE_PASS_FORWARD_TRAINING && saved) {
            /* then backward, on the saved buffer as it is or made foreign */
            switch (u8(&r) % 5) {
              case 1: memset(saved, 0, saved_bytes); break;
              case 2: memset(saved, 0xff, saved_bytes); break;
              case 3: for (size_t i = 0; i < saved_bytes; ++i) ((unsigned char*)saved)[i] = u8(&r); break;
              case 4:
                for (int f = 1 + u8(&r) % 4; f > 0 && saved_bytes; --f)
                  ((unsigned char*)saved)[(size_t)u64(&r) % saved_bytes] ^= (unsigned char)(1u << (u8(&r) % 8));
                break;
              default: break;
            }
            slot b[kMaxArgs];
            size_t nb = canonical(b, &ly, MOEBLAZE_PASS_BACKWARD, mode, extras);
            mutate(&r, b, &nb);
            size_t bneed = 0, bws_bytes = 0;
            const int last_use = u8(&r) & 1; /* the saved buffer's last use, in its own (smaller) workspace */
            if (back(&r, &g, &p, b, nb, &ly) &&
                moeblaze_get_workspace_size(h, last_use ? MOEBLAZE_PASS_BACKWARD_LAST_USE : MOEBLAZE_PASS_BACKWARD, ly.L,
                                            &bneed) == MOEBLAZE_STATUS_SUCCESS) {
              void* bws = scratch(&r, &p, bneed, &bws_bytes);
              if (last_use) moeblaze_backward_last_use(h, args_of(b, nb), nb, saved, saved_bytes, bws, bws_bytes, NULL);
              else moeblaze_backward(h, args_of(b, nb), nb, saved, saved_bytes, bws, bws_bytes, NULL);
              check_canaries(&p);
              /* and once more on the same buffer: refused if that was its last use */
              if (u8(&r) % 4 == 0) moeblaze_backward(h, args_of(b, nb), nb, saved, saved_bytes, bws, bws_bytes, NULL);
            }
          }
        }
      }
    }
    check_canaries(&p);
    (void)moeblaze_get_last_error_message();
  }
  moeblaze_destroy(h);
  free_pool(&p);
  return 0;
}
