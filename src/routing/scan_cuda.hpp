// Exclusive prefix sum of int32 counts on the GPU, in three launches (tile scans, one scan of
// the tile totals, add-back). Its scratch size is plain arithmetic on n, so the size queries
// that include it never touch the CUDA runtime (CUB's device-wide scan asks the runtime, which
// fails under stream capture and can then disagree with the caller's earlier query).
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

namespace moeblaze {
inline namespace v0 {
namespace routing {

size_t exclusive_scan_scratch_bytes(int64_t n);
// out[i] = sum of in[0..i); the sum of all n counts must fit in int32 (it is at most L*k).
void exclusive_scan_cuda(const int32_t* in, int32_t* out, int64_t n, void* scratch, cudaStream_t s);

}  // namespace routing
}  // namespace v0
}  // namespace moeblaze
