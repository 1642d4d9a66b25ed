# LibMoEBlaze: the low-level, 1:1 layer over include/moeblaze/moeblaze.h.
#
# UNTESTED: Julia is not installed on the MoEBlaze development machines. See ../../README.md.
#
# * Enums are plain Int32 constants (no @enum): an unknown value from a newer library must not
#   throw.
# * Structs are isbits mirrors with the C layout (Julia lays isbits structs out like C).
# * Every status-returning function is wrapped in @check, which throws MoEBlazeError with the
#   status name and the thread-local message, copied before anything else can run a
#   moeblaze_* call on this thread (finalizers are disabled during the copy).
module LibMoEBlaze

export MoEBlazeError

"""Path or soname of the library; override with the MOEBLAZE_LIBRARY environment variable
(read when the package is precompiled)."""
const libmoeblaze = get(ENV, "MOEBLAZE_LIBRARY", "libmoeblaze.so.0")

# ---- version ------------------------------------------------------------------------------
const MOEBLAZE_VERSION_MAJOR = 0
const MOEBLAZE_VERSION_MINOR = 2
const MOEBLAZE_VERSION_PATCH = 0
moeblaze_version_encode(major, minor, patch) = UInt32(major * 1_000_000 + minor * 1_000 + patch)
const MOEBLAZE_VERSION = moeblaze_version_encode(0, 2, 0)
const MOEBLAZE_ABI_VERSION = UInt32(0)

# ---- status ------------------------------------------------------------------------------
const moeblaze_status_t = Int32
const MOEBLAZE_STATUS_SUCCESS = Int32(0)
const MOEBLAZE_STATUS_INVALID_ARGUMENT = Int32(1)
const MOEBLAZE_STATUS_NOT_SUPPORTED = Int32(2)
const MOEBLAZE_STATUS_INSUFFICIENT_WORKSPACE = Int32(3)
const MOEBLAZE_STATUS_OUT_OF_HOST_MEMORY = Int32(4)
const MOEBLAZE_STATUS_OUT_OF_DEVICE_MEMORY = Int32(5)
const MOEBLAZE_STATUS_CUDA_ERROR = Int32(6)
const MOEBLAZE_STATUS_CUBLAS_ERROR = Int32(7)
const MOEBLAZE_STATUS_ARCH_MISMATCH = Int32(8)
const MOEBLAZE_STATUS_VERSION_MISMATCH = Int32(9)
const MOEBLAZE_STATUS_UNKNOWN_ATTRIBUTE = Int32(10)
const MOEBLAZE_STATUS_ATTRIBUTE_TYPE_MISMATCH = Int32(11)
const MOEBLAZE_STATUS_INTERNAL_ERROR = Int32(12)

const MOEBLAZE_LOG_ERROR = Int32(1)
const MOEBLAZE_LOG_WARN = Int32(2)
const MOEBLAZE_LOG_INFO = Int32(3)
const MOEBLAZE_LOG_DEBUG = Int32(4)

# ---- devices, dtypes, tensors --------------------------------------------------------------
const MOEBLAZE_DEVICE_CPU = Int32(1)
const MOEBLAZE_DEVICE_CUDA = Int32(2)

const MOEBLAZE_DTYPE_CODE_INT = UInt8(0)
const MOEBLAZE_DTYPE_CODE_UINT = UInt8(1)
const MOEBLAZE_DTYPE_CODE_FLOAT = UInt8(2)
const MOEBLAZE_DTYPE_CODE_BFLOAT = UInt8(4)

"""`moeblaze_device_t` == DLPack `DLDevice` (8 bytes)."""
struct moeblaze_device_t
    device_type::Int32
    device_id::Int32
end

"""`moeblaze_dtype_t` == DLPack `DLDataType` (4 bytes)."""
struct moeblaze_dtype_t
    code::UInt8
    bits::UInt8
    lanes::UInt16
end

