// Timing helpers of the C++ microbenchmarks in perf/ (plan-bench, router-bench): a CUDA call
// checked with exit on failure, and the median of CUDA-event timings of an enqueued step.
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <vector>

#define CK(call)                                                                   \
  do {                                                                             \
    cudaError_t e_ = (call);                                                       \
    if (e_ != cudaSuccess) {                                                       \
      std::fprintf(stderr, "%s: %s\n", #call, cudaGetErrorString(e_));             \
      std::exit(1);                                                                \
    }                                                                              \
  } while (0)

// The median milliseconds of f() on stream s over reps timed runs, after three untimed ones.
template <class F>
double median_ms(F&& f, cudaStream_t s, int reps) {
  cudaEvent_t a, b;
  CK(cudaEventCreate(&a));
  CK(cudaEventCreate(&b));
  std::vector<double> t;
  for (int r = -3; r < reps; ++r) {
    CK(cudaEventRecord(a, s));
    f();
    CK(cudaEventRecord(b, s));
    CK(cudaEventSynchronize(b));
    float ms = 0.f;
    CK(cudaEventElapsedTime(&ms, a, b));
    if (r >= 0) t.push_back(ms);
  }
  CK(cudaEventDestroy(a));
  CK(cudaEventDestroy(b));
  std::sort(t.begin(), t.end());
  return t[t.size() / 2];
}
