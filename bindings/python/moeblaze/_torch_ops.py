"""The layer as PyTorch custom operators (``torch.library``), so ``torch.compile`` traces it
without a graph break and CUDA graphs can capture it (on a sync-free engine).

Two operators:

* ``moeblaze::moe_forward(layer, mode, x, router?, topk_ids?, topk_weights?, w_gate_up, w_down,
  expert_bias?, sequence_lengths?, token_mask?) -> (y, aux_loss, z_loss, topk_indices, topk_weights,
  tokens_per_expert, saved)``
* ``moeblaze::moe_backward(layer, mode, x, router?, topk_ids?, topk_weights?, w_gate_up, w_down,
  saved, dy, d_aux, d_z, needs, sequence_lengths?) -> (dx, d_router, d_topk_weights, d_w_gate_up,
  d_w_down)``

``layer`` is the integer id of a :class:`LayerSpec` (the configuration; a handle per device is
made on first use inside the operators, so tracing never runs library code). ``saved`` is the
library's saved buffer as a uint8 tensor output of the forward: autograd saves it like any
activation, so saved-tensor hooks (checkpointing, CPU offload) see and handle it, and it lives
exactly as long as the graph needs it. It is a plain tensor of exactly ``saved_size(L)`` bytes,
and its contents do not depend on its address: a saved-tensor hook may hand backward a copy
anywhere (a clone, a CPU round trip, another alignment). The library reads and writes it in
place when it starts on a 256-byte boundary, as the CUDA caching allocator's blocks always do;
otherwise (host memory, or a hook's shifted copy) the call goes through an aligned copy. A
backward that does not retain the graph is the buffer's last use: it runs
``moeblaze_backward_last_use``, which writes over the buffer and needs less workspace.
Workspaces are ``torch.empty`` on the current stream (PyTorch's caching allocator).
Each operator has a fake (meta) implementation for tracing and the pair is tied together with
``register_autograd``; gradients not needed come back as empty tensors internally and as None
to autograd.
"""
import struct
import threading
from array import array
import weakref
from ctypes import c_int64, sizeof
from typing import List, Optional, Tuple

import torch

from ._core import ArgList, Config, Handle
from ._types import BUFFER_ALIGNMENT, Arg, ArgKind, Attr, DeviceType, Pass, Tensor, dtype_from_name

ROUTE_LOGITS = 1
ROUTE_WEIGHT = 2
ROUTE_CALLER = 3

_DTYPES = {torch.float32: "f32", torch.float16: "f16", torch.bfloat16: "bf16",
           torch.int32: "i32", torch.int64: "i64", torch.uint8: "u8"}


