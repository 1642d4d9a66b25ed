/*
 * MoEBlaze: memory-frugal Mixture-of-Experts training kernels behind a stable C ABI.
 * SPDX-License-Identifier: Apache-2.0
 */
/**
 * @file moeblaze.h
 * @brief The one stable public header of libmoeblaze (C99, no CUDA includes).
 *
 * One MoE layer (token-choice top-k, dropless, no padding): router -> routing plan ->
 * expert MLPs that gather tokens on the fly -> gate-weighted combine, and the whole
 * backward pass including the router gradient. See docs/design.md for the data flow,
 * docs/memory.md for the size formulas and docs/abi-policy.md for the ABI rules.
 *
 * Conventions that hold for every function below:
 * - Every function returns ::moeblaze_status_t, except pure getters of static data.
 * - On failure, moeblaze_get_last_error_message() returns a thread-local description.
 * - No C++ exception and no abort() ever crosses this boundary.
 * - Shapes and counts are int64_t; byte counts are size_t.
 */
#ifndef MOEBLAZE_MOEBLAZE_H_
#define MOEBLAZE_MOEBLAZE_H_

#include <stddef.h>
#include <stdint.h>

#if defined(__GNUC__) || defined(__clang__)
/** @brief Marks a symbol as part of the exported C ABI. */
#define MOEBLAZE_API __attribute__((visibility("default")))
/** @brief Marks a function as deprecated, with a message naming its replacement. */
#define MOEBLAZE_DEPRECATED(msg) __attribute__((deprecated(msg)))
#else
#define MOEBLAZE_API
#define MOEBLAZE_DEPRECATED(msg)
#endif

