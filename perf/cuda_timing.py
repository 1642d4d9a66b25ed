"""The perf scripts' one step timer: the median of per-step CUDA-event times."""
import statistics

import torch


def median_ms(fn, reps, warmup=3, before=None):
    """Median milliseconds of ``fn()`` over ``reps`` steps after ``warmup``, each step timed
    alone by CUDA events and synchronised; ``before()`` runs untimed before every step (an L2
    flush, for instance)."""
    times = []
    for r in range(warmup + reps):
        if before is not None:
            before()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        if r >= warmup:
            times.append(start.elapsed_time(end))
    return statistics.median(times)


def queued_median_ms(fn, rep_ms=500, warmup_ms=5):
    """Median milliseconds of ``fn()`` timed in SonicMoE's benchmark's loop: triton's
    ``do_bench`` (an L2 flush before every step, per-step CUDA events, no synchronisation
    between steps, so the host may enqueue ahead of the GPU as in a training loop; steps for
    ~rep_ms, at least 20 for any step under 25 ms). Returns (ms, what timed it). Without
    triton, the same loop written out here."""
    try:
        from triton.testing import do_bench
    except ImportError:
        do_bench = None
    if do_bench is not None:
        return do_bench(fn, warmup=warmup_ms, rep=rep_ms, return_mode="median"), "triton.testing.do_bench"
    flush = torch.empty(256 << 20, dtype=torch.int8, device="cuda")
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(5):
        flush.zero_()
        fn()
    end.record()
    torch.cuda.synchronize()
    estimate = max(start.elapsed_time(end) / 5, 1e-3)
    for _ in range(max(1, int(warmup_ms / estimate))):
        fn()
    n = max(1, int(rep_ms / estimate))
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(n)]
    for s, e in events:
        flush.zero_()
        s.record()
        fn()
        e.record()
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) for s, e in events), "do_bench's loop (triton not installed)"
