"""MoELayer behaves as a torch module and as the Hugging Face blocks it converts: it follows
``.to(dtype)``, ``.half()``, ``.bfloat16()`` and autocast; configuration errors are raised at
construction; the converters honour the experts' activation (hidden_act) or refuse it, named."""
import unittest

from support import fused_hf_block, torch_or_none as _torch

import moeblaze  # noqa: F401


def _rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-12)).item()


@unittest.skipIf(_torch() is None, "torch is not installed")
class TestMoELayerDtypes(unittest.TestCase):
    def setUp(self):
        import moeblaze.torch as mt
        self.torch, self.mt = _torch(), mt
        self.torch.manual_seed(0)

    def test_follows_to_half_and_bfloat16(self):
        torch = self.torch
        layer = self.mt.MoELayer(16, 24, 4, 2, max_tokens=64)
        x = torch.randn(20, 16)
        want = layer(x)[0]
        for convert, dt in ((lambda m: m.to(torch.bfloat16), torch.bfloat16), (lambda m: m.half(), torch.float16),
                            (lambda m: m.bfloat16(), torch.bfloat16), (lambda m: m.float(), torch.float32)):
            convert(layer)
            xd = x.to(dt).requires_grad_()
            y, aux, _ = layer(xd)
            self.assertEqual(y.dtype, dt)
            self.assertLess(_rel(y, want), 2e-2)  # the weights went through 16 bits on the way
            (y.float().square().sum() + aux).backward()
            self.assertEqual(layer.w_gate_up.grad.dtype, dt)
            layer.zero_grad(set_to_none=True)

    def test_autocast(self):
        torch = self.torch
        layer = self.mt.MoELayer(16, 24, 4, 2, max_tokens=64)
        x = torch.randn(20, 16, requires_grad=True)
        want = layer(x)[0]
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y, aux, _ = layer(x)
        self.assertEqual(y.dtype, torch.bfloat16)
        self.assertLess(_rel(y, want), 2e-2)
        (y.float().square().sum() + aux).backward()
        self.assertEqual(layer.w_gate_up.dtype, torch.float32)  # the parameters keep their dtype
        self.assertEqual(layer.w_gate_up.grad.dtype, torch.float32)
        self.assertEqual(x.grad.dtype, torch.float32)

    def test_second_derivative_is_refused(self):
        torch = self.torch
        layer = self.mt.MoELayer(16, 24, 4, 2, max_tokens=64)
        x = torch.randn(8, 16, requires_grad=True)
        g, = torch.autograd.grad(layer(x)[0].square().sum(), x, create_graph=True)
        x2 = x.detach().requires_grad_()
        g2, = torch.autograd.grad(layer(x2)[0].square().sum(), x2)
        self.assertTrue(torch.equal(g, g2))  # the first derivative is the plain one
        with self.assertRaisesRegex(RuntimeError, "differentiate twice"):
            g.sum().backward()

    def test_mismatch_names_the_way_out(self):
        torch = self.torch
        layer = self.mt.MoELayer(16, 24, 4, 2, max_tokens=64)
        with self.assertRaises(TypeError) as cm:
            layer(torch.randn(4, 16, dtype=torch.bfloat16))
        self.assertIn("layer.to(torch.bfloat16)", str(cm.exception))
        self.assertIn("autocast", str(cm.exception))

    def test_configuration_errors_at_construction(self):
        with self.assertRaises(moeblaze.MoEBlazeError) as cm:
            self.mt.MoELayer(16, 24, 4, 5, max_tokens=64)
        self.assertIn("top_k = 5 exceeds num_experts = 4", str(cm.exception))
        with self.assertRaises(moeblaze.MoEBlazeError):
            self.mt.MoE(num_experts=4, top_k=5, hidden_size=16, ffn_hidden_size=24, max_tokens=64)
        with self.assertRaises(moeblaze.MoEBlazeError):
            self.mt.MoELayer(16, 24, 4, 2, max_tokens=64, window_tokens=65)
        with self.assertRaises(moeblaze.MoEBlazeError) as cm:
            self.mt.MoELayer(16, 24, 4, 2, max_tokens=64, window_tokens=32, window_bytes=1 << 30)
        self.assertIn("are both set", str(cm.exception))
        # a budget alone is taken (the CPU engine ignores it) and the layer runs
        layer = self.mt.MoELayer(16, 24, 4, 2, max_tokens=64, window_bytes=1 << 30)
        self.assertEqual(layer(self.torch.randn(8, 16))[0].shape, (8, 16))


@unittest.skipIf(_torch() is None, "torch is not installed")
class TestTorchArgs(unittest.TestCase):
    """The operators' packed argument array holds, field by field, what a moeblaze Tensor built by
    tensor_descriptor holds, for every rank and layout the operators pass."""

    def test_packed_arguments_match_the_descriptors(self):
        import ctypes
        torch = _torch()
        from moeblaze._core import ArgList
        from moeblaze._torch_ops import TorchArgs, tensor_descriptor
        base = torch.randn(6, 10, 12)
        tensors = [torch.randn(5, 7).to(torch.bfloat16), torch.zeros((), dtype=torch.float32),
                   base.transpose(1, 2), base[:, 2:9, ::1], torch.empty(0, 4, dtype=torch.int64),
                   torch.arange(9, dtype=torch.int32), torch.ones(3, 2, dtype=torch.float16).t(),
                   torch.empty(0, dtype=torch.uint8)]
        fast, slow = TorchArgs(), ArgList()
        for i, t in enumerate(tensors):
            fast.add(i + 1, t, flags=i % 2)
            slow.add(i + 1, tensor_descriptor(t), flags=i % 2)
        fast.add(len(tensors) + 1, tensor_descriptor(tensors[0]))  # a moeblaze Tensor, as ArgList takes it
        slow.add(len(tensors) + 1, tensor_descriptor(tensors[0]))
        a, b = fast.to_array(), slow.to_array()
        self.assertEqual(len(fast), len(slow))
        for i in range(len(fast)):
            x, y = a[i], b[i]
            self.assertEqual((x.kind, x.flags), (y.kind, y.flags))
            tx, ty = x.tensor, y.tensor
            self.assertEqual((tx.data or 0, tx.device.device_type, tx.device.device_id, tx.ndim, tx.byte_offset),
                             (ty.data or 0, ty.device.device_type, ty.device.device_id, ty.ndim, ty.byte_offset))
            self.assertEqual((tx.dtype.code, tx.dtype.bits, tx.dtype.lanes), (ty.dtype.code, ty.dtype.bits, ty.dtype.lanes))
            self.assertEqual([tx.shape[j] for j in range(tx.ndim)], [ty.shape[j] for j in range(ty.ndim)])
            self.assertTrue(bool(tx.shape))
            self.assertEqual(bool(tx.strides), bool(ty.strides))
            if tx.ndim:
                self.assertEqual([tx.strides[j] for j in range(tx.ndim)], [ty.strides[j] for j in range(ty.ndim)])
        with self.assertRaises(TypeError):
            TorchArgs().add(1, torch.zeros(2, dtype=torch.complex64)).to_array()
        self.assertEqual(ctypes.sizeof(a[0]), 56)