class LayerSpec:
    """A layer configuration (the keyword attributes of :class:`moeblaze.Config`, without the
    device) and its handles, one per device, made on first use. Registered under an integer id
    that the operators take."""

    # Weak: a spec lives as long as its layer (or, for for_handle, its Handle) holds it; its
    # handles close with it through their own finalizers.
    _registry = weakref.WeakValueDictionary()
    _lock = threading.Lock()
    _next_id = 1

    def __init__(self, ep_group=None, **attrs):
        attrs.pop("device_type", None)
        attrs.pop("device_id", None)
        self.ep_group = ep_group  # a torch.distributed NCCL group: an expert-parallel layer
        with Config(**attrs) as cfg:  # validates the attributes now, on the caller's thread
            self.num_experts = int(cfg.get(Attr.NUM_EXPERTS))
            self.top_k = int(cfg.get(Attr.TOP_K))
            # ...and the rules between them (TOP_K <= NUM_EXPERTS, WINDOW_TOKENS <= MAX_TOKENS):
            # a CPU handle checks them as create does, instead of the first call on a device.
            cfg.set(Attr.DEVICE_TYPE, DeviceType.CPU)
            cfg.set(Attr.ENGINE, 0)  # AUTO: the device's own engine
            cfg.set(Attr.EP_SIZE, 0)
            cfg.set(Attr.EP_RANK, -1)
            Handle(cfg).close()
        self.attrs = attrs
        self._bound = None  # a caller's Handle (for_handle): used for every device
        self._handles = {}
        self._handles_lock = threading.Lock()
        self._register()

    def __reduce__(self):
        # Pickling and copy.deepcopy (EMA copies, torch.save of a module) rebuild the spec from
        # its attributes: a new id and its own handles. A spec over a caller's Handle cannot be,
        # nor one over a process group (its handles are made collectively).
        if self._bound is not None:
            raise TypeError("a LayerSpec over a caller's Handle cannot be copied or pickled")
        if self.ep_group is not None:
            raise TypeError("an expert-parallel LayerSpec cannot be copied or pickled: its handles are "
                            "made collectively over its process group")
        return (_spec_from_attrs, (dict(self.attrs),))

    @classmethod
    def for_handle(cls, handle):
        """A spec over a caller's :class:`moeblaze.Handle` (the 0.1 ``MoEFunction`` API): the
        operators use that handle, which stays the caller's to close. One spec per handle."""
        spec = getattr(handle, "_torch_layer_spec", None)
        if spec is None:
            spec = cls.__new__(cls)
            spec.num_experts = int(handle.get(Attr.NUM_EXPERTS))
            spec.top_k = int(handle.get(Attr.TOP_K))
            spec.attrs, spec._bound, spec._handles, spec.ep_group = {}, handle, {}, None
            spec._handles_lock = threading.Lock()
            spec._register()
            handle._torch_layer_spec = spec
        return spec

    def _register(self):
        with LayerSpec._lock:
            self.id = LayerSpec._next_id
            LayerSpec._next_id += 1
            LayerSpec._registry[self.id] = self

    @staticmethod
    def get(layer_id):
        spec = LayerSpec._registry.get(int(layer_id))
        if spec is None:
            raise ValueError("moeblaze: no layer with id %d (closed?)" % layer_id)
        return spec

    def handle(self, device):
        if self._bound is not None:
            return self._bound
        if device.type == "cuda":
            key = ("cuda", device.index if device.index is not None else torch.cuda.current_device())
        elif device.type in ("cpu", "meta"):
            key = ("cpu", 0)
        else:
            raise ValueError("moeblaze supports CPU and CUDA tensors, not %s" % device)
        with self._handles_lock:
            h = self._handles.get(key)
            if h is None:
                with Config(**self.attrs) as cfg:
                    if key[0] == "cuda":
                        cfg.set(Attr.DEVICE_TYPE, DeviceType.CUDA)
                        cfg.set(Attr.DEVICE_ID, key[1])
                    else:
                        cfg.set(Attr.DEVICE_TYPE, DeviceType.CPU)
                    h = self._create_ep(cfg, key) if self.ep_group is not None else Handle(cfg)
                self._handles[key] = h
            return h

    def _create_ep(self, cfg, key):
        """The expert-parallel handle on the group's NCCL communicator: collective, so made on
        the layer's first eager call (every rank makes the same calls), never while tracing or
        capturing."""
        import torch.distributed as dist
        if key[0] != "cuda":
            raise ValueError("moeblaze: an expert-parallel layer runs on CUDA tensors")
        if torch.compiler.is_compiling() or torch._guards.detect_fake_mode() is not None:
            raise RuntimeError("moeblaze: an expert-parallel layer makes its handle collectively on its "
                               "first eager call; run one eager step before torch.compile")
        if torch.cuda.is_current_stream_capturing():
            raise RuntimeError("moeblaze: an expert-parallel layer makes its handle collectively on its "
                               "first eager call; run one eager step before capturing a CUDA graph")
        group = self.ep_group
        device = torch.device("cuda", key[1])
        # The group's communicator exists once a collective ran on it.
        dist.barrier(group=group, device_ids=[key[1]])
        backend = group._get_backend(device)
        comm = backend._comm_ptr() if hasattr(backend, "_comm_ptr") else 0
        if not comm:
            raise RuntimeError("moeblaze: the expert-parallel group has no NCCL communicator (ep_group must "
                               "be an NCCL process group of this PyTorch)")
        cfg.set(Attr.EP_SIZE, group.size())
        cfg.set(Attr.EP_RANK, group.rank())
        with torch.cuda.device(device):
            stream = torch.cuda.current_stream(device)
            h = Handle.create_ep(cfg, comm, stream=stream.cuda_stream)
        h._ep_group = group  # the communicator's owner lives as long as the handle
        return h

    def close(self):
        with LayerSpec._lock:
            LayerSpec._registry.pop(self.id, None)
        if self._bound is not None:  # the caller's handle: not ours to close
            self._bound = None
            return
        with self._handles_lock:
            for h in self._handles.values():
                h.close()
            self._handles.clear()


