"""
    MoEBlaze

High-level Julia wrapper of libmoeblaze (memory-frugal Mixture-of-Experts layers).

UNTESTED: Julia is not installed on the MoEBlaze development machines; see ../README.md.

Layout: the C API is row-major (C order). A Julia column-major array of size `(d, L)` is the
row-major tensor `[L, d]`; [`tensor`](@ref) reverses the dimensions accordingly. Keep the
returned [`TensorArg`](@ref)s (which hold the shape vectors) and the arrays alive during calls:
[`forward!`](@ref) and friends do this with `GC.@preserve`.
"""
module MoEBlaze

include("LibMoEBlaze.jl")
using .LibMoEBlaze
using .LibMoEBlaze: libmoeblaze, @check

export Config, Handle, MoEBlazeError, destroy!, tensor, TensorArg, workspace_size, saved_size,
       check_args, forward!, backward!, route!, HostBuffer

# ---- version and ABI guard ---------------------------------------------------------------
version() = LibMoEBlaze.moeblaze_get_version()
version_string() = unsafe_string(LibMoEBlaze.moeblaze_get_version_string())
abi_version() = LibMoEBlaze.moeblaze_get_abi_version()
build_info() = unsafe_string(LibMoEBlaze.moeblaze_get_build_info())
status_name(s::Integer) = unsafe_string(LibMoEBlaze.moeblaze_status_name(Int32(s)))

function __init__()
    abi = abi_version()
    if abi != LibMoEBlaze.MOEBLAZE_ABI_VERSION
        error("$(libmoeblaze) reports ABI version $(abi), but MoEBlaze.jl was written for ABI " *
              "$(LibMoEBlaze.MOEBLAZE_ABI_VERSION); set MOEBLAZE_LIBRARY to a matching library")
    end
end

# ---- attributes ----------------------------------------------------------------------------
"""Attribute descriptions from `moeblaze_attr_query`, keyed by name (e.g. `:top_k`)."""
function attributes()
    out = Dict{Symbol,LibMoEBlaze.moeblaze_attr_info_t}()
    for a in Int32(0):Int32(4095)
        info = LibMoEBlaze.moeblaze_attr_info_t()
        status = @ccall libmoeblaze.moeblaze_attr_query(
            a::Int32, info::Ref{LibMoEBlaze.moeblaze_attr_info_t})::Int32
        status == LibMoEBlaze.MOEBLAZE_STATUS_UNKNOWN_ATTRIBUTE && break
        status == LibMoEBlaze.MOEBLAZE_STATUS_SUCCESS || throw(MoEBlazeError(status))
        out[Symbol(unsafe_string(info.name))] = info
    end
    return out
end

# name => (attribute number, value type), probed once from the loaded library (numbers are
# dense and appended, so probing stops at the first unknown number).
const _ATTRS = Ref{Union{Nothing,Dict{Symbol,Tuple{Int32,Int32}}}}(nothing)
function _attr(name::Symbol)
    if _ATTRS[] === nothing
        d = Dict{Symbol,Tuple{Int32,Int32}}()
        for a in Int32(0):Int32(4095)
            info = LibMoEBlaze.moeblaze_attr_info_t()
            status = @ccall libmoeblaze.moeblaze_attr_query(
                a::Int32, info::Ref{LibMoEBlaze.moeblaze_attr_info_t})::Int32
            status == LibMoEBlaze.MOEBLAZE_STATUS_SUCCESS || break
            d[Symbol(unsafe_string(info.name))] = (a, info.value_type)
        end
        _ATTRS[] = d
    end
    haskey(_ATTRS[], name) || throw(ArgumentError("unknown attribute $(name); known: " *
                                                  join(sort(collect(keys(_ATTRS[]))), ", ")))
    return _ATTRS[][name]
end

_dtype(t::LibMoEBlaze.moeblaze_dtype_t) = t
function _dtype(s::Union{Symbol,AbstractString})
    s = Symbol(lowercase(string(s)))
    s in (:f32, :float32) && return LibMoEBlaze.MOEBLAZE_DTYPE_F32
    s in (:f16, :float16) && return LibMoEBlaze.MOEBLAZE_DTYPE_F16
    s in (:bf16, :bfloat16) && return LibMoEBlaze.MOEBLAZE_DTYPE_BF16
    s in (:i32, :int32) && return LibMoEBlaze.MOEBLAZE_DTYPE_I32
    s in (:i64, :int64) && return LibMoEBlaze.MOEBLAZE_DTYPE_I64
    throw(ArgumentError("unknown dtype $(s)"))
end
_dtype(::Type{Float32}) = LibMoEBlaze.MOEBLAZE_DTYPE_F32
_dtype(::Type{Float16}) = LibMoEBlaze.MOEBLAZE_DTYPE_F16
_dtype(::Type{Int32}) = LibMoEBlaze.MOEBLAZE_DTYPE_I32
_dtype(::Type{Int64}) = LibMoEBlaze.MOEBLAZE_DTYPE_I64

