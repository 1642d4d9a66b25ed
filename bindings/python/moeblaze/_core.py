"""Config and Handle objects, argument lists, host buffers and aligned allocations."""
import atexit
import contextlib
import ctypes
import gc
import operator
import threading
import weakref
from collections import namedtuple
from ctypes import byref, c_char, c_double, c_int32, c_int64, c_size_t, c_void_p

from . import _lib
from ._types import (INT32, INT64, UINT32, UINT64, checked_int)
from ._types import (BUFFER_ALIGNMENT, Activation, Arg, AttrInfo, DType, DeviceType, Engine, EpTransport, Pass,
                     SavePolicy, ScoreFn, AuxLossForm, Status, Tensor, ValueType, dtype_from_name, dtype_name,
                     dtype_itemsize)
from .errors import BindingError, MoEBlazeError

_L = _lib.lib

__all__ = [
    "get_version", "get_version_string", "get_abi_version", "get_build_info", "status_name",
    "status_string", "last_error_message", "get_device_count", "set_log_callback",
    "AttrSpec", "attributes", "Config", "Handle", "AlignedBuffer", "ArgList", "host_tensor",
    "buffer_address",
]


def _s(b):
    return b.decode("utf-8", "replace") if b is not None else ""


# ---- version and status ------------------------------------------------------------------------
def get_version():
    """Run-time library version, encoded as major*1000000 + minor*1000 + patch."""
    return int(_L.moeblaze_get_version())


def get_version_string():
    return _s(_L.moeblaze_get_version_string())


def get_abi_version():
    return int(_L.moeblaze_get_abi_version())


def get_build_info():
    return _s(_L.moeblaze_get_build_info())


def _status_value(status):
    """An int32 status for the C lookup; any other integer is unknown to the library (-1 is
    never a status), never wrapped onto a known one."""
    v = operator.index(status)
    return v if INT32[0] <= v <= INT32[1] else -1


def status_name(status):
    """``moeblaze_status_name``; any integer is accepted ("MOEBLAZE_STATUS_UNKNOWN" for values
    that are not statuses, however large)."""
    return _s(_L.moeblaze_status_name(_status_value(status)))


def status_string(status):
    return _s(_L.moeblaze_status_string(_status_value(status)))


def last_error_message():
    return _lib.last_error_message()


def get_device_count(device_type=DeviceType.CUDA):
    """Devices of a type this build can use (1 for the CPU; 0 CUDA devices without CUDA)."""
    out = c_int32(0)
    _L.moeblaze_get_device_count(checked_int(DeviceType.parse(device_type), INT32, "device_type"), byref(out))
    return out.value


# The log callback. The library calls it outside its locks, on any thread, and may be called
# back from it: the trampoline may call any moeblaze function, set_log_callback included.
# Thunks (ctypes callback objects) stay alive while the library may call them: the library's
# set_log_callback, called from outside a callback, returns only once no thread runs the
# previous one, so older thunks are released then; a thunk installed from inside a callback is
# kept for the life of the process (the library returns at once there).
_log_lock = threading.Lock()
_log_state = {"fn": None, "thunks": [], "pinned": []}
_log_tls = threading.local()


def _in_log_callback():
    return getattr(_log_tls, "depth", 0) > 0