const MOEBLAZE_DTYPE_F32 = moeblaze_dtype_t(2, 32, 1)
const MOEBLAZE_DTYPE_F16 = moeblaze_dtype_t(2, 16, 1)
const MOEBLAZE_DTYPE_BF16 = moeblaze_dtype_t(4, 16, 1)
const MOEBLAZE_DTYPE_I32 = moeblaze_dtype_t(0, 32, 1)
const MOEBLAZE_DTYPE_I64 = moeblaze_dtype_t(0, 64, 1)

"""`moeblaze_tensor_t` == DLPack `DLTensor` (48 bytes). Row-major: `shape` lists the slowest
dimension first, so a Julia column-major `Matrix` of size (d, L) is the tensor [L, d]."""
struct moeblaze_tensor_t
    data::Ptr{Cvoid}
    device::moeblaze_device_t
    ndim::Int32
    dtype::moeblaze_dtype_t
    shape::Ptr{Int64}
    strides::Ptr{Int64}
    byte_offset::UInt64
end

# A CUDA stream (cudaStream_t); C_NULL is the legacy default stream.
const moeblaze_stream_t = Ptr{Cvoid}

# ---- config ------------------------------------------------------------------------------
mutable struct moeblaze_config_s end
const moeblaze_config_t = Ptr{moeblaze_config_s}

const MOEBLAZE_ACTIVATION_RELU = Int64(0)
const MOEBLAZE_ACTIVATION_GELU = Int64(1)
const MOEBLAZE_ACTIVATION_SILU = Int64(2)
const MOEBLAZE_ACTIVATION_SWIGLU = Int64(3)
const MOEBLAZE_ACTIVATION_GEGLU = Int64(4)

const MOEBLAZE_SCORE_SOFTMAX = Int64(0)
const MOEBLAZE_SCORE_SIGMOID = Int64(1)

const MOEBLAZE_AUX_LOSS_SWITCH = Int64(0)
const MOEBLAZE_AUX_LOSS_HUGGING_FACE = Int64(1)

const MOEBLAZE_SAVE_PREACT = Int64(0)
const MOEBLAZE_SAVE_RECOMPUTE_UP = Int64(1)
const MOEBLAZE_SAVE_ALL = Int64(2)

const MOEBLAZE_ENGINE_AUTO = Int64(0)
const MOEBLAZE_ENGINE_CPU = Int64(1)
const MOEBLAZE_ENGINE_CUDA_CUBLASLT = Int64(2)
const MOEBLAZE_ENGINE_CUDA_FUSED = Int64(3)

const MOEBLAZE_VALUE_I64 = Int32(0)
const MOEBLAZE_VALUE_F64 = Int32(1)
const MOEBLAZE_VALUE_DTYPE = Int32(2)

const moeblaze_attr_t = Int32
const MOEBLAZE_ATTR_NUM_EXPERTS = Int32(0)
const MOEBLAZE_ATTR_TOP_K = Int32(1)
const MOEBLAZE_ATTR_HIDDEN_SIZE = Int32(2)
const MOEBLAZE_ATTR_FFN_HIDDEN_SIZE = Int32(3)
const MOEBLAZE_ATTR_MAX_TOKENS = Int32(4)
const MOEBLAZE_ATTR_ACTIVATION = Int32(5)
const MOEBLAZE_ATTR_SCORE_FUNCTION = Int32(6)
const MOEBLAZE_ATTR_NORMALIZE_TOPK = Int32(7)
const MOEBLAZE_ATTR_AUX_LOSS_COEFF = Int32(8)
const MOEBLAZE_ATTR_Z_LOSS_COEFF = Int32(9)
const MOEBLAZE_ATTR_ACTIVATION_DTYPE = Int32(10)
const MOEBLAZE_ATTR_WEIGHT_DTYPE = Int32(11)
const MOEBLAZE_ATTR_ACCUM_DTYPE = Int32(12)
const MOEBLAZE_ATTR_SAVE_POLICY = Int32(13)
const MOEBLAZE_ATTR_DETERMINISTIC = Int32(14)
const MOEBLAZE_ATTR_DEVICE_TYPE = Int32(15)
const MOEBLAZE_ATTR_DEVICE_ID = Int32(16)
const MOEBLAZE_ATTR_ENGINE = Int32(17)
const MOEBLAZE_ATTR_NUM_THREADS = Int32(18)
const MOEBLAZE_ATTR_WINDOW_TOKENS = Int32(19)
const MOEBLAZE_ATTR_EP_MAX_RECV_TOKENS = Int32(20)
const MOEBLAZE_ATTR_EP_TRANSPORT = Int32(21)
const MOEBLAZE_ATTR_EP_COMM_SMS = Int32(22)
const MOEBLAZE_ATTR_EP_SIZE = Int32(23)
const MOEBLAZE_ATTR_EP_RANK = Int32(24)
const MOEBLAZE_ATTR_NUM_EXPERT_GROUPS = Int32(25)
const MOEBLAZE_ATTR_TOPK_GROUPS = Int32(26)
const MOEBLAZE_ATTR_ROUTE_SCALE = Int32(27)
const MOEBLAZE_ATTR_AUX_LOSS_FORM = Int32(28)
const MOEBLAZE_ATTR_COUNT = Int32(29)

