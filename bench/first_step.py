"""What the first training step of a restarted worker costs, and what a standby can pre-pay.

    python -m bench first_step                       # H200: llama3.2-1b, bf16 AdamW, batch 4 x 1024
    python -m bench first_step --tiny                # CPU smoke size

In every recovery table the first step after a restart takes several times a steady step
(llama3.2-1b on the H200: ~0.6-0.75 s vs ~0.09 s), for gpu-anchor and the baselines alike:
the new process meets every kernel, cuBLAS heuristic and allocator block for the first time.
A warm standby (``gpu-anchor run --warm-pool``) runs before the fault, so whatever it does
then is off the critical path, but it must not touch the job's state.  This measures, each
variant in a fresh process with a fresh CUDA context (``run_isolated``), the first and
steady step of the real model after a *pre-warm* done beforehand on scratch tensors only:

* ``none``      — CUDA context only (what a restarted worker has today);
* ``cublas``    — plus a bf16 matmul (``runtime.warm.warm_cuda``: the serving standby's warm-up);
* ``shape``     — plus one training step of a 1-layer model of the same shapes (hidden
  size, heads, vocabulary, batch, sequence) on its own random weights;
* ``shape_release`` — ``shape``, then ``torch.cuda.empty_cache()``: the kernels and
  heuristics stay warm, the allocator's blocks go back, so the difference to ``shape``
  is what the caching allocator's warm blocks are worth;
* ``eager_modules`` — ``cublas`` with ``CUDA_MODULE_LOADING=EAGER``: the context loads every
  kernel module of every library at creation (in a standby, before the fault) instead of each
  at its first launch; it needs no knowledge of the job, so a default standby could do it.
  ``context_bytes`` shows what the context then holds on the device.
* ``auto``      — ``cublas``, then the automatic pre-warm of ``gpu-anchor run`` without flags
  (``runtime.auto_prewarm.run_auto_prewarm``) from the recipe its ``Recorder`` took from one
  real step of the model in another fresh process (what a worker sends its supervisor).

The real model's weights and optimizer state are created before the clock starts (a
restarted worker maps or loads them first); the clock covers one full step, synchronised.
"""
from __future__ import annotations

import argparse
import statistics
import time

from bench.common import default_device, fmt_s, run_isolated, write_result

VARIANTS = ("none", "cublas", "shape", "shape_release", "eager_modules", "auto")


def _step(model, opt, step, bsz, seq):
    from bench.baselines.trainer import train_step
    return float(train_step(model, opt, step, bsz, seq).detach())  # synchronises


def _prewarm(variant, name, device, tiny, bsz, seq, recipe=None) -> float:
    from bench.baselines.trainer import scratch_step
    t0 = time.perf_counter()
    if variant in ("cublas", "shape", "shape_release", "eager_modules", "auto") and device.startswith("cuda"):
        from gpu_anchor.runtime.warm import warm_cuda
        warm_cuda(device)
    if variant in ("shape", "shape_release"):
        scratch_step(name, device, tiny, bsz, seq, release=variant == "shape_release")
    if variant == "auto":
        from gpu_anchor.runtime.auto_prewarm import run_auto_prewarm
        info = run_auto_prewarm(recipe, device)
        if "auto_prewarm_s" not in info:
            raise RuntimeError(f"the automatic pre-warm did not run: {info}")
    return time.perf_counter() - t0


def record_recipe(name: str, device: str, tiny: bool, bsz: int, seq: int) -> dict:
    """In a fresh process: the automatic pre-warm's recipe as ``runtime.auto_prewarm.Recorder``
    takes it from one real training step of the model."""
    from gpu_anchor.runtime.auto_prewarm import Recorder

    from bench import models
    from bench.baselines.trainer import make_optimizer, train_step
    got = []
    rec = Recorder(got.append).install()
    model = models.build(name, device, tiny=tiny, init=False)
    float(train_step(model, make_optimizer(model, device), 0, bsz, seq).detach())
    rec.remove()
    if not got or "recipe" not in got[0]:
        raise RuntimeError(f"no recipe recorded: {got}")
    return got[0]["recipe"]


