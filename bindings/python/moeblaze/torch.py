"""PyTorch integration: a ``torch.autograd.Function`` around moeblaze_forward/backward.

Importing this module imports torch (``import moeblaze.torch`` fails with ImportError when torch
is missing; ``import moeblaze`` alone never imports torch).

* Tensors may live on CUDA or on the CPU; the handle must be created for the same device
  (:class:`MoE` creates one handle per device on first use).
* ``workspace`` and ``saved`` come from ``torch.empty(nbytes, dtype=torch.uint8)`` on the input's
  device, i.e. from PyTorch's caching allocator, which makes them stream-safe. They are
  over-allocated by 256 bytes and sliced to a 256-byte boundary (the library's alignment).
* The stream is ``torch.cuda.current_stream(device).cuda_stream``.
* Routing: from ``router_logits`` [L, E], from ``router_weight`` [E, d] (logits = x W_g^T), or
  caller routing with ``topk_indices``/``topk_weights`` as inputs.
"""
import torch

from ._core import ArgList, Config, Handle
from ._types import BUFFER_ALIGNMENT, ArgKind, Attr, DeviceType, Pass, Tensor

__all__ = ["MoEFunction", "MoE", "moe", "tensor_descriptor", "aligned_bytes"]

_DTYPES = {torch.float32: "f32", torch.float16: "f16", torch.bfloat16: "bf16",
           torch.int32: "i32", torch.int64: "i64", torch.uint8: "u8"}

ROUTE_LOGITS = 1
ROUTE_WEIGHT = 2
ROUTE_CALLER = 3


def _device(t):
    if t.device.type == "cuda":
        return DeviceType.CUDA, t.device.index if t.device.index is not None else \
            torch.cuda.current_device()
    if t.device.type == "cpu":
        return DeviceType.CPU, 0
    raise ValueError("moeblaze supports CPU and CUDA tensors, not %s" % t.device)


def tensor_descriptor(t):
    """A moeblaze Tensor over ``t`` (no copy); ``t`` must stay alive during the call."""
    if t.dtype not in _DTYPES:
        raise TypeError("unsupported dtype %s" % t.dtype)
    dev_type, dev_id = _device(t)
    desc = Tensor.make(t.data_ptr(), tuple(t.shape), _DTYPES[t.dtype], dev_type, dev_id,
                       strides=tuple(t.stride()) if t.dim() else None)
    desc._keepalive.append(t)
    return desc


def _rowmajor(t):
    """The library honours strides when the innermost stride is 1; otherwise copy."""
    if t.dim() and t.stride(-1) != 1:
        return t.contiguous()
    return t


def aligned_bytes(nbytes, device):
    """A uint8 tensor of ``nbytes`` on ``device`` starting on a 256-byte boundary (its storage
    comes from PyTorch's allocator; the returned view keeps it alive)."""
    raw = torch.empty(int(nbytes) + BUFFER_ALIGNMENT, dtype=torch.uint8, device=device)
    off = (-raw.data_ptr()) % BUFFER_ALIGNMENT
    return raw[off:off + int(nbytes)]


def _stream(device):
    if device.type == "cuda":
        return torch.cuda.current_stream(device).cuda_stream
    return None


def _routing_args(args, mode, router, topk_ids, topk_weights):
    if mode == ROUTE_LOGITS:
        args.add(ArgKind.ROUTER_LOGITS, tensor_descriptor(router))
    elif mode == ROUTE_WEIGHT:
        args.add(ArgKind.ROUTER_WEIGHT, tensor_descriptor(router))
    else:
        args.add(ArgKind.TOPK_INDICES, tensor_descriptor(topk_ids))
        args.add(ArgKind.TOPK_WEIGHTS, tensor_descriptor(topk_weights))


