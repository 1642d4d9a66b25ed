"""MoELayer(ep_group=...) on every GPU of the host (torchrun, one process per GPU) against the
single-GPU MoELayer on all ranks' tokens, from the same weights:

  * eager forward + backward: y and dx (this rank's tokens), the local experts' gradients, the
    router weight's gradient summed over the ranks, within bf16 tolerance; the HOST transport's
    equal to NVLink's, bit for bit;
  * the state_dict: loaded from the single-GPU layout, saved with its expert range, gathered back
    by full_state_dict() equal to the original;
  * torch.compile(fullgraph=True) forward + backward equal to eager, bit for bit;
  * forward + backward captured in a CUDA graph (torch.cuda.graph), replayed on new x (new
    routing), equal to eager on it, bit for bit;
  * FSDP2: fully_shard over the same ranks with the experts left to the layer
    (ignored_params=expert_parameters()): the router weight's averaged gradient equals the
    single-GPU gradient of the ranks' mean loss.

    torchrun --standalone --nproc_per_node=2 tests/gpu/ep_torch_check.py
Prints one line per check and PASS or FAIL last (rank 0); exits non-zero on a failure.
"""
import os
import sys

import torch
import torch.distributed as dist

from moeblaze.torch import MoELayer

failures = []


def rel(a, b):
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def check(ok, what, value=0.0):
    if not ok:
        failures.append(what)
    if dist.get_rank() == 0 or not ok:
        print("  %-6s rank %d %-55s %.3g" % ("ok" if ok else "FAILED", dist.get_rank(), what, value), flush=True)


def graph_replay(layer, x, dy, new_x, step):
    """Forward + backward captured once (PyTorch's whole-network recipe: warm-up on a side stream,
    gradients None before capture), replayed on new x; returns the replay's and eager's results."""
    static_x = x.clone().requires_grad_()
    static_dy = dy.clone()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            layer.zero_grad(set_to_none=True)
            static_x.grad = None
            layer(static_x)[0].backward(static_dy)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    layer.zero_grad(set_to_none=True)
    static_x.grad = None
    with torch.cuda.graph(graph):
        static_y = layer(static_x)[0]
        static_y.backward(static_dy)
    with torch.no_grad():
        static_x.copy_(new_x)
    graph.replay()
    torch.cuda.synchronize()
    replayed = [static_y.clone(), static_x.grad.clone()] + [p.grad.clone() for p in layer.parameters()]
    return replayed, step(layer, new_x, static_dy)