def _spec_from_attrs(attrs):
    return LayerSpec(**attrs)


_DTYPE_STRUCTS = {t: dtype_from_name(name) for t, name in _DTYPES.items()}
_DTYPE_FIELDS = {t: (d.code, d.bits, d.lanes) for t, d in _DTYPE_STRUCTS.items()}


def tensor_descriptor(t):
    """A moeblaze Tensor over ``t`` (no copy); ``t`` must stay alive during the call. Built
    field by field: a torch tensor's address, shape and strides always fit their C types, and
    this runs for every argument of every step."""
    dtype = _DTYPE_STRUCTS.get(t.dtype)
    if dtype is None:
        raise TypeError("moeblaze: unsupported dtype %s" % t.dtype)
    dev = t.device
    if dev.type == "cuda":
        dev_type, dev_id = DeviceType.CUDA, dev.index
    elif dev.type == "cpu":
        dev_type, dev_id = DeviceType.CPU, 0
    else:
        raise ValueError("moeblaze supports CPU and CUDA tensors, not %s" % dev)
    nd = t.dim()
    desc = Tensor()
    desc.data = t.data_ptr() or None
    desc.device.device_type = dev_type
    desc.device.device_id = dev_id
    desc.ndim = nd
    desc.dtype = dtype
    shp = (c_int64 * max(nd, 1))(*t.shape)
    desc.shape = shp
    keep = [shp, t]
    if nd:
        st = (c_int64 * nd)(*t.stride())
        desc.strides = st
        keep.append(st)
    desc._keepalive = keep
    return desc


# moeblaze_arg_t as bytes (LP64, native order; asserted against the ctypes layout below): kind,
# flags, then the tensor: data, device type and id, ndim, dtype code, bits and lanes, shape and
# strides pointers, byte offset.
_ARG_FORMAT = struct.Struct("=iIQiiiBBHQQQ")
assert _ARG_FORMAT.size == sizeof(Arg) and Arg.tensor.offset == 8 and Tensor.shape.offset == 24


class TorchArgs(ArgList):
    """A call's arguments straight from torch tensors: ``add(kind, tensor)`` keeps the tensor, and
    ``to_array`` packs every moeblaze_arg_t in one pass with one int64 array for all shapes and
    strides (building a ctypes Tensor per argument took most of the binding's host time of a
    step). A moeblaze Tensor is taken as ArgList takes it. The tensors stay alive as long as
    this list, and the array's shapes as long as the last ``to_array``."""

    def __init__(self):
        super().__init__()
        self._dims = None

    def add(self, kind, tensor, flags=0):
        if isinstance(tensor, torch.Tensor):
            self._items.append((int(kind), tensor, int(flags)))
            return self
        return super().add(kind, tensor, flags)

    def to_array(self):
        items = self._items
        n = len(items)
        dims = []
        for _, t, _ in items:
            if isinstance(t, torch.Tensor):
                dims.extend(t.shape)
                dims.extend(t.stride())
                if t.dim() == 0:
                    dims.append(0)  # a 0-d tensor's shape pointer points at a slot, as tensor_descriptor's
        # array('q') converts the ints in C (a ctypes array built from them took ~8 us a call)
        ints = array("q", dims or [0])
        arr = (Arg * max(n, 1))()
        self._dims = ints  # alive until the next to_array (the call that uses arr is over by then)
        at, base = 0, ints.buffer_info()[0]
        for i, (kind, t, flags) in enumerate(items):
            if not isinstance(t, torch.Tensor):
                arr[i].kind, arr[i].flags, arr[i].tensor = kind, flags, t
                continue
            dt = _DTYPE_FIELDS.get(t.dtype)
            if dt is None:
                raise TypeError("moeblaze: unsupported dtype %s" % t.dtype)
            if t.is_cuda:
                dev_type, dev_id = int(DeviceType.CUDA), t.get_device()
            elif t.device.type == "cpu":
                dev_type, dev_id = int(DeviceType.CPU), 0
            else:
                raise ValueError("moeblaze supports CPU and CUDA tensors, not %s" % t.device)
            nd = t.dim()
            shape_at = base + 8 * at
            strides_at = shape_at + 8 * nd if nd else 0
            at += 2 * nd if nd else 1
            _ARG_FORMAT.pack_into(arr, i * _ARG_FORMAT.size, kind, flags, t.data_ptr(), dev_type, dev_id, nd,
                                  dt[0], dt[1], dt[2], shape_at, strides_at, 0)
        return arr


