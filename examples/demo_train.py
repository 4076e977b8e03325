"""A small training job whose whole state is anchored: run it under ``gpu-anchor run``.

    gpu-anchor run --chaos-kills 3 -- python examples/demo_train.py --steps 300 --out result.pt

Model: a 2-layer MLP regression, SGD with momentum, written by hand so that the
whole state is two flat tensors.  Consistency protocol (simple, correct, and
all in this file so it can switch to ``gpu_anchor.train.AnchoredOptimizer``):

- state lives in two anchored buffers ``state.0``/``state.1`` = [params | momentum];
- the journal names the live one (``demo/live``) and the committed step
  (``gpu_anchor/step``); step s+1 reads the live buffer, writes the other, and one
  atomic journal commit flips ``live`` and advances the step.  A worker killed at
  any instant leaves the live buffer untouched, so a restarted worker resumes at
  exactly the last committed step;
- with several ranks, a kill can leave ranks one step apart (a rank commits only
  after the all-reduce every rank joined); at start the ranks agree on the
  minimum committed step, and a rank one ahead reads its other buffer, which
  still holds that step (nobody can have started the next all-reduce).

Every batch is a pure function of (seed, step, rank), so a run with failures
ends bit-identical to a fault-free run.
"""
from __future__ import annotations

import argparse
import os
import time

import torch

import gpu_anchor
from gpu_anchor import launch

STEP, LIVE = launch.STEP_KEY, "demo/live"


def shapes(d_in: int, hidden: int, d_out: int) -> list[tuple[int, ...]]:
    return [(d_in, hidden), (hidden,), (hidden, d_out), (d_out,)]


def views(flat: torch.Tensor, shp) -> list[torch.Tensor]:
    out, off = [], 0
    for s in shp:
        n = 1
        for d in s:
            n *= d
        out.append(flat[off:off + n].view(s))
        off += n
    return out


def init_params(flat: torch.Tensor, shp, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    cpu = torch.empty(flat.numel(), dtype=flat.dtype)
    for v, s in zip(views(cpu, shp), shp):
        v.copy_(torch.randn(s, generator=g) * (1.0 / s[0] ** 0.5 if len(s) == 2 else 0.0))
    flat.copy_(cpu)


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
    if device != "cpu":
        torch.cuda.set_device(local)
        torch.zeros(1, device=device)
        launch.mark("cuda_init")
    pg = None
    if world > 1:
        import torch.distributed as dist
        dist.init_process_group("nccl" if device != "cpu" else "gloo")
        pg = dist

    shp = shapes(a.d_in, a.hidden, a.d_out)
    n = sum(torch.Size(s).numel() for s in shp)
    client = gpu_anchor.connect(device)
    bufs = [b.tensor for b in client.bind([(f"state.{i}", (2 * n,), torch.float32) for i in range(2)])]
    launch.mark("bind")

    j = client.journal.get_many([STEP, LIVE])
    if STEP not in j:  # fresh job (or killed before the first commit): initialise buffer 0
        init_params(bufs[0][:n], shp, a.seed)
        bufs[0][n:].zero_()
        if device != "cpu":
            torch.cuda.synchronize()
        client.journal.commit({STEP: b"0", LIVE: b"0", "demo/buf_step.0": b"0"})
        j = {STEP: b"0", LIVE: b"0"}
    step, live = int(j[STEP]), int(j[LIVE])
    if pg is not None:  # agree on the step (see the module docstring)
        t = torch.tensor([step], dtype=torch.int64, device=device)
        pg.all_reduce(t, op=pg.ReduceOp.MIN)
        agreed = int(t.item())
        if agreed != step:
            other = int(client.journal.get(f"demo/buf_step.{1 - live}", b"-1"))
            if step - agreed != 1 or other != agreed:
                raise RuntimeError(f"rank {rank} at step {step} cannot roll back to {agreed} (other buffer {other})")
            step, live = agreed, 1 - live
    launch.mark("recovered", step=step)
    if step and rank == 0:
        print(f"[rank 0] resuming at step {step}", flush=True)

    for s in range(step + 1, a.steps + 1):
        if s == a.fail_at_step:
            raise RuntimeError(f"--fail-at-step {s}")
        if s == a.hang_at_step and os.environ.get("GPU_ANCHOR_RESTART_COUNT", "0") == "0":
            time.sleep(3600)
        cur, nxt = bufs[live], bufs[1 - live]
        params = [v.detach().requires_grad_() for v in views(cur[:n], shp)]
        x, y = batch(a.seed, s, rank, a.batch, a.d_in, a.d_out, device)
        w1, b1, w2, b2 = params
        loss = ((torch.tanh(x @ w1 + b1) @ w2 + b2 - y) ** 2).mean()
        grads = torch.autograd.grad(loss, params)
        g = torch.cat([gr.reshape(-1) for gr in grads])
        if pg is not None:
            pg.all_reduce(g)
            g /= world
        torch.mul(cur[n:], a.momentum, out=nxt[n:])
        nxt[n:].add_(g)
        torch.add(cur[:n], nxt[n:], alpha=-a.lr, out=nxt[:n])
        if device != "cpu":
            torch.cuda.synchronize()
        live = 1 - live
        client.journal.commit({STEP: b"%d" % s, LIVE: b"%d" % live, f"demo/buf_step.{live}": b"%d" % s})
        launch.step_boundary(s, client)
        if a.step_sleep:
            time.sleep(a.step_sleep)
        if rank == 0 and s % max(1, a.steps // 5) == 0:
            print(f"[rank 0] step {s}/{a.steps} loss {loss.item():.6f}", flush=True)

    if a.out and rank == 0:
        torch.save(bufs[live].detach().cpu().clone(), a.out + ".tmp")
        os.replace(a.out + ".tmp", a.out)
    if pg is not None:
        pg.barrier()
        pg.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