"""`moeblaze_attr_info_t` (64 bytes). Set `struct_size` before `moeblaze_attr_query`."""
mutable struct moeblaze_attr_info_t
    struct_size::Csize_t
    name::Cstring
    value_type::Int32
    required::Int32
    min_i64::Int64
    max_i64::Int64
    default_i64::Int64
    default_f64::Float64
    since_version::UInt32
end
moeblaze_attr_info_t() =
    moeblaze_attr_info_t(Csize_t(64), Cstring(C_NULL), 0, 0, 0, 0, 0, 0.0, UInt32(0))

# ---- handles and execution ---------------------------------------------------------------
mutable struct moeblaze_handle_s end
const moeblaze_handle_t = Ptr{moeblaze_handle_s}

const MOEBLAZE_BUFFER_ALIGNMENT = 256

const moeblaze_pass_t = Int32
const MOEBLAZE_PASS_FORWARD_TRAINING = Int32(0)
const MOEBLAZE_PASS_FORWARD_INFERENCE = Int32(1)
const MOEBLAZE_PASS_BACKWARD = Int32(2)
const MOEBLAZE_PASS_ROUTE = Int32(3)
const MOEBLAZE_PASS_BACKWARD_LAST_USE = Int32(4)

const MOEBLAZE_ARG_INPUT = Int32(1)
const MOEBLAZE_ARG_ROUTER_WEIGHT = Int32(2)
const MOEBLAZE_ARG_ROUTER_LOGITS = Int32(3)
const MOEBLAZE_ARG_EXPERT_BIAS = Int32(4)
const MOEBLAZE_ARG_W_GATE_UP = Int32(5)
const MOEBLAZE_ARG_W_DOWN = Int32(6)
const MOEBLAZE_ARG_TOPK_INDICES = Int32(7)
const MOEBLAZE_ARG_TOPK_WEIGHTS = Int32(8)
const MOEBLAZE_ARG_SEQUENCE_LENGTHS = Int32(9)
const MOEBLAZE_ARG_TOKEN_MASK = Int32(10)
const MOEBLAZE_ARG_OUTPUT = Int32(32)
const MOEBLAZE_ARG_AUX_LOSS = Int32(33)
const MOEBLAZE_ARG_TOKENS_PER_EXPERT = Int32(34)
const MOEBLAZE_ARG_Z_LOSS = Int32(35)
const MOEBLAZE_ARG_STATUS = Int32(36)
const MOEBLAZE_ARG_GRAD_OUTPUT = Int32(64)
const MOEBLAZE_ARG_GRAD_AUX_LOSS = Int32(65)
const MOEBLAZE_ARG_GRAD_Z_LOSS = Int32(66)
const MOEBLAZE_ARG_GRAD_INPUT = Int32(96)
const MOEBLAZE_ARG_GRAD_ROUTER_WEIGHT = Int32(97)
const MOEBLAZE_ARG_GRAD_ROUTER_LOGITS = Int32(98)
const MOEBLAZE_ARG_GRAD_W_GATE_UP = Int32(100)
const MOEBLAZE_ARG_GRAD_W_DOWN = Int32(101)
const MOEBLAZE_ARG_GRAD_TOPK_WEIGHTS = Int32(102)