@unittest.skipIf(_torch() is None, "torch is not installed")
class TestHuggingFaceActivation(unittest.TestCase):
    """The fused experts of transformers 5 (gate_up_proj, down_proj, act_fn from hidden_act)."""

    def _block(self, act_fn):
        return fused_hf_block(_torch(), 16, 24, 6, 2, act_fn)

    def test_activation_follows_the_experts(self):
        torch = _torch()
        from moeblaze.torch import MoELayer
        x = torch.randn(25, 16)
        for act_fn, want in ((torch.nn.SiLU(), "swiglu"), (torch.nn.GELU(), "geglu")):
            block = self._block(act_fn)
            layer = MoELayer.from_qwen3_moe(block, max_tokens=64)
            self.assertEqual(layer.activation, want)
            self.assertLess(_rel(layer(x)[0], block(x)), 1e-5)

    def test_unsupported_activation_is_refused(self):
        torch = _torch()
        from moeblaze.torch import MoELayer
        for act_fn in (torch.nn.GELU(approximate="tanh"), torch.nn.ReLU()):
            with self.assertRaises(ValueError) as cm:
                MoELayer.from_qwen3_moe(self._block(act_fn), max_tokens=64)
            self.assertIn(type(act_fn).__name__, str(cm.exception))

    def test_transformers_qwen3_moe_gelu(self):
        try:
            from transformers.models.qwen3_moe.configuration_qwen3_moe import Qwen3MoeConfig
            from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock
        except ImportError:
            self.skipTest("transformers is not installed")
        torch = _torch()
        from moeblaze.torch import MoELayer
        for act, want in (("gelu", "geglu"), ("silu", "swiglu")):
            cfg = Qwen3MoeConfig(hidden_size=16, moe_intermediate_size=24, num_experts=6,
                                 num_experts_per_tok=2, hidden_act=act, norm_topk_prob=True)
            block = Qwen3MoeSparseMoeBlock(cfg)
            with torch.no_grad():
                for p in block.parameters():
                    p.normal_(0, 0.3)
            layer = MoELayer.from_qwen3_moe(block, max_tokens=64)
            self.assertEqual(layer.activation, want)
            x = torch.randn(1, 25, 16)
            self.assertLess(_rel(layer(x)[0], block(x)), 1e-5)
        cfg.hidden_act = "gelu_pytorch_tanh"
        with self.assertRaises(ValueError):
            MoELayer.from_qwen3_moe(Qwen3MoeSparseMoeBlock(cfg), max_tokens=64)


@unittest.skipIf(_torch() is None, "torch is not installed")
class TestHuggingFaceExpertsBackend(unittest.TestCase):
    """experts_implementation="moeblaze": a transformers Qwen3-MoE block runs its experts on the
    library (the model's router, the experts' own weights, no copy), against transformers' eager
    experts: outputs and every gradient."""

    def test_qwen3_moe_block(self):
        try:
            from transformers.models.qwen3_moe.configuration_qwen3_moe import Qwen3MoeConfig
            from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock
        except ImportError:
            self.skipTest("transformers is not installed")
        import copy
        import moeblaze.hf_experts as hf_experts
        torch = _torch()
        torch.manual_seed(0)
        self.assertEqual(hf_experts.register(), "moeblaze")
        for act in ("silu", "gelu"):
            cfg = Qwen3MoeConfig(hidden_size=16, moe_intermediate_size=24, num_experts=6,
                                 num_experts_per_tok=2, hidden_act=act, norm_topk_prob=True)
            cfg._experts_implementation = "eager"
            ref = Qwen3MoeSparseMoeBlock(cfg)
            with torch.no_grad():
                for p in ref.parameters():
                    p.normal_(0, 0.3)
            blk = copy.deepcopy(ref)
            blk.experts.config = copy.deepcopy(cfg)
            blk.experts.config._experts_implementation = "moeblaze"
            weights = blk.experts.gate_up_proj.data_ptr(), blk.experts.down_proj.data_ptr()
            x = torch.randn(2, 13, 16)
            xr, xm = x.clone().requires_grad_(), x.clone().requires_grad_()
            yr, ym = ref(xr), blk(xm)
            self.assertLess(_rel(ym, yr), 1e-5)
            dy = torch.randn_like(yr)
            (yr * dy).sum().backward()
            (ym * dy).sum().backward()
            self.assertLess(_rel(xm.grad, xr.grad), 1e-5)
            for (name, a), (_, b) in zip(ref.named_parameters(), blk.named_parameters()):
                self.assertLess(_rel(b.grad, a.grad), 1e-5, name)
            self.assertEqual(weights, (blk.experts.gate_up_proj.data_ptr(), blk.experts.down_proj.data_ptr()))

    def test_qwen3_moe_block_on_cuda(self):
        """The same in bf16 on a CUDA device (the engine AUTO picks: fused on sm_90), against
        transformers' eager experts in bf16: the same router, so the same experts per token."""
        torch = _torch()
        if not torch.cuda.is_available() or moeblaze.get_device_count("cuda") == 0:
            self.skipTest("needs torch with CUDA and a CUDA build of libmoeblaze")
        try:
            from transformers.models.qwen3_moe.configuration_qwen3_moe import Qwen3MoeConfig
            from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock
        except ImportError:
            self.skipTest("transformers is not installed")
        import copy
        import moeblaze.hf_experts as hf_experts
        hf_experts.register()
        torch.manual_seed(0)
        cfg = Qwen3MoeConfig(hidden_size=256, moe_intermediate_size=512, num_experts=16,
                             num_experts_per_tok=4, hidden_act="silu", norm_topk_prob=True)
        cfg._experts_implementation = "eager"
        blk = Qwen3MoeSparseMoeBlock(cfg).cuda().to(torch.bfloat16)
        with torch.no_grad():
            for p in blk.parameters():
                p.normal_(0, 0.05)
        ref = copy.deepcopy(blk)
        blk.experts.config = copy.deepcopy(cfg)
        blk.experts.config._experts_implementation = "moeblaze"
        x = torch.randn(4, 128, 256, device="cuda", dtype=torch.bfloat16)
        xr, xm = x.clone().requires_grad_(), x.clone().requires_grad_()
        yr, ym = ref(xr), blk(xm)
        self.assertLess(_rel(ym, yr), 3e-2)
        dy = torch.randn_like(yr)
        (yr * dy).sum().backward()
        (ym * dy).sum().backward()
        self.assertLess(_rel(xm.grad, xr.grad), 3e-2)
        for (name, a), (_, b) in zip(ref.named_parameters(), blk.named_parameters()):
            self.assertLess(_rel(b.grad, a.grad), 3e-2, name)


