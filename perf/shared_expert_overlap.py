"""Where a shared expert should run: after the routed experts on the same stream, beside them on a
second stream, or as m = hs / n more experts of the routed grouped GEMM that every token picks.

Part 1, the operators (moeblaze.torch.MoE, caller routing so that the three forms route the same
tokens; bf16 SwiGLU, fwd+bwd with every gradient):
  * routed:      the routed experts alone (the reference);
  * after:       routed, then the shared expert as a one-expert layer on the same stream (what
                 MoELayer does by default);
  * beside:      the same two calls, the shared one on a second stream;
  * extra groups: one call with E + m experts and top-k + m, each token's m extra slots the
                 shared expert's slices of width n (gate 1); only where n divides hs.
Part 2, what a user times: MoELayer (router inside) with shared_expert_overlap off and on.

Part 3, under torchrun (one process per GPU): the expert-parallel MoELayer with the shared expert
in line or beside (where the exchanges leave the GPU idle), every rank's tokens the shape's.

Each variant is timed in interleaved rounds (the order rotates), median of --reps steps per round,
median over the rounds.

    python perf/shared_expert_overlap.py [--shapes deepseek_v3,qwen2_moe,deepseek_v2_lite] [--reps 20]
"""
import argparse
import statistics
import sys

import torch

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from cuda_timing import median_ms  # noqa: E402

# name: (tokens, d, n, E, k, shared width hs, sigmoid-gated shared expert)
SHAPES = {
    "deepseek_v3": (8192, 7168, 2048, 256, 8, 2048, False),
    "qwen2_moe": (16384, 2048, 1408, 60, 4, 5632, True),     # Qwen1.5-MoE-A2.7B's block
    "deepseek_v2_lite": (16384, 2048, 1408, 64, 6, 2816, False),
}


def leaves(*tensors):
    """Separate autograd leaves over the given views (their gradients are their own tensors)."""
    return [t.detach().requires_grad_() for t in tensors]


def op_variants(shape, engine):
    """The part-1 step functions, sharing one weight allocation: the routed experts are the first
    E of E + m experts, the shared expert (one expert of width m n) the last m reinterpreted."""
    from moeblaze.torch import MoE
    from moeblaze._torch_module import _SideStream
    T, d, n, E, k, hs, gated = shape
    m = hs // n if hs % n == 0 else 0
    bf = dict(device="cuda", dtype=torch.bfloat16)
    total = E + max(m, 1)
    base_gu = torch.randn(total, d, 2 * n, **bf) * d ** -0.5
    base_dn = torch.randn(total, n, d, **bf) * n ** -0.5
    # The shared expert's weights: m n-wide slices when n divides hs, else a tensor of its own.
    if m:
        s_gu = base_gu[E:].reshape(-1).view(1, d, 2 * hs)
        s_dn = base_dn[E:].reshape(-1).view(1, hs, d)
    else:
        s_gu = torch.randn(1, d, 2 * hs, **bf) * d ** -0.5
        s_dn = torch.randn(1, hs, d, **bf) * hs ** -0.5
    wgu, wdn, s_gu, s_dn = leaves(base_gu[:E], base_dn[:E], s_gu, s_dn)
    x = torch.randn(T, d, **bf).requires_grad_()
    dy = torch.randn(T, d, **bf)
    ids = torch.rand(T, E, device="cuda").topk(k, dim=1).indices.to(torch.int32)
    gates = torch.softmax(torch.randn(T, k, device="cuda"), dim=1).requires_grad_()
    s_ids = torch.zeros(T, 1, dtype=torch.int32, device="cuda")
    s_gate = (torch.rand(T, 1, device="cuda") if gated else torch.ones(T, 1, device="cuda")).requires_grad_()
    common = dict(hidden_size=d, ffn_hidden_size=n, max_tokens=T, activation="swiglu", activation_dtype="bf16",
                  weight_dtype="bf16", engine=engine)
    routed = MoE(num_experts=E, top_k=k, **common)
    shared = MoE(num_experts=1, top_k=1, **dict(common, ffn_hidden_size=hs))

    def run_shared(xx, a, b, g):
        return shared(xx, a, b, topk_indices=s_ids, topk_weights=g)

    def backward(y, params):
        y.backward(dy)
        for p in params:
            p.grad = None

    params = [x, wgu, wdn, gates, s_gu, s_dn, s_gate]
    variants = {
        "routed": lambda: backward(routed(x, wgu, wdn, topk_indices=ids, topk_weights=gates), params),
        "after": lambda: backward(routed(x, wgu, wdn, topk_indices=ids, topk_weights=gates)
                                  + run_shared(x, s_gu, s_dn, s_gate), params),
    }

    def beside():
        side = _SideStream(x.device, run_shared, x, s_gu, s_dn, s_gate)
        y = routed(x, wgu, wdn, topk_indices=ids, topk_weights=gates)
        backward(y + side.join(), params)
    variants["beside"] = beside
    if m:
        wgu_all, wdn_all = leaves(base_gu, base_dn)
        ids_all = torch.cat([ids, torch.arange(E, E + m, dtype=torch.int32, device="cuda").expand(T, m)], 1)
        gates_all = torch.cat([gates.detach(), s_gate.detach().expand(T, m)], 1).contiguous().requires_grad_()
        grouped = MoE(num_experts=E + m, top_k=k + m, **common)
        variants["extra groups"] = lambda: backward(
            grouped(x, wgu_all, wdn_all, topk_indices=ids_all, topk_weights=gates_all),
            [x, wgu_all, wdn_all, gates_all])
    return variants, None