const MOEBLAZE_ARG_FLAG_ACCUMULATE = UInt32(0x1)

"""`moeblaze_arg_t` (56 bytes)."""
struct moeblaze_arg_t
    kind::Int32
    flags::UInt32
    tensor::moeblaze_tensor_t
end

# ---- errors ------------------------------------------------------------------------------
"""A libmoeblaze call failed. `name` is `moeblaze_status_name(status)`; `message` is the
thread-local detail, copied immediately after the failing call."""
struct MoEBlazeError <: Exception
    status::Int32
    name::String
    message::String
end

function MoEBlazeError(status::Integer)
    # No finalizer (which could call moeblaze_destroy and clear the message) may run between
    # the failing call and this copy.
    GC.enable_finalizers(false)
    try
        msg = unsafe_string(@ccall libmoeblaze.moeblaze_get_last_error_message()::Cstring)
        name = unsafe_string(@ccall libmoeblaze.moeblaze_status_name(Int32(status)::Int32)::Cstring)
        return MoEBlazeError(Int32(status), name, msg)
    finally
        GC.enable_finalizers(true)
    end
end

Base.showerror(io::IO, e::MoEBlazeError) =
    print(io, "MoEBlazeError: ", e.name, " (", e.status, "): ", e.message)

"""`@check @ccall ...`: throws MoEBlazeError unless the call returns MOEBLAZE_STATUS_SUCCESS
(NCCL.jl's `@check` pattern)."""
macro check(ex)
    quote
        local status = $(esc(ex))
        if status != MOEBLAZE_STATUS_SUCCESS
            throw(MoEBlazeError(status))
        end
        nothing
    end
end

# ---- functions (1:1 with the header) -----------------------------------------------------
moeblaze_get_version() = @ccall libmoeblaze.moeblaze_get_version()::UInt32
moeblaze_get_version_string() = @ccall libmoeblaze.moeblaze_get_version_string()::Cstring
moeblaze_get_abi_version() = @ccall libmoeblaze.moeblaze_get_abi_version()::UInt32
moeblaze_get_build_info() = @ccall libmoeblaze.moeblaze_get_build_info()::Cstring
moeblaze_status_name(status) = @ccall libmoeblaze.moeblaze_status_name(status::Int32)::Cstring
moeblaze_status_string(status) = @ccall libmoeblaze.moeblaze_status_string(status::Int32)::Cstring
moeblaze_get_last_error_message() =
    @ccall libmoeblaze.moeblaze_get_last_error_message()::Cstring

function moeblaze_set_log_callback(fn, user_data, min_level)
    @check @ccall libmoeblaze.moeblaze_set_log_callback(fn::Ptr{Cvoid}, user_data::Ptr{Cvoid},
                                                        min_level::Int32)::Int32
end

function moeblaze_config_create(out)
    @check @ccall libmoeblaze.moeblaze_config_create(out::Ptr{moeblaze_config_t})::Int32
end
function moeblaze_config_destroy(cfg)
    @check @ccall libmoeblaze.moeblaze_config_destroy(cfg::moeblaze_config_t)::Int32
end
function moeblaze_config_set_i64(cfg, attr, value)
    @check @ccall libmoeblaze.moeblaze_config_set_i64(cfg::moeblaze_config_t, attr::Int32,
                                                      value::Int64)::Int32
end
function moeblaze_config_set_f64(cfg, attr, value)
    @check @ccall libmoeblaze.moeblaze_config_set_f64(cfg::moeblaze_config_t, attr::Int32,
                                                      value::Float64)::Int32
