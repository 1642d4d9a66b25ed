"""Loads libmoeblaze and declares the signature of every exported function.

Search order: the ``MOEBLAZE_LIBRARY`` environment variable (a path or a soname), then the
library installed inside this package (``pip install .`` puts ``libmoeblaze.so.0`` next to this
file), then ``ctypes.util.find_library("moeblaze")``, then ``"libmoeblaze.so.0"`` (the SONAME of
ABI 0).

Every function gets explicit ``argtypes``/``restype`` (never ctypes' ``int`` defaults, which would
truncate ``size_t``/``int64_t`` and pointers). Every status-returning function gets the same
``errcheck``, which copies ``moeblaze_get_last_error_message()`` and ``moeblaze_status_name()``
immediately, on the calling thread, and raises :class:`MoEBlazeError`.

The library's ABI version is checked at import; a mismatch raises :class:`BindingError`.
"""
import ctypes
import ctypes.util
import os
from ctypes import (CFUNCTYPE, POINTER, c_char_p, c_double, c_int32, c_int64, c_size_t, c_uint32,
                    c_void_p)

from ._types import ABI_VERSION, Arg, AttrInfo, DType, Status, Tensor
from .errors import BindingError, MoEBlazeError

__all__ = ["lib", "library_path", "LOG_FN", "raw_function", "last_error_message"]

LIBRARY_ENV = "MOEBLAZE_LIBRARY"
DEFAULT_SONAME = "libmoeblaze.so.%d" % ABI_VERSION


def _candidates():
    env = os.environ.get(LIBRARY_ENV)
    if env:
        # An explicit choice is final: falling back silently would test the wrong library.
        return [env]
    out = []
    bundled = os.path.join(os.path.dirname(os.path.abspath(__file__)), DEFAULT_SONAME)
    if os.path.exists(bundled):
        out.append(bundled)
    found = ctypes.util.find_library("moeblaze")
    if found:
        out.append(found)
    out.append(DEFAULT_SONAME)
    return out


def _load():
    errors = []
    for name in _candidates():
        try:
            return ctypes.CDLL(name), name
        except OSError as exc:
            errors.append("%s: %s" % (name, exc))
    raise ImportError("cannot load libmoeblaze (set %s to its path): %s"
                      % (LIBRARY_ENV, "; ".join(errors)))


lib, library_path = _load()

# --- getters of static data (no status) ---------------------------------------------------------
_GETTERS = {
    "moeblaze_get_version": ([], c_uint32),
    "moeblaze_get_version_string": ([], c_char_p),
    "moeblaze_get_abi_version": ([], c_uint32),
    "moeblaze_get_build_info": ([], c_char_p),
    "moeblaze_status_name": ([c_int32], c_char_p),
    "moeblaze_status_string": ([c_int32], c_char_p),
    "moeblaze_get_last_error_message": ([], c_char_p),
}

#: void (*moeblaze_log_fn)(void* user_data, int32_t level, const char* func, const char* msg)
LOG_FN = CFUNCTYPE(None, c_void_p, c_int32, c_char_p, c_char_p)

_config_t = c_void_p
_handle_t = c_void_p
_stream_t = c_void_p

