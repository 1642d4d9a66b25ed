#!/usr/bin/env python3
"""What is alive at a step's memory peak: MoEBlaze (through moeblaze.torch) and the
torch._grouped_mm layer of perf/torch_baselines.py, on the same inputs.

One fwd+bwd per config and implementation, measured as perf/torch_baselines.py measures it
(peak allocation above the inputs and parameters, y kept alive through backward), with PyTorch's
allocator history recorded: the history is replayed to find the moment of the peak, and the
blocks alive then are printed, largest first, each with the Python line that allocated it.

Usage: MOEBLAZE_LIBRARY=build/src/libmoeblaze.so.0 python3 perf/peak_breakdown.py
       [--configs paper|modern|FILE] [--only conf1,conf2] [--activations silu,swiglu] [--top 8]
"""
import argparse
import json
import math
import os
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(HERE, "..", "bindings", "python"))
import moeblaze.torch as mbt  # noqa: E402
from moeblaze import Pass  # noqa: E402
from torch_baselines import grouped_mm_moe, layer_shape  # noqa: E402

MiB = float(1 << 20)


def where(frames):
    """The innermost frame of this repository's Python (the binding, perf/), else the first."""
    for f in frames:
        name = f.get("filename", "")
        if "moeblaze" in name or "/perf/" in name:
            return "%s:%d %s" % (os.path.basename(name), f.get("line", 0), f.get("name", ""))
    return "%s:%d" % (os.path.basename(frames[0]["filename"]), frames[0]["line"]) if frames else "?"


def live_at_peak(snapshot, base_live):
    """Replays the allocator trace: (peak bytes above the trace's start, blocks alive then)."""
    live, total, peak, at_peak = {}, 0, 0, {}
    for trace in snapshot["device_traces"]:
        for ev in trace:
            a = ev["action"]
            if a == "alloc":
                live[ev["addr"]] = (ev["size"], where(ev.get("frames", [])))
                total += ev["size"]
                if total > peak:
                    peak, at_peak = total, dict(live)
            elif a in ("free_requested",):
                if ev["addr"] in live:
                    total -= live.pop(ev["addr"])[0]
    return peak, at_peak


def step(fn, dy):
    y = fn()
    torch.autograd.backward(y, dy)
    torch.cuda.synchronize()
    return y


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--configs", default="paper")
    ap.add_argument("--only", default=None)
    ap.add_argument("--activations", default=None)
    ap.add_argument("--top", type=int, default=8)
    args = ap.parse_args()
    path = {"paper": "paper-configs.json", "modern": "modern-configs.json"}.get(args.configs)
    with open(os.path.join(HERE, "configs", path) if path else args.configs) as f:
        cfgs = [layer_shape(c) for c in json.load(f)["configs"]]
    if args.only:
        cfgs = [c for c in cfgs if c["name"] in set(args.only.split(","))]
    acts = set(args.activations.split(",")) if args.activations else None
    dev = torch.device("cuda")
    torch.manual_seed(0)
    for c in cfgs:
        d, E, k, L, h = c["d"], c["E"], c["k"], c["L"], c["h"]
        for act in c["activations"]:
            if acts and act not in acts:
                continue
            gh = 2 * h if act == "swiglu" else h
            x = torch.randn(L, d, device=dev, dtype=torch.bfloat16, requires_grad=True)
            logits = torch.randn(L, E, device=dev, dtype=torch.float32, requires_grad=True)
            wgu = (torch.randn(E, d, gh, device=dev, dtype=torch.bfloat16) / math.sqrt(d)).requires_grad_()
            wd = (torch.randn(E, h, d, device=dev, dtype=torch.bfloat16) / math.sqrt(h)).requires_grad_()
            dy = torch.randn(L, d, device=dev, dtype=torch.bfloat16)
            w_up = ((wgu.detach()[:, :, :h].contiguous().requires_grad_(),
                     wgu.detach()[:, :, h:].contiguous().requires_grad_()) if act == "swiglu" else wgu)
            mb = mbt.MoE(num_experts=E, top_k=k, hidden_size=d, ffn_hidden_size=h, max_tokens=L,
                         activation=act, activation_dtype="bf16", weight_dtype="bf16")
            params = [x, logits, wgu, wd] + (list(w_up) if isinstance(w_up, tuple) else [])
            for name, fn in (("moeblaze", lambda: mb(x, wgu, wd, router_logits=logits)),
                             ("grouped_mm", lambda: grouped_mm_moe(x, logits, w_up, wd, k))):
                del_y = step(fn, dy)  # warm: the handle, cuBLAS, the allocator's pools
                del del_y
                for t in params:
                    t.grad = None
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
                base = torch.cuda.memory_allocated()
                torch.cuda.memory._record_memory_history(max_entries=200000, stacks="python")
                y = step(fn, dy)
                snap = torch.cuda.memory._snapshot()
                torch.cuda.memory._record_memory_history(enabled=None)
                peak = torch.cuda.max_memory_allocated() - base
                replay_peak, blocks = live_at_peak(snap, base)
                del y
                for t in params:
                    t.grad = None
                grouped = {}
                for size, loc in blocks.values():
                    n, s = grouped.get(loc, (0, 0))
                    grouped[loc] = (n + 1, s + size)
                print("%s %s %s: peak extra %.0f MiB (replayed %.0f)" % (c["name"], act, name, peak / MiB,
                                                                         replay_peak / MiB))
                if name == "moeblaze":
                    hd = mb.handle_for(dev)
                    print("    size queries: saved %.1f, forward workspace %.1f, backward workspace %.1f MiB" % (
                        hd.saved_size(L) / MiB, hd.workspace_size(Pass.FORWARD_TRAINING, L) / MiB,
                        hd.workspace_size(Pass.BACKWARD, L) / MiB))
                for loc, (n, s) in sorted(grouped.items(), key=lambda kv: -kv[1][1])[:args.top]:
                    print("    %8.1f MiB  %3d block(s)  %s" % (s / MiB, n, loc))
                sys.stdout.flush()
            mb.close()
            del x, logits, wgu, wd, dy, w_up, params
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
