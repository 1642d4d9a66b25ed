"""``MoELayer``: the layer as a ``torch.nn.Module`` that owns its parameters, and converters
from the per-expert ``nn.Linear`` layout of Hugging Face's Mixtral and Qwen3-MoE blocks and from
torchtitan's ``GroupedExperts`` (w1, w3 [E, h, d], w2 [E, d, h]).

Parameters:
  * ``router_weight`` [E, d] (logits = x W^T, as ``nn.Linear(d, E, bias=False)``);
  * ``weight_layout="in_out"`` (default, the library's layout): ``w_gate_up`` [E, d, 2h] for gated
    activations (gate columns first, then up), else [E, d, h]; ``w_down`` [E, h, d];
  * ``weight_layout="out_in"`` (nn.Linear's and Hugging Face's fused experts' layout):
    ``w_gate_up`` [E, 2h, d] (gate rows first), ``w_down`` [E, d, h]. The layer hands the library
    ``transpose(1, 2)`` views, which it reads and whose gradients it writes in place, on every
    engine: no copy per call.
Initialised as ``nn.Linear`` does (uniform in +-1/sqrt(fan_in)).

Routing options of current models (docs/routing.md; every engine):
``num_expert_groups`` and ``topk_groups`` (group-limited top-k), ``route_scale``, and
``expert_bias=True``, which adds a buffer ``expert_bias`` [E] (fp32) added to the scores for
selection only, and a buffer ``tokens_per_expert`` [E] that forward accumulates the routed
tokens into; :meth:`update_expert_bias` applies DeepSeek-V3's auxiliary-loss-free update from it.

Shared expert: ``shared_expert_hidden=hs`` (0: none) adds a dense expert of width hs that every
token goes through (DeepSeek-V2/V3, Qwen2-MoE, Llama-4), with the layer's activation:
``shared_w_gate_up`` [1, d, g hs] and ``shared_w_down`` [1, hs, d] (transposed for ``"out_in"``).
``shared_expert_gate=True`` scales its output per token by ``sigmoid(x shared_gate_weight^T)``
(``shared_gate_weight`` [1, d]), as Qwen2-MoE does. It runs on the same engine as the routed
experts, as a layer of one expert that every token picks (the gate given as its weight); under
expert parallelism it is replicated like the router. ``shared_expert_overlap=True`` runs it on a
second CUDA stream beside the routed experts (forward and, as autograd runs each backward on its
forward's stream, backward): outputs and gradients are the same bits either way; it is off under
torch.compile, whose graphs run it in line (docs/pytorch.md has the measured effect).

Expert parallelism: ``MoELayer(..., ep_group=group)`` over a torch.distributed NCCL process group
of P ranks holds this rank's experts only, ``[r E/P, (r+1) E/P)`` (``w_gate_up`` and ``w_down``
have E/P experts; the router weight is whole and replicated). ``forward(x)`` takes this rank's
tokens and is collective: every rank of the group calls it (and backward) in the same order. The
experts' gradients cover every rank's tokens routed to them (the gradient of the sum of the ranks'
losses); the router weight's gradient covers this rank's tokens, to be reduced over the group as
any replicated parameter's (docs/ep.md has the data-parallel recipe). The state_dict holds the
local experts and records their range; ``load_state_dict`` takes that or the single-GPU layout
(all E experts, of which it keeps its own), and :meth:`full_state_dict` gathers the single-GPU
layout (collective). The converters and ``load_*_experts`` take all E experts and keep this
rank's; ``store_*_experts`` write this rank's experts into their place.
"""
import math

import torch

from ._torch_ops import ROUTE_CALLER, ROUTE_WEIGHT, LayerSpec, call_moe_forward

_GATED = ("swiglu", "geglu")
_DTYPE_NAMES = {torch.float32: "f32", torch.float16: "f16", torch.bfloat16: "bf16"}
# The attributes a shared expert takes from the layer's (how it computes, not how it routes).
_SHARED_EXPERT_ATTRS = ("engine", "save_policy", "deterministic", "num_threads", "window_tokens", "window_bytes")


class _SideStream:
    """``fn(*tensors)`` enqueued on a second stream of the device, after what the current stream
    has enqueued so far; :meth:`join` makes the current stream wait for it and returns its result.
    Autograd runs the backward of what ``fn`` did on that stream too, and orders it against the
    rest of the graph itself. One side stream per device, shared by every layer: a layer's shared
    expert overlaps its own routed experts, not another layer's work."""

    _streams = {}

    def __init__(self, device, fn, *tensors):
        self.main = torch.cuda.current_stream(device)
        side = self._streams.get(device.index)
        if side is None:
            side = self._streams[device.index] = torch.cuda.Stream(device)
        side.wait_stream(self.main)
        with torch.cuda.stream(side):
            self.result = fn(*tensors)
        for t in tensors:  # made on the current stream, read on the side one
            if t is not None:
                t.record_stream(side)
        self.side = side

    def join(self):
        self.main.wait_stream(self.side)
        self.result.record_stream(self.main)
        return self.result


