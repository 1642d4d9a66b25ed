"""A convenience MoE layer for host (CPU engine) use with plain Python buffers.

Example (f32, routing from logits)::

    from array import array
    import moeblaze
    with moeblaze.Layer(num_experts=4, top_k=2, hidden_size=8, ffn_hidden_size=12,
                        max_tokens=16) as layer:
        fwd = layer.forward(x, w_gate_up, w_down, router_logits=logits)
        grads = layer.backward(fwd, dy)
        grads.dx, grads.dw_gate_up, grads.dw_down, grads.drouter_logits

Buffers are anything with the buffer protocol (``array('f')``, ``bytearray``, ``memoryview``,
ctypes arrays) or :class:`~moeblaze.AlignedBuffer`. Outputs are allocated as ``array('f')`` for
f32, ``array('H')`` (raw bits) for f16/bf16 and ``array('q')`` for int64 ids and counts, unless
the caller passes its own. Workspace and saved buffers come from the size queries and are
256-byte aligned. The Layer defaults to ``device_type="cpu"`` and f32 activations/weights
(the library's own defaults are CUDA and bf16).
"""
from array import array

from ._core import AlignedBuffer, ArgList, Config, Handle, host_tensor
from ._types import ARG_FLAG_ACCUMULATE, Activation, ArgKind, Attr, Pass, Status, dtype_itemsize, \
    dtype_name
from .errors import BindingError

__all__ = ["Layer", "ForwardResult", "Gradients"]


def _alloc(dtype, n):
    name = dtype_name(dtype)
    if name == "f32":
        return array("f", bytes(4 * n))
    if name == "f64":
        return array("d", bytes(8 * n))
    if name in ("f16", "bf16"):
        return array("H", bytes(2 * n))
    if name == "i32":
        return array("i", bytes(4 * n))
    if name == "i64":
        return array("q", bytes(8 * n))
    raise BindingError(Status.NOT_SUPPORTED, "moeblaze.Layer", "cannot allocate %s" % name)


class ForwardResult:
    """What forward returns: outputs, and what backward needs (saved buffer, routing inputs)."""

    def __init__(self):
        self.y = None
        self.topk_indices = None
        self.topk_weights = None
        self.tokens_per_expert = None
        self.aux_loss = None
        self.z_loss = None
        self.saved = None
        self.num_tokens = 0
        self._inputs = None  # ArgList of the inputs (x, weights, routing), reused by backward


class Gradients:
    """Gradients returned by backward; those not requested are None."""

    def __init__(self):
        self.dx = None
        self.dw_gate_up = None
        self.dw_down = None
        self.drouter_logits = None
        self.drouter_weight = None
        self.dtopk_weights = None


