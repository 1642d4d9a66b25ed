#!/usr/bin/env python3
"""Where a fwd+bwd step's GPU time goes, MoEBlaze beside SonicMoE, kernel by kernel, in one process.

Each layer runs the step loop SonicMoE's benchmark times (an L2 flush before every step, CUDA
events around each step, no synchronisation between steps) under the torch profiler (CUDA
activities only). Per layer and config it prints the event-timed median, and per step the span
from the end of its flush to its last kernel, the time some kernel runs in it and the idle rest
(the GPU waiting for the host), then the kernels' ms per step grouped by what they do (expert
GEMMs, activation, combine, router and routing, other) and the largest kernels by name. Both
layers run the same configs in the same process on the same GPU, so their kernel times compare
directly; the order is SonicMoE, MoEBlaze, MoEBlaze, SonicMoE, so that drift shows. With both, it
ends with one table of every config: both layers' runs, MoEBlaze's speed relative to SonicMoE's
by events and by kernel time, and the groups where they differ (perf/RESULTS.md quotes it).

MoEBlaze: ``moeblaze.torch.MoE`` as perf/side_by_side.py runs it (bf16 SwiGLU, router weight
inside the layer, engine AUTO). SonicMoE (--sonic): its ``moe_TC_softmax_topk_layer`` as its
benchmarks/moe-cute.py calls it, imported from a SonicMoE bundle carried in the git-ignored .peers/
(scripts/gpu-check.sh's ``kernels`` mode unpacks it and puts it on the path).

Usage: python3 perf/step_kernels.py [--sonic] [--steps 20] [--top 12] [--activation silu] [--timeline] T,d,n,E,K ...
"""
import argparse
import os
import statistics
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import side_by_side as sbs  # noqa: E402
import moeblaze.torch as mbt  # noqa: E402

# What a kernel does, by the first pattern its name contains (both layers' kernels).
GROUPS = [
    ("expert GEMMs", ("grouped_gemm", "act_backward_warpgroup", "weight_grad_kernel", "HopperWgmma_MoE")),
    ("activation", ("activation_backward", "activation_forward")),
    ("combine", ("combine_rows", "token_gather_sum")),
    ("router and routing", ("nvjet", "route_tokens", "router_backward", "loss_", "logits", "routing::", "TopK_Softmax",
                            "softmax_bwd", "radix_sort", "count_cumsum", "sgemm", "gemm_f32")),
]


def group_of(name):
    for group, patterns in GROUPS:
        if any(p in name for p in patterns):
            return group
    return "other"


def sonic_step(T, d, n, E, K):
    from sonicmoe import MoE
    from sonicmoe.enums import ActivationType
    from sonicmoe.functional import moe_TC_softmax_topk_layer
    torch.manual_seed(1111)
    act = ActivationType("swiglu")
    moe = MoE(num_experts=E, num_experts_per_tok=K, hidden_size=d, intermediate_size=n, activation_function=act,
              add_bias=False, std=0.02).to(dtype=torch.bfloat16).cuda()
    x = (0.2 * torch.randn(T, d, device="cuda", dtype=torch.bfloat16)).requires_grad_()
    dout = 0.2 * torch.randn_like(x)
    w1, w2, rw = moe.c_fc.weight, moe.c_proj.weight, moe.router.weight

    def step():
        o, _, _ = moe_TC_softmax_topk_layer(x, rw, w1.permute(1, 2, 0), None, w2.permute(1, 2, 0), None, moe.top_k,
                                            moe.stream_id, act, False)
        o.backward(dout, retain_graph=True)  # as moe-cute.py calls it
        x.grad = w1.grad = w2.grad = rw.grad = None
    return step, lambda: None


def moeblaze_step(T, d, n, E, K, activation="swiglu"):
    x, wr, wgu, wd, dy = sbs.make_inputs(T, d, n, E)
    if activation not in ("swiglu", "geglu"):  # one column block per expert: [E, d, n]
        wgu = wgu[:, :, :n].detach().contiguous().requires_grad_()
    mb = mbt.MoE(num_experts=E, top_k=K, hidden_size=d, ffn_hidden_size=n, max_tokens=T, activation=activation,
                 activation_dtype="bf16", weight_dtype="bf16", normalize_topk=1)
    return sbs.moeblaze_step(mb, x, wr, wgu, wd, dy), mb.close


