#!/usr/bin/env python3
"""The largest MoE training step that fits one GPU: a binary search over the token count L.

For one layer shape (default: the paper's conf4 with SwiGLU, d=2048, h=8192, E=16, k=4, bf16)
it finds, in one run on one GPU, the largest L (to a granularity) for which a full training
step runs without running out of memory:
  forward (routing from bf16 logits, which need a gradient), then backward from a given dy,
  producing dx, d logits and both expert weight gradients.
Contenders:
  grouped_mm        plain torch._grouped_mm MoE (tokens sorted by expert, torchtitan style)
  moeblaze:<engine>:<policy>  MoEBlaze through its Python binding, e.g. fused:preact,
                    fused:recompute, cublaslt:preact.
Every contender holds the same caller tensors (weights and their gradients, x, logits, y, dy,
dx); its own peak is whatever else it allocates through PyTorch's caching allocator (the
MoEBlaze binding takes its workspace and saved buffer from it too). A step "fits" when it
raises no out-of-memory error; torch.cuda.max_memory_allocated gives its peak.

Usage: MOEBLAZE_LIBRARY=build/src/libmoeblaze.so.0 python3 perf/max_tokens.py \
           [--only grouped_mm,moeblaze:fused:preact] [--granularity 8192] [--json out.json]
"""
import argparse
import json
import os
import sys
import time

import torch
import torch.nn.functional as F

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "bindings", "python"))
import moeblaze  # noqa: E402
import moeblaze.torch as mbt  # noqa: E402

POLICIES = {"preact": moeblaze.SavePolicy.PREACT, "recompute": moeblaze.SavePolicy.RECOMPUTE_UP,
            "all": moeblaze.SavePolicy.ALL}
ENGINES = {"fused": moeblaze.Engine.CUDA_FUSED, "cublaslt": moeblaze.Engine.CUDA_CUBLASLT,
           "auto": moeblaze.Engine.AUTO}


def grouped_mm_step(x, logits, w, k):
    """A plain torch._grouped_mm SwiGLU MoE (separate gate and up weights, as torchtitan)."""
    w1, w3, w2 = w
    L, E = logits.shape
    probs = torch.softmax(logits.float(), dim=-1)
    gates, ids = torch.topk(probs, k, dim=-1)
    flat = ids.reshape(-1)
    order = torch.argsort(flat, stable=True)
    tok = torch.arange(L, device=x.device).repeat_interleave(k).index_select(0, order)
    g = gates.reshape(-1).index_select(0, order)
    offs = torch.cumsum(torch.bincount(flat, minlength=E), 0).to(torch.int32)
    xs = x.index_select(0, tok)
    h = F.silu(torch._grouped_mm(xs, w1, offs=offs)) * torch._grouped_mm(xs, w3, offs=offs)
    o = torch._grouped_mm(h, w2, offs=offs)
    return torch.zeros_like(x).index_add(0, tok, o * g.unsqueeze(1).to(o.dtype))


class Contender:
    def __init__(self, name, shape, max_tokens):
        self.name = name
        d, h, E, k = shape["d"], shape["h"], shape["E"], shape["k"]
        self.k = k
        dev, bf = "cuda", torch.bfloat16
        if name == "grouped_mm":
            self.w = [torch.randn(E, d, h, device=dev, dtype=bf).mul_(d ** -0.5).requires_grad_(),
                      torch.randn(E, d, h, device=dev, dtype=bf).mul_(d ** -0.5).requires_grad_(),
                      torch.randn(E, h, d, device=dev, dtype=bf).mul_(h ** -0.5).requires_grad_()]
            self.layer = None
        else:
            _, engine, policy = name.split(":")
            self.w = [torch.randn(E, d, 2 * h, device=dev, dtype=bf).mul_(d ** -0.5).requires_grad_(),
                      torch.randn(E, h, d, device=dev, dtype=bf).mul_(h ** -0.5).requires_grad_()]
            self.layer = mbt.MoE(num_experts=E, top_k=k, hidden_size=d, ffn_hidden_size=h,
                                 max_tokens=max_tokens, activation=moeblaze.Activation.SWIGLU,
                                 activation_dtype="bf16", weight_dtype="bf16",
                                 save_policy=POLICIES[policy], engine=ENGINES[engine])
        for p in self.w:  # gradients live across steps, as in training
            p.grad = torch.zeros_like(p)

    def step(self, L, d, E):
        x = torch.randn(L, d, device="cuda", dtype=torch.bfloat16).requires_grad_()
        logits = torch.randn(L, E, device="cuda", dtype=torch.bfloat16).requires_grad_()
        dy = torch.randn(L, d, device="cuda", dtype=torch.bfloat16)
        if self.layer is None:
            y = grouped_mm_step(x, logits, self.w, self.k)
        else:
            y = self.layer(x, self.w[0], self.w[1], router_logits=logits)
        y.backward(dy)
        torch.cuda.synchronize()
        ok = bool(torch.isfinite(x.grad).all())
        del x, logits, dy, y
        return ok


