# CUDA.jl support (a weak dependency): device tensors from CuArrays, the task's stream, and
# workspace/saved buffers from CUDA.jl's pool. UNTESTED (no Julia on our machines).
module MoEBlazeCUDAExt

using CUDA
using MoEBlaze
using MoEBlaze: TensorArg, LibMoEBlaze, _dtype

"""`tensor(kind, A::CuArray)`: a device argument; the row-major shape is `reverse(size(A))`."""
function MoEBlaze.tensor(kind::Integer, A::CuArray{T}; flags::Integer=0,
                         dtype=_dtype(T)) where {T}
    shape = Int64[reverse(size(A))...]
    ptr = Ptr{Cvoid}(UInt(pointer(A)))  # CuPtr -> raw device address
    dev = LibMoEBlaze.moeblaze_device_t(LibMoEBlaze.MOEBLAZE_DEVICE_CUDA,
                                        Int32(CUDA.deviceid(CUDA.device(A))))
    return TensorArg(Int32(kind), UInt32(flags), A, shape, ptr, dev, _dtype(dtype))
end

"""A 256-byte-aligned device buffer from CUDA.jl's pool (its allocations are aligned)."""
struct DeviceBuffer
    data::CuVector{UInt8}
end
DeviceBuffer(nbytes::Integer) = DeviceBuffer(CuVector{UInt8}(undef, max(nbytes, 1)))
Base.pointer(b::DeviceBuffer) = Ptr{Cvoid}(UInt(pointer(b.data)))
Base.sizeof(b::DeviceBuffer) = length(b.data)

"""The current task's stream, as the library's `moeblaze_stream_t`."""
current_stream() = Ptr{Cvoid}(UInt(CUDA.stream().handle))

end # module