def set_log_callback(fn, min_level=2):
    """Installs ``fn(level:int, func:str, msg:str)`` as the process-wide log sink (None removes
    it). ``fn`` runs on the thread of the call that logs and may call the library (remove or
    replace itself, make calls that fail). Exceptions raised by ``fn`` are swallowed: they must
    not unwind through C. ``min_level``: 0 (nothing) to 4 (everything); errors are level 1."""
    if fn is not None and not callable(fn):
        raise TypeError("set_log_callback takes a callable fn(level, func, msg) or None, not %s"
                        % type(fn).__name__)
    level = checked_int(min_level, INT32, "min_level", "moeblaze.set_log_callback")
    if fn is None:
        cfunc = ctypes.cast(None, _lib.LOG_FN)
    else:
        def trampoline(_user, lvl, func, msg):
            depth = getattr(_log_tls, "depth", 0)
            if depth:  # the library never re-enters on one thread; stay safe if it did
                return
            _log_tls.depth = depth + 1
            try:
                fn(int(lvl), _s(func), _s(msg))
            except BaseException:  # noqa: BLE001 - never propagate into C
                pass
            finally:
                _log_tls.depth = depth

        cfunc = _lib.LOG_FN(trampoline)
    if _in_log_callback():
        # The library returns at once here and other threads may still run older thunks:
        # keep this one (and every older one) alive for good. No lock: the thread that holds
        # it may be waiting in the library for this very callback to return.
        _log_state["pinned"].append(cfunc)
        _log_state["pinned"].extend(_log_state["thunks"])
        _L.moeblaze_set_log_callback(cfunc, None, level)
        _log_state["fn"] = fn
        return
    with _log_lock:
        _log_state["thunks"].append(cfunc)  # alive before the library can call it
        _L.moeblaze_set_log_callback(cfunc, None, level)
        # No thread runs an older thunk now; only the installed one must stay.
        _log_state["thunks"] = [cfunc]
        _log_state["fn"] = fn


# ---- attributes --------------------------------------------------------------------------------
AttrSpec = namedtuple("AttrSpec", "number name value_type required min_i64 max_i64 default_i64 "
                                  "default_f64 since_version")

_ENUM_ATTRS = {
    "activation": Activation, "score_function": ScoreFn, "save_policy": SavePolicy, "aux_loss_form": AuxLossForm,
    "device_type": DeviceType, "engine": Engine, "ep_transport": EpTransport,
}
_attr_cache = None
_attr_lock = threading.Lock()


def attributes():
    """``{name: AttrSpec}`` for every attribute the *loaded library* knows, from
    ``moeblaze_attr_query`` (so new attributes appear without binding changes). Attribute
    numbers are dense and appended, so probing stops at the first unknown number."""
    global _attr_cache
    with _attr_lock:
        if _attr_cache is None:
            query = _lib.raw_function("moeblaze_attr_query")
            table = {}
            for number in range(4096):
                info = AttrInfo()
                info.struct_size = ctypes.sizeof(AttrInfo)
                status = query(number, byref(info))
                if status == Status.UNKNOWN_ATTRIBUTE:
                    break
                if status != Status.SUCCESS:
                    raise MoEBlazeError(status, "moeblaze_attr_query", _lib.last_error_message(),
                                        status_name(status))
                name = _s(info.name)
                table[name] = AttrSpec(number, name, info.value_type, bool(info.required),
                                       info.min_i64, info.max_i64, info.default_i64,
                                       info.default_f64, info.since_version)
            _attr_cache = table
        return dict(_attr_cache)


def _attr_number_and_type(attr):
    """(number, value_type or None) from a name such as "top_k", an Attr constant or an int."""
    table = attributes()
    if isinstance(attr, str):
        spec = table.get(attr.lower())
        if spec is None:
            raise BindingError(Status.UNKNOWN_ATTRIBUTE, "moeblaze.Config",
                               "unknown attribute %r; this library knows: %s"
                               % (attr, ", ".join(sorted(table))))
        return spec.number, spec.value_type
    number = checked_int(attr, INT32, "attribute number", "moeblaze.Config")
    for spec in table.values():
        if spec.number == number:
            return number, spec.value_type
    return number, None  # let the library answer UNKNOWN_ATTRIBUTE


def _attr_name(number):
    for spec in attributes().values():
        if spec.number == number:
            return spec.name
    return None


