#!/usr/bin/env python3
"""MoEBlaze against PyTorch baselines on one GPU, all in one run.

For the paper's configs x {SiLU, SwiGLU} (h = 4 d), or the modern fine-grained configs
(--configs modern: explicit n, SwiGLU), in bf16 (routing from logits, softmax, no
renormalisation), times forward and forward+backward of
  (a) naive PyTorch: loop over experts, index_select, index_add_;
  (b) torch._grouped_mm with tokens sorted by expert (torchtitan style);
  (c) MoEBlaze through its Python binding (moeblaze.torch.MoE) on the same torch tensors, on the
      engine --engine names (auto: the library's choice, reported in the "impl" column);
next to a dense bf16 matmul of the same FLOPs (the ceiling). Activation memory: the unique
storages saved for backward (torch.autograd.graph.saved_tensors_hooks), excluding x, the
logits and the parameters; for MoEBlaze that is its saved buffer (an autograd-invisible byte
buffer, counted by its size). Writes JSON (--json) and prints a markdown table.

Usage: MOEBLAZE_LIBRARY=build/src/libmoeblaze.so.0 python3 perf/torch_baselines.py [--only conf1,conf3]
       [--configs paper|modern|FILE] [--engine auto|fused|cublaslt] [--skip-naive] [--json FILE]
"""
import argparse
import json
import math
import os
import sys

import torch
import torch.nn.functional as F

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "bindings", "python"))
import moeblaze  # noqa: E402
import moeblaze.torch as mbt  # noqa: E402
from cuda_timing import median_ms  # noqa: E402


def up_proj(mm, x, w_up):
    """act of the up projection; w_up is W (SiLU) or (W1, W3) (SwiGLU, torchtitan style:
    separate contiguous gate and up weights, two matmuls)."""
    if isinstance(w_up, tuple):
        return F.silu(mm(x, w_up[0])) * mm(x, w_up[1])
    return F.silu(mm(x, w_up))


def route(logits, k):
    probs = torch.softmax(logits.float(), dim=-1)
    gates, ids = torch.topk(probs, k, dim=-1)
    return gates, ids


def naive_moe(x, logits, w_up, wd, k):
    L, E = logits.shape
    gates, ids = route(logits, k)
    flat_ids = ids.reshape(-1)
    tok = torch.arange(L, device=x.device).repeat_interleave(k)
    flat_g = gates.reshape(-1)
    y = torch.zeros_like(x)
    for e in range(E):
        sel = (flat_ids == e).nonzero().squeeze(1)
        t = tok.index_select(0, sel)
        xe = x.index_select(0, t)
        we = tuple(w[e] for w in w_up) if isinstance(w_up, tuple) else w_up[e]
        o = up_proj(torch.matmul, xe, we) @ wd[e]
        y = y.index_add(0, t, o * flat_g.index_select(0, sel).unsqueeze(1).to(o.dtype))
    return y


def grouped_mm_moe(x, logits, w_up, wd, k):
    L, E = logits.shape
    gates, ids = route(logits, k)
    flat_ids = ids.reshape(-1)
    order = torch.argsort(flat_ids, stable=True)
    tok = torch.arange(L, device=x.device).repeat_interleave(k).index_select(0, order)
    g = gates.reshape(-1).index_select(0, order)
    counts = torch.bincount(flat_ids, minlength=E)
    offs = torch.cumsum(counts, 0).to(torch.int32)
    xs = x.index_select(0, tok)
    gmm = lambda a, w: torch._grouped_mm(a, w, offs=offs)  # noqa: E731
    o = gmm(up_proj(gmm, xs, w_up), wd)
    return torch.zeros_like(x).index_add(0, tok, o * g.unsqueeze(1).to(o.dtype))


class SavedBytes:
    """Counts unique storages packed for backward, except the excluded tensors'."""

    def __init__(self, exclude):
        self.exclude = {t.untyped_storage().data_ptr() for t in exclude}
        self.seen = {}

    def pack(self, t):
        st = t.untyped_storage()
        if st.data_ptr() not in self.exclude:
            self.seen[st.data_ptr()] = st.nbytes()
        return t

    def total(self):
        return sum(self.seen.values())


def dense_ms(flops, reps):
    n = 8192
    f0 = 2.0 * n ** 3
    count = max(1, round(flops / f0))
    if flops < f0:
        n = max(256, int(round((flops / 2) ** (1 / 3) / 256)) * 256)
        count = 1
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)

    def run():
        for _ in range(count):
            torch.matmul(a, b)
    return median_ms(run, reps) * flops / (2.0 * n ** 3 * count)


ENGINES = {"auto": moeblaze.Engine.AUTO, "fused": moeblaze.Engine.CUDA_FUSED,
           "cublaslt": moeblaze.Engine.CUDA_CUBLASLT}
ENGINE_NAMES = {int(moeblaze.Engine.CUDA_FUSED): "fused", int(moeblaze.Engine.CUDA_CUBLASLT): "cublaslt"}


