#!/usr/bin/env python3
"""MoEBlaze beside SonicMoE and torch._grouped_mm on SonicMoE's own configs, one GPU, one run.

Each config (T, d, n, E, K) is one SwiGLU MoE layer in bf16 with the router inside the timed
layer, as SonicMoE's benchmarks/moe-cute.py times it: logits = x W_r^T, softmax top-K, the
expert MLPs, the gate-weighted combine; fwd+bwd computes the gradients of x, the expert weights
and W_r. FLOPs are counted as SonicMoE counts them (fwd 6 T n d K, fwd+bwd 18 T n d K; the
router GEMM is timed, not counted).

  - MoEBlaze: through ``moeblaze.torch.MoE`` (what a PyTorch user calls), engine AUTO;
  - torch._grouped_mm: tokens sorted by expert, torchtitan style, the same router;
  - SonicMoE: not run here (it needs its own environment; scripts/gpu-check.sh sidebyside runs
    its own benchmark first when a SonicMoE bundle and its run_sonic.sh are carried in .peers/);
    its output lines (``sonic T,d,n,E,K fwd_ms bwd_ms fwdbwd_tflops``) are read from --sonic FILE
    when given, and must come from the same GPU in the same session.

Each step is timed as SonicMoE's benchmark times it: triton's do_bench (an L2 flush before every
step, per-step CUDA events, no synchronisation between steps, ~500 ms of steps), so the host may
enqueue ahead of the GPU, as in a training loop; MoEBlaze's figure is the median of those steps
(SonicMoE's benchmark prints their mean); the ratios to SonicMoE use these figures. Beside them,
the median of --reps steps each timed alone and synchronised (the host's latency to the first
kernel included: what a step costs when nothing is queued before it). The 8192^3 dense bf16 GEMM
is timed next to each config, and every rate is also given as a % of it. Peak extra memory = the
step's peak allocation above the inputs and parameters. --profile CFG prints the CUDA kernels of
one MoEBlaze fwd+bwd.

Usage: python3 perf/side_by_side.py [--configs T,d,n,E,K ...] [--sonic FILE] [--reps 20]
       [--json FILE] [--profile T,d,n,E,K]
"""
import argparse
import json
import os
import sys

import torch
import torch.nn.functional as F

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "bindings", "python"))
import moeblaze  # noqa: E402
import moeblaze.torch as mbt  # noqa: E402
from cuda_timing import median_ms, queued_median_ms  # noqa: E402

SONIC_CONFIGS = ["40960,768,256,128,8", "24576,1536,256,128,8", "24576,1536,1024,32,2", "32768,4096,512,128,8",
                 "32768,4096,1024,64,4", "32768,4096,1024,128,8", "32768,4096,2048,64,4", "32768,2048,768,128,8",
                 "32768,2048,1024,64,8"]
ENGINE_NAMES = {int(moeblaze.Engine.CUDA_FUSED): "fused", int(moeblaze.Engine.CUDA_CUBLASLT): "cublaslt"}


class Timer:
    """Steps timed alone and synchronised after an L2 flush (``median_ms``), or queued as
    triton's do_bench times them (``queued_ms``)."""

    def __init__(self):
        self.flush_buf = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")

    def median_ms(self, fn, reps, warmup=3):
        return median_ms(fn, reps, warmup, before=self.flush_buf.zero_)

    def queued_ms(self, fn):
        ms, self.queued_by = queued_median_ms(fn)
        return ms


def queued_timer_name():
    try:
        import triton.testing  # noqa: F401
        return "triton.testing.do_bench"
    except ImportError:
        return "do_bench's loop written out, triton not installed"


def dense_tflops(timer):
    n = 8192
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    return 2.0 * n ** 3 / timer.queued_ms(lambda: torch.matmul(a, b)) * 1e-9