class _Owned:
    """Owns one C object: close() is idempotent, context manager, weakref.finalize fallback.

    Every library call on the object runs inside ``_call()``, which counts it in flight; close()
    waits for the calls in flight on other threads before destroying the object, refuses new
    ones from then on, and refuses to run from inside a call on the same object (a log
    callback, say), which it would otherwise free under its caller."""
    _destroy_name = None

    def _own(self, ptr):
        _drain_pending()
        self._cond = threading.Condition(threading.Lock())
        self._in_flight = {}  # thread id -> calls of that thread now inside the library
        self._closing = False
        self._ptr = ptr
        self._finalizer = weakref.finalize(self, _destroy, self._destroy_name, ptr)

    @contextlib.contextmanager
    def _call(self):
        """Marks one library call on this object in flight (raises if it is closed)."""
        cond = getattr(self, "_cond", None)
        if cond is None:
            self._require_open()
        me = threading.get_ident()
        with cond:
            if self._closing or self._ptr is None:
                raise BindingError(Status.INVALID_ARGUMENT, type(self).__name__,
                                   "%s is closed" % type(self).__name__)
            self._in_flight[me] = self._in_flight.get(me, 0) + 1
        try:
            yield
        finally:
            with cond:
                left = self._in_flight[me] - 1
                if left:
                    self._in_flight[me] = left
                else:
                    del self._in_flight[me]
                if not self._in_flight:
                    cond.notify_all()

    def close(self):
        """Destroys the C object once no other thread is inside a call on it; safe to call more
        than once. Raises BindingError when called from inside a call on this object."""
        cond = getattr(self, "_cond", None)
        if cond is not None:
            with cond:
                if threading.get_ident() in self._in_flight:
                    raise BindingError(Status.INVALID_ARGUMENT, type(self).__name__,
                                       "close() from inside a call on this %s (a log callback?) "
                                       "would free it under that call" % type(self).__name__)
                self._closing = True
                while self._in_flight:
                    cond.wait()
        fin = getattr(self, "_finalizer", None)
        if fin is not None:
            fin()
        self._ptr = None
        _drain_pending()

    @property
    def closed(self):
        return getattr(self, "_ptr", None) is None or getattr(self, "_closing", False)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
        return False

    def _require_open(self):
        if self.closed:
            raise BindingError(Status.INVALID_ARGUMENT, type(self).__name__,
                               "%s is closed" % type(self).__name__)

    @property
    def _as_parameter_(self):
        self._require_open()
        return c_void_p(self._ptr)

    @property
    def address(self):
        """The C pointer as an integer (None once closed)."""
        return getattr(self, "_ptr", None)


# Destroy calls clear the calling thread's last error message (every moeblaze_* call does).
# A finalizer run by the cyclic garbage collector can fire *between* a failing call and the
# copy of its message (the collector runs inside any allocation, e.g. the argument tuple that
# ctypes builds for errcheck). So objects collected by the cyclic GC are not destroyed from
# inside the collection: they are queued and destroyed at the next explicit binding call
# (Config/Handle creation, close()) or at exit. Objects released by reference counting are
# destroyed at once.
_gc_active = False
_pending = []
_pending_lock = threading.Lock()


def _gc_phase(phase, _info):
    global _gc_active
    _gc_active = phase == "start"


gc.callbacks.append(_gc_phase)


def _drain_pending():
    while True:
        with _pending_lock:
            if not _pending:
                return
            fname, ptr = _pending.pop()
        getattr(_L, fname)(c_void_p(ptr))


atexit.register(_drain_pending)


def _destroy(fname, ptr):
    if _gc_active:
        with _pending_lock:
            _pending.append((fname, ptr))
        return
    _drain_pending()
    getattr(_L, fname)(c_void_p(ptr))


def _coerce_value(name, value_type, value):
    if value_type == ValueType.DTYPE or isinstance(value, (str, DType)) and value_type is None:
        return ValueType.DTYPE, dtype_from_name(value)
    if value_type == ValueType.F64:
        return ValueType.F64, float(value)
    if isinstance(value, str):
        ns = _ENUM_ATTRS.get(name)
        if ns is None:
            raise BindingError(Status.INVALID_ARGUMENT, "moeblaze.Config",
                               "attribute %s takes a number, not %r" % (name, value))
        return ValueType.I64, ns.parse(value)
    if value_type == ValueType.I64:
        return ValueType.I64, checked_int(value, INT64, name, "moeblaze.Config")
    # Unknown to this binding: pick the setter by the Python type; the library checks.
    if isinstance(value, float):
        return ValueType.F64, value
    return ValueType.I64, checked_int(value, INT64, name, "moeblaze.Config")


