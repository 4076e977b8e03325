"""Random-kill campaigns through the public API: ``managed_scope`` + ``AnchoredOptimizer``.

    python tests/scope_campaign.py --case gru [--case peft] --kills 20 --out result.json

Cases (CPU, a host daemon this script starts in a private directory):

- ``gru``: ``nn.GRU`` + a linear head, AdamW with a ``LambdaLR`` warm-up schedule;
- ``peft``: a tiny Qwen3 with LoRA adapters (``peft.get_peft_model``), AdamW over the
  adapters.

The result file holds one result per ``--case``, in order.  From this interpreter (torch,
transformers and peft imported once for every case; no thread pool started) it forks, per
case: one *plain* worker (the same training without gpu-anchor: the reference), then
workers of the anchored job in one namespace, each SIGKILLed after a random delay in
[0, 0.8 × the plain run's wall time] — during the scope's bind, recovery, a forward, a
backward or the optimizer's step — until ``--kills`` kills have landed; then workers run
without kills until one finishes.  The job's final parameters, optimizer state, scheduler
state and every step's loss must equal the plain run's, bit for bit.
"""
from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import traceback

import torch
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import scope_matrix as sm  # noqa: E402

STEPS = {"gru": 120, "peft": 40}


def _build(case):
    if case == "gru":
        torch.manual_seed(0)
        model = nn.ModuleDict({"rnn": nn.GRU(8, 16, 2), "head": nn.Linear(16, 4)})
        inner = torch.optim.AdamW(model.parameters(), lr=3e-3)
    else:
        torch.manual_seed(0)
        model = sm._peft(sm.qwen())
        inner = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    sched = torch.optim.lr_scheduler.LambdaLR(inner, lambda s: min(1.0, (s + 1) / 10))
    return model, inner, sched


def _loss(case, model, step):
    g = torch.Generator().manual_seed(1000 + step)
    if case == "gru":
        x = torch.randn(6, 3, 8, generator=g)
        out, _ = model["rnn"](x)
        return (model["head"](out) - torch.randn(6, 3, 4, generator=g)).square().mean()
    ids = torch.randint(0, 128, (2, 8), generator=g)
    return model(ids, labels=ids).loss


def _final(model, inner, sched, losses, done):
    flat = [p.detach().reshape(-1).clone() for p in model.parameters()]
    for p in (p for g in inner.param_groups for p in g["params"]):
        st = inner.state[p]
        flat += [st["exp_avg"].reshape(-1), st["exp_avg_sq"].reshape(-1)]
    return {"state": torch.cat(flat).numpy().tobytes(), "steps": done, "lr": [g["lr"] for g in inner.param_groups],
            "sched": sched.state_dict()["last_epoch"], "losses": losses}


def _worker(case, ns, q):
    try:
        torch.set_num_threads(1)
        if ns is None:
            model, inner, sched = _build(case)
            start, losses = 0, []
            opt = inner
        else:
            import gpu_anchor
            from gpu_anchor.train import AnchoredOptimizer
            with gpu_anchor.managed_scope(ns):
                model, inner, sched = _build(case)
                opt = AnchoredOptimizer(inner, model=model, schedulers=[sched])
            start = opt.completed_steps
            losses = list(opt.loop_state.get("losses", []))
        for step in range(start, STEPS[case]):
            loss = _loss(case, model, step)
            loss.backward()
            losses.append(loss.item())
            if ns is not None:
                opt.loop_state["losses"] = losses
            opt.step()
            if ns is None:
                sched.step()
            opt.zero_grad()
        if ns is not None:
            opt.flush()
        q.put(_final(model, inner, sched, losses, STEPS[case] if ns is None else opt.completed_steps))
    except BaseException:
        q.put({"error": traceback.format_exc()})


def run(case: str, kills: int, seed: int) -> dict:
    ctx = mp.get_context("fork")
    rng = random.Random(seed)

    def start(ns):
        q = ctx.Queue()
        p = ctx.Process(target=_worker, args=(case, ns, q))
        p.start()
        return p, q

    t0 = time.perf_counter()
    p, q = start(None)
    ref = q.get(timeout=600)
    p.join(60)
    plain_s = time.perf_counter() - t0
    if "error" in ref:
        return {"case": case, "problems": ["plain run: " + ref["error"]]}
    problems, landed, runs, jobs, delays = [], 0, 0, 0, []

    def finish(p, q, label):
        try:
            out = q.get(timeout=600)
        except Exception:
            out = {"error": "worker gave no answer"}
        p.join(60)
        if "error" in out:
            problems.append(f"{label}: {out['error']}")
            return
        for k in ("state", "steps", "lr", "sched", "losses"):
            if out[k] != ref[k]:
                problems.append(f"{label}: {k} differs from the run without gpu-anchor")

    t0 = time.perf_counter()                       # a fault-free anchored job: the kill window
    p, q = start(f"campaign-{case}-{seed}-free")
    finish(p, q, "fault-free anchored job")
    anchored_s = time.perf_counter() - t0
    # Jobs, each in a fresh namespace, each worker SIGKILLed after a random delay, until
    # ``kills`` kills have landed; a worker that outruns its delay finishes its job.
    while landed < kills and runs < 20 * max(1, kills) and not problems:
        ns, jobs = f"campaign-{case}-{seed}-{jobs}", jobs + 1
        while not problems:
            p, q = start(ns)
            runs += 1
            delay = rng.uniform(0, 0.8 * anchored_s)
            p.join(delay)
            if p.is_alive() and landed < kills:
                os.kill(p.pid, signal.SIGKILL)
                p.join(30)
                landed += 1
                delays.append(round(delay, 3))
                continue
            finish(p, q, f"job {jobs}")
            break
    return {"case": case, "kills": landed, "runs": runs, "jobs": jobs, "plain_s": round(plain_s, 3),
            "anchored_s": round(anchored_s, 3), "delays_s": delays, "steps": STEPS[case], "problems": problems}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--case", choices=sorted(STEPS), action="append", required=True)
    ap.add_argument("--kills", type=int, default=20)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    work = tempfile.mkdtemp(prefix="ga-campaign-")
    os.environ["GPU_ANCHOR_SOCKET_DIR"] = os.path.join(work, "sock")
    os.makedirs(os.environ["GPU_ANCHOR_SOCKET_DIR"], mode=0o700)
    os.environ.pop("GPU_ANCHOR_SOCKET", None)
    results = []
    sm.preload()
    try:
        sm._cli("daemon", "--device", "cpu", "--detach")
        for case in args.case:
            try:
                results.append(run(case, args.kills, args.seed))
            except BaseException:
                results.append({"case": case, "problems": [traceback.format_exc()]})
    except BaseException:        # no daemon: no case ran
        results = [{"case": case, "problems": [traceback.format_exc()]} for case in args.case]
    finally:
        try:
            sm._cli("stop")
        except (subprocess.CalledProcessError, OSError):
            pass
        shutil.rmtree(work, ignore_errors=True)
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)
    for result in results:
        print(json.dumps({k: v for k, v in result.items() if k != "delays_s"}))
    return 0


if __name__ == "__main__":
    from gpu_anchor import runtime
    runtime.exit_path(lambda: sys.exit(main()))    # skips the ~1 s teardown of torch and transformers
