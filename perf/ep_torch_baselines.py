#!/usr/bin/env python3
"""Expert parallelism as PyTorch users build it today: the baselines that perf/ep-bench's table
sets the EP layer beside, run on the same GPUs in the same session.

Every rank holds E / P experts and its own tokens; the router (replicated) picks top-k experts
per token (softmax, renormalised). Both baselines move tokens the way torchtitan's default EP
does: the (token, expert) rows sorted by expert, their counts exchanged with all_to_all_single
and copied to the host (the split sizes), then the rows with all_to_all_single (autograd), and
the results back the same way, summed with the gates on the token's rank.

  - ``a2a+moeblaze``: the received rows through the single-GPU MoEBlaze layer (``moeblaze.torch``,
    caller routing: each row to its local expert with gate 1);
  - ``torchtitan``: the received rows sorted by local expert, then torch._grouped_mm.

The time is fwd+bwd (gradients of x, the expert weights and the router weight), the median of
--reps steps of the slowest rank, bf16, SwiGLU.

  torchrun --nproc_per_node=P perf/ep_torch_baselines.py [--tokens 16384] [--reps 20] [--shapes ...]
  torchrun --nproc_per_node=2 perf/ep_torch_baselines.py --device cpu --tokens 64 --reps 1 --shapes tiny \
    --check-tol 0.02   (the CPU smoke test CI runs, over gloo)
"""
import argparse
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as fc
import torch.nn.functional as F

HERE = os.path.dirname(os.path.abspath(__file__))
if os.environ.get("MOEBLAZE_LIBRARY"):  # the source tree's package, on the library named there;
    sys.path.insert(0, os.path.join(HERE, "..", "bindings", "python"))  # else the installed one

SHAPES = {  # d, h, E, k
    "qwen3-30b-a3b": (2048, 768, 128, 8),
    "olmoe": (2048, 1024, 64, 8),
    "deepseek-v3": (7168, 2048, 256, 8),
    "mixtral": (4096, 14336, 8, 2),
    "tiny": (64, 32, 8, 2),
}


def route(x, wg, k):
    probs = torch.softmax(x.float() @ wg.float().t(), dim=-1)
    gates, ids = torch.topk(probs, k, dim=-1)
    return gates / gates.sum(dim=-1, keepdim=True), ids


class Exchange:
    """The (token, expert) rows of one step: sorted by expert, hence by owning rank; the counts
    exchanged and read on the host, as torchtitan does."""

    def __init__(self, ids, E, P):
        El = E // P
        flat = ids.reshape(-1)
        self.order = torch.argsort(flat, stable=True)
        self.token = self.order // ids.shape[1]
        counts = torch.bincount(flat, minlength=E).to(torch.int64)
        recv = torch.empty_like(counts)
        dist.all_to_all_single(recv, counts)  # recv[s El + e]: rows from rank s for local expert e
        host = torch.stack([counts, recv]).cpu()  # the host synchronisation of this design
        self.send_splits = host[0].view(P, El).sum(1).tolist()
        self.recv_splits = host[1].view(P, El).sum(1).tolist()
        rc = host[1].view(P, El)
        dev = ids.device
        # Received rows come by (source rank, local expert); expert-major order for grouped_mm.
        lens = rc.t().reshape(-1)
        starts = (torch.cumsum(rc.reshape(-1), 0) - rc.reshape(-1)).view(P, El).t().reshape(-1)
        n = int(lens.sum())
        excl = torch.cumsum(lens, 0) - lens
        self.to_expert = (torch.arange(n) + torch.repeat_interleave(starts - excl, lens)).to(dev)
        self.offs = torch.cumsum(rc.sum(0), 0).to(torch.int32).to(dev)
        self.local_ids = torch.repeat_interleave(torch.arange(El).repeat(P), rc.reshape(-1)).to(torch.int32).to(dev)
        self.received = n

    # torchtitan's collective: all_to_all_single with autograd, on the default group.
    def out(self, rows):
        return fc.wait_tensor(fc.all_to_all_single_autograd(rows, self.recv_splits, self.send_splits, dist.group.WORLD))

    def back(self, rows):
        return fc.wait_tensor(fc.all_to_all_single_autograd(rows, self.send_splits, self.recv_splits, dist.group.WORLD))


def grouped_experts(xe, w1, w3, w2, offs):
    h = F.silu(torch._grouped_mm(xe, w1, offs=offs)) * torch._grouped_mm(xe, w3, offs=offs)
    return torch._grouped_mm(h, w2, offs=offs)


def torchtitan_layer(x, wg, w1, w3, w2, k, E, P):
    gates, ids = route(x, wg, k)
    ex = Exchange(ids, E, P)
    xr = ex.out(x.index_select(0, ex.token))
    o = grouped_experts(xr.index_select(0, ex.to_expert), w1, w3, w2, ex.offs)
    o = torch.zeros_like(o).index_copy(0, ex.to_expert, o)  # back to the order rows arrived in
    ob = ex.back(o)
    g = gates.reshape(-1).index_select(0, ex.order).unsqueeze(1).to(ob.dtype)
    return torch.zeros_like(x).index_add(0, ex.token, ob * g)


