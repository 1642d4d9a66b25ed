// A random grouped-GEMM problem on the device and its independent reference, shared by
// tests/kernels/test_sm90_grouped_gemm (correctness) and perf/grouped-gemm-bench (timing): a
// routing (expert row counts, uniform or skewed), a gather index list, bf16/fp16 operands drawn
// fresh from a seeded generator, outputs poisoned with NaN, and a naive fp32 GEMM kernel that
// reads the same operands through the plain definition of the problem (no tiles, no smem).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <vector>

#include "math/activation.hpp"
#include "gemm/sm90/grouped_gemm.hpp"
#include "util/dtype.hpp"

namespace ggp {

using namespace moeblaze;
using gemm::sm90::Major;

#define GGP_CK(call)                                                                               \
  do {                                                                                             \
    cudaError_t e_ = (call);                                                                       \
    if (e_ != cudaSuccess) {                                                                       \
      std::fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #call, cudaGetErrorString(e_));   \
      std::exit(1);                                                                                \
    }                                                                                              \
  } while (0)

// Device 0 is a Hopper GPU (the kernel's only target); fills *prop when it is.
inline bool have_sm90(cudaDeviceProp* prop) {
  int n = 0;
  return cudaGetDeviceCount(&n) == cudaSuccess && n > 0 && cudaGetDeviceProperties(prop, 0) == cudaSuccess &&
         prop->major == 9;
}

// The kernel tests' start: without an sm_90 GPU the test is skipped (exit code 77, ctest's
// SKIP_RETURN_CODE).
inline void skip_without_sm90() {
  cudaDeviceProp prop;
  if (have_sm90(&prop)) return;
  std::printf("no sm_90 GPU: skipped\n");
  std::exit(77);
}

inline uint16_t to_half_bits(float f, DType dt) {
  if (dt == DType::kBF16) return f32_to_bf16(f);
  __half h = __float2half_rn(f);
  uint16_t u;
  std::memcpy(&u, &h, 2);
  return u;
}
inline float from_half_bits(uint16_t u, DType dt) {
  if (dt == DType::kBF16) return bf16_to_f32(u);
  __half h;
  std::memcpy(&h, &u, 2);
  return __half2float(h);
}

struct Shape {
  int64_t m_total;  // rows (L k)
  int64_t a_rows;   // rows of A (tokens L when gathered)
  int32_t E, n, k;  // n: output columns (gated: per half)
  bool gated, gather;
  Major b_major;
  double skew;      // 0: uniform routing; s > 0: expert e gets weight (e + 1)^-s; < 0: all on expert 0, odd experts empty
};

// out[e] rows per expert, summing to m_total.
inline std::vector<int32_t> make_counts(const Shape& s, std::mt19937_64& rng) {
  std::vector<int32_t> c(s.E, 0);
  if (s.skew < 0) {
    c[0] = static_cast<int32_t>(s.m_total);
    return c;
  }
  std::vector<double> w(s.E);
  for (int e = 0; e < s.E; ++e) w[e] = s.skew == 0 ? 1.0 : std::pow(e + 1.0, -s.skew);
  std::discrete_distribution<int> pick(w.begin(), w.end());
  for (int64_t i = 0; i < s.m_total; ++i) ++c[pick(rng)];
  return c;
}

struct Problem {
  Shape s;
  DType dt;
  int64_t b_cols;  // columns of each B as stored when kMN (gated: 2n); rows when kK
  std::vector<int32_t> offsets;
  int32_t *d_offsets = nullptr, *d_index = nullptr;
  void *d_a = nullptr, *d_b = nullptr;
  float* d_ref = nullptr;    // [m_total, ncols] fp32 reference of the raw product
  float* d_scale = nullptr;  // [m_total] row scales
  void* d_sched = nullptr;
  gemm::sm90::Schedule sched;

  int64_t ncols() const { return s.gated ? 2 * s.n : s.n; }
  int64_t ldb() const { return s.b_major == Major::kMN ? ncols() : s.k; }
  int64_t b_stride() const { return static_cast<int64_t>(s.k) * ncols(); }