def _strides_accepted(shape, strides):
    """The library's stride rule (moeblaze.h, "Arguments and execution"): the innermost stride
    is 1 and every outer stride steps past the last element of the block inside it. Dimensions
    of extent 1 take any stride."""
    extent = 1
    for i in reversed(range(len(shape))):
        n, st = int(shape[i]), int(strides[i])
        if n > 1:
            if st < 0 or (i == len(shape) - 1 and st != 1) or (i < len(shape) - 1 and st < extent):
                return False
        extent += (st if n > 1 else extent) * max(n - 1, 0)
    return True


def _rowmajor(t):
    """``t`` when the library takes its strides, else a row-major copy: broadcast (stride 0)
    tensors from ``expand``, negative or overlapping strides, columns of unit stride. A
    contiguous tensor with elements always meets the rule (the common case, checked first; an
    empty one counts as contiguous whatever its strides)."""
    if t is None or (t.is_contiguous() and t.numel()):
        return t
    if t.dim() and not _strides_accepted(t.shape, t.stride()):
        if t.numel() == 0:  # contiguous() keeps an empty tensor's strides; nothing to copy
            return t.new_empty(t.shape)
        return t.contiguous()
    return t


def _weight_layout(w):
    """Expert weights as the library reads them without a copy: rows of unit stride, or each
    expert's matrix column-major (nn.Linear's [out, in] seen through ``transpose(1, 2)``);
    anything else is copied to row-major. The gradients are allocated like the result, so they
    come back in the weights' own layout."""
    if w.dim() == 3 and w.shape[-1] > 1 and w.stride(-1) != 1 and (w.shape[-2] <= 1 or w.stride(-2) == 1):
        swapped = (w.shape[0], w.shape[2], w.shape[1])
        if _strides_accepted(swapped, (w.stride(0), w.stride(2), 1)):
            return w
        return w.contiguous() if w.numel() else w.new_empty(w.shape)
    return _rowmajor(w)


def _aligned(raw, nbytes):
    """The 256-byte-aligned window of ``nbytes`` inside a uint8 tensor of nbytes + 256."""
    off = (-raw.data_ptr()) % BUFFER_ALIGNMENT
    return raw[off:off + int(nbytes)]


def _realigned(saved):
    """The saved buffer where the library can read it: ``saved`` itself when it starts on a
    256-byte boundary (always, unless a saved-tensor hook moved it), else an aligned copy."""
    if saved.is_contiguous() and saved.data_ptr() % BUFFER_ALIGNMENT == 0:
        return saved
    copy = aligned_bytes(saved.numel(), saved.device)
    copy.copy_(saved)
    return copy


def _saved_used_once():
    """Whether this backward is the saved buffer's last use: inside an autograd backward that
    does not retain the graph (as AOTAutograd decides for its own saved tensors). Then
    moeblaze_backward_last_use may write over it and needs less workspace. Outside autograd,
    or with retain_graph=True, the buffer stays readable."""
    keep = getattr(torch._C._autograd, "_get_current_graph_task_keep_graph", None)
    return keep is not None and not keep()


def _workspace(nbytes, device):
    """A call's workspace from PyTorch's allocator: the uint8 tensor of nbytes + 256 that holds
    it (the caller keeps it until the call is enqueued) and the 256-byte boundary inside it."""
    raw = torch.empty(int(nbytes) + BUFFER_ALIGNMENT, dtype=torch.uint8, device=device)
    ptr = raw.data_ptr()
    return raw, ptr + (-ptr) % BUFFER_ALIGNMENT


def aligned_bytes(nbytes, device):
    """A uint8 tensor of ``nbytes`` on ``device`` starting on a 256-byte boundary (its storage
    comes from PyTorch's allocator; the returned view keeps it alive)."""
    return _aligned(torch.empty(int(nbytes) + BUFFER_ALIGNMENT, dtype=torch.uint8, device=device),
                    nbytes)