def moeblaze_layer(mb, x, wg, wgu, wd, k, E, P):
    gates, ids = route(x, wg, k)
    ex = Exchange(ids, E, P)
    xr = ex.out(x.index_select(0, ex.token))
    one = torch.ones((xr.shape[0], 1), device=x.device, dtype=torch.float32)
    o = mb(xr, wgu, wd, topk_indices=ex.local_ids.unsqueeze(1), topk_weights=one)
    ob = ex.back(o)
    g = gates.reshape(-1).index_select(0, ex.order).unsqueeze(1).to(ob.dtype)
    return torch.zeros_like(x).index_add(0, ex.token, ob * g)


def median_ms(step, reps, cuda, dev):
    times = []
    for r in range(reps + 3):
        dist.barrier()
        if cuda:
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            step()
            b.record()
            b.synchronize()
            t = a.elapsed_time(b)
        else:
            t0 = time.perf_counter()
            step()
            t = (time.perf_counter() - t0) * 1e3
        if r >= 3:
            times.append(t)
    worst = torch.tensor([statistics.median(times)], dtype=torch.float64, device=dev)  # NCCL: device tensors
    dist.all_reduce(worst, op=dist.ReduceOp.MAX)
    return float(worst)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", type=int, default=16384, help="tokens per rank")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--shapes", nargs="*", default=["qwen3-30b-a3b", "olmoe", "deepseek-v3", "mixtral"])
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--check-tol", type=float, default=None,
                    help="exit 1 when the two baselines' y differ by more than this (relative L2)")
    args = ap.parse_args()
    cuda = args.device == "cuda"
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, P = dist.get_rank(), dist.get_world_size()
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
    dev = torch.device(args.device, torch.cuda.current_device()) if cuda else torch.device("cpu")
    import moeblaze.torch as mbt
    T = args.tokens
    if rank == 0:
        print("ep_torch_baselines: %d ranks, %d tokens per rank, median of %d fwd+bwd steps of the slowest rank "
              "(bf16, SwiGLU)\n" % (P, T, args.reps))
        print("| shape (d, h, E, k) | P | torchtitan-style ms | all_to_all + MoEBlaze ms | y, rel. difference |")
        print("|---|---|---|---|---|")
    failed = False
    for name in args.shapes:
        d, h, E, k = SHAPES[name]
        El = E // P
        gen = torch.Generator(device="cpu").manual_seed(1234)  # the same router on every rank
        bf = torch.bfloat16

        def rnd(*shape, scale=1.0, seed=None):
            g = gen if seed is None else torch.Generator(device="cpu").manual_seed(seed)
            return (torch.randn(*shape, generator=g) * scale).to(bf).to(dev).requires_grad_()

        wg = rnd(E, d, scale=d ** -0.5)
        x = rnd(T, d, seed=100 + rank)
        dy = torch.randn(T, d, generator=torch.Generator().manual_seed(200 + rank)).to(bf).to(dev)
        w1 = rnd(El, d, h, scale=d ** -0.5, seed=300 + rank)
        w3 = rnd(El, d, h, scale=d ** -0.5, seed=400 + rank)
        w2 = rnd(El, h, d, scale=h ** -0.5, seed=500 + rank)
        wgu = torch.cat([w1.detach(), w3.detach()], dim=2).requires_grad_()
        params = [x, wg, w1, w3, w2, wgu]

        def titan():
            for p in params:
                p.grad = None
            torchtitan_layer(x, wg, w1, w3, w2, k, E, P).backward(dy)

        mb = mbt.MoE(num_experts=El, top_k=1, hidden_size=d, ffn_hidden_size=h, max_tokens=T * k * P,
                     activation="swiglu")

        def blaze():
            for p in params:
                p.grad = None
            moeblaze_layer(mb, x, wg, wgu, w2, k, E, P).backward(dy)

        with torch.no_grad():  # the two compute the same layer (MoEBlaze's SwiGLU: silu(gate half) * up half)
            ya = torchtitan_layer(x, wg, w1, w3, w2, k, E, P).float()
            yb = moeblaze_layer(mb, x, wg, wgu, w2, k, E, P).float()
            err = torch.tensor([float((ya - yb).norm() / ya.norm().clamp_min(1e-30))], dtype=torch.float64,
                               device=dev)
        dist.all_reduce(err, op=dist.ReduceOp.MAX)
        t_titan = median_ms(titan, args.reps, cuda, dev)
        t_blaze = median_ms(blaze, args.reps, cuda, dev)
        mb.close()
        if rank == 0:
            print("| %s (%d, %d, %d, %d) | %d | %.3f | %.3f | %.1e |" % (name, d, h, E, k, P, t_titan, t_blaze,
                                                                       float(err)))
        failed = failed or (args.check_tol is not None and not float(err) <= args.check_tol)
    # Every rank done with its layers before the group goes.
    dist.barrier()
    dist.destroy_process_group()
    if failed and rank == 0:
        print("FAILED: the two baselines' y differ by more than %g" % args.check_tol)
    # Under gloo on CPUs, torch (2.15) can abort a rank at interpreter shutdown ("terminate called
    # without an active exception": a thread of its own left joinable; MoEBlaze's handles are
    # closed above and own no other threads), so each rank ends here, its output flushed.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(1 if failed else 0)


if __name__ == "__main__":
    main()