def layer_shape(c):
    """One config of either file: the paper's (h = 4 d, SiLU and SwiGLU) or the modern ones."""
    if "experts" in c:
        return dict(name=c["name"], d=c["d"], E=c["experts"], k=c["k"], L=c["batch"] * c["seq"], h=4 * c["d"],
                    activations=("silu", "swiglu"))
    return dict(name=c["name"], d=c["d"], E=c["E"], k=c["K"], L=c["T"], h=c["n"], activations=("swiglu",))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--configs", default="paper", help="paper, modern or a JSON file of either kind")
    ap.add_argument("--engine", default="auto", choices=sorted(ENGINES))
    ap.add_argument("--only", default=None)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--json", default=None)
    ap.add_argument("--skip-naive", action="store_true")
    args = ap.parse_args()
    path = {"paper": "paper-configs.json", "modern": "modern-configs.json"}.get(args.configs)
    with open(os.path.join(HERE, "configs", path) if path else args.configs) as f:
        cfgs = [layer_shape(c) for c in json.load(f)["configs"]]
    if args.only:
        keep = set(args.only.split(","))
        cfgs = [c for c in cfgs if c["name"] in keep]
    torch.manual_seed(0)
    dev = torch.device("cuda")
    results = []
    print("# %s; torch %s; %s" % (moeblaze.get_build_info() if hasattr(moeblaze, "get_build_info") else "moeblaze",
                                  torch.__version__, torch.cuda.get_device_name()))
    print("| config | act | dense ms | impl | fwd ms | fwd+bwd ms | TFLOP/s | % of dense | activation MiB | peak extra MiB |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for c in cfgs:
        d, E, k, L, h = c["d"], c["E"], c["k"], c["L"], c["h"]
        for act in c["activations"]:
            gh = 2 * h if act == "swiglu" else h
            flops = 3 * 2 * L * k * d * h * (3 if act == "swiglu" else 2)
            x = torch.randn(L, d, device=dev, dtype=torch.bfloat16, requires_grad=True)
            logits = torch.randn(L, E, device=dev, dtype=torch.float32, requires_grad=True)
            wgu = (torch.randn(E, d, gh, device=dev, dtype=torch.bfloat16) / math.sqrt(d)).requires_grad_()
            wd = (torch.randn(E, h, d, device=dev, dtype=torch.bfloat16) / math.sqrt(h)).requires_grad_()
            dy = torch.randn(L, d, device=dev, dtype=torch.bfloat16)
            # The PyTorch baselines hold SwiGLU's gate and up weights as two contiguous tensors
            # (torchtitan style); MoEBlaze takes them as one [E, d, 2h] tensor. Same values.
            if act == "swiglu":
                w_up = (wgu.detach()[:, :, :h].contiguous().requires_grad_(),
                        wgu.detach()[:, :, h:].contiguous().requires_grad_())
            else:
                w_up = wgu
            mb = mbt.MoE(num_experts=E, top_k=k, hidden_size=d, ffn_hidden_size=h, max_tokens=L,
                         activation=act, activation_dtype="bf16", weight_dtype="bf16", engine=ENGINES[args.engine])
            engine = ENGINE_NAMES.get(int(mb.handle_for(dev).get("engine")), "?")
            impls = [("moeblaze", lambda: mb(x, wgu, wd, router_logits=logits)),
                     ("grouped_mm", lambda: grouped_mm_moe(x, logits, w_up, wd, k))]
            if not args.skip_naive:
                impls.append(("naive", lambda: naive_moe(x, logits, w_up, wd, k)))
            ceiling = dense_ms(flops, 5)

            def clear_grads():
                for t in [x, logits, wgu, wd] + (list(w_up) if isinstance(w_up, tuple) else []):
                    t.grad = None
            for name, fn in impls:
                def fwd():
                    with torch.no_grad():
                        fn()

                def fwd_bwd():
                    y = fn()
                    torch.autograd.backward(y, dy)
                    clear_grads()
                t_f = median_ms(fwd, args.reps)
                t_fb = median_ms(fwd_bwd, args.reps)
                counter = SavedBytes([x, logits, wgu, wd] + (list(w_up) if isinstance(w_up, tuple) else []))
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
                base = torch.cuda.memory_allocated()
                with torch.autograd.graph.saved_tensors_hooks(counter.pack, lambda t: t):
                    y = fn()
                saved = counter.total()  # MoEBlaze's saved buffer is a saved tensor: counted here
                torch.autograd.backward(y, dy)
                torch.cuda.synchronize()
                peak = torch.cuda.max_memory_allocated() - base
                del y
                clear_grads()
                r = dict(config=c["name"], activation=act, impl=name, tokens=L, fwd_ms=t_f, fwd_bwd_ms=t_fb,
                         tflops=flops / t_fb * 1e-9, dense_ms=ceiling, dense_ratio=ceiling / t_fb,
                         activation_bytes=saved, peak_extra_bytes=peak, engine=engine if name == "moeblaze" else None)
                results.append(r)
                label = name + (" (%s)" % engine if name == "moeblaze" else "")
                print("| %s | %s | %.3f | %s | %.3f | %.3f | %.0f | %.1f | %.0f | %.0f |" % (
                    c["name"], act, ceiling, label, t_f, t_fb, r["tflops"], 100 * r["dense_ratio"],
                    saved / 2**20, peak / 2**20), flush=True)
            mb.close()
            del x, logits, wgu, wd, dy, w_up
            torch.cuda.empty_cache()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