class Config(_Owned):
    """A moeblaze_config_t. Keyword arguments are attribute names from moeblaze_attr_query,
    e.g. ``Config(num_experts=8, top_k=2, hidden_size=64, ffn_hidden_size=128, max_tokens=32,
    activation="swiglu", device_type="cpu", activation_dtype="f32")``. Enum-valued attributes
    accept their constant names; dtype attributes accept ``"f32"``/``"f16"``/``"bf16"``."""
    _destroy_name = "moeblaze_config_destroy"

    def __init__(self, **attrs):
        ptr = c_void_p()
        _L.moeblaze_config_create(byref(ptr))
        self._own(ptr.value)
        self.update(**attrs)

    def update(self, **attrs):
        for key, val in attrs.items():
            self.set(key, val)
        return self

    def set(self, attr, value):
        self._require_open()
        number, value_type = _attr_number_and_type(attr)
        name = _attr_name(number) or str(attr)
        kind, val = _coerce_value(name, value_type, value)
        with self._call():
            if kind == ValueType.DTYPE:
                _L.moeblaze_config_set_dtype(self, number, val)
            elif kind == ValueType.F64:
                _L.moeblaze_config_set_f64(self, number, c_double(val))
            else:
                _L.moeblaze_config_set_i64(self, number, c_int64(val))
        return self

    def get(self, attr):
        number, value_type = _attr_number_and_type(attr)
        return _get(self, "config", number, value_type)

    __setitem__ = set
    __getitem__ = get

    def as_dict(self):
        return {name: self.get(name) for name in attributes()}

    def create_handle(self):
        return Handle(self)


def _get(obj, prefix, number, value_type):
    obj._require_open()
    with obj._call():
        if value_type == ValueType.F64:
            out = c_double()
            getattr(_L, "moeblaze_%s_get_f64" % prefix)(obj, number, byref(out))
            return out.value
        if value_type == ValueType.DTYPE:
            out = DType()
            getattr(_L, "moeblaze_%s_get_dtype" % prefix)(obj, number, byref(out))
            return out
        out = c_int64()
        getattr(_L, "moeblaze_%s_get_i64" % prefix)(obj, number, byref(out))
        return out.value


# ---- buffers -----------------------------------------------------------------------------------
class AlignedBuffer:
    """Zero-initialised host memory whose address is a multiple of ``alignment`` (default 256,
    MOEBLAZE_BUFFER_ALIGNMENT), allocated with ctypes and aligned by hand."""

    def __init__(self, nbytes, alignment=BUFFER_ALIGNMENT):
        nbytes = int(nbytes)
        if nbytes < 0 or alignment <= 0 or alignment & (alignment - 1):
            raise ValueError("bad size or alignment")
        self._raw = (c_char * (nbytes + alignment))()
        base = ctypes.addressof(self._raw)
        self._offset = (-base) % alignment
        self.address = base + self._offset
        self.nbytes = nbytes

    def __len__(self):
        return self.nbytes

    def memoryview(self):
        """A writable byte view of the aligned region."""
        return memoryview(self._raw).cast("B")[self._offset:self._offset + self.nbytes]

    def __repr__(self):
        return "AlignedBuffer(%d bytes at 0x%x)" % (self.nbytes, self.address)


_FORMAT_DTYPES = {"f": "f32", "d": "f64", "e": "f16"}


def _format_dtype(fmt, itemsize):
    fmt = fmt.lstrip("@=<>!")
    if fmt in _FORMAT_DTYPES:
        return dtype_from_name(_FORMAT_DTYPES[fmt])
    if fmt in ("b", "h", "i", "l", "q", "n") and itemsize in (4, 8):
        return dtype_from_name("i%d" % (8 * itemsize))
    return None  # bytes, uint16 (bf16 bits) and friends: the caller must say


