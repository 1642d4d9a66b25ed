/*
 * reference_moe.h: an independent fp64 reference of one MoE layer (forward and analytic
 * backward), written from the math in docs/design.md and sharing no code with the engines.
 * SPDX-License-Identifier: Apache-2.0
 *
 * Conventions:
 * - Every array is plain `double` (ids and counts `int64_t`), contiguous and row-major:
 *     x [L, d], logits [L, E], w_router (W_g) [E, d], w_gate_up [E, d, g*h] (gate columns
 *     0..h-1 first, then up columns h..2h-1; g = 2 for SwiGLU/GeGLU, 1 otherwise),
 *     w_down [E, h, d], ids / gates [L, k] (slot j of token t at t*k + j), y / dy [L, d].
 * - Enumerated values (activation, score function) are the MOEBLAZE_* values of moeblaze.h;
 *   REF_* names with the same numbers are defined here so that this header (and the
 *   moeblaze_reference library) needs nothing from the library, not even its include path.
 * - Nothing allocates except where noted (internal scratch of O(E + g*h) per call); nothing
 *   prints. Functions that can fail return 0 on success and -1 on a bad argument.
 * - The reference assumes its inputs are valid (ids in range and distinct per token) except
 *   where a function says it checks.
 */
#ifndef MOEBLAZE_REFERENCE_MOE_H_
#define MOEBLAZE_REFERENCE_MOE_H_

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* Same numbers as moeblaze_activation_t and moeblaze_score_fn_t (tests assert it). */
enum {
  REF_ACT_RELU = 0,   /**< MOEBLAZE_ACTIVATION_RELU */
  REF_ACT_GELU = 1,   /**< MOEBLAZE_ACTIVATION_GELU (exact erf form) */
  REF_ACT_SILU = 2,   /**< MOEBLAZE_ACTIVATION_SILU */
  REF_ACT_SWIGLU = 3, /**< MOEBLAZE_ACTIVATION_SWIGLU */
  REF_ACT_GEGLU = 4,  /**< MOEBLAZE_ACTIVATION_GEGLU */
  REF_SCORE_SOFTMAX = 0, /**< MOEBLAZE_SCORE_SOFTMAX */
  REF_SCORE_SIGMOID = 1  /**< MOEBLAZE_SCORE_SIGMOID */
};

/** One MoE layer's shape and router/expert options. */
typedef struct ref_layer {
  int64_t E;          /**< number of experts */
  int64_t k;          /**< experts per token, 1..E */
  int64_t d;          /**< model dimension */
  int64_t h;          /**< expert FFN hidden size */
  int32_t activation; /**< REF_ACT_* == moeblaze_activation_t */
  int32_t score_fn;   /**< REF_SCORE_* == moeblaze_score_fn_t */
  int32_t normalize;  /**< 1: renormalise the k selected scores to sum to one */
  double aux_coeff;   /**< Switch load-balancing loss coefficient (>= 0) */
  double z_coeff;     /**< router z-loss coefficient (>= 0) */
  /**
   * Optional (NULL = pure fp64): rounding applied where the engines round to
   * ACTIVATION_DTYPE (docs/design.md, "Numerics"): A/B/H, act, O and dA/dB/dH. Set it to a
   * function that rounds a double to the activation dtype to model the engines' 16-bit
   * intermediates; the reference stays fp64 everywhere else.
   */
  double (*round_act)(double v);
} ref_layer;

/** 2 for the gated activations (SwiGLU, GeGLU), else 1. */
int64_t ref_gate_factor(int32_t activation);

/* ------------------------------------------------------------------------------------------
 * Element-wise activation pieces (exact erf GELU).
 * ---------------------------------------------------------------------------------------- */
double ref_silu(double v);
double ref_silu_grad(double v);
double ref_gelu(double v);
double ref_gelu_grad(double v);
double ref_relu(double v);
double ref_relu_grad(double v); /**< 1 for v > 0, else 0 */

/* ------------------------------------------------------------------------------------------
 * Router
 * ---------------------------------------------------------------------------------------- */
