"""Checkpoint stall as the job sees it and as its thread is blocked: concurrent (soft CoW,
device-side snapshot, soft recopy) vs stop-the-world vs ``torch.distributed.checkpoint.async_save``;
the write-set tracker's step overhead idle and in flight; restore to first step, on-demand vs full.

    python -m bench checkpoint_stall --tiny                          # smoke: toy MLP, CPU, throttled copier
    python -m bench checkpoint_stall --workload llama3.2-1b --tiny   # smoke: toy Llama + AnchoredOptimizer
    python -m bench checkpoint_stall --device cuda:0 --hidden 4096 --layers 60 --batch 1024   # 12 GB MLP + Adam
    python -m bench checkpoint_stall --device cuda:0 --workload llama3.2-1b                   # 1B Llama, AdamW

Workloads: ``mlp`` is ``gpu_anchor.testing.workload.Job`` (an MLP + Adam, everything anchored:
``--hidden``² × ``--layers`` parameters, ×3 with the moments); ``llama3.2-1b`` is that shape
(``bench.models``, random weights, ``--dtype``) anchored with ``anchor_module`` and trained by
``AnchoredOptimizer(AdamW)`` (weights, gradients, moments and undo slots anchored), batch
``--batch`` × ``--seq`` tokens; the checkpoint boundary is the optimizer's "step committed"
event, as under ``gpu-anchor run`` (every step's commit lands at once, in every row).  One warm
process and daemon for everything; every step is timed to a device synchronisation.

Definitions (the same for every row):

* **host blocking** — the time the job's thread was blocked by the checkpointer (``stall_s``:
  the copy at the start, copies ops made before writing, the closing recopy).
* **job-level extra** — the checkpoint's *window* is the step at whose boundary it starts, the
  steps while it is in flight, and ``--trail`` steps after it completed (the device→host drain
  of GPU-side buffers and the background writer start there); extra = wall time of the window −
  its number of steps × the mean step of its own controls: ``--gap`` plain steps just before it
  and as many plain steps as the window just after it.  Paired, because the 12 GB MLP's plain
  step on the H200 has modes that last several steps (~198 vs ~225 ms in one run): against a
  pooled median, a window measures the mode it fell in.  The pooled figure is kept as
  ``extra_pooled_s``.  The ``gpu_clock`` record (NVML, every 10 ms) says what the SM clock and
  its clock-event reasons did meanwhile: in that run the clock stayed at 1 980 MHz with no
  reason set, so the modes are not the clock.  Each repetition also keeps ``enqueue_s``: per
  step, the host's seconds until the step's work was enqueued (before the step's closing sync),
  which says whether a slow window step waited on the host or on the device.  Disk writes run
  in a background thread in every row and are waited for between the window and its
  after-controls; then ``--settle`` plain steps, not counted, run before the after-controls: on
  the H200 the steps right after the write's idle seconds ran at a higher SM clock (1 779–1 803
  against 1 722–1 764 MHz), which made the after-controls fast and the extra too large.
* **the ``none`` row** is the measurement's A/A control: the same repetition with no
  checkpoint — a window of ``2 + --trail`` plain steps, an idle pause as long as the median disk
  write so far, the settle steps, the controls.  Its "extra" is what the procedure reads when
  nothing happens: the noise (and any bias) that every other row's extra carries.
* **tracker overhead** — median step time in windows of ``--window`` steps: plain (no tracker,
  no checkpointer); idle (the loop inside ``with tracker:``, the checkpointer's ``boundary`` at
  every step, no checkpoint in flight); in flight, tracking only (a copy-on-write flight whose
  copies are all done, run without a boundary: the dispatch mode and the flight's listeners,
  no copy traffic).  Plain and idle windows alternate, ``--rounds`` of each.

``--reps`` repetitions per checkpoint row (n ≥ 3 for a published figure): min / median / max.
"""
from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import statistics
import tempfile
import time

from bench.checkpoint_restore import _migrate, _restore, _sync
from bench.common import write_result

POLICIES = ("stw", "cow", "device", "recopy", "dcp", "none")