class Layer:
    """One MoE layer on the CPU engine, called with host buffers."""

    def __init__(self, config=None, **attrs):
        if config is None:
            attrs.setdefault("device_type", "cpu")
            attrs.setdefault("activation_dtype", "f32")
            attrs.setdefault("weight_dtype", "f32")
            with Config(**attrs) as cfg:
                self.handle = Handle(cfg)
        else:
            self.handle = Handle(config)
        h = self.handle
        self.num_experts = h.get(Attr.NUM_EXPERTS)
        self.top_k = h.get(Attr.TOP_K)
        self.hidden_size = h.get(Attr.HIDDEN_SIZE)
        self.ffn_hidden_size = h.get(Attr.FFN_HIDDEN_SIZE)
        self.max_tokens = h.get(Attr.MAX_TOKENS)
        self.activation = h.get(Attr.ACTIVATION)
        self.gate_factor = 2 if self.activation in (Activation.SWIGLU, Activation.GEGLU) else 1
        self.activation_dtype = h.get(Attr.ACTIVATION_DTYPE)
        self.weight_dtype = h.get(Attr.WEIGHT_DTYPE)

    # -- lifetime --
    def close(self):
        self.handle.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
        return False

    # -- helpers --
    def _shapes(self, L):
        E, k, d, h, g = (self.num_experts, self.top_k, self.hidden_size, self.ffn_hidden_size,
                         self.gate_factor)
        return {
            ArgKind.INPUT: (L, d), ArgKind.ROUTER_WEIGHT: (E, d), ArgKind.ROUTER_LOGITS: (L, E),
            ArgKind.W_GATE_UP: (E, d, g * h), ArgKind.W_DOWN: (E, h, d),
            ArgKind.TOPK_INDICES: (L, k), ArgKind.TOPK_WEIGHTS: (L, k), ArgKind.OUTPUT: (L, d),
            ArgKind.TOKENS_PER_EXPERT: (E,), ArgKind.GRAD_OUTPUT: (L, d),
        }

    def _num_tokens(self, x, num_tokens):
        if num_tokens is not None:
            return int(num_tokens)
        nbytes = memoryview(x).nbytes if not isinstance(x, AlignedBuffer) else x.nbytes
        row = self.hidden_size * dtype_itemsize(self.activation_dtype)
        if nbytes % row:
            raise BindingError(Status.INVALID_ARGUMENT, "moeblaze.Layer.forward",
                               "x has %d bytes, not a multiple of a row (%d)" % (nbytes, row))
        return nbytes // row

    # -- forward --
    def forward(self, x, w_gate_up, w_down, router_logits=None, router_weight=None,
                topk_indices=None, topk_weights=None, *, training=True, num_tokens=None,
                y=None, want_routing=True, aux_loss=False, z_loss=False):
        """Runs the layer. Routing: ``router_logits`` [L, E], else ``router_weight`` [E, d],
        else caller routing with ``topk_indices``/``topk_weights`` as inputs. With
        ``want_routing`` the top-k ids/weights and per-expert counts are returned too."""
        L = self._num_tokens(x, num_tokens)
        shp = self._shapes(L)
        act, wdt = self.activation_dtype, self.weight_dtype
        res = ForwardResult()
        res.num_tokens = L

        inputs = ArgList()
        inputs.add(ArgKind.INPUT, host_tensor(x, shp[ArgKind.INPUT], default_dtype=act))
        inputs.add(ArgKind.W_GATE_UP, host_tensor(w_gate_up, shp[ArgKind.W_GATE_UP],
                                                  default_dtype=wdt))
        inputs.add(ArgKind.W_DOWN, host_tensor(w_down, shp[ArgKind.W_DOWN], default_dtype=wdt))
        caller_routing = router_logits is None and router_weight is None
        if router_logits is not None:
            inputs.add(ArgKind.ROUTER_LOGITS,
                       host_tensor(router_logits, shp[ArgKind.ROUTER_LOGITS], default_dtype="f32"))
        elif router_weight is not None:
            inputs.add(ArgKind.ROUTER_WEIGHT,
                       host_tensor(router_weight, shp[ArgKind.ROUTER_WEIGHT], default_dtype=wdt))
        else:
            if topk_indices is None or topk_weights is None:
                raise BindingError(Status.INVALID_ARGUMENT, "moeblaze.Layer.forward",
                                   "give router_logits, router_weight, or topk_indices and "
                                   "topk_weights (caller routing)")
            inputs.add(ArgKind.TOPK_INDICES, host_tensor(topk_indices, shp[ArgKind.TOPK_INDICES],
                                                         default_dtype="i64"))
            inputs.add(ArgKind.TOPK_WEIGHTS, host_tensor(topk_weights, shp[ArgKind.TOPK_WEIGHTS],
                                                         default_dtype="f32"))

        args = inputs.copy()
        res.y = y if y is not None else _alloc(act, L * self.hidden_size)
        args.add(ArgKind.OUTPUT, host_tensor(res.y, shp[ArgKind.OUTPUT], writable=True,
                                             default_dtype=act))
        if want_routing and not caller_routing:
            res.topk_indices = _alloc("i64", L * self.top_k)
            res.topk_weights = _alloc("f32", L * self.top_k)
            res.tokens_per_expert = _alloc("i64", self.num_experts)
            args.add(ArgKind.TOPK_INDICES, host_tensor(res.topk_indices,
                                                       shp[ArgKind.TOPK_INDICES], writable=True))
            args.add(ArgKind.TOPK_WEIGHTS, host_tensor(res.topk_weights,
                                                       shp[ArgKind.TOPK_WEIGHTS], writable=True))
            args.add(ArgKind.TOKENS_PER_EXPERT,
                     host_tensor(res.tokens_per_expert, shp[ArgKind.TOKENS_PER_EXPERT],
                                 writable=True))
        scalars = {}
        for wanted, kind in ((aux_loss, ArgKind.AUX_LOSS), (z_loss, ArgKind.Z_LOSS)):
            if wanted:
                scalars[kind] = array("f", [0.0])
                args.add(kind, host_tensor(scalars[kind], (), writable=True))

        pass_ = Pass.FORWARD_TRAINING if training else Pass.FORWARD_INFERENCE
        workspace = AlignedBuffer(self.handle.workspace_size(pass_, L))
        if training:
            res.saved = AlignedBuffer(self.handle.saved_size(L))
        self.handle.forward(pass_, args, workspace, res.saved)
        if ArgKind.AUX_LOSS in scalars:
            res.aux_loss = scalars[ArgKind.AUX_LOSS][0]
        if ArgKind.Z_LOSS in scalars:
            res.z_loss = scalars[ArgKind.Z_LOSS][0]
        res._inputs = inputs
        return res

    # -- backward --
    def backward(self, fwd, dy, *, grad_aux_loss=None, grad_z_loss=None,
                 want=("input", "w_gate_up", "w_down", "router"), out=None, accumulate=False,
                 last_use=False):
        """Gradients of a training forward. ``want`` picks the gradients: "input",
        "w_gate_up", "w_down" and "router" (d logits, dW_g or d top-k weights, following the
        forward's routing input). ``out`` may map those names to caller buffers; with
        ``accumulate`` the results are added to them (MOEBLAZE_ARG_FLAG_ACCUMULATE). With
        ``last_use`` this is the forward's last backward (moeblaze_backward_last_use): the same
        gradients, in less workspace, and ``fwd`` is spent (a later backward of it is refused)."""
        if fwd.saved is None:
            raise BindingError(Status.INVALID_ARGUMENT, "moeblaze.Layer.backward",
                               "backward needs a forward run with training=True")
        L = fwd.num_tokens
        E, k, d, h, g = (self.num_experts, self.top_k, self.hidden_size, self.ffn_hidden_size,
                         self.gate_factor)
        act, wdt = self.activation_dtype, self.weight_dtype
        out = dict(out or {})
        flags = ARG_FLAG_ACCUMULATE if accumulate else 0
        grads = Gradients()
        args = fwd._inputs.copy()
        args.add(ArgKind.GRAD_OUTPUT, host_tensor(dy, (L, d), default_dtype=act))
        for value, kind in ((grad_aux_loss, ArgKind.GRAD_AUX_LOSS),
                            (grad_z_loss, ArgKind.GRAD_Z_LOSS)):
            if value is not None:
                args.add(kind, host_tensor(array("f", [float(value)]), ()))
        kinds = set(fwd._inputs.kinds())
        plan = []
        if "input" in want:
            plan.append(("dx", "input", ArgKind.GRAD_INPUT, (L, d), act))
        if "w_gate_up" in want:
            plan.append(("dw_gate_up", "w_gate_up", ArgKind.GRAD_W_GATE_UP, (E, d, g * h), wdt))
        if "w_down" in want:
            plan.append(("dw_down", "w_down", ArgKind.GRAD_W_DOWN, (E, h, d), wdt))
        if "router" in want:
            if ArgKind.ROUTER_LOGITS in kinds:
                logits_dt = fwd._inputs.get(ArgKind.ROUTER_LOGITS).dtype
                plan.append(("drouter_logits", "router", ArgKind.GRAD_ROUTER_LOGITS, (L, E),
                             logits_dt))
            elif ArgKind.ROUTER_WEIGHT in kinds:
                plan.append(("drouter_weight", "router", ArgKind.GRAD_ROUTER_WEIGHT, (E, d), wdt))
            else:
                plan.append(("dtopk_weights", "router", ArgKind.GRAD_TOPK_WEIGHTS, (L, k), "f32"))
        for attr, key, kind, shape, dt in plan:
            buf = out.get(key)
            if buf is None:
                n = 1
                for s in shape:
                    n *= s
                buf = _alloc(dt, n)
            setattr(grads, attr, buf)
            args.add(kind, host_tensor(buf, shape, writable=True, default_dtype=dt), flags)
        workspace = AlignedBuffer(self.handle.workspace_size(
            Pass.BACKWARD_LAST_USE if last_use else Pass.BACKWARD, L))
        self.handle.backward(args, fwd.saved, workspace, last_use=last_use)
        return grads

    # -- router only --
    def route(self, router_logits=None, x=None, router_weight=None, *, num_tokens=None,
              aux_loss=False, z_loss=False):
        """Runs the router alone; returns a ForwardResult with the routing outputs."""
        if router_logits is not None:
            if num_tokens is None:
                num_tokens = memoryview(router_logits).nbytes // (4 * self.num_experts)
            L = int(num_tokens)
        else:
            L = self._num_tokens(x, num_tokens)
        shp = self._shapes(L)
        args = ArgList()
        if router_logits is not None:
            args.add(ArgKind.ROUTER_LOGITS, host_tensor(router_logits, shp[ArgKind.ROUTER_LOGITS],
                                                        default_dtype="f32"))
        else:
            args.add(ArgKind.INPUT, host_tensor(x, shp[ArgKind.INPUT],
                                                default_dtype=self.activation_dtype))
            args.add(ArgKind.ROUTER_WEIGHT, host_tensor(router_weight, shp[ArgKind.ROUTER_WEIGHT],
                                                        default_dtype=self.weight_dtype))
        res = ForwardResult()
        res.num_tokens = L
        res.topk_indices = _alloc("i64", L * self.top_k)
        res.topk_weights = _alloc("f32", L * self.top_k)
        res.tokens_per_expert = _alloc("i64", self.num_experts)
        args.add(ArgKind.TOPK_INDICES, host_tensor(res.topk_indices, shp[ArgKind.TOPK_INDICES],
                                                   writable=True))
        args.add(ArgKind.TOPK_WEIGHTS, host_tensor(res.topk_weights, shp[ArgKind.TOPK_WEIGHTS],
                                                   writable=True))
        args.add(ArgKind.TOKENS_PER_EXPERT, host_tensor(res.tokens_per_expert, (self.num_experts,),
                                                        writable=True))
        scalars = {}
        for wanted, kind in ((aux_loss, ArgKind.AUX_LOSS), (z_loss, ArgKind.Z_LOSS)):
            if wanted:
                scalars[kind] = array("f", [0.0])
                args.add(kind, host_tensor(scalars[kind], (), writable=True))
        workspace = AlignedBuffer(self.handle.workspace_size(Pass.ROUTE, L))
        self.handle.route(args, workspace)
        res.aux_loss = scalars[ArgKind.AUX_LOSS][0] if aux_loss else None
        res.z_loss = scalars[ArgKind.Z_LOSS][0] if z_loss else None
        return res