/** logits[L, E] = x[L, d] W_g[E, d]^T. */
void ref_logits(const ref_layer* l, int64_t L, const double* x, const double* w_router,
                double* logits);

/** scores[L, E] = softmax over experts, or element-wise sigmoid, of logits. */
void ref_scores(const ref_layer* l, int64_t L, const double* logits, double* scores);

/** ids[L, k]: the k largest scores of each token in descending order; ties go to the lower id. */
void ref_topk(const ref_layer* l, int64_t L, const double* scores, int64_t* ids);

/** gates[L, k] = scores[t, ids_tj], divided by their sum over j when l->normalize. */
void ref_gates(const ref_layer* l, int64_t L, const double* scores, const int64_t* ids,
               double* gates);

/** counts[E]: number of (t, j) with ids_tj = e. Returns -1 if an id is out of range. */
int ref_counts(int64_t E, int64_t L, int64_t k, const int64_t* ids, int64_t* counts);

/** aux = aux_coeff * E * sum_e f_e P_e with f_e = count_e/(L k), P_e = mean_t scores[t, e]
 *  (0 when L = 0). */
double ref_aux_loss(const ref_layer* l, int64_t L, const double* scores, const int64_t* ids);

/** z = z_coeff * mean_t (logsumexp_e logits[t, e])^2 (0 when L = 0). */
double ref_z_loss(const ref_layer* l, int64_t L, const double* logits);

/**
 * The whole router on logits[L, E]: ids, gates, counts, aux and z. Any output may be NULL.
 * If @p force_ids is non-NULL it is used as the top-k selection instead of ref_topk() (to
 * follow another implementation's choice between near-tied scores); gates, counts and the
 * losses are then computed for that selection. @p ids (if given) receives the ids used.
 */
void ref_route(const ref_layer* l, int64_t L, const double* logits, const int64_t* force_ids,
               int64_t* ids, double* gates, int64_t* counts, double* aux, double* z);

/**
 * Router backward, logits -> dlogits[L, E] (overwritten):
 *   dgates (may be NULL = zero) back through renormalisation and the selection to the scores,
 *   + grad_aux * d aux / d scores (f_e constant), then through softmax / sigmoid,
 *   + grad_z * d z / d logits.
 */
void ref_router_backward(const ref_layer* l, int64_t L, const double* logits,
                         const int64_t* ids, const double* dgates, double grad_aux,
                         double grad_z, double* dlogits);

/**
 * Case 2 (logits = x W_g^T): dw_router[E, d] = dlogits^T x (overwritten, may be NULL) and
 * dx[L, d] += dlogits W_g (accumulated, may be NULL).
 */
void ref_router_weight_backward(const ref_layer* l, int64_t L, const double* x,
                                const double* w_router, const double* dlogits,
                                double* dw_router, double* dx);

/* ------------------------------------------------------------------------------------------
 * Experts
 * ---------------------------------------------------------------------------------------- */
/** y[L, d] = sum_j gates_tj * (act(x_t W_gate_up[e]) W_down[e]), e = ids_tj, in slot order. */
void ref_forward(const ref_layer* l, int64_t L, const double* x, const double* w_gate_up,
                 const double* w_down, const int64_t* ids, const double* gates, double* y);

/**
 * Analytic backward of ref_forward given dy[L, d]. Every output is optional (NULL) and
 * overwritten: dx[L, d] (expert path only), dw_gate_up[E, d, g*h], dw_down[E, h, d],
 * dgates[L, k] = <dy_t W_down[e]^T, act_tj>.
 */
void ref_backward(const ref_layer* l, int64_t L, const double* x, const double* w_gate_up,
                  const double* w_down, const int64_t* ids, const double* gates,
                  const double* dy, double* dx, double* dw_gate_up, double* dw_down,
                  double* dgates);

/* ------------------------------------------------------------------------------------------
 * The whole layer (router + experts), in the routing precedence of the C API:
 *   logits given -> case 1; else w_router given -> case 2 (logits = x W_g^T); else case 3
 *   (topk_ids and topk_gates are the caller's routing).
 * ---------------------------------------------------------------------------------------- */