def _stats(xs: list) -> dict:
    """min / median / max of a non-empty list (samples kept)."""
    return {"n": len(xs), "min": min(xs), "median": statistics.median(xs), "max": max(xs), "samples": xs}


# ---------------------------------------------------------------- workloads
class _MLP:
    def __init__(self, client, args) -> None:
        from gpu_anchor.testing.workload import Job
        self.client = client
        self.job = Job(client, hidden=args.hidden, layers=args.layers, batch=args.batch)

    def run(self, s: int, boundary) -> None:
        self.job.step(s)
        self.job.commit(s)
        boundary(s)

    def state(self) -> dict:
        return self.job.tensors()

    def close(self) -> None:
        pass


class _Llama:
    """``bench.models`` shape + ``anchor_module`` + ``AnchoredOptimizer(AdamW)``; the boundary is the
    optimizer's "step committed" event (``gpu_anchor.train.step_hooks``), as under ``gpu-anchor run``."""

    def __init__(self, client, args) -> None:
        import torch
        from bench.models import build
        from gpu_anchor.train import AnchoredOptimizer, anchor_module, step_hooks
        self.client, self._boundary, self._hooks = client, None, step_hooks
        self.model = build(args.workload, args.device, dtype=getattr(torch, args.dtype), tiny=args.tiny)
        anchor_module(self.model, client)
        self.opt = AnchoredOptimizer(torch.optim.AdamW(self.model.parameters(), lr=1e-5), model=self.model,
                                     client=client)
        g = torch.Generator().manual_seed(0)
        vocab = self.model.config.vocab_size
        self.tokens = [torch.randint(0, vocab, (args.batch, args.seq), generator=g).to(args.device) for _ in range(2)]
        step_hooks.subscribe(self)

    def wants_landed(self, step: int) -> bool:
        return True  # every step's commit lands at its end: a boundary may start a checkpoint there

    def step_committed(self, step: int, clients) -> None:
        if self._boundary is not None:
            self._boundary(step)

    def run(self, s: int, boundary) -> None:
        self._boundary = boundary
        x = self.tokens[s % 2]
        self.model(input_ids=x, labels=x).loss.backward()
        self.opt.step()  # the step commits in here, then the boundary runs
        self.opt.zero_grad()

    def state(self) -> dict:
        """What a user saves: the model's weights and the optimizer's state."""
        import torch
        out = {f"model.{n}": p.detach() for n, p in self.model.named_parameters()}
        for i, st in enumerate(self.opt.optimizer.state.values()):
            out.update({f"optim.{i}.{k}": v for k, v in st.items() if torch.is_tensor(v) and v.dim()})
        return out

    def close(self) -> None:
        self._hooks.unsubscribe(self)


# ---------------------------------------------------------------- measuring
class _Runner:
    """Runs timed steps; ``boundary`` decides what happens at each step's committed point."""

    def __init__(self, wl, device: str) -> None:
        self.wl, self.device, self.step, self.plain = wl, device, 0, []
        self.spans: list[tuple[str, float, float]] = []   # (what, start, end) of every timed step
        # host seconds until the step's work was enqueued (before the closing sync), per span: far
        # below the step time, the step waited on the device; near it, on the host
        self.enqueue: list[float] = []
        self.profile = None   # a bench.step_profile.StepProfile marking each step, while one is open
        self.writes: list[float] = []   # seconds each checkpoint's disk write was waited for

    def steps(self, n: int, boundary=lambda s: None, what: str = "other") -> list[float]:
        times = []
        for _ in range(n):
            self.step += 1
            mark = self.profile.step(what) if self.profile is not None else contextlib.nullcontext()
            with mark:
                t0 = time.perf_counter()
                self.wl.run(self.step, boundary)
                t_enq = time.perf_counter()
                _sync(self.device)
                t1 = time.perf_counter()
            times.append(t1 - t0)
            self.spans.append((what, t0, t1))
            self.enqueue.append(t_enq - t0)
        return times

    def gap(self, n: int) -> list[float]:
        """Plain steps (no checkpoint anywhere): the controls every window is compared with."""
        ts = self.steps(n, what="plain")
        self.plain += ts
        return ts