_BAD_IDS_ON_CUDA = r"""
import torch, moeblaze.torch as mt
layer = mt.MoE(num_experts=8, top_k=2, hidden_size=64, ffn_hidden_size=128, max_tokens=32,
               activation="swiglu", activation_dtype="bf16")
x = torch.randn(32, 64, device="cuda", dtype=torch.bfloat16)
wgu = torch.randn(8, 64, 256, device="cuda", dtype=torch.bfloat16) * 0.05
wd = torch.randn(8, 128, 64, device="cuda", dtype=torch.bfloat16) * 0.05
ids = torch.stack([torch.arange(32) % 8, (torch.arange(32) + 1) % 8], 1).to("cuda")
ids[5, 1] = 8                        # outside [0, num_experts)
gates = torch.full((32, 2), 0.5, device="cuda")
y = layer(x, wgu, wd, topk_indices=ids, topk_weights=gates)
print("ENQUEUED", flush=True)
try:
    torch.cuda.synchronize()
    print("NO ERROR")
except RuntimeError as e:
    print("RAISED", str(e).splitlines()[0])
"""


@unittest.skipIf(_torch() is None, "torch is not installed")
class TestDeviceErrors(unittest.TestCase):
    def test_bad_caller_ids_on_cuda_name_the_cause(self):
        """Caller ids out of range on CUDA: the call returns without a sync, the next sync raises,
        and the device-side assertion printed to stderr names the cause. In a child process,
        since the assertion ends the CUDA context."""
        torch = _torch()
        if not torch.cuda.is_available() or moeblaze.get_device_count("cuda") == 0:
            self.skipTest("needs torch with CUDA and a CUDA build of libmoeblaze")
        import os
        import subprocess
        import sys
        res = subprocess.run([sys.executable, "-c", _BAD_IDS_ON_CUDA], capture_output=True, text=True,
                             timeout=300, env=dict(os.environ))
        out = res.stdout + res.stderr
        self.assertIn("ENQUEUED", res.stdout, out)
        self.assertIn("RAISED", res.stdout, out)
        self.assertIn("device-side assert", res.stdout, out)
        self.assertIn("a caller expert id (TOPK_INDICES) outside [0, NUM_EXPERTS)", out)