def buffer_address(obj, writable=True):
    """``(address, nbytes, keepalive, inferred_dtype)`` of a buffer-like object.

    Accepts AlignedBuffer, ctypes objects, objects with the buffer protocol (array.array,
    bytearray, memoryview, ...) and ``(address, nbytes)`` tuples. A read-only buffer is copied
    when ``writable`` is false (inputs) and rejected otherwise (outputs).
    """
    if isinstance(obj, AlignedBuffer):
        return obj.address, obj.nbytes, obj, None
    if isinstance(obj, tuple) and len(obj) == 2:
        return (checked_int(obj[0], UINT64, "buffer address", "moeblaze.buffer_address"),
                checked_int(obj[1], UINT64, "buffer size", "moeblaze.buffer_address"), None, None)
    if isinstance(obj, (ctypes._SimpleCData, ctypes.Array, ctypes.Structure)):
        return ctypes.addressof(obj), ctypes.sizeof(obj), obj, None
    mv = memoryview(obj)
    if not mv.c_contiguous:
        raise BindingError(Status.INVALID_ARGUMENT, "moeblaze.buffer_address",
                           "buffer is not C-contiguous")
    dtype = _format_dtype(mv.format, mv.itemsize)
    nbytes = mv.nbytes
    if nbytes == 0:
        # Nothing to read or write; any aligned non-NULL address will do.
        holder = AlignedBuffer(0)
        return holder.address, 0, holder, dtype
    flat = mv.cast("B") if mv.format != "B" or mv.ndim != 1 else mv
    if mv.readonly:
        if writable:
            raise BindingError(Status.INVALID_ARGUMENT, "moeblaze.buffer_address",
                               "output buffer is read-only")
        holder = (c_char * nbytes).from_buffer_copy(flat)
    else:
        holder = (c_char * nbytes).from_buffer(flat)
    return ctypes.addressof(holder), nbytes, (holder, flat, obj), dtype


def _prod(shape):
    n = 1
    for s in shape:
        n *= int(s)
    return n


def host_tensor(buf, shape, dtype=None, strides=None, writable=False, default_dtype=None):
    """A CPU Tensor descriptor over a Python buffer; the result keeps ``buf`` (and the shape
    array) alive. The dtype is ``dtype``, else inferred from the buffer's format ('f' = f32,
    'q' = i64, ...), else ``default_dtype``. The buffer size is checked against the shape."""
    addr, nbytes, keep, inferred = buffer_address(buf, writable)
    if dtype is not None:
        dt = dtype_from_name(dtype)
    elif inferred is not None:
        dt = inferred
    elif default_dtype is not None:
        dt = dtype_from_name(default_dtype)
    else:
        raise BindingError(Status.INVALID_ARGUMENT, "moeblaze.host_tensor",
                           "cannot infer the dtype of %s; pass dtype=" % type(buf).__name__)
    if strides is None:
        need = _prod(shape) * dtype_itemsize(dt)
        if nbytes < need:
            raise BindingError(Status.INVALID_ARGUMENT, "moeblaze.host_tensor",
                               "buffer of %d bytes is smaller than shape %s of %s (%d bytes)"
                               % (nbytes, tuple(shape), dtype_name(dt), need))
    t = Tensor.make(addr, shape, dt, DeviceType.CPU, 0, strides)
    t._keepalive.append(keep)
    return t


class ArgList:
    """An ordered list of moeblaze_arg_t that keeps every tensor (and its shape array and
    buffer) alive for as long as the list lives."""

    def __init__(self, items=()):
        self._items = []
        for item in items:
            if isinstance(item, Arg):
                self.append_arg(item)
            else:
                self.add(*item)

    def add(self, kind, tensor, flags=0):
        """Appends ``(kind, tensor, flags)``; iteration yields the same triples."""
        if not isinstance(tensor, Tensor):
            raise TypeError("expected a moeblaze Tensor, got %s" % type(tensor).__name__)
        self._items.append((checked_int(kind, INT32, "argument kind", "moeblaze.ArgList"), tensor,
                            checked_int(flags, UINT32, "argument flags", "moeblaze.ArgList")))
        return self

    def append_arg(self, arg):
        self._items.append((arg.kind, arg.tensor, arg.flags))
        return self

    def copy(self):
        return ArgList(self._items)

    def __len__(self):
        return len(self._items)

    def __iter__(self):
        return iter(self._items)

    def kinds(self):
        return [k for k, _, _ in self._items]

    def get(self, kind):
        """The tensor of the first argument of ``kind``, or None."""
        for k, t, _ in self._items:
            if k == kind:
                return t
        return None

    def to_array(self):
        """``(Arg * n)`` filled from the list; valid while this ArgList lives."""
        arr = (Arg * max(len(self._items), 1))()
        for i, (kind, tensor, flags) in enumerate(self._items):
            arr[i].kind = kind
            arr[i].flags = flags
            ctypes.memmove(ctypes.addressof(arr[i].tensor), ctypes.addressof(tensor),
                           ctypes.sizeof(Tensor))
        return arr


