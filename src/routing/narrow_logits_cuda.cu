// The narrow router GEMM: a warp computes 32 rows of logits, two m16 tiles by one or two n8
// tiles of m16n8k16 MMAs with fp32 accumulators. Each lane reads x and W_g as 16-byte runs (8
// consecutive k) and uses them as its fragments' k pairs: for a k32 step, lane quad q holds
// columns [8q, 8q + 8) of its rows, whose pairs 0 and 1 feed the first MMA in the places of k
// pairs {2q, 2q + 1} and {2q + 8, 2q + 9}, pairs 2 and 3 the second. A and B take the same
// permutation of k, so the two MMAs sum all 32 columns once: coalesced 16-byte loads, no shared
// memory. x streams past L1 (read once); W_g stays there, read by every warp.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "cuda/chained_launch.cuh"
#include "cuda/cuda_check.hpp"
#include "routing/narrow_logits_cuda.hpp"
#include "util/align.hpp"
#include "util/dtype.hpp"

namespace moeblaze {
inline namespace v0 {
namespace routing {
namespace {

constexpr int kWarps = 8;
constexpr int kRowsPerWarp = 32;

__device__ __forceinline__ uint4 load_streaming(const void* p) {
  uint4 v;
  asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "l"(p));
  return v;
}

// c += a b for one m16n8k16 tile (a: 4 words of 16-bit pairs, b: 2).
template <bool Bf16>
__device__ __forceinline__ void mma16816(float (&c)[4], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3, uint32_t b0,
                                         uint32_t b1) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  if constexpr (Bf16) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
  } else {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
  }
#endif
}

// NT: n8 tiles, ceil(E / 8): 1 or 2 (E <= kNarrowLogitsMaxExperts). A block's warps take row
// tiles of 32 rows, `splits` warps to a tile (a power of two), warp part p of a tile its k stages
// p, p + splits, ...; the parts' sums are added in part order through shared memory, so the bits
// depend on d alone. Lane (g, q) = (lane / 4, lane % 4) owns rows g + 8 i (i < 4) of its tile and
// expert rows g + 8 j of W_g; its accumulators c[m][j] hold rows 16 m + g and 16 m + g + 8,
// columns 8 j + 2 q and 8 j + 2 q + 1.
static_assert(kNarrowLogitsMaxExperts <= 16, "the launch below instantiates one and two n8 tiles");
template <bool Bf16, int NT>
__global__ void __launch_bounds__(kWarps * 32, 2)
    narrow_logits_kernel(const uint16_t* x, int64_t ldx, const uint16_t* w, int64_t ldw, int64_t L, int32_t E,
                         int32_t d, int32_t splits, float* out) {
  cuda::wait_for_prior_grids();
  cuda::allow_next_grid();
  constexpr int kAcc = 2 * NT * 4;
  __shared__ float partial_sums[kWarps][kAcc][32];
  const int lane = threadIdx.x % 32, g = lane / 4, q = lane % 4, warp = threadIdx.x / 32;
  const int part = warp % splits;
  const int64_t r0 = (static_cast<int64_t>(blockIdx.x) * (kWarps / splits) + warp / splits) * kRowsPerWarp;
  // Rows past L and experts past E read row 0 (their sums are never stored), so that only the
  // last, partial k stage needs predicates.
  const uint16_t* xr[4];
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const int64_t r = r0 + g + 8 * i;
    xr[i] = x + (r < L ? r : 0) * ldx + 8 * q;
  }
  const uint16_t* wr[NT];
#pragma unroll
  for (int j = 0; j < NT; ++j) wr[j] = w + (8 * j + g < E ? 8 * j + g : 0) * ldw + 8 * q;
  float c[2][NT][4] = {};
  // A stage of kSteps k32 steps: its loads first, then its MMAs, so that each lane has
  // 4 kSteps 16-byte reads of x in flight.
  constexpr int kSteps = 2, kStageCols = 32 * kSteps;
  const auto stage = [&](int32_t k0, bool partial) {
    uint4 a[kSteps][4], b[kSteps][NT];
#pragma unroll
    for (int t = 0; t < kSteps; ++t) {
      const int32_t col = k0 + 32 * t;
      const bool in = !partial || col + 8 * q < d;  // d % 8 == 0: a lane's 8 columns are all in or all out
#pragma unroll
      for (int i = 0; i < 4; ++i) a[t][i] = in ? load_streaming(xr[i] + col) : make_uint4(0, 0, 0, 0);
#pragma unroll
      for (int j = 0; j < NT; ++j)
        b[t][j] = in ? __ldg(reinterpret_cast<const uint4*>(wr[j] + col)) : make_uint4(0, 0, 0, 0);
    }
#pragma unroll
    for (int t = 0; t < kSteps; ++t)
#pragma unroll
      for (int m = 0; m < 2; ++m)
#pragma unroll
        for (int j = 0; j < NT; ++j) {
          const uint4 lo = a[t][2 * m], hi = a[t][2 * m + 1];
          mma16816<Bf16>(c[m][j], lo.x, hi.x, lo.y, hi.y, b[t][j].x, b[t][j].y);
          mma16816<Bf16>(c[m][j], lo.z, hi.z, lo.w, hi.w, b[t][j].z, b[t][j].w);
        }
  };
  const int32_t full = d / kStageCols * kStageCols;
#pragma unroll 1
  for (int32_t k0 = part * kStageCols; k0 < full; k0 += splits * kStageCols) stage(k0, false);
  if (full < d && (full / kStageCols) % splits == part) stage(full, true);
  if (splits > 1) {
#pragma unroll
    for (int v = 0; v < kAcc; ++v) partial_sums[warp][v][lane] = c[v / (NT * 4)][v / 4 % NT][v % 4];
    __syncthreads();
    if (part != 0) return;
#pragma unroll
    for (int v = 0; v < kAcc; ++v) {
      float sum = c[v / (NT * 4)][v / 4 % NT][v % 4];
      for (int p = 1; p < splits; ++p) sum += partial_sums[warp + p][v][lane];
      c[v / (NT * 4)][v / 4 % NT][v % 4] = sum;
    }
  }
#pragma unroll
  for (int m = 0; m < 2; ++m)
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const int64_t r = r0 + 16 * m + g + 8 * half;
      if (r >= L) continue;
#pragma unroll
      for (int j = 0; j < NT; ++j)
#pragma unroll
        for (int col = 0; col < 2; ++col) {
          const int32_t e = 8 * j + 2 * q + col;
          if (e < E) out[r * E + e] = c[m][j][2 * half + col];
        }
    }
}

