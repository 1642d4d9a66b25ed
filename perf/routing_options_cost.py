"""What each routing option costs on the GPU: one MoE layer (moeblaze.torch, bf16 SwiGLU, router
weight inside the layer, AUTO engine) timed fwd+bwd with the plain routing of its model family and
with each option added alone (the expert score bias, group-limited top-k, the route scale, the
sequence-wise balance loss), then all together, and a token mask (alone and with the
sequence-wise loss) that masks nothing, so that its cost is its own. The variants run in interleaved rounds, each
step timed alone (median of --reps per round); the table gives the median over the rounds and
the change against the plain layer of the same rounds (the order rotates per round), and the GPU time of the routing kernels
(src/routing: top-k, losses, plan, router backward) per step from the torch profiler, whose
change is the option's own cost. The bias is zero, so that it changes no pick and the experts'
loads stay the plain layer's; group-limited routing changes the picks, and with them the loads
and the expert GEMMs' time, by design.

    python perf/routing_options_cost.py [--shapes qwen3,deepseek_v3] [--reps 20] [--rounds 3]
"""
import argparse
import statistics
import sys

import torch

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from cuda_timing import median_ms  # noqa: E402

# name: (T, d, n, E, k, score function, groups kept of groups, sequences)
SHAPES = {
    "qwen3": (32768, 2048, 768, 128, 8, "softmax", (4, 8), 8),
    "deepseek_v3": (8192, 7168, 2048, 256, 8, "sigmoid", (4, 8), 2),
}

VARIANTS = ["plain", "bias", "groups", "scale", "per-sequence loss", "all", "token mask",
            "token mask + per-sequence loss"]


def make_layer(shape, variant):
    from moeblaze.torch import MoELayer
    T, d, n, E, k, fn, (keep, groups), seqs = shape
    attrs = dict(score_function=fn, normalize_topk=1, aux_loss_coeff=1e-3)
    if variant in ("groups", "all"):
        attrs.update(num_expert_groups=groups, topk_groups=keep)
    if variant in ("scale", "all"):
        attrs.update(route_scale=2.5)
    layer = MoELayer(d, n, E, k, activation="swiglu", max_tokens=T, dtype=torch.bfloat16, device="cuda",
                     expert_bias=variant in ("bias", "all"),
                     balance_per_sequence=variant in ("per-sequence loss", "all", "token mask + per-sequence loss"),
                     **attrs)
    with torch.no_grad():
        for p in layer.parameters():
            p.normal_(0.0, d ** -0.5)
    return layer


def routing_kernel_ms(step, steps=3):
    """GPU milliseconds per step in the library's routing kernels (namespace routing::)."""
    from torch.profiler import ProfilerActivity, profile
    step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
    total_us = sum(e.device_time_total for e in prof.key_averages() if "routing::" in e.key)
    return total_us / 1e3 / steps


def step_of(layer, x, dy, mask=None):
    def step():
        y, aux, z = layer(x, token_mask=mask)
        torch.autograd.backward([y, aux], [dy, torch.ones_like(aux)])
        x.grad = None
        for p in layer.parameters():
            p.grad = None
    return step


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="qwen3,deepseek_v3")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--variants", default=",".join(VARIANTS), help="a subset of: " + ", ".join(VARIANTS))
    args = ap.parse_args()
    variants = args.variants.split(",")
    if "plain" not in variants:
        variants.insert(0, "plain")
    print("# %s" % torch.cuda.get_device_name())
    print("| shape (T, d, n, E, k) | variant | fwd+bwd ms (median of %d rounds) | vs plain | routing kernels ms "
          "per step | their change, %% of the plain step |" % args.rounds)
    print("|---|---|---|---|---|---|")
    for name in args.shapes.split(","):
        shape = SHAPES[name]
        T, d, n, E, k, _, _, seqs = shape
        x = torch.randn(seqs, T // seqs, d, device="cuda", dtype=torch.bfloat16).requires_grad_()
        dy = torch.randn_like(x)
        times = {v: [] for v in variants}
        # The token mask masks nothing: its cost is reading it, with every token's work unchanged.
        mask = torch.ones(x.shape[:-1], dtype=torch.bool, device="cuda")
        routing = {}
        for r in range(args.rounds):
            # One layer at a time (the large shapes' weights fill the GPU), in an order that
            # rotates each round, so no variant always runs first after a pause.
            for v in variants[r % len(variants):] + variants[:r % len(variants)]:
                layer = make_layer(shape, v)
                step = step_of(layer, x, dy, mask if v.startswith("token mask") else None)
                times[v].append(median_ms(step, args.reps))
                if r == 0:
                    routing[v] = routing_kernel_ms(step)
                del layer, step
                torch.cuda.empty_cache()
        plain = statistics.median(times["plain"])
        for v in variants:
            ms = statistics.median(times[v])
            print("| %s (%d, %d, %d, %d, %d) | %s | %.3f (%s) | %+.2f%% | %.3f | %+.2f%% |" % (
                name, T, d, n, E, k, v, ms, ", ".join("%.3f" % t for t in times[v]), 100.0 * (ms / plain - 1.0),
                routing[v], 100.0 * (routing[v] - routing["plain"]) / plain), flush=True)


if __name__ == "__main__":
    main()
