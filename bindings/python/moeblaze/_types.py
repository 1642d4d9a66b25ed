"""ctypes mirrors of the frozen public structs and every public enum of moeblaze.h.

Enums are plain integers with named constants (style guide 4.6 rule 3): a value this module does
not know is still a valid ``int`` and never raises on its own. Each namespace class has a
``name(value)`` helper that returns ``"UNKNOWN(<value>)"`` for values it does not know.

The structs are laid out exactly like their C counterparts; ``Tensor`` is field-for-field DLPack's
``DLTensor`` (48 bytes) and ``Arg`` is 56 bytes. The binding tests assert both sizes.
"""
import ctypes
import operator
from ctypes import (POINTER, Structure, c_char_p, c_double, c_int32, c_int64, c_size_t, c_uint8,
                    c_uint16, c_uint32, c_uint64, c_void_p)

__all__ = [
    "ABI_VERSION", "VERSION_MAJOR", "VERSION_MINOR", "VERSION_PATCH", "VERSION", "ATTR_COUNT",
    "BUFFER_ALIGNMENT", "ARG_FLAG_ACCUMULATE", "version_encode",
    "Status", "LogLevel", "DeviceType", "DTypeCode", "Activation", "ScoreFn", "AuxLossForm", "EpTransport",
    "SavePolicy",
    "Engine", "ValueType", "Attr", "Pass", "ArgKind",
    "Device", "DType", "Tensor", "Arg", "AttrInfo",
    "F32", "F16", "BF16", "I32", "I64", "dtype_from_name", "dtype_name", "dtype_itemsize",
    "INT32", "UINT32", "INT64", "UINT64", "checked_int",
]


# ---- integers crossing ctypes ------------------------------------------------------------------
# ctypes silently wraps an out-of-range int (c_int64(2**64 + 8) is 8), so every integer the
# binding hands to C is checked against its C type first.
INT32 = (-2 ** 31, 2 ** 31 - 1)
UINT32 = (0, 2 ** 32 - 1)
INT64 = (-2 ** 63, 2 ** 63 - 1)
UINT64 = (0, 2 ** 64 - 1)


def checked_int(value, bounds, what, where="moeblaze"):
    """``value`` as an int inside ``bounds`` (a C type's range), or BindingError naming it.
    Integral values only: bools and numpy integers pass, floats and strings do not."""
    if type(value) is int and bounds[0] <= value <= bounds[1]:  # the common case, on every call
        return value
    from .errors import BindingError  # errors.py imports nothing of this package
    try:
        v = operator.index(value)
    except TypeError:
        raise BindingError(Status.INVALID_ARGUMENT, where, "%s must be an integer, not %s (%r)"
                           % (what, type(value).__name__, value)) from None
    if not bounds[0] <= v <= bounds[1]:
        raise BindingError(Status.INVALID_ARGUMENT, where, "%s = %d is outside [%d, %d], the range of "
                           "its C type" % (what, v, bounds[0], bounds[1]))
    return v


def _checked_ints(values, bounds, what, where):
    """checked_int over a sequence; the element's name is formatted only for an error."""
    lo, hi = bounds
    values = list(values)
    for v in values:
        if type(v) is not int or not lo <= v <= hi:
            return [checked_int(x, bounds, "%s[%d]" % (what, i), where) for i, x in enumerate(values)]
    return values


def version_encode(major, minor, patch):
    """MOEBLAZE_VERSION_ENCODE."""
    return major * 1000000 + minor * 1000 + patch


# ---- header constants --------------------------------------------------------------------------
VERSION_MAJOR = 0
VERSION_MINOR = 2
VERSION_PATCH = 0
VERSION = version_encode(VERSION_MAJOR, VERSION_MINOR, VERSION_PATCH)
#: The ABI this binding was written for; _lib refuses a library reporting another one.
ABI_VERSION = 0
#: Number of attributes known to the header this binding mirrors (the library may know more).
ATTR_COUNT = 30
#: Required alignment of workspace and saved buffers, in bytes.
BUFFER_ALIGNMENT = 256
#: Flag on a gradient output: accumulate into it instead of overwriting.
ARG_FLAG_ACCUMULATE = 0x1