// Warps to a row tile: one below d = 2048; above, up to eight, each with two k stages or more
// (measured on an H200, perf/NOTES.md: at d = 4096-7168 and E = 8, 1.4-2.4x faster split; at
// d = 1024 and E = 16, 1.3x slower).
int32_t k_splits(int64_t d) {
  if (d < 2048) return 1;
  const int64_t stages = (d + 63) / 64;
  int32_t splits = 1;
  while (splits < kWarps && 2 * splits * 2 <= stages) splits *= 2;
  return splits;
}

template <bool Bf16>
void launch(const View& x, const View& wg, int64_t L, int64_t E, int64_t d, float* out, cudaStream_t s) {
  const auto* xp = reinterpret_cast<const uint16_t*>(x.data);
  const auto* wp = reinterpret_cast<const uint16_t*>(wg.data);
  const int32_t splits = k_splits(d);
  const unsigned blocks = static_cast<unsigned>(ceil_div(L, int64_t{kRowsPerWarp} * (kWarps / splits)));
  const int32_t e = static_cast<int32_t>(E), dd = static_cast<int32_t>(d);
  const int64_t ldx = x.stride[0], ldw = wg.stride[0];
  if (E <= 8)
    cuda::launch_chained(narrow_logits_kernel<Bf16, 1>, blocks, kWarps * 32, 0, s, xp, ldx, wp, ldw, L, e, dd, splits,
                         out);
  else
    cuda::launch_chained(narrow_logits_kernel<Bf16, 2>, blocks, kWarps * 32, 0, s, xp, ldx, wp, ldw, L, e, dd, splits,
                         out);
}

bool aligned_rows(const View& v) {
  return reinterpret_cast<uintptr_t>(v.data) % 16 == 0 && v.stride[0] % 8 == 0 && v.stride[1] == 1;
}

}  // namespace

const char* narrow_logits_unsupported(const View& x, const View& wg, int64_t E, int64_t d) {
  if (E < 1 || E > kNarrowLogitsMaxExperts) return "more experts than it serves";
  if (E > 8 && d > 1024) return "more than 8 experts at hidden > 1024 (cuBLASLt is faster there)";
  if (x.dtype != wg.dtype || (x.dtype != DType::kBF16 && x.dtype != DType::kF16))
    return "x and W_g not both bf16 or fp16";
  if (d % 8 || d > INT32_MAX - 32) return "hidden not a multiple of 8";
  if (x.ndim != 2 || wg.ndim != 2 || !aligned_rows(x) || !aligned_rows(wg)) return "rows not 16-byte aligned";
  return nullptr;  // the CUDA engines run on sm_80 and newer (cuda::has_kernels_for), as the MMAs need
}

void narrow_logits_cuda(const View& x, const View& wg, int64_t L, int64_t E, int64_t d, float* out, cudaStream_t s) {
  if (L == 0) return;
  if (x.dtype == DType::kBF16)
    launch<true>(x, wg, L, E, d, out, s);
  else
    launch<false>(x, wg, L, E, d, out, s);
  MOEBLAZE_CUDA_LAUNCH_CHECK("narrow_logits");
}

}  // namespace routing
}  // namespace v0
}  // namespace moeblaze
