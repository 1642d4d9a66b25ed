// Hopper (sm_90a) device primitives of the grouped GEMM: shared-memory matrix descriptors,
// warpgroup MMA control, cp.async with zero fill, mbarrier waits, ldmatrix / stmatrix and named barriers. mbarrier
// and proxy fences come from the Toolkit's CCCL (cuda::ptx); wgmma and cp.async are inline PTX. Included
// only by sources compiled for sm_90a.
#pragma once

#include <cuda/ptx>

#include <cstdint>

namespace moeblaze {
inline namespace v0 {
namespace gemm {
namespace sm90 {

__device__ __forceinline__ uint32_t smem_addr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// A wgmma shared-memory descriptor for a 128-byte-swizzled operand (PTX ISA "Matrix
// Descriptor Format"): start address, leading and stride byte offsets (all >> 4), swizzle mode 1.
// Atoms (8 rows of 128 bytes) must be 1024-byte aligned so the base-offset field stays 0.
//   K-major  (rows of 64 K-elements):  SBO = 1024 (next 8 rows); LBO unused (1).
//   MN-major (rows of 64 MN-elements): LBO = stride between 64-wide MN blocks, SBO = 1024.
__device__ __forceinline__ uint64_t sw128_desc(uint32_t addr, uint32_t lbo, uint32_t sbo) {
  return static_cast<uint64_t>((addr & 0x3FFFF) >> 4) | (static_cast<uint64_t>((lbo & 0x3FFFF) >> 4) << 16) |
         (static_cast<uint64_t>((sbo & 0x3FFFF) >> 4) << 32) | (1ull << 62);
}

// The descriptor of the operand `bytes` further on (a later k-step or fragment of the same
// stage): only the start-address field moves, and it cannot carry (shared memory ends below
// 256 KB), so one 32-bit add on the low word. Rebuilding each descriptor from its address cost
// ~10 instructions per wgmma, a large share of the ping-pong mainloop's issue time
// (perf/NOTES.md).
__device__ __forceinline__ uint64_t desc_advance(uint64_t desc, uint32_t bytes) {
  return (desc & 0xFFFFFFFF00000000ull) | (static_cast<uint32_t>(desc) + (bytes >> 4));
}

// Byte offset of 16-byte chunk `chunk` (0..7) of row `row` inside a 128-byte-swizzled block of
// 128-byte rows: what TMA's SWIZZLE_128B writes and what the descriptor above reads.
__device__ __forceinline__ uint32_t sw128_offset(uint32_t row, uint32_t chunk) {
  return row * 128u + ((chunk ^ (row & 7u)) << 4);
}

// 16-byte cp.async, bypassing L1; src_bytes < 16 zero-fills the rest (0: nothing is read).
__device__ __forceinline__ void cp_async_16(uint32_t dst, const void* src, uint32_t src_bytes) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(src_bytes) : "memory");
}

// Waits until the phase of parity `parity` of the mbarrier at shared address `bar` completes.
__device__ __forceinline__ void mbar_wait_shared(uint32_t bar, uint32_t parity) {
  asm volatile(
      "{\n .reg .pred done;\n wait_%=:\n"
      " mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
      " @!done bra wait_%=;\n}\n" ::"r"(bar), "r"(parity)
      : "memory");
}
__device__ __forceinline__ void mbar_wait(uint64_t* bar, uint32_t parity) { mbar_wait_shared(smem_addr(bar), parity); }

__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
template <int N>
__device__ __forceinline__ void wgmma_wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
}

// Keeps the compiler from moving accumulator reads or writes across the asynchronous MMAs.
template <int N>
__device__ __forceinline__ void fence_accumulators(float (&acc)[N]) {
#pragma unroll
  for (int i = 0; i < N; ++i) asm volatile("" : "+f"(acc[i])::"memory");
}

// Four 8 x 8 b16 matrices to shared memory: register j holds this thread's pair of matrix j in the
// MMA fragment layout (row lane / 4, columns 2 (lane % 4), +1); lanes 8 j .. 8 j + 7 give the
// addresses of matrix j's eight 16-byte rows.
__device__ __forceinline__ void stmatrix_x4(uint32_t addr, uint32_t r0, uint32_t r1, uint32_t r2, uint32_t r3) {
  asm volatile("stmatrix.sync.aligned.m8n8.x4.shared.b16 [%0], {%1, %2, %3, %4};\n" ::"r"(addr), "r"(r0), "r"(r1), "r"(r2),
               "r"(r3)
               : "memory");
}

// The same with each 8 x 8 matrix transposed on the way: lanes 8 j .. 8 j + 7 address the rows of
// the transposed matrix j (its columns in the fragment).
__device__ __forceinline__ void stmatrix_x4_trans(uint32_t addr, uint32_t r0, uint32_t r1, uint32_t r2, uint32_t r3) {
  asm volatile("stmatrix.sync.aligned.m8n8.x4.trans.shared.b16 [%0], {%1, %2, %3, %4};\n" ::"r"(addr), "r"(r0), "r"(r1),
               "r"(r2), "r"(r3)
               : "memory");
}

// stmatrix_x4's inverse: lane 8 j + i addresses row i of matrix j, and each thread receives
// its accumulator-layout pair of each matrix (row lane / 4, columns 2 (lane % 4), +1).
__device__ __forceinline__ void ldmatrix_x4(uint32_t addr, uint32_t& r0, uint32_t& r1, uint32_t& r2, uint32_t& r3) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3)
               : "r"(addr)
               : "memory");
}

// One 32-bit word from / to shared memory (a packed b16 pair).
__device__ __forceinline__ uint32_t ld_shared_b32(uint32_t addr) {
  uint32_t v;
  asm volatile("ld.shared.b32 %0, [%1];\n" : "=r"(v) : "r"(addr) : "memory");
  return v;
}
// Sixteen bytes from shared memory (16-byte aligned address).
__device__ __forceinline__ uint4 ld_shared_v4(uint32_t addr) {
  uint4 v;
  asm volatile("ld.shared.v4.b32 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "r"(addr)
               : "memory");
  return v;
}
__device__ __forceinline__ void st_shared_b32(uint32_t addr, uint32_t v) {
  asm volatile("st.shared.b32 [%0], %1;\n" ::"r"(addr), "r"(v) : "memory");
}

// Two fp32 values to shared memory (8-byte aligned address).
__device__ __forceinline__ void st_shared_v2(uint32_t addr, float2 v) {
  asm volatile("st.shared.v2.f32 [%0], {%1, %2};\n" ::"r"(addr), "f"(v.x), "f"(v.y) : "memory");
}

// A barrier among `threads` threads (a warpgroup: 128) on hardware barrier `id` (1..15; 0 is
// __syncthreads').
__device__ __forceinline__ void named_barrier_sync(uint32_t id, uint32_t threads) {
  asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}

template <uint32_t Regs>
__device__ __forceinline__ void regs_dealloc() {
  asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(Regs));
}
template <uint32_t Regs>
__device__ __forceinline__ void regs_alloc() {
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(Regs));
}

}  // namespace sm90
}  // namespace gemm
}  // namespace v0
}  // namespace moeblaze