def _stream(device):
    return torch.cuda.current_stream(device).cuda_stream if device.type == "cuda" else None


def _device_status(args, dev):
    """A CUDA call reports what it finds on the device (bad caller ids, a bad saved buffer)
    through MOEBLAZE_ARG_STATUS instead of a host sync; returns the status tensor, or None on
    the CPU (whose engine raises at once)."""
    if dev.type != "cuda":
        return None
    status = torch.empty((), dtype=torch.int32, device=dev)
    args.add(ArgKind.STATUS, status)
    return status


def _check_device_status(handle, status, pass_, dev):
    """Fails, without a host sync, when the call reported an error on the device: the library
    enqueues a device-side assertion whose text names the cause (moeblaze_assert_status), as
    torch's own indexing checks its indices. The CUDA error surfaces at the next synchronising
    call, and the process's CUDA context is then lost."""
    if status is not None:
        handle.assert_status(pass_, tensor_descriptor(status), stream=_stream(dev))


def _routing_args(args, mode, router, topk_ids, topk_weights):
    if mode == ROUTE_LOGITS:
        args.add(ArgKind.ROUTER_LOGITS, router)
    elif mode == ROUTE_WEIGHT:
        args.add(ArgKind.ROUTER_WEIGHT, router)
    else:
        args.add(ArgKind.TOPK_INDICES, topk_ids)
        args.add(ArgKind.TOPK_WEIGHTS, topk_weights)


def _check_tensors(x, real=True, **named):
    """Every tensor argument on x's device, of a dtype the library takes, x 2-D: a Python
    exception naming the argument before anything is enqueued (the library then checks shapes
    and values and names them in its message). The fake kernels check the same, less the
    device type (meta tensors are theirs)."""
    if x.dim() != 2:
        raise ValueError("moeblaze: x must be [tokens, d], not %s" % (tuple(x.shape),))
    for name, t in dict(x=x, **named).items():
        if t is None:
            continue
        if t.dtype not in _DTYPES:
            raise TypeError("moeblaze: %s has dtype %s, which the library does not take" % (name, t.dtype))
        if t.device != x.device:
            raise ValueError("moeblaze: %s is on %s but x is on %s" % (name, t.device, x.device))
        if real and t.device.type not in ("cpu", "cuda"):
            raise ValueError("moeblaze: %s is on %s; the library takes CPU and CUDA tensors" % (name, t.device))


def _check_mode(mode, router, topk_ids, topk_weights):
    if mode in (ROUTE_LOGITS, ROUTE_WEIGHT) and router is None:
        raise ValueError("moeblaze: routing mode %d needs the router tensor" % mode)
    if mode == ROUTE_CALLER and (topk_ids is None or topk_weights is None):
        raise ValueError("moeblaze: caller routing needs topk_indices and topk_weights")
    if mode not in (ROUTE_LOGITS, ROUTE_WEIGHT, ROUTE_CALLER):
        raise ValueError("moeblaze: unknown routing mode %d" % mode)