class _InLine:
    """A result already on the current stream (the in-line counterpart of :class:`_SideStream`)."""

    def __init__(self, result):
        self.result = result

    def join(self):
        return self.result


class MoELayer(torch.nn.Module):
    """Token-choice top-k MoE layer on libmoeblaze.

    ``MoELayer(hidden_size, ffn_hidden_size, num_experts, top_k, activation="swiglu",
    max_tokens=65536, dtype=None, device=None, **attrs)``; ``attrs`` are the other attributes
    of :class:`moeblaze.Config` (``score_function``, ``normalize_topk``, ``aux_loss_coeff``,
    ``z_loss_coeff``, ``save_policy``, ``engine``, ...). The activation and weight dtypes follow
    ``dtype`` (default: torch's default dtype). ``weight_layout`` is ``"in_out"`` or ``"out_in"``
    (module docstring). ``forward(x)`` takes ``[..., d]`` and returns ``(y, aux_loss, z_loss)``
    with ``y`` shaped like ``x``; at most ``max_tokens`` tokens a call.
    """

    def __init__(self, hidden_size, ffn_hidden_size, num_experts, top_k, activation="swiglu",
                 max_tokens=65536, dtype=None, device=None, weight_layout="in_out", ep_group=None,
                 shared_expert_hidden=0, shared_expert_gate=False, expert_bias=False,
                 balance_per_sequence=False, shared_expert_overlap=False, **attrs):
        super().__init__()
        self.shared_expert_overlap = bool(shared_expert_overlap)
        self.balance_per_sequence = bool(balance_per_sequence)
        self.shared_expert_hidden = int(shared_expert_hidden)
        self.shared_expert_gate = bool(shared_expert_gate)
        if self.shared_expert_hidden < 0:
            raise ValueError("MoELayer: shared_expert_hidden must be >= 0, not %d" % self.shared_expert_hidden)
        if self.shared_expert_gate and not self.shared_expert_hidden:
            raise ValueError("MoELayer: shared_expert_gate needs a shared expert (shared_expert_hidden > 0)")
        self.ep_group = ep_group
        self.ep_size, self.ep_rank = (ep_group.size(), ep_group.rank()) if ep_group is not None else (1, 0)
        if int(num_experts) % self.ep_size:
            raise ValueError("MoELayer: %d experts cannot be split over %d expert-parallel ranks (E must be "
                             "divisible by the group's size)" % (num_experts, self.ep_size))
        if weight_layout not in ("in_out", "out_in"):
            raise ValueError("MoELayer: weight_layout must be 'in_out' or 'out_in', not %r" % (weight_layout,))
        self.weight_layout = weight_layout
        dtype = dtype or torch.get_default_dtype()
        if dtype not in _DTYPE_NAMES:
            raise TypeError("MoELayer: dtype must be float32, float16 or bfloat16, not %s" % dtype)
        self.hidden_size, self.ffn_hidden_size = int(hidden_size), int(ffn_hidden_size)
        self.num_experts, self.top_k = int(num_experts), int(top_k)
        self.activation = str(activation).lower()
        self.max_tokens = int(max_tokens)
        self.attrs = dict(attrs)
        self._spec_dtype = None
        self._spec_for(dtype)
        self._register_state_dict_hook(MoELayer._record_layout)
        d, h = self.hidden_size, self.ffn_hidden_size
        E = self.num_local_experts = self.num_experts // self.ep_size
        self.first_expert = self.ep_rank * E
        g = 2 if self.activation in _GATED else 1
        kw = dict(dtype=dtype, device=device)
        self.router_weight = torch.nn.Parameter(torch.empty(self.num_experts, d, **kw))
        out_in = weight_layout == "out_in"
        self.w_gate_up = torch.nn.Parameter(torch.empty((E, g * h, d) if out_in else (E, d, g * h), **kw))
        self.w_down = torch.nn.Parameter(torch.empty((E, d, h) if out_in else (E, h, d), **kw))
        hs = self.shared_expert_hidden
        self.shared_w_gate_up = torch.nn.Parameter(
            torch.empty((1, g * hs, d) if out_in else (1, d, g * hs), **kw)) if hs else None
        self.shared_w_down = torch.nn.Parameter(torch.empty((1, d, hs) if out_in else (1, hs, d), **kw)) if hs else None
        self.shared_gate_weight = torch.nn.Parameter(torch.empty(1, d, **kw)) if self.shared_expert_gate else None
        # Not parameters: the bias is updated between steps from the loads (update_expert_bias).
        self.has_expert_bias = bool(expert_bias)
        if self.has_expert_bias:
            self.register_buffer("expert_bias", torch.zeros(self.num_experts, dtype=torch.float32, device=device))
            self.register_buffer("tokens_per_expert", torch.zeros(self.num_experts, dtype=torch.float32, device=device))
        self.reset_parameters()

    def _spec_for(self, dtype):
        """The layer's LayerSpec for storage dtype ``dtype`` (activations and weights): the
        spec follows the parameters through ``.to(dtype)``, ``.half()`` and autocast."""
        if dtype not in _DTYPE_NAMES:
            raise TypeError("MoELayer: the library stores float32, float16 or bfloat16, not %s" % dtype)
        if dtype != self._spec_dtype:
            self.spec = LayerSpec(num_experts=self.num_experts, top_k=self.top_k,
                                  hidden_size=self.hidden_size, ffn_hidden_size=self.ffn_hidden_size,
                                  max_tokens=self.max_tokens, activation=self.activation,
                                  activation_dtype=_DTYPE_NAMES[dtype], weight_dtype=_DTYPE_NAMES[dtype],
                                  ep_group=self.ep_group, **self.attrs)
            # The shared expert: one expert every token picks, on the same engine, never
            # expert-parallel; the routing attributes do not apply to it.
            self.shared_spec = LayerSpec(
                num_experts=1, top_k=1, hidden_size=self.hidden_size, ffn_hidden_size=self.shared_expert_hidden,
                max_tokens=self.max_tokens, activation=self.activation, activation_dtype=_DTYPE_NAMES[dtype],
                weight_dtype=_DTYPE_NAMES[dtype],
                **{k: v for k, v in self.attrs.items() if k in _SHARED_EXPERT_ATTRS}) if self.shared_expert_hidden else None
            self._spec_dtype = dtype
        return self.spec

    def expert_weights(self):
        """``(w_gate_up [E, d, g h], w_down [E, h, d])`` as the library reads them: the parameters
        themselves, or their ``transpose(1, 2)`` views (``weight_layout="out_in"``)."""
        if self.weight_layout == "out_in":
            return self.w_gate_up.transpose(1, 2), self.w_down.transpose(1, 2)
        return self.w_gate_up, self.w_down

    def shared_expert_weights(self):
        """``(shared_w_gate_up [1, d, g hs], shared_w_down [1, hs, d])`` as the library reads them
        (see :meth:`expert_weights`), or ``(None, None)`` without a shared expert."""
        if not self.shared_expert_hidden:
            return None, None
        if self.weight_layout == "out_in":
            return self.shared_w_gate_up.transpose(1, 2), self.shared_w_down.transpose(1, 2)
        return self.shared_w_gate_up, self.shared_w_down

    def reset_parameters(self):
        with torch.no_grad():
            pairs = [(self.router_weight, self.hidden_size), (self.w_gate_up, self.hidden_size),
                     (self.w_down, self.ffn_hidden_size)]
            if self.shared_expert_hidden:
                pairs += [(self.shared_w_gate_up, self.hidden_size), (self.shared_w_down, self.shared_expert_hidden)]
            if self.shared_expert_gate:
                pairs.append((self.shared_gate_weight, self.hidden_size))
            for w, fan_in in pairs:
                bound = 1.0 / math.sqrt(fan_in)
                w.uniform_(-bound, bound)

    def forward(self, x, sequence_lengths=None, token_mask=None):
        """``x`` [..., d] -> ``(y, aux_loss, z_loss)``. ``sequence_lengths`` (int tensor [B] on x's
        device, summing to the tokens) makes the balance loss DeepSeek-V3's sequence-wise form
        over those consecutive sequences; with ``balance_per_sequence=True`` a ``[batch, seq, d]``
        input gives ``[seq] * batch`` (docs/routing.md). ``token_mask`` (bool or int, x's shape
        less d, on x's device): a token whose entry is False or 0 (padding) is not
        routed, gets nothing from the routed experts and no gradient through them, and is left
        out of the losses; a shared expert still runs on it."""
        if x.shape[-1] != self.hidden_size:
            raise ValueError("MoELayer: x has %d features, the layer %d" % (x.shape[-1], self.hidden_size))
        lead = x.shape[:-1]
        if sequence_lengths is None and self.balance_per_sequence and x.dim() >= 3:
            sequence_lengths = torch.full((math.prod(lead[:-1]),), lead[-1], dtype=torch.int64, device=x.device)
        x2 = x.reshape(-1, self.hidden_size)
        w_gate_up, w_down = self.expert_weights()
        s_gate_up, s_down = self.shared_expert_weights()
        router, s_gate = self.router_weight, self.shared_gate_weight
        dtype = w_gate_up.dtype
        if torch.is_autocast_enabled(x.device.type):
            # As autocast treats a linear layer: inputs and weights cast to the autocast dtype
            # (the casts are differentiable; the parameters keep their own dtype).
            dtype = torch.get_autocast_dtype(x.device.type)
            x2, router = x2.to(dtype), router.to(dtype)
            w_gate_up, w_down = w_gate_up.to(dtype), w_down.to(dtype)
            if self.shared_expert_hidden:
                s_gate_up, s_down = s_gate_up.to(dtype), s_down.to(dtype)
                s_gate = s_gate.to(dtype) if s_gate is not None else None
        elif x.dtype != dtype:
            raise TypeError("MoELayer: x is %s but the layer's parameters are %s; convert one "
                            "(layer.to(%s) or x.to(%s)), or run under torch.autocast"
                            % (x.dtype, dtype, x.dtype, dtype))
        spec = self._spec_for(dtype)
        if self.ep_group is not None and not torch.compiler.is_compiling():
            spec.handle(x.device)  # made collectively here, on the first eager call
        bias = self.expert_bias if self.has_expert_bias else None
        if token_mask is not None:
            if tuple(token_mask.shape) != tuple(lead):
                raise ValueError("MoELayer: token_mask has shape %s; x has %s tokens"
                                 % (tuple(token_mask.shape), tuple(lead)))
            token_mask = token_mask.reshape(-1)
            if token_mask.dtype not in (torch.int32, torch.int64):
                token_mask = token_mask.to(torch.int32)
        # The shared expert is enqueued before the routed experts either way: the autograd graph
        # (and so the order in which x's gradient terms are summed) is the same with the
        # overlap on or off, and so are the bits.
        shared = None
        if self.shared_expert_hidden:
            if self.shared_expert_overlap and x2.is_cuda and not torch.compiler.is_compiling():
                shared = _SideStream(x2.device, self._shared_expert, x2, s_gate_up, s_down, s_gate)
            else:
                shared = _InLine(self._shared_expert(x2, s_gate_up, s_down, s_gate))
        y, aux, z, _ids, _gates, counts = call_moe_forward(spec.id, ROUTE_WEIGHT, x2, router, None, None,
                                                           w_gate_up, w_down, bias, sequence_lengths, token_mask)[:6]
        if self.has_expert_bias:
            with torch.no_grad():
                self.tokens_per_expert.add_(counts)
        if shared is not None:
            y = y + shared.join()
        return y.reshape(*lead, self.hidden_size), aux, z

    @torch.no_grad()
    def update_expert_bias(self, rate=1e-3, group=None):
        """DeepSeek-V3's auxiliary-loss-free balancing step, between optimizer steps: with n_e
        the tokens routed to expert e since the last update (``tokens_per_expert``, summed over
        ``group`` when given, e.g. the data-parallel group), ``expert_bias += rate *
        sign(mean(n) - n)``, centred to keep its mean (as torchtitan does); then the counts
        restart from zero. Returns the counts used."""
        if not self.has_expert_bias:
            raise ValueError("MoELayer: this layer has no expert bias (expert_bias=False)")
        counts = self.tokens_per_expert.clone()
        if group is not None:
            import torch.distributed as dist
            dist.all_reduce(counts, group=group)
        delta = rate * torch.sign(counts.mean() - counts)
        self.expert_bias.add_(delta - delta.mean())
        self.tokens_per_expert.zero_()
        return counts

    def _shared_expert(self, x2, w_gate_up, w_down, gate_weight):
        """The shared expert's output: the one-expert layer with every token routed to it, its
        gate 1 or sigmoid(x W_gate^T) (fp32, given to the library as the routing weight, so its
        gradient comes back as d TOPK_WEIGHTS)."""
        L = x2.shape[0]
        ids = torch.zeros((L, 1), dtype=torch.int32, device=x2.device)
        if gate_weight is not None:
            gates = torch.sigmoid(torch.nn.functional.linear(x2, gate_weight).float())
        else:
            gates = torch.ones((L, 1), dtype=torch.float32, device=x2.device)
        return call_moe_forward(self.shared_spec.id, ROUTE_CALLER, x2, None, ids, gates, w_gate_up, w_down)[0]

    # ---- the weight layout in the state_dict -------------------------------------------------
    # The state_dict records the layout in its metadata (state_dict._metadata, which torch.save
    # keeps), not as a key: a state_dict of this layer still loads strictly into a module with
    # the same parameters and no such record (a pure-PyTorch reference MoE, say). Loading
    # converts a checkpoint of the other layout (the expert matrices transposed); a checkpoint
    # without the record (older versions, formats that drop metadata) is taken to be in this
    # layer's layout.
    _LAYOUT_KEY = "moeblaze_weight_layout"

    _EXPERTS_KEY = "moeblaze_experts"  # (first expert, experts held, all experts)

    def _record_layout(self, state_dict, prefix, local_metadata):
        local_metadata[self._LAYOUT_KEY] = self.weight_layout
        local_metadata[self._EXPERTS_KEY] = (self.first_expert, self.num_local_experts, self.num_experts)

    def expert_parameters(self):
        """The parameters that hold experts (``w_gate_up``, ``w_down``): under expert
        parallelism, this rank's own, not replicated over the group."""
        return [self.w_gate_up, self.w_down]

    @torch.no_grad()
    def full_state_dict(self):
        """The state_dict in the single-GPU layout (all E experts): on an expert-parallel layer
        the experts are gathered over the group (collective); otherwise ``state_dict()``."""
        sd = self.state_dict()
        if self.ep_group is None:
            return sd
        import torch.distributed as dist
        for name in ("w_gate_up", "w_down"):
            local = getattr(self, name).detach().contiguous()
            parts = [torch.empty_like(local) for _ in range(self.ep_size)]
            dist.all_gather(parts, local, group=self.ep_group)
            sd[name] = torch.cat(parts, 0)
        sd._metadata[""][self._EXPERTS_KEY] = (0, self.num_experts, self.num_experts)
        return sd

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys,
                              unexpected_keys, error_msgs):
        layout = local_metadata.get(self._LAYOUT_KEY) if local_metadata else None
        if layout is not None and layout not in ("in_out", "out_in"):
            error_msgs.append("%s: unknown weight layout record %r" % (prefix or "MoELayer", layout))
            return
        if layout is not None and layout != self.weight_layout:
            for name in ("w_gate_up", "w_down", "shared_w_gate_up", "shared_w_down"):
                if prefix + name in state_dict:
                    state_dict[prefix + name] = state_dict[prefix + name].transpose(1, 2)
        # The experts: all E (the single-GPU layout: this rank keeps its own), or exactly the ones
        # this layer holds.
        held = local_metadata.get(self._EXPERTS_KEY) if local_metadata else None
        mine = (self.first_expert, self.num_local_experts, self.num_experts)
        for name in ("w_gate_up", "w_down"):
            w = state_dict.get(prefix + name)
            if w is None or w.dim() != 3:
                continue
            if w.shape[0] == self.num_experts and self.ep_size > 1:
                state_dict[prefix + name] = w[self.first_expert:self.first_expert + self.num_local_experts]
            elif held is not None and tuple(held) != mine and w.shape[0] == self.num_local_experts:
                error_msgs.append("%s%s holds experts [%d, %d) of %d; this layer holds [%d, %d) of %d" % (
                    prefix, name, held[0], held[0] + held[1], held[2], mine[0], mine[0] + mine[1], mine[2]))
                return
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys,
                                      unexpected_keys, error_msgs)

    def extra_repr(self):
        ep = ", ep_size=%d, ep_rank=%d" % (self.ep_size, self.ep_rank) if self.ep_group is not None else ""
        if self.shared_expert_hidden:
            ep += ", shared_expert_hidden=%d%s" % (self.shared_expert_hidden,
                                                   ", shared_expert_gate=True" if self.shared_expert_gate else "")
        return "hidden_size=%d, ffn_hidden_size=%d, num_experts=%d, top_k=%d, activation=%s, weight_layout=%s%s" % (
            self.hidden_size, self.ffn_hidden_size, self.num_experts, self.top_k, self.activation,
            self.weight_layout, ep)

    def close(self):
        """Releases the layer's library handles now; on an expert-parallel layer, collective
        (every rank, before the process group is destroyed). The layer makes new ones if it is
        called again."""
        for name in ("spec", "shared_spec"):
            spec = self.__dict__.get(name)
            if spec is not None:
                spec.close()
        self._spec_dtype = None

    def _local(self, experts):
        """The part of an all-E sequence or tensor that this layer holds (all of it without
        expert parallelism)."""
        if len(experts) != self.num_experts:
            raise ValueError("%d experts given, the layer has %d" % (len(experts), self.num_experts))
        return experts[self.first_expert:self.first_expert + self.num_local_experts]

    # ---- Hugging Face per-expert nn.Linear layouts ------------------------------------------------

    @torch.no_grad()
    def load_linear_experts(self, router, experts, gate="gate_proj", up="up_proj", down="down_proj"):
        """Copies a router ``nn.Linear(d, E)`` and E expert modules whose ``gate``/``up``
        (``nn.Linear(d, h)``) and ``down`` (``nn.Linear(h, d)``) weights are stored
        [out, in], into this layer's parameters (one copy, at load time)."""
        wgu, wd = self.expert_weights()  # [E, d, g h] and [E, h, d] views
        h = self.ffn_hidden_size
        self.router_weight.copy_(router.weight)
        for e, ex in enumerate(self._local(experts)):
            wgu[e, :, :h].copy_(getattr(ex, gate).weight.t())
            if self.activation in _GATED:
                wgu[e, :, h:].copy_(getattr(ex, up).weight.t())
            wd[e].copy_(getattr(ex, down).weight.t())
        return self

    @torch.no_grad()
    def store_linear_experts(self, router, experts, gate="gate_proj", up="up_proj", down="down_proj"):
        """The inverse of :meth:`load_linear_experts`: writes this layer's weights back."""
        wgu, wd = self.expert_weights()  # [E, d, g h] and [E, h, d] views
        h = self.ffn_hidden_size
        router.weight.copy_(self.router_weight)
        for e, ex in enumerate(self._local(experts)):
            getattr(ex, gate).weight.copy_(wgu[e, :, :h].t())
            if self.activation in _GATED:
                getattr(ex, up).weight.copy_(wgu[e, :, h:].t())
            getattr(ex, down).weight.copy_(wd[e].t())

    @torch.no_grad()
    def load_fused_experts(self, router_weight, gate_up_proj, down_proj):
        """Copies Hugging Face's fused expert tensors (transformers 5): ``gate_up_proj``
        [E, 2h, d] (gate rows, then up rows) and ``down_proj`` [E, d, h], and a router weight
        [E, d] (one copy, at load time)."""
        wgu, wd = self.expert_weights()  # [E, d, g h] and [E, h, d] views
        self.router_weight.copy_(router_weight)
        wgu.copy_(self._local(gate_up_proj).transpose(1, 2))
        wd.copy_(self._local(down_proj).transpose(1, 2))
        return self

    @torch.no_grad()
    def store_fused_experts(self, router_weight, gate_up_proj, down_proj):
        """The inverse of :meth:`load_fused_experts`."""
        wgu, wd = self.expert_weights()  # [E, d, g h] and [E, h, d] views
        router_weight.copy_(self.router_weight)
        self._local(gate_up_proj).copy_(wgu.transpose(1, 2))
        self._local(down_proj).copy_(wd.transpose(1, 2))

    @classmethod
    def from_qwen3_moe(cls, block, max_tokens=65536, **attrs):
        """From a Qwen3-MoE sparse block: ``block.gate`` (the router: a weight [E, d]) and
        ``block.experts``, either per-expert modules with ``gate_proj``/``up_proj``/
        ``down_proj`` or the fused ``gate_up_proj``/``down_proj`` tensors. Routing as Qwen3-MoE:
        softmax, top-k, renormalised when ``norm_topk_prob`` (default True); the balance loss in
        transformers' form (``aux_loss_form="hugging_face"``), so ``aux_loss_coeff`` takes the
        model's ``router_aux_loss_coef`` as it is."""
        attrs.setdefault("aux_loss_form", "hugging_face")
        return cls._from_hf_block(block, ("gate_proj", "up_proj", "down_proj"),
                                  bool(_find(block, "norm_topk_prob", True)), max_tokens, attrs)

    @classmethod
    def from_qwen2_moe(cls, block, max_tokens=65536, **attrs):
        """From a Qwen2-MoE sparse block: the routed experts as :meth:`from_qwen3_moe` (softmax,
        top-k, renormalised when ``norm_topk_prob``, Qwen2-MoE's default being False), and
        ``block.shared_expert`` (``gate_proj``/``up_proj``/``down_proj``) scaled by the sigmoid
        of ``block.shared_expert_gate`` as the layer's shared expert; the balance loss in
        transformers' form, as :meth:`from_qwen3_moe`."""
        attrs.setdefault("aux_loss_form", "hugging_face")
        mlp = block.shared_expert
        gate = getattr(block, "shared_expert_gate", None)
        attrs.setdefault("shared_expert_hidden", int(mlp.gate_proj.weight.shape[0]))
        attrs.setdefault("shared_expert_gate", gate is not None)
        layer = cls._from_hf_block(block, ("gate_proj", "up_proj", "down_proj"),
                                   bool(_find(block, "norm_topk_prob", False)), max_tokens, attrs)
        return layer.load_shared_expert(mlp, gate)

    @torch.no_grad()
    def load_shared_expert(self, mlp, gate=None, names=("gate_proj", "up_proj", "down_proj")):
        """Copies a dense gated MLP (``nn.Linear`` ``gate``/``up`` [hs, d], ``down`` [d, hs]) into
        the shared expert, and its gate ``nn.Linear(d, 1)`` when given (one copy, at load time)."""
        if not self.shared_expert_hidden:
            raise ValueError("MoELayer: this layer has no shared expert (shared_expert_hidden = 0)")
        wgu, wd = self.shared_expert_weights()  # [1, d, g hs] and [1, hs, d] views
        hs = self.shared_expert_hidden
        wgu[0, :, :hs].copy_(getattr(mlp, names[0]).weight.t())
        if self.activation in _GATED:
            wgu[0, :, hs:].copy_(getattr(mlp, names[1]).weight.t())
        wd[0].copy_(getattr(mlp, names[2]).weight.t())
        if gate is not None:
            if not self.shared_expert_gate:
                raise ValueError("MoELayer: a shared expert gate was given but the layer has none "
                                 "(shared_expert_gate=False)")
            self.shared_gate_weight.copy_(gate.weight)
        return self

    @classmethod
    def from_deepseek_v3(cls, block, max_tokens=65536, **attrs):
        """From a DeepSeek-V3 MoE block (transformers' ``DeepseekV3MoE``): the router
        ``block.gate`` (sigmoid scores, ``e_score_correction_bias`` as the expert bias,
        ``n_group``/``topk_group`` as group-limited routing, ``routed_scaling_factor`` as the
        route scale, ``norm_topk_prob``), the fused experts, and ``block.shared_experts`` as the
        shared expert."""
        gate = block.gate
        attrs.setdefault("score_function", "sigmoid")
        attrs.setdefault("num_expert_groups", int(getattr(gate, "num_group", getattr(gate, "n_group", 1))))
        attrs.setdefault("topk_groups", int(getattr(gate, "topk_group", 0)))
        attrs.setdefault("route_scale", float(getattr(gate, "routed_scaling_factor", 1.0)))
        bias = getattr(gate, "e_score_correction_bias", None)
        attrs.setdefault("expert_bias", bias is not None)
        shared = getattr(block, "shared_experts", None)
        if shared is not None:
            attrs.setdefault("shared_expert_hidden", int(shared.gate_proj.weight.shape[0]))
        layer = cls._from_hf_block(block, ("gate_proj", "up_proj", "down_proj"),
                                   bool(_find(block, "norm_topk_prob", True)), max_tokens, attrs)
        if bias is not None and layer.has_expert_bias:
            with torch.no_grad():
                layer.expert_bias.copy_(bias)
        if shared is not None:
            layer.load_shared_expert(shared)
        return layer

    @classmethod
    def from_mixtral(cls, block, max_tokens=65536, **attrs):
        """From a Mixtral sparse block: ``block.gate`` and ``block.experts``, per-expert ``w1``
        (gate), ``w3`` (up), ``w2`` (down) or the fused tensors. Routing as Mixtral: softmax,
        top-k, renormalised; the balance loss in transformers' form, as :meth:`from_qwen3_moe`."""
        attrs.setdefault("aux_loss_form", "hugging_face")
        return cls._from_hf_block(block, ("w1", "w3", "w2"), True, max_tokens, attrs)

    @classmethod
    def _from_hf_block(cls, block, names, renormalise, max_tokens, attrs):
        experts = block.experts
        fused = hasattr(experts, "gate_up_proj")
        act_fn = getattr(experts, "act_fn", None) if fused else getattr(experts[0], "act_fn", None)
        activation = attrs.pop("activation", None) or _gated_activation(act_fn)
        if fused:
            E, two_h, d = experts.gate_up_proj.shape
            h, w = two_h // 2, experts.gate_up_proj
        else:
            w = getattr(experts[0], names[0]).weight
            (h, d), E = w.shape, len(experts)
        top_k = int(_find(block, ("top_k", "num_experts_per_tok"), 2))
        attrs.setdefault("normalize_topk", 1 if renormalise else 0)
        attrs.setdefault("score_function", "softmax")
        layer = cls(hidden_size=d, ffn_hidden_size=h, num_experts=E, top_k=top_k,
                    activation=activation, max_tokens=max_tokens, dtype=w.dtype, device=w.device,
                    **attrs)
        if fused:
            return layer.load_fused_experts(block.gate.weight, experts.gate_up_proj, experts.down_proj)
        return layer.load_linear_experts(block.gate, experts, *names)

    # ---- torchtitan's GroupedExperts ------------------------------------------------------------

    @torch.no_grad()
    def load_grouped_experts(self, router, w1, w2, w3):
        """Copies a router ``nn.Linear(d, E)`` and torchtitan-style stacked expert weights:
        ``w1`` (gate) and ``w3`` (up) [E, h, d], ``w2`` (down) [E, d, h] (one copy, at load time)."""
        wgu, wd = self.expert_weights()  # [E, d, g h] and [E, h, d] views
        h = self.ffn_hidden_size
        self.router_weight.copy_(router.weight)
        w1, w2, w3 = self._local(w1), self._local(w2), self._local(w3)
        wgu[:, :, :h].copy_(w1.transpose(1, 2))
        wgu[:, :, h:].copy_(w3.transpose(1, 2))
        wd.copy_(w2.transpose(1, 2))
        return self

    @torch.no_grad()
    def store_grouped_experts(self, router, w1, w2, w3):
        """The inverse of :meth:`load_grouped_experts`."""
        wgu, wd = self.expert_weights()  # [E, d, g h] and [E, h, d] views
        h = self.ffn_hidden_size
        router.weight.copy_(self.router_weight)
        w1, w2, w3 = self._local(w1), self._local(w2), self._local(w3)
        w1.copy_(wgu[:, :, :h].transpose(1, 2))
        w3.copy_(wgu[:, :, h:].transpose(1, 2))
        w2.copy_(wd.transpose(1, 2))

    @classmethod
    def from_torchtitan(cls, moe, max_tokens=65536, **attrs):
        """From torchtitan's ``MoE``: ``moe.router`` (``gate``, ``top_k``, ``score_func``,
        ``route_norm``, ``route_scale``) and the stacked experts, in either layout:
        ``moe.routed_experts.inner_experts`` with ``w1_EFD``, ``w2_EDF``, ``w3_EFD``
        (torchtitan 0.3) or ``moe.experts`` with ``w1``, ``w2``, ``w3`` (earlier releases).
        Routing follows the router: softmax or sigmoid, renormalised when ``route_norm``, scaled
        by ``route_scale``, group-limited when ``num_expert_groups`` is set (``num_limited_groups``
        groups kept: the same rule as this library's), and a non-zero expert bias
        (``expert_bias_E`` or ``expert_bias``) as the layer's ``expert_bias``. A zero bias (a
        fresh model) is taken only with ``expert_bias=True``.

        Refused, with the reason (ValueError): ``score_before_experts`` (torchtitan then
        multiplies the expert's input by the gate; this layer multiplies its output, which
        differs for a gated MLP). Shared experts are not converted: keep
        ``moe.shared_experts`` and add its output, or make the layer with
        ``shared_expert_hidden`` and copy them with ``load_shared_expert(moe.shared_experts,
        names=("w1", "w3", "w2"))``."""
        r = moe.router
        ex = getattr(moe, "experts", None)
        if ex is None and hasattr(moe, "routed_experts"):
            ex = moe.routed_experts.inner_experts
        if ex is None:
            raise ValueError("from_torchtitan: %s has neither routed_experts.inner_experts nor "
                             "experts" % type(moe).__name__)
        if hasattr(ex, "w1_EFD"):
            w1, w2, w3 = ex.w1_EFD, ex.w2_EDF, ex.w3_EFD
        else:
            w1, w2, w3 = ex.w1, ex.w2, ex.w3
        if getattr(moe, "score_before_experts", False):
            raise ValueError("from_torchtitan: score_before_experts=True scales the experts' input; "
                             "this layer scales their output (set it to False)")
        if float(getattr(r, "route_scale", 1.0)) != 1.0:
            attrs.setdefault("route_scale", float(r.route_scale))
        if getattr(r, "num_expert_groups", None) is not None:
            attrs.setdefault("num_expert_groups", int(r.num_expert_groups))
            attrs.setdefault("topk_groups", int(r.num_limited_groups))
        bias = next((b for b in (getattr(moe, n, None) for n in ("expert_bias_E", "expert_bias")) if b is not None),
                    None)
        attrs.setdefault("expert_bias", bias is not None and bool((bias != 0).any()))
        attrs.setdefault("score_function", str(r.score_func))
        attrs.setdefault("normalize_topk", 1 if r.route_norm else 0)
        E, h, d = w1.shape
        layer = cls(hidden_size=d, ffn_hidden_size=h, num_experts=E, top_k=int(r.top_k),
                    activation="swiglu", max_tokens=max_tokens, dtype=w1.dtype,
                    device=w1.device, **attrs)
        if layer.has_expert_bias and bias is not None:
            with torch.no_grad():
                layer.expert_bias.copy_(bias)
        return layer.load_grouped_experts(r.gate, w1, w2, w3)


