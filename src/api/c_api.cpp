// The C ABI: the only extern "C" code of the library. Each entry point validates its
// pointers, converts to the C++ core, and runs inside api::guard (no exception escapes).
#include <cstddef>
#include <cstring>
#include <new>

#include "api/build_info.hpp"
#include "api/guard.hpp"
#include "core/args.hpp"
#include "core/config.hpp"
#include "core/layer.hpp"
#include "cuda/device.hpp"
#include "moeblaze/moeblaze.h"
#if MOEBLAZE_WITH_EP
#include "engines/ep/ep_engine.hpp"
#endif

using namespace moeblaze;

namespace moeblaze {
inline namespace v0 {
namespace api {
const char* last_error();
void set_log_callback(moeblaze_log_fn fn, void* user_data, int32_t min_level);
}  // namespace api
}  // namespace v0
}  // namespace moeblaze

struct moeblaze_config_s {
  ConfigValues values;
};
struct moeblaze_handle_s {
  explicit moeblaze_handle_s(const ConfigValues& v) : layer(v) {}
  explicit moeblaze_handle_s(Layer&& l) : layer(std::move(l)) {}
  Layer layer;
};

// The core mirrors the public enums and structs by value and layout; keep them in lockstep.
static_assert(sizeof(moeblaze_tensor_t) == 48, "moeblaze_tensor_t must match DLTensor (48 bytes)");
static_assert(sizeof(moeblaze_arg_t) == 56, "moeblaze_arg_t layout is frozen");
static_assert(sizeof(RawTensor) == sizeof(moeblaze_tensor_t) && sizeof(RawArg) == sizeof(moeblaze_arg_t), "layout");
static_assert(offsetof(RawTensor, ndim) == offsetof(moeblaze_tensor_t, ndim), "layout");
static_assert(offsetof(RawTensor, code) == offsetof(moeblaze_tensor_t, dtype), "layout");
static_assert(offsetof(RawTensor, shape) == offsetof(moeblaze_tensor_t, shape), "layout");
static_assert(offsetof(RawTensor, strides) == offsetof(moeblaze_tensor_t, strides), "layout");
static_assert(offsetof(RawTensor, byte_offset) == offsetof(moeblaze_tensor_t, byte_offset), "layout");
static_assert(offsetof(RawArg, tensor) == offsetof(moeblaze_arg_t, tensor), "layout");
static_assert(sizeof(moeblaze_status_t) == 4 && sizeof(moeblaze_attr_t) == 4 && sizeof(moeblaze_arg_kind_t) == 4,
              "enums are pinned to 32 bits");