#ifdef __cplusplus
extern "C" {
#endif

/**
 * @defgroup version Version and build queries
 * @brief Compile-time and run-time version numbers.
 *
 * The product version (VERSION file, semantic versioning) and the ABI version (the SONAME
 * suffix, libmoeblaze.so.N for ABI version N) are independent: the ABI version is bumped only when the ABI
 * breaks, which the project avoids (docs/abi-policy.md).
 * @{
 */
/** @brief Major product version of this header. */
#define MOEBLAZE_VERSION_MAJOR 0
/** @brief Minor product version of this header. */
#define MOEBLAZE_VERSION_MINOR 2
/** @brief Patch product version of this header. */
#define MOEBLAZE_VERSION_PATCH 0
/** @brief Encodes a version triple as one comparable integer (room for 999 minors/patches). */
#define MOEBLAZE_VERSION_ENCODE(major, minor, patch) \
  ((uint32_t)(major) * 1000000u + (uint32_t)(minor) * 1000u + (uint32_t)(patch))
/** @brief The version of this header, encoded with #MOEBLAZE_VERSION_ENCODE. */
#define MOEBLAZE_VERSION \
  MOEBLAZE_VERSION_ENCODE(MOEBLAZE_VERSION_MAJOR, MOEBLAZE_VERSION_MINOR, MOEBLAZE_VERSION_PATCH)
/** @brief ABI version of this header; equals the SONAME suffix (libmoeblaze.so.0). */
#define MOEBLAZE_ABI_VERSION 0

/**
 * @brief Run-time library version, encoded like #MOEBLAZE_VERSION.
 * @return The version of the loaded library.
 * @since 0.1
 */
MOEBLAZE_API uint32_t moeblaze_get_version(void);

/**
 * @brief Run-time library version as a string such as "0.1.0".
 * @return A static string; never NULL, never to be freed.
 * @since 0.1
 */
MOEBLAZE_API const char* moeblaze_get_version_string(void);

/**
 * @brief Run-time ABI version; bindings refuse to load on a mismatch with #MOEBLAZE_ABI_VERSION.
 * @return The ABI version of the loaded library.
 * @since 0.1
 */
MOEBLAZE_API uint32_t moeblaze_get_abi_version(void);

/**
 * @brief Build description: version, git revision, build type, CUDA version and SM list.
 * @return A static string; never NULL, never to be freed.
 * @since 0.1
 */
MOEBLAZE_API const char* moeblaze_get_build_info(void);
/** @} */

/**
 * @defgroup errors Status codes and error messages
 * @brief Every call returns a status; failures also leave a thread-local message.
 *
 * The last error message belongs to the calling thread and stays valid until the next
 * moeblaze_* call on that thread. Status values are never renumbered.
 * @{
 */
/** @brief Result of every non-getter call. Values are frozen (docs/abi-policy.md). */
typedef enum moeblaze_status {
  /** The call succeeded (for stream-ordered calls: the work was enqueued). */
  MOEBLAZE_STATUS_SUCCESS = 0,
  /** A NULL pointer, bad shape, dtype, stride, device, alignment, enum value or routing id. */
  MOEBLAZE_STATUS_INVALID_ARGUMENT = 1,
  /** The request is valid but this build or engine has no implementation for it. */
  MOEBLAZE_STATUS_NOT_SUPPORTED = 2,
  /** The workspace or saved buffer is smaller than the size query returned. */
  MOEBLAZE_STATUS_INSUFFICIENT_WORKSPACE = 3,
  /** A host allocation failed: in config and create calls, or in the first cuBLASLt-engine
   *  call of a thread that meets a larger NUM_EXPERTS (its host copy of the expert offsets).
   *  Warm forward, backward and route calls allocate no host memory. */
  MOEBLAZE_STATUS_OUT_OF_HOST_MEMORY = 4,
  /** A device allocation failed (only in create; never in forward/backward/route). */
  MOEBLAZE_STATUS_OUT_OF_DEVICE_MEMORY = 5,
  /** The CUDA runtime reported an error; the message carries its name. */
  MOEBLAZE_STATUS_CUDA_ERROR = 6,
  /** cuBLASLt reported an error; the message carries its status. */
  MOEBLAZE_STATUS_CUBLAS_ERROR = 7,
  /** The device has no kernels compiled for it, or no such device exists. */
  MOEBLAZE_STATUS_ARCH_MISMATCH = 8,
  /** A struct_size or version field is not understood by this library. */
  MOEBLAZE_STATUS_VERSION_MISMATCH = 9,
  /** The attribute number is not known to this library. */
  MOEBLAZE_STATUS_UNKNOWN_ATTRIBUTE = 10,
  /** The attribute exists but has another value type (e.g. set_f64 on an i64 attribute). */
  MOEBLAZE_STATUS_ATTRIBUTE_TYPE_MISMATCH = 11,
  /** A bug in the library, including an escaped C++ exception. Please report it. */
  MOEBLAZE_STATUS_INTERNAL_ERROR = 12,
  /** Pins the enum to 32 bits; not a status. */
  MOEBLAZE_STATUS__FORCE_INT32 = 0x7fffffff
} moeblaze_status_t;

/**
 * @brief Name of a status value, e.g. "MOEBLAZE_STATUS_INVALID_ARGUMENT".
 * @param[in] status Any value, known or not.
 * @return A static string; never NULL ("MOEBLAZE_STATUS_UNKNOWN" for unknown values).
 * @since 0.1
 */
MOEBLAZE_API const char* moeblaze_status_name(moeblaze_status_t status);

/**
 * @brief One-sentence description of a status value.
 * @param[in] status Any value, known or not.
 * @return A static string; never NULL.
 * @since 0.1
 */
MOEBLAZE_API const char* moeblaze_status_string(moeblaze_status_t status);

/**
 * @brief Detail of the calling thread's last failing call.
 * @return A thread-local string, "" if the last call succeeded; valid until the next
 *         moeblaze_* call on this thread. Never NULL, never to be freed.
 * @since 0.1
 */
MOEBLAZE_API const char* moeblaze_get_last_error_message(void);

/** @brief Log levels passed to a ::moeblaze_log_fn. */
typedef enum moeblaze_log_level {
  MOEBLAZE_LOG_ERROR = 1,  /**< A call failed; the message is the error message. */
  MOEBLAZE_LOG_WARN = 2,   /**< Something works but is likely not what the caller wants. */
  MOEBLAZE_LOG_INFO = 3,   /**< Decisions taken at create time (the engine, its device, why others were passed over). */
  MOEBLAZE_LOG_DEBUG = 4,  /**< Verbose detail. */
  MOEBLAZE_LOG__FORCE_INT32 = 0x7fffffff /**< Pins the enum to 32 bits. */
} moeblaze_log_level_t;

/**
 * @brief Log sink. May be called on any thread that calls into the library, and may itself
 *        call any library function (moeblaze_set_log_callback() and failing calls included):
 *        it runs outside the library's locks. Messages raised on a thread while that thread
 *        is inside the callback are not delivered to it (they would recurse); the failing
 *        call that logged keeps its own last error message.
 * @param user_data The pointer given to moeblaze_set_log_callback().
 * @param level A ::moeblaze_log_level_t value.
 * @param func The public function that logs, e.g. "moeblaze_create".
 * @param msg The message; valid only during the callback.
 */
typedef void (*moeblaze_log_fn)(void* user_data, int32_t level, const char* func,
                                const char* msg);

/**
 * @brief Installs a process-wide log callback (default: none, the library prints nothing).
 * @param[in] fn The callback, or NULL to remove it.
 * @param[in] user_data Passed back to @p fn unchanged.
 * @param[in] min_level Messages with level <= min_level are delivered: 0 (none) to 4 (all).
 * @retval MOEBLAZE_STATUS_SUCCESS The callback is installed. Called from outside a callback,
 *         it returns once no thread is running the previous callback, so that callback's
 *         @p user_data may be freed at once; called from inside one, it returns at once.
 * @retval MOEBLAZE_STATUS_INVALID_ARGUMENT @p min_level is outside 0..4.
 * @since 0.1
 */
MOEBLAZE_API moeblaze_status_t moeblaze_set_log_callback(moeblaze_log_fn fn, void* user_data,
                                                         int32_t min_level);
/** @} */

/**
 * @defgroup tensors Devices, dtypes and tensors (DLPack-compatible)
 * @brief Tensor descriptors laid out exactly like DLPack's DLTensor.
 *
 * A DLTensor* taken from a "dltensor" capsule can be passed as a ::moeblaze_tensor_t* as-is.
 * The library never keeps a pointer to a descriptor, its shape or its strides after a call
 * returns. These struct layouts are frozen.
 * @{
 */
struct CUstream_st;
/** @brief A CUDA stream; identical to cudaStream_t and CUstream. NULL is the legacy default stream. */
typedef struct CUstream_st* moeblaze_stream_t;

/** @brief DLPack device types accepted by the library. */
typedef enum moeblaze_device_type {
  MOEBLAZE_DEVICE_CPU = 1,  /**< Host memory (DLPack kDLCPU); the reference engine. */
  MOEBLAZE_DEVICE_CUDA = 2, /**< CUDA device memory (DLPack kDLCUDA). */
  MOEBLAZE_DEVICE__FORCE_INT32 = 0x7fffffff /**< Pins the enum to 32 bits. */
} moeblaze_device_type_t;

/** @brief Device of a tensor or handle; identical to DLPack's DLDevice. */
typedef struct moeblaze_device {
  int32_t device_type; /**< A ::moeblaze_device_type_t value. */
  int32_t device_id;   /**< Device ordinal (0 for the CPU). */
} moeblaze_device_t;

/** @brief Element type; identical to DLPack's DLDataType. */
typedef struct moeblaze_dtype {
  uint8_t code;   /**< A ::moeblaze_dtype_code_t value. */
  uint8_t bits;   /**< Bits per element: 16, 32 or 64. */
  uint16_t lanes; /**< Always 1. */
} moeblaze_dtype_t;

/** @brief DLPack type codes. */
typedef enum moeblaze_dtype_code {
  MOEBLAZE_DTYPE_CODE_INT = 0,    /**< Signed integer (kDLInt). */
  MOEBLAZE_DTYPE_CODE_UINT = 1,   /**< Unsigned integer (kDLUInt). */
  MOEBLAZE_DTYPE_CODE_FLOAT = 2,  /**< IEEE float (kDLFloat). */
  MOEBLAZE_DTYPE_CODE_BFLOAT = 4, /**< bfloat16 (kDLBfloat). */
  MOEBLAZE_DTYPE_CODE__FORCE_INT32 = 0x7fffffff /**< Pins the enum to 32 bits. */
} moeblaze_dtype_code_t;

/** @brief Initializer for a float32 ::moeblaze_dtype_t: `moeblaze_dtype_t t = MOEBLAZE_DTYPE_F32;` */
#define MOEBLAZE_DTYPE_F32 {2u, 32u, 1u}
/** @brief Initializer for a float16 ::moeblaze_dtype_t. */
#define MOEBLAZE_DTYPE_F16 {2u, 16u, 1u}
/** @brief Initializer for a bfloat16 ::moeblaze_dtype_t. */
#define MOEBLAZE_DTYPE_BF16 {4u, 16u, 1u}
/** @brief Initializer for an int32 ::moeblaze_dtype_t. */
#define MOEBLAZE_DTYPE_I32 {0u, 32u, 1u}
/** @brief Initializer for an int64 ::moeblaze_dtype_t. */
#define MOEBLAZE_DTYPE_I64 {0u, 64u, 1u}

/** @brief A strided tensor view; field-for-field identical to DLPack's DLTensor (48 bytes). */
typedef struct moeblaze_tensor {
  void* data;                /**< Base pointer (host or device, per @c device). */
  moeblaze_device_t device;  /**< Where @c data lives; must match the handle's device. */
  int32_t ndim;              /**< Number of dimensions. */
  moeblaze_dtype_t dtype;    /**< Element type. */
  const int64_t* shape;      /**< @c ndim extents. */
  const int64_t* strides;    /**< @c ndim strides in elements, or NULL for contiguous row-major. */
  uint64_t byte_offset;      /**< Added to @c data, in bytes. */
} moeblaze_tensor_t;
/** @} */

/**
 * @defgroup config Configuration
 * @brief An opaque, typed key-value object describing one MoE layer.
 *
 * Config objects are single-writer: do not modify one from two threads at once. A handle
 * snapshots its config at creation; later changes to the config do not affect the handle.
 * @{
 */
/** @brief Opaque configuration object. */
typedef struct moeblaze_config_s* moeblaze_config_t;

/** @brief Expert MLP activation (value of #MOEBLAZE_ATTR_ACTIVATION). */
typedef enum moeblaze_activation {
  MOEBLAZE_ACTIVATION_RELU = 0,   /**< act = relu(x W_up). */
  MOEBLAZE_ACTIVATION_GELU = 1,   /**< act = gelu(x W_up), exact erf form. */
  MOEBLAZE_ACTIVATION_SILU = 2,   /**< act = silu(x W_up). */
  MOEBLAZE_ACTIVATION_SWIGLU = 3, /**< act = silu(x W_gate) * (x W_up). */
  MOEBLAZE_ACTIVATION_GEGLU = 4,  /**< act = gelu(x W_gate) * (x W_up), exact erf form. */
  MOEBLAZE_ACTIVATION__FORCE_INT32 = 0x7fffffff /**< Pins the enum to 32 bits. */
} moeblaze_activation_t;

/** @brief Router score function (value of #MOEBLAZE_ATTR_SCORE_FUNCTION). */
typedef enum moeblaze_score_fn {
  MOEBLAZE_SCORE_SOFTMAX = 0, /**< scores = softmax(logits) over the experts. */
  MOEBLAZE_SCORE_SIGMOID = 1, /**< scores = sigmoid(logits), per expert. */
  MOEBLAZE_SCORE__FORCE_INT32 = 0x7fffffff /**< Pins the enum to 32 bits. */
} moeblaze_score_fn_t;

/** @brief Normalisation of the batch-wise balance loss (value of #MOEBLAZE_ATTR_AUX_LOSS_FORM;
 *  docs/routing.md compares the libraries' definitions). @since 0.2 */
typedef enum moeblaze_aux_loss_form {
  /** AUX_LOSS_COEFF * E * sum_e f_e P_e, f_e the fraction of the L k picks that went to e:
   *  Switch Transformer's and Megatron-Core's form. */
  MOEBLAZE_AUX_LOSS_SWITCH = 0,
  /** k times the Switch form, as transformers' load_balancing_loss_func (Mixtral, Qwen-MoE)
   *  computes it for the same coefficient. */
  MOEBLAZE_AUX_LOSS_HUGGING_FACE = 1,
  MOEBLAZE_AUX_LOSS__FORCE_INT32 = 0x7fffffff /**< Pins the enum to 32 bits. */
} moeblaze_aux_loss_form_t;

/** @brief What forward keeps for backward (value of #MOEBLAZE_ATTR_SAVE_POLICY). */
typedef enum moeblaze_save_policy {
  /** Save the up-projection outputs A and B (or H); backward recomputes the activation. */
  MOEBLAZE_SAVE_PREACT = 0,
  /** Save only the routing plan and gates; backward recomputes the up GEMM. */
  MOEBLAZE_SAVE_RECOMPUTE_UP = 1,
  /** Also save the activation output (fastest backward, most memory). */
  MOEBLAZE_SAVE_ALL = 2,
  MOEBLAZE_SAVE__FORCE_INT32 = 0x7fffffff /**< Pins the enum to 32 bits. */
} moeblaze_save_policy_t;

/** @brief Compute engine (value of #MOEBLAZE_ATTR_ENGINE). */
typedef enum moeblaze_engine {
  MOEBLAZE_ENGINE_AUTO = 0,          /**< The best engine for the device (resolved at create). */
  MOEBLAZE_ENGINE_CPU = 1,           /**< The multi-threaded CPU reference engine. */
  MOEBLAZE_ENGINE_CUDA_CUBLASLT = 2, /**< CUDA: cuBLASLt per-expert GEMMs (portable, sm_80+). */
  MOEBLAZE_ENGINE_CUDA_FUSED = 3,    /**< CUDA: fused grouped GEMMs (sm_90a; bf16/fp16; d, h multiples of 8). Sync-free and graph-capturable. AUTO picks it on sm_90 for layers with ffn_hidden <= 8192, where it was measured at least as fast as cuBLASLt; for wider experts choose it explicitly. */
  MOEBLAZE_ENGINE__FORCE_INT32 = 0x7fffffff /**< Pins the enum to 32 bits. */
} moeblaze_engine_t;

/** @brief Value type of an attribute (see ::moeblaze_attr_info_t). */
typedef enum moeblaze_value_type {
  MOEBLAZE_VALUE_I64 = 0,   /**< Set with moeblaze_config_set_i64(). */
  MOEBLAZE_VALUE_F64 = 1,   /**< Set with moeblaze_config_set_f64(). */
  MOEBLAZE_VALUE_DTYPE = 2, /**< Set with moeblaze_config_set_dtype(). */
  MOEBLAZE_VALUE__FORCE_INT32 = 0x7fffffff /**< Pins the enum to 32 bits. */
} moeblaze_value_type_t;

/** @brief Configuration attributes. Numbers are frozen; new ones are appended. */
typedef enum moeblaze_attr {
  /** i64, required, 1..65536: number of experts E. @since 0.1 */
  MOEBLAZE_ATTR_NUM_EXPERTS = 0,
  /** i64, required, 1..min(E, 64): experts per token k. @since 0.1 */
  MOEBLAZE_ATTR_TOP_K = 1,
  /** i64, required, >= 1: model dimension d (rows of x). @since 0.1 */
  MOEBLAZE_ATTR_HIDDEN_SIZE = 2,
  /** i64, required, >= 1: expert FFN hidden size h. @since 0.1 */
  MOEBLAZE_ATTR_FFN_HIDDEN_SIZE = 3,
  /** i64, required, >= 1: upper bound on tokens L per call; MAX_TOKENS * TOP_K < 2^31. @since 0.1 */
  MOEBLAZE_ATTR_MAX_TOKENS = 4,
  /** i64 ::moeblaze_activation_t, default SWIGLU. @since 0.1 */
  MOEBLAZE_ATTR_ACTIVATION = 5,
  /** i64 ::moeblaze_score_fn_t, default SOFTMAX. @since 0.1 */
  MOEBLAZE_ATTR_SCORE_FUNCTION = 6,
  /** i64 0/1, default 0: renormalise the k selected scores to sum to one. @since 0.1 */
  MOEBLAZE_ATTR_NORMALIZE_TOPK = 7,
  /** f64 >= 0, default 0: coefficient of the Switch load-balancing loss. @since 0.1 */
  MOEBLAZE_ATTR_AUX_LOSS_COEFF = 8,
  /** f64 >= 0, default 0: coefficient of the router z-loss. @since 0.1 */
  MOEBLAZE_ATTR_Z_LOSS_COEFF = 9,
  /** dtype F32/F16/BF16, default BF16: x, y, dy, dx and saved activations. @since 0.1 */
  MOEBLAZE_ATTR_ACTIVATION_DTYPE = 10,
  /** dtype F32/F16/BF16, default BF16: expert and router weights and their gradients. @since 0.1 */
  MOEBLAZE_ATTR_WEIGHT_DTYPE = 11,
  /** dtype, default F32 (the only value in 0.1): accumulation type. @since 0.1 */
  MOEBLAZE_ATTR_ACCUM_DTYPE = 12,
  /** i64 ::moeblaze_save_policy_t, default SAVE_PREACT. @since 0.1 */
  MOEBLAZE_ATTR_SAVE_POLICY = 13,
  /** i64 0/1, default 1: same inputs give the same bits on every run. @since 0.1 */
  MOEBLAZE_ATTR_DETERMINISTIC = 14,
  /** i64 ::moeblaze_device_type_t, default CUDA. @since 0.1 */
  MOEBLAZE_ATTR_DEVICE_TYPE = 15,
  /** i64, default -1 (CUDA: the current device at create; CPU: 0). @since 0.1 */
  MOEBLAZE_ATTR_DEVICE_ID = 16,
  /** i64 ::moeblaze_engine_t, default AUTO; the handle reports the engine chosen. @since 0.1 */
  MOEBLAZE_ATTR_ENGINE = 17,
  /** i64 0..1024, default 0 (all hardware threads): CPU engine worker threads. @since 0.1 */
  MOEBLAZE_ATTR_NUM_THREADS = 18,
  /** i64 0..MAX_TOKENS (set checks 0..2^31-1; create refuses a value above MAX_TOKENS),
   *  default 0 (automatic): the CUDA fused engine runs the expert MLPs on
   *  windows of this many tokens, so its workspace is bounded by the window instead of growing
   *  with the call's tokens (docs/memory.md gives the formula and the automatic choice). Results
   *  depend on it only through the fp32 summation order of the weight gradients. Other engines
   *  ignore it. @since 0.2 */
  MOEBLAZE_ATTR_WINDOW_TOKENS = 19,
  /** i64 0..2^31-1, default 0 (dropless: EP size * MAX_TOKENS): expert-parallel layers
   *  (moeblaze_create_ep()) only, the most token rows one rank may receive in a step. A step in
   *  which some rank would receive more sends nothing, fills every output of every rank with NaN
   *  and reports INSUFFICIENT_WORKSPACE through #MOEBLAZE_ARG_STATUS (docs/ep.md). @since 0.2 */
  MOEBLAZE_ATTR_EP_MAX_RECV_TOKENS = 20,
  /** i64 ::moeblaze_ep_transport_t, default AUTO: how an expert-parallel layer moves rows. @since 0.2 */
  MOEBLAZE_ATTR_EP_TRANSPORT = 21,
  /** i64 0..128, default 0 (the library picks): CTAs an expert-parallel layer's exchanges run
   *  on (each meets its peers' CTA of the same index at a barrier, so all must fit on the GPU at
   *  once). @since 0.2 */
  MOEBLAZE_ATTR_EP_COMM_SMS = 22,
  /** i64 0..1024, default 0 (any): on a config, the expert-parallel group size the caller expects
   *  (moeblaze_create_ep() refuses another); on a handle, the group's size (1 for a single-GPU
   *  layer). @since 0.2 */
  MOEBLAZE_ATTR_EP_SIZE = 23,
  /** i64 -1..1023, default -1 (any): on a config, the communicator rank the caller expects to
   *  be; on a handle, the layer's rank (0 for a single-GPU layer). @since 0.2 */
  MOEBLAZE_ATTR_EP_RANK = 24,
  /** i64 1..65536, default 1: the experts form this many groups of NUM_EXPERTS / NUM_EXPERT_GROUPS
   *  consecutive ids (create refuses a count that does not divide NUM_EXPERTS), for group-limited
   *  routing (#MOEBLAZE_ATTR_TOPK_GROUPS; docs/routing.md). @since 0.2 */
  MOEBLAZE_ATTR_NUM_EXPERT_GROUPS = 25,
  /** i64 0..65536, default 0 (no limit): group-limited routing as DeepSeek-V3's. A token picks its
   *  experts only from its TOPK_GROUPS best groups, a group's score being the sum of its two best
   *  selection scores. Create requires TOPK_GROUPS <= NUM_EXPERT_GROUPS and
   *  TOPK_GROUPS * (NUM_EXPERTS / NUM_EXPERT_GROUPS) >= TOP_K; a CUDA layer with a group limit
   *  takes at most 256 groups (more: NOT_SUPPORTED). @since 0.2 */
  MOEBLAZE_ATTR_TOPK_GROUPS = 26,
  /** f64 >= 0, default 1: multiplies the gates after any renormalisation (DeepSeek-V3's
   *  routed_scaling_factor). @since 0.2 */
  MOEBLAZE_ATTR_ROUTE_SCALE = 27,
  /** i64 ::moeblaze_aux_loss_form_t, default SWITCH: how the batch-wise balance loss (AUX_LOSS)
   *  is normalised. A call with #MOEBLAZE_ARG_SEQUENCE_LENGTHS takes DeepSeek-V3's sequence-wise
   *  form instead, which has no Hugging Face variant: with HUGGING_FACE it is refused.
   *  @since 0.2 */
  MOEBLAZE_ATTR_AUX_LOSS_FORM = 28,
  /** i64 0..2^62, default 0 (automatic): a memory budget for the CUDA fused engine's windows,
   *  in bytes, instead of a token count: a call whose backward row buffers fit it runs as one
   *  window, a larger one in windows whose row buffers and fp32 weight-gradient sums fit it
   *  together, of at least 1024 tokens (docs/memory.md gives the per-token bytes). Create refuses
   *  it together with #MOEBLAZE_ATTR_WINDOW_TOKENS. Results depend on it only through the fp32
   *  summation order of the weight gradients. Other engines ignore it. @since 0.2 */
  MOEBLAZE_ATTR_WINDOW_BYTES = 29,
  MOEBLAZE_ATTR__FORCE_INT32 = 0x7fffffff /**< Pins the enum to 32 bits. */
} moeblaze_attr_t;

/** @brief Number of attributes known to this header (attributes are 0..MOEBLAZE_ATTR_COUNT-1). */
#define MOEBLAZE_ATTR_COUNT 30

/** @brief How an expert-parallel layer moves rows (value of #MOEBLAZE_ATTR_EP_TRANSPORT). */
typedef enum moeblaze_ep_transport {
  MOEBLAZE_EP_TRANSPORT_AUTO = 0,   /**< NVLINK where every rank is a load/store peer, else HOST. */
  MOEBLAZE_EP_TRANSPORT_NVLINK = 1, /**< Load/store through NCCL's device API; every rank a peer. */
  MOEBLAZE_EP_TRANSPORT_HOST = 2,   /**< Grouped ncclSend/ncclRecv; one host sync per pass, no capture. */
  MOEBLAZE_EP_TRANSPORT__FORCE_INT32 = 0x7fffffff /**< Pins the enum to 32 bits. */
} moeblaze_ep_transport_t;

/**
 * @brief Creates a config with every attribute at its default.
 * @param[out] out Receives the new config.
 * @retval MOEBLAZE_STATUS_SUCCESS Created.
 * @retval MOEBLAZE_STATUS_INVALID_ARGUMENT @p out is NULL.
 * @retval MOEBLAZE_STATUS_OUT_OF_HOST_MEMORY Allocation failed.
 * @since 0.1
 */
MOEBLAZE_API moeblaze_status_t moeblaze_config_create(moeblaze_config_t* out);

/**
 * @brief Destroys a config. Never fails and leaves the last error message unchanged.
 * @param[in] cfg The config, or NULL (no-op).
 * @retval MOEBLAZE_STATUS_SUCCESS Always.
 * @since 0.1
 */
MOEBLAZE_API moeblaze_status_t moeblaze_config_destroy(moeblaze_config_t cfg);

/**
 * @brief Sets an integer attribute.
 * @param[in] cfg The config.
 * @param[in] attr The attribute.
 * @param[in] value The value; checked against the attribute's bounds.
 * @retval MOEBLAZE_STATUS_SUCCESS Set.
 * @retval MOEBLAZE_STATUS_INVALID_ARGUMENT @p cfg is NULL or @p value is out of bounds.
 * @retval MOEBLAZE_STATUS_UNKNOWN_ATTRIBUTE @p attr is not known.
 * @retval MOEBLAZE_STATUS_ATTRIBUTE_TYPE_MISMATCH @p attr is not an i64 attribute.
 * @since 0.1
 */
MOEBLAZE_API moeblaze_status_t moeblaze_config_set_i64(moeblaze_config_t cfg, moeblaze_attr_t attr,
                                                       int64_t value);

/**
 * @brief Sets a floating-point attribute.
 * @param[in] cfg The config.
 * @param[in] attr The attribute.
 * @param[in] value The value; must be finite and within bounds.
 * @retval MOEBLAZE_STATUS_SUCCESS Set.
 * @retval MOEBLAZE_STATUS_INVALID_ARGUMENT @p cfg is NULL or @p value is not allowed.
 * @retval MOEBLAZE_STATUS_UNKNOWN_ATTRIBUTE @p attr is not known.
 * @retval MOEBLAZE_STATUS_ATTRIBUTE_TYPE_MISMATCH @p attr is not an f64 attribute.
 * @since 0.1
 */
MOEBLAZE_API moeblaze_status_t moeblaze_config_set_f64(moeblaze_config_t cfg, moeblaze_attr_t attr,
                                                       double value);

/**
 * @brief Sets a dtype attribute.
 * @param[in] cfg The config.
 * @param[in] attr The attribute.
 * @param[in] value The dtype.
 * @retval MOEBLAZE_STATUS_SUCCESS Set.
 * @retval MOEBLAZE_STATUS_INVALID_ARGUMENT @p cfg is NULL or the dtype is not allowed here.
 * @retval MOEBLAZE_STATUS_NOT_SUPPORTED A valid dtype this version does not implement here.
 * @retval MOEBLAZE_STATUS_UNKNOWN_ATTRIBUTE @p attr is not known.
 * @retval MOEBLAZE_STATUS_ATTRIBUTE_TYPE_MISMATCH @p attr is not a dtype attribute.
 * @since 0.1
 */
MOEBLAZE_API moeblaze_status_t moeblaze_config_set_dtype(moeblaze_config_t cfg,
                                                         moeblaze_attr_t attr,
                                                         moeblaze_dtype_t value);

/**
 * @brief Reads an integer attribute.
 * @param[in] cfg The config.
 * @param[in] attr The attribute.
 * @param[out] out Receives the value.
 * @retval MOEBLAZE_STATUS_SUCCESS Read.
 * @retval MOEBLAZE_STATUS_INVALID_ARGUMENT @p cfg or @p out is NULL.
 * @retval MOEBLAZE_STATUS_UNKNOWN_ATTRIBUTE @p attr is not known.
 * @retval MOEBLAZE_STATUS_ATTRIBUTE_TYPE_MISMATCH @p attr is not an i64 attribute.
 * @since 0.1
 */
MOEBLAZE_API moeblaze_status_t moeblaze_config_get_i64(moeblaze_config_t cfg, moeblaze_attr_t attr,
                                                       int64_t* out);

/**
 * @brief Reads a floating-point attribute.
 * @param[in] cfg The config.
 * @param[in] attr The attribute.
 * @param[out] out Receives the value.
 * @retval MOEBLAZE_STATUS_SUCCESS Read.
 * @retval MOEBLAZE_STATUS_INVALID_ARGUMENT @p cfg or @p out is NULL.
 * @retval MOEBLAZE_STATUS_UNKNOWN_ATTRIBUTE @p attr is not known.
 * @retval MOEBLAZE_STATUS_ATTRIBUTE_TYPE_MISMATCH @p attr is not an f64 attribute.
 * @since 0.1
 */
MOEBLAZE_API moeblaze_status_t moeblaze_config_get_f64(moeblaze_config_t cfg, moeblaze_attr_t attr,
                                                       double* out);

/**
 * @brief Reads a dtype attribute.
 * @param[in] cfg The config.
 * @param[in] attr The attribute.
 * @param[out] out Receives the value.
 * @retval MOEBLAZE_STATUS_SUCCESS Read.
 * @retval MOEBLAZE_STATUS_INVALID_ARGUMENT @p cfg or @p out is NULL.
 * @retval MOEBLAZE_STATUS_UNKNOWN_ATTRIBUTE @p attr is not known.
 * @retval MOEBLAZE_STATUS_ATTRIBUTE_TYPE_MISMATCH @p attr is not a dtype attribute.
 * @since 0.1
 */
MOEBLAZE_API moeblaze_status_t moeblaze_config_get_dtype(moeblaze_config_t cfg,
                                                         moeblaze_attr_t attr,
                                                         moeblaze_dtype_t* out);

/** @brief Description of one attribute, for bindings that build keyword arguments. */
typedef struct moeblaze_attr_info {
  size_t struct_size;     /**< Set by the caller to sizeof(moeblaze_attr_info_t); the library writes min(struct_size, its own size) bytes. */
  const char* name;       /**< Lower-case name, e.g. "top_k"; static string. */
  int32_t value_type;     /**< A ::moeblaze_value_type_t value. */
  int32_t required;       /**< 1 if moeblaze_create() fails without it. */
  int64_t min_i64;        /**< Smallest allowed value (i64 attributes). */
  int64_t max_i64;        /**< Largest allowed value (i64 attributes). */
  int64_t default_i64;    /**< Default value (i64 attributes). */
  double default_f64;     /**< Default value (f64 attributes). */
  uint32_t since_version; /**< Version that introduced it, encoded with #MOEBLAZE_VERSION_ENCODE. */
} moeblaze_attr_info_t;

/**
 * @brief Describes an attribute.
 * @param[in] attr The attribute.
 * @param[in,out] info The caller sets @c struct_size; the library fills the rest.
 * @retval MOEBLAZE_STATUS_SUCCESS Filled.
 * @retval MOEBLAZE_STATUS_INVALID_ARGUMENT @p info is NULL.
 * @retval MOEBLAZE_STATUS_VERSION_MISMATCH @c struct_size is smaller than the first two fields.
 * @retval MOEBLAZE_STATUS_UNKNOWN_ATTRIBUTE @p attr is not known.
 * @since 0.1
 */
MOEBLAZE_API moeblaze_status_t moeblaze_attr_query(moeblaze_attr_t attr, moeblaze_attr_info_t* info);
/** @} */

/**
 * @defgroup handle Handles and devices
 * @brief An immutable, validated layer description bound to one device and engine.
 *
 * @par Thread safety
 * A handle is immutable after moeblaze_create(): forward, backward, route and the size
 * queries may run concurrently on one handle from many threads and streams, as long as each
 * in-flight call has its own workspace and saved buffer.
 * @{
 */
/** @brief Opaque handle. */
typedef struct moeblaze_handle_s* moeblaze_handle_t;

/**
 * @brief Counts the devices of a type that this build can use.
 * @param[in] device_type A ::moeblaze_device_type_t value.
 * @param[out] count Receives the count: 1 for the CPU; the CUDA device count (0 if the
 *             build has no CUDA support, no driver is installed or no GPU is present).
 * @retval MOEBLAZE_STATUS_SUCCESS Counted.
 * @retval MOEBLAZE_STATUS_INVALID_ARGUMENT @p count is NULL or @p device_type is unknown.
 * @since 0.1
 */
MOEBLAZE_API moeblaze_status_t moeblaze_get_device_count(int32_t device_type, int32_t* count);

/**
 * @brief Validates a config and creates a handle for it.
 * @param[out] out Receives the handle.
 * @param[in] cfg The config; it is copied, so it may be destroyed afterwards.
 * @retval MOEBLAZE_STATUS_SUCCESS Created.
 * @retval MOEBLAZE_STATUS_INVALID_ARGUMENT A NULL pointer, a required attribute missing or
 *         inconsistent attributes (e.g. TOP_K > NUM_EXPERTS).
 * @retval MOEBLAZE_STATUS_NOT_SUPPORTED The engine does not implement this configuration.
 * @retval MOEBLAZE_STATUS_ARCH_MISMATCH The device does not exist or has no kernels here.
 * @retval MOEBLAZE_STATUS_OUT_OF_HOST_MEMORY A host allocation failed.
 * @retval MOEBLAZE_STATUS_OUT_OF_DEVICE_MEMORY A device allocation failed.
 * @retval MOEBLAZE_STATUS_CUDA_ERROR The CUDA runtime failed.
 * @since 0.1
 */
MOEBLAZE_API moeblaze_status_t moeblaze_create(moeblaze_handle_t* out, moeblaze_config_t cfg);

/**
 * @brief Creates an expert-parallel layer over the ranks of an NCCL communicator
 *        (docs/ep.md). Collective: every rank of the communicator calls it, with the same
 *        config, at the same point of its program.
 *
 * The P ranks each own NUM_EXPERTS / P experts (rank r: experts [r E/P, (r+1) E/P)); the
 * handle's W_GATE_UP, W_DOWN and their gradients hold those local experts only. Every other
 * argument keeps its meaning for the rank's own tokens (at most MAX_TOKENS of them), and
 * moeblaze_forward() and moeblaze_backward() on the handle are collective steps: every rank makes
 * the same sequence of calls. A step never synchronises the host and can be captured in a CUDA
 * graph. The layer is dropless: it receives up to P * MAX_TOKENS rows per rank.
 * @param[out] out Receives the handle.
 * @param[in] cfg The config (DEVICE_TYPE CUDA; DEVICE_ID the communicator rank's device).
 * @param[in] nccl_comm The caller's ncclComm_t, borrowed: it must stay alive until
 *            moeblaze_destroy() of every handle made on it has returned (destroy is collective
 *            too). All its ranks must be load/store peers (one NVLink domain).
 * @param[in] stream A cudaStream_t (NULL: the default stream) that must not be capturing:
 *            create registers memory with NCCL and checks the ranks' configs on it, and
 *            synchronises it.
 * @retval MOEBLAZE_STATUS_SUCCESS Created.
 * @retval MOEBLAZE_STATUS_INVALID_ARGUMENT A NULL pointer, NUM_EXPERTS not divisible by the
 *         number of ranks, configs that differ across ranks, or a capturing stream.
 * @retval MOEBLAZE_STATUS_NOT_SUPPORTED No NCCL with the device API can be loaded, this build has
 *         no expert parallelism (MOEBLAZE_ENABLE_EP), or the ranks are not load/store peers.
 * @retval MOEBLAZE_STATUS_INTERNAL_ERROR NCCL failed (the message names the call).
 * @since 0.2
 */
MOEBLAZE_API moeblaze_status_t moeblaze_create_ep(moeblaze_handle_t* out, moeblaze_config_t cfg, void* nccl_comm,
                                                  void* stream);

/**
 * @brief moeblaze_create_ep() for a caller without a communicator: the layer makes one from an
 *        ncclUniqueId (ncclCommInitRank on the config's device) and destroys it with the handle.
 *        Collective over the @p nranks ranks, each passing its @p rank and the same id (made by
 *        ncclGetUniqueId on one rank and shared by the caller).
 * @param[out] out Receives the handle.
 * @param[in] cfg The config, as for moeblaze_create_ep().
 * @param[in] unique_id The ncclUniqueId's bytes.
 * @param[in] unique_id_bytes Their count: sizeof(ncclUniqueId), 128.
 * @param[in] nranks The group's size P.
 * @param[in] rank This caller's rank in [0, P).
 * @param[in] stream As for moeblaze_create_ep().
 * @retval MOEBLAZE_STATUS_SUCCESS Created.
 * @retval MOEBLAZE_STATUS_INVALID_ARGUMENT A NULL pointer, a rank outside [0, nranks), a wrong
 *         unique_id_bytes, or as moeblaze_create_ep().
 * @retval MOEBLAZE_STATUS_NOT_SUPPORTED As moeblaze_create_ep().
 * @retval MOEBLAZE_STATUS_INTERNAL_ERROR NCCL failed (the message names the call).
 * @since 0.2
 */
MOEBLAZE_API moeblaze_status_t moeblaze_create_ep_from_unique_id(moeblaze_handle_t* out, moeblaze_config_t cfg,
                                                                 const void* unique_id, size_t unique_id_bytes,
                                                                 int32_t nranks, int32_t rank, void* stream);

/**
 * @brief Bytes of symmetric memory (ncclMemAlloc, registered with NCCL) that
 *        moeblaze_create_ep() allocates on each rank for @p cfg over @p ep_size ranks; a
 *        function of the shapes alone (docs/ep.md, "Memory"). With EP_TRANSPORT = HOST, the
 *        plain device memory it allocates instead (the same receive layout and a staging area).
 * @param[in] cfg The config the layer would be created with.
 * @param[in] ep_size The number of ranks P.
 * @param[out] bytes Receives the size.
 * @retval MOEBLAZE_STATUS_SUCCESS Written.
 * @retval MOEBLAZE_STATUS_INVALID_ARGUMENT A NULL pointer, an invalid config, or NUM_EXPERTS
 *         not divisible by @p ep_size.
 * @since 0.2
 */
MOEBLAZE_API moeblaze_status_t moeblaze_get_symmetric_size(moeblaze_config_t cfg, int32_t ep_size, size_t* bytes);

/**
 * @brief Destroys a handle. The caller guarantees no in-flight work still uses it. Never
 *        fails and leaves the last error message unchanged (safe in finalizers).
 * @param[in] handle The handle, or NULL (no-op).
 * @retval MOEBLAZE_STATUS_SUCCESS Always.
 * @since 0.1
 */
MOEBLAZE_API moeblaze_status_t moeblaze_destroy(moeblaze_handle_t handle);

/**
 * @brief Reads an integer attribute of a handle (the effective value, e.g. the engine chosen).
 * @param[in] handle The handle.
 * @param[in] attr The attribute.
 * @param[out] out Receives the value.
 * @retval MOEBLAZE_STATUS_SUCCESS Read.
 * @retval MOEBLAZE_STATUS_INVALID_ARGUMENT @p handle or @p out is NULL.
 * @retval MOEBLAZE_STATUS_UNKNOWN_ATTRIBUTE @p attr is not known.
 * @retval MOEBLAZE_STATUS_ATTRIBUTE_TYPE_MISMATCH @p attr is not an i64 attribute.
 * @since 0.1
 */
MOEBLAZE_API moeblaze_status_t moeblaze_handle_get_i64(moeblaze_handle_t handle,
                                                       moeblaze_attr_t attr, int64_t* out);

/**
 * @brief Reads a floating-point attribute of a handle.
 * @param[in] handle The handle.
 * @param[in] attr The attribute.
 * @param[out] out Receives the value.
 * @retval MOEBLAZE_STATUS_SUCCESS Read.
 * @retval MOEBLAZE_STATUS_INVALID_ARGUMENT @p handle or @p out is NULL.
 * @retval MOEBLAZE_STATUS_UNKNOWN_ATTRIBUTE @p attr is not known.
 * @retval MOEBLAZE_STATUS_ATTRIBUTE_TYPE_MISMATCH @p attr is not an f64 attribute.
 * @since 0.1
 */
MOEBLAZE_API moeblaze_status_t moeblaze_handle_get_f64(moeblaze_handle_t handle,
                                                       moeblaze_attr_t attr, double* out);

/**
 * @brief Reads a dtype attribute of a handle.
 * @param[in] handle The handle.
 * @param[in] attr The attribute.
 * @param[out] out Receives the value.
 * @retval MOEBLAZE_STATUS_SUCCESS Read.
 * @retval MOEBLAZE_STATUS_INVALID_ARGUMENT @p handle or @p out is NULL.
 * @retval MOEBLAZE_STATUS_UNKNOWN_ATTRIBUTE @p attr is not known.
 * @retval MOEBLAZE_STATUS_ATTRIBUTE_TYPE_MISMATCH @p attr is not a dtype attribute.
 * @since 0.1
 */
MOEBLAZE_API moeblaze_status_t moeblaze_handle_get_dtype(moeblaze_handle_t handle,
                                                         moeblaze_attr_t attr,
                                                         moeblaze_dtype_t* out);
/** @} */

/**
 * @defgroup sizes Size queries
 * @brief Workspace and saved-buffer sizes, from host-known shapes only.
 *
 * Sizes depend only on the handle's config and @c num_tokens, never on routing or data.
 * They are monotone in @c num_tokens and bounded by their value at MAX_TOKENS, so a caller
 * may allocate once for the maximum. Dropless routing is sized for the worst case (all L*k
 * assignments on one expert). The formulas are in docs/memory.md. Both buffers must be
 * aligned to #MOEBLAZE_BUFFER_ALIGNMENT bytes. For a CPU handle both live in host memory.
 * @{
 */
/** @brief Required alignment, in bytes, of workspace and saved buffers. */
#define MOEBLAZE_BUFFER_ALIGNMENT 256

/** @brief Which call a workspace is for. */
typedef enum moeblaze_pass {
  MOEBLAZE_PASS_FORWARD_TRAINING = 0,  /**< moeblaze_forward() that writes the saved buffer. */
  MOEBLAZE_PASS_FORWARD_INFERENCE = 1, /**< moeblaze_forward() without a saved buffer. */
  MOEBLAZE_PASS_BACKWARD = 2,          /**< moeblaze_backward(). */
  MOEBLAZE_PASS_ROUTE = 3,             /**< moeblaze_route(). */
  /** moeblaze_backward_last_use(): a backward that may overwrite the saved buffer. @since 0.3 */
  MOEBLAZE_PASS_BACKWARD_LAST_USE = 4,
  MOEBLAZE_PASS__FORCE_INT32 = 0x7fffffff /**< Pins the enum to 32 bits. */
} moeblaze_pass_t;

/**
 * @brief Scratch bytes a call needs; free to reuse once that call's work has completed.
 * @param[in] handle The handle.
 * @param[in] pass The call.
 * @param[in] num_tokens Tokens L in the call, 0..MAX_TOKENS.
 * @param[out] bytes Receives the size (a multiple of #MOEBLAZE_BUFFER_ALIGNMENT; may be 0).
 * @retval MOEBLAZE_STATUS_SUCCESS Computed.
 * @retval MOEBLAZE_STATUS_INVALID_ARGUMENT NULL pointer, unknown pass, or L outside 0..MAX_TOKENS.
 * @since 0.1
 */
MOEBLAZE_API moeblaze_status_t moeblaze_get_workspace_size(moeblaze_handle_t handle,
                                                           moeblaze_pass_t pass,
                                                           int64_t num_tokens, size_t* bytes);

/**
 * @brief Bytes forward (training) keeps for backward, per the handle's save policy.
 * @param[in] handle The handle.
 * @param[in] num_tokens Tokens L in the call, 0..MAX_TOKENS.
 * @param[out] bytes Receives the size (a multiple of #MOEBLAZE_BUFFER_ALIGNMENT; may be 0).
 * @retval MOEBLAZE_STATUS_SUCCESS Computed.
 * @retval MOEBLAZE_STATUS_INVALID_ARGUMENT NULL pointer or L outside 0..MAX_TOKENS.
 * @since 0.1
 */
MOEBLAZE_API moeblaze_status_t moeblaze_get_saved_size(moeblaze_handle_t handle,
                                                       int64_t num_tokens, size_t* bytes);
/** @} */

/**
 * @defgroup execution Arguments and execution
 * @brief Forward, backward and router-only calls, with arguments passed by kind.
 *
 * Shapes: L tokens, d = HIDDEN_SIZE, h = FFN_HIDDEN_SIZE, E = NUM_EXPERTS, k = TOP_K,
 * g = 2 for SWIGLU/GEGLU else 1. Float tensors use ACTIVATION_DTYPE (x, y, dy, dx) or
 * WEIGHT_DTYPE (weights and their gradients); router tensors (logits, top-k weights and
 * their gradients) may be F32 or ACTIVATION_DTYPE; top-k ids and token counts are I32 or I64.
 * Strides are honoured when the innermost stride is 1 and every outer stride steps past the
 * last element of the block inside it (padding between rows or experts is free; no element
 * may share an address with another or come out of order); anything else is rejected, never
 * misread. The expert weights and their gradients
 * (W_GATE_UP, W_DOWN, GRAD_W_GATE_UP, GRAD_W_DOWN) may instead store each expert's matrix
 * column-major: stride 1 in dimension 1 and a column pitch >= its extent in dimension 2, as
 * nn.Linear's [E, out, in] seen through transpose(1, 2). Every engine reads them, and writes
 * the gradients, in place (0.1.0 rejected these strides). L = 0 is valid and writes only the
 * scalar and per-expert outputs (and zero weight gradients unless accumulating).
 *
 * Routing input, in this order of precedence:
 * 1. #MOEBLAZE_ARG_ROUTER_LOGITS [L, E] given: scores, top-k and gates are computed from them.
 * 2. #MOEBLAZE_ARG_ROUTER_WEIGHT W_g [E, d] given: logits = x W_g^T, then as above.
 * 3. Neither: #MOEBLAZE_ARG_TOPK_INDICES and #MOEBLAZE_ARG_TOPK_WEIGHTS are inputs (the
 *    caller routed, e.g. expert parallelism). Ids are validated (0 <= id < E, distinct per
 *    token); a bad id fails the call with INVALID_ARGUMENT before anything is written (the
 *    fused engine, which never syncs, finds it on the device instead: outputs NaN and
 *    #MOEBLAZE_ARG_STATUS = INVALID_ARGUMENT; see docs/errors.md).
 * In cases 1 and 2, TOPK_INDICES, TOPK_WEIGHTS and TOKENS_PER_EXPERT are optional outputs.
 * Backward takes the same routing inputs as the forward it follows (logits, or x and W_g, to
 * recompute the router scores); the ids and gates come from the saved buffer, so in case 3
 * TOPK_INDICES and TOPK_WEIGHTS may be passed to backward but are not read.
 *
 * @par Stream semantics
 * forward, backward and route return once all work is enqueued on @c stream (for a CPU
 * handle: once the work is done; @c stream is ignored). The fused CUDA engine never
 * synchronises the host and is CUDA-graph capturable; the cuBLASLt engine copies the E+1
 * expert offsets to the host once per call. No call allocates device memory. Inputs,
 * outputs, workspace and saved must stay valid until the work completes.
 *
 * @par Aliasing
 * Nothing a call writes may share a byte with anything else it touches: an output or
 * gradient with another argument, the workspace or the saved buffer, and the workspace with
 * the saved buffer (the bytes compared are those the call needs). Inputs may share memory
 * with each other. Violations are INVALID_ARGUMENT before anything is written.
 *
 * @par Device
 * Every tensor must live on the handle's device. A saved buffer written by one handle may
 * only be consumed by that handle with the same number of tokens.
 * @{
 */
/** @brief Argument kinds. Numbers are frozen; new kinds are appended. */
typedef enum moeblaze_arg_kind {
  /** Input x [L, d], ACTIVATION_DTYPE. Required by forward and backward. @since 0.1 */
  MOEBLAZE_ARG_INPUT = 1,
  /** Router weight W_g [E, d], WEIGHT_DTYPE. @since 0.1 */
  MOEBLAZE_ARG_ROUTER_WEIGHT = 2,
  /** Router logits [L, E], F32 or ACTIVATION_DTYPE. @since 0.1 */
  MOEBLAZE_ARG_ROUTER_LOGITS = 3,
  /** Optional expert score bias b [E], F32 (aux-loss-free balancing as DeepSeek-V3's): added to
   *  the scores to rank the experts, never to the gates, which come from the unbiased scores.
   *  For the library's routing only (refused with caller routing); backward accepts it and does
   *  not read it. Every engine picks the same experts with it, bit for bit (docs/routing.md).
   *  @since 0.2 */
  MOEBLAZE_ARG_EXPERT_BIAS = 4,
  /** Expert up weights [E, d, g*h] (gate columns first, then up), WEIGHT_DTYPE. @since 0.1 */
  MOEBLAZE_ARG_W_GATE_UP = 5,
  /** Expert down weights [E, h, d], WEIGHT_DTYPE. @since 0.1 */
  MOEBLAZE_ARG_W_DOWN = 6,
  /** Top-k expert ids [L, k], I32 or I64: input (caller routing) or optional output. @since 0.1 */
  MOEBLAZE_ARG_TOPK_INDICES = 7,
  /** Top-k gate weights [L, k], F32 or ACTIVATION_DTYPE: input or optional output. @since 0.1 */
  MOEBLAZE_ARG_TOPK_WEIGHTS = 8,
  /** Optional sequence lengths [B], I32 or I64, each >= 1, summing to the call's tokens: the
   *  tokens form B consecutive sequences, and AUX_LOSS is DeepSeek-V3's sequence-wise balance
   *  loss, averaged over them, instead of the batch-wise one (docs/routing.md). For the
   *  library's routing; backward takes it again for the loss's gradient. B > L (or B = 0 with
   *  tokens) is refused at once. On the CPU the lengths are checked before anything is written;
   *  on a GPU they are device memory, checked on the device: the cuBLASLt engine then fails
   *  the call with INVALID_ARGUMENT before writing an output, the fused engine (which never
   *  syncs) reports INVALID_ARGUMENT through #MOEBLAZE_ARG_STATUS and fills its outputs and
   *  AUX_LOSS with NaN. @since 0.2 */
  MOEBLAZE_ARG_SEQUENCE_LENGTHS = 9,
  /** Optional token mask [L], I32 or I64: a token whose entry is 0 is masked (padding). A masked
   *  token is not routed (TOPK_INDICES output -1, TOPK_WEIGHTS 0, counted in no
   *  TOKENS_PER_EXPERT), costs no expert compute, gets y = 0 and zero gradients, and is left out
   *  of the balance loss and the z-loss, which are then taken over the unmasked tokens. Forward
   *  and route; backward accepts it and does not need it (the saved plan marks the masked
   *  tokens). With caller routing, a masked token's ids and gates are not read. With
   *  #MOEBLAZE_ARG_SEQUENCE_LENGTHS each sequence's term is taken over its unmasked tokens and
   *  the mean over the sequences that keep one. On the expert-parallel layer a masked token is
   *  sent to no rank. @since 0.2 */
  MOEBLAZE_ARG_TOKEN_MASK = 10,
  /** Output y [L, d], ACTIVATION_DTYPE. Required by forward. @since 0.1 */
  MOEBLAZE_ARG_OUTPUT = 32,
  /** Optional output, F32 scalar: AUX_LOSS_COEFF * E * sum_e f_e P_e; exactly 0 when the
   *  coefficient is 0, whatever the scores. @since 0.1 */
  MOEBLAZE_ARG_AUX_LOSS = 33,
  /** Optional output [E], I32 or I64: tokens routed to each expert. @since 0.1 */
  MOEBLAZE_ARG_TOKENS_PER_EXPERT = 34,
  /** Optional output, F32 scalar: Z_LOSS_COEFF * mean_t logsumexp(logits_t)^2; exactly 0 when
   *  the coefficient is 0. @since 0.1 */
  MOEBLAZE_ARG_Z_LOSS = 35,
  /**
   * Optional output, I32 scalar on the handle's device, valid in every pass: the call's
   * device-side status, written in stream order. 0 when the call's device-side checks passed;
   * otherwise a ::moeblaze_status_t value (MOEBLAZE_STATUS_INVALID_ARGUMENT for caller ids out
   * of range or repeated, or a saved buffer whose routing plan fails its checks), in which case
   * the outputs are NaN-filled and no index escaped its buffer. Engines that check on the host
   * (CPU, CUDA cuBLASLt) return such failures synchronously and write 0 here on success; a
   * call that returns a failure writes nothing, this argument included. Lets a sync-free
   * engine report what it found without a host synchronisation (ncclCommGetAsyncError's role).
   * @since 0.2
   */
  MOEBLAZE_ARG_STATUS = 36,
  /** Gradient dy [L, d], ACTIVATION_DTYPE. Required by backward. @since 0.1 */
  MOEBLAZE_ARG_GRAD_OUTPUT = 64,
  /** Optional F32 scalar dLoss/dAUX_LOSS (default 1 when absent). @since 0.1 */
  MOEBLAZE_ARG_GRAD_AUX_LOSS = 65,
  /** Optional F32 scalar dLoss/dZ_LOSS (default 1 when absent). @since 0.1 */
  MOEBLAZE_ARG_GRAD_Z_LOSS = 66,
  /** Optional output dx [L, d], ACTIVATION_DTYPE (includes the router path). @since 0.1 */
  MOEBLAZE_ARG_GRAD_INPUT = 96,
  /** Optional output dW_g [E, d], WEIGHT_DTYPE (routing from W_g). @since 0.1 */
  MOEBLAZE_ARG_GRAD_ROUTER_WEIGHT = 97,
  /** Optional output d logits [L, E], F32 or ACTIVATION_DTYPE (routing from logits). @since 0.1 */
  MOEBLAZE_ARG_GRAD_ROUTER_LOGITS = 98,
  /* 99 is reserved for the expert bias gradient. */
  /** Optional output dW_gate_up [E, d, g*h], WEIGHT_DTYPE. @since 0.1 */
  MOEBLAZE_ARG_GRAD_W_GATE_UP = 100,
  /** Optional output dW_down [E, h, d], WEIGHT_DTYPE. @since 0.1 */
  MOEBLAZE_ARG_GRAD_W_DOWN = 101,
  /** Optional output d top-k weights [L, k], F32 or ACTIVATION_DTYPE (caller routing). @since 0.1 */
  MOEBLAZE_ARG_GRAD_TOPK_WEIGHTS = 102,
  MOEBLAZE_ARG__FORCE_INT32 = 0x7fffffff /**< Pins the enum to 32 bits. */
} moeblaze_arg_kind_t;

/** @brief Flag on a gradient output: add the result to the tensor instead of overwriting it. */
#define MOEBLAZE_ARG_FLAG_ACCUMULATE 0x1u

/** @brief One argument: its kind, flags and tensor (56 bytes). */
typedef struct moeblaze_arg {
  int32_t kind;             /**< A ::moeblaze_arg_kind_t value. */
  uint32_t flags;           /**< Bitwise OR of MOEBLAZE_ARG_FLAG_* values; 0 for none. */
  moeblaze_tensor_t tensor; /**< The tensor (for scalars: ndim 0, or ndim 1 with shape [1]). */
} moeblaze_arg_t;

/**
 * @brief Validates argument descriptors on the host exactly as the call for @p pass would,
 *        doing no work. It reads no tensor data: caller-given expert ids are checked by the
 *        call itself, and buffer sizes by forward/backward/route.
 * @param[in] handle The handle.
 * @param[in] pass The call the arguments are for.
 * @param[in] args The arguments.
 * @param[in] num_args Number of arguments.
 * @retval MOEBLAZE_STATUS_SUCCESS The call would accept the arguments.
 * @retval MOEBLAZE_STATUS_INVALID_ARGUMENT An argument is missing, duplicated, unknown, or
 *         has a bad shape, dtype, stride, device or flag.
 * @retval MOEBLAZE_STATUS_NOT_SUPPORTED A valid argument this engine does not implement.
 * @since 0.1
 */
MOEBLAZE_API moeblaze_status_t moeblaze_check_args(moeblaze_handle_t handle, moeblaze_pass_t pass,
                                                   const moeblaze_arg_t* args, size_t num_args);

/**
 * @brief Runs the MoE layer forward: route, plan, expert MLPs, combine.
 * @param[in] handle The handle.
 * @param[in] pass #MOEBLAZE_PASS_FORWARD_TRAINING (writes @p saved) or
 *            #MOEBLAZE_PASS_FORWARD_INFERENCE (ignores @p saved).
 * @param[in] args The arguments (see ::moeblaze_arg_kind_t).
 * @param[in] num_args Number of arguments.
 * @param[in] workspace Scratch of at least moeblaze_get_workspace_size(pass) bytes.
 * @param[in] workspace_bytes Size of @p workspace.
 * @param[out] saved Training: at least moeblaze_get_saved_size() bytes, for backward.
 * @param[in] saved_bytes Size of @p saved.
 * @param[in] stream The stream (CUDA handles).
 * @retval MOEBLAZE_STATUS_SUCCESS Done (CPU) or enqueued (CUDA).
 * @retval MOEBLAZE_STATUS_INVALID_ARGUMENT Bad arguments (see moeblaze_check_args()), a bad
 *         caller-given expert id, or a NULL/misaligned buffer.
 * @retval MOEBLAZE_STATUS_INSUFFICIENT_WORKSPACE @p workspace or @p saved is too small.
 * @retval MOEBLAZE_STATUS_NOT_SUPPORTED The engine does not implement this request.
 * @retval MOEBLAZE_STATUS_CUDA_ERROR A CUDA launch failed.
 * @retval MOEBLAZE_STATUS_CUBLAS_ERROR cuBLASLt failed.
 * @since 0.1
 */
MOEBLAZE_API moeblaze_status_t moeblaze_forward(moeblaze_handle_t handle, moeblaze_pass_t pass,
                                                const moeblaze_arg_t* args, size_t num_args,
                                                void* workspace, size_t workspace_bytes,
                                                void* saved, size_t saved_bytes,
                                                moeblaze_stream_t stream);

/**
 * @brief Runs the MoE layer backward from the saved buffer of a training forward.
 * @param[in] handle The handle that ran the forward.
 * @param[in] args Inputs (x, weights, dy, routing inputs) and the gradients wanted.
 * @param[in] num_args Number of arguments.
 * @param[in] saved The saved buffer the forward wrote, for the same number of tokens.
 * @param[in] saved_bytes Size of @p saved.
 * @param[in] workspace Scratch of at least moeblaze_get_workspace_size(BACKWARD) bytes.
 * @param[in] workspace_bytes Size of @p workspace.
 * @param[in] stream The stream (CUDA handles).
 * @retval MOEBLAZE_STATUS_SUCCESS Done (CPU) or enqueued (CUDA).
 * @retval MOEBLAZE_STATUS_INVALID_ARGUMENT Bad arguments or a NULL/misaligned buffer.
 * @retval MOEBLAZE_STATUS_INSUFFICIENT_WORKSPACE @p workspace or @p saved is too small.
 * @retval MOEBLAZE_STATUS_NOT_SUPPORTED The engine does not implement this request.
 * @retval MOEBLAZE_STATUS_CUDA_ERROR A CUDA launch failed.
 * @retval MOEBLAZE_STATUS_CUBLAS_ERROR cuBLASLt failed.
 * @since 0.1
 */
MOEBLAZE_API moeblaze_status_t moeblaze_backward(moeblaze_handle_t handle,
                                                 const moeblaze_arg_t* args, size_t num_args,
                                                 const void* saved, size_t saved_bytes,
                                                 void* workspace, size_t workspace_bytes,
                                                 moeblaze_stream_t stream);

/**
 * @brief moeblaze_backward() for the saved buffer's last use: the backward may write over the
 *        saved buffer, so it needs less workspace (moeblaze_get_workspace_size() with
 *        #MOEBLAZE_PASS_BACKWARD_LAST_USE, at most the BACKWARD size).
 *
 * The same arguments, checks and results as moeblaze_backward(), bit for bit. What the saved
 * buffer then holds is unspecified, except that it is marked spent: a later backward on it is
 * refused (INVALID_ARGUMENT at once on engines that check on the host; on the fused engine,
 * which never syncs, through #MOEBLAZE_ARG_STATUS with NaN outputs), until a training forward
 * writes it again. For callers that run one backward per forward (an autograd framework that
 * does not retain the graph). What it saves, per engine and save policy, is in docs/memory.md:
 * on the fused engine the pre-activation gradients take the saved pre-activations' place.
 * Since it writes the saved buffer, no argument may share a byte with it (INVALID_ARGUMENT, as
 * for any written buffer; moeblaze_backward() lets inputs lie there).
 * @param[in] handle The handle that ran the forward.
 * @param[in] args As for moeblaze_backward().
 * @param[in] num_args Number of arguments.
 * @param[in,out] saved The saved buffer the forward wrote, for the same number of tokens.
 * @param[in] saved_bytes Size of @p saved.
 * @param[in] workspace Scratch of at least moeblaze_get_workspace_size(BACKWARD_LAST_USE) bytes.
 * @param[in] workspace_bytes Size of @p workspace.
 * @param[in] stream The stream (CUDA handles).
 * @return As moeblaze_backward().
 * @since 0.3
 */
MOEBLAZE_API moeblaze_status_t moeblaze_backward_last_use(moeblaze_handle_t handle,
                                                          const moeblaze_arg_t* args, size_t num_args,
                                                          void* saved, size_t saved_bytes,
                                                          void* workspace, size_t workspace_bytes,
                                                          moeblaze_stream_t stream);

/**
 * @brief Runs the router alone: logits (or x and W_g) -> top-k ids and weights, token
 *        counts per expert, aux loss and z-loss.
 * @param[in] handle The handle.
 * @param[in] args ROUTER_LOGITS, or INPUT and ROUTER_WEIGHT; outputs TOPK_INDICES,
 *            TOPK_WEIGHTS (required), TOKENS_PER_EXPERT, AUX_LOSS, Z_LOSS (optional).
 * @param[in] num_args Number of arguments.
 * @param[in] workspace Scratch of at least moeblaze_get_workspace_size(ROUTE) bytes.
 * @param[in] workspace_bytes Size of @p workspace.
 * @param[in] stream The stream (CUDA handles).
 * @retval MOEBLAZE_STATUS_SUCCESS Done (CPU) or enqueued (CUDA).
 * @retval MOEBLAZE_STATUS_INVALID_ARGUMENT Bad arguments or a NULL/misaligned buffer.
 * @retval MOEBLAZE_STATUS_INSUFFICIENT_WORKSPACE @p workspace is too small.
 * @retval MOEBLAZE_STATUS_NOT_SUPPORTED The engine does not implement this request.
 * @retval MOEBLAZE_STATUS_CUDA_ERROR A CUDA launch failed.
 * @since 0.1
 */
MOEBLAZE_API moeblaze_status_t moeblaze_route(moeblaze_handle_t handle, const moeblaze_arg_t* args,
                                              size_t num_args, void* workspace,
                                              size_t workspace_bytes, moeblaze_stream_t stream);

/**
 * @brief Turns an error that a call reported through its #MOEBLAZE_ARG_STATUS scalar into a
 *        CUDA device-side assertion that names the cause, without synchronising the host.
 *
 * For callers whose convention is asynchronous asserts, as PyTorch checks indices on the GPU:
 * enqueues, on @p stream, one tiny kernel that does nothing when @p status reads 0 and
 * otherwise fails an assertion whose text names the pass and the cause ("a caller expert id
 * outside [0, NUM_EXPERTS) or repeated within a token"; "the saved buffer was not written by
 * this layer's forward for these tokens"). The CUDA runtime prints that text to stderr and the
 * caller's next synchronising call returns cudaErrorAssert; as after any device-side assert,
 * the process's CUDA context is then unusable. Capturable in a CUDA graph. A caller who can
 * afford a synchronisation reads the STATUS scalar instead (docs/errors.md).
 * On a CPU handle the status is host memory and is read at once: a non-zero value returns
 * #MOEBLAZE_STATUS_INVALID_ARGUMENT with the same message.
 * @param[in] handle The handle whose call wrote @p status.
 * @param[in] pass The pass of that call (which decides the message).
 * @param[in] status The STATUS scalar given to that call: int32, ndim 0 or shape [1], on the
 *            handle's device.
 * @param[in] stream The stream the call ran on (CUDA handles).
 * @retval MOEBLAZE_STATUS_SUCCESS Enqueued (CUDA), or the status reads 0 (CPU).
 * @retval MOEBLAZE_STATUS_INVALID_ARGUMENT Bad @p pass or @p status; or, on a CPU handle, a
 *         non-zero status.
 * @retval MOEBLAZE_STATUS_CUDA_ERROR The launch failed.
 * @since 0.2
 */
MOEBLAZE_API moeblaze_status_t moeblaze_assert_status(moeblaze_handle_t handle, moeblaze_pass_t pass,
                                                      const moeblaze_tensor_t* status,
                                                      moeblaze_stream_t stream);
/** @} */

#ifdef __cplusplus
} /* extern "C" */
#endif

#endif /* MOEBLAZE_MOEBLAZE_H_ */