end
function moeblaze_config_set_dtype(cfg, attr, value)
    @check @ccall libmoeblaze.moeblaze_config_set_dtype(cfg::moeblaze_config_t, attr::Int32,
                                                        value::moeblaze_dtype_t)::Int32
end
function moeblaze_config_get_i64(cfg, attr, out)
    @check @ccall libmoeblaze.moeblaze_config_get_i64(cfg::moeblaze_config_t, attr::Int32,
                                                      out::Ptr{Int64})::Int32
end
function moeblaze_config_get_f64(cfg, attr, out)
    @check @ccall libmoeblaze.moeblaze_config_get_f64(cfg::moeblaze_config_t, attr::Int32,
                                                      out::Ptr{Float64})::Int32
end
function moeblaze_config_get_dtype(cfg, attr, out)
    @check @ccall libmoeblaze.moeblaze_config_get_dtype(cfg::moeblaze_config_t, attr::Int32,
                                                        out::Ptr{moeblaze_dtype_t})::Int32
end
function moeblaze_attr_query(attr, info)
    @check @ccall libmoeblaze.moeblaze_attr_query(attr::Int32,
                                                  info::Ref{moeblaze_attr_info_t})::Int32
end

function moeblaze_get_device_count(device_type, count)
    @check @ccall libmoeblaze.moeblaze_get_device_count(device_type::Int32,
                                                        count::Ptr{Int32})::Int32
end
function moeblaze_create(out, cfg)
    @check @ccall libmoeblaze.moeblaze_create(out::Ptr{moeblaze_handle_t},
                                              cfg::moeblaze_config_t)::Int32
end
# Collective over the ranks of nccl_comm (an ncclComm_t, borrowed); stream is a cudaStream_t.
function moeblaze_create_ep(out, cfg, nccl_comm, stream)
    @check @ccall libmoeblaze.moeblaze_create_ep(out::Ptr{moeblaze_handle_t}, cfg::moeblaze_config_t,
                                                 nccl_comm::Ptr{Cvoid}, stream::Ptr{Cvoid})::Int32
end
# Collective over nranks ranks sharing one ncclUniqueId (unique_id_bytes = 128).
function moeblaze_create_ep_from_unique_id(out, cfg, unique_id, unique_id_bytes, nranks, rank, stream)
    @check @ccall libmoeblaze.moeblaze_create_ep_from_unique_id(out::Ptr{moeblaze_handle_t},
        cfg::moeblaze_config_t, unique_id::Ptr{Cvoid}, unique_id_bytes::Csize_t, nranks::Int32,
        rank::Int32, stream::Ptr{Cvoid})::Int32
end
function moeblaze_get_symmetric_size(cfg, ep_size, bytes)
    @check @ccall libmoeblaze.moeblaze_get_symmetric_size(cfg::moeblaze_config_t, ep_size::Int32,
                                                          bytes::Ptr{Csize_t})::Int32
end
function moeblaze_destroy(handle)
    @check @ccall libmoeblaze.moeblaze_destroy(handle::moeblaze_handle_t)::Int32
end
function moeblaze_handle_get_i64(h, attr, out)
    @check @ccall libmoeblaze.moeblaze_handle_get_i64(h::moeblaze_handle_t, attr::Int32,
                                                      out::Ptr{Int64})::Int32
end
function moeblaze_handle_get_f64(h, attr, out)
    @check @ccall libmoeblaze.moeblaze_handle_get_f64(h::moeblaze_handle_t, attr::Int32,
                                                      out::Ptr{Float64})::Int32
end
function moeblaze_handle_get_dtype(h, attr, out)
    @check @ccall libmoeblaze.moeblaze_handle_get_dtype(h::moeblaze_handle_t, attr::Int32,
                                                        out::Ptr{moeblaze_dtype_t})::Int32
end

function moeblaze_get_workspace_size(h, pass, num_tokens, bytes)
    @check @ccall libmoeblaze.moeblaze_get_workspace_size(h::moeblaze_handle_t, pass::Int32,
                                                          num_tokens::Int64,
                                                          bytes::Ptr{Csize_t})::Int32