def layer_variants(shape, engine, ep_group=None):
    from moeblaze.torch import MoELayer
    T, d, n, E, k, hs, gated = shape
    x = torch.randn(T, d, device="cuda", dtype=torch.bfloat16).requires_grad_()
    dy = torch.randn_like(x)
    layer = MoELayer(d, n, E, k, max_tokens=T, dtype=torch.bfloat16, device="cuda", shared_expert_hidden=hs,
                     shared_expert_gate=gated, engine=engine, aux_loss_coeff=1e-3, ep_group=ep_group)
    with torch.no_grad():
        for p in layer.parameters():
            p.normal_(0.0, p.shape[-1] ** -0.5 if p.dim() > 1 else 1.0)

    def step(overlap):
        def run():
            layer.shared_expert_overlap = overlap
            y, aux, _ = layer(x)
            torch.autograd.backward([y, aux], [dy, torch.ones_like(aux)])
            x.grad = None
            for p in layer.parameters():
                p.grad = None
        return run
    return {"MoELayer, shared after": step(False), "MoELayer, shared beside": step(True)}, layer


def rounds_of(variants, reps, rounds):
    names = list(variants)
    times = {name: [] for name in names}
    for r in range(rounds):
        order = names[r % len(names):] + names[:r % len(names)]
        for name in order:
            times[name].append(median_ms(variants[name], reps))
    return {name: statistics.median(ts) for name, ts in times.items()}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--engines", default="auto", help="auto, fused, cublaslt (comma-separated)")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    import os
    import moeblaze
    if "WORLD_SIZE" in os.environ:
        return main_ep(args)
    engine_ids = {"auto": 0, "fused": int(moeblaze.Engine.CUDA_FUSED), "cublaslt": int(moeblaze.Engine.CUDA_CUBLASLT)}
    print("# %s" % torch.cuda.get_device_name())
    print("| shape (T, d, n, E, k, hs) | engine | variant | fwd+bwd ms | the shared expert's added ms |")
    print("|---|---|---|---|---|")
    for name in args.shapes.split(","):
        shape = SHAPES[name]
        for engine in args.engines.split(","):
            label = "%s %s" % (name, shape[:6])
            for make in (op_variants, layer_variants):
                variants, _ = make(shape, engine_ids[engine])
                ms = rounds_of(variants, args.reps, args.rounds)
                ref = ms.get("routed")
                for variant, t in ms.items():
                    added = "" if ref is None or variant == "routed" else "%+.3f" % (t - ref)
                    print("| %s | %s | %s | %.3f | %s |" % (label, engine, variant, t, added), flush=True)
                if "MoELayer, shared after" in ms:
                    a, b = ms["MoELayer, shared after"], ms["MoELayer, shared beside"]
                    print("| %s | %s | beside / after | %.3f | |" % (label, engine, b / a), flush=True)
                del variants
                torch.cuda.empty_cache()


def main_ep(args):
    """Part 3: every rank times the EP layer; rank 0 prints the median over the rounds of the
    slowest rank's step."""
    import os
    import torch.distributed as dist
    dist.init_process_group("nccl")
    rank, P = dist.get_rank(), dist.get_world_size()
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
    if rank == 0:
        print("# %s, expert parallelism over %d GPUs" % (torch.cuda.get_device_name(), P))
        print("| shape (T per rank, d, n, E, k, hs) | in line ms | beside ms | beside / in line |")
        print("|---|---|---|---|")
    for name in args.shapes.split(","):
        shape = SHAPES[name]
        variants, layer = layer_variants(shape, 0, ep_group=dist.group.WORLD)
        times = {v: [] for v in variants}
        for r in range(args.rounds):
            for v in (list(variants) if r % 2 == 0 else list(variants)[::-1]):
                dist.barrier()
                t = torch.tensor([median_ms(variants[v], args.reps)], device="cuda")
                dist.all_reduce(t, op=dist.ReduceOp.MAX)
                times[v].append(t.item())
        a, b = (statistics.median(times[v]) for v in variants)
        if rank == 0:
            print("| %s %s | %.3f | %.3f | %.3f |" % (name, shape[:6], a, b, b / a), flush=True)
        layer.close()  # collective
        del variants, layer
        torch.cuda.empty_cache()
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
