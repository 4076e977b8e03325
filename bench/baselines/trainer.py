"""The training worker every training benchmark runs, for every method alike.

    python -m bench.baselines.trainer --method M --model SHAPE --device D --dir DIR
        --events FILE [--total N] [--run-steps K] [--ckpt-every C] [--tiny]

Writes one JSON line per event to ``--events`` (wall-clock ``t``, so a driver can time a
restart across processes): ``imported`` (torch + transformers + the method), ``cuda``
(context ready), ``built`` (model on the device), ``restored`` (``step`` = first step to
run), ``step`` (after each optimizer step, with the loss), ``saved`` (blocking seconds of
that checkpoint), ``paused`` (tests: ``--pause-at-step``), ``done``.  Cold: a fresh
``python``; warm: the same ``main`` run in a child forked by gpu-anchor's zygote that already imported torch and transformers, or a
standby of that zygote that takes over after the fault (``standby``; its pre-warm is
``prewarm`` below).
"""
from __future__ import annotations

import time

T_PROCESS = time.time()

import argparse  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402


class Events:
    def __init__(self, path: str) -> None:
        self.fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)

    def __call__(self, ev: str, **kw) -> None:
        # one write() per line: what the kernel got survives a SIGKILL of this process
        os.write(self.fd, (json.dumps({"ev": ev, "t": time.time(), "pid": os.getpid(), **kw}) + "\n").encode())


def batch(step: int, vocab: int, bsz: int, seq: int, device):
    """Synthetic tokens for ``step``: the same on every run and after every restart."""
    import torch
    g = torch.Generator().manual_seed(1000 + step)
    return torch.randint(0, vocab, (bsz, seq), generator=g).to(device, non_blocking=True)


def train_step(model, opt, step: int, bsz: int, seq: int) -> float:
    ids = batch(step, model.config.vocab_size, bsz, seq, next(model.parameters()).device)
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return loss


def make_optimizer(model, device: str):
    import torch
    fused = torch.device(device).type == "cuda"
    return torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.01, foreach=not fused, fused=fused)


def scratch_step(model: str, device: str, tiny: bool, bsz: int, seq: int, release: bool = True) -> None:
    """One training step of a 1-layer copy of shape ``model`` on scratch weights (loads the
    kernels the real step needs); ``release``: its memory goes back to the driver after."""
    import torch

    from bench import models
    scratch = models.build(model, device, tiny=tiny, layers=1, seed=1)
    opt = make_optimizer(scratch, device)
    float(train_step(scratch, opt, 0, bsz, seq).detach())
    del scratch, opt
    if release and device.startswith("cuda"):
        torch.cuda.empty_cache()


PREWARM_ENV = "BENCH_TRAIN_PREWARM"


def prewarm(device: str) -> None:
    """A warm standby's pre-warm (``gpu-anchor run --prewarm bench.baselines.trainer:prewarm``, and
    the benchmarks' standbys): ``scratch_step`` with the shapes in ``BENCH_TRAIN_PREWARM`` (JSON:
    model, tiny, batch, seq)."""
    spec = json.loads(os.environ[PREWARM_ENV])
    scratch_step(spec["model"], device, spec.get("tiny", False), spec["batch"], spec["seq"])


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m bench.baselines.trainer")
    p.add_argument("--method", required=True)
    p.add_argument("--model", default="llama3.2-1b")
    p.add_argument("--tiny", action="store_true")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dir", required=True, help="the method's checkpoint directory")
    p.add_argument("--namespace", default="bench-train", help="gpu-anchor namespace")
    p.add_argument("--events", required=True)
    p.add_argument("--total", type=int, default=2000, help="train until this many steps are done")
    p.add_argument("--run-steps", type=int, default=0, help="exit after this many steps in this worker (0: no limit)")
    p.add_argument("--ckpt-every", type=int, default=100)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--dump", default=None, help="at the end, torch.save the full training state here (tests)")
    p.add_argument("--pause-at-step", type=int, default=None,
                   help="tests: after this step (and its checkpoint, if one is due) wait to be killed, so a kill "
                        "lands at a known step however fast the run goes")
    p.add_argument("--wait-persist", action="store_true",
                   help="wait for each checkpoint's background persistence and report it (recovery benchmark)")
    return p


def main(argv=None) -> int:
    args = parser().parse_args(argv)
    ev = Events(args.events)
    ev("process", t_process=T_PROCESS)
    import torch
    import transformers  # noqa: F401  (timed as start-up, like a real training script)

    from bench import baselines, models
    ev("imported")
    if args.device.startswith("cuda"):
        torch.cuda.set_device(args.device)
        torch.empty(1, device=args.device)
    ev("cuda")
    ck = baselines.method(args.method)(args.dir, args.device)
    anchored = args.method == "gpu_anchor"
    fresh = anchored and not _anchored_state_exists(args) or not anchored and not _has_checkpoint(ck)
    model = models.build(args.model, args.device, tiny=args.tiny, init=fresh)
    model.train()
    opt = make_optimizer(model, args.device)
    ev("built", fresh=fresh)
    if anchored:
        opt, start = ck.attach(model, opt, args.namespace)
    else:
        start = ck.restore(model, opt) or 0
    ev("restored", step=start, notes=ck.notes)
    step, ran = start, 0
    while step < args.total and (not args.run_steps or ran < args.run_steps):
        t0 = time.perf_counter()
        loss = train_step(model, opt, step, args.batch, args.seq)
        lv = float(loss.detach())  # synchronises: the step is complete
        step, ran = step + 1, ran + 1
        ev("step", step=step, loss=lv, dt=time.perf_counter() - t0)
        if not anchored and args.ckpt_every and step % args.ckpt_every == 0:
            t0 = time.perf_counter()
            ck.save(model, opt, step)
            ev("saved", step=step, blocking_s=time.perf_counter() - t0, notes=ck.notes)
            if args.wait_persist:
                ck.wait()
                ev("persisted", step=step)
        if args.pause_at_step is not None and step >= args.pause_at_step:
            ev("paused", step=step)
            while True:
                time.sleep(60)
    ck.close()
    if args.dump:
        from bench.baselines.state import named_state
        inner = getattr(opt, "optimizer", opt)  # AnchoredOptimizer wraps the torch optimizer
        torch.save({n: t.detach().cpu().clone() for n, t in named_state(model, inner)}, args.dump)
    ev("done", step=step)
    return 0


def _has_checkpoint(ck) -> bool:
    d = ck.directory
    return os.path.isdir(d) and any(n in ("latest", "latest.json", "ckpt.pt") for n in os.listdir(d))


def _anchored_state_exists(args) -> bool:
    import gpu_anchor
    c = gpu_anchor.connect(args.device, namespace=args.namespace)
    try:
        return bool(c.names())
    finally:
        c.close() if hasattr(c, "close") else None


if __name__ == "__main__":
    raise SystemExit(main())