def _forward_impl(layer: int, mode: int, x: torch.Tensor, router: Optional[torch.Tensor],
                topk_ids: Optional[torch.Tensor], topk_weights: Optional[torch.Tensor],
                w_gate_up: torch.Tensor, w_down: torch.Tensor, expert_bias: Optional[torch.Tensor] = None,
                sequence_lengths: Optional[torch.Tensor] = None, token_mask: Optional[torch.Tensor] = None
                ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor,
                           torch.Tensor, torch.Tensor]:
    _check_mode(mode, router, topk_ids, topk_weights)
    _check_tensors(x, router=router, topk_ids=topk_ids, topk_weights=topk_weights,
                   w_gate_up=w_gate_up, w_down=w_down, expert_bias=expert_bias, sequence_lengths=sequence_lengths,
                   token_mask=token_mask)
    spec = LayerSpec.get(layer)
    handle = spec.handle(x.device)
    x, router, expert_bias = _rowmajor(x), _rowmajor(router), _rowmajor(expert_bias)
    w_gate_up, w_down = _weight_layout(w_gate_up), _weight_layout(w_down)
    topk_ids, topk_weights = _rowmajor(topk_ids), _rowmajor(topk_weights)
    L, d = x.shape
    dev = x.device
    E, k = spec.num_experts, spec.top_k
    args = TorchArgs()
    args.add(ArgKind.INPUT, x)
    args.add(ArgKind.W_GATE_UP, w_gate_up)
    args.add(ArgKind.W_DOWN, w_down)
    _routing_args(args, mode, router, topk_ids, topk_weights)
    if expert_bias is not None:
        args.add(ArgKind.EXPERT_BIAS, expert_bias)
    if sequence_lengths is not None:
        args.add(ArgKind.SEQUENCE_LENGTHS, _rowmajor(sequence_lengths))
    if token_mask is not None:
        args.add(ArgKind.TOKEN_MASK, _rowmajor(token_mask))
    y = torch.empty((L, d), dtype=x.dtype, device=dev)
    aux = torch.zeros((), dtype=torch.float32, device=dev)
    z = torch.zeros((), dtype=torch.float32, device=dev)
    args.add(ArgKind.OUTPUT, y)
    routed = mode != ROUTE_CALLER
    ids = torch.empty((L, k) if routed else (0,), dtype=torch.int64, device=dev)
    gates = torch.empty((L, k) if routed else (0,), dtype=torch.float32, device=dev)
    counts = torch.empty((E,) if routed else (0,), dtype=torch.int64, device=dev)
    if routed:  # every routing output at once: no second routing pass
        args.add(ArgKind.TOPK_INDICES, ids)
        args.add(ArgKind.TOPK_WEIGHTS, gates)
        args.add(ArgKind.TOKENS_PER_EXPERT, counts)
        args.add(ArgKind.AUX_LOSS, aux)
        args.add(ArgKind.Z_LOSS, z)
    saved_bytes = handle.saved_size(L)
    saved = torch.empty(saved_bytes, dtype=torch.uint8, device=dev)
    target = saved if saved.data_ptr() % BUFFER_ALIGNMENT == 0 else aligned_bytes(saved_bytes, dev)
    ws_bytes = handle.workspace_size(Pass.FORWARD_TRAINING, L)
    _ws, ws = _workspace(ws_bytes, dev)
    status = _device_status(args, dev)
    handle.forward(Pass.FORWARD_TRAINING, args, ws, target.data_ptr(), stream=_stream(dev), workspace_bytes=ws_bytes,
                   saved_bytes=saved_bytes)
    _check_device_status(handle, status, Pass.FORWARD_TRAINING, dev)
    if target is not saved:
        saved.copy_(target)
    return y, aux, z, ids, gates, counts, saved


moe_forward = torch.library.custom_op("moeblaze::moe_forward", mutates_args=())(_forward_impl)


@moe_forward.register_fake
def _moe_forward_fake(layer, mode, x, router, topk_ids, topk_weights, w_gate_up, w_down, expert_bias=None,
                      sequence_lengths=None, token_mask=None):
    _check_mode(mode, router, topk_ids, topk_weights)
    _check_tensors(x, real=False, router=router, topk_ids=topk_ids, topk_weights=topk_weights,
                   w_gate_up=w_gate_up, w_down=w_down, expert_bias=expert_bias, sequence_lengths=sequence_lengths,
                   token_mask=token_mask)
    spec = LayerSpec.get(layer)
    L, d = x.shape
    E, k = spec.num_experts, spec.top_k
    routed = mode != ROUTE_CALLER
    f32 = dict(dtype=torch.float32, device=x.device)
    i64 = dict(dtype=torch.int64, device=x.device)
    if isinstance(L, int):
        saved_len = spec.handle(x.device).saved_size(L)
    else:  # a symbolic token count: the size is the library's, known only when it runs
        saved_len = torch.library.get_ctx().new_dynamic_size()
    return (x.new_empty((L, d)), x.new_empty((), **f32), x.new_empty((), **f32),
            x.new_empty((L, k) if routed else (0,), **i64),
            x.new_empty((L, k) if routed else (0,), **f32),
            x.new_empty((E,) if routed else (0,), **i64),
            x.new_empty((saved_len,), dtype=torch.uint8))


