#!/usr/bin/env python3
"""Where one expert-parallel fwd+bwd step spends its time on rank 0: the step's time (CUDA
events, median of --steps), then every kernel of one profiled step in start order, with its start
and end in microseconds from the step's first kernel, its duration and its stream, so the gaps
and what runs beside what (the rows sent on the layer's second stream) can be read off; then
the kernel time per stream and the kernels summed by name; last, every rank's main kernels (the
exchanges, the local GEMMs, the combines) with their starts from the end of that rank's forward
counts exchange, to show where the ranks drift apart and which rank the others wait for.

Run it once with the rows beside the local GEMMs and once before them, to see what the overlap
costs and saves (scripts/gpu-check.sh epprofile does both):

  MOEBLAZE_EP_OVERLAP=1 torchrun --nproc_per_node=P perf/ep_step_profile.py [--shape qwen3-30b-a3b]
      [--tokens 16384] [--steps 20] [--list 80]
"""
import argparse
import collections
import functools
import json
import os
import statistics

import torch
import torch.distributed as dist

# The shapes and the binding as perf/ep_exchange_bw.py sets them up (perf/ is the script's directory).
from ep_exchange_bw import SHAPES, MoELayer, fwd_bwd_step  # noqa: E402


# The step's main kernels by what they do (the local experts' GEMMs, the exchanges, the combines),
# in start order: (label, start us from the end of the first counts exchange, duration us).
MAIN = [("exchange_counts", "counts"), ("metadata_kernel", "metadata"), ("dispatch_rows_by_expert", "rows"),
        ("dispatch_kernel", "rows and metadata"), ("act_backward_warpgroup", "dact GEMM + act backward"),
        ("grouped_gemm_kernel", "grouped GEMM"), ("weight_grad_kernel", "weight-gradient GEMM"),
        ("combine_rows_kernel<__nv_bfloat16, 8, true, true>", "combine into the peers"),
        ("return_kernel<true>", "return (and barrier)"), ("return_kernel<false>", "dx rows"),
        ("take_received_kernel", "received rows kept")]


def main_kernels(kernels):
    out, t0 = [], None
    for e in kernels:
        label = next((lab for pat, lab in MAIN if pat in e["name"]), None)
        if label is None or (label == "received rows kept" and e["dur"] < 50):
            continue
        if t0 is None and label == "counts":
            t0 = e["ts"] + e["dur"]
        if t0 is not None:
            out.append((label, e["ts"] - t0, e["dur"]))
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="qwen3-30b-a3b", choices=sorted(SHAPES))
    ap.add_argument("--tokens", type=int, default=16384)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--list", type=int, default=80, help="kernels listed in start order")
    args = ap.parse_args()
    dist.init_process_group("nccl")
    rank, P = dist.get_rank(), dist.get_world_size()
    dev = torch.device("cuda", int(os.environ.get("LOCAL_RANK", rank)))
    torch.cuda.set_device(dev)
    from torch.profiler import ProfilerActivity, profile

    d, h, E, k = SHAPES[args.shape]
    gen = torch.Generator(device=dev).manual_seed(100 + rank)
    x = torch.randn(args.tokens, d, device=dev, dtype=torch.bfloat16, generator=gen)
    dy = torch.randn(args.tokens, d, device=dev, dtype=torch.bfloat16, generator=gen)
    torch.manual_seed(0)  # the same router weight on every rank
    layer = MoELayer(d, h, E, k, dtype=torch.bfloat16, device=dev, normalize_topk=1, max_tokens=args.tokens,
                     ep_group=dist.group.WORLD)

    step = functools.partial(fwd_bwd_step, layer, x, dy)
    for _ in range(3):
        step()
    times = []
    for _ in range(args.steps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        dist.barrier()
        torch.cuda.synchronize()
        a.record()
        step()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b))
    dist.barrier()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    layer.close()
    # The kernels with their streams, from the profiler's trace (its event list has no stream).
    trace = os.path.join(os.environ.get("OUT", "/tmp"), "ep-step-trace-%d.json" % os.getpid())
    prof.export_chrome_trace(trace)
    with open(trace) as f:
        events = json.load(f)["traceEvents"]
    os.remove(trace)
    kernels = sorted((e for e in events if e.get("cat") == "kernel"), key=lambda e: e["ts"])
    # Every rank's main kernels, timed from the end of its forward counts exchange (where the
    # ranks leave a barrier together), so that where they drift apart can be read off.
    steps = [None] * P
    dist.all_gather_object(steps, (statistics.median(times), main_kernels(kernels)))
    if rank == 0:
        t0 = kernels[0]["ts"] if kernels else 0
        print("# %s (d %d, h %d, E %d, k %d), EP %d on %s, %d tokens per rank, MOEBLAZE_EP_OVERLAP=%s"
              % (args.shape, d, h, E, k, P, torch.cuda.get_device_name(dev), args.tokens,
                 os.environ.get("MOEBLAZE_EP_OVERLAP", "(the rule)")))
        print("step ms (rank 0, median of %d): %.3f" % (args.steps, statistics.median(times)))
        if kernels:
            end = max(e["ts"] + e["dur"] for e in kernels)
            print("profiled step: %.0f us from the first kernel's start to the last one's end" % (end - t0))
        print("\n| start us | end us | us | stream | kernel |\n|---|---|---|---|---|")
        for e in kernels[:args.list]:
            s = e["ts"] - t0
            print("| %.0f | %.0f | %.1f | %s | %s |" % (s, s + e["dur"], e["dur"], e.get("args", {}).get("stream", "?"),
                                                   e["name"][:110]))
        busy = collections.defaultdict(float)
        total = collections.defaultdict(float)
        count = collections.Counter()
        for e in kernels:
            busy[e.get("args", {}).get("stream", "?")] += e["dur"]
            total[e["name"][:110]] += e["dur"]
            count[e["name"][:110]] += 1
        print("\n| stream | kernel us |\n|---|---|")
        for stream, us in sorted(busy.items(), key=lambda kv: -kv[1]):
            print("| %s | %.1f |" % (stream, us))
        print("\n| kernel | calls | us |\n|---|---|---|")
        for name, us in sorted(total.items(), key=lambda kv: -kv[1]):
            print("| %s | %d | %.1f |" % (name, count[name], us))
        print("\nEvery rank: start and duration in us from the end of its forward counts exchange "
              "(step ms: %s)" % ", ".join("%.3f" % st[0] for st in steps))
        print("\n| kernel | " + " | ".join("rank %d" % r for r in range(P)) + " |\n|---|" + "---|" * P)
        for i, (label, _, _) in enumerate(steps[0][1]):
            cells = []
            for r in range(P):
                row = steps[r][1]
                cells.append("%.0f + %.0f" % row[i][1:] if i < len(row) and row[i][0] == label else "?")
            print("| %s | %s |" % (label, " | ".join(cells)))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
