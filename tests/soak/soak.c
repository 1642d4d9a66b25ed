/* Soak: many forward + backward steps on one handle with the same buffers, reporting host RSS
 * (and, on CUDA, device memory in use) after a warm-up and at the end. Any growth fails: the
 * library allocates nothing per call that it does not free.
 * Usage: soak [--device cpu|cuda] [--steps N]    (exit 0: no growth; 1: growth or a failure) */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "moe_step.h"
#include "test_util.h"
#ifdef MOEBLAZE_SOAK_CUDA
#include <cuda_runtime.h>

#include "moe_step_cuda.h"
#endif

enum { L0 = 64, E0 = 8, K0 = 2, D0 = 32, H0 = 48, WARMUP = 200 };

static long rss_kib(void) {
  FILE* f = fopen("/proc/self/statm", "r");
  long pages = 0, resident = 0;
  if (!f) return -1;
  if (fscanf(f, "%ld %ld", &pages, &resident) != 2) resident = -1;
  fclose(f);
  return resident * (sysconf(_SC_PAGESIZE) / 1024);
}

static long device_used_kib(int cuda) {
#ifdef MOEBLAZE_SOAK_CUDA
  if (cuda) {
    size_t free_b = 0, total = 0;
    cudaDeviceSynchronize();
    if (cudaMemGetInfo(&free_b, &total) != cudaSuccess) return -1;
    return (long)((total - free_b) / 1024);
  }
#endif
  (void)cuda;
  return 0;
}

int main(int argc, char** argv) {
  int cuda = 0;
  long steps = 10000;
  for (int i = 1; i < argc; ++i) {
    if (!strcmp(argv[i], "--device") && i + 1 < argc) cuda = !strcmp(argv[++i], "cuda");
    else if (!strcmp(argv[i], "--steps") && i + 1 < argc) steps = atol(argv[++i]);
    else { fprintf(stderr, "usage: soak [--device cpu|cuda] [--steps N]\n"); return 2; }
  }
  tu_layer l = tu_layer_default(E0, K0, D0, H0, L0, MOEBLAZE_ACTIVATION_SWIGLU);
  moeblaze_handle_t h = NULL;
  moeblaze_status_t st;
#ifndef MOEBLAZE_SOAK_CUDA
  if (cuda) {
    fprintf(stderr, "soak: built without CUDA\n");
    return 77;
  }
#endif
  st = tu_create_on(&l, cuda ? MOEBLAZE_DEVICE_CUDA : MOEBLAZE_DEVICE_CPU, &h);
  if (st != MOEBLAZE_STATUS_SUCCESS) {
    fprintf(stderr, "soak: create: %s\n", moeblaze_get_last_error_message());
    return 1;
  }
  ms_problem p;
  ms_init(&p, h, L0, E0, K0, D0, H0, 1, 12345);
  moeblaze_arg_t fa[8], ba[10];
  const size_t nf = ms_forward_args(&p, fa), nb = ms_backward_args(&p, ba);
  void* ws = p.ws;
  void* saved = p.saved;
#ifdef MOEBLAZE_SOAK_CUDA
  ms_mirror m;
  if (cuda) {
    if (ms_mirror_create(&p, &m)) return 1;
    ms_mirror_args(&m, fa, nf);
    ms_mirror_args(&m, ba, nb);
    ws = ms_mirror_of(&m, p.ws);
    saved = ms_mirror_of(&m, p.saved);
  }
#endif
  long rss0 = 0, dev0 = 0;
  for (long s = 0; s < steps + WARMUP; ++s) {
    if (s == WARMUP) {
      rss0 = rss_kib();
      dev0 = device_used_kib(cuda);
    }
    st = moeblaze_forward(h, MOEBLAZE_PASS_FORWARD_TRAINING, fa, nf, ws, p.ws_bytes, saved, p.saved_bytes, NULL);
    if (st == MOEBLAZE_STATUS_SUCCESS) st = moeblaze_backward(h, ba, nb, saved, p.saved_bytes, ws, p.ws_bytes, NULL);
    if (st != MOEBLAZE_STATUS_SUCCESS) {
      fprintf(stderr, "soak: step %ld: %s\n", s, moeblaze_get_last_error_message());
      return 1;
    }
  }
  const long rss1 = rss_kib(), dev1 = device_used_kib(cuda);
  printf("soak (%s): %ld forward+backward steps after %d warm-up: host RSS %ld -> %ld KiB (%+ld), device in use %ld -> %ld KiB (%+ld)\n",
         cuda ? "cuda" : "cpu", steps, WARMUP, rss0, rss1, rss1 - rss0, dev0, dev1, dev1 - dev0);
  /* Allow for allocator noise well under one page per 100 steps; a per-call leak of even a
   * few bytes times 10,000 calls exceeds it. */
  const int grew = rss1 - rss0 > 256 || dev1 - dev0 > 0;
#ifdef MOEBLAZE_SOAK_CUDA
  if (cuda) ms_mirror_free(&m);
#endif
  ms_free(&p);
  moeblaze_destroy(h);
  if (grew) fprintf(stderr, "soak: memory grew\n");
  return grew ? 1 : 0;
}
