"""``python -m bench baselines``: each checkpoint baseline must restore bit-exactly.

Trains a model for a few steps, saves, trains on (the reference), then builds a fresh
model without initialisation, restores, repeats the same steps and compares every
parameter and optimizer tensor bit for bit.  A baseline that fails this is not measured.
"""
from __future__ import annotations

import argparse
import shutil
import tempfile
import time

from . import TRAIN, method


def check(name: str, model_name: str, device: str, tiny: bool, steps: int, bsz: int, seq: int) -> dict:
    import torch

    from bench import models
    from . import state
    from .trainer import make_optimizer, train_step
    d = tempfile.mkdtemp(prefix=f"ga-rt-{name}-", dir="/dev/shm" if name == "inmemory" else None)
    try:
        model = models.build(model_name, device, tiny=tiny)
        opt = make_optimizer(model, device)
        ck = method(name)(d, device)
        for s in range(steps):
            train_step(model, opt, s, bsz, seq)
        t0 = time.perf_counter()
        ck.save(model, opt, steps)
        blocking = time.perf_counter() - t0
        ck.wait()
        for s in range(steps, steps + 2):
            train_step(model, opt, s, bsz, seq)
        want = [t.detach().clone() for _, t in state.named_state(model, opt)]
        del model, opt
        model = models.build(model_name, device, tiny=tiny, init=False)
        opt = make_optimizer(model, device)
        ck2 = method(name)(d, device)
        t0 = time.perf_counter()
        got_step = ck2.restore(model, opt)
        restore = time.perf_counter() - t0
        for s in range(got_step, got_step + 2):
            train_step(model, opt, s, bsz, seq)
        got = [t for _, t in state.named_state(model, opt)]
        exact = got_step == steps and len(got) == len(want) and all(
            a.shape == b.shape and torch.equal(a.cpu(), b.cpu()) for a, b in zip(got, want))
        ck.close(), ck2.close()
        return {"method": name, "exact": exact, "restored_step": got_step, "blocking_s": blocking,
                "restore_s": restore}
    finally:
        shutil.rmtree(d, ignore_errors=True)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench baselines", description=__doc__)
    p.add_argument("--model", default="llama3.2-1b")
    p.add_argument("--device", default=None)
    p.add_argument("--tiny", action="store_true")
    p.add_argument("--methods", default=",".join(TRAIN))
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    import torch
    device = args.device or ("cuda:0" if torch.cuda.is_available() else "cpu")
    bsz, seq = (2, 32) if args.tiny else (2, 512)
    rows = [check(m, args.model, device, args.tiny, 3, bsz, seq) for m in args.methods.split(",")]
    for r in rows:
        print(f"{r['method']:12s} exact={r['exact']} step={r['restored_step']} "
              f"blocking={r['blocking_s']:.3f}s restore={r['restore_s']:.3f}s")
    from bench.common import write_result
    write_result("baselines_tiny" if args.tiny else "baselines",
                 {"title": f"Baseline round trips ({args.model}, {device})", "device": device, "rows": rows},
                 args.out)
    bad = [r["method"] for r in rows if not r["exact"]]
    if bad:
        print("NOT bit-exact:", ", ".join(bad))
        return 1
    return 0


def render(result: dict) -> str:
    lines = ["| method | bit-exact restore | blocking save (s) | restore (s) |", "| --- | --- | --- | --- |"]
    for r in result["rows"]:
        lines.append(f"| {r['method']} | {'yes' if r['exact'] else '**NO**'} | {r['blocking_s']:.3f} | "
                     f"{r['restore_s']:.3f} |")
    return "\n".join(lines)