def _as_args(args):
    if isinstance(args, ArgList):
        return args
    return ArgList(args)


def _buffer(buf, nbytes, what):
    """(address or None, nbytes, keepalive) for a workspace/saved argument."""
    if buf is None:
        return None, 0, None
    if isinstance(buf, int):
        if nbytes is None:
            raise BindingError(Status.INVALID_ARGUMENT, "moeblaze.Handle",
                               "%s given as an address needs %s_bytes" % (what, what))
        return (checked_int(buf, UINT64, what + " address", "moeblaze.Handle"),
                checked_int(nbytes, UINT64, what + "_bytes", "moeblaze.Handle"), None)
    addr, size, keep, _ = buffer_address(buf, writable=False if what == "saved_in" else True)
    if nbytes is not None:
        size = checked_int(nbytes, UINT64, what + "_bytes", "moeblaze.Handle")
    return addr, size, keep


def _stream(stream):
    """A cudaStream_t from an int (or None: the legacy default stream)."""
    if stream is None:
        return None
    return checked_int(stream, UINT64, "stream", "moeblaze.Handle") or None


class Handle(_Owned):
    """A moeblaze_handle_t: an immutable layer bound to a device and an engine.

    ``Handle(config)`` or ``Handle(**attrs)`` (a temporary Config is built and released)."""
    _destroy_name = "moeblaze_destroy"

    def __init__(self, config=None, **attrs):
        if config is None:
            with Config(**attrs) as cfg:
                self._create(cfg)
        else:
            if attrs:
                raise TypeError("pass either a Config or keyword attributes, not both")
            self._create(config)

    def _create(self, cfg):
        ptr = c_void_p()
        with cfg._call():
            _L.moeblaze_create(byref(ptr), cfg)
        self._own(ptr.value)

    @classmethod
    def create_ep(cls, config, nccl_comm, stream=None):
        """An expert-parallel layer on the caller's NCCL communicator (``moeblaze_create_ep``):
        ``nccl_comm`` is the ncclComm_t as an int (e.g. ``ProcessGroupNCCL._comm_ptr()``), which
        the caller keeps alive until this handle is closed. Collective over the communicator's
        ranks, as is :meth:`close`; ``stream`` (an int cudaStream_t) must not be capturing."""
        comm = checked_int(nccl_comm, UINT64, "nccl_comm", "moeblaze.Handle.create_ep")
        if comm == 0:
            raise BindingError(Status.INVALID_ARGUMENT, "moeblaze.Handle.create_ep", "nccl_comm is null")
        self = cls.__new__(cls)
        ptr = c_void_p()
        with config._call():
            _L.moeblaze_create_ep(byref(ptr), config, c_void_p(comm), _stream(stream))
        self._own(ptr.value)
        return self

    @classmethod
    def create_ep_from_unique_id(cls, config, unique_id, nranks, rank, stream=None):
        """An expert-parallel layer that makes (and owns) its communicator from an ncclUniqueId
        (``unique_id``: its 128 bytes, drawn on one rank and shared with every rank)."""
        what = "moeblaze.Handle.create_ep_from_unique_id"
        uid = bytes(unique_id)
        n = checked_int(nranks, INT32, "nranks", what)
        r = checked_int(rank, INT32, "rank", what)
        self = cls.__new__(cls)
        ptr = c_void_p()
        buf = ctypes.create_string_buffer(uid, len(uid))
        with config._call():
            _L.moeblaze_create_ep_from_unique_id(byref(ptr), config, buf, len(uid), n, r, _stream(stream))
        self._own(ptr.value)
        return self

    def get(self, attr):
        """An effective attribute value (e.g. the engine chosen at create)."""
        number, value_type = _attr_number_and_type(attr)
        return _get(self, "handle", number, value_type)

    __getitem__ = get

    # The sizes depend on the handle's (immutable) configuration and the token count only, so
    # each answer is kept: a training step asks for them on every call.
    def workspace_size(self, pass_, num_tokens):
        self._require_open()
        p = checked_int(Pass.parse(pass_), INT32, "pass", "moeblaze.Handle")
        L = checked_int(num_tokens, INT64, "num_tokens", "moeblaze.Handle")
        cache = self.__dict__.setdefault("_sizes", {})
        if (p, L) not in cache:
            out = c_size_t()
            with self._call():
                _L.moeblaze_get_workspace_size(self, p, c_int64(L), byref(out))
            if len(cache) > 256:
                cache.clear()
            cache[(p, L)] = out.value
        return cache[(p, L)]

    def saved_size(self, num_tokens):
        self._require_open()
        L = checked_int(num_tokens, INT64, "num_tokens", "moeblaze.Handle")
        cache = self.__dict__.setdefault("_sizes", {})
        if ("saved", L) not in cache:
            out = c_size_t()
            with self._call():
                _L.moeblaze_get_saved_size(self, c_int64(L), byref(out))
            if len(cache) > 256:
                cache.clear()
            cache[("saved", L)] = out.value
        return cache[("saved", L)]

    def check_args(self, pass_, args):
        self._require_open()
        args = _as_args(args)
        arr = args.to_array()
        p = checked_int(Pass.parse(pass_), INT32, "pass", "moeblaze.Handle")
        with self._call():
            _L.moeblaze_check_args(self, p, arr, len(args))

    def forward(self, pass_, args, workspace=None, saved=None, stream=None,
                workspace_bytes=None, saved_bytes=None):
        """moeblaze_forward. Buffers: AlignedBuffer, a Python buffer, or an int address with
        an explicit byte count. ``stream`` is an int (cudaStream_t) or None."""
        self._require_open()
        args = _as_args(args)
        arr = args.to_array()
        ws, wsb, _k1 = _buffer(workspace, workspace_bytes, "workspace")
        sv, svb, _k2 = _buffer(saved, saved_bytes, "saved")
        p = checked_int(Pass.parse(pass_), INT32, "pass", "moeblaze.Handle")
        st = _stream(stream)
        with self._call():
            _L.moeblaze_forward(self, p, arr, len(args), ws, wsb, sv, svb, st)

    def backward(self, args, saved, workspace=None, stream=None, saved_bytes=None,
                 workspace_bytes=None, last_use=False):
        """moeblaze_backward, or with ``last_use`` moeblaze_backward_last_use: the saved buffer's
        last use, which may write over it (its workspace is Pass.BACKWARD_LAST_USE's) and
        leaves it spent."""
        self._require_open()
        args = _as_args(args)
        arr = args.to_array()
        sv, svb, _k1 = _buffer(saved, saved_bytes, "saved" if last_use else "saved_in")
        ws, wsb, _k2 = _buffer(workspace, workspace_bytes, "workspace")
        st = _stream(stream)
        with self._call():
            if last_use:
                _L.moeblaze_backward_last_use(self, arr, len(args), sv, svb, ws, wsb, st)
            else:
                _L.moeblaze_backward(self, arr, len(args), sv, svb, ws, wsb, st)

    def route(self, args, workspace=None, stream=None, workspace_bytes=None):
        self._require_open()
        args = _as_args(args)
        arr = args.to_array()
        ws, wsb, _k = _buffer(workspace, workspace_bytes, "workspace")
        st = _stream(stream)
        with self._call():
            _L.moeblaze_route(self, arr, len(args), ws, wsb, st)

    def assert_status(self, pass_, status, stream=None):
        """moeblaze_assert_status: ``status`` (a Tensor descriptor of the STATUS scalar a call
        of ``pass_`` was given) non-zero stops the stream with a device-side assertion naming
        the cause (CUDA; nothing is synchronised), or raises MoEBlazeError now (CPU)."""
        self._require_open()
        if not isinstance(status, Tensor):
            raise TypeError("moeblaze.Handle.assert_status: status must be a moeblaze.Tensor")
        p = checked_int(Pass.parse(pass_), INT32, "pass", "moeblaze.Handle")
        st = _stream(stream)
        with self._call():
            _L.moeblaze_assert_status(self, p, byref(status), st)