def _overhead(run: _Runner, ck, tracker, args) -> dict:
    """Tracker cost per step, in rounds of three back-to-back windows (so a busy host's drift hits
    all three alike): plain; idle (inside `with tracker:`, boundary each step); in flight with every
    copy done (tracking only).  Ratios to the plain window of the same round."""
    plain, idle, tracking = [], [], []
    ck.write_files = False  # the tracking-only flights just hold the mode: nothing to write
    try:
        for _ in range(args.rounds):
            ts = run.gap(args.window)
            plain.append(statistics.median(ts))
            with tracker:
                idle.append(statistics.median(run.steps(args.window, lambda s: ck.boundary(s, due=False))))
                assert not tracker.active, "no checkpoint in flight, yet the tracker is installed"
            ck.start(run.step, policy="cow")
            while not ck.copied:
                time.sleep(0.001)
            tracking.append(statistics.median(run.steps(args.window)))  # no boundary: the flight stays open
            ck.finish(run.step)
    finally:
        ck.write_files = True
    return {"plain_step_s": _stats(plain), "idle_step_s": _stats(idle), "inflight_tracking_step_s": _stats(tracking),
            "idle_vs_plain": _stats([i / p for i, p in zip(idle, plain)]),
            "inflight_tracking_vs_plain": _stats([t / p for t, p in zip(tracking, plain)])}


def _window(run: _Runner, start_at, done, args) -> tuple[list[float], int]:
    """The due step (its boundary starts the checkpoint via ``start_at``), the steps until ``done()``,
    then ``--trail`` steps.  Returns (step times, steps in flight)."""
    times = run.steps(1, start_at, "window")
    inflight = 0
    while not done() and inflight < args.inflight_steps:
        times += run.steps(1, start_at, "window")
        inflight += 1
    return times + run.steps(args.trail, start_at, "window"), inflight


def _rep(run: _Runner, ck, policy: str, args, dcp_dir: str) -> dict:
    """One checkpoint between its two controls: ``--gap`` plain steps before it, and as many plain
    steps as its window after it (once its disk write is done)."""
    i = len(run.spans)
    before = run.gap(args.gap)
    r = _checkpoint(run, ck, policy, args, dcp_dir)
    j = len(run.spans)                      # the settle steps, not counted, between window and after
    run.steps(args.settle, what="settle")
    k = len(run.spans)
    after = run.gap(len(r["window_s"]))
    sp, enq = run.spans[i:j] + run.spans[k:], run.enqueue[i:j] + run.enqueue[k:]
    nb, nw = len(before), len(r["window_s"])
    bounds = {"before": (sp[0][1], sp[nb - 1][2]), "window": (sp[nb][1], sp[nb + nw - 1][2]),
              "after": (sp[nb + nw][1], sp[-1][2])}
    enqueue = {"before": enq[:nb], "window": enq[nb:nb + nw], "after": enq[nb + nw:]}
    return dict(r, before_s=before, after_s=after, bounds=bounds, enqueue_s=enqueue)


def _profiled_rep(run: _Runner, ck, policy: str, args, base_dir: str) -> dict:
    """One more repetition under ``torch.profiler`` (``--profile``), not counted in the row's
    figures (profiling slows steps down): per step, its wall time, device kernel time and
    copies (``bench.step_profile``), to see where a window step's extra goes."""
    from bench.step_profile import StepProfile
    prof = StepProfile(args.device)
    run.profile = prof
    try:
        with prof:
            r = _rep(run, ck, policy, args, os.path.join(base_dir, "dcp"))
    finally:
        run.profile = None
    return {"extra_s": paired_extra(r), "steps": prof.summary()}