static_assert(MOEBLAZE_ATTR_COUNT == kAttrCount, "attribute table and header disagree");
static_assert(static_cast<int>(Status::kInternalError) == MOEBLAZE_STATUS_INTERNAL_ERROR, "status values");
static_assert(static_cast<int>(Status::kInsufficientWorkspace) == MOEBLAZE_STATUS_INSUFFICIENT_WORKSPACE, "status values");
static_assert(static_cast<int>(Attr::kNumThreads) == MOEBLAZE_ATTR_NUM_THREADS, "attribute values");
static_assert(static_cast<int>(Attr::kWindowTokens) == MOEBLAZE_ATTR_WINDOW_TOKENS, "attribute values");
static_assert(static_cast<int>(Attr::kEpMaxRecvTokens) == MOEBLAZE_ATTR_EP_MAX_RECV_TOKENS, "attribute values");
static_assert(static_cast<int>(Attr::kEpTransport) == MOEBLAZE_ATTR_EP_TRANSPORT, "attribute values");
static_assert(static_cast<int>(Attr::kEpCommSms) == MOEBLAZE_ATTR_EP_COMM_SMS, "attribute values");
static_assert(static_cast<int>(Attr::kEpSize) == MOEBLAZE_ATTR_EP_SIZE, "attribute values");
static_assert(static_cast<int>(Attr::kEpRank) == MOEBLAZE_ATTR_EP_RANK, "attribute values");
static_assert(static_cast<int>(Attr::kNumExpertGroups) == MOEBLAZE_ATTR_NUM_EXPERT_GROUPS, "attribute values");
static_assert(static_cast<int>(Attr::kTopkGroups) == MOEBLAZE_ATTR_TOPK_GROUPS, "attribute values");
static_assert(static_cast<int>(Attr::kRouteScale) == MOEBLAZE_ATTR_ROUTE_SCALE, "attribute values");
static_assert(static_cast<int>(Attr::kAuxLossForm) == MOEBLAZE_ATTR_AUX_LOSS_FORM, "attribute values");
static_assert(static_cast<int>(Attr::kWindowBytes) == MOEBLAZE_ATTR_WINDOW_BYTES, "attribute values");
static_assert(static_cast<int>(Attr::kSavePolicy) == MOEBLAZE_ATTR_SAVE_POLICY, "attribute values");
static_assert(static_cast<int>(ArgKind::kGradTopkWeights) == MOEBLAZE_ARG_GRAD_TOPK_WEIGHTS, "argument kinds");
static_assert(static_cast<int>(ArgKind::kZLoss) == MOEBLAZE_ARG_Z_LOSS, "argument kinds");
static_assert(static_cast<int>(ArgKind::kStatus) == MOEBLAZE_ARG_STATUS, "argument kinds");
static_assert(static_cast<int>(ArgKind::kExpertBias) == MOEBLAZE_ARG_EXPERT_BIAS, "argument kinds");
static_assert(static_cast<int>(ArgKind::kSequenceLengths) == MOEBLAZE_ARG_SEQUENCE_LENGTHS, "argument kinds");
static_assert(static_cast<int>(ArgKind::kTokenMask) == MOEBLAZE_ARG_TOKEN_MASK, "argument kinds");
static_assert(static_cast<int>(Pass::kRoute) == MOEBLAZE_PASS_ROUTE, "passes");
static_assert(static_cast<int>(Pass::kBackwardLastUse) == MOEBLAZE_PASS_BACKWARD_LAST_USE, "passes");
static_assert(static_cast<int>(Activation::kGeglu) == MOEBLAZE_ACTIVATION_GEGLU, "activations");
static_assert(static_cast<int>(SavePolicy::kSaveAll) == MOEBLAZE_SAVE_ALL, "save policies");
static_assert(static_cast<int>(EngineKind::kCudaFused) == MOEBLAZE_ENGINE_CUDA_FUSED, "engines");
static_assert(kArgFlagAccumulate == MOEBLAZE_ARG_FLAG_ACCUMULATE, "flags");

namespace {

template <class T>
void require(const T* p, const char* name) {
  if (!p) fail(Status::kInvalidArgument, "%s is NULL", name);
}
DType to_dtype(moeblaze_dtype_t t) { return dtype_from_dlpack(t.code, t.bits, t.lanes); }
moeblaze_dtype_t from_dtype(DType t) {
  moeblaze_dtype_t r;
  dtype_to_dlpack(t, &r.code, &r.bits);
  r.lanes = 1;
  return r;
}
const RawArg* raw(const moeblaze_arg_t* a) { return reinterpret_cast<const RawArg*>(a); }

// A C caller may pass any 32-bit value for an enum parameter (e.g. -1, or a value from a newer
// header). In C++ an out-of-range value must not be read as the enum type, so parameters are
// read through their bytes and handled as int32_t from then on.
template <class Enum>
int32_t raw_enum(const Enum& e) {
  static_assert(sizeof(Enum) == sizeof(int32_t), "public enums are 32-bit");
  int32_t v;
  std::memcpy(&v, &e, sizeof v);
  return v;
}

}  // namespace

