/* Device mirrors of an ms_problem (moe_step.h) for the CUDA tests: every buffer copied to a
 * cudaMalloc'd twin with 256 guard bytes of 0xA5, and argument lists re-pointed to the twins. */
#ifndef MOEBLAZE_MOE_STEP_CUDA_H_
#define MOEBLAZE_MOE_STEP_CUDA_H_

#include "moe_step.h"

typedef struct ms_mirror {
  void* dev[32];
  const void* host[32];
  size_t bytes[32];
  int n;
} ms_mirror;

/* 0 on success. */
int ms_mirror_create(const ms_problem* p, ms_mirror* m);
void ms_mirror_free(ms_mirror* m);
/* The device twin of host buffer `host` (NULL if it has none). */
void* ms_mirror_of(const ms_mirror* m, const void* host);
/* Re-points every argument whose data is a mirrored host buffer, and marks it CUDA device 0. */
void ms_mirror_args(const ms_mirror* m, moeblaze_arg_t* a, size_t n);
/* Device -> host copies of every buffer (results back for comparison). 0 on success. */
int ms_mirror_download(const ms_mirror* m);
/* 1 when every device twin's guard bytes are intact. */
int ms_mirror_guards_intact(const ms_mirror* m);

#endif
