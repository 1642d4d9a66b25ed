#!/usr/bin/env python3
"""The small MoE language model of moe_lm.py trained with expert parallelism: every process
(torchrun, one GPU each) holds E/P of each layer's experts and trains on its share of each batch,
data-parallel for the rest of the model. It is checked against the same model trained on one GPU
on the whole batch, from the same initial weights and batches: the two loss curves must agree
within the dtype's own noise, measured in the same run as the gap between the one-GPU model in
the dtype and in fp32 (within 3x per step and 2x over 10-step means, as moe_lm.py's check).

    torchrun --standalone --nproc_per_node=2 examples/moe_lm_ep.py
    torchrun --standalone --nproc_per_node=4 examples/moe_lm_ep.py --experts 16 --steps 200

The gradient rule it shows (docs/ep.md): with the ranks' losses averaged, the replicated
parameters' gradients are averaged over the group (all_reduce / P), and the experts' gradients,
which already hold every rank's tokens, are divided by P.
"""
import argparse
import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from moe_lm import DTYPES, LM, NOISE_FACTOR, TOLERANCE, add_model_args, prepare, smooth, train  # noqa: E402

try:
    from moeblaze.torch import MoELayer
except ImportError:  # run from a source checkout without `pip install .`
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "bindings", "python"))
    from moeblaze.torch import MoELayer


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_model_args(ap)
    ap.set_defaults(batch=16)  # the whole batch, split over the ranks
    args = ap.parse_args()

    dist.init_process_group("nccl")
    rank, P = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", rank)))
    torch.cuda.set_device(device)
    if args.batch % P or args.experts % P:
        sys.exit("the batch (%d) and the experts (%d) must divide over %d ranks" % (args.batch, args.experts, P))
    dtype = DTYPES[args.dtype]
    data, vocab, h, heads = prepare(args)

    def build(dtype, group=None):
        torch.manual_seed(args.seed)  # the same initial weights on every rank and for every run
        def make_moe():
            return MoELayer(args.d, h, args.experts, args.top_k, activation="swiglu",
                            max_tokens=args.batch * args.seq, dtype=dtype, device=device, normalize_topk=1,
                            ep_group=group)
        return LM(len(vocab), args.d, args.layers, heads, make_moe).to(device=device, dtype=dtype)

    single = build(dtype)
    initial = {k: v.clone() for k, v in single.state_dict().items()}
    ep_model = build(dtype, dist.group.WORLD)
    ep_model.load_state_dict(initial)  # the one-GPU layout: each rank keeps its experts
    experts = {id(p) for b in ep_model.blocks for p in b.moe.expert_parameters()}

    def reduce_grads(loss):
        for p in ep_model.parameters():
            if id(p) in experts:
                p.grad.div_(P)
            else:
                dist.all_reduce(p.grad, op=dist.ReduceOp.AVG)
        loss = loss.detach().clone()
        dist.all_reduce(loss, op=dist.ReduceOp.AVG)
        return loss

    per = args.batch // P
    if rank == 0:
        print("model: %d layers, d %d, %d experts of width %d, top-%d, %s; %d ranks, %d experts and %d of "
              "%d sequences per rank" % (args.layers, args.d, args.experts, h, args.top_k, args.dtype, P,
                                          args.experts // P, per, args.batch))
    ep_run = train(ep_model, data, args, device, rows=(rank * per, (rank + 1) * per), reduce_grads=reduce_grads)
    for b in ep_model.blocks:
        b.moe.close()  # collective: before the process group goes
    dist.barrier(device_ids=[device.index])
    if rank == 0:
        runs = {"ep": ep_run, "single": train(single, data, args, device)}
        if args.dtype != "f32":
            single32 = build(torch.float32)
            single32.load_state_dict({k: v.float() for k, v in initial.items()})
            runs["single-f32"] = train(single32, data, args, device)
        for name, (losses, tps, peak) in runs.items():
            print("%-10s loss %.4f -> %.4f, %.0f tokens/s per GPU, peak %.0f MiB" % (
                name, losses[0], losses[-1], tps, peak))
        a, b = runs["ep"][0], runs["single"][0]
        c = runs["single-f32"][0] if "single-f32" in runs else None
        print("step  ep-%d      single" % P + ("  single-f32" if c else ""))
        for i in range(0, args.steps, max(1, args.steps // 15)):
            print("%4d  %8.4f  %8.4f" % (i, a[i], b[i]) + ("  %10.4f" % c[i] if c else ""))

        def gap(u, v):
            return (max(abs(x - y) for x, y in zip(u, v)),
                    max(abs(x - y) for x, y in zip(smooth(u), smooth(v))))

        step, mean10 = gap(a, b)
        if c is None:
            ok = step <= TOLERANCE["f32"]
            print("largest |EP - single| per step %.2e (tolerance %.0e)" % (step, TOLERANCE["f32"]))
        else:
            noise_step, noise_mean = gap(b, c)
            ok = step <= NOISE_FACTOR["step"] * noise_step and mean10 <= NOISE_FACTOR["mean10"] * noise_mean
            print("largest |EP - single|: %.4f per step, %.4f over 10-step means; the %s noise "
                  "(|single - single-f32|): %.4f and %.4f" % (step, mean10, args.dtype, noise_step, noise_mean))
        print("PASS: the EP loss curve matches one GPU's within the dtype's noise" if ok else
              "FAIL: the EP loss curve is further from one GPU's than the dtype's noise")
        result = torch.tensor([0 if ok else 1], device=device)
    else:
        result = torch.zeros(1, dtype=torch.long, device=device)
    dist.broadcast(result, 0)
    dist.destroy_process_group()
    sys.exit(int(result.item()))


if __name__ == "__main__":
    main()