@unittest.skipIf(_torch() is None, "torch is not installed")
class TestTorchtitanLayouts(unittest.TestCase):
    """torchtitan 0.3's MoE (routed_experts.inner_experts.w1_EFD / w2_EDF / w3_EFD, expert_bias_E)
    beside the earlier layout, against the same math in plain PyTorch."""

    def _titan_moe(self, E, d, h, k, seed, **router_options):
        """torchtitan 0.3's MoE of E experts (d, h, top-k), its router built with
        router_options (score_func, route_norm, route_scale, groups); skips when torchtitan 0.3
        does not import."""
        try:
            from torchtitan.models.common.linear import Linear
            from torchtitan.models.common.moe import GroupedExperts, MoE, RoutedExperts, TokenChoiceTopKRouter
            from torchtitan.models.common.token_dispatcher import LocalTokenDispatcher
        except Exception as e:  # not installed, or a release with another layout
            self.skipTest("torchtitan 0.3 is not importable: %s" % e)
        experts = RoutedExperts.Config(inner_experts=GroupedExperts.Config(dim=d, hidden_dim=h, num_experts=E),
                                       token_dispatcher=LocalTokenDispatcher.Config(num_experts=E, top_k=k))
        router = TokenChoiceTopKRouter.Config(num_experts=E, gate=Linear.Config(in_features=d, out_features=E),
                                              top_k=k, **router_options)
        _torch().manual_seed(seed)
        return MoE.Config(num_experts=E, routed_experts=experts, router=router, load_balance_coeff=1e-3).build()

    @staticmethod
    def _titan_forward(moe, x):
        import warnings
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # torchtitan's fp32 autocast on the CPU
            return moe(x)

    # DeepSeek-V3-style routing: sigmoid scores, 4 groups with 2 kept, a scale (and a bias).
    _DEEPSEEK_ROUTING = dict(score_func="sigmoid", route_norm=True, route_scale=2.0, num_expert_groups=4,
                             num_limited_groups=2)

    def test_torchtitan_package(self):
        """The real torchtitan 0.3 MoE (when the package imports): MoELayer.from_torchtitan
        matches its output and input gradient within bf16 noise
        (torchtitan runs its experts in bf16 whatever the parameters' dtype)."""
        torch = _torch()
        import moeblaze.torch as mt
        E, d, h, k = 8, 32, 64, 2
        moe = self._titan_moe(E, d, h, k, 0, score_func="softmax", route_norm=True)
        with torch.no_grad():
            for p in moe.parameters():
                p.normal_(0, 0.1)
        layer = mt.MoELayer.from_torchtitan(moe)
        x = torch.randn(2, 16, d)
        xr, xm = x.clone().requires_grad_(), x.clone().requires_grad_()
        yr = self._titan_forward(moe, xr)
        ym = layer(xm)
        ym = ym[0] if isinstance(ym, tuple) else ym
        self.assertLess(_rel(ym, yr), 3e-2)
        dy = torch.randn_like(yr)
        (yr * dy).sum().backward()
        (ym * dy).sum().backward()
        self.assertLess(_rel(xm.grad, xr.grad), 3e-2)
        moe = self._titan_moe(E, d, h, k, 1, **self._DEEPSEEK_ROUTING)
        with torch.no_grad():
            for p in moe.parameters():
                p.normal_(0, 0.1)
            moe.expert_bias_E.normal_(0, 0.05)
        layer = mt.MoELayer.from_torchtitan(moe)
        self.assertTrue(layer.has_expert_bias)
        self.assertLess(_rel(layer(x)[0], self._titan_forward(moe, x)), 3e-2)

    def test_torchtitan_package_on_cuda(self):
        """MoELayer.from_torchtitan of the real torchtitan 0.3 MoE (DeepSeek-V3-style routing:
        sigmoid, 2 of 4 groups, a scale and a bias), the layer in bf16 on a CUDA device (the engine
        AUTO picks) against the module on the CPU with the same bf16 values."""
        torch = _torch()
        if not torch.cuda.is_available() or moeblaze.get_device_count("cuda") == 0:
            self.skipTest("needs torch with CUDA and a CUDA build of libmoeblaze")
        import copy
        import moeblaze.torch as mt
        E, d, h, k = 16, 256, 128, 4
        moe = self._titan_moe(E, d, h, k, 0, **self._DEEPSEEK_ROUTING)
        with torch.no_grad():
            for p in moe.parameters():
                p.copy_((torch.randn_like(p) * 0.05).to(torch.bfloat16).float())
            moe.expert_bias_E.normal_(0, 0.02)
        layer = mt.MoELayer.from_torchtitan(copy.deepcopy(moe).cuda().to(torch.bfloat16))
        self.assertTrue(layer.has_expert_bias)
        x = torch.randn(4, 64, d).to(torch.bfloat16)
        xr, xm = x.float().requires_grad_(), x.cuda().requires_grad_()
        yr = self._titan_forward(moe, xr)
        ym = layer(xm)[0]
        self.assertLess(_rel(ym.cpu(), yr), 3e-2)
        dy = torch.randn_like(yr).to(torch.bfloat16)
        (yr * dy.float()).sum().backward()
        (ym * dy.cuda()).sum().backward()
        self.assertLess(_rel(xm.grad.cpu(), xr.grad), 3e-2)
        self.assertLess(_rel(layer.router_weight.grad.cpu(), moe.router.gate.weight.grad), 3e-2)

    def _moe(self, new_layout, score_func="softmax", route_norm=True):
        torch = _torch()
        import torch.nn as nn
        import torch.nn.functional as F
        d, h, E, k = 16, 24, 6, 2

        class Router(nn.Module):
            def __init__(self):
                super().__init__()
                self.gate = nn.Linear(d, E, bias=False)
                self.top_k, self.score_func, self.route_norm, self.route_scale = k, score_func, route_norm, 1.0
                self.num_expert_groups = None

        class Experts(nn.Module):
            def __init__(self):
                super().__init__()
                names = ("w1_EFD", "w2_EDF", "w3_EFD") if new_layout else ("w1", "w2", "w3")
                for name, shape in zip(names, ((E, h, d), (E, d, h), (E, h, d))):
                    setattr(self, name, nn.Parameter(torch.randn(*shape) / shape[-1] ** 0.5))

            def weights(self):
                if new_layout:
                    return self.w1_EFD, self.w2_EDF, self.w3_EFD
                return self.w1, self.w2, self.w3

        class Routed(nn.Module):
            def __init__(self):
                super().__init__()
                self.inner_experts = Experts()

        class TitanMoE(nn.Module):
            def __init__(self):
                super().__init__()
                self.router = Router()
                if new_layout:
                    self.routed_experts = Routed()
                    self.register_buffer("expert_bias_E", torch.zeros(E))
                else:
                    self.experts = Experts()

            def forward(self, x):
                ex = self.routed_experts.inner_experts if new_layout else self.experts
                w1, w2, w3 = ex.weights()
                s = F.linear(x, self.router.gate.weight).float()
                s = torch.sigmoid(s) if score_func == "sigmoid" else F.softmax(s, dim=-1)
                w, i = s.topk(k, dim=-1)
                if route_norm:
                    w = w / (w.sum(-1, keepdim=True) + 1e-20)
                y = torch.zeros_like(x)
                for j in range(k):
                    for e in range(E):
                        m = (i[:, j] == e).nonzero()[:, 0]
                        if m.numel():
                            o = F.linear(F.silu(F.linear(x[m], w1[e])) * F.linear(x[m], w3[e]), w2[e])
                            y = y.index_add(0, m, w[m, j:j + 1] * o)
                return y
        return TitanMoE()

    def test_both_layouts(self):
        torch = _torch()
        from moeblaze.torch import MoELayer
        x = torch.randn(25, 16)
        for new_layout in (True, False):
            for score_func, norm in (("softmax", True), ("sigmoid", False)):
                moe = self._moe(new_layout, score_func, norm)
                layer = MoELayer.from_torchtitan(moe, max_tokens=64)
                self.assertLess(_rel(layer(x)[0], moe(x)), 1e-5)

    def test_refusals_and_routing_options(self):
        torch = _torch()
        from moeblaze.torch import MoELayer
        moe = self._moe(True)
        moe.score_before_experts = True
        with self.assertRaises(ValueError) as cm:
            MoELayer.from_torchtitan(moe, max_tokens=64)
        self.assertIn("score_before_experts", str(cm.exception))
        # A non-zero bias, groups and a scale become the layer's (checked against the real
        # torchtitan router in test_torchtitan_package).
        moe = self._moe(True)
        with torch.no_grad():
            moe.expert_bias_E[2] = 0.5
        moe.router.num_expert_groups, moe.router.num_limited_groups, moe.router.route_scale = 3, 2, 2.0
        layer = MoELayer.from_torchtitan(moe, max_tokens=64)
        self.assertTrue(torch.equal(layer.expert_bias, moe.expert_bias_E))
        self.assertEqual(layer.spec.attrs["num_expert_groups"], 3)
        self.assertEqual(layer.spec.attrs["topk_groups"], 2)
        self.assertEqual(layer.spec.attrs["route_scale"], 2.0)
        self.assertFalse(MoELayer.from_torchtitan(self._moe(True), max_tokens=64).has_expert_bias)