class MoEFunction(torch.autograd.Function):
    """``MoEFunction.apply(handle, mode, x, router, topk_ids, topk_weights, w_gate_up, w_down)``
    returns ``(y, aux_loss, z_loss, topk_indices, topk_weights_out, tokens_per_expert)``.

    ``mode`` is ROUTE_LOGITS (``router`` = logits), ROUTE_WEIGHT (``router`` = W_g) or
    ROUTE_CALLER (``topk_ids``/``topk_weights`` are inputs; the routing outputs are then empty
    and the losses zero). ``aux_loss``/``z_loss`` are differentiable F32 scalars."""

    @staticmethod
    def forward(ctx, handle, mode, x, router, topk_ids, topk_weights, w_gate_up, w_down):
        x = _rowmajor(x)
        w_gate_up, w_down = _rowmajor(w_gate_up), _rowmajor(w_down)
        router = _rowmajor(router) if router is not None else None
        if mode == ROUTE_CALLER:
            topk_ids, topk_weights = _rowmajor(topk_ids), _rowmajor(topk_weights)
        L, d = x.shape
        dev = x.device
        E, k = handle.get(Attr.NUM_EXPERTS), handle.get(Attr.TOP_K)

        args = ArgList()
        args.add(ArgKind.INPUT, tensor_descriptor(x))
        args.add(ArgKind.W_GATE_UP, tensor_descriptor(w_gate_up))
        args.add(ArgKind.W_DOWN, tensor_descriptor(w_down))
        _routing_args(args, mode, router, topk_ids, topk_weights)

        y = torch.empty((L, d), dtype=x.dtype, device=dev)
        aux = torch.zeros((), dtype=torch.float32, device=dev)
        z = torch.zeros((), dtype=torch.float32, device=dev)
        args.add(ArgKind.OUTPUT, tensor_descriptor(y))
        if mode != ROUTE_CALLER:
            # Ask for every routing output at once: no second routing pass.
            ids = torch.empty((L, k), dtype=torch.int64, device=dev)
            gates = torch.empty((L, k), dtype=torch.float32, device=dev)
            counts = torch.empty((E,), dtype=torch.int64, device=dev)
            args.add(ArgKind.TOPK_INDICES, tensor_descriptor(ids))
            args.add(ArgKind.TOPK_WEIGHTS, tensor_descriptor(gates))
            args.add(ArgKind.TOKENS_PER_EXPERT, tensor_descriptor(counts))
            args.add(ArgKind.AUX_LOSS, tensor_descriptor(aux))
            args.add(ArgKind.Z_LOSS, tensor_descriptor(z))
        else:
            ids = torch.empty((0,), dtype=torch.int64, device=dev)
            gates = torch.empty((0,), dtype=torch.float32, device=dev)
            counts = torch.empty((0,), dtype=torch.int64, device=dev)

        workspace = aligned_bytes(handle.workspace_size(Pass.FORWARD_TRAINING, L), dev)
        saved = aligned_bytes(handle.saved_size(L), dev)
        handle.forward(Pass.FORWARD_TRAINING, args, workspace.data_ptr(), saved.data_ptr(),
                       stream=_stream(dev), workspace_bytes=workspace.numel(),
                       saved_bytes=saved.numel())

        ctx.handle = handle
        ctx.mode = mode
        ctx.saved_buffer = saved  # a byte buffer, kept as an attribute (not an autograd input)
        ctx.x_dtype = x.dtype
        ctx.save_for_backward(x, router, topk_ids, topk_weights, w_gate_up, w_down)
        ctx.mark_non_differentiable(ids, gates, counts)
        if mode == ROUTE_CALLER:
            ctx.mark_non_differentiable(aux, z)
        return y, aux, z, ids, gates, counts

    @staticmethod
    def backward(ctx, dy, daux, dz, _dids, _dgates, _dcounts):
        x, router, topk_ids, topk_weights, w_gate_up, w_down = ctx.saved_tensors
        handle, mode, dev = ctx.handle, ctx.mode, x.device
        L = x.shape[0]
        need = ctx.needs_input_grad  # (handle, mode, x, router, ids, weights, w_gu, w_down)

        if dy is None:
            dy = torch.zeros_like(x)
        dy = _rowmajor(dy).to(ctx.x_dtype)
        args = ArgList()
        args.add(ArgKind.INPUT, tensor_descriptor(x))
        args.add(ArgKind.W_GATE_UP, tensor_descriptor(w_gate_up))
        args.add(ArgKind.W_DOWN, tensor_descriptor(w_down))
        _routing_args(args, mode, router, topk_ids, topk_weights)
        args.add(ArgKind.GRAD_OUTPUT, tensor_descriptor(dy))
        if mode != ROUTE_CALLER:
            # The library defaults dLoss/daux and dLoss/dz to 1 when absent: always pass them.
            daux = torch.zeros((), dtype=torch.float32, device=dev) if daux is None else \
                daux.to(torch.float32).reshape(())
            dz = torch.zeros((), dtype=torch.float32, device=dev) if dz is None else \
                dz.to(torch.float32).reshape(())
            args.add(ArgKind.GRAD_AUX_LOSS, tensor_descriptor(daux))
            args.add(ArgKind.GRAD_Z_LOSS, tensor_descriptor(dz))

        dx = drouter = dweights = dwgu = dwd = None
        if need[2]:
            dx = torch.empty_like(x)
            args.add(ArgKind.GRAD_INPUT, tensor_descriptor(dx))
        if need[3] and mode == ROUTE_LOGITS:
            drouter = torch.empty_like(router)
            args.add(ArgKind.GRAD_ROUTER_LOGITS, tensor_descriptor(drouter))
        if need[3] and mode == ROUTE_WEIGHT:
            drouter = torch.empty_like(router)
            args.add(ArgKind.GRAD_ROUTER_WEIGHT, tensor_descriptor(drouter))
        if need[5] and mode == ROUTE_CALLER:
            dweights = torch.empty_like(topk_weights)
            args.add(ArgKind.GRAD_TOPK_WEIGHTS, tensor_descriptor(dweights))
        if need[6]:
            dwgu = torch.empty_like(w_gate_up)
            args.add(ArgKind.GRAD_W_GATE_UP, tensor_descriptor(dwgu))
        if need[7]:
            dwd = torch.empty_like(w_down)
            args.add(ArgKind.GRAD_W_DOWN, tensor_descriptor(dwd))

        workspace = aligned_bytes(handle.workspace_size(Pass.BACKWARD, L), dev)
        saved = ctx.saved_buffer
        handle.backward(args, saved.data_ptr(), workspace.data_ptr(), stream=_stream(dev),
                        saved_bytes=saved.numel(), workspace_bytes=workspace.numel())
        return None, None, dx, drouter, None, dweights, dwgu, dwd