# --- status-returning functions -----------------------------------------------------------------
_CHECKED = {
    "moeblaze_set_log_callback": [LOG_FN, c_void_p, c_int32],
    "moeblaze_config_create": [POINTER(_config_t)],
    "moeblaze_config_destroy": [_config_t],
    "moeblaze_config_set_i64": [_config_t, c_int32, c_int64],
    "moeblaze_config_set_f64": [_config_t, c_int32, c_double],
    "moeblaze_config_set_dtype": [_config_t, c_int32, DType],
    "moeblaze_config_get_i64": [_config_t, c_int32, POINTER(c_int64)],
    "moeblaze_config_get_f64": [_config_t, c_int32, POINTER(c_double)],
    "moeblaze_config_get_dtype": [_config_t, c_int32, POINTER(DType)],
    "moeblaze_attr_query": [c_int32, POINTER(AttrInfo)],
    "moeblaze_get_device_count": [c_int32, POINTER(c_int32)],
    "moeblaze_create": [POINTER(_handle_t), _config_t],
    "moeblaze_create_ep": [POINTER(_handle_t), _config_t, c_void_p, _stream_t],
    "moeblaze_create_ep_from_unique_id": [POINTER(_handle_t), _config_t, c_void_p, c_size_t, c_int32, c_int32,
                                          _stream_t],
    "moeblaze_get_symmetric_size": [_config_t, c_int32, POINTER(c_size_t)],
    "moeblaze_destroy": [_handle_t],
    "moeblaze_handle_get_i64": [_handle_t, c_int32, POINTER(c_int64)],
    "moeblaze_handle_get_f64": [_handle_t, c_int32, POINTER(c_double)],
    "moeblaze_handle_get_dtype": [_handle_t, c_int32, POINTER(DType)],
    "moeblaze_get_workspace_size": [_handle_t, c_int32, c_int64, POINTER(c_size_t)],
    "moeblaze_get_saved_size": [_handle_t, c_int64, POINTER(c_size_t)],
    "moeblaze_check_args": [_handle_t, c_int32, POINTER(Arg), c_size_t],
    "moeblaze_forward": [_handle_t, c_int32, POINTER(Arg), c_size_t, c_void_p, c_size_t,
                         c_void_p, c_size_t, _stream_t],
    "moeblaze_backward": [_handle_t, POINTER(Arg), c_size_t, c_void_p, c_size_t, c_void_p,
                          c_size_t, _stream_t],
    "moeblaze_backward_last_use": [_handle_t, POINTER(Arg), c_size_t, c_void_p, c_size_t, c_void_p,
                                   c_size_t, _stream_t],
    "moeblaze_route": [_handle_t, POINTER(Arg), c_size_t, c_void_p, c_size_t, _stream_t],
    "moeblaze_assert_status": [_handle_t, c_int32, POINTER(Tensor), _stream_t],
}

#: Every symbol this binding declares (the ABI test compares it with exported-symbols.txt).
DECLARED = tuple(sorted(list(_GETTERS) + list(_CHECKED)))


def _declare(fn, argtypes, restype):
    fn.argtypes = argtypes
    fn.restype = restype
    return fn


for _name, (_args, _res) in _GETTERS.items():
    _declare(getattr(lib, _name), _args, _res)


def _decode(b):
    return b.decode("utf-8", "replace") if b is not None else ""


def last_error_message():
    """The calling thread's last error message (a copy)."""
    return _decode(lib.moeblaze_get_last_error_message())


def _check(result, func, args):
    """errcheck: raise on a non-success status, copying the message first (it is only valid
    until the next moeblaze_* call on this thread), then the status name."""
    if result != Status.SUCCESS:
        message = _decode(lib.moeblaze_get_last_error_message())
        status_name = _decode(lib.moeblaze_status_name(result))
        raise MoEBlazeError(result, func.__name__, message, status_name)
    return args


for _name, _args in _CHECKED.items():
    _fn = _declare(getattr(lib, _name), _args, c_int32)
    _fn.errcheck = _check


def raw_function(name):
    """A fresh function object for ``name`` with the same signature and *no* errcheck, for
    probing calls where a failure is expected (it returns the raw status)."""
    fn = lib[name]  # CDLL.__getitem__ builds a new function object each time
    if name in _GETTERS:
        return _declare(fn, *_GETTERS[name])
    return _declare(fn, _CHECKED[name], c_int32)


del _name, _args, _res, _fn

# --- ABI guard ----------------------------------------------------------------------------------
library_abi_version = int(lib.moeblaze_get_abi_version())
if library_abi_version != ABI_VERSION:
    raise BindingError(Status.VERSION_MISMATCH, "moeblaze._lib",
                       "%s reports ABI version %d, but this binding was written for ABI %d"
                       % (library_path, library_abi_version, ABI_VERSION))