def probe(variant: str, name: str, device: str, tiny: bool, bsz: int, seq: int, steps: int,
          recipe: dict | None = None) -> dict:
    """In a fresh process: CUDA context, pre-warm, the real model + optimizer state, then steps."""
    import torch
    from bench import models
    from bench.baselines.trainer import make_optimizer
    import os
    if variant == "eager_modules":      # read by the driver when this process creates its context
        os.environ["CUDA_MODULE_LOADING"] = "EAGER"
    t0 = time.perf_counter()
    context_bytes = None
    if device.startswith("cuda"):
        torch.cuda.set_device(device)
        torch.empty(1, device=device)
        free, total = torch.cuda.mem_get_info()
        context_bytes = total - free    # the context, kernels and the 1-element tensor's block
    cuda_s = time.perf_counter() - t0
    warm_s = _prewarm(variant, name, device, tiny, bsz, seq, recipe)
    model = models.build(name, device, tiny=tiny, init=False)
    opt = make_optimizer(model, device)
    for group in opt.param_groups:  # the optimizer state a restarted worker finds restored
        for p in group["params"]:
            opt.state[p] = {"step": torch.zeros((), dtype=torch.float32, device=p.device if opt.defaults.get("fused")
                                                else "cpu"),
                            "exp_avg": torch.zeros_like(p), "exp_avg_sq": torch.zeros_like(p)}
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    dts = []
    for s in range(steps):
        t = time.perf_counter()
        _step(model, opt, s + 1, bsz, seq)
        dts.append(time.perf_counter() - t)
    return {"variant": variant, "cuda_init_s": cuda_s, "context_bytes": context_bytes, "prewarm_s": warm_s, "first_step_s": dts[0],
            "steady_step_s": statistics.median(dts[1:]), "step_dts": dts}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench first_step", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="llama3.2-1b")
    p.add_argument("--variants", default=",".join(VARIANTS))
    p.add_argument("--repeat", type=int, default=3, help="fresh processes per variant (the protocol's n; >= 3)")
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--device", default=None)
    p.add_argument("--tiny", action="store_true")
    p.add_argument("--out", default=None)
    a = p.parse_args(argv)
    device = default_device(a.device)
    if a.tiny:
        a.batch, a.seq, a.steps, a.repeat = 2, 32, 3, 1
    variants = [v for v in a.variants.split(",") if v]
    bad = set(variants) - set(VARIANTS)
    if bad:
        p.error(f"unknown variant(s) {sorted(bad)}; choose from {VARIANTS}")
    rows = []
    recipe = run_isolated(record_recipe, a.model, device, a.tiny, a.batch, a.seq) if "auto" in variants else None
    for v in variants:
        trials = [run_isolated(probe, v, a.model, device, a.tiny, a.batch, a.seq, a.steps, recipe)
                  for _ in range(a.repeat)]
        row = {"variant": v, "trials": trials,
               **{k: statistics.median(t[k] for t in trials)
                  for k in ("cuda_init_s", "prewarm_s", "first_step_s", "steady_step_s")}}
        if all(t.get("context_bytes") is not None for t in trials):
            row["context_bytes"] = statistics.median(t["context_bytes"] for t in trials)
        rows.append(row)
        print(f"{a.model} {v:14s} first step {row['first_step_s']:.3f}s  steady {row['steady_step_s']:.3f}s  "
              f"(pre-warm {row['prewarm_s']:.3f}s, off the critical path)", flush=True)
    result = {"title": f"Training: the first step of a restarted worker, and what a standby can pre-pay "
                       f"({a.model}, {device})", "device": device, "model": a.model, "batch": a.batch, "seq": a.seq, "repeat": a.repeat,
              "rows": rows}
    write_result("first_step" + ("_tiny" if a.tiny else ""), result, a.out)
    return 0


def render(result: dict) -> str:
    rows = result["rows"]
    base = next((r for r in rows if r["variant"] == "none"), rows[0])
    lines = [f"{result['model']}, batch {result['batch']} × {result['seq']} tokens, bf16 weights + AdamW; "
             f"medians of {result['repeat']} fresh process(es) per row.", "",
             "| pre-warm in the standby (before the fault) | pre-warm time | first step | each process's first step "
             "| steady step | first − steady | vs no pre-warm | context creation | device memory after it |",
             "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    label = {"none": "none (CUDA context only)", "cublas": "cuBLAS + a bf16 matmul",
             "shape": "one step of a 1-layer model of the same shapes",
             "shape_release": "same, then `empty_cache()` (kernels warm, allocator cold)",
             "eager_modules": "`CUDA_MODULE_LOADING=EAGER` + cuBLAS (every kernel module loaded at context creation)",
             "auto": "the automatic pre-warm (`gpu-anchor run` without flags), from the recorded recipe"}
    for r in rows:
        extra = r["first_step_s"] - r["steady_step_s"]
        lines.append(f"| {label.get(r['variant'], r['variant'])} | {fmt_s(r['prewarm_s'])} | "
                     f"**{fmt_s(r['first_step_s'])}** | {', '.join(fmt_s(t['first_step_s']) for t in r['trials'])} | "
                     f"{fmt_s(r['steady_step_s'])} | {fmt_s(extra)} | "
                     f"{base['first_step_s'] / r['first_step_s']:.2f}× | {fmt_s(r['cuda_init_s'])} | "
                     + (f"{r['context_bytes'] / 2**20:.0f} MiB |" if r.get("context_bytes") is not None else "– |"))
    if result["repeat"] < 3:
        lines += ["", f"n = {result['repeat']} processes per row: below the benchmark protocol's n ≥ 3 (not a "
                  "headline)."]
    lines += ["", "Each row is a fresh process with its own CUDA context; the pre-warm touches scratch "
              "tensors only (a standby must not touch the job's state) and runs before the fault, so it "
              "is off the critical path. The real model's weights and optimizer state exist before the "
              "clock starts, as they do for a restarted worker."]
    return "\n".join(lines)