class _IntConstants:
    """Base of the enum namespaces: named ``int`` constants plus lookup helpers."""

    _PREFIX = ""

    @classmethod
    def members(cls):
        """``{name: value}`` of every constant (without the C prefix)."""
        out = {}
        for klass in reversed(cls.__mro__):
            for key, val in vars(klass).items():
                if key.isupper() and not key.startswith("_") and isinstance(val, int):
                    out[key] = val
        return out

    @classmethod
    def name(cls, value):
        """The constant's name for ``value``, or ``"UNKNOWN(<value>)"``; never raises."""
        for key, val in cls.members().items():
            if val == value:
                return key
        return "UNKNOWN(%d)" % int(value)

    @classmethod
    def c_name(cls, value):
        """The C enumerator name, e.g. ``MOEBLAZE_STATUS_SUCCESS``."""
        return cls._PREFIX + cls.name(value)

    @classmethod
    def parse(cls, value):
        """An ``int`` from an int or a (case-insensitive) constant name such as ``"swiglu"``."""
        if isinstance(value, str):
            key = value.upper()
            if key.startswith(cls._PREFIX):
                key = key[len(cls._PREFIX):]
            members = cls.members()
            if key not in members:
                raise ValueError("%s is not one of %s" % (value, ", ".join(sorted(members))))
            return members[key]
        return int(value)


class Status(_IntConstants):
    """moeblaze_status_t."""
    _PREFIX = "MOEBLAZE_STATUS_"
    SUCCESS = 0
    INVALID_ARGUMENT = 1
    NOT_SUPPORTED = 2
    INSUFFICIENT_WORKSPACE = 3
    OUT_OF_HOST_MEMORY = 4
    OUT_OF_DEVICE_MEMORY = 5
    CUDA_ERROR = 6
    CUBLAS_ERROR = 7
    ARCH_MISMATCH = 8
    VERSION_MISMATCH = 9
    UNKNOWN_ATTRIBUTE = 10
    ATTRIBUTE_TYPE_MISMATCH = 11
    INTERNAL_ERROR = 12


class LogLevel(_IntConstants):
    """moeblaze_log_level_t."""
    _PREFIX = "MOEBLAZE_LOG_"
    ERROR = 1
    WARN = 2
    INFO = 3
    DEBUG = 4


class DeviceType(_IntConstants):
    """moeblaze_device_type_t (DLPack device types)."""
    _PREFIX = "MOEBLAZE_DEVICE_"
    CPU = 1
    CUDA = 2


class DTypeCode(_IntConstants):
    """moeblaze_dtype_code_t (DLPack type codes)."""
    _PREFIX = "MOEBLAZE_DTYPE_CODE_"
    INT = 0
    UINT = 1
    FLOAT = 2
    BFLOAT = 4


class Activation(_IntConstants):
    """moeblaze_activation_t."""
    _PREFIX = "MOEBLAZE_ACTIVATION_"
    RELU = 0
    GELU = 1
    SILU = 2
    SWIGLU = 3
    GEGLU = 4


class ScoreFn(_IntConstants):
    """moeblaze_score_fn_t."""
    _PREFIX = "MOEBLAZE_SCORE_"
    SOFTMAX = 0
    SIGMOID = 1


class AuxLossForm(_IntConstants):
    """moeblaze_aux_loss_form_t."""
    _PREFIX = "MOEBLAZE_AUX_LOSS_"
    SWITCH = 0
    HUGGING_FACE = 1


class EpTransport(_IntConstants):
    """moeblaze_ep_transport_t."""
    _PREFIX = "MOEBLAZE_EP_TRANSPORT_"
    AUTO = 0
    NVLINK = 1
    HOST = 2


class SavePolicy(_IntConstants):
    """moeblaze_save_policy_t."""
    _PREFIX = "MOEBLAZE_SAVE_"
    PREACT = 0
    RECOMPUTE_UP = 1
    ALL = 2


class Engine(_IntConstants):
    """moeblaze_engine_t."""
    _PREFIX = "MOEBLAZE_ENGINE_"
    AUTO = 0
    CPU = 1
    CUDA_CUBLASLT = 2
    CUDA_FUSED = 3


class ValueType(_IntConstants):
    """moeblaze_value_type_t."""
    _PREFIX = "MOEBLAZE_VALUE_"
    I64 = 0
    F64 = 1
    DTYPE = 2


class Attr(_IntConstants):
    """moeblaze_attr_t. Config objects also accept the lower-case names from attr_query."""
    _PREFIX = "MOEBLAZE_ATTR_"
    NUM_EXPERTS = 0
    TOP_K = 1
    HIDDEN_SIZE = 2
    FFN_HIDDEN_SIZE = 3
    MAX_TOKENS = 4
    ACTIVATION = 5
    SCORE_FUNCTION = 6
    NORMALIZE_TOPK = 7
    AUX_LOSS_COEFF = 8
    Z_LOSS_COEFF = 9
    ACTIVATION_DTYPE = 10
    WEIGHT_DTYPE = 11
    ACCUM_DTYPE = 12
    SAVE_POLICY = 13
    DETERMINISTIC = 14
    DEVICE_TYPE = 15
    DEVICE_ID = 16
    ENGINE = 17
    NUM_THREADS = 18
    WINDOW_TOKENS = 19
    EP_MAX_RECV_TOKENS = 20
    EP_TRANSPORT = 21
    EP_COMM_SMS = 22
    EP_SIZE = 23
    EP_RANK = 24
    NUM_EXPERT_GROUPS = 25
    TOPK_GROUPS = 26
    ROUTE_SCALE = 27
    AUX_LOSS_FORM = 28
    WINDOW_BYTES = 29


