"""MoEBlaze as a Hugging Face experts implementation (transformers 5).

transformers 5 runs the experts of its MoE models (Qwen3-MoE, Mixtral, ...) through a
pluggable function chosen by ``config._experts_implementation``. :func:`register` adds
``"moeblaze"`` to that registry; a model loaded with
``from_pretrained(..., experts_implementation="moeblaze")`` (or a config whose
``_experts_implementation`` is set to it) then runs its experts on MoEBlaze: the model's own
router picks the experts (caller routing), and the experts' ``gate_up_proj`` [E, 2h, d] and
``down_proj`` [E, d, h] are read in place through ``transpose(1, 2)`` views, with their
gradients written in place too. No weight is copied, at load time or per call.

Served: gated experts (``gate_up_proj``, gate rows first, then up), no biases, no post-expert
norm, the activation SiLU (SwiGLU) or the exact GELU (GeGLU). Anything else raises
``NotImplementedError`` naming what is missing, as does expert parallelism's sentinel routing.
"""
import torch

from ._torch_module import _DTYPE_NAMES, _gated_activation
from ._torch_ops import ROUTE_CALLER, LayerSpec, call_moe_forward

__all__ = ["register", "experts_forward", "NAME"]

NAME = "moeblaze"


def _top_k_spec(module, dtype, num_tokens, top_k, activation):
    """The module's LayerSpec for this dtype, activation and k, sized to a power of two of
    tokens: rebuilt only when a call needs more, so a few specs serve every sequence length."""
    E, two_h, d = module.gate_up_proj.shape
    key = (dtype, activation, int(top_k))
    cache = module.__dict__.setdefault("_moeblaze_specs", {})
    spec = cache.get(key)
    if spec is None or spec.max_tokens < num_tokens:
        cap = max(1 << max(int(num_tokens) - 1, 0).bit_length(), 1)
        spec = LayerSpec(num_experts=int(E), top_k=int(top_k), hidden_size=int(d),
                         ffn_hidden_size=int(two_h) // 2, max_tokens=cap, activation=activation,
                         activation_dtype=_DTYPE_NAMES[dtype], weight_dtype=_DTYPE_NAMES[dtype])
        spec.max_tokens = cap
        cache[key] = spec
    return spec


def experts_forward(self, hidden_states, top_k_index, top_k_weights):
    """The experts implementation: ``(hidden_states [T, d], top_k_index [T, k], top_k_weights
    [T, k]) -> [T, d]``, gate-weighted sum over each token's experts."""
    for flag, what in (("has_bias", "expert biases"), ("has_post_expert_norm", "a post-expert norm"),
                       ("_is_expert_parallel", "expert parallelism's sentinel routing")):
        if getattr(self, flag, False):
            raise NotImplementedError("moeblaze experts: %s is not supported" % what)
    if not getattr(self, "has_gate", True) or not hasattr(self, "gate_up_proj"):
        raise NotImplementedError("moeblaze experts: only gated experts (gate_up_proj) are supported")
    if not getattr(self, "is_concatenated", True):
        raise NotImplementedError("moeblaze experts: interleaved gate/up weights are not supported")
    activation = _gated_activation(getattr(self, "act_fn", None))
    if getattr(self, "is_transposed", False):  # [E, d, 2h] and [E, h, d]: the library's own layout
        w_gate_up, w_down = self.gate_up_proj, self.down_proj
    else:  # [E, 2h, d] and [E, d, h], read through strides
        w_gate_up, w_down = self.gate_up_proj.transpose(1, 2), self.down_proj.transpose(1, 2)
    dtype = w_gate_up.dtype
    x = hidden_states.to(dtype)
    num_tokens, top_k = top_k_index.shape
    spec = _top_k_spec(self, dtype, num_tokens, top_k, activation)
    weights = top_k_weights if top_k_weights.dtype in (torch.float32, dtype) else top_k_weights.float()
    y = call_moe_forward(spec.id, ROUTE_CALLER, x, None, top_k_index, weights, w_gate_up, w_down)[0]
    return y.to(hidden_states.dtype)


def register():
    """Adds ``"moeblaze"`` to transformers' experts implementations (idempotent). Returns the
    name to pass as ``experts_implementation``."""
    from transformers.integrations.moe import ExpertsInterface
    ExpertsInterface.register(NAME, experts_forward)
    return NAME
