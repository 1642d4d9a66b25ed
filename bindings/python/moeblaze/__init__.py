"""Python binding of libmoeblaze (stdlib ctypes only).

Layers:
  * ``moeblaze._lib``: the loaded library with argtypes/restype/errcheck on every function.
  * ``moeblaze._types``: ctypes structs (Tensor == DLTensor, Arg, Device, DType, AttrInfo) and
    every enum as named integer constants.
  * :class:`Config`, :class:`Handle`: owners of the C objects (``close()``, ``with``, finalizers).
  * :class:`Layer`: a convenience host (CPU engine) layer working on Python buffers.
  * ``moeblaze.torch``: a ``torch.autograd.Function`` (imported on first access, needs torch).
  * ``moeblaze.dlpack``: pass any ``__dlpack__`` producer as a tensor argument.

Every failing call raises :class:`MoEBlazeError` with ``status``, ``status_name``, ``function``
and ``message`` copied from the library on the failing thread.
"""
import importlib

from ._types import *  # noqa: F401,F403 - the constants are part of the API
from ._types import __all__ as _types_all
from .errors import BindingError, MoEBlazeError
from ._lib import library_path
from ._core import (AlignedBuffer, ArgList, AttrSpec, Config, Handle, attributes, buffer_address,
                    get_abi_version, get_build_info, get_device_count, get_version,
                    get_version_string, host_tensor, last_error_message, set_log_callback,
                    status_name, status_string)
from .layer import ForwardResult, Gradients, Layer

__version__ = "0.2.0"

__all__ = list(_types_all) + [
    "BindingError", "MoEBlazeError", "library_path", "AlignedBuffer", "ArgList", "AttrSpec",
    "Config", "Handle", "attributes", "buffer_address", "get_abi_version", "get_build_info",
    "get_device_count", "get_version", "get_version_string", "host_tensor",
    "last_error_message", "set_log_callback", "status_name", "status_string", "ForwardResult",
    "Gradients", "Layer",
]


def __getattr__(name):
    # moeblaze.torch is imported lazily: importing torch costs seconds and torch is optional.
    # It raises ImportError when torch is not installed.
    if name in ("torch", "dlpack"):
        return importlib.import_module("." + name, __name__)
    raise AttributeError("module %r has no attribute %r" % (__name__, name))