class Pass(_IntConstants):
    """moeblaze_pass_t."""
    _PREFIX = "MOEBLAZE_PASS_"
    FORWARD_TRAINING = 0
    FORWARD_INFERENCE = 1
    BACKWARD = 2
    ROUTE = 3
    BACKWARD_LAST_USE = 4


class ArgKind(_IntConstants):
    """moeblaze_arg_kind_t."""
    _PREFIX = "MOEBLAZE_ARG_"
    INPUT = 1
    ROUTER_WEIGHT = 2
    ROUTER_LOGITS = 3
    EXPERT_BIAS = 4
    W_GATE_UP = 5
    W_DOWN = 6
    TOPK_INDICES = 7
    TOPK_WEIGHTS = 8
    SEQUENCE_LENGTHS = 9
    TOKEN_MASK = 10
    OUTPUT = 32
    AUX_LOSS = 33
    TOKENS_PER_EXPERT = 34
    Z_LOSS = 35
    STATUS = 36
    GRAD_OUTPUT = 64
    GRAD_AUX_LOSS = 65
    GRAD_Z_LOSS = 66
    GRAD_INPUT = 96
    GRAD_ROUTER_WEIGHT = 97
    GRAD_ROUTER_LOGITS = 98
    GRAD_W_GATE_UP = 100
    GRAD_W_DOWN = 101
    GRAD_TOPK_WEIGHTS = 102


# ---- structs -----------------------------------------------------------------------------------
class Device(Structure):
    """moeblaze_device_t == DLDevice (8 bytes)."""
    _fields_ = [("device_type", c_int32), ("device_id", c_int32)]

    def __repr__(self):
        return "Device(%s, %d)" % (DeviceType.name(self.device_type), self.device_id)


class DType(Structure):
    """moeblaze_dtype_t == DLDataType (4 bytes)."""
    _fields_ = [("code", c_uint8), ("bits", c_uint8), ("lanes", c_uint16)]

    def __eq__(self, other):
        if isinstance(other, str):
            other = dtype_from_name(other)
        if not isinstance(other, DType):
            return NotImplemented
        return (self.code, self.bits, self.lanes) == (other.code, other.bits, other.lanes)

    def __hash__(self):
        return hash((self.code, self.bits, self.lanes))

    def __repr__(self):
        return "DType(%s)" % dtype_name(self)


class Tensor(Structure):
    """moeblaze_tensor_t == DLTensor (48 bytes). ``shape``/``strides`` must outlive the call."""
    _fields_ = [
        ("data", c_void_p),
        ("device", Device),
        ("ndim", c_int32),
        ("dtype", DType),
        ("shape", POINTER(c_int64)),
        ("strides", POINTER(c_int64)),
        ("byte_offset", c_uint64),
    ]

    @classmethod
    def make(cls, data, shape, dtype, device_type=DeviceType.CPU, device_id=0, strides=None,
             byte_offset=0):
        """Builds a descriptor; the shape/strides arrays are kept alive by the returned object.

        ``data`` is an integer address (or None). The caller keeps the memory alive.
        """
        where = "moeblaze.Tensor"
        shape = _checked_ints(shape, INT64, "shape", where)
        t = cls()
        t.data = None if data is None else checked_int(data, UINT64, "data address", where)
        t.device = Device(checked_int(device_type, INT32, "device_type", where),
                          checked_int(device_id, INT32, "device_id", where))
        t.ndim = checked_int(len(shape), INT32, "ndim", where)
        t.dtype = dtype_from_name(dtype) if isinstance(dtype, str) else dtype
        shp = (c_int64 * max(len(shape), 1))(*shape)
        t.shape = ctypes.cast(shp, POINTER(c_int64))
        keep = [shp]
        if strides is not None:
            strides = _checked_ints(strides, INT64, "strides", where)
            st = (c_int64 * max(len(strides), 1))(*strides)
            t.strides = ctypes.cast(st, POINTER(c_int64))
            keep.append(st)
        t.byte_offset = checked_int(byte_offset, UINT64, "byte_offset", where)
        t._keepalive = keep  # ctypes instances accept extra Python attributes
        return t

    def shape_tuple(self):
        return tuple(self.shape[i] for i in range(self.ndim))