def grouped_mm_layer(x, w_router, w1, w3, w2, k):
    """torchtitan-style: router GEMM, softmax top-k renormalised (SonicMoE's softmax over the K
    picked logits), tokens sorted by expert, torch._grouped_mm."""
    logits = x @ w_router.t()
    gates, ids = torch.topk(torch.softmax(logits.float(), dim=-1), k, dim=-1)
    gates = gates / gates.sum(dim=-1, keepdim=True)
    flat = ids.reshape(-1)
    order = torch.argsort(flat, stable=True)
    tok = torch.arange(x.shape[0], device=x.device).repeat_interleave(k).index_select(0, order)
    g = gates.reshape(-1).index_select(0, order)
    offs = torch.cumsum(torch.bincount(flat, minlength=w1.shape[0]), 0).to(torch.int32)
    xs = x.index_select(0, tok)
    h = F.silu(torch._grouped_mm(xs, w1, offs=offs)) * torch._grouped_mm(xs, w3, offs=offs)
    o = torch._grouped_mm(h, w2, offs=offs)
    return torch.zeros_like(x).index_add(0, tok, o * g.unsqueeze(1).to(o.dtype))


def parse_cfg(s):
    T, d, n, E, K = (int(v) for v in s.split(","))
    return T, d, n, E, K


def read_sonic(path):
    out = {}
    if not path:
        return out
    with open(path) as f:
        for line in f:
            p = line.split()
            if len(p) >= 5 and p[0] == "sonic" and p[2] != "NA":
                out[p[1]] = dict(fwd_ms=float(p[2]), bwd_ms=float(p[3]), tflops=float(p[4]))
    return out


def peak_extra(fn, grads):
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    fn()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    for t in grads:
        t.grad = None
    return peak


def profile(cfg):
    T, d, n, E, K = parse_cfg(cfg)
    x, wr, wgu, wd, dy = make_inputs(T, d, n, E)
    mb = mbt.MoE(num_experts=E, top_k=K, hidden_size=d, ffn_hidden_size=n, max_tokens=T, activation="swiglu",
                 activation_dtype="bf16", weight_dtype="bf16", normalize_topk=1)
    step = moeblaze_step(mb, x, wr, wgu, wd, dy)
    for _ in range(3):
        step()
    torch.cuda.synchronize()
    host_profile(step)
    from torch.profiler import ProfilerActivity, profile as prof
    flush = Timer().flush_buf
    with prof(activities=[ProfilerActivity.CUDA]) as p:  # CPU events would slow the host it measures
        flush.zero_()  # as the timed steps: the host enqueues while the GPU flushes L2
        step()
        torch.cuda.synchronize()
    idle_gaps(p)
    rows = {}
    kernels = sorted((e for e in p.events() if e.device_type == torch.autograd.DeviceType.CUDA),
                     key=lambda e: e.time_range.start)
    for e in kernels[1:]:  # not the flush
        r = rows.setdefault(e.name, [0, 0.0])
        r[0] += 1
        r[1] += e.device_time_total / 1000.0
    total = sum(v[1] for v in rows.values())
    print("# profile of one MoEBlaze fwd+bwd at %s: %.3f ms of GPU time" % (cfg, total))
    print("| kernel | calls | ms |")
    print("|---|---|---|")
    for name, (calls, ms) in sorted(rows.items(), key=lambda kv: -kv[1][1]):
        print("| %s | %d | %.3f |" % (name[:110], calls, ms))
    print("# the step's kernels in order (over 5 us; a template's arguments after the name)")
    for e in kernels[1:]:
        if e.device_time_total >= 5:
            print("%8.3f ms  %s" % (e.device_time_total / 1000.0, short_kernel_name(e.name)))
    mb.close()


def short_kernel_name(name):
    """A kernel's own name and its template arguments, without namespaces and parameter lists."""
    name = name.replace("(anonymous namespace)::", "")
    head = name[:name.find(">(") + 1] if ">(" in name else name.split("(")[0]
    for ns in ("moeblaze::v0::", "gemm::sm90::", "grouped_gemm_detail::", "weight_grad_detail::", "routing::",
               "combine::", "experts::", "cuda::"):
        head = head.replace(ns, "")
    return head[:200]