# The L2 flush before each step: a fill of doubles, so that no kernel of either layer is taken for it.
FLUSH_KERNEL = "FillFunctor<double>"


def measure(step, steps):
    """(event median ms, per-step spans, busy and idle ms, kernel ms per step by name)."""
    from torch.profiler import ProfilerActivity, profile
    flush = torch.empty(32 << 20, dtype=torch.float64, device="cuda")
    for _ in range(3):
        step()
    torch.cuda.synchronize()
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(steps)]
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for start, end in events:
            flush.zero_()
            start.record()
            step()
            end.record()
        flush.zero_()
        torch.cuda.synchronize()
    median = statistics.median(s.elapsed_time(e) for s, e in events)
    kernels = sorted((k for k in prof.events() if k.device_type == torch.autograd.DeviceType.CUDA),
                     key=lambda k: k.time_range.start)
    flushes = [i for i, k in enumerate(kernels) if FLUSH_KERNEL in k.name]
    spans, busy, per_name, steps_seen = [], [], {}, []
    for a, b in zip(flushes, flushes[1:]):
        inside = kernels[a + 1:b]
        if not inside:
            continue
        t0 = kernels[a].time_range.end
        steps_seen.append([(k.name, k.time_range.start - t0, k.time_range.end - t0) for k in inside])
        spans.append((inside[-1].time_range.end - t0) / 1e3)
        covered, end = 0.0, t0  # the union of the kernels' intervals (a second stream may overlap)
        for k in inside:
            s0 = max(k.time_range.start, end)
            if k.time_range.end > s0:
                covered += k.time_range.end - s0
                end = k.time_range.end
            per_name[k.name] = per_name.get(k.name, 0.0) + (k.time_range.end - k.time_range.start) / 1e3
        busy.append(covered / 1e3)
    n = max(len(spans), 1)
    return median, spans, busy, {name: ms / n for name, ms in per_name.items()}, steps_seen


def print_timeline(steps_seen):
    """One step's kernels in launch order: each one's duration and the gap before it (from the
    end of the kernel before it, or of the L2 flush), medians over the steps whose sequence is
    the most common one; then the gaps' sum."""
    names = [tuple(n for n, _, _ in st) for st in steps_seen]
    common = max(set(names), key=names.count)
    same = [st for st, nm in zip(steps_seen, names) if nm == common]
    print("\n| # | gap us | kernel us | kernel |")
    print("|---|---|---|---|")
    total_gap = total = 0.0
    for i, name in enumerate(common):
        gap = statistics.median(st[i][1] - (st[i - 1][2] if i else 0.0) for st in same)
        dur = statistics.median(st[i][2] - st[i][1] for st in same)
        total_gap += max(gap, 0.0)
        total += dur
        print("| %d | %.1f | %.1f | %s |" % (i, gap, dur, sbs.short_kernel_name(name)[:100]))
    print("%d kernels (%d of %d steps alike): %.1f us in kernels, %.1f us of gaps between them"
          % (len(common), len(same), len(steps_seen), total, total_gap))


