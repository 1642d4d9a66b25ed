/* Tolerances for the gradients that are sums whose terms cancel (the CUDA tests compare them
 * with the CPU engine's).
 *
 * The gate gradients g_tj = <dy_t, y_tj> (y_tj: expert j's unweighted output for token t) are
 * dot products over d: at L = 1, k = 2 a bf16 dtopk_w differed by 3.5e-2 of its own norm (ReLU,
 * d = 24) while y and dx were right to the dtype. Their rounding error is about eps * S_tj,
 * S_tj = sum_i |dy_ti| |y_tj,i|.
 *
 * The router gradients pass through the softmax backward, p_e (g_e - sum_j p_j g_j), which
 * cancels when a token's gate gradients are close: at L = 1, E = 4 a dlogits differed by
 * 5.8e-2 of its own norm in bf16 (1.8e-5 in fp32) while each g was right to the dtype. The
 * rounding of g bounds the error of token t's dlogits row by about eps * 2 S_t,
 * S_t = sum_j w_tj |g_tj|, and that of dW_g by eps * 2 sum_t S_t |x_t| per expert.
 *
 * So these errors are measured against max(norm of the reference, norm of those scales). */
#ifndef MOEBLAZE_GRAD_CONDITIONING_H_
#define MOEBLAZE_GRAD_CONDITIONING_H_

#include <stddef.h>
#include <stdint.h>

#include "test_util.h"

/* ||a - b|| / max(||b||, sqrt(scale2)); +inf when a holds a NaN or an infinity. */
double tu_err_against(const double* a, const double* b, size_t n, double scale2);

/* The squared norm of S_tj over every (token, slot) routed to `routed` [L, k]; x and dy are
 * [L, d] in the layer's activation dtype, the weights row-major in its weight dtype. y_tj comes
 * from one CPU forward (each pair its own token, routed to its expert with weight 1). When
 * `gate_grad_scales` is given it receives S_tj [L k] from the same outputs. NAN if that forward
 * fails. */
double tu_gate_grad_scale2(const tu_layer* layer, int64_t L, const void* x, const void* wgu, const void* wd,
                           const int32_t* routed, const void* dy, double* gate_grad_scales);

/* The squared norm of the router gradients' scale from the gates w [L, k] and the gate
 * gradients' scales S [L, k] (tu_gate_grad_scale2's, not the gradients themselves: a gate
 * gradient that cancels to near zero still carries the rounding of its terms): of
 * R_t = sum_j |w_tj| S_tj over tokens (d logits; x NULL), or of sum_t R_t |x_t| over the d
 * columns (dW_g; x [L, d] in dtype at). */
double tu_router_grad_scale2(int64_t L, int64_t k, int64_t d, const float* gates, const double* gate_grad_scales,
                             const void* x, moeblaze_dtype_t at);

#endif
