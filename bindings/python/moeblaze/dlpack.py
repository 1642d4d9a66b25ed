"""DLPack interop: pass any ``__dlpack__`` producer (NumPy, CuPy, JAX, PyTorch, ...) as a
moeblaze tensor argument, without copying.

``moeblaze_tensor_t`` is field-for-field DLPack's ``DLTensor``, so the ``dl_tensor`` member of
the managed struct inside a ``"dltensor"`` capsule is used as-is. Ownership follows the DLPack
Python specification: the consumer (this module) renames the capsule to ``"used_dltensor"``
(``"used_dltensor_versioned"``) when it takes it, and calls the producer's ``deleter`` exactly
once when it is done, in :meth:`Imported.release` (or at the end of an :class:`ArgBuilder`
``with`` block).

Stream: for CUDA producers the consumer passes its stream to ``__dlpack__`` and the producer
orders its pending work on it. ``None`` means the legacy default stream, which DLPack encodes
as ``1``. CPU producers get ``stream=None``.

Example::

    from moeblaze import dlpack
    with dlpack.ArgBuilder(stream=s) as ab:
        ab.add(ArgKind.INPUT, x)                 # any object with __dlpack__
        ab.add(ArgKind.OUTPUT, y)                # outputs must not be read-only
        handle.forward(Pass.FORWARD_INFERENCE, ab.args, ws, None, stream=s)
"""
import ctypes
import threading
from ctypes import CFUNCTYPE, POINTER, Structure, c_char_p, c_int, c_uint32, c_uint64, c_void_p, \
    py_object

from ._core import ArgList, _prod, buffer_address
from ._types import ArgKind, DeviceType, Status, Tensor, dtype_from_name, dtype_itemsize
from .errors import BindingError

__all__ = ["DLManagedTensor", "DLManagedTensorVersioned", "DLPackVersion", "Imported",
           "ArgBuilder", "import_dlpack", "HostDLPackArray", "FLAG_READ_ONLY"]

#: DLPACK_FLAG_BITMASK_READ_ONLY
FLAG_READ_ONLY = 1 << 0
#: DLPACK_FLAG_BITMASK_IS_COPIED
FLAG_IS_COPIED = 1 << 1

_DELETER = CFUNCTYPE(None, c_void_p)


class DLManagedTensor(Structure):
    """DLPack 0.x ``DLManagedTensor`` (capsule name ``"dltensor"``)."""
    _fields_ = [("dl_tensor", Tensor), ("manager_ctx", c_void_p), ("deleter", c_void_p)]


class DLPackVersion(Structure):
    _fields_ = [("major", c_uint32), ("minor", c_uint32)]


class DLManagedTensorVersioned(Structure):
    """DLPack 1.x ``DLManagedTensorVersioned`` (capsule name ``"dltensor_versioned"``)."""
    _fields_ = [("version", DLPackVersion), ("manager_ctx", c_void_p), ("deleter", c_void_p),
                ("flags", c_uint64), ("dl_tensor", Tensor)]


# Python C API through ctypes.pythonapi (holds the GIL, as these calls require).
_api = ctypes.pythonapi
_api.PyCapsule_IsValid.argtypes = [py_object, c_char_p]
_api.PyCapsule_IsValid.restype = c_int
_api.PyCapsule_GetPointer.argtypes = [py_object, c_char_p]
_api.PyCapsule_GetPointer.restype = c_void_p
_api.PyCapsule_SetName.argtypes = [py_object, c_char_p]
_api.PyCapsule_SetName.restype = c_int
_api.PyCapsule_New.argtypes = [c_void_p, c_char_p, c_void_p]
_api.PyCapsule_New.restype = py_object

# A capsule keeps the name *pointer*: these buffers live as long as the module.
_NAMES = {n: ctypes.create_string_buffer(n) for n in
          (b"dltensor", b"used_dltensor", b"dltensor_versioned", b"used_dltensor_versioned")}


def _name(n):
    return ctypes.cast(_NAMES[n], c_char_p)