def report(layer, cfg, result, top):
    median, spans, busy, per_name = result[:4]
    idle = [s - b for s, b in zip(spans, busy)]
    print("\n## %s %s: %.3f ms per step (event median); span %.3f, kernels busy %.3f, idle %.3f ms (medians of %d steps)"
          % (layer, cfg, median, statistics.median(spans), statistics.median(busy), statistics.median(idle), len(spans)))
    groups = {}
    for name, ms in per_name.items():
        groups[group_of(name)] = groups.get(group_of(name), 0.0) + ms
    print("| what | ms per step |")
    print("|---|---|")
    for group, _ in GROUPS + [("other", ())]:
        print("| %s | %.3f |" % (group, groups.get(group, 0.0)))
    print("| kernels in all | %.3f |" % sum(per_name.values()))
    print("largest kernels, ms per step:")
    for name, ms in sorted(per_name.items(), key=lambda kv: -kv[1])[:top]:
        print("  %7.3f  %s" % (ms, sbs.short_kernel_name(name)[:140]))
    sys.stdout.flush()
    return groups


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("configs", nargs="+", help="T,d,n,E,K")
    ap.add_argument("--sonic", action="store_true", help="SonicMoE beside MoEBlaze (its bundle on the path)")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--top", type=int, default=12)
    ap.add_argument("--activation", default="swiglu", help="MoEBlaze's activation (SonicMoE runs SwiGLU)")
    ap.add_argument("--timeline", action="store_true", help="MoEBlaze's kernels of one step in order, with the gaps")
    args = ap.parse_args()
    if args.steps < 5:
        sys.exit("--steps must be at least 5")
    print("# %s; torch %s" % (torch.cuda.get_device_name(), torch.__version__))
    if args.sonic:
        try:
            import sonicmoe.functional  # noqa: F401
        except Exception as e:  # the bundle missing or broken: MoEBlaze alone, said so
            print("# SonicMoE not importable (%s: %s): MoEBlaze alone" % (type(e).__name__, e))
            args.sonic = False
    layers = [("SonicMoE", sonic_step), ("MoEBlaze", moeblaze_step), ("MoEBlaze", moeblaze_step),
              ("SonicMoE", sonic_step)] if args.sonic else [("MoEBlaze", moeblaze_step)]
    table = []
    for cfg in args.configs:
        T, d, n, E, K = sbs.parse_cfg(cfg)
        summary = []
        for layer, make in layers:
            step, close = make(T, d, n, E, K, args.activation) if layer == "MoEBlaze" else make(T, d, n, E, K)
            result = measure(step, args.steps)
            summary.append((layer, result[0], report(layer, cfg, result, args.top), statistics.median(result[2])))
            if args.timeline and layer == "MoEBlaze":
                print_timeline(result[4])
            close()
            del step
            torch.cuda.empty_cache()
        print("\n### %s, ms per step: %s" % (cfg, "; ".join(
            "%s %.3f (GEMMs %.3f, activation %.3f, combine %.3f, router %.3f, other %.3f)" % (
                layer, ms, g.get("expert GEMMs", 0), g.get("activation", 0), g.get("combine", 0),
                g.get("router and routing", 0), g.get("other", 0)) for layer, ms, g, _ in summary)))
        table.append((cfg, summary))
    if args.sonic:
        print_side_by_side(table)


def print_side_by_side(table):
    """One row per config: both layers' runs, MoEBlaze's speed relative to SonicMoE's by the
    event medians and by the time kernels ran (the two differ where a layer leaves the GPU
    idle in this loop), and the groups where the time goes."""
    print("\n## Side by side, ms per step (MoEBlaze / SonicMoE above 1: MoEBlaze faster)\n")
    print("| T, d, n, E, K | SonicMoE ms | MoEBlaze ms | MoEBlaze / SonicMoE | by kernel time "
          "| expert GEMMs ms, SonicMoE / MoEBlaze | router and routing ms | activation ms (MoEBlaze) |")
    print("|---|---|---|---|---|---|---|---|")
    mean = statistics.mean
    for cfg, summary in table:
        runs = {layer: [r for r in summary if r[0] == layer] for layer in ("SonicMoE", "MoEBlaze")}
        s, m = runs["SonicMoE"], runs["MoEBlaze"]
        if not s or not m:
            continue
        group = lambda rs, g: [r[2].get(g, 0.0) for r in rs]  # noqa: E731
        lo_hi = lambda v: ("%.2f" % min(v), "%.2f" % max(v))  # noqa: E731
        span = lambda v: lo_hi(v)[0] if lo_hi(v)[0] == lo_hi(v)[1] else "-".join(lo_hi(v))  # noqa: E731
        print("| %s | %s | %s | %.3fx | %.3fx | %s / %s | %.3f / %.3f | %.3f |" % (
            cfg.replace(",", ", "), ", ".join("%.3f" % r[1] for r in s), ", ".join("%.3f" % r[1] for r in m),
            mean(r[1] for r in s) / mean(r[1] for r in m), mean(r[3] for r in s) / mean(r[3] for r in m),
            span(group(s, "expert GEMMs")), span(group(m, "expert GEMMs")), mean(group(s, "router and routing")),
            mean(group(m, "router and routing")), mean(group(m, "activation"))))
    sys.stdout.flush()


if __name__ == "__main__":
    main()