def _backward_impl(layer: int, mode: int, x: torch.Tensor, router: Optional[torch.Tensor],
                 topk_ids: Optional[torch.Tensor], topk_weights: Optional[torch.Tensor],
                 w_gate_up: torch.Tensor, w_down: torch.Tensor, saved: torch.Tensor,
                 dy: torch.Tensor, d_aux: torch.Tensor, d_z: torch.Tensor, needs: List[bool],
                 sequence_lengths: Optional[torch.Tensor] = None
                 ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """needs = (dx, d_router, d_topk_weights, d_w_gate_up, d_w_down); a gradient not needed is
    an empty tensor."""
    _check_mode(mode, router, topk_ids, topk_weights)
    _check_tensors(x, router=router, topk_ids=topk_ids, topk_weights=topk_weights,
                   w_gate_up=w_gate_up, w_down=w_down, saved=saved, dy=dy)
    spec = LayerSpec.get(layer)
    handle = spec.handle(x.device)
    x, router = _rowmajor(x), _rowmajor(router)
    w_gate_up, w_down = _weight_layout(w_gate_up), _weight_layout(w_down)
    topk_ids, topk_weights = _rowmajor(topk_ids), _rowmajor(topk_weights)
    dy = _rowmajor(dy.to(x.dtype))
    L = x.shape[0]
    dev = x.device
    saved_bytes = handle.saved_size(L)
    if saved.dtype != torch.uint8 or saved.dim() != 1 or saved.numel() != saved_bytes:
        raise ValueError("moeblaze: saved must be the uint8 tensor of %d bytes that moe_forward "
                         "returned for %d tokens" % (saved_bytes, L))
    saved = _realigned(saved)
    args = TorchArgs()
    args.add(ArgKind.INPUT, x)
    args.add(ArgKind.W_GATE_UP, w_gate_up)
    args.add(ArgKind.W_DOWN, w_down)
    _routing_args(args, mode, router, topk_ids, topk_weights)
    args.add(ArgKind.GRAD_OUTPUT, dy)
    if sequence_lengths is not None:
        args.add(ArgKind.SEQUENCE_LENGTHS, _rowmajor(sequence_lengths))
    if mode != ROUTE_CALLER:  # the library takes absent loss gradients as 1: always pass them
        args.add(ArgKind.GRAD_AUX_LOSS, d_aux.to(torch.float32).reshape(()))
        args.add(ArgKind.GRAD_Z_LOSS, d_z.to(torch.float32).reshape(()))
    def empty():  # one per return: outputs may not alias each other
        return x.new_empty((0,))
    dx = torch.empty_like(x) if needs[0] else empty()
    d_router = torch.empty_like(router) if needs[1] and mode != ROUTE_CALLER else empty()
    d_weights = torch.empty_like(topk_weights) if needs[2] and mode == ROUTE_CALLER else empty()
    d_wgu = torch.empty_like(w_gate_up) if needs[3] else empty()
    d_wd = torch.empty_like(w_down) if needs[4] else empty()
    if needs[0]:
        args.add(ArgKind.GRAD_INPUT, dx)
    if d_router.numel():
        args.add(ArgKind.GRAD_ROUTER_LOGITS if mode == ROUTE_LOGITS else ArgKind.GRAD_ROUTER_WEIGHT, d_router)
    if d_weights.numel():
        args.add(ArgKind.GRAD_TOPK_WEIGHTS, d_weights)
    if needs[3]:
        args.add(ArgKind.GRAD_W_GATE_UP, d_wgu)
    if needs[4]:
        args.add(ArgKind.GRAD_W_DOWN, d_wd)
    last_use = _saved_used_once()
    ws_bytes = handle.workspace_size(Pass.BACKWARD_LAST_USE if last_use else Pass.BACKWARD, L)
    _ws, ws = _workspace(ws_bytes, dev)
    status = _device_status(args, dev)
    handle.backward(args, saved.data_ptr(), ws, stream=_stream(dev), saved_bytes=saved_bytes, workspace_bytes=ws_bytes,
                    last_use=last_use)
    _check_device_status(handle, status, Pass.BACKWARD, dev)
    return dx, d_router, d_weights, d_wgu, d_wd


moe_backward = torch.library.custom_op("moeblaze::moe_backward", mutates_args=())(_backward_impl)


@moe_backward.register_fake
def _moe_backward_fake(layer, mode, x, router, topk_ids, topk_weights, w_gate_up, w_down, saved,
                       dy, d_aux, d_z, needs, sequence_lengths=None):
    _check_mode(mode, router, topk_ids, topk_weights)
    _check_tensors(x, real=False, router=router, topk_ids=topk_ids, topk_weights=topk_weights,
                   w_gate_up=w_gate_up, w_down=w_down, saved=saved, dy=dy)
    def empty():
        return x.new_empty((0,))
    w_gate_up, w_down = _weight_layout(w_gate_up), _weight_layout(w_down)  # as the real kernel
    return (torch.empty_like(x) if needs[0] else empty(),
            torch.empty_like(router) if needs[1] and mode != ROUTE_CALLER else empty(),
            torch.empty_like(topk_weights) if needs[2] and mode == ROUTE_CALLER else empty(),
            torch.empty_like(w_gate_up) if needs[3] else empty(),
            torch.empty_like(w_down) if needs[4] else empty())


def _setup_context(ctx, inputs, output):
    layer, mode, x, router, topk_ids, topk_weights, w_gate_up, w_down = inputs[:8]
    ctx.sequence_lengths = inputs[9] if len(inputs) > 9 else None
    _y, _aux, _z, ids, gates, counts, saved = output
    ctx.layer, ctx.mode = layer, mode
    # The graph holds the layer's spec until backward: a temporary functional MoE(...) may be
    # gone by then, and the operators find the spec by its id in a weak registry.
    ctx.spec = LayerSpec.get(layer)
    ctx.save_for_backward(x, router, topk_ids, topk_weights, w_gate_up, w_down, saved)
    ctx.mark_non_differentiable(ids, gates, counts, saved)
    # Outputs without a gradient reach _backward as None, not as zero tensors: autograd would
    # otherwise allocate one the size of `saved` (as large as the saved activations) per backward.
    ctx.set_materialize_grads(False)


def _backward(ctx, dy, d_aux, d_z, _d_ids, _d_gates, _d_counts, _d_saved, backward_fn=None):
    x, router, topk_ids, topk_weights, w_gate_up, w_down, saved = ctx.saved_tensors
    need = ctx.needs_input_grad  # (layer, mode, x, router, ids, weights, w_gate_up, w_down)
    mode = ctx.mode
    if dy is None:
        dy = torch.zeros_like(x)
    zero = x.new_zeros((), dtype=torch.float32)
    d_aux = zero if d_aux is None else d_aux
    d_z = zero if d_z is None else d_z
    needs = [bool(need[2]), bool(need[3]) and mode != ROUTE_CALLER,
             bool(need[5]) and mode == ROUTE_CALLER, bool(need[6]), bool(need[7])]
    dx, d_router, d_weights, d_wgu, d_wd = (backward_fn or moe_backward)(
        ctx.layer, mode, x, router, topk_ids, topk_weights, w_gate_up, w_down, saved, dy, d_aux,
        d_z, needs, ctx.sequence_lengths)
    return (None, None, dx if needs[0] else None, d_router if needs[1] else None, None,
            d_weights if needs[2] else None, d_wgu if needs[3] else None,
            d_wd if needs[4] else None, None, None, None)


moe_forward.register_autograd(_backward, setup_context=_setup_context)


class _EagerMoE(torch.autograd.Function):
    """The operators' implementations, context and backward under a plain autograd Function: what
    an eager call runs. torch's custom-operator dispatch around each call cost about 0.1-0.2 ms
    of host time per pass, time the GPU waited for on small layers (perf/NOTES.md); traced calls
    (torch.compile) still go through the operators."""

    @staticmethod
    def forward(ctx, *inputs):
        output = _forward_impl(*inputs)
        _setup_context(ctx, inputs, output)
        return output

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, *grads):
        # The library's backward has no derivative of its own: a gradient taken with
        # create_graph=True raises when differentiated again, instead of silently being a
        # constant.
        return _backward(ctx, *grads, backward_fn=_backward_impl)


def call_moe_forward(layer, mode, x, router, topk_ids, topk_weights, w_gate_up, w_down, expert_bias=None,
                     sequence_lengths=None, token_mask=None):
    """``moe_forward`` with autograd, as the modules call it: the operator when traced, else the
    same implementation under :class:`_EagerMoE`; the same results either way."""
    args = (layer, mode, x, router, topk_ids, topk_weights, w_gate_up, w_down, expert_bias, sequence_lengths,
            token_mask)
    if torch.compiler.is_compiling():
        return moe_forward(*args)
    return _EagerMoE.apply(*args)
