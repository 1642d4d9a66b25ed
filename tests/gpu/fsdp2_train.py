"""MoELayer under FSDP2 (torch.distributed.fsdp.fully_shard) trains as on one GPU.

Run with torchrun on N >= 2 GPUs (scripts/gpu-check.sh fsdp):
    torchrun --standalone --nproc_per_node=2 tests/gpu/fsdp2_train.py
(FSDP_CHECK_DEVICE=cpu runs the same check on CPU processes over gloo.)

A small model (embedding, two residual MoELayer blocks in bf16 on the engine AUTO picks, an
output head) trains for STEPS steps of AdamW on a fixed token stream. Rank 0 first trains an
identical model alone on the whole batch; then every rank trains a fully_shard copy on its
share of the batch (each block and the root sharded). The loss curves must agree within bf16
noise: per step |difference| below TOL_STEP and the mean difference over the run below
TOL_MEAN. Prints both curves and a last line PASS or FAIL; exits 1 on FAIL.
"""
import os
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F

from moeblaze.torch import MoELayer

VOCAB, D, H, E, K, SEQ, BATCH = 256, 256, 512, 8, 2, 128, 8
STEPS = int(os.environ.get("FSDP_CHECK_STEPS", "30"))
TOL_STEP, TOL_MEAN = 0.05, 0.02


class Model(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(VOCAB, D)
        self.blocks = torch.nn.ModuleList(
            [MoELayer(D, H, E, K, max_tokens=BATCH * SEQ, dtype=torch.bfloat16) for _ in range(2)])
        self.norms = torch.nn.ModuleList([torch.nn.LayerNorm(D) for _ in range(2)])
        self.head = torch.nn.Linear(D, VOCAB)

    def forward(self, tokens):
        x = self.embed(tokens).to(torch.bfloat16)
        for norm, block in zip(self.norms, self.blocks):
            x = x + block(norm(x.float()).to(torch.bfloat16))[0]
        return self.head(x.float())


def make_model(device):
    torch.manual_seed(1234)
    return Model().to(device)


def batches(device):
    g = torch.Generator().manual_seed(99)
    base = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=g)
    for step in range(STEPS):  # a learnable stream: each row repeats a short pattern
        yield torch.roll(base, shifts=step, dims=1).to(device)


def train(model, rows, device):
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses = []
    for data in batches(device):
        data = data[rows]
        logits = model(data[:, :-1])
        loss = F.cross_entropy(logits.reshape(-1, VOCAB), data[:, 1:].reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        losses.append(loss.detach())
    return torch.stack(losses)


def main():
    cuda = torch.cuda.is_available() and os.environ.get("FSDP_CHECK_DEVICE", "cuda") == "cuda"
    dist.init_process_group("nccl" if cuda else "gloo")  # gloo: the same check on CPUs
    rank, world = dist.get_rank(), dist.get_world_size()
    if cuda:
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", rank)))
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    if BATCH % world:
        raise SystemExit("BATCH must divide by the world size")
    reference = None
    if rank == 0:
        reference = train(make_model(device), slice(0, BATCH), device).float().cpu()
    dist.barrier()

    from torch.distributed.fsdp import fully_shard
    model = make_model(device)
    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)
    share = BATCH // world
    local = train(model, slice(rank * share, (rank + 1) * share), device).float()
    dist.all_reduce(local)  # the mean over ranks of the local losses: the global batch's loss
    sharded = (local / world).cpu()

    ok = True
    if rank == 0:
        diff = (sharded - reference).abs()
        for step in range(STEPS):
            print("step %2d  one rank %.4f  fully_shard x%d %.4f  |diff| %.4f"
                  % (step, reference[step], world, sharded[step], diff[step]))
        ok = bool(diff.max() < TOL_STEP and diff.mean() < TOL_MEAN and reference[-1] < reference[0] - 0.5)
        where = "GPUs" if cuda else "CPU processes"
        print("%s: fully_shard on %d %s vs one, %d steps: max |loss diff| %.4f (< %.2f), mean %.4f "
              "(< %.2f); loss %.3f -> %.3f" % ("PASS" if ok else "FAIL", world, where, STEPS, diff.max(),
                                               TOL_STEP, diff.mean(), TOL_MEAN, reference[0], reference[-1]))
    flag = torch.tensor([1 if ok else 0], device=device)
    dist.broadcast(flag, 0)
    passed = bool(flag.item())
    dist.barrier()
    dist.destroy_process_group()
    # Under gloo on CPUs, torch (2.15) can abort a rank at interpreter shutdown ("terminate called
    # without an active exception": a thread of its own left joinable), so each rank ends here,
    # its output flushed.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0 if passed else 1)


if __name__ == "__main__":
    main()
