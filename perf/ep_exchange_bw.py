#!/usr/bin/env python3
"""The expert-parallel layer's exchanges inside a training step: bytes per GPU per second, and
the SMs they take.

For each shape and each EP_COMM_SMS (the CTAs that move rows, one per SM), `MoELayer(ep_group=)`
runs fwd+bwd steps (bf16, SwiGLU, a random router weight as perf/ep-bench uses: near-uniform
routing); the torch profiler (CUPTI, kernel activities only) gives the durations of the NVLink
exchange kernels: dispatch (x forward, dy backward; the rows' own kernel where they are sent
beside the local GEMMs, whose time then overlaps theirs) and return (the y parts forward: the
combine that stores them into the peers and the barrier after it, or the return exchange; the
dx parts backward: their kernel beside the weight gradients, or the return exchange with the
gate gradients). Bytes are the rows this rank stores into its peers' windows (a
token travels once to each rank that owns one of its experts; the rows it keeps are its own
window's and not counted), from the same routing recomputed here (softmax top-k of x W_g^T in
fp32). A kernel's time includes its wait at the closing barrier for the slowest rank, as in the
step. Printed per rank 0: the rows sent to peers per exchange, the median ms of each kernel, and
GB/s = bytes to peers / time, for dispatch and for return (d * 2 bytes a row; the per-row
metadata, 8 + 8 k_loc bytes forward, is left out).

  torchrun --nproc_per_node=P perf/ep_exchange_bw.py [--tokens 16384] [--steps 5] [--sms 16 32 64]
      [--shapes qwen3-30b-a3b ...]
"""
import argparse
import functools
import os
import statistics
import sys

import torch
import torch.distributed as dist

HERE = os.path.dirname(os.path.abspath(__file__))
if os.environ.get("MOEBLAZE_LIBRARY"):
    sys.path.insert(0, os.path.join(HERE, "..", "bindings", "python"))
from moeblaze.torch import MoELayer  # noqa: E402

SHAPES = {  # d, h, E, k
    "qwen3-30b-a3b": (2048, 768, 128, 8),
    "olmoe": (2048, 1024, 64, 8),
    "deepseek-v3": (7168, 2048, 256, 8),
    "mixtral": (4096, 14336, 8, 2),
}


def rows_to_peers(x, wg, k, P, rank):
    """Rows this rank sends to other ranks in one exchange: per token, the distinct owners of its
    top-k experts other than this rank."""
    ids = torch.topk(torch.softmax(x.float() @ wg.float().t(), dim=-1), k, dim=-1).indices
    owners = ids // (wg.shape[0] // P)
    reach = torch.zeros(x.shape[0], P, dtype=torch.bool, device=x.device)
    reach.scatter_(1, owners, True)
    reach[:, rank] = False
    return int(reach.sum())


def fwd_bwd_step(layer, x, dy):
    """One training step of the layer: forward, backward of dy, the gradients dropped."""
    xs = x.detach().requires_grad_()
    layer(xs)[0].backward(dy)
    layer.zero_grad(set_to_none=True)


def kernel_ms(prof, name_part):
    return [e.device_time_total / 1000.0 for e in prof.events()
            if e.device_type == torch.autograd.DeviceType.CUDA and name_part in e.name]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=16384)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--sms", type=int, nargs="*", default=[16, 32, 64])
    ap.add_argument("--shapes", nargs="*", default=["qwen3-30b-a3b", "olmoe"])
    args = ap.parse_args()
    dist.init_process_group("nccl")
    rank, P = dist.get_rank(), dist.get_world_size()
    dev = torch.device("cuda", int(os.environ.get("LOCAL_RANK", rank)))
    torch.cuda.set_device(dev)
    from torch.profiler import ProfilerActivity, profile
    if rank == 0:
        print("# %d ranks (%s), %d tokens per rank, %d fwd+bwd steps profiled per row, bf16 SwiGLU"
              % (P, torch.cuda.get_device_name(dev), args.tokens, args.steps))
        print("| shape (d, h, E, k) | P | SMs (CTAs) | rows to peers per exchange | dispatch ms (x / dy) | "
              "return ms (y / dx) | dispatch GB/s | return GB/s |")
        print("|---|---|---|---|---|---|---|---|")
    for name in args.shapes:
        d, h, E, k = SHAPES[name]
        gen = torch.Generator(device=dev).manual_seed(100 + rank)
        x = torch.randn(args.tokens, d, device=dev, dtype=torch.bfloat16, generator=gen)
        dy = torch.randn(args.tokens, d, device=dev, dtype=torch.bfloat16, generator=gen)
        for sms in args.sms:
            torch.manual_seed(0)  # the same router weight on every rank
            layer = MoELayer(d, h, E, k, dtype=torch.bfloat16, device=dev, normalize_topk=1,
                             max_tokens=args.tokens, ep_group=dist.group.WORLD, ep_comm_sms=sms)
            rows = rows_to_peers(x, layer.router_weight.detach(), k, P, rank)

            step = functools.partial(fwd_bwd_step, layer, x, dy)
            for _ in range(3):
                step()
            torch.cuda.synchronize()
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                for _ in range(args.steps):
                    step()
                torch.cuda.synchronize()
            # rows sent beside the local GEMMs have a kernel of their own (docs/ep.md, "Rows under
            # the GEMMs"); its time then overlaps the GEMMs'
            disp = kernel_ms(prof, "dispatch_rows_by_expert_kernel") or kernel_ms(prof, "dispatch_kernel")
            ret = kernel_ms(prof, "return_kernel")
            # Where the forward's combine stores the y parts into the peers (docs/ep.md, "Returns"),
            # its return is that combine and the barrier after it, and the backward's dx rows go
            # beside the weight gradients in a kernel of their own.
            combine = kernel_ms(prof, "combine_rows_kernel<__nv_bfloat16, 8, true, true>")
            dx_rows = kernel_ms(prof, "return_kernel<false>")
            barrier = kernel_ms(prof, "return_kernel<true>")
            layer.close()
            # forward's and backward's alternate in each list
            dx_ms, ddy_ms = statistics.median(disp[0::2]), statistics.median(disp[1::2])
            if combine and dx_rows:
                ry_ms = statistics.median(c + b for c, b in zip(combine, barrier[0::2]))
                rdx_ms = statistics.median(dx_rows)
            else:
                ry_ms, rdx_ms = statistics.median(ret[0::2]), statistics.median(ret[1::2])
            out = torch.tensor([rows, dx_ms, ddy_ms, ry_ms, rdx_ms], dtype=torch.float64, device=dev)
            gathered = [torch.empty_like(out) for _ in range(P)]
            dist.all_gather(gathered, out)
            if rank == 0:  # the slowest rank's times and the busiest rank's rows
                g = torch.stack(gathered).cpu()
                rows_max = int(g[:, 0].max())
                t = g[:, 1:].max(dim=0).values.tolist()
                mb = rows_max * d * 2 / 1e6
                print("| %s (%d, %d, %d, %d) | %d | %d | %d | %.3f / %.3f | %.3f / %.3f | %.0f | %.0f |"
                      % (name, d, h, E, k, P, sms, rows_max, t[0], t[1], t[2], t[3],
                         mb / statistics.mean(t[0:2]), mb / statistics.mean(t[2:4])))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