  gemm::sm90::GroupedGemmParams params() const {
    gemm::sm90::GroupedGemmParams p;
    p.sched = sched;
    p.n = s.n;
    p.k = s.k;
    p.gated = s.gated;
    p.b_major = s.b_major;
    p.a = d_a;
    p.lda = s.k;
    p.a_index = s.gather ? d_index : nullptr;
    p.a_rows = static_cast<int32_t>(s.gather ? s.a_rows : s.m_total);
    p.b = d_b;
    p.ldb = ldb();
    p.b_expert_stride = b_stride();
    return p;
  }
};

template <class T>
__device__ float ld_f(const T* p) {
  if constexpr (std::is_same<T, __nv_bfloat16>::value) return __bfloat162float(*p);
  else return __half2float(*p);
}

// ref[p, c] = sum_k A[row(p), k] B_e[k, c] in fp32, for the expert e that owns row p; rows whose
// index is out of range are zero rows (the kernel's contract).
template <class T>
__global__ void reference_kernel(const T* a, const int32_t* index, int64_t a_rows, const T* b, int major_mn,
                                 int64_t ldb, int64_t b_stride, const int32_t* offsets, int E, int64_t m_total,
                                 int64_t ncols, int64_t K, float* ref) {
  const int64_t p = blockIdx.y;
  const int64_t c = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (p >= m_total || c >= ncols) return;
  int e = 0;
  while (e + 1 < E && offsets[e + 1] <= p) ++e;
  const int64_t row = index ? index[p] : p;
  float acc = 0.f;
  if (row >= 0 && row < a_rows) {
    const T* be = b + e * b_stride;
    for (int64_t kk = 0; kk < K; ++kk)
      acc = fmaf(ld_f(a + row * K + kk), ld_f(major_mn ? be + kk * ldb + c : be + c * ldb + kk), acc);
  }
  ref[p * ncols + c] = acc;
}

// Uniform values in [-scale sqrt(3), scale sqrt(3)) (variance scale^2) from a per-element hash:
// fast enough for the benchmark's GiB-sized weights.
template <class T>
__global__ void fill_hash_kernel(T* d, int64_t count, uint64_t seed, float scale) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < count;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    uint64_t z = seed + 0x9e3779b97f4a7c15ull * static_cast<uint64_t>(i + 1);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    z ^= z >> 31;
    const float u = static_cast<float>(z >> 40) * (1.f / 16777216.f) * 2.f - 1.f;
    d[i] = static_cast<T>(u * scale * 1.7320508f);
  }
}

inline void fill_random_device(void* d, int64_t count, DType dt, uint64_t seed, float scale) {
  if (dt == DType::kBF16) fill_hash_kernel<<<1024, 256>>>(static_cast<__nv_bfloat16*>(d), count, seed, scale);
  else fill_hash_kernel<<<1024, 256>>>(static_cast<__half*>(d), count, seed, scale);
  GGP_CK(cudaGetLastError());
}

inline void fill_random(void* d, int64_t count, DType dt, std::mt19937_64& rng, float scale) {
  std::normal_distribution<float> nd(0.f, scale);
  std::vector<uint16_t> h(count);
  for (auto& v : h) v = to_half_bits(nd(rng), dt);
  GGP_CK(cudaMemcpy(d, h.data(), count * 2, cudaMemcpyHostToDevice));
}