def _gated_activation(act_fn):
    """The library's gated activation for a Hugging Face expert's ``act_fn`` (built from the
    config's ``hidden_act``): SwiGLU for SiLU, GeGLU for the exact (erf) GELU. Anything else
    is refused, named, rather than built as another activation. No act_fn: SwiGLU."""
    if act_fn is None:
        return "swiglu"
    name = type(act_fn).__name__
    if isinstance(act_fn, torch.nn.SiLU) or name == "SiLUActivation":
        return "swiglu"
    if isinstance(act_fn, torch.nn.GELU) and act_fn.approximate == "none":
        return "geglu"
    if name == "GELUActivation" and getattr(act_fn, "act", None) is not None and \
            getattr(act_fn.act, "__name__", "") in ("gelu", "_gelu_python"):
        return "geglu"
    raise ValueError("MoELayer: the experts' activation %s (their config's hidden_act) is not one "
                     "the library computes: it has SwiGLU (hidden_act 'silu') and GeGLU with the "
                     "exact GELU (hidden_act 'gelu'); pass activation= to override" % name)


def _find(block, names, default):
    """The first of ``names`` found on the block or on its router (``block.gate``)."""
    for owner in (block, getattr(block, "gate", None)):
        for n in (names,) if isinstance(names, str) else names:
            if owner is not None and hasattr(owner, n):
                return getattr(owner, n)
    return default