class Arg(Structure):
    """moeblaze_arg_t (56 bytes)."""
    _fields_ = [("kind", c_int32), ("flags", c_uint32), ("tensor", Tensor)]

    def __repr__(self):
        return "Arg(%s, flags=%d, shape=%s)" % (ArgKind.name(self.kind), self.flags,
                                                self.tensor.shape_tuple())


class AttrInfo(Structure):
    """moeblaze_attr_info_t (64 bytes on LP64). ``struct_size`` must be set by the caller."""
    _fields_ = [
        ("struct_size", c_size_t),
        ("name", c_char_p),
        ("value_type", c_int32),
        ("required", c_int32),
        ("min_i64", c_int64),
        ("max_i64", c_int64),
        ("default_i64", c_int64),
        ("default_f64", c_double),
        ("since_version", c_uint32),
    ]


# ---- dtypes ------------------------------------------------------------------------------------
F32 = DType(DTypeCode.FLOAT, 32, 1)
F16 = DType(DTypeCode.FLOAT, 16, 1)
BF16 = DType(DTypeCode.BFLOAT, 16, 1)
I32 = DType(DTypeCode.INT, 32, 1)
I64 = DType(DTypeCode.INT, 64, 1)

_DTYPE_NAMES = {
    "f32": (DTypeCode.FLOAT, 32), "float32": (DTypeCode.FLOAT, 32),
    "f16": (DTypeCode.FLOAT, 16), "float16": (DTypeCode.FLOAT, 16),
    "bf16": (DTypeCode.BFLOAT, 16), "bfloat16": (DTypeCode.BFLOAT, 16),
    "f64": (DTypeCode.FLOAT, 64), "float64": (DTypeCode.FLOAT, 64),
    "i32": (DTypeCode.INT, 32), "int32": (DTypeCode.INT, 32),
    "i64": (DTypeCode.INT, 64), "int64": (DTypeCode.INT, 64),
    "u8": (DTypeCode.UINT, 8), "uint8": (DTypeCode.UINT, 8),
}


def dtype_from_name(name):
    """A fresh DType from ``"f32"``, ``"bf16"``, ``"i64"``, ... (a DType is copied)."""
    if isinstance(name, DType):
        return DType(name.code, name.bits, name.lanes)
    try:
        code, bits = _DTYPE_NAMES[name.lower()]
    except (KeyError, AttributeError):
        raise ValueError("unknown dtype %r (expected one of %s)" % (name, ", ".join(_DTYPE_NAMES)))
    return DType(code, bits, 1)


def dtype_name(dt):
    """``"f32"``, ``"bf16"``, ... or ``"code<c>_bits<b>"`` for others; never raises."""
    if isinstance(dt, str):
        dt = dtype_from_name(dt)
    short = {(DTypeCode.FLOAT, 32): "f32", (DTypeCode.FLOAT, 16): "f16",
             (DTypeCode.BFLOAT, 16): "bf16", (DTypeCode.FLOAT, 64): "f64",
             (DTypeCode.INT, 32): "i32", (DTypeCode.INT, 64): "i64", (DTypeCode.UINT, 8): "u8"}
    name = short.get((dt.code, dt.bits))
    if name is None or dt.lanes != 1:
        return "code%d_bits%d_lanes%d" % (dt.code, dt.bits, dt.lanes)
    return name


def dtype_itemsize(dt):
    """Bytes per element of a one-lane dtype."""
    if isinstance(dt, str):
        dt = dtype_from_name(dt)
    return (dt.bits * dt.lanes + 7) // 8


# Module-level C names (MOEBLAZE_STATUS_SUCCESS, MOEBLAZE_ARG_INPUT, ...), for code that
# mirrors C. They are generated from the namespaces above, so the two can never disagree.
for _ns in (Status, LogLevel, DeviceType, DTypeCode, Activation, ScoreFn, SavePolicy, Engine, EpTransport,
            ValueType, Attr, Pass, ArgKind):
    for _k, _v in _ns.members().items():
        globals()[_ns._PREFIX + _k] = _v
        __all__.append(_ns._PREFIX + _k)
MOEBLAZE_ABI_VERSION = ABI_VERSION
MOEBLAZE_ATTR_COUNT = ATTR_COUNT
MOEBLAZE_BUFFER_ALIGNMENT = BUFFER_ALIGNMENT
MOEBLAZE_ARG_FLAG_ACCUMULATE = ARG_FLAG_ACCUMULATE
__all__ += ["MOEBLAZE_ABI_VERSION", "MOEBLAZE_ATTR_COUNT", "MOEBLAZE_BUFFER_ALIGNMENT",
            "MOEBLAZE_ARG_FLAG_ACCUMULATE"]
del _ns, _k, _v
