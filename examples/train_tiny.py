"""Train a small MLP under AnchoredOptimizer; kill it any time and run it again.

    gpu-anchor daemon --device cpu --detach          # once
    python examples/train_tiny.py --steps 200        # Ctrl-C / kill -9 it, then run it again:
    python examples/train_tiny.py --steps 200        # resumes at the last completed step
    gpu-anchor drop train-tiny                       # start over

On a GPU machine pass ``--device cuda:0`` (after ``gpu-anchor daemon --device cuda:0 --detach``).
"""
from __future__ import annotations

import argparse

import torch

import gpu_anchor
from gpu_anchor.train import AnchoredOptimizer, LoopState, anchor_module


def main(argv=None) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--namespace", default="train-tiny")
    args = ap.parse_args(argv)

    client = gpu_anchor.connect(args.device, namespace=args.namespace)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 256), torch.nn.GELU(), torch.nn.Linear(256, 1)).to(args.device)
    status = anchor_module(model, client)                 # matched on restart: the weights never left
    inner = torch.optim.AdamW(model.parameters(), lr=1e-3)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(inner, T_max=args.steps)
    opt = AnchoredOptimizer(inner, model=model, client=client, schedulers=[sched])
    loop = LoopState(opt, steps_per_epoch=50)
    print(f"{opt}; parameters {set(status.values())}; resuming at step {opt.completed_steps}")

    for step, epoch, k in loop.batches(args.steps):
        g = torch.Generator().manual_seed(epoch * 1000 + k)    # batch = f(seed, epoch, index)
        x = torch.randn(64, 32, generator=g).to(args.device)
        y = x.sin().sum(dim=1, keepdim=True)
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.loop_state["samples"] = opt.loop_state.get("samples", 0) + len(x)
        opt.step()
        opt.zero_grad()
        if step % 20 == 0:
            print(f"step {step} epoch {epoch} loss {loss.item():.5f} lr {sched.get_last_lr()[0]:.2e} "
                  f"samples {opt.loop_state['samples']}")
    print(f"done: {opt.completed_steps} steps")


if __name__ == "__main__":
    main()