extern "C" {

/* ---- version ---- */
MOEBLAZE_API uint32_t moeblaze_get_version(void) { return MOEBLAZE_VERSION; }
MOEBLAZE_API const char* moeblaze_get_version_string(void) { return MOEBLAZE_VERSION_STRING; }
MOEBLAZE_API uint32_t moeblaze_get_abi_version(void) { return MOEBLAZE_ABI_VERSION; }
MOEBLAZE_API const char* moeblaze_get_build_info(void) { return MOEBLAZE_BUILD_INFO; }

/* ---- errors ---- */
MOEBLAZE_API const char* moeblaze_status_name(moeblaze_status_t status) {
  switch (raw_enum(status)) {
    case MOEBLAZE_STATUS_SUCCESS: return "MOEBLAZE_STATUS_SUCCESS";
    case MOEBLAZE_STATUS_INVALID_ARGUMENT: return "MOEBLAZE_STATUS_INVALID_ARGUMENT";
    case MOEBLAZE_STATUS_NOT_SUPPORTED: return "MOEBLAZE_STATUS_NOT_SUPPORTED";
    case MOEBLAZE_STATUS_INSUFFICIENT_WORKSPACE: return "MOEBLAZE_STATUS_INSUFFICIENT_WORKSPACE";
    case MOEBLAZE_STATUS_OUT_OF_HOST_MEMORY: return "MOEBLAZE_STATUS_OUT_OF_HOST_MEMORY";
    case MOEBLAZE_STATUS_OUT_OF_DEVICE_MEMORY: return "MOEBLAZE_STATUS_OUT_OF_DEVICE_MEMORY";
    case MOEBLAZE_STATUS_CUDA_ERROR: return "MOEBLAZE_STATUS_CUDA_ERROR";
    case MOEBLAZE_STATUS_CUBLAS_ERROR: return "MOEBLAZE_STATUS_CUBLAS_ERROR";
    case MOEBLAZE_STATUS_ARCH_MISMATCH: return "MOEBLAZE_STATUS_ARCH_MISMATCH";
    case MOEBLAZE_STATUS_VERSION_MISMATCH: return "MOEBLAZE_STATUS_VERSION_MISMATCH";
    case MOEBLAZE_STATUS_UNKNOWN_ATTRIBUTE: return "MOEBLAZE_STATUS_UNKNOWN_ATTRIBUTE";
    case MOEBLAZE_STATUS_ATTRIBUTE_TYPE_MISMATCH: return "MOEBLAZE_STATUS_ATTRIBUTE_TYPE_MISMATCH";
    case MOEBLAZE_STATUS_INTERNAL_ERROR: return "MOEBLAZE_STATUS_INTERNAL_ERROR";
    default: return "MOEBLAZE_STATUS_UNKNOWN";
  }
}

MOEBLAZE_API const char* moeblaze_status_string(moeblaze_status_t status) {
  switch (raw_enum(status)) {
    case MOEBLAZE_STATUS_SUCCESS: return "The call succeeded.";
    case MOEBLAZE_STATUS_INVALID_ARGUMENT: return "An argument is NULL, malformed or out of range.";
    case MOEBLAZE_STATUS_NOT_SUPPORTED: return "The request is valid but not implemented by this build or engine.";
    case MOEBLAZE_STATUS_INSUFFICIENT_WORKSPACE: return "The workspace or saved buffer is smaller than required.";
    case MOEBLAZE_STATUS_OUT_OF_HOST_MEMORY: return "A host memory allocation failed.";
    case MOEBLAZE_STATUS_OUT_OF_DEVICE_MEMORY: return "A device memory allocation failed.";
    case MOEBLAZE_STATUS_CUDA_ERROR: return "The CUDA runtime reported an error.";
    case MOEBLAZE_STATUS_CUBLAS_ERROR: return "cuBLASLt reported an error.";
    case MOEBLAZE_STATUS_ARCH_MISMATCH: return "The device does not exist or has no kernels in this build.";
    case MOEBLAZE_STATUS_VERSION_MISMATCH: return "A struct size or version is not understood by this library.";
    case MOEBLAZE_STATUS_UNKNOWN_ATTRIBUTE: return "The attribute is not known to this library.";
    case MOEBLAZE_STATUS_ATTRIBUTE_TYPE_MISMATCH: return "The attribute has a different value type.";
    case MOEBLAZE_STATUS_INTERNAL_ERROR: return "An internal error occurred (a bug; please report it).";
    default: return "Unknown status value.";
  }
}

MOEBLAZE_API const char* moeblaze_get_last_error_message(void) { return api::last_error(); }

MOEBLAZE_API moeblaze_status_t moeblaze_set_log_callback(moeblaze_log_fn fn, void* user_data, int32_t min_level) {
  return api::guard(__func__, [&] {
    if (min_level < 0 || min_level > MOEBLAZE_LOG_DEBUG)
      fail(Status::kInvalidArgument, "min_level = %d is outside [0, 4]", min_level);
    api::set_log_callback(fn, user_data, min_level);
  });
}

/* ---- config ---- */
MOEBLAZE_API moeblaze_status_t moeblaze_config_create(moeblaze_config_t* out) {
  return api::guard(__func__, [&] {
    require(out, "out");
    *out = new moeblaze_config_s();
  });
}

// The destroy calls cannot fail and leave the last error message alone: a finalizer that
// destroys an object must not wipe the message of the call that failed just before it.
MOEBLAZE_API moeblaze_status_t moeblaze_config_destroy(moeblaze_config_t cfg) {
  delete cfg;
  return MOEBLAZE_STATUS_SUCCESS;
}

MOEBLAZE_API moeblaze_status_t moeblaze_config_set_i64(moeblaze_config_t cfg, moeblaze_attr_t attr, int64_t v) {
  return api::guard(__func__, [&] {
    require(cfg, "cfg");
    cfg->values.set_i64(raw_enum(attr), v);
  });
}

MOEBLAZE_API moeblaze_status_t moeblaze_config_set_f64(moeblaze_config_t cfg, moeblaze_attr_t attr, double v) {
  return api::guard(__func__, [&] {
    require(cfg, "cfg");
    cfg->values.set_f64(raw_enum(attr), v);
  });
}

MOEBLAZE_API moeblaze_status_t moeblaze_config_set_dtype(moeblaze_config_t cfg, moeblaze_attr_t attr,
                                                         moeblaze_dtype_t v) {
  return api::guard(__func__, [&] {
    require(cfg, "cfg");
    cfg->values.set_dtype(raw_enum(attr), to_dtype(v));
  });
}

MOEBLAZE_API moeblaze_status_t moeblaze_config_get_i64(moeblaze_config_t cfg, moeblaze_attr_t attr, int64_t* out) {
  return api::guard(__func__, [&] {
    require(cfg, "cfg");
    require(out, "out");
    *out = cfg->values.get_i64(raw_enum(attr));
  });
}

MOEBLAZE_API moeblaze_status_t moeblaze_config_get_f64(moeblaze_config_t cfg, moeblaze_attr_t attr, double* out) {
  return api::guard(__func__, [&] {
    require(cfg, "cfg");
    require(out, "out");
    *out = cfg->values.get_f64(raw_enum(attr));
  });
}

MOEBLAZE_API moeblaze_status_t moeblaze_config_get_dtype(moeblaze_config_t cfg, moeblaze_attr_t attr,
                                                         moeblaze_dtype_t* out) {
  return api::guard(__func__, [&] {
    require(cfg, "cfg");
    require(out, "out");
    *out = from_dtype(cfg->values.get_dtype(raw_enum(attr)));
  });
}

MOEBLAZE_API moeblaze_status_t moeblaze_attr_query(moeblaze_attr_t attr, moeblaze_attr_info_t* info) {
  return api::guard(__func__, [&] {
    require(info, "info");
    const size_t prefix = offsetof(moeblaze_attr_info_t, value_type);
    if (info->struct_size < prefix)
      fail(Status::kVersionMismatch, "info->struct_size = %zu is smaller than the first two fields (%zu bytes)",
           info->struct_size, prefix);
    const AttrInfo* a = attr_info(raw_enum(attr));
    if (!a) fail(Status::kUnknownAttribute, "unknown attribute %d", raw_enum(attr));
    moeblaze_attr_info_t full;
    std::memset(&full, 0, sizeof full);
    full.struct_size = sizeof full;
    full.name = a->name;
    full.value_type = static_cast<int32_t>(a->type);
    full.required = a->required ? 1 : 0;
    full.min_i64 = a->min_i64;
    full.max_i64 = a->max_i64;
    full.default_i64 = a->default_i64;
    full.default_f64 = a->default_f64;
    full.since_version = MOEBLAZE_VERSION_ENCODE(0, a->since_minor, 0);
    const size_t caller = info->struct_size;
    std::memcpy(info, &full, caller < sizeof full ? caller : sizeof full);
    info->struct_size = caller;
  });
}

/* ---- handles ---- */
MOEBLAZE_API moeblaze_status_t moeblaze_get_device_count(int32_t device_type, int32_t* count) {
  return api::guard(__func__, [&] {
    require(count, "count");
    if (device_type == MOEBLAZE_DEVICE_CPU) *count = 1;
    else if (device_type == MOEBLAZE_DEVICE_CUDA) *count = cuda::device_count();
    else fail(Status::kInvalidArgument, "unknown device type %d (CPU = 1, CUDA = 2)", device_type);
  });
}

MOEBLAZE_API moeblaze_status_t moeblaze_create(moeblaze_handle_t* out, moeblaze_config_t cfg) {
  return api::guard(__func__, [&] {
    require(out, "out");
    require(cfg, "cfg");
    *out = nullptr;
    moeblaze_handle_s* h = new moeblaze_handle_s(cfg->values);
    *out = h;
    api::log_message(MOEBLAZE_LOG_INFO, "moeblaze_create", h->layer.decision().c_str());
  });
}

MOEBLAZE_API moeblaze_status_t moeblaze_create_ep(moeblaze_handle_t* out, moeblaze_config_t cfg, void* nccl_comm,
                                                  void* stream) {
  return api::guard(__func__, [&] {
    require(out, "out");
    *out = nullptr;
    require(cfg, "cfg");
    require(nccl_comm, "nccl_comm");
#if MOEBLAZE_WITH_EP
    LayerConfig c = LayerConfig::from_values(cfg->values);
    EpOptions opt;
    opt.nccl_comm = nccl_comm;
    opt.stream = stream;
    std::string decision;
    std::unique_ptr<Engine> engine = make_ep_engine(c, opt, &decision);
    moeblaze_handle_s* h = new moeblaze_handle_s(Layer(c, std::move(engine), decision));
    *out = h;
    api::log_message(MOEBLAZE_LOG_INFO, "moeblaze_create_ep", h->layer.decision().c_str());
#else
    (void)stream;
    fail(Status::kNotSupported, "this build of libmoeblaze has no expert parallelism (CMake option MOEBLAZE_ENABLE_EP, "
                                "which needs CUDA and NCCL's headers)");
#endif
  });
}

MOEBLAZE_API moeblaze_status_t moeblaze_create_ep_from_unique_id(moeblaze_handle_t* out, moeblaze_config_t cfg,
                                                                 const void* unique_id, size_t unique_id_bytes,
                                                                 int32_t nranks, int32_t rank, void* stream) {
  return api::guard(__func__, [&] {
    require(out, "out");
    *out = nullptr;
    require(cfg, "cfg");
    require(unique_id, "unique_id");
    if (nranks < 1) fail(Status::kInvalidArgument, "nranks = %d must be >= 1", nranks);
    if (rank < 0 || rank >= nranks) fail(Status::kInvalidArgument, "rank = %d is outside [0, nranks = %d)", rank, nranks);
#if MOEBLAZE_WITH_EP
    LayerConfig c = LayerConfig::from_values(cfg->values);
    EpOptions opt;
    opt.unique_id = unique_id;
    opt.unique_id_bytes = unique_id_bytes;
    opt.ranks = nranks;
    opt.rank = rank;
    opt.stream = stream;
    std::string decision;
    std::unique_ptr<Engine> engine = make_ep_engine(c, opt, &decision);
    moeblaze_handle_s* h = new moeblaze_handle_s(Layer(c, std::move(engine), decision));
    *out = h;
    api::log_message(MOEBLAZE_LOG_INFO, "moeblaze_create_ep_from_unique_id", h->layer.decision().c_str());
#else
    (void)unique_id_bytes;
    (void)stream;
    fail(Status::kNotSupported, "this build of libmoeblaze has no expert parallelism (CMake option MOEBLAZE_ENABLE_EP, "
                                "which needs CUDA and NCCL's headers)");
#endif
  });
}

MOEBLAZE_API moeblaze_status_t moeblaze_get_symmetric_size(moeblaze_config_t cfg, int32_t ep_size, size_t* bytes) {
  return api::guard(__func__, [&] {
    require(cfg, "cfg");
    require(bytes, "bytes");
    if (ep_size < 1) fail(Status::kInvalidArgument, "ep_size = %d must be >= 1", ep_size);
#if MOEBLAZE_WITH_EP
    *bytes = ep_symmetric_bytes(LayerConfig::from_values(cfg->values), ep_size);
#else
    fail(Status::kNotSupported, "this build of libmoeblaze has no expert parallelism (CMake option MOEBLAZE_ENABLE_EP)");
#endif
  });
}

MOEBLAZE_API moeblaze_status_t moeblaze_destroy(moeblaze_handle_t h) {
  delete h;  // the engines' destructors do not throw
  return MOEBLAZE_STATUS_SUCCESS;
}

MOEBLAZE_API moeblaze_status_t moeblaze_handle_get_i64(moeblaze_handle_t h, moeblaze_attr_t attr, int64_t* out) {
  return api::guard(__func__, [&] {
    require(h, "handle");
    require(out, "out");
    *out = h->layer.config().to_values().get_i64(raw_enum(attr));
  });
}

MOEBLAZE_API moeblaze_status_t moeblaze_handle_get_f64(moeblaze_handle_t h, moeblaze_attr_t attr, double* out) {
  return api::guard(__func__, [&] {
    require(h, "handle");
    require(out, "out");
    *out = h->layer.config().to_values().get_f64(raw_enum(attr));
  });
}

MOEBLAZE_API moeblaze_status_t moeblaze_handle_get_dtype(moeblaze_handle_t h, moeblaze_attr_t attr,
                                                         moeblaze_dtype_t* out) {
  return api::guard(__func__, [&] {
    require(h, "handle");
    require(out, "out");
    *out = from_dtype(h->layer.config().to_values().get_dtype(raw_enum(attr)));
  });
}

/* ---- sizes ---- */
MOEBLAZE_API moeblaze_status_t moeblaze_get_workspace_size(moeblaze_handle_t h, moeblaze_pass_t pass,
                                                           int64_t num_tokens, size_t* bytes) {
  return api::guard(__func__, [&] {
    require(h, "handle");
    require(bytes, "bytes");
    *bytes = h->layer.workspace_size(static_cast<Pass>(raw_enum(pass)), num_tokens);
  });
}

MOEBLAZE_API moeblaze_status_t moeblaze_get_saved_size(moeblaze_handle_t h, int64_t num_tokens, size_t* bytes) {
  return api::guard(__func__, [&] {
    require(h, "handle");
    require(bytes, "bytes");
    *bytes = h->layer.saved_size(num_tokens);
  });
}

/* ---- execution ---- */
MOEBLAZE_API moeblaze_status_t moeblaze_check_args(moeblaze_handle_t h, moeblaze_pass_t pass,
                                                   const moeblaze_arg_t* args, size_t num_args) {
  return api::guard(__func__, [&] {
    require(h, "handle");
    h->layer.check(static_cast<Pass>(raw_enum(pass)), raw(args), num_args);
  });
}

MOEBLAZE_API moeblaze_status_t moeblaze_forward(moeblaze_handle_t h, moeblaze_pass_t pass, const moeblaze_arg_t* args,
                                                size_t num_args, void* workspace, size_t workspace_bytes, void* saved,
                                                size_t saved_bytes, moeblaze_stream_t stream) {
  return api::guard(__func__, [&] {
    require(h, "handle");
    h->layer.forward(static_cast<Pass>(raw_enum(pass)), raw(args), num_args, workspace, workspace_bytes, saved, saved_bytes,
                     stream);
  });
}

MOEBLAZE_API moeblaze_status_t moeblaze_backward(moeblaze_handle_t h, const moeblaze_arg_t* args, size_t num_args,
                                                 const void* saved, size_t saved_bytes, void* workspace,
                                                 size_t workspace_bytes, moeblaze_stream_t stream) {
  return api::guard(__func__, [&] {
    require(h, "handle");
    // Read only: the engines write to saved only on its last use (moeblaze_backward_last_use).
    h->layer.backward(raw(args), num_args, const_cast<void*>(saved), saved_bytes, workspace, workspace_bytes, stream,
                      false);
  });
}

MOEBLAZE_API moeblaze_status_t moeblaze_backward_last_use(moeblaze_handle_t h, const moeblaze_arg_t* args,
                                                          size_t num_args, void* saved, size_t saved_bytes,
                                                          void* workspace, size_t workspace_bytes,
                                                          moeblaze_stream_t stream) {
  return api::guard(__func__, [&] {
    require(h, "handle");
    h->layer.backward(raw(args), num_args, saved, saved_bytes, workspace, workspace_bytes, stream, true);
  });
}

MOEBLAZE_API moeblaze_status_t moeblaze_route(moeblaze_handle_t h, const moeblaze_arg_t* args, size_t num_args,
                                              void* workspace, size_t workspace_bytes, moeblaze_stream_t stream) {
  return api::guard(__func__, [&] {
    require(h, "handle");
    h->layer.route(raw(args), num_args, workspace, workspace_bytes, stream);
  });
}

MOEBLAZE_API moeblaze_status_t moeblaze_assert_status(moeblaze_handle_t h, moeblaze_pass_t pass,
                                                      const moeblaze_tensor_t* status, moeblaze_stream_t stream) {
  return api::guard(__func__, [&] {
    require(h, "handle");
    require(status, "status");
    h->layer.assert_status(static_cast<Pass>(raw_enum(pass)), reinterpret_cast<const RawTensor*>(status), stream);
  });
}

}  // extern "C"