end
function moeblaze_get_saved_size(h, num_tokens, bytes)
    @check @ccall libmoeblaze.moeblaze_get_saved_size(h::moeblaze_handle_t, num_tokens::Int64,
                                                      bytes::Ptr{Csize_t})::Int32
end

function moeblaze_check_args(h, pass, args, nargs)
    @check @ccall libmoeblaze.moeblaze_check_args(h::moeblaze_handle_t, pass::Int32,
                                                  args::Ptr{moeblaze_arg_t},
                                                  nargs::Csize_t)::Int32
end
function moeblaze_forward(h, pass, args, nargs, ws, wsb, saved, sb, stream)
    @check @ccall libmoeblaze.moeblaze_forward(h::moeblaze_handle_t, pass::Int32,
        args::Ptr{moeblaze_arg_t}, nargs::Csize_t, ws::Ptr{Cvoid}, wsb::Csize_t,
        saved::Ptr{Cvoid}, sb::Csize_t, stream::Ptr{Cvoid})::Int32
end
function moeblaze_backward(h, args, nargs, saved, sb, ws, wsb, stream)
    @check @ccall libmoeblaze.moeblaze_backward(h::moeblaze_handle_t,
        args::Ptr{moeblaze_arg_t}, nargs::Csize_t, saved::Ptr{Cvoid}, sb::Csize_t,
        ws::Ptr{Cvoid}, wsb::Csize_t, stream::Ptr{Cvoid})::Int32
end
function moeblaze_backward_last_use(h, args, nargs, saved, sb, ws, wsb, stream)
    @check @ccall libmoeblaze.moeblaze_backward_last_use(h::moeblaze_handle_t,
        args::Ptr{moeblaze_arg_t}, nargs::Csize_t, saved::Ptr{Cvoid}, sb::Csize_t,
        ws::Ptr{Cvoid}, wsb::Csize_t, stream::Ptr{Cvoid})::Int32
end
function moeblaze_route(h, args, nargs, ws, wsb, stream)
    @check @ccall libmoeblaze.moeblaze_route(h::moeblaze_handle_t, args::Ptr{moeblaze_arg_t},
        nargs::Csize_t, ws::Ptr{Cvoid}, wsb::Csize_t, stream::Ptr{Cvoid})::Int32
end
function moeblaze_assert_status(h, pass, status, stream)
    @check @ccall libmoeblaze.moeblaze_assert_status(h::moeblaze_handle_t, pass::Int32,
        status::Ptr{moeblaze_tensor_t}, stream::Ptr{Cvoid})::Int32
end

# Every exported C symbol wrapped above (compared with tests/abi/exported-symbols.txt by
# test/runtests.jl).
const WRAPPED = [
    :moeblaze_assert_status, :moeblaze_attr_query, :moeblaze_backward, :moeblaze_backward_last_use, :moeblaze_check_args, :moeblaze_config_create,
    :moeblaze_config_destroy, :moeblaze_config_get_dtype, :moeblaze_config_get_f64,
    :moeblaze_config_get_i64, :moeblaze_config_set_dtype, :moeblaze_config_set_f64,
    :moeblaze_config_set_i64, :moeblaze_create, :moeblaze_create_ep, :moeblaze_create_ep_from_unique_id, :moeblaze_destroy, :moeblaze_forward,
    :moeblaze_get_abi_version, :moeblaze_get_build_info, :moeblaze_get_device_count,
    :moeblaze_get_last_error_message, :moeblaze_get_saved_size, :moeblaze_get_symmetric_size,
    :moeblaze_get_version,
    :moeblaze_get_version_string, :moeblaze_get_workspace_size, :moeblaze_handle_get_dtype,
    :moeblaze_handle_get_f64, :moeblaze_handle_get_i64, :moeblaze_route,
    :moeblaze_set_log_callback, :moeblaze_status_name, :moeblaze_status_string,
]

end # module LibMoEBlaze