class _Group:
    """Stands in for a process group where no collective runs: its size and this rank."""
    def __init__(self, size, rank):
        self._size, self._rank = size, rank

    def size(self):
        return self._size

    def rank(self):
        return self._rank


@unittest.skipIf(_torch() is None, "torch is not installed")
class TestExpertParallelLayer(unittest.TestCase):
    """MoELayer(ep_group=...) where no GPU is needed: the local experts' shapes and range, the
    state_dict in both layouts, and the refusals (the GPU runs are tests/gpu/ep_torch_check.py)."""

    def _layers(self):
        torch = _torch()
        from moeblaze.torch import MoELayer
        torch.manual_seed(0)
        single = MoELayer(16, 24, 8, 2, max_tokens=64)
        ep = MoELayer(16, 24, 8, 2, max_tokens=64, ep_group=_Group(4, 2))
        return single, ep

    def test_local_experts_and_state_dict(self):
        torch = _torch()
        single, ep = self._layers()
        self.assertEqual(tuple(ep.w_gate_up.shape), (2, 16, 48))
        self.assertEqual(tuple(ep.w_down.shape), (2, 24, 16))
        self.assertEqual(tuple(ep.router_weight.shape), (8, 16))
        self.assertEqual((ep.first_expert, ep.num_local_experts), (4, 2))
        self.assertIn("ep_size=4, ep_rank=2", repr(ep))
        ep.load_state_dict(single.state_dict())  # all 8 experts: experts 4 and 5 kept
        self.assertTrue(torch.equal(ep.w_gate_up, single.w_gate_up[4:6]))
        self.assertTrue(torch.equal(ep.w_down, single.w_down[4:6]))
        self.assertTrue(torch.equal(ep.router_weight, single.router_weight))
        sd = ep.state_dict()
        self.assertEqual(sd._metadata[""]["moeblaze_experts"], (4, 2, 8))
        self.assertEqual(single.state_dict()._metadata[""]["moeblaze_experts"], (0, 8, 8))
        ep.load_state_dict(sd)  # its own shard
        from moeblaze.torch import MoELayer
        other = MoELayer(16, 24, 8, 2, max_tokens=64, ep_group=_Group(4, 1))
        with self.assertRaises(RuntimeError) as cm:
            other.load_state_dict(sd)  # rank 2's shard into rank 1's layer
        self.assertIn("holds experts [4, 6) of 8", str(cm.exception))
        self.assertEqual([p is q for p, q in zip(ep.expert_parameters(), (ep.w_gate_up, ep.w_down))], [True, True])

    def test_converters_keep_own_experts(self):
        torch = _torch()
        single, ep = self._layers()
        gate_up = single.w_gate_up.detach().transpose(1, 2).clone()
        down = single.w_down.detach().transpose(1, 2).clone()
        ep.load_fused_experts(single.router_weight, gate_up, down)
        self.assertTrue(torch.equal(ep.w_gate_up, single.w_gate_up[4:6]))
        out_gu, out_d, out_r = torch.zeros_like(gate_up), torch.zeros_like(down), torch.zeros(8, 16)
        ep.store_fused_experts(out_r, out_gu, out_d)
        self.assertTrue(torch.equal(out_gu[4:6], gate_up[4:6]) and not out_gu[:4].any() and not out_gu[6:].any())

    def test_refusals(self):
        import copy
        torch = _torch()
        from moeblaze.torch import MoELayer
        from moeblaze import Config, Handle
        from moeblaze.errors import MoEBlazeError
        with self.assertRaises(ValueError) as cm:
            MoELayer(16, 24, 6, 2, ep_group=_Group(4, 0))
        self.assertIn("divisible", str(cm.exception))
        _, ep = self._layers()
        with self.assertRaises(ValueError) as cm:
            ep(torch.randn(5, 16))
        self.assertIn("CUDA", str(cm.exception))
        with self.assertRaises(TypeError):
            copy.deepcopy(ep)
        with Config(num_experts=8, top_k=2, hidden_size=16, ffn_hidden_size=24, max_tokens=64) as cfg:
            with self.assertRaises(MoEBlazeError):
                Handle.create_ep(cfg, 0)
            with self.assertRaises(MoEBlazeError) as cm:
                Handle.create_ep_from_unique_id(cfg, b"x" * 10, 2, 0)
            self.assertIn("id_bytes", str(cm.exception))