def fits(c, L, shape):
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    t = time.time()
    try:
        ok = c.step(L, shape["d"], shape["E"])
    except torch.OutOfMemoryError:
        return False, 0, time.time() - t
    except RuntimeError as e:  # the binding's out-of-memory surfaces as a RuntimeError too
        if "out of memory" not in str(e).lower():
            raise
        return False, 0, time.time() - t
    finally:
        torch.cuda.empty_cache()
    if not ok:
        raise RuntimeError(f"{c.name}: non-finite dx at L = {L}")
    return True, torch.cuda.max_memory_allocated(), time.time() - t


def search(c, shape, gran, hi_cap):
    lo, lo_peak, hi = 0, 0, None
    L = 8 * gran
    while hi is None:  # grow until a step fails
        ok, peak, sec = fits(c, L, shape)
        print(f"  {c.name}: L = {L:>9}: {'fits, peak %.2f GiB' % (peak / 2**30) if ok else 'out of memory'} ({sec:.1f} s)",
              flush=True)
        if ok:
            lo, lo_peak = L, peak
            if L >= hi_cap:
                return lo, lo_peak, True
            L = min(2 * L, hi_cap)
        else:
            hi = L
    while hi - lo > gran:
        mid = (lo + hi) // 2 // gran * gran
        if mid <= lo:
            break
        ok, peak, sec = fits(c, mid, shape)
        print(f"  {c.name}: L = {mid:>9}: {'fits, peak %.2f GiB' % (peak / 2**30) if ok else 'out of memory'} ({sec:.1f} s)",
              flush=True)
        if ok:
            lo, lo_peak = mid, peak
        else:
            hi = mid
    return lo, lo_peak, False


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--only", default="grouped_mm,moeblaze:fused:preact,moeblaze:fused:recompute")
    ap.add_argument("--d", type=int, default=2048)
    ap.add_argument("--h", type=int, default=8192)
    ap.add_argument("--E", type=int, default=16)
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--granularity", type=int, default=8192)
    ap.add_argument("--cap", type=int, default=1 << 23, help="largest L tried")
    ap.add_argument("--json")
    a = ap.parse_args()
    shape = {"d": a.d, "h": a.h, "E": a.E, "k": a.k}
    total = torch.cuda.get_device_properties(0).total_memory
    print(f"# Largest training step that fits: {torch.cuda.get_device_name(0)}, {total / 2**30:.1f} GiB, "
          f"SwiGLU d={a.d} h={a.h} E={a.E} k={a.k} bf16, granularity {a.granularity} tokens", flush=True)
    rows = []
    for name in a.only.split(","):
        c = Contender(name, shape, a.cap)
        L, peak, capped = search(c, shape, a.granularity, a.cap)
        rows.append({"contender": name, "max_tokens": L, "peak_bytes": peak, "capped": capped})
        if c.layer is not None:
            c.layer.close()
        del c
        torch.cuda.empty_cache()
    base = next((r["max_tokens"] for r in rows if r["contender"] == "grouped_mm"), None)
    print("\n| contender | largest L | peak GiB at it | vs grouped_mm |\n|---|---|---|---|")
    for r in rows:
        ratio = f"{r['max_tokens'] / base:.2f}x" if base else "-"
        cap = " (cap)" if r["capped"] else ""
        print(f"| {r['contender']} | {r['max_tokens']}{cap} | {r['peak_bytes'] / 2**30:.2f} | {ratio} |")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"gpu": torch.cuda.get_device_name(0), "total_bytes": total, "shape": shape,
                       "granularity": a.granularity, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
