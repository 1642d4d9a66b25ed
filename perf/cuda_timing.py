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