@unittest.skipIf(_torch() is None, "torch is not installed")
class TestSharedExpert(unittest.TestCase):
    """The shared expert (every token, one dense expert on the same engine) against plain
    PyTorch, and the Qwen2-MoE converter against transformers' block, outputs and gradients."""

    def test_matches_a_dense_mlp(self):
        torch = _torch()
        import torch.nn.functional as F
        from moeblaze.torch import MoELayer
        torch.manual_seed(0)
        for layout in ("in_out", "out_in"):
            for gated in (False, True):
                layer = MoELayer(16, 24, 4, 2, max_tokens=64, shared_expert_hidden=20, shared_expert_gate=gated,
                                 weight_layout=layout, normalize_topk=1)
                plain = MoELayer(16, 24, 4, 2, max_tokens=64, weight_layout=layout, normalize_topk=1)
                plain.load_state_dict({k: v for k, v in layer.state_dict().items() if not k.startswith("shared_")})
                x = torch.randn(25, 16, requires_grad=True)
                y = layer(x)[0]
                wgu, wd = layer.shared_expert_weights()
                xr = x.detach().clone().requires_grad_()
                hid = xr @ wgu[0]
                want = plain(xr)[0] + (F.silu(hid[:, :20]) * hid[:, 20:]) @ wd[0] * (
                    torch.sigmoid(xr @ layer.shared_gate_weight[0])[:, None] if gated else 1.0)
                self.assertLess(_rel(y, want), 1e-5)
                dy = torch.randn_like(y)
                y.backward(dy)
                want.backward(dy)
                self.assertLess(_rel(x.grad, xr.grad), 1e-5)
                if gated:
                    self.assertIsNotNone(layer.shared_gate_weight.grad)
                self.assertIsNotNone(layer.shared_w_down.grad)
                self.assertIn("shared_expert_hidden=20", repr(layer))

    def test_qwen2_moe_block(self):
        torch = _torch()
        try:
            from transformers import Qwen2MoeConfig
            from transformers.models.qwen2_moe.modeling_qwen2_moe import Qwen2MoeSparseMoeBlock
        except ImportError:
            self.skipTest("transformers with Qwen2-MoE is not installed")
        from moeblaze.torch import MoELayer
        torch.manual_seed(0)
        for norm in (False, True):
            cfg = Qwen2MoeConfig(hidden_size=16, moe_intermediate_size=24, shared_expert_intermediate_size=40,
                                 num_experts=6, num_experts_per_tok=2, norm_topk_prob=norm, hidden_act="silu",
                                 num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2, vocab_size=32)
            block = Qwen2MoeSparseMoeBlock(cfg).float()
            with torch.no_grad():
                for p in block.parameters():
                    p.normal_(0, 0.3)
            layer = MoELayer.from_qwen2_moe(block, max_tokens=64)
            self.assertEqual((layer.shared_expert_hidden, layer.shared_expert_gate), (40, True))
            x = torch.randn(2, 9, 16)
            xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
            want = block(xa)
            got = layer(xb)[0]
            self.assertLess(_rel(got, want), 1e-5)
            dy = torch.randn_like(want)
            want.backward(dy)
            got.backward(dy)
            self.assertLess(_rel(xb.grad, xa.grad), 1e-5)
            self.assertLess(_rel(layer.shared_gate_weight.grad, block.shared_expert_gate.weight.grad), 1e-5)
            wgu_grad = layer.shared_w_gate_up.grad[0]  # [d, 2 hs]: gate columns, then up
            self.assertLess(_rel(wgu_grad[:, :40].t(), block.shared_expert.gate_proj.weight.grad), 1e-5)
            self.assertLess(_rel(layer.shared_w_down.grad[0].t(), block.shared_expert.down_proj.weight.grad), 1e-5)
            self.assertLess(_rel(layer.router_weight.grad, block.gate.weight.grad), 1e-5)

    def test_refusals(self):
        from moeblaze.torch import MoELayer
        with self.assertRaises(ValueError):
            MoELayer(16, 24, 4, 2, shared_expert_gate=True)
        with self.assertRaises(ValueError):
            MoELayer(16, 24, 4, 2, shared_expert_hidden=-1)
        with self.assertRaises(ValueError):
            MoELayer(16, 24, 4, 2, max_tokens=64).load_shared_expert(None)


@unittest.skipIf(_torch() is None, "torch is not installed")
class TestDeepSeekV3Routing(unittest.TestCase):
    """Group-limited routing, the expert score bias and the route scale through MoELayer (CPU
    engine), against transformers' DeepseekV3MoE; the auxiliary-loss-free bias update."""

    def test_deepseek_v3_block(self):
        torch = _torch()
        try:
            from transformers import DeepseekV3Config
            from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3MoE
        except ImportError:
            self.skipTest("transformers with DeepSeek-V3 is not installed")
        from moeblaze.torch import MoELayer
        torch.manual_seed(0)
        for n_group, topk_group, scale in ((4, 2, 2.5), (8, 3, 1.0), (1, 1, 1.5)):
            cfg = DeepseekV3Config(hidden_size=16, moe_intermediate_size=12, n_routed_experts=16,
                                   num_experts_per_tok=4, n_group=n_group, topk_group=topk_group,
                                   routed_scaling_factor=scale, n_shared_experts=1, norm_topk_prob=True,
                                   hidden_act="silu", num_hidden_layers=1, num_attention_heads=2,
                                   num_key_value_heads=2, vocab_size=32)
            block = DeepseekV3MoE(cfg).float()
            with torch.no_grad():
                for p in block.parameters():
                    p.normal_(0, 0.3)
                block.gate.e_score_correction_bias.normal_(0, 0.05)
            layer = MoELayer.from_deepseek_v3(block, max_tokens=64)
            self.assertTrue(torch.equal(layer.expert_bias, block.gate.e_score_correction_bias))
            x = torch.randn(3, 7, 16)
            xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
            want = block(xa)
            got = layer(xb)[0]
            self.assertLess(_rel(got, want), 1e-5, "groups %d keep %d scale %g" % (n_group, topk_group, scale))
            dy = torch.randn_like(want)
            want.backward(dy)
            got.backward(dy)
            self.assertLess(_rel(xb.grad, xa.grad), 1e-5)
            self.assertLess(_rel(layer.router_weight.grad, block.gate.weight.grad), 1e-5)
            self.assertLess(_rel(layer.w_gate_up.grad.transpose(1, 2), block.experts.gate_up_proj.grad), 1e-5)
            self.assertLess(_rel(layer.shared_w_down.grad[0].t(), block.shared_experts.down_proj.weight.grad), 1e-5)
            self.assertEqual(float(layer.tokens_per_expert.sum()), 21 * 4)

    def test_update_expert_bias(self):
        torch = _torch()
        from moeblaze.torch import MoELayer
        torch.manual_seed(0)
        layer = MoELayer(16, 24, 8, 2, max_tokens=64, expert_bias=True, score_function="sigmoid")
        with torch.no_grad():
            layer.router_weight[3] += 1.0  # expert 3 overloaded
        layer(torch.randn(40, 16))
        counts = layer.tokens_per_expert.clone()
        self.assertEqual(float(counts.sum()), 80)
        used = layer.update_expert_bias(rate=0.01)
        self.assertTrue(torch.equal(used, counts))
        delta = 0.01 * torch.sign(counts.mean() - counts)
        self.assertTrue(torch.allclose(layer.expert_bias, delta - delta.mean()))
        self.assertLess(float(layer.expert_bias[int(counts.argmax())]), 0)
        self.assertEqual(float(layer.tokens_per_expert.abs().sum()), 0)
        with self.assertRaises(ValueError):
            MoELayer(16, 24, 8, 2, max_tokens=64).update_expert_bias()