def idle_gaps(p, top=12):
    """Where the GPU waits for the host within one step: the step's span from the end of the
    L2 flush to its last kernel, the time no kernel or copy runs, and the largest gaps with the
    work on either side."""
    ev = sorted((e for e in p.events() if e.device_type == torch.autograd.DeviceType.CUDA),
                key=lambda e: e.time_range.start)
    if not ev:
        return
    flush_end = ev[0].time_range.end  # the first kernel is the flush
    ev = [e for e in ev if e.time_range.start >= flush_end]
    gaps, end, prev = [], flush_end, "(L2 flush)"
    for e in ev:
        if e.time_range.start > end:
            gaps.append((e.time_range.start - end, prev, e.name))
        if e.time_range.end > end:
            end, prev = e.time_range.end, e.name
    span = (end - flush_end) / 1000.0
    idle = sum(g[0] for g in gaps) / 1000.0
    print("# one step from the end of the L2 flush to its last kernel: %.3f ms, of it %.3f ms with the GPU idle "
          "(%d gaps)" % (span, idle, len(gaps)))
    print("| idle us | after | before |")
    print("|---|---|---|")
    for us, a, b in sorted(gaps, reverse=True)[:top]:
        print("| %.1f | %s | %s |" % (us, a[:60], b[:60]))


