"""Training recovery after SIGKILL: kill → next training step completed, per method, cold and warm.

    python -m bench recovery_train                               # H200, Llama3.2-1B shape
    python -m bench recovery_train --models llama3.2-1b,qwen3-1.7b,llama3.2-3b
    python -m bench recovery_train --tiny                        # CPU smoke size

For each method one worker trains and checkpoints every ``--ckpt-every`` steps; once a
checkpoint is durable and one more step is done, the driver SIGKILLs the worker and starts
the next one, which restores and runs one step; that worker is in turn killed after its
next durable checkpoint (``--repeat`` kills per mode).  Phases, from the worker's own
wall-clock events: **start-up** (kill → model built on the device: process start, imports,
CUDA context, model construction without initialisation), **restore** (checkpoint → live
tensors; gpu-anchor: mapping the daemon's objects and the optimizer's journal recovery),
**first step** (the first optimizer step after the restore).  Cold = a fresh interpreter;
warm = a child of gpu-anchor's fork server that imported torch + transformers + the model
code (the same server and preloads for every method).  Every restarted worker also
reports how many completed steps it lost (it resumes at its restored step).
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile
import time

from bench.baselines import standby
from bench.common import default_device, failure_notes, fmt_s, median_by_mode, private_daemon, write_result
from bench.protocol import Cell, Interval, from_rows, throughput_section

TARGET_X = 5.0  # issue 7: >= 5x faster than the in-memory checkpoint, 1B model
PAPER = "26.6 % faster"
PHASES = ("startup_s", "restore_s", "first_step_s", "total_s")
INTERVAL = Interval("SIGKILL of the worker", "the next training step completed (its loss on the host)")
STEADY_SKIP = 2   # fault-free step times: the first worker's steps after its first two


def _trial_args(method, model, device, tiny, d, ns, evfile, ckpt_every, bsz, seq) -> list[str]:
    a = ["--method", method, "--model", model, "--device", device, "--dir", d, "--namespace", ns,
         "--events", evfile, "--total", "1000000", "--ckpt-every", str(ckpt_every), "--wait-persist",
         "--batch", str(bsz), "--seq", str(seq)]
    return a + (["--tiny"] if tiny else [])


def _phases(evs: list[dict], t_kill: float, t_dead: float, ready: dict | None = None) -> dict:
    """The restarted worker's phases from its events; ``ready``: the fork server's report of the
    standby it ran in (None: started after the fault)."""
    by = {}
    for e in evs:
        by.setdefault(e["ev"], e)
    first = by["step"]
    if ready is not None:  # a standby: process, imports and CUDA context came before the fault
        out = {"go_s": by["process"]["t"] - t_kill, "build_s": by["built"]["t"] - by["process"]["t"],
               "prewarm_s": ready["info"].get("prewarm_s"), "standby_cuda_init_s": ready["info"].get("cuda_init_s")}
    else:
        out = {"process_s": by["process"]["t_process"] - t_kill, "imports_s": by["imported"]["t"] - t_kill,
               "cuda_s": by["cuda"]["t"] - by["imported"]["t"], "build_s": by["built"]["t"] - by["cuda"]["t"]}
    out.update({"detect_s": t_dead - t_kill,
                "startup_s": by["built"]["t"] - t_kill, "restore_s": by["restored"]["t"] - by["built"]["t"],
                "first_step_s": first["t"] - by["restored"]["t"], "total_s": first["t"] - t_kill,
                "restored_step": by["restored"]["step"], "fresh": by["built"].get("fresh"),
                "notes": by["restored"].get("notes", {})})
    if out["fresh"] or out["notes"].get("created"):
        raise RuntimeError(f"the restarted worker did not find the previous state: {out}")
    return out


def steady_step_times(evs: list[dict], pid: int) -> list[float]:
    """Fault-free step times of worker ``pid`` (its steps after the first ``STEADY_SKIP``): the
    training step alone, checkpoint saves excluded (persist_blocking and e2e_faults count those)."""
    return [e["dt"] for e in evs if e["ev"] == "step" and e["pid"] == pid][STEADY_SKIP:]


def run_method(method, model, device, tiny, modes, repeat, ckpt_every, bsz, seq, work, launchers) -> dict:
    from bench.baselines.launcher import EventLog
    from bench.baselines.trainer import PREWARM_ENV
    d = tempfile.mkdtemp(prefix=f"rt-{method}-", dir="/dev/shm" if method == "inmemory" else work)
    evfile = os.path.join(work, f"{method}-{model}.events")
    log = EventLog(evfile)
    ns = f"rt-{method}-{model}-{time.time_ns()}"
    args = _trial_args(method, model, device, tiny, d, ns, evfile, ckpt_every, bsz, seq)
    shapes = standby.prewarm_env(PREWARM_ENV, {"model": model, "tiny": tiny, "batch": bsz, "seq": seq})
    anchored = method == "gpu_anchor"
    setup = launchers.get("warm") or launchers["cold"]
    launcher, pid = setup, setup.spawn(args)
    first_pid = pid
    trials = {m: [] for m in modes}
    if tiny and method != "gpu_anchor":
        trials.pop("cold", None)  # smoke size: cold start-up is the same interpreter cost for every method
    modes = list(trials)
    sid = None
    try:
        for mode in modes:
            for _ in range(repeat):
                sid = ready = None
                if mode in standby.STANDBY_MODES:  # the next worker waits, ready, before the fault
                    sid, ready = standby.start(launchers["warm"], device, "bench.baselines.trainer:prewarm"
                                               if mode == "prewarm" else None, shapes)
                log.wait(lambda e: e["ev"] == "restored" and e["pid"] == pid, lambda: launcher.alive(pid))
                log.poll()
                # the worker trained on while a standby got ready: count from the steps it has now
                last = max((e["step"] for e in log.events if e["ev"] == "step" and e["pid"] == pid), default=0)
                if anchored:
                    ck_step = log.wait(lambda e: e["ev"] == "step" and e["pid"] == pid and
                                       e["step"] >= last + ckpt_every, lambda: launcher.alive(pid))["step"]
                else:
                    ck_step = log.wait(lambda e: e["ev"] == "persisted" and e["pid"] == pid and e["step"] > last,
                                       lambda: launcher.alive(pid))["step"]
                log.wait(lambda e: e["ev"] == "step" and e["pid"] == pid and e["step"] >= ck_step + 1,
                         lambda: launcher.alive(pid))
                t_kill = time.time()
                launcher.kill(pid)
                t_dead = time.time()
                log.poll()
                done = max(e["step"] for e in log.events if e["ev"] == "step" and e["pid"] == pid)
                if sid is not None:
                    launcher, pid = launchers["warm"], standby.release(launchers["warm"], sid, args,
                                                                      "bench.baselines.trainer")
                    sid = None
                else:
                    launcher = launchers[mode]
                    pid = launcher.spawn(args)
                log.wait(lambda e: e["ev"] == "step" and e["pid"] == pid, lambda: launcher.alive(pid))
                ph = _phases([e for e in log.events if e["pid"] == pid], t_kill, t_dead, ready)
                ph["killed_after_step"] = done
                ph["lost_steps"] = max(0, done - ph["restored_step"])  # a step may commit before the kill lands
                trials[mode].append(ph)
                print(f"{model} {method:10s} {mode}: total {ph['total_s']:.3f}s = start-up {ph['startup_s']:.3f} "
                      f"+ restore {ph['restore_s']:.3f} + first step {ph['first_step_s']:.3f}; "
                      f"lost {ph['lost_steps']} steps", flush=True)
    finally:
        try:
            launcher.kill(pid)
            if sid is not None:  # a standby that never took over
                standby.dismiss(launchers["warm"], sid)
        finally:
            shutil.rmtree(d, ignore_errors=True)
    return {"method": method, "modes": median_by_mode(trials),
            "fault_free_step_s": steady_step_times(log.events, first_pid)}


SUPERVISED = {  # variant -> (method name in the result, extra `gpu-anchor run` options, the baselines' mode)
    "default": ("gpu_anchor_run_default", [], None),   # no recovery flags: what a new user gets (GPU: a standby
                                                       # that replays the first step's recipe, runtime.auto_prewarm)
    "no_early_start": ("gpu_anchor_run_no_early_start", ["--no-early-start"], None),  # the default, successor
                                                       # started at the worker's exit (the default before early start)
    "fork": ("gpu_anchor_run", ["--no-warm-pool"], "warm"),
    "warm_pool": ("gpu_anchor_run_warm_pool", ["--warm-pool", "--no-auto-prewarm"], "standby"),
    "prewarm": ("gpu_anchor_run_prewarm", ["--prewarm", "bench.baselines.trainer:prewarm"], "prewarm"),
}


def supervised_mode(variant: str, device: str) -> str:
    """The baselines' mode a ``gpu-anchor run`` variant compares with: ``default`` keeps a standby
    on GPU jobs and forks on CPU jobs (``launch.config.resolve_standby``)."""
    mode = SUPERVISED[variant][2]
    return mode or ("standby" if device.startswith("cuda") else "warm")


def run_supervised(model, device, tiny, repeat, ckpt_every, bsz, seq, work, variant="fork") -> dict:
    """gpu-anchor as shipped: ``gpu-anchor run`` (supervisor, warm workers, its own daemons)
    restarts the killed worker by itself; kill → first step measured the same way.
    ``variant``: ``default`` (no recovery flags), ``fork`` (a child of the warm fork server),
    ``warm_pool`` (a standby with its CUDA context made takes over), ``prewarm`` (that standby
    also ran one step of a 1-layer copy of the model first).  With standbys, each kill waits
    until the supervisor's job record says the next standby is ready; each trial records how
    the supervisor restarted the rank."""
    import signal
    import subprocess
    import sys

    from bench.baselines.launcher import PRELOAD, ROOT, EventLog, worker_env
    method, extra, _ = SUPERVISED[variant]
    mode = supervised_mode(variant, device)
    standbys = mode in standby.STANDBY_MODES
    evfile = os.path.join(work, f"supervised-{variant}-{model}.events")
    log = EventLog(evfile)
    ns = f"rt-sup-{model}-{time.time_ns()}"
    args = _trial_args("gpu_anchor", model, device, tiny, os.path.join(work, "sup-ck"), ns, evfile, ckpt_every,
                       bsz, seq)
    env = worker_env()
    env["GPU_ANCHOR_SOCKET_DIR"] = sockets = tempfile.mkdtemp(prefix="ga-sup-")  # the supervisor's own daemons
    env["BENCH_TRAIN_PREWARM"] = json.dumps({"model": model, "tiny": tiny, "batch": bsz, "seq": seq})
    env.pop("GPU_ANCHOR_WARM_POOL", None)  # each variant says what it wants; `default` gets the default
    # `gpu-anchor run` (gpu_anchor.launch.cli until the top-level CLI registers `run`)
    cmd = [sys.executable, "-c", "import sys; from gpu_anchor.launch.cli import main; sys.exit(main(sys.argv[1:]))",
           "run", "--max-restarts", str(repeat + 2), "--restart-backoff",
           "0", "--crash-loop", str(repeat + 2), "--preload", ",".join(PRELOAD), "--namespace", ns,
           "--device-type", "cuda" if device.startswith("cuda") else "cpu", "--quiet", *extra, "--",
           sys.executable, "-m", "bench.baselines.trainer"] + args
    sup = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=open(os.path.join(work, "supervisor.log"), "wb"),
                           stderr=subprocess.STDOUT, start_new_session=True)
    trials = []
    try:
        def alive():
            return sup.poll() is None
        pid = log.wait(lambda e: e["ev"] == "restored", alive, 600)["pid"]
        first_pid, workers = pid, {pid}
        for _ in range(repeat):
            restored = log.wait(lambda e: e["ev"] == "restored" and e["pid"] == pid, alive)["step"]
            done = log.wait(lambda e: e["ev"] == "step" and e["pid"] == pid and e["step"] >= restored + ckpt_every + 1,
                            alive)["step"]
            sb = None
            if standbys:  # the fault must find a ready standby, as in a job that ran a while
                sb = _wait_standby_ready(sockets, ns, workers, alive)
            log.poll()
            done = max(e["step"] for e in log.events if e["ev"] == "step" and e["pid"] == pid)
            t_kill = time.time()
            os.kill(pid, signal.SIGKILL)
            first = log.wait(lambda e: e["ev"] == "step" and e["pid"] != pid and e["t"] > t_kill, alive, 600)
            pid = first["pid"]
            workers.add(pid)
            ph = _phases([e for e in log.events if e["pid"] == pid], t_kill, t_kill)
            ph["killed_after_step"] = done
            ph["lost_steps"] = max(0, done - ph["restored_step"])
            ph["how"] = _last_restart_how(sockets, ns)
            rec = (_job(sockets, ns).get("restarts") or [{}])[-1]
            if rec.get("t_exit") and rec.get("t_detect"):     # the supervisor's side of the start-up
                ph.update(exit_s=rec["t_exit"] - t_kill, detect_s=rec["t_detect"] - t_kill,
                          decide_s=rec.get("decide_s"), spawn_s=rec.get("spawn_s"), early=bool(rec.get("early")))
                if rec.get("early"):    # the successor started at the death, waited at its gate until t_gate
                    ph.update(early_start_s=rec["t_started"] - t_kill, gate_open_s=rec["t_gate"] - t_kill)
            for k in AUTO_PREWARM_KEYS:   # what the standby's automatic pre-warm did, or why it did not
                if sb and k in sb:
                    ph["standby_" + k] = sb[k]
            trials.append(ph)
            print(f"{model} gpu-anchor run ({variant}, {ph['how']}): total {ph['total_s']:.3f}s = start-up "
                  f"{ph['startup_s']:.3f} + restore {ph['restore_s']:.3f} + first step {ph['first_step_s']:.3f}",
                  flush=True)
    finally:
        try:
            os.killpg(sup.pid, signal.SIGTERM)
            sup.wait(timeout=30)
        except Exception:
            try:
                os.killpg(sup.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        # a stopped supervisor leaves its daemons running (the state is kept for a rerun): stop them,
        # or they outlive the benchmark (and the test suite)
        from gpu_anchor.client import control
        for dev, path in control.discover(sockets).items():
            control.stop(dev, path)
        shutil.rmtree(sockets, ignore_errors=True)
    return {"method": method, "modes": median_by_mode({mode: trials}), "variant": variant,
            "fault_free_step_s": steady_step_times(log.events, first_pid)}


def _job(socket_dir: str, namespace: str) -> dict:
    try:
        with open(os.path.join(socket_dir, "jobs", namespace + ".json")) as f:
            return json.load(f)
    except (OSError, ValueError):
        return {}


AUTO_PREWARM_KEYS = ("auto_prewarm_s", "auto_prewarm_skipped", "auto_prewarm_failed", "anchored_warm",
                     "anchored_warm_s", "anchored_warm_failed")


def _wait_standby_ready(socket_dir: str, namespace: str, workers: set, alive, timeout: float = 900) -> dict:
    """The supervisor's job record once it names a ready standby for rank 0 that has not been a
    worker yet (the fork server reports each standby when its preparation is done); once the
    record holds rank 0's automatic pre-warm recipe, one that replayed it (or said why not)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        job = _job(socket_dir, namespace)
        sb = (job.get("standbys") or {}).get("0")
        recipe = "recipe" in ((job.get("warm_recipes") or {}).get("0") or {})
        if sb and sb.get("pid") not in workers and (not recipe or any(k in sb for k in AUTO_PREWARM_KEYS)):
            if sb.get("failed"):
                raise RuntimeError(f"the supervisor's standby failed to prepare: {sb['failed']}")
            return sb
        if not alive():
            raise RuntimeError("the supervisor exited while waiting for its standby")
        time.sleep(0.05)
    raise TimeoutError(f"no ready standby in the job record after {timeout:.0f} s")