@unittest.skipIf(_torch() is None, "torch is not installed")
class TestConvertersOnCuda(unittest.TestCase):
    """from_deepseek_v3 and from_qwen2_moe on a CUDA device in bf16 (the engine AUTO picks), with
    their shared experts (in line and on a second stream), against the transformers blocks they
    were made from, run in fp32 on the same device from the same bf16 values: outputs and
    gradients."""

    def setUp(self):
        torch = _torch()
        if not torch.cuda.is_available() or moeblaze.get_device_count("cuda") == 0:
            self.skipTest("needs torch with CUDA and a CUDA build of libmoeblaze")

    def _in_line_and_beside(self, ref, convert, named_grads):
        """The layer convert(overlap) makes, with its shared expert in line and on a second
        stream, against ref: outputs and the gradients named_grads(layer) lists."""
        for overlap in (False, True):
            with self.subTest(shared_expert_overlap=overlap):
                ref.zero_grad(set_to_none=True)
                layer = convert(overlap)
                _check_converted(self, ref, layer, 3e-2, lambda: named_grads(layer))

    def test_deepseek_v3_block(self):
        torch = _torch()
        try:
            from transformers import DeepseekV3Config
            from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3MoE
        except ImportError:
            self.skipTest("transformers with DeepSeek-V3 is not installed")
        from moeblaze.torch import MoELayer
        torch.manual_seed(0)
        cfg = DeepseekV3Config(hidden_size=256, moe_intermediate_size=128, n_routed_experts=32,
                               num_experts_per_tok=4, n_group=4, topk_group=2, routed_scaling_factor=2.5,
                               n_shared_experts=1, norm_topk_prob=True, hidden_act="silu", num_hidden_layers=1,
                               num_attention_heads=2, num_key_value_heads=2, vocab_size=32)
        block, ref = _block_and_fp32_copy(DeepseekV3MoE(cfg), "cuda", torch.bfloat16,
                                          lambda b: b.gate.e_score_correction_bias.normal_(0, 0.02))
        self._in_line_and_beside(ref, lambda overlap: MoELayer.from_deepseek_v3(
            block, max_tokens=512, shared_expert_overlap=overlap), lambda layer: [
                ("router", layer.router_weight.grad, ref.gate.weight.grad),
                ("experts", layer.w_gate_up.grad.transpose(1, 2), ref.experts.gate_up_proj.grad),
                ("shared down", layer.shared_w_down.grad[0].t(), ref.shared_experts.down_proj.weight.grad)])

    def test_qwen2_moe_block(self):
        torch = _torch()
        try:
            from transformers import Qwen2MoeConfig
            from transformers.models.qwen2_moe.modeling_qwen2_moe import Qwen2MoeSparseMoeBlock
        except ImportError:
            self.skipTest("transformers with Qwen2-MoE is not installed")
        from moeblaze.torch import MoELayer
        torch.manual_seed(0)
        cfg = Qwen2MoeConfig(hidden_size=256, moe_intermediate_size=128, shared_expert_intermediate_size=384,
                             num_experts=16, num_experts_per_tok=4, norm_topk_prob=False, hidden_act="silu",
                             num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2, vocab_size=32)
        block, ref = _block_and_fp32_copy(Qwen2MoeSparseMoeBlock(cfg), "cuda", torch.bfloat16)
        self._in_line_and_beside(ref, lambda overlap: MoELayer.from_qwen2_moe(
            block, max_tokens=512, shared_expert_overlap=overlap), lambda layer: [
                ("router", layer.router_weight.grad, ref.gate.weight.grad),
                ("shared gate", layer.shared_gate_weight.grad, ref.shared_expert_gate.weight.grad),
                ("shared down", layer.shared_w_down.grad[0].t(), ref.shared_expert.down_proj.weight.grad)])


@unittest.skipIf(_torch() is None, "torch is not installed")
class TestRoutedConverters(unittest.TestCase):
    """from_mixtral and from_qwen3_moe (transformers 5's fused experts) on a CUDA device in bf16
    against the fp32 blocks, as TestConvertersOnCuda; _compare also runs on the CPU (fp32 layer)
    so that CI checks the comparison (_check_converted) itself."""

    def _compare(self, device, dtype, make_block, convert, tol):
        _torch().manual_seed(0)
        block, ref = _block_and_fp32_copy(make_block(), device, dtype)
        layer = convert(block)
        _check_converted(self, ref, layer, tol, lambda: [
            ("router", layer.router_weight.grad, ref.gate.weight.grad),
            ("down", layer.w_down.grad, ref.experts.down_proj.grad.transpose(1, 2)
             if layer.weight_layout == "in_out" else ref.experts.down_proj.grad)])

    def _blocks(self):
        try:
            from transformers import MixtralConfig, Qwen3MoeConfig
            from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock
            from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock
        except ImportError:
            self.skipTest("transformers with Mixtral and Qwen3-MoE is not installed")
        from moeblaze.torch import MoELayer
        common = dict(hidden_size=256, num_experts_per_tok=4, hidden_act="silu", num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=2, vocab_size=32)
        return [
            (lambda: MixtralSparseMoeBlock(MixtralConfig(intermediate_size=128, num_local_experts=16, **common)),
             lambda b: MoELayer.from_mixtral(b, max_tokens=512)),
            (lambda: Qwen3MoeSparseMoeBlock(Qwen3MoeConfig(moe_intermediate_size=128, num_experts=16,
                                                           norm_topk_prob=True, **common)),
             lambda b: MoELayer.from_qwen3_moe(b, max_tokens=512)),
        ]

    def test_on_cuda(self):
        torch = _torch()
        if not torch.cuda.is_available() or moeblaze.get_device_count("cuda") == 0:
            self.skipTest("needs torch with CUDA and a CUDA build of libmoeblaze")
        for make_block, convert in self._blocks():
            self._compare("cuda", torch.bfloat16, make_block, convert, 3e-2)

    def test_on_cpu(self):
        for make_block, convert in self._blocks():
            self._compare("cpu", _torch().float32, make_block, convert, 1e-5)


def block_hidden(block):
    """The hidden size of a transformers MoE block (its router's input width)."""
    return block.gate.weight.shape[1]


def _block_and_fp32_copy(block, device, dtype, init=None):
    """A transformers MoE block on `device` in `dtype`, its parameters drawn from N(0, 0.05) (then
    init(block)), and an fp32 copy holding the same values: the reference a converted layer is
    checked against."""
    import copy
    torch = _torch()
    block = block.to(device).to(dtype)
    with torch.no_grad():
        for p in block.parameters():
            p.normal_(0, 0.05)
        if init is not None:
            init(block)
    return block, copy.deepcopy(block).float()