def main():
    dist.init_process_group("nccl")
    rank, P = dist.get_rank(), dist.get_world_size()
    dev = torch.device("cuda", int(os.environ.get("LOCAL_RANK", rank)))
    torch.cuda.set_device(dev)
    group = dist.group.WORLD
    E, k, d, h = 8 * P, 4, 256, 128
    dtype, tol = torch.bfloat16, 2e-2
    tokens = [300 - 37 * r for r in range(P)]
    off = [sum(tokens[:r]) for r in range(P + 1)]
    total, mine = off[P], slice(off[rank], off[rank + 1])
    torch.manual_seed(0)
    ref = MoELayer(d, h, E, k, dtype=dtype, device=dev, normalize_topk=1)
    ep = MoELayer(d, h, E, k, dtype=dtype, device=dev, normalize_topk=1, ep_group=group)
    ep.load_state_dict(ref.state_dict())
    El, e0 = E // P, rank * (E // P)
    check(tuple(ep.w_gate_up.shape) == (El, d, 2 * h) and torch.equal(ep.w_gate_up, ref.w_gate_up[e0:e0 + El]),
          "load_state_dict: the single-GPU layout, own experts kept")
    gen = torch.Generator().manual_seed(1)
    x_all = torch.randn(total, d, generator=gen).to(dev, dtype)
    dy_all = torch.randn(total, d, generator=gen).to(dev, dtype)

    # Eager, against one GPU on every token.
    xr = x_all.clone().requires_grad_()
    y_ref = ref(xr)[0]
    y_ref.backward(dy_all)
    xe = x_all[mine].clone().requires_grad_()
    y = ep(xe)[0]
    y.backward(dy_all[mine])
    check(rel(y, y_ref[mine]) < tol, "y vs single GPU", rel(y, y_ref[mine]))
    check(rel(xe.grad, xr.grad[mine]) < tol, "dx vs single GPU", rel(xe.grad, xr.grad[mine]))
    for name in ("w_gate_up", "w_down"):
        g, gr = getattr(ep, name).grad, getattr(ref, name).grad[e0:e0 + El]
        check(rel(g, gr) < tol, "d%s (local experts) vs single GPU" % name, rel(g, gr))
    g_router = ep.router_weight.grad.float().clone()
    dist.all_reduce(g_router)
    check(rel(g_router, ref.router_weight.grad.float()) < tol, "d router_weight summed over ranks",
          rel(g_router, ref.router_weight.grad.float()))

    # The HOST transport (ncclSend/ncclRecv on the process group's communicator): the same rows
    # in the same places as NVLink, so the same bits.
    ep_h = MoELayer(d, h, E, k, dtype=dtype, device=dev, normalize_topk=1, ep_group=group, ep_transport="host")
    ep_h.load_state_dict(ref.state_dict())
    xh = x_all[mine].clone().requires_grad_()
    yh = ep_h(xh)[0]
    yh.backward(dy_all[mine])
    check(torch.equal(yh, y) and torch.equal(xh.grad, xe.grad) and torch.equal(ep_h.w_down.grad, ep.w_down.grad)
          and torch.equal(ep_h.router_weight.grad, ep.router_weight.grad), "HOST transport == NVLink, bitwise")
    ep_h.close()

    # A token mask and a shared expert on its own stream, beside the exchanges: against one GPU
    # with the same mask (the shared expert's gradients summed over the ranks).
    torch.manual_seed(3)
    kw = dict(dtype=dtype, device=dev, normalize_topk=1, shared_expert_hidden=192, aux_loss_coeff=0.01)
    ref_s = MoELayer(d, h, E, k, **kw)
    ep_s = MoELayer(d, h, E, k, ep_group=group, shared_expert_overlap=True, **kw)
    ep_s.load_state_dict(ref_s.state_dict())
    mask_all = (torch.rand(total, generator=gen) > 0.3).to(dev)
    xr = x_all.clone().requires_grad_()
    y_ref = ref_s(xr, token_mask=mask_all)[0]
    y_ref.backward(dy_all)
    xe = x_all[mine].clone().requires_grad_()
    y = ep_s(xe, token_mask=mask_all[mine])[0]
    y.backward(dy_all[mine])
    check(rel(y, y_ref[mine]) < tol, "masked, shared expert beside: y vs single GPU", rel(y, y_ref[mine]))
    check(rel(xe.grad, xr.grad[mine]) < tol, "masked, shared expert beside: dx vs single GPU", rel(xe.grad, xr.grad[mine]))
    check(rel(ep_s.w_down.grad, ref_s.w_down.grad[e0:e0 + El]) < tol, "masked: d w_down (local experts) vs single GPU",
          rel(ep_s.w_down.grad, ref_s.w_down.grad[e0:e0 + El]))
    g_shared = ep_s.shared_w_down.grad.float().clone()
    dist.all_reduce(g_shared)
    check(rel(g_shared, ref_s.shared_w_down.grad.float()) < tol, "masked: d shared_w_down summed over ranks",
          rel(g_shared, ref_s.shared_w_down.grad.float()))
    ep_s.close()

    # The state_dict round trip.
    sd = ep.state_dict()
    check(sd._metadata[""]["moeblaze_experts"] == (e0, El, E), "state_dict records the expert range")
    full = ep.full_state_dict()
    check(all(torch.equal(full[n], ref.state_dict()[n]) for n in ("router_weight", "w_gate_up", "w_down")),
          "full_state_dict() == the single-GPU state_dict")

    def step(layer, x, dy):
        layer.zero_grad(set_to_none=True)
        x = x.detach().requires_grad_()
        out = layer(x)[0]
        out.backward(dy)
        return [out.detach().clone(), x.grad.clone()] + [p.grad.clone() for p in layer.parameters()]

    # torch.compile.
    eager = step(ep, x_all[mine], dy_all[mine])
    compiled = torch.compile(ep, fullgraph=True)
    got = step(compiled, x_all[mine], dy_all[mine])
    check(all(torch.equal(a, b) for a, b in zip(eager, got)), "torch.compile(fullgraph) == eager, bitwise")

    # FSDP2 over the same ranks, the experts left to the layer.
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    ep2 = MoELayer(d, h, E, k, dtype=dtype, device=dev, normalize_topk=1, ep_group=group)
    ep2.load_state_dict(ref.state_dict())
    mesh = init_device_mesh("cuda", (P,))
    fully_shard(ep2, mesh=mesh, ignored_params=set(ep2.expert_parameters()))
    xe = x_all[mine].clone().requires_grad_()
    ep2(xe)[0].backward(dy_all[mine])
    g = ep2.router_weight.grad.full_tensor().float()
    want = ref.router_weight.grad.float() / P  # the gradient of the ranks' mean loss
    check(rel(g, want) < tol, "FSDP2: averaged d router_weight vs single GPU / P", rel(g, want))
    check(rel(ep2.w_down.grad, ref.w_down.grad[e0:e0 + El]) < tol, "FSDP2: d w_down (experts) vs single GPU",
          rel(ep2.w_down.grad, ref.w_down.grad[e0:e0 + El]))

    # A CUDA graph of forward + backward, replayed on new x: the single-GPU layer, then the EP one.
    new_x = torch.randn(tokens[rank], d, generator=torch.Generator().manual_seed(2 + rank)).to(dev, dtype)
    for name, layer in (("single-GPU", ref), ("EP", ep)):
        try:
            replayed, eager_new = graph_replay(layer, x_all[mine], dy_all[mine], new_x, step)
            check(all(torch.equal(a, b) for a, b in zip(replayed, eager_new)) and not torch.equal(replayed[0], eager[0]),
                  "%s: CUDA graph replay on new x == eager, bitwise" % name)
        except Exception as e:  # noqa: BLE001 (reported, then the remaining checks run)
            check(False, "%s: CUDA graph capture (%s)" % (name, str(e).splitlines()[0][:80]))
            torch.cuda.synchronize()

    torch.cuda.synchronize()
    for layer in (ep, ep2):
        layer.close()  # collective, before the process group goes
    bad = torch.tensor([len(failures)], device=dev)
    dist.all_reduce(bad)
    if rank == 0:
        print("PASS: %d ranks" % P if bad.item() == 0 else "FAIL: %d failed checks" % bad.item(), flush=True)
    dist.destroy_process_group()
    sys.exit(1 if bad.item() else 0)


if __name__ == "__main__":
    main()