def _last_restart_how(socket_dir: str, namespace: str) -> str | None:
    """How the supervisor started the rank after the last failure ("warm standby", "warm
    (forked)", ...), from its job record; None if it has not written one yet."""
    for _ in range(50):
        restarts = _job(socket_dir, namespace).get("restarts") or []
        if restarts and restarts[-1].get("how"):
            return restarts[-1]["how"]
        time.sleep(0.1)
    return None


def main(argv=None) -> int:
    from bench import baselines
    from bench.baselines.anchor import available
    from bench.baselines.launcher import Launcher, revive
    p = argparse.ArgumentParser(prog="python -m bench recovery_train", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", default="llama3.2-1b")
    p.add_argument("--methods", default=",".join(list(baselines.TRAIN) + ["gpu_anchor"]))
    p.add_argument("--modes", default="cold,warm", help="any of cold, warm, standby, prewarm")
    p.add_argument("--device", default=None)
    p.add_argument("--repeat", type=int, default=3, help="kills per method and mode (the protocol's n; >= 3)")
    p.add_argument("--ckpt-every", type=int, default=2)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--dir", default=None, help="local-disk work directory (default: a temp dir)")
    p.add_argument("--supervised", nargs="?", const="default", default="",
                   help="after the gpu_anchor rows, add rows for gpu-anchor under `gpu-anchor run` (its supervisor "
                        "restarts the worker): comma-separated variants of " + ", ".join(SUPERVISED)
                        + " (bare flag: default, i.e. `gpu-anchor run` without recovery flags)")
    p.add_argument("--tag", default=None, help="a run of a subset: written as recovery_train_TAG.json, next to the "
                   "full table instead of over it")
    p.add_argument("--tiny", action="store_true")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    name = "recovery_train" + (f"_{args.tag}" if args.tag else "") + ("_tiny" if args.tiny else "")
    args.supervised = [v for v in args.supervised.split(",") if v]
    bad = set(args.supervised) - set(SUPERVISED)
    if bad:
        p.error(f"unknown --supervised variant(s) {sorted(bad)}; choose from {', '.join(SUPERVISED)}")
    device = default_device(args.device)
    methods = args.methods.split(",")
    if args.tiny:
        args.repeat, args.batch, args.seq, args.ckpt_every = 1, 2, 32, 2
        args.models = "llama3.2-1b"
    why = available()
    if why is not None and "gpu_anchor" in methods:
        print(f"gpu-anchor not measured: {why}")
        methods.remove("gpu_anchor")
    modes = args.modes.split(",")
    work = tempfile.mkdtemp(prefix="recovery-train-", dir=args.dir)
    launchers = {}
    result = {"title": "Training: recovery after SIGKILL (kill → next step completed)"
              + (f" ({args.tag} run)" if args.tag else ""), "device": device,
              "repeat": args.repeat, "batch": args.batch, "seq": args.seq, "models": {}, "target_x": TARGET_X,
              "standby_impl": standby.IMPL, "protocol": 1}
    try:
        with private_daemon(device):
            launchers["warm"] = Launcher(True, work)
            result["warm_server"] = {k: launchers["warm"].ready.get(k) for k in ("preload_s", "threads", "failed")}
            launchers["cold"] = Launcher(False, work)
            for m in args.models.split(","):
                rows = []
                for meth in methods:
                    why = revive(launchers, work)
                    if why:
                        result.setdefault("warm_server_restarts", []).append(f"before {m}/{meth}: {why}")
                    try:
                        rows.append(run_method(meth, m, device, args.tiny, modes, args.repeat, args.ckpt_every,
                                               args.batch, args.seq, work, launchers))
                    except Exception as e:  # one broken method must not cost the others' figures
                        if args.tiny:
                            raise
                        print(f"{m} {meth} FAILED: {type(e).__name__}: {e}", flush=True)
                        result.setdefault("failed", {})[f"{m}/{meth}"] = f"{type(e).__name__}: {e}"
                    result["models"][m] = rows
                    for variant in (args.supervised if meth == "gpu_anchor" else []):
                        try:
                            rows.append(run_supervised(m, device, args.tiny, args.repeat, args.ckpt_every,
                                                       args.batch, args.seq, work, variant))
                        except Exception as e:
                            if args.tiny:
                                raise
                            print(f"{m} gpu-anchor run ({variant}) FAILED: {type(e).__name__}: {e}", flush=True)
                            result.setdefault("failed", {})[f"{m}/{SUPERVISED[variant][0]}"] = \
                                f"{type(e).__name__}: {e}"
                    # partial results survive a time limit
                    write_result(name, result, args.out)
    finally:
        for lau in launchers.values():
            lau.close()
        shutil.rmtree(work, ignore_errors=True)
    if why is not None:
        result["gpu_anchor_unavailable"] = why
    write_result(name, result, args.out)
    return 0


LABELS = {"torch_save": "torch.save", "checkfreq": "CheckFreq", "inmemory": "in-memory (/dev/shm)",
          "dcp_async": "DCP async_save", "gpu_anchor": "gpu-anchor",
          "gpu_anchor_run_default": "gpu-anchor under `gpu-anchor run` (no recovery flags)",
          "gpu_anchor_run": "gpu-anchor under `gpu-anchor run --no-warm-pool`",
          "gpu_anchor_run_warm_pool": "gpu-anchor under `gpu-anchor run --warm-pool --no-auto-prewarm`",
          "gpu_anchor_run_prewarm": "gpu-anchor under `gpu-anchor run --prewarm`"}


def render(result: dict) -> str:
    from bench.common import plot_breakdown, plot_path
    labels = dict(LABELS)
    if result.get("protocol") is None:  # measured before `gpu-anchor run` kept standbys by default
        labels["gpu_anchor_run"] = "gpu-anchor under `gpu-anchor run`"
    parts, verdicts, heads = [], [], []
    for model, rows in result["models"].items():
        cmp = from_rows(rows, INTERVAL, ours=lambda m: m.startswith("gpu_anchor"), labels=labels)
        lines = [f"**{model}** (per cell: median [min–max] over n kills; ratio = the strongest baseline's total in "
                 "the same mode / this total, > 1: faster than it)\n",
                 "| method | mode | start-up | restore | first step | **total** | n | vs strongest baseline | "
                 "lost steps |",
                 "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
        for mode in cmp.modes():
            for r in rows:
                x, tot = r["modes"].get(mode), cmp.cell(r["method"], mode)
                if x is None or tot is None:
                    continue
                lines.append(f"| {labels.get(r['method'], r['method'])} | {mode} | {fmt_s(x['startup_s'])} | "
                             f"{fmt_s(x['restore_s'])} | {fmt_s(x['first_step_s'])} | "
                             f"{tot.text(fmt_s, bold=True, show_n=False)} | "
                             f"{tot.n} | {cmp.ratio_text(r['method'], mode)} | {x['lost_steps']:.0f} |")
            head = cmp.against_strongest("gpu_anchor", mode)
            heads += [f"{model} {mode}: {head}"] if head else []
            target = cmp.target_verdict("gpu_anchor", "inmemory", mode, result["target_x"], fmt_s)
            verdicts += [target] if target and model == "llama3.2-1b" else []
        lines += ["", cmp.strongest_line(fmt_s), "", cmp.n_note()]
        hows = [f"{labels.get(r['method'], r['method'])}: "
                + ", ".join(str(t.get("how")) for t in x["trials"])
                for r in rows if r["method"].startswith("gpu_anchor_run") for x in r["modes"].values()
                if any(t.get("how") for t in x["trials"])]
        if hows:
            lines.append("\nHow `gpu-anchor run` restarted the rank, per kill — " + "; ".join(hows) + ".")
        steady = [(labels.get(r["method"], r["method"]), Cell([v * 1e3 for v in r["fault_free_step_s"]])
                   if r.get("fault_free_step_s") else None) for r in rows]
        lines += throughput_section(steady, f"Fault-free throughput of each method's first worker before any kill "
                                    f"(batch {result['batch']} × {result['seq']} tokens; the training step alone, "
                                    "checkpoint saves excluded: persist_blocking and e2e_faults count those):",
                                    "step time (ms)", lambda v: f"{v:.1f}",
                                    "; see the training-overhead and end-to-end tables")
        png = plot_path(f"recovery_train_{model}.png")
        if png and plot_breakdown(rows, labels, (("startup_s", "start-up"), ("restore_s", "restore"),
                                                 ("first_step_s", "first step")),
                                  f"Training recovery breakdown, {model}", png[0]):
            lines.append(f"\n![recovery breakdown {model}]({png[1]})")
        parts.append("\n".join(lines))
    tail = ("\n\ngpu-anchor against the strongest baseline of each mode: " + ("; ".join(heads) if heads else
                                                                             "not measured") + ".")
    tail += (f"\n\nTarget (issue 7, set against the in-memory checkpoint, not the strongest baseline): training "
             f"recovery ≥ {result['target_x']:.0f}× faster than the in-memory checkpoint, 1B model "
             f"[paper: {PAPER}]. "
             + ("; ".join(verdicts) if verdicts else "not measured") + ".\n\n"
             "Start-up = kill → model built on the device (process, imports, CUDA context, model construction "
             "without initialisation); restore = checkpoint → live tensors (gpu-anchor: mapping + journal "
             "recovery); first step = the first optimizer step after it. Cold: fresh interpreter for every "
             "method; warm: a child of gpu-anchor's fork server with torch, transformers and the model code "
             "imported, for every method alike. Baselines lose the steps since their last checkpoint (here "
             "1, killed one step after a durable checkpoint; in the end-to-end run up to 99)."
             + standby.describe_modes(result)
             + (" The `gpu-anchor run` rows are the product's own restarts, shown in the mode they compare with "
                "(without flags on a GPU job: a standby per rank, so `standby`)." if any(
                    r["method"].startswith("gpu_anchor_run") for rows in result["models"].values() for r in rows)
                else ""))
    if "warm_server" in result:
        tail += f" Fork server: preload {fmt_s(result['warm_server'].get('preload_s'))}, " \
                f"{result['warm_server'].get('threads')} OS thread(s) at fork."
    if result.get("gpu_anchor_unavailable"):
        tail += f"\n\ngpu-anchor was not measured: {result['gpu_anchor_unavailable']}."
    tail += failure_notes(result)
    return "\n\n".join(parts) + tail