def _check_converted(tc, ref, layer, tol, grads):
    """The converted layer against the fp32 reference block on the same inputs (x in the layer's
    dtype): y and dx within tol, then each (name, layer gradient, reference gradient) of grads()."""
    torch = _torch()
    dtype = next(layer.parameters()).dtype
    device = next(layer.parameters()).device
    x = torch.randn(4, 96, block_hidden(ref), device=device).to(dtype)
    xa, xb = x.float().clone().requires_grad_(), x.clone().requires_grad_()
    want = ref(xa)
    want = want[0] if isinstance(want, tuple) else want
    got = layer(xb)[0]
    tc.assertLess(_rel(got, want), tol)
    dy = torch.randn_like(want).to(dtype)
    want.backward(dy.float())
    got.backward(dy)
    tc.assertLess(_rel(xb.grad, xa.grad), tol)
    for name, mine, theirs in grads():
        tc.assertLess(_rel(mine, theirs), tol, name)


@unittest.skipIf(_torch() is None, "torch is not installed")
class TestSequenceBalanceLoss(unittest.TestCase):
    """balance_per_sequence / sequence_lengths: DeepSeek-V3's sequence-wise balance loss and its
    router gradient against the formula written in PyTorch (CPU engine)."""

    def test_against_pytorch(self):
        torch = _torch()
        import torch.nn.functional as F
        from moeblaze.torch import MoELayer
        torch.manual_seed(0)
        E, k, d, alpha = 8, 2, 16, 0.01
        for score in ("softmax", "sigmoid"):
            layer = MoELayer(d, 24, E, k, max_tokens=128, aux_loss_coeff=alpha, score_function=score,
                             normalize_topk=1, balance_per_sequence=True)
            x = torch.randn(3, 20, d)
            aux = layer(x)[1]
            aux.backward()
            got = layer.router_weight.grad.clone()
            # The formula: per sequence, alpha E / (k T) sum_e n_e P_e, P_e the mean normalised score.
            w = layer.router_weight.detach().clone().requires_grad_()
            logits = x.reshape(-1, d) @ w.t()
            s = F.softmax(logits, -1) if score == "softmax" else torch.sigmoid(logits)
            ids = logits.topk(k, -1).indices
            sn = s if score == "softmax" else s / s.sum(-1, keepdim=True)
            loss = 0
            for q in range(3):
                rows = slice(20 * q, 20 * (q + 1))
                n = torch.zeros(E).index_add_(0, ids[rows].reshape(-1), torch.ones(20 * k))
                loss = loss + alpha * E / (k * 20) * (n * sn[rows].mean(0)).sum()
            loss = loss / 3
            loss.backward()
            self.assertLess(abs(aux.item() - loss.item()) / loss.item(), 1e-5, score)
            self.assertLess(_rel(got, w.grad), 1e-4, score)
            # Explicit lengths: the same loss for [20, 20, 20]; another split gives another one.
            same = layer(x, sequence_lengths=torch.tensor([20, 20, 20]))[1]
            other = layer(x, sequence_lengths=torch.tensor([30, 30]))[1]
            self.assertEqual(float(same), float(aux))
            self.assertNotEqual(float(other), float(aux))
            with self.assertRaises(Exception):
                layer(x, sequence_lengths=torch.tensor([20, 20]))  # sums to 40 of 60 tokens

    def test_token_mask_is_the_unmasked_tokens_alone(self):
        """MoELayer(x, token_mask=m) on the CPU engine: y, the losses and every gradient of the
        same layer on the unmasked tokens alone; zero y and dx rows for the masked ones."""
        torch = _torch()
        from moeblaze.torch import MoELayer
        torch.manual_seed(0)
        layer = MoELayer(16, 24, 8, 2, max_tokens=64, aux_loss_coeff=0.01, z_loss_coeff=1e-3)
        x, mask = torch.randn(2, 10, 16), torch.rand(2, 10) > 0.3
        dy = torch.randn_like(x)

        def step(xx, gy, **kw):
            layer.zero_grad()
            xx = xx.clone().requires_grad_()
            y, aux, z = layer(xx, **kw)
            ((y * gy).sum() + aux + z).backward()
            return [y.detach(), aux.detach(), z.detach(), xx.grad] + [p.grad.clone() for p in layer.parameters()]

        got = step(x, dy, token_mask=mask)
        want = step(x[mask], dy[mask])
        self.assertEqual(float(got[0][~mask].abs().max()), 0.0)
        self.assertEqual(float(got[3][~mask].abs().max()), 0.0)
        got[0], got[3] = got[0][mask], got[3][mask]
        for a, b in zip(got, want):
            self.assertLess(_rel(a, b), 1e-5)
        with self.assertRaisesRegex(ValueError, "token_mask"):
            layer(x, token_mask=torch.ones(20, dtype=torch.bool))

    def test_token_mask_with_the_sequence_wise_loss(self):
        """A token mask with balance_per_sequence: each sequence's loss over its unmasked tokens,
        a wholly masked sequence left out of the mean; the same as the unmasked tokens alone with
        their own lengths."""
        torch = _torch()
        from moeblaze.torch import MoELayer
        torch.manual_seed(0)
        for score in ("softmax", "sigmoid"):
            layer = MoELayer(16, 24, 8, 2, max_tokens=64, aux_loss_coeff=0.01, balance_per_sequence=True,
                             score_function=score)
            x, mask = torch.randn(3, 10, 16), torch.rand(3, 10) > 0.3
            mask[1] = False
            dy = torch.randn_like(x)

            def step(xx, gy, **kw):
                layer.zero_grad()
                xx = xx.clone().requires_grad_()
                y, aux, _ = layer(xx, **kw)
                ((y * gy).sum() + aux).backward()
                return [y.detach(), aux.detach(), xx.grad] + [p.grad.clone() for p in layer.parameters()]

            got = step(x, dy, token_mask=mask)
            kept = mask.sum(1)
            want = step(x[mask], dy[mask], sequence_lengths=kept[kept > 0])
            self.assertGreater(float(want[1]), 0.0)
            got[0], got[2] = got[0][mask], got[2][mask]
            for a, b in zip(got, want):
                self.assertLess(_rel(a, b), 1e-5, score)


if __name__ == "__main__":
    unittest.main()
