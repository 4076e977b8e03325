"""A small training job written with gpu-anchor's public API: run it under ``gpu-anchor run``.

    gpu-anchor run --chaos-kills 3 -- python examples/demo_train.py --steps 300 --out result.pt

The model and the optimizer are built inside ``gpu_anchor.managed_scope`` and the
optimizer is wrapped in ``AnchoredOptimizer``: weights, momentum, gradients and the step
protocol's cursor live in the device's daemon.  A worker SIGKILLed at any instant is
replaced by one that binds the same memory (nothing is re-initialised), lets the
optimizer finish or discard the interrupted step, and continues at
``opt.completed_steps``.  With several ranks (``--nproc-per-node``) the model is wrapped
in DDP *after* the optimizer, so recovery runs before DDP broadcasts anything, and the
ranks agree on the step to resume.

Every batch is a pure function of (seed, step, rank), so a run with failures ends
bit-identical to a fault-free run.  ``--out``: rank 0 saves the final parameters and
momentum buffers, flattened into one tensor.
"""
from __future__ import annotations

import argparse
import os
import time

import torch

import gpu_anchor
from gpu_anchor import launch
from gpu_anchor.train import AnchoredOptimizer


def batch(seed: int, step: int, rank: int, n: int, d_in: int, d_out: int, device) -> tuple:
    g = torch.Generator().manual_seed(seed * 1_000_003 + step * 131 + rank)
    x = torch.randn(n, d_in, generator=g)
    w_true = torch.linspace(-1, 1, d_in * d_out).view(d_in, d_out)
    y = torch.tanh(x @ w_true) + 0.01 * torch.randn(n, d_out, generator=g)
    return x.to(device), y.to(device)


def main(argv=None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--d-in", type=int, default=32)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--d-out", type=int, default=8)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--momentum", type=float, default=0.9)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--step-sleep", type=float, default=0.0, help="seconds per step (slows the job for chaos)")
    p.add_argument("--fail-at-step", type=int, default=-1, help="raise at this step (crash-loop tests)")
    p.add_argument("--hang-at-step", type=int, default=-1,
                   help="hang (sleep) at this step in the first generation only (hang-detection tests)")
    p.add_argument("--out", help="rank 0 writes the final parameters here (torch.save)")
    a = p.parse_args(argv)

    rank, world = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    local = int(os.environ.get("LOCAL_RANK", "0"))
    device = f"cuda:{local}" if torch.cuda.is_available() else "cpu"
    if device == "cpu":
        torch.set_num_threads(1)        # a toy model: intra-op threads only add contention
    else:
        torch.cuda.set_device(local)
        torch.zeros(1, device=device)
        launch.mark("cuda_init")
    if world > 1:
        import torch.distributed as dist
        dist.init_process_group("nccl" if device != "cpu" else "gloo")

    with gpu_anchor.managed_scope():
        torch.manual_seed(a.seed)       # replayed only when the daemon creates the weights
        model = torch.nn.Sequential(torch.nn.Linear(a.d_in, a.hidden), torch.nn.Tanh(),
                                    torch.nn.Linear(a.hidden, a.d_out)).to(device)
        opt = AnchoredOptimizer(torch.optim.SGD(model.parameters(), lr=a.lr, momentum=a.momentum), model=model)
    launch.mark("bind")
    start = opt.completed_steps         # recovery (finish or discard the interrupted step) is done
    launch.mark("recovered", step=start)
    if start and rank == 0:
        print(f"[rank 0] resuming at step {start}", flush=True)
    net = model
    if world > 1:
        from torch.nn.parallel import DistributedDataParallel as DDP
        net = DDP(model)

    for s in range(start, a.steps):
        if s + 1 == a.fail_at_step:
            raise RuntimeError(f"--fail-at-step {s + 1}")
        if s + 1 == a.hang_at_step and os.environ.get("GPU_ANCHOR_RESTART_COUNT", "0") == "0":
            time.sleep(3600)
        x, y = batch(a.seed, s + 1, rank, a.batch, a.d_in, a.d_out, device)
        loss = ((net(x) - y) ** 2).mean()
        loss.backward()                 # DDP averages the gradients here
        opt.step()                      # the crash-consistent step; commits step s + 1
        opt.zero_grad()
        if a.step_sleep:
            time.sleep(a.step_sleep)
        if rank == 0 and (s + 1) % max(1, a.steps // 5) == 0:
            print(f"[rank 0] step {s + 1}/{a.steps} loss {loss.item():.6f}", flush=True)

    opt.flush()
    if a.out and rank == 0:
        state = opt.state_dict()["state"]
        flat = [t.detach().reshape(-1) for t in model.state_dict().values()]
        flat += [st["momentum_buffer"].reshape(-1) for _, st in sorted(state.items())]
        torch.save(torch.cat(flat).cpu(), a.out + ".tmp")
        os.replace(a.out + ".tmp", a.out)
    if world > 1:
        dist.barrier()
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
