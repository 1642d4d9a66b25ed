"""Shared pieces of the Python tests: the import path, torch when installed, and a Hugging Face
style MoE block written in plain PyTorch (transformers 5's fused expert tensors)."""
import os
import sys

_HERE = os.path.dirname(os.path.abspath(__file__))
# bindings/python, unless the installed package is under test (MOEBLAZE_TEST_INSTALLED=1: the
# pip-installed package with its own library, as scripts/test.sh checks it).
if os.environ.get("MOEBLAZE_TEST_INSTALLED") != "1" and os.path.dirname(_HERE) not in sys.path:
    sys.path.insert(0, os.path.dirname(_HERE))


def torch_or_none():
    try:
        import torch
    except ImportError:
        return None
    return torch


def fused_hf_block(torch, d, h, E, k, act_fn=None):
    """A block with transformers 5's fused experts: ``gate.weight`` [E, d] (with ``top_k`` and
    ``norm_topk_prob``), ``experts.gate_up_proj`` [E, 2h, d] (gate rows first) and
    ``experts.down_proj`` [E, d, h], and ``experts.act_fn`` when given (SiLU otherwise); its
    forward is softmax, top-k, renormalisation and the experts, expert by expert."""
    import torch.nn as nn
    import torch.nn.functional as F

    class Router(nn.Module):
        def __init__(self):
            super().__init__()
            self.weight = nn.Parameter(torch.randn(E, d) / d ** 0.5)
            self.top_k, self.norm_topk_prob = k, True

    class Experts(nn.Module):
        def __init__(self):
            super().__init__()
            self.gate_up_proj = nn.Parameter(torch.randn(E, 2 * h, d) / d ** 0.5)
            self.down_proj = nn.Parameter(torch.randn(E, d, h) / h ** 0.5)
            if act_fn is not None:
                self.act_fn = act_fn

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.gate, self.experts = Router(), Experts()

        def forward(self, x):
            act = act_fn if act_fn is not None else F.silu
            p = F.softmax(F.linear(x, self.gate.weight).float(), dim=-1)
            w, i = p.topk(k, dim=-1)
            w = w / w.sum(-1, keepdim=True)
            y = torch.zeros_like(x)
            for j in range(k):
                for e in range(E):
                    m = (i[:, j] == e).nonzero()[:, 0]
                    if m.numel():
                        g, u = F.linear(x[m], self.experts.gate_up_proj[e]).chunk(2, dim=-1)
                        o = F.linear(act(g) * u, self.experts.down_proj[e])
                        y = y.index_add(0, m, w[m, j:j + 1] * o)
            return y
    return Block()