typedef struct ref_inputs {
  const double* x;          /**< [L, d], required */
  const double* w_gate_up;  /**< [E, d, g*h], required */
  const double* w_down;     /**< [E, h, d], required */
  const double* logits;     /**< [L, E] or NULL (case 1) */
  const double* w_router;   /**< [E, d] or NULL (case 2 when logits is NULL) */
  /** Case 3: the caller's ids. Cases 1 and 2: optional override of the top-k selection
   *  (see ref_route's force_ids), NULL to select by ref_topk(). */
  const int64_t* topk_ids;
  const double* topk_gates; /**< [L, k]: case 3 only */
} ref_inputs;

typedef struct ref_fwd_out {
  double* y;        /**< [L, d], required */
  int64_t* ids;     /**< [L, k] or NULL: ids used (case 3: a copy of the input) */
  double* gates;    /**< [L, k] or NULL: gates used */
  int64_t* counts;  /**< [E] or NULL: tokens per expert */
  double* logits;   /**< [L, E] or NULL: logits used (cases 1 and 2) */
  double aux;       /**< written: aux loss (0 in case 3) */
  double z;         /**< written: z loss (0 in case 3) */
} ref_fwd_out;

typedef struct ref_grads {
  double* dx;          /**< [L, d] or NULL; includes dlogits W_g in case 2 */
  double* dw_gate_up;  /**< [E, d, g*h] or NULL */
  double* dw_down;     /**< [E, h, d] or NULL */
  double* dw_router;   /**< [E, d] or NULL (case 2) */
  double* dlogits;     /**< [L, E] or NULL (cases 1 and 2) */
  double* dgates;      /**< [L, k] or NULL: dLoss/dgate of the expert path only */
} ref_grads;

/** 1, 2 or 3: the routing case @p in selects. */
int ref_routing_case(const ref_inputs* in);

/** Forward of the whole layer. Returns 0, or -1 on missing inputs or a bad id. */
int ref_layer_forward(const ref_layer* l, int64_t L, const ref_inputs* in, ref_fwd_out* out);

/**
 * Backward of the whole layer for Loss = <y, dy> + grad_aux * aux + grad_z * z. All outputs
 * in @p g are optional and overwritten. Returns 0, or -1 on missing inputs or a bad id.
 */
int ref_layer_backward(const ref_layer* l, int64_t L, const ref_inputs* in, const double* dy,
                       double grad_aux, double grad_z, const ref_grads* g);

/** Loss = <y, dy> + grad_aux * aux + grad_z * z of the forward (for finite differences).
 *  If @p ids_out is non-NULL it receives the selection used. */
double ref_layer_loss(const ref_layer* l, int64_t L, const ref_inputs* in, const double* dy,
                      double grad_aux, double grad_z, int64_t* ids_out);

/* ------------------------------------------------------------------------------------------
 * Routing plan by a plain stable sort of (expert, token) pairs: the independent check of the
 * engines' atomic-free, sort-free builder.
 *   expert_token_indices[L k]: token ids grouped by expert, ascending token id in an expert;
 *   expert_token_offsets[E+1]: exclusive prefix sum of tokens per expert;
 *   token_index_map[L k]: position of (t, j) (at t k + j) in expert_token_indices.
 * Any output may be NULL. Returns 0, or -1 if an id is out of range or repeated in a token.
 * Allocates O(L k) scratch (returns -1 if that fails).
 * ---------------------------------------------------------------------------------------- */
int ref_plan_sort(int64_t L, int64_t k, int64_t E, const int64_t* token_expert_indices,
                  int64_t* expert_token_indices, int64_t* expert_token_offsets,
                  int64_t* token_index_map);

/* ------------------------------------------------------------------------------------------
 * Comparison helpers
 * ---------------------------------------------------------------------------------------- */
/** ||a - b||_2 / ||b||_2 (b the reference); +inf if a has a NaN/Inf; 0 if both are ~0 and
 *  +inf if only b is. */
double ref_rel_l2(const double* a, const double* b, size_t n);

#ifdef __cplusplus
} /* extern "C" */
#endif

#endif /* MOEBLAZE_REFERENCE_MOE_H_ */