# ---- config --------------------------------------------------------------------------------
"""
    Config(; num_experts=8, top_k=2, hidden_size=..., ffn_hidden_size=..., max_tokens=...,
           device_type=LibMoEBlaze.MOEBLAZE_DEVICE_CPU, activation_dtype=:f32, ...)

A `moeblaze_config_t`. Keywords are the attribute names of `moeblaze_attr_query`.
Freed by a finalizer or explicitly with [`destroy!`](@ref).
"""
mutable struct Config
    ptr::LibMoEBlaze.moeblaze_config_t
    function Config(; kwargs...)
        r = Ref{LibMoEBlaze.moeblaze_config_t}(C_NULL)
        LibMoEBlaze.moeblaze_config_create(r)
        c = finalizer(destroy!, new(r[]))
        for (k, v) in kwargs
            setattr!(c, k, v)
        end
        return c
    end
end

Base.unsafe_convert(::Type{LibMoEBlaze.moeblaze_config_t}, c::Config) = c.ptr

function destroy!(c::Config)
    if c.ptr != C_NULL
        LibMoEBlaze.moeblaze_config_destroy(c.ptr)
        c.ptr = C_NULL
    end
    return nothing
end

function setattr!(c::Config, name::Symbol, value)
    num, vt = _attr(name)
    if vt == LibMoEBlaze.MOEBLAZE_VALUE_DTYPE
        LibMoEBlaze.moeblaze_config_set_dtype(c, num, _dtype(value))
    elseif vt == LibMoEBlaze.MOEBLAZE_VALUE_F64
        LibMoEBlaze.moeblaze_config_set_f64(c, num, Float64(value))
    else
        LibMoEBlaze.moeblaze_config_set_i64(c, num, Int64(value))
    end
    return c
end

function getattr(c::Config, name::Symbol)
    num, vt = _attr(name)
    if vt == LibMoEBlaze.MOEBLAZE_VALUE_DTYPE
        r = Ref{LibMoEBlaze.moeblaze_dtype_t}()
        LibMoEBlaze.moeblaze_config_get_dtype(c, num, r)
    elseif vt == LibMoEBlaze.MOEBLAZE_VALUE_F64
        r = Ref{Float64}()
        LibMoEBlaze.moeblaze_config_get_f64(c, num, r)
    else
        r = Ref{Int64}()
        LibMoEBlaze.moeblaze_config_get_i64(c, num, r)
    end
    return r[]
end

# ---- handle --------------------------------------------------------------------------------
"""An immutable layer (`moeblaze_handle_t`), as NCCL.jl's `Communicator`."""
mutable struct Handle
    ptr::LibMoEBlaze.moeblaze_handle_t
    function Handle(cfg::Config)
        r = Ref{LibMoEBlaze.moeblaze_handle_t}(C_NULL)
        LibMoEBlaze.moeblaze_create(r, cfg)
        return finalizer(destroy!, new(r[]))
    end
end
Handle(; kwargs...) = (cfg = Config(; kwargs...); h = Handle(cfg); destroy!(cfg); h)

Base.unsafe_convert(::Type{LibMoEBlaze.moeblaze_handle_t}, h::Handle) = h.ptr

function destroy!(h::Handle)
    if h.ptr != C_NULL
        LibMoEBlaze.moeblaze_destroy(h.ptr)
        h.ptr = C_NULL
    end
    return nothing
end

function getattr(h::Handle, name::Symbol)
    num, vt = _attr(name)
    if vt == LibMoEBlaze.MOEBLAZE_VALUE_DTYPE
        r = Ref{LibMoEBlaze.moeblaze_dtype_t}()
        LibMoEBlaze.moeblaze_handle_get_dtype(h, num, r)
    elseif vt == LibMoEBlaze.MOEBLAZE_VALUE_F64
        r = Ref{Float64}()
        LibMoEBlaze.moeblaze_handle_get_f64(h, num, r)
    else
        r = Ref{Int64}()
        LibMoEBlaze.moeblaze_handle_get_i64(h, num, r)
    end
    return r[]
end

function workspace_size(h::Handle, pass::Integer, num_tokens::Integer)
    r = Ref{Csize_t}(0)
    LibMoEBlaze.moeblaze_get_workspace_size(h, Int32(pass), Int64(num_tokens), r)
    return Int(r[])
end

function saved_size(h::Handle, num_tokens::Integer)
    r = Ref{Csize_t}(0)
    LibMoEBlaze.moeblaze_get_saved_size(h, Int64(num_tokens), r)
    return Int(r[])
end

# ---- tensors and arguments -----------------------------------------------------------------
"""One argument: its kind, flags, data owner and the shape vector the descriptor points to."""
struct TensorArg
    kind::Int32
    flags::UInt32
    owner::Any             # the array (kept alive by GC.@preserve in the calls)
    shape::Vector{Int64}   # row-major shape; the descriptor points into it
    data::Ptr{Cvoid}
    device::LibMoEBlaze.moeblaze_device_t
    dtype::LibMoEBlaze.moeblaze_dtype_t