class Imported:
    """One consumed DLPack capsule. ``tensor`` is a view of the producer's ``DLTensor`` (valid
    until :meth:`release`); ``read_only`` reflects the versioned flag."""

    def __init__(self, obj, stream=None, max_version=(1, 0)):
        dev_type, dev_id = obj.__dlpack_device__() if hasattr(obj, "__dlpack_device__") \
            else (DeviceType.CPU, 0)
        self.device = (int(dev_type), int(dev_id))
        kw = {}
        if int(dev_type) == DeviceType.CUDA:
            kw["stream"] = 1 if stream is None else int(stream)
        capsule = None
        if max_version is not None:
            try:
                capsule = obj.__dlpack__(max_version=tuple(max_version), **kw)
            except TypeError:  # a pre-1.0 producer without the max_version keyword
                capsule = None
        if capsule is None:
            capsule = obj.__dlpack__(**kw)
        self._capsule = capsule  # keep alive until release
        self._lock = threading.Lock()
        if _api.PyCapsule_IsValid(capsule, _name(b"dltensor_versioned")):
            ptr = _api.PyCapsule_GetPointer(capsule, _name(b"dltensor_versioned"))
            _api.PyCapsule_SetName(capsule, _name(b"used_dltensor_versioned"))
            managed = DLManagedTensorVersioned.from_address(ptr)
            if managed.version.major > 1:
                self._managed_ptr, self._deleter = ptr, managed.deleter
                self.release()
                raise BindingError(Status.VERSION_MISMATCH, "moeblaze.dlpack",
                                   "DLPack version %d.%d is newer than 1.x"
                                   % (managed.version.major, managed.version.minor))
            self.versioned = True
            self.read_only = bool(managed.flags & FLAG_READ_ONLY)
            offset = DLManagedTensorVersioned.dl_tensor.offset
        elif _api.PyCapsule_IsValid(capsule, _name(b"dltensor")):
            ptr = _api.PyCapsule_GetPointer(capsule, _name(b"dltensor"))
            _api.PyCapsule_SetName(capsule, _name(b"used_dltensor"))
            managed = DLManagedTensor.from_address(ptr)
            self.versioned = False
            self.read_only = False
            offset = DLManagedTensor.dl_tensor.offset
        else:
            raise BindingError(Status.INVALID_ARGUMENT, "moeblaze.dlpack",
                               "__dlpack__ did not return an unused DLPack capsule")
        self._managed_ptr = ptr
        self._deleter = managed.deleter
        #: Address of the DLTensor, usable as a moeblaze_tensor_t*.
        self.tensor_address = ptr + offset
        self.tensor = Tensor.from_address(self.tensor_address)
        self.tensor._keepalive = [self]

    def release(self):
        """Calls the producer's deleter (once). The tensor must not be used afterwards."""
        with self._lock:
            ptr, deleter = self._managed_ptr, self._deleter
            self._managed_ptr = self._deleter = None
        if ptr and deleter:
            _DELETER(deleter)(ptr)
        self._capsule = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.release()
        return False

    def __del__(self):
        try:
            self.release()
        except Exception:  # noqa: BLE001 - interpreter shutdown
            pass


def import_dlpack(obj, stream=None, max_version=(1, 0)):
    """Consumes ``obj.__dlpack__``; returns an :class:`Imported` (release it when done)."""
    return Imported(obj, stream=stream, max_version=max_version)


_OUTPUT_KINDS = frozenset([ArgKind.OUTPUT, ArgKind.AUX_LOSS, ArgKind.TOKENS_PER_EXPERT,
                           ArgKind.Z_LOSS, ArgKind.GRAD_INPUT, ArgKind.GRAD_ROUTER_WEIGHT,
                           ArgKind.GRAD_ROUTER_LOGITS, ArgKind.GRAD_W_GATE_UP,
                           ArgKind.GRAD_W_DOWN, ArgKind.GRAD_TOPK_WEIGHTS])


#: Top-level modules whose arrays are immutable by contract (their DLPack capsules may still
#: be unversioned or lack the read-only flag).
IMMUTABLE_PRODUCER_MODULES = ("jax", "jaxlib")


def _type_name(obj):
    t = type(obj)
    return "%s.%s" % (t.__module__, t.__qualname__)


def _immutable_producer(obj):
    return type(obj).__module__.split(".")[0] in IMMUTABLE_PRODUCER_MODULES