def moe(handle, x, w_gate_up, w_down, router_logits=None, router_weight=None,
        topk_indices=None, topk_weights=None):
    """Functional form; returns ``(y, aux_loss, z_loss, topk_indices, topk_weights,
    tokens_per_expert)`` (the routing outputs are empty tensors with caller routing)."""
    if router_logits is not None:
        return MoEFunction.apply(handle, ROUTE_LOGITS, x, router_logits, None, None,
                                 w_gate_up, w_down)
    if router_weight is not None:
        return MoEFunction.apply(handle, ROUTE_WEIGHT, x, router_weight, None, None,
                                 w_gate_up, w_down)
    if topk_indices is None or topk_weights is None:
        raise ValueError("give router_logits, router_weight, or topk_indices and topk_weights")
    return MoEFunction.apply(handle, ROUTE_CALLER, x, None, topk_indices, topk_weights,
                             w_gate_up, w_down)


class MoE:
    """Holds the layer configuration and one handle per device (created on first use).

    ``MoE(num_experts=8, top_k=2, hidden_size=d, ffn_hidden_size=h, max_tokens=L, ...)`` takes
    the attribute keywords of :class:`moeblaze.Config` (device_type/device_id are taken from the
    input). Calling it returns ``y``, or the full tuple of :func:`moe` with ``return_all=True``.
    """

    def __init__(self, **attrs):
        attrs.pop("device_type", None)
        attrs.pop("device_id", None)
        self._attrs = attrs
        self._handles = {}

    def handle_for(self, device):
        key = (device.type, device.index)
        h = self._handles.get(key)
        if h is None:
            with Config(**self._attrs) as cfg:
                if device.type == "cuda":
                    cfg.set(Attr.DEVICE_TYPE, DeviceType.CUDA)
                    cfg.set(Attr.DEVICE_ID, device.index if device.index is not None
                            else torch.cuda.current_device())
                else:
                    cfg.set(Attr.DEVICE_TYPE, DeviceType.CPU)
                h = Handle(cfg)
            self._handles[key] = h
        return h

    def __call__(self, x, w_gate_up, w_down, router_logits=None, router_weight=None,
                 topk_indices=None, topk_weights=None, return_all=False):
        out = moe(self.handle_for(x.device), x, w_gate_up, w_down, router_logits,
                  router_weight, topk_indices, topk_weights)
        return out if return_all else out[0]

    def close(self):
        for h in self._handles.values():
            h.close()
        self._handles.clear()