end

"""
    tensor(kind, A::DenseArray; flags=0, dtype=eltype-derived)

A host argument over a contiguous Julia array. The row-major shape is `reverse(size(A))`
(a `d × L` matrix is `[L, d]`); a zero-dimensional array or `Ref`-like 1-element vector is a
scalar.
"""
function tensor(kind::Integer, A::DenseArray{T}; flags::Integer=0,
                dtype=_dtype(T)) where {T}
    shape = Int64[reverse(size(A))...]
    return TensorArg(Int32(kind), UInt32(flags), A, shape, Ptr{Cvoid}(pointer(A)),
                     LibMoEBlaze.moeblaze_device_t(LibMoEBlaze.MOEBLAZE_DEVICE_CPU, 0),
                     _dtype(dtype))
end

# Builds the C argument array. Call only inside GC.@preserve of the TensorArgs.
function _c_args(args::AbstractVector{TensorArg})
    return [LibMoEBlaze.moeblaze_arg_t(a.kind, a.flags,
                LibMoEBlaze.moeblaze_tensor_t(a.data, a.device, Int32(length(a.shape)), a.dtype,
                                              isempty(a.shape) ? Ptr{Int64}(C_NULL) :
                                                                 pointer(a.shape),
                                              Ptr{Int64}(C_NULL), UInt64(0)))
            for a in args]
end

"""Zeroed host memory aligned to 256 bytes, for workspace and saved buffers of CPU handles."""
mutable struct HostBuffer
    raw::Vector{UInt8}
    offset::Int
    nbytes::Int
    function HostBuffer(nbytes::Integer)
        raw = zeros(UInt8, nbytes + LibMoEBlaze.MOEBLAZE_BUFFER_ALIGNMENT)
        addr = UInt(pointer(raw))
        off = Int((LibMoEBlaze.MOEBLAZE_BUFFER_ALIGNMENT - addr % 256) % 256)
        return new(raw, off, Int(nbytes))
    end
end
Base.pointer(b::HostBuffer) = Ptr{Cvoid}(pointer(b.raw) + b.offset)
Base.sizeof(b::HostBuffer) = b.nbytes

function check_args(h::Handle, pass::Integer, args::Vector{TensorArg})
    GC.@preserve args begin
        cargs = _c_args(args)
        LibMoEBlaze.moeblaze_check_args(h, Int32(pass), cargs, length(cargs))
    end
end

"""
    forward!(h, pass, args; workspace=HostBuffer(...), saved=nothing, stream=C_NULL)

`moeblaze_forward`. With `pass == MOEBLAZE_PASS_FORWARD_TRAINING` a saved buffer of
`saved_size(h, L)` bytes is required; it is returned for [`backward!`](@ref).
"""
function forward!(h::Handle, pass::Integer, args::Vector{TensorArg}; num_tokens::Integer,
                  workspace=HostBuffer(workspace_size(h, pass, num_tokens)),
                  saved=(pass == LibMoEBlaze.MOEBLAZE_PASS_FORWARD_TRAINING ?
                         HostBuffer(saved_size(h, num_tokens)) : nothing),
                  stream::Ptr{Cvoid}=C_NULL)
    GC.@preserve args workspace saved begin
        cargs = _c_args(args)
        LibMoEBlaze.moeblaze_forward(h, Int32(pass), cargs, length(cargs),
            pointer(workspace), sizeof(workspace),
            saved === nothing ? C_NULL : pointer(saved),
            saved === nothing ? 0 : sizeof(saved), stream)
    end
    return saved
end

"""`moeblaze_backward` from the saved buffer returned by a training [`forward!`](@ref)."""
function backward!(h::Handle, args::Vector{TensorArg}, saved; num_tokens::Integer,
                   workspace=HostBuffer(workspace_size(h, LibMoEBlaze.MOEBLAZE_PASS_BACKWARD,
                                                       num_tokens)),
                   stream::Ptr{Cvoid}=C_NULL)
    GC.@preserve args workspace saved begin
        cargs = _c_args(args)
        LibMoEBlaze.moeblaze_backward(h, cargs, length(cargs), pointer(saved), sizeof(saved),
                                      pointer(workspace), sizeof(workspace), stream)
    end
    return nothing
end

"""`moeblaze_route`: the router alone."""
function route!(h::Handle, args::Vector{TensorArg}; num_tokens::Integer,
                workspace=HostBuffer(workspace_size(h, LibMoEBlaze.MOEBLAZE_PASS_ROUTE,
                                                    num_tokens)),
                stream::Ptr{Cvoid}=C_NULL)
    GC.@preserve args workspace begin
        cargs = _c_args(args)
        LibMoEBlaze.moeblaze_route(h, cargs, length(cargs), pointer(workspace),
                                   sizeof(workspace), stream)
    end
    return nothing
end

end # module MoEBlaze