inline Problem make_problem(const Shape& s, DType dt, uint64_t seed, bool bad_indices = false, bool with_reference = true) {
  std::mt19937_64 rng(seed);
  Problem P;
  P.s = s;
  P.dt = dt;
  const std::vector<int32_t> counts = make_counts(s, rng);
  P.offsets.assign(s.E + 1, 0);
  for (int e = 0; e < s.E; ++e) P.offsets[e + 1] = P.offsets[e] + counts[e];
  std::vector<int32_t> idx(std::max<int64_t>(s.m_total, 1));
  std::uniform_int_distribution<int64_t> tok(0, std::max<int64_t>(s.a_rows - 1, 0));
  for (auto& v : idx) v = static_cast<int32_t>(tok(rng));
  if (bad_indices && s.m_total > 2) {  // the kernel must read these as zero rows
    idx[0] = -5;
    idx[s.m_total / 2] = static_cast<int32_t>(s.a_rows);
    idx[s.m_total - 1] = 0x7fffffff;
  }
  const int64_t a_rows = s.gather ? s.a_rows : s.m_total;
  GGP_CK(cudaMalloc(&P.d_offsets, sizeof(int32_t) * (s.E + 1)));
  GGP_CK(cudaMalloc(&P.d_index, sizeof(int32_t) * idx.size()));
  GGP_CK(cudaMalloc(&P.d_a, std::max<int64_t>(a_rows, 1) * s.k * 2));
  GGP_CK(cudaMalloc(&P.d_b, std::max<int64_t>(P.b_stride() * s.E, 1) * 2));
  GGP_CK(cudaMalloc(&P.d_ref, (with_reference ? std::max<int64_t>(s.m_total * P.ncols(), 1) : 1) * 4));
  GGP_CK(cudaMalloc(&P.d_scale, std::max<int64_t>(s.m_total, 1) * 4));
  GGP_CK(cudaMalloc(&P.d_sched, gemm::sm90::schedule_bytes(s.E)));
  GGP_CK(cudaMemcpy(P.d_offsets, P.offsets.data(), sizeof(int32_t) * (s.E + 1), cudaMemcpyHostToDevice));
  GGP_CK(cudaMemcpy(P.d_index, idx.data(), sizeof(int32_t) * idx.size(), cudaMemcpyHostToDevice));
  const float b_scale = 1.f / std::sqrt(static_cast<float>(std::max(s.k, 1)));
  if (with_reference) {  // the test: exact normal draws
    fill_random(P.d_a, a_rows * s.k, dt, rng, 1.f);
    fill_random(P.d_b, P.b_stride() * s.E, dt, rng, b_scale);
  } else {  // the benchmark: GiB of weights, drawn on the device
    fill_random_device(P.d_a, a_rows * s.k, dt, rng(), 1.f);
    fill_random_device(P.d_b, P.b_stride() * s.E, dt, rng(), b_scale);
  }
  std::vector<float> sc(std::max<int64_t>(s.m_total, 1));
  std::uniform_real_distribution<float> ud(0.1f, 1.f);
  for (auto& v : sc) v = ud(rng);
  GGP_CK(cudaMemcpy(P.d_scale, sc.data(), sc.size() * 4, cudaMemcpyHostToDevice));
  P.sched = gemm::sm90::make_schedule(P.d_offsets, s.E, s.m_total, P.d_sched, nullptr);
  if (s.m_total > 0 && with_reference) {
    dim3 grid(static_cast<unsigned>((P.ncols() + 127) / 128), static_cast<unsigned>(s.m_total));
    if (dt == DType::kBF16)
      reference_kernel<<<grid, 128>>>(static_cast<const __nv_bfloat16*>(P.d_a), s.gather ? P.d_index : nullptr, a_rows,
                                      static_cast<const __nv_bfloat16*>(P.d_b), s.b_major == Major::kMN, P.ldb(),
                                      P.b_stride(), P.d_offsets, s.E, s.m_total, P.ncols(), s.k, P.d_ref);
    else
      reference_kernel<<<grid, 128>>>(static_cast<const __half*>(P.d_a), s.gather ? P.d_index : nullptr, a_rows,
                                      static_cast<const __half*>(P.d_b), s.b_major == Major::kMN, P.ldb(), P.b_stride(),
                                      P.d_offsets, s.E, s.m_total, P.ncols(), s.k, P.d_ref);
    GGP_CK(cudaGetLastError());
  }
  GGP_CK(cudaDeviceSynchronize());
  return P;
}

inline void free_problem(Problem& P) {
  cudaFree(P.d_offsets); cudaFree(P.d_index); cudaFree(P.d_a); cudaFree(P.d_b);
  cudaFree(P.d_ref); cudaFree(P.d_scale); cudaFree(P.d_sched);
}

inline void* alloc_poisoned(int64_t elems) {
  void* d = nullptr;
  GGP_CK(cudaMalloc(&d, std::max<int64_t>(elems, 1) * 2));
  GGP_CK(cudaMemset(d, 0xFF, std::max<int64_t>(elems, 1) * 2));  // NaN in bf16 and fp16
  return d;
}

struct Check {
  double rel_err = 0;    // ||out - ref|| / ||ref||
  int64_t unwritten = 0; // NaN left where a value was due
  int64_t clobbered = 0; // padding columns written
};