def _checkpoint(run: _Runner, ck, policy: str, args, dcp_dir: str) -> dict:
    if policy == "dcp":
        import torch.distributed.checkpoint as dcp
        box = {}

        def at(s):
            if "fut" not in box:
                t0 = time.perf_counter()
                box["fut"] = dcp.async_save(run.wl.state(), checkpoint_id=dcp_dir)
                box["stall_s"] = time.perf_counter() - t0
        times, _ = _window(run, at, lambda: True, args)
        box["fut"].result()
        shutil.rmtree(dcp_dir, ignore_errors=True)
        return {"stall_s": box["stall_s"], "window_s": times, "inflight_steps": 0}
    if policy == "none":    # the A/A control: the same steps and pauses, no checkpoint
        times = run.steps(2 + args.trail, what="window")
        time.sleep(statistics.median(run.writes) if run.writes else 0.0)
        return {"stall_s": 0.0, "window_s": times, "inflight_steps": 0, "policy": "none"}
    before = len(ck.results)
    ck.policy = policy
    due = [True]

    def at(s):
        ck.boundary(s, due=due.pop() if due else False)
    times, inflight = _window(run, at, lambda: len(ck.results) > before, args)
    t0 = time.perf_counter()
    res = ck.finish(run.step)  # the disk write, outside the window
    run.writes.append(time.perf_counter() - t0)
    return {"stall_s": res.stall_s, "window_s": times, "inflight_steps": inflight, "policy": res.policy,
            "valid": res.valid, "cow_foreground": len(res.cow_foreground), "gpu_buffered": res.gpu_buffered,
            "recopied": len(res.recopied), "objects": res.objects, "bytes": res.bytes, "checkpoint_step": res.step,
            "seconds": res.seconds, "reason": res.reason}


def paired_extra(rep: dict) -> float:
    """The window's wall time minus as many steps at the mean of its own two controls (the plain
    steps just before and just after it): a repetition is compared with the steps around it, not
    with a pooled median that mixes the step's modes."""
    ctrl = rep["before_s"] + rep["after_s"]
    return sum(rep["window_s"]) - len(rep["window_s"]) * sum(ctrl) / len(ctrl)