class ArgBuilder:
    """Builds an :class:`~moeblaze.ArgList` from DLPack producers and releases every capsule
    at the end of the ``with`` block (after the call returned; for CUDA the caller orders the
    producer's reuse of the memory after the stream work, as usual)."""

    def __init__(self, stream=None):
        self.stream = stream
        self.args = ArgList()
        self._imports = []

    def add(self, kind, obj, flags=0, output=None):
        is_output = (int(kind) in _OUTPUT_KINDS) if output is None else output
        if is_output and _immutable_producer(obj):
            # Checked before the capsule is taken: a JAX array is immutable whatever flags its
            # (possibly unversioned) capsule carries, and writing into it corrupts JAX's values.
            raise BindingError(Status.INVALID_ARGUMENT, "moeblaze.dlpack",
                               "argument %s is an output but its producer (%s) is an immutable "
                               "array; pass a mutable buffer (e.g. NumPy, CuPy or PyTorch) and "
                               "convert the result" % (ArgKind.name(kind), _type_name(obj)))
        imp = obj if isinstance(obj, Imported) else Imported(obj, stream=self.stream)
        if not isinstance(obj, Imported):
            self._imports.append(imp)
        if is_output and imp.read_only:
            raise BindingError(Status.INVALID_ARGUMENT, "moeblaze.dlpack",
                               "argument %s is an output but its DLPack tensor is read-only"
                               % ArgKind.name(kind))
        self.args.add(kind, imp.tensor, flags)
        return self

    def release(self):
        imports, self._imports = self._imports, []
        for imp in imports:
            imp.release()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.release()
        return False


# ---- a minimal producer over a Python buffer (tests, and exporting host buffers) ----------------
_live = {}
_live_lock = threading.Lock()


@_DELETER
def _host_deleter(ptr):
    with _live_lock:
        entry = _live.pop(ptr, None)
    if entry is not None and entry[1] is not None:
        try:
            entry[1](ptr)
        except Exception:  # noqa: BLE001 - never raise into C
            pass


class HostDLPackArray:
    """Exports a contiguous Python buffer on the CPU through ``__dlpack__``.

    ``on_delete(ptr)`` is called when the consumer calls the deleter. Capsules that are never
    consumed keep their memory until process exit (this producer sets no capsule destructor)."""

    def __init__(self, buf, shape, dtype=None, on_delete=None, read_only=False):
        addr, nbytes, keep, inferred = buffer_address(buf, writable=not read_only)
        self.dtype = dtype_from_name(dtype) if dtype is not None else inferred
        if self.dtype is None:
            raise BindingError(Status.INVALID_ARGUMENT, "HostDLPackArray", "dtype needed")
        if nbytes < _prod(shape) * dtype_itemsize(self.dtype):
            raise BindingError(Status.INVALID_ARGUMENT, "HostDLPackArray", "buffer too small")
        self.address, self.shape, self._keep = addr, tuple(shape), keep
        self.on_delete, self.read_only = on_delete, read_only

    def __dlpack_device__(self):
        return (DeviceType.CPU, 0)

    def __dlpack__(self, stream=None, max_version=None, dl_device=None, copy=None):
        if stream is not None:
            raise BufferError("stream must be None for a CPU array")
        versioned = max_version is not None and tuple(max_version) >= (1, 0)
        cls = DLManagedTensorVersioned if versioned else DLManagedTensor
        m = cls()
        # The shape array must live as long as the managed struct: both go into _live.
        shape_arr = (ctypes.c_int64 * max(len(self.shape), 1))(*self.shape)
        m.dl_tensor.data = self.address
        m.dl_tensor.device.device_type = DeviceType.CPU
        m.dl_tensor.device.device_id = 0
        m.dl_tensor.ndim = len(self.shape)
        m.dl_tensor.dtype = self.dtype
        m.dl_tensor.shape = ctypes.cast(shape_arr, POINTER(ctypes.c_int64))
        m.dl_tensor.strides = None  # contiguous
        m.dl_tensor.byte_offset = 0
        m.deleter = ctypes.cast(_host_deleter, c_void_p).value
        if versioned:
            m.version.major, m.version.minor = 1, 0
            m.flags = FLAG_READ_ONLY if self.read_only else 0
        ptr = ctypes.addressof(m)
        with _live_lock:
            _live[ptr] = ((m, shape_arr, self._keep), self.on_delete)
        name = b"dltensor_versioned" if versioned else b"dltensor"
        return _api.PyCapsule_New(ptr, _name(name), None)
