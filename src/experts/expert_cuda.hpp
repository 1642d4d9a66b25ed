// Expert-stage kernels of the CUDA cuBLASLt engine: row gathers through the routing plan,
// the activation forward, and the fused activation backward that also produces dg.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "core/args.hpp"
#include "core/config.hpp"
#include "core/memory_layout.hpp"

namespace moeblaze {
inline namespace v0 {
namespace experts {

// out[p, :] = scale_p * src[expert_token_indices[p], :] for p in [0, P); scale is
// gate_of_position[p] when non-null, else 1. out is dense [P, d] of src's dtype.
void gather_rows_cuda(const View& src, const int32_t* expert_token_indices, const float* gate_of_position, int64_t P,
                      int64_t d, void* out, cudaStream_t s);

// gate_of_position[token_index_map[t k + j]] = gates[t k + j].
void gates_to_positions_cuda(const RoutingPlan& plan, int64_t L, int64_t k, float* gate_of_position, cudaStream_t s);

// act[p, :] = f(pre[p, 0:h]) (* pre[p, h:2h] if gated), rounded to dtype. pre rows have
// stride pre_ld, act rows stride h.
void activation_forward_cuda(Activation a, DType dt, int64_t P, int64_t h, const void* pre, int64_t pre_ld, void* act,
                             cudaStream_t s);

// On entry dpre[p, 0:h] holds dact = dy W_down^T (dtype dt). Writes dg_pos[p] = <dact, act>
// and, in place, dpre[p, :] = activation backward of gate * dact (dA, dB or dH), rounded.
void activation_backward_cuda(Activation a, DType dt, int64_t P, int64_t h, const void* pre, const void* act,
                              const float* gate_of_position, void* dpre, float* dg_pos, cudaStream_t s);

}  // namespace experts
}  // namespace v0
}  // namespace moeblaze