def _summarise(row_reps: list[dict], base: float, trail: int) -> dict:
    """Per policy: host blocking, job-level extra (paired with its controls; also against the pooled
    median, as earlier results were) and in-flight step ratio over the repetitions."""
    pooled = [sum(r["window_s"]) - len(r["window_s"]) * base for r in row_reps]
    paired = [paired_extra(r) for r in row_reps if r.get("before_s") and r.get("after_s")]
    out = {"reps": row_reps, "stall_s": _stats([r["stall_s"] for r in row_reps]),
           "extra_s": _stats(paired) if len(paired) == len(row_reps) else _stats(pooled),
           "extra_pooled_s": _stats(pooled), "extra_definition": "paired" if paired else "pooled",
           "inflight_steps": _stats([r["inflight_steps"] for r in row_reps])}
    flight = [statistics.median(r["window_s"][1:1 + r["inflight_steps"]]) / base
              for r in row_reps if r["inflight_steps"]]
    if flight:
        out["inflight_step_ratio"] = _stats(flight)
    last = row_reps[-1]
    for k in ("policy", "objects", "bytes", "cow_foreground", "gpu_buffered", "recopied"):
        if k in last:
            out[k] = last[k]
    out["valid"] = all(r.get("valid", True) for r in row_reps)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench checkpoint_stall", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tiny", action="store_true",
                    help="smoke run: toy size on CPU, copier throttled so steps overlap it; writes *_tiny.json")
    ap.add_argument("--workload", default="mlp", choices=["mlp", "llama3.2-1b"])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--hidden", type=int, default=64, help="mlp: width")
    ap.add_argument("--layers", type=int, default=3, help="mlp: layers")
    ap.add_argument("--batch", type=int, default=None, help="mlp: rows (default 16); llama: sequences (default 8)")
    ap.add_argument("--seq", type=int, default=2048, help="llama: tokens per sequence")
    ap.add_argument("--dtype", default="bfloat16", help="llama: parameter (and AdamW state) dtype")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--policies", default=",".join(POLICIES), help=f"checkpoint rows, of {','.join(POLICIES)}")
    ap.add_argument("--reps", type=int, default=3, help="repetitions per checkpoint row")
    ap.add_argument("--dcp-reps", type=int, default=None, help="repetitions of the async_save row (default --reps)")
    ap.add_argument("--gap", type=int, default=3, help="plain steps before each repetition (the baseline)")
    ap.add_argument("--trail", type=int, default=2, help="steps counted after a checkpoint completed")
    ap.add_argument("--settle", type=int, default=6, help="plain steps, not counted, between a repetition's "
                    "disk write and its after-controls (the GPU's clock settles after the idle write)")
    ap.add_argument("--window", type=int, default=5, help="steps per tracker-overhead window")
    ap.add_argument("--rounds", type=int, default=3, help="tracker-overhead windows of each kind")
    ap.add_argument("--inflight-steps", type=int, default=50, help="cap on steps run while a checkpoint is in flight")
    ap.add_argument("--copy-chunk-mib", type=int, default=None,
                    help="the checkpointer's copy chunk (default: the library's, 64 MiB); the result's name says it")
    ap.add_argument("--profile", action="store_true",
                    help="after each checkpoint row's repetitions, one more under torch.profiler, not counted: "
                         "per step, device kernel time and copies (result key 'profiled')")
    ap.add_argument("--throttle", type=float, default=0.0, help="sleep per object in the copier (smoke runs)")
    ap.add_argument("--no-restore", action="store_true", help="skip the restore rows (mlp only anyway)")
    ap.add_argument("--dir", default=None, help="checkpoint directory (default: a temporary one)")
    ap.add_argument("--migrate-to", default=None, help="also measure live migration to this device (e.g. cuda:1)")
    ap.add_argument("--out", default=None, help="results directory (default bench/results or $GPU_ANCHOR_BENCH_OUT)")
    args = ap.parse_args(argv)
    llama = args.workload != "mlp"
    if args.tiny:
        args.device, args.hidden, args.layers, args.migrate_to = "cpu", 64, 3, None
        args.batch, args.seq = (2, 32) if llama else (16, args.seq)
        args.inflight_steps, args.throttle = min(args.inflight_steps, 20), args.throttle or 0.002
        args.window, args.gap, args.settle = min(args.window, 3), min(args.gap, 2), min(args.settle, 1)
    args.batch = args.batch or (8 if llama else 16)
    policies = [p for p in args.policies.split(",") if p]
    if set(policies) - set(POLICIES) or "stw" not in policies:
        ap.error(f"--policies: a subset of {','.join(POLICIES)} that includes stw (the reference)")
    name = "checkpoint_stall" + (f"_{args.workload}" if llama else "") + ("_tiny" if args.tiny else "") + (
        f"_chunk{args.copy_chunk_mib}m" if args.copy_chunk_mib else "")

    sock = tempfile.mkdtemp(prefix="ga-ckbench-")
    saved_env = {k: os.environ.get(k) for k in ("GPU_ANCHOR_SOCKET_DIR", "GPU_ANCHOR_CHECKPOINT_KEEP")}
    os.environ["GPU_ANCHOR_SOCKET_DIR"] = sock
    os.environ["GPU_ANCHOR_CHECKPOINT_KEEP"] = "1"  # one full checkpoint on disk at a time (disk space at 1B)
    base_dir = args.dir or tempfile.mkdtemp(prefix="ga-ckpt-")
    from gpu_anchor.client import control
    devices = ["cpu"] + ([args.device] if args.device != "cpu" else [])
    for d in devices:
        control.start(d)
    try:
        import torch
        import gpu_anchor
        from gpu_anchor.checkpoint.concurrent import ConcurrentCheckpointer
        from gpu_anchor.checkpoint.writeset import WriteSetTracker
        client = gpu_anchor.connect(args.device, namespace="job")
        t0 = time.perf_counter()
        wl = (_Llama if llama else _MLP)(client, args)
        build_s = time.perf_counter() - t0
        run = _Runner(wl, args.device)
        run.steps(args.warmup)
        from bench.gpu_clock import ClockSampler
        clock = ClockSampler.start(args.device)
        tracker = WriteSetTracker()
        ck_dir = os.path.join(base_dir, "ga")
        ck = ConcurrentCheckpointer([client], ck_dir, tracker, throttle_s=args.throttle,
                                    **({"chunk_bytes": args.copy_chunk_mib << 20} if args.copy_chunk_mib else {}))
        t0 = time.perf_counter()
        ck.prepare()  # pinned staging + the dispatch path's one-time import, shared by every row
        anchored = sum(o.nbytes for o in client.objects().values())
        result = {"workload": args.workload, "device": args.device, "hidden": args.hidden, "layers": args.layers,
                  "batch": args.batch, "seq": args.seq if llama else None, "dtype": args.dtype if llama else "float32",
                  "anchored_bytes": anchored, "anchored_objects": len(client.objects()), "build_s": build_s,
                  "copy_chunk_bytes": ck.copies.chunk_bytes,
                  "setup_s": time.perf_counter() - t0, "reps": args.reps, "trail": args.trail, "settle": args.settle,
                  "checkpoint_dir": base_dir, "checkpoint": {}, "restore": {}}
        if not llama:
            result["anchored_values"] = sum(t.numel() for t in wl.state().values())

        def save():  # after every section: a run cut short still leaves what it measured
            if run.plain:
                result["gpu_clock"] = clock and clock.summarize(run.spans, [r for reps in raw.values() for r in reps])
                result["baseline_step_s"] = statistics.median(run.plain)
                result["baseline_step"] = _stats(run.plain)
                for p, reps in raw.items():
                    result["checkpoint"][p] = _summarise(reps, result["baseline_step_s"], args.trail)
                stw = result["checkpoint"].get("stw")
                for p, row in result["checkpoint"].items():
                    if stw and p != "stw":
                        row["stall_vs_stw"] = row["stall_s"]["median"] / stw["stall_s"]["median"]
                        row["extra_vs_stw"] = row["extra_s"]["median"] / max(stw["extra_s"]["median"], 1e-9)
            return write_result(name, result, args.out)

        raw: dict[str, list] = {}
        result["overhead"] = _overhead(run, ck, tracker, args)
        save()
        for policy in policies:
            raw[policy] = []
            for _ in range((args.dcp_reps or args.reps) if policy == "dcp" else args.reps):
                raw[policy].append(_rep(run, ck, policy, args, os.path.join(base_dir, "dcp")))
            if args.profile and policy != "dcp":
                result.setdefault("profiled", {})[policy] = _profiled_rep(run, ck, policy, args, base_dir)
            save()
        if clock is not None:
            clock.stop()
        ck.close()
        wl.close()
        del wl, ck, tracker
        if not llama and not args.no_restore:
            for m in ("full", "on_demand"):
                result["restore"][m] = _restore(ck_dir, args.device, args, m)
                save()
        if args.migrate_to and not llama:
            if args.device.startswith("cuda") and torch.cuda.device_count() > 1:
                try:
                    result["migration"] = _migrate(args, args.migrate_to, sock)
                except Exception as e:  # keep the other rows
                    result["migration"] = {"error": f"{type(e).__name__}: {e}"}
            else:
                result["migration"] = {"skipped": "needs a CUDA source and a second GPU"}
        path = save()
        print(f"wrote {path}")
        base = result["baseline_step_s"]
        ov = result["overhead"]
        print(f"step {base * 1e3:.2f} ms; idle {ov['idle_vs_plain']['median'] - 1:+.1%}, "
              f"in flight (tracking only) {ov['inflight_tracking_vs_plain']['median'] - 1:+.1%}")
        for k, r in result["checkpoint"].items():
            print(f"{k:7s} host blocking {r['stall_s']['median'] * 1e3:9.2f} ms   job-level extra "
                  f"{r['extra_s']['median'] * 1e3:9.2f} ms (min {r['extra_s']['min'] * 1e3:.2f}, "
                  f"max {r['extra_s']['max'] * 1e3:.2f})")
        for k, r in result["restore"].items():
            print(f"restore {k:9s} first step after {r['time_to_first_step_s'] * 1e3:9.2f} ms")
        del torch
    finally:
        for d in devices:
            try:
                control.stop(d)
            except Exception:
                pass
        if args.dir is None:
            shutil.rmtree(base_dir, ignore_errors=True)
        shutil.rmtree(sock, ignore_errors=True)
        for k, v in saved_env.items():  # an in-process caller (the smoke test) gets its environment back
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    return 0


from bench.checkpoint_stall_report import render, title  # noqa: E402,F401  (python -m bench report)
