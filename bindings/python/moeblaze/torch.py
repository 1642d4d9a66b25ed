"""PyTorch integration: the layer as ``torch.library`` operators (``moeblaze::moe_forward`` and
``moeblaze::moe_backward``, see ``_torch_ops``), the ``MoELayer`` module (``_torch_module``),
the functional :func:`moe` / :class:`MoE`, and 0.1's ``MoEFunction`` for callers that hold a
:class:`moeblaze.Handle` (now over the same operators).

Importing this module imports torch (``import moeblaze.torch`` fails with ImportError when torch
is missing; ``import moeblaze`` alone never imports torch).

* Tensors may live on CUDA or on the CPU; the handle must be created for the same device
  (:class:`MoE` creates one handle per device on first use).
* ``workspace`` and ``saved`` come from ``torch.empty(nbytes, dtype=torch.uint8)`` on the input's
  device, i.e. from PyTorch's caching allocator, which makes them stream-safe. Workspaces are
  over-allocated by 256 bytes and sliced to a 256-byte boundary (the library's alignment); the
  saved tensor is exactly the saved size, realigned through a copy only where it is not aligned.
* The stream is ``torch.cuda.current_stream(device).cuda_stream``.
* Routing: from ``router_logits`` [L, E], from ``router_weight`` [E, d] (logits = x W_g^T), or
  caller routing with ``topk_indices``/``topk_weights`` as inputs.
"""
import torch  # noqa: F401 - importing moeblaze.torch imports torch (and registers the operators)

from ._torch_module import MoELayer
from ._torch_ops import (ROUTE_CALLER, ROUTE_LOGITS, ROUTE_WEIGHT, LayerSpec,  # noqa: F401
                         aligned_bytes, call_moe_forward, moe_backward, moe_forward, tensor_descriptor)

__all__ = ["MoEFunction", "MoE", "MoELayer", "moe", "tensor_descriptor", "aligned_bytes",
           "LayerSpec", "moe_forward", "moe_backward"]


class MoEFunction:
    """The 0.1 interface, kept: ``MoEFunction.apply(handle, mode, x, router, topk_ids,
    topk_weights, w_gate_up, w_down)`` returns ``(y, aux_loss, z_loss, topk_indices,
    topk_weights_out, tokens_per_expert)`` for a caller's :class:`moeblaze.Handle`. It now runs
    the ``torch.library`` operators (through :meth:`LayerSpec.for_handle`), so it has the same
    autograd, saved-tensor and ``torch.compile`` behaviour as :class:`MoE`.

    ``mode`` is ROUTE_LOGITS (``router`` = logits), ROUTE_WEIGHT (``router`` = W_g) or
    ROUTE_CALLER (``topk_ids``/``topk_weights`` are inputs; the routing outputs are then empty
    and the losses zero)."""

    @staticmethod
    def apply(handle, mode, x, router, topk_ids, topk_weights, w_gate_up, w_down):
        spec = LayerSpec.for_handle(handle)
        return call_moe_forward(spec.id, mode, x, router, topk_ids, topk_weights, w_gate_up,
                           w_down)[:6]


def moe(layer, x, w_gate_up, w_down, router_logits=None, router_weight=None,
        topk_indices=None, topk_weights=None):
    """Functional form; returns ``(y, aux_loss, z_loss, topk_indices, topk_weights,
    tokens_per_expert)`` (the routing outputs are empty tensors with caller routing).

    ``layer`` is a :class:`LayerSpec` or, as in 0.1, a :class:`moeblaze.Handle`; either way
    the ``torch.library`` operators run (traceable by ``torch.compile`` without a graph break,
    saved buffer kept by autograd). ``x`` is [L, d]."""
    if router_logits is not None:
        mode, router = ROUTE_LOGITS, router_logits
    elif router_weight is not None:
        mode, router = ROUTE_WEIGHT, router_weight
    elif topk_indices is not None and topk_weights is not None:
        mode, router = ROUTE_CALLER, None
    else:
        raise ValueError("give router_logits, router_weight, or topk_indices and topk_weights")
    spec = layer if isinstance(layer, LayerSpec) else LayerSpec.for_handle(layer)
    return call_moe_forward(spec.id, mode, x, router, topk_indices, topk_weights, w_gate_up, w_down)[:6]


class MoE:
    """Holds the layer configuration (a :class:`LayerSpec`: one handle per device, made on first
    use) and calls the ``torch.library`` operators.

    ``MoE(num_experts=8, top_k=2, hidden_size=d, ffn_hidden_size=h, max_tokens=L, ...)`` takes
    the attribute keywords of :class:`moeblaze.Config` (device_type/device_id are taken from the
    input). ``x`` may have any leading shape ``[..., d]`` (``y`` has the same; routing tensors
    and outputs are [tokens, ...]). Calling it returns ``y``, or the full tuple of :func:`moe`
    with ``return_all=True``.
    """

    def __init__(self, **attrs):
        self.spec = LayerSpec(**attrs)

    def handle_for(self, device):
        return self.spec.handle(device)

    def __call__(self, x, w_gate_up, w_down, router_logits=None, router_weight=None,
                 topk_indices=None, topk_weights=None, return_all=False):
        lead = x.shape[:-1]
        x2 = x.reshape(-1, x.shape[-1])
        out = moe(self.spec, x2, w_gate_up, w_down, router_logits, router_weight, topk_indices,
                  topk_weights)
        y = out[0].reshape(*lead, x.shape[-1])
        return (y,) + tuple(out[1:]) if return_all else y

    def close(self):
        self.spec.close()