def host_profile(step, reps=20):
    """Where the host's time goes: one fwd+bwd enqueued (GPU idle, synchronised before and
    after), split into the library calls and the rest (Python, torch, the binding), and when
    each library call starts and ends after the step starts (median over the steps)."""
    import statistics
    import time
    spent, marks = {}, {}
    start = [0.0]

    def timed(name, fn):
        def wrapper(*a, **kw):
            t0 = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                t1 = time.perf_counter()
                spent[name] = spent.get(name, 0.0) + t1 - t0
                marks.setdefault(name, []).append((t0 - start[0], t1 - start[0]))
        return wrapper
    H = moeblaze.Handle
    saved = {n: getattr(H, n) for n in ("forward", "backward", "workspace_size", "saved_size", "assert_status")}
    for n, fn in saved.items():
        setattr(H, n, timed(n, fn))
    try:
        total = 0.0
        for _ in range(reps):
            torch.cuda.synchronize()
            t0 = start[0] = time.perf_counter()
            step()
            total += time.perf_counter() - t0
        torch.cuda.synchronize()
    finally:
        for n, fn in saved.items():
            setattr(H, n, fn)
    print("# host time per fwd+bwd enqueue: %.3f ms; of it in Handle.%s" % (
        1e3 * total / reps, ", ".join("%s %.3f ms" % (n, 1e3 * v / reps) for n, v in sorted(spent.items()))))
    calls = sorted((statistics.median(a for a, _ in m[i::len(m) // reps]), statistics.median(b for _, b in m[i::len(m) // reps]), n)
                   for n, m in marks.items() for i in range(len(m) // reps))
    print("# host timeline of a step (ms from its start, medians): " +
          ", ".join("%s %.3f-%.3f" % (n, a * 1e3, b * 1e3) for a, b, n in calls))


def make_inputs(T, d, n, E):
    dev = torch.device("cuda")
    x = torch.randn(T, d, device=dev, dtype=torch.bfloat16).requires_grad_()
    wr = (torch.randn(E, d, device=dev, dtype=torch.bfloat16) * d ** -0.5).requires_grad_()
    wgu = (torch.randn(E, d, 2 * n, device=dev, dtype=torch.bfloat16) * d ** -0.5).requires_grad_()
    wd = (torch.randn(E, n, d, device=dev, dtype=torch.bfloat16) * n ** -0.5).requires_grad_()
    dy = torch.randn(T, d, device=dev, dtype=torch.bfloat16)
    return x, wr, wgu, wd, dy


def moeblaze_step(mb, x, wr, wgu, wd, dy):
    def step():
        y = mb(x, wgu, wd, router_weight=wr)
        torch.autograd.backward(y, dy)
        x.grad = wr.grad = wgu.grad = wd.grad = None
    return step


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--configs", nargs="*", default=SONIC_CONFIGS)
    ap.add_argument("--sonic", default=None, help="run_sonic.sh output of the same session")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--json", default=None)
    ap.add_argument("--profile", default=None, help="T,d,n,E,K: print the kernels of one MoEBlaze fwd+bwd")
    ap.add_argument("--skip-grouped-mm", action="store_true")
    args = ap.parse_args()
    if args.reps < 20:
        sys.exit("--reps must be at least 20")
    if args.profile:
        profile(args.profile)
        return
    torch.manual_seed(0)
    sonic = read_sonic(args.sonic)
    timer = Timer()
    print("# %s; torch %s; %s" % (moeblaze.get_build_info(), torch.__version__, torch.cuda.get_device_name()))
    print("# bf16 SwiGLU, router inside the layer; TFLOP/s as SonicMoE counts them (18 T n d K per fwd+bwd)")
    print("# queued: timed as SonicMoE's benchmark times itself (%s: L2 flushed before every step, no "
          "synchronisation between steps, the median of ~500 ms of steps; SonicMoE prints their mean); alone: the median of %d steps each timed alone "
          "and synchronised (the host's latency to the first kernel included)" % (
              queued_timer_name(), args.reps))
    print("| T, d, n, E, K | dense TFLOP/s | MoEBlaze fwd ms | MoEBlaze fwd+bwd ms, queued / alone (engine) | "
          "MoEBlaze TFLOP/s (% of dense) | SonicMoE TFLOP/s (% of dense) | MoEBlaze / SonicMoE | grouped_mm "
          "TFLOP/s | peak extra MiB (MoEBlaze / grouped_mm) |")
    print("|---|---|---|---|---|---|---|---|---|")
    results = []
    for cfg in args.configs:
        T, d, n, E, K = parse_cfg(cfg)
        flops_fb = 18.0 * T * n * d * K
        dense = dense_tflops(timer)
        x, wr, wgu, wd, dy = make_inputs(T, d, n, E)
        params = [x, wr, wgu, wd]
        mb = mbt.MoE(num_experts=E, top_k=K, hidden_size=d, ffn_hidden_size=n, max_tokens=T, activation="swiglu",
                     activation_dtype="bf16", weight_dtype="bf16", normalize_topk=1)
        engine = ENGINE_NAMES.get(int(mb.handle_for(x.device).get("engine")), "?")
        step = moeblaze_step(mb, x, wr, wgu, wd, dy)

        def fwd():
            with torch.no_grad():
                mb(x, wgu, wd, router_weight=wr)
        mb_fwd = timer.queued_ms(fwd)
        mb_fb = timer.queued_ms(step)
        mb_fb_alone = timer.median_ms(step, args.reps)
        mb_peak = peak_extra(step, params)
        r = dict(config=cfg, dense_tflops=dense, moeblaze_engine=engine, moeblaze_fwd_ms=mb_fwd,
                 moeblaze_fwd_bwd_ms=mb_fb, moeblaze_fwd_bwd_alone_ms=mb_fb_alone,
                 moeblaze_tflops=flops_fb / mb_fb * 1e-9, moeblaze_peak_extra=mb_peak, timed_by=timer.queued_by)
        mb.close()
        if not args.skip_grouped_mm:
            w1 = wgu.detach()[:, :, :n].contiguous().requires_grad_()
            w3 = wgu.detach()[:, :, n:].contiguous().requires_grad_()

            def gmm_step():
                y = grouped_mm_layer(x, wr, w1, w3, wd, K)
                torch.autograd.backward(y, dy)
                x.grad = wr.grad = w1.grad = w3.grad = wd.grad = None
            g_fb = timer.queued_ms(gmm_step)
            r.update(grouped_mm_fwd_bwd_ms=g_fb, grouped_mm_tflops=flops_fb / g_fb * 1e-9,
                     grouped_mm_peak_extra=peak_extra(gmm_step, params + [w1, w3]))
            w1 = w3 = None
        s = sonic.get(cfg)
        if s:
            r.update(sonic_tflops=s["tflops"], sonic_fwd_ms=s["fwd_ms"], sonic_bwd_ms=s["bwd_ms"])
        results.append(r)
        pct = lambda v: 100.0 * v / dense  # noqa: E731
        print("| %s | %.0f | %.3f | %.3f / %.3f (%s) | %.1f (%.1f%%) | %s | %s | %s | %.0f / %s |" % (
            cfg.replace(",", ", "), dense, mb_fwd, mb_fb, mb_fb_alone, engine, r["moeblaze_tflops"], pct(r["moeblaze_tflops"]),
            "%.1f (%.1f%%)" % (s["tflops"], pct(s["tflops"])) if s else "not run",
            "%.2fx" % (r["moeblaze_tflops"] / s["tflops"]) if s else "-",
            "%.1f" % r["grouped_mm_tflops"] if "grouped_mm_tflops" in r else "-",
            mb_peak / 2**20, "%.0f" % (r["grouped_mm_peak_extra"] / 2**20) if "grouped_mm_peak_extra" in r else "-"),
            flush=True)
        x = wr = wgu = wd = dy = params = step = None
        torch.cuda.empty_cache()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
