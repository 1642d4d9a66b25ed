// Expert-stage kernels of the CUDA cuBLASLt engine: row gathers through the routing plan,
// the activation forward, and the fused activation backward (dg, dpre and g * act in one pass).
// Memory-bound: 16-byte vector access where rows allow it.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "core/view.hpp"
#include "core/config.hpp"
#include "core/memory_layout.hpp"
#include "cuda/row_arrival.hpp"

namespace moeblaze {
inline namespace v0 {
namespace experts {

// out[p, :] = src[expert_token_indices[p], :] for p in [0, P); out is dense [P, d] of src's dtype.
// An index outside [0, src.shape[0]) gives a zero row (nothing outside src is read). With
// `arrival` waiting, each row is read once it has arrived, and the grid keeps to
// arrival.max_ctas blocks so that the rows' senders find room beside it.
void gather_rows_cuda(const View& src, const int32_t* expert_token_indices, int64_t P, int64_t d, void* out,
                      cudaStream_t s, const RowArrival& arrival = {});

// gate_of_position[token_index_map[t k + j]] = gates[t k + j].
void gates_to_positions_cuda(const RoutingPlan& plan, int64_t L, int64_t k, float* gate_of_position, cudaStream_t s);

// act[p, :] = f(pre[p, 0:h]) (* pre[p, h:2h] if gated), rounded to dtype; pre rows have
// stride pre_ld, act rows stride h.
void activation_forward_cuda(Activation a, DType dt, int64_t P, int64_t h, const void* pre, int64_t pre_ld, void* act,
                             cudaStream_t s);

// dact = dy W_down^T is row p of `dact` (stride ld_dact): dpre's own first h columns, or g *
// act's rows. One pass per row p, with g = gate[p] and act recomputed from pre exactly as the
// forward rounded it:
//   dg_pos[p] = <dact, act>;  dpre[p, :] = backward of g * dact (dA, dB or dH);
//   gact[p, :] = g * act (the dW_down operand).
// Each element is read before it is written, by the same thread, so dpre may lie over dact or
// over pre (the same rows), and gact over dact.
// pre row p is pre_rows[p] when pre_rows is given (a window reading the call's saved pre).
// With rows_done (a device count, e.g. the sanitised offsets' end), rows p >= *rows_done, which
// no expert's GEMM wrote (a plan whose offsets end early), only get dg_pos[p] = 0.
void activation_backward_cuda(Activation a, DType dt, int64_t P, int64_t h, const void* pre, const int32_t* pre_rows,
                              const float* gate_of_position, const void* dact, int64_t ld_dact, void* dpre, void* gact,
                              float* dg_pos, cudaStream_t s, const int32_t* rows_done = nullptr);

}  // namespace experts
}  // namespace v0
}  // namespace moeblaze