// Compares a [m_total, ld] 16-bit output's first `cols` columns with want[m_total, cols] (host);
// columns [cols, ld) must keep the poison.
inline Check compare_bits(const std::vector<uint16_t>& h, int64_t m_total, int64_t cols, int64_t ld, DType dt,
                          const std::vector<float>& want) {
  Check c;
  double num = 0, den = 0;
  for (int64_t p = 0; p < m_total; ++p)
    for (int64_t j = 0; j < ld; ++j) {
      const float v = from_half_bits(h[p * ld + j], dt);
      if (j >= cols) {
        if (h[p * ld + j] != 0xFFFF) ++c.clobbered;
        continue;
      }
      const float w = want[p * cols + j];
      if (std::isnan(v)) ++c.unwritten;
      else num += (v - w) * double(v - w);
      den += double(w) * w;
    }
  c.rel_err = den > 0 ? std::sqrt(num / den) : std::sqrt(num);
  return c;
}
inline std::vector<uint16_t> download_bits(const void* d, int64_t elems) {
  std::vector<uint16_t> h(std::max<int64_t>(elems, 1));
  GGP_CK(cudaMemcpy(h.data(), d, elems * 2, cudaMemcpyDeviceToHost));
  return h;
}
inline Check compare(const void* d_out, int64_t m_total, int64_t cols, int64_t ld, DType dt, const std::vector<float>& want) {
  return compare_bits(download_bits(d_out, m_total * ld), m_total, cols, ld, dt, want);
}

inline std::vector<float> reference(const Problem& P) {
  std::vector<float> r(std::max<int64_t>(P.s.m_total * P.ncols(), 1));
  GGP_CK(cudaMemcpy(r.data(), P.d_ref, P.s.m_total * P.ncols() * 4, cudaMemcpyDeviceToHost));
  return r;
}

inline std::vector<float> scales(const Problem& P) {
  std::vector<float> r(std::max<int64_t>(P.s.m_total, 1));
  GGP_CK(cudaMemcpy(r.data(), P.d_scale, P.s.m_total * 4, cudaMemcpyDeviceToHost));
  return r;
}

inline float round_to(float v, DType dt) { return from_half_bits(to_half_bits(v, dt), dt); }

// What the kStore epilogue must produce (row-scaled when scaled) and what the kActivation one
// must produce (pre rounded; act from the rounded pre, rounded), from the fp32 reference.
inline std::vector<float> want_store(const Problem& P, bool scaled) {
  std::vector<float> r = reference(P), sc = scales(P);
  for (int64_t p = 0; p < P.s.m_total; ++p)
    for (int64_t j = 0; j < P.ncols(); ++j) r[p * P.ncols() + j] *= scaled ? sc[p] : 1.f;
  return r;
}
inline std::vector<float> want_act(const Problem& P, Activation a) {
  const std::vector<float> r = reference(P);
  const int64_t n = P.s.n, nc = P.ncols();
  std::vector<float> out(std::max<int64_t>(P.s.m_total * n, 1));
  for (int64_t p = 0; p < P.s.m_total; ++p)
    for (int64_t j = 0; j < n; ++j) {
      const float u = round_to(r[p * nc + j], P.dt);
      out[p * n + j] = P.s.gated ? act_fn(a, u) * round_to(r[p * nc + n + j], P.dt) : act_fn(a, u);
    }
  return out;
}

// The dact GEMM's activation-backward epilogue: dpre [m, ldc] (dact, then the activation's
// gradient in place), g act [m, ld_act] and the dg partial sums [parts, ld_dg] from the saved pre
// [., ld_pre] and the rows' gates.
inline gemm::sm90::EpilogueParams act_backward_params(Activation a, void* dpre, int64_t ldc, void* gact, int64_t ld_act,
                                                const float* gates, void* pre, int64_t ld_pre, float* dg,
                                                int64_t ld_dg) {
  gemm::sm90::EpilogueParams e;
  e.kind = gemm::sm90::EpilogueKind::kActivationBackward;
  e.activation = a;
  e.c = dpre;
  e.ldc = ldc;
  e.act = gact;
  e.ld_act = ld_act;
  e.row_scale = gates;
  e.pre = pre;
  e.ld_pre = ld_pre;
  e.dg = dg;
  e.ld_dg = ld_dg;
  return e;
}

}  // namespace ggp
