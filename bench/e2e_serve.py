"""Inference end to end under injected faults: per-request latency (p50/p99) per method.

    python -m bench e2e_serve                                   # H200: Qwen3-8B shape, 1 %/s
    python -m bench e2e_serve --requests 2000 --rates 0.01,0.05
    python -m bench e2e_serve --tiny                            # CPU smoke size

Each method (Replay, KV-memory, gpu-anchor; see ``recovery_serve``) serves the same seeded
ShareGPT-like trace of ``--requests`` requests at a fixed concurrency (closed loop: a new
request enters when one finishes, none while the engine is down); the driver SIGKILLs the
engine at the instants of a seeded Poisson process (``rate`` per second, the same instants
for every method, clock started when the first engine has served its first step) and
restarts it at once (``--mode`` warm or cold, the same for every method).  A request's
latency runs from its first admission to its last token, across restarts.  Each method runs
once per ``--seeds`` entry (each seed its own fault schedule and trace, the same for every
method; n = 3 by default); tables give median [min–max] over the seeds.  Fault-free
throughput: each run's tokens/s before its first fault.
"""
from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time

from bench.common import default_device, failure_notes, fmt_s, private_daemon, verdict, write_result
from bench.e2e_faults import iter_fault_times
from bench.protocol import Cell, Comparison, Interval, throughput_section

INTERVAL = Interval("a request's first admission", "its last token")
from bench.recovery_serve import LABELS, METHODS, _args, make_model_dir, next_request


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))]


def run_one(method, rate, a, model_dir, device, work, launcher, seed: int) -> dict:
    from bench.baselines.launcher import EventLog
    state = tempfile.mkdtemp(prefix=f"es-{method}-", dir="/dev/shm")
    evfile = os.path.join(work, f"e2e-serve-{method}-{rate}.events")
    log = EventLog(evfile)
    ns = f"es-{method}-{time.time_ns()}"
    mod = "bench.baselines.server"
    faults = iter_fault_times(rate, seed)
    due = next(faults, None)
    a.seed = seed   # the trace's seed (server --seed) follows the run's
    pid = launcher.spawn(_args(method, a, model_dir, device, state, ns, evfile), mod)
    kills = []
    try:
        t0 = log.wait(lambda e: e["ev"] == "step" and e["pid"] == pid, lambda: launcher.alive(pid), 1800)["t"]
        while True:
            if any(e["ev"] == "done" for e in log.poll()):
                break
            if due is not None and time.time() - t0 >= due and (not a.max_faults or len(kills) < a.max_faults):
                due = next(faults, None)
                launcher.kill(pid)
                kills.append(time.time())
                log.poll()
                pid = launcher.spawn(_args(method, a, model_dir, device, state, ns, evfile, next_request(log.events)),
                                     mod)
                continue
            if not launcher.alive(pid):
                log.poll()
                if any(e["ev"] == "done" for e in log.events):
                    break
                raise RuntimeError(f"{method} engine exited without finishing (events {evfile})")
            time.sleep(0.005)
    finally:
        if launcher.alive(pid):
            launcher.kill(pid)
        shutil.rmtree(state, ignore_errors=True)
    start, end, tokens, progress = {}, {}, 0, []
    for e in log.events:
        if e["ev"] != "step":
            continue
        tokens += e["n"]
        progress.append((round(e["t"] - t0, 3), tokens))
        for i in e.get("adm", ()):
            start.setdefault(i, e["adm_t"])
        for i in e.get("fin", ()):
            end.setdefault(i, e["t"])
    lat = [end[i] - start[i] for i in end if i in start]
    t_end = max(e["t"] for e in log.events)
    resumed = [next((e["t"] for e in log.events if e["ev"] == "resumed" and e["t"] > k), None) for k in kills]
    before = [e for e in log.events if e["ev"] == "step" and e["t"] <= (kills[0] if kills else float("inf"))]
    fault_free = (sum(e["n"] for e in before[1:]) / (before[-1]["t"] - before[0]["t"])
                  if len(before) > 2 and before[-1]["t"] > before[0]["t"] else None)
    return {"method": method, "rate": rate, "seed": seed, "faults": len(kills), "requests_done": len(lat),
            "fault_free_tokens_per_s": fault_free,
            "wall_s": t_end - t0, "p50_s": _pct(lat, 0.5) if lat else None, "p99_s": _pct(lat, 0.99) if lat else None,
            "mean_s": statistics.mean(lat) if lat else None, "tokens_per_s": tokens / max(1e-9, t_end - t0),
            "recovery_each_s": [r - k for r, k in zip(resumed, kills) if r is not None],
            "kills_s": [round(k - t0, 3) for k in kills], "progress": progress[::max(1, len(progress) // 1500)]}


def main(argv=None) -> int:
    from bench.baselines.launcher import Launcher
    p = argparse.ArgumentParser(prog="python -m bench e2e_serve", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="qwen3-8b")
    p.add_argument("--methods", default=",".join(reversed(METHODS)))  # gpu-anchor first: survives a time limit
    p.add_argument("--rates", default="0.01")
    p.add_argument("--mode", default="warm", choices=("warm", "cold"))
    p.add_argument("--device", default=None)
    p.add_argument("--concurrency", type=int, default=64)
    p.add_argument("--requests", type=int, default=1000)
    p.add_argument("--num-blocks", type=int, default=4096)
    p.add_argument("--max-batched-tokens", type=int, default=8192)
    p.add_argument("--dtype", default=None)
    p.add_argument("--seeds", default="0,1,2", help="one run per method per seed (the protocol's n; >= 3)")
    p.add_argument("--model-root", default=None)
    p.add_argument("--max-faults", type=int, default=0, help="stop injecting after this many (0: no limit)")
    p.add_argument("--tiny", action="store_true")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    device = default_device(args.device)
    args.dtype = args.dtype or ("bfloat16" if device.startswith("cuda") else "float32")
    if args.tiny:
        args.concurrency, args.requests, args.num_blocks, args.max_batched_tokens = 3, 12, 128, 512
        args.rates, args.methods, args.seeds = "20", "kv_memory,gpu_anchor", "0"  # seed 0: the first fault 0.05 s in
        args.max_faults = 1  # one kill and restart per method: the path is exercised, the run stays short
    work = tempfile.mkdtemp(prefix="e2e-serve-")
    root = args.model_root or os.path.join(work, "models")
    name = "e2e_serve_tiny" if args.tiny else "e2e_serve"
    result = {"title": f"Inference end to end under injected faults ({args.model})", "device": device,
              "model": args.model, "concurrency": args.concurrency, "requests": args.requests, "mode": args.mode,
              "dtype": args.dtype, "seeds": [int(x) for x in args.seeds.split(",")], "max_faults": args.max_faults,
              "runs": {}, "protocol": 1}
    launcher = None
    try:
        with private_daemon(device):
            model_dir = make_model_dir(args.model, device, args.tiny, root)
            launcher = Launcher(args.mode == "warm", work)
            for rate in map(float, args.rates.split(",")):
                rows = []
                for seed, m in [(sd, m) for sd in result["seeds"] for m in args.methods.split(",")]:
                    try:
                        rows.append(run_one(m, rate, args, model_dir, device, work, launcher, seed))
                    except Exception as e:  # one broken method must not cost the others' figures
                        if args.tiny:
                            raise
                        result.setdefault("failed", {})[f"{rate}/{seed}/{m}"] = f"{type(e).__name__}: {e}"
                    r = rows[-1] if rows else None
                    if r is not None and r["method"] == m and r["seed"] == seed:
                        print(f"rate {rate:g}/s {m:10s} faults {r['faults']} p50 {r['p50_s']:.3f}s "
                              f"p99 {r['p99_s']:.3f}s {r['tokens_per_s']:.0f} tok/s", flush=True)
                    result["runs"][str(rate)] = rows
                    write_result(name, result, args.out)  # partial results survive a time limit
    finally:
        if launcher is not None:
            launcher.close()
        shutil.rmtree(work, ignore_errors=True)
    write_result(name, result, args.out)
    return 0


def render(result: dict) -> str:
    from bench.common import plot_path
    out, verdicts = [], []
    seeds = result.get("seeds") or [result.get("seed")]
    for rate, rows in result["runs"].items():
        rows = [r for r in rows if r.get("p50_s")]
        cmps = {}
        for q in ("p50_s", "p99_s"):   # the table's "mode" is the percentile
            cmps[q] = c = Comparison(INTERVAL, labels=LABELS)
            for m in dict.fromkeys(r["method"] for r in rows):
                c.add(m, q[:3] + " latency", [r[q] for r in rows if r["method"] == m])
        lines = [f"**{float(rate) * 100:g} %/s fault rate** ({result['requests']} requests, {result['concurrency']} "
                 f"concurrent, {result['mode']} restarts for every method; per cell: median [min–max] over n "
                 f"runs, one per seed of {', '.join(map(str, seeds))})\n",
                 "| method | n | faults | p50 latency | vs strongest | p99 latency | vs strongest | tokens/s | "
                 "median recovery |",
                 "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
        for m in cmps["p50_s"].methods():
            rs = [r for r in rows if r["method"] == m]
            rec = [x for r in rs for x in r["recovery_each_s"]]
            lines.append(f"| {LABELS.get(m, m)} | {len(rs)} | {statistics.median(r['faults'] for r in rs):g} | "
                         f"{cmps['p50_s'].cell(m, 'p50 latency').text(fmt_s, show_n=False)} | "
                         f"{cmps['p50_s'].ratio_text(m, 'p50 latency')} | "
                         f"{cmps['p99_s'].cell(m, 'p99 latency').text(fmt_s, show_n=False)} | "
                         f"{cmps['p99_s'].ratio_text(m, 'p99 latency')} | "
                         f"{statistics.median(r['tokens_per_s'] for r in rs):.0f} | "
                         f"{fmt_s(statistics.median(rec)) if rec else '—'} |")
        lines += ["", cmps["p99_s"].strongest_line(fmt_s), "", cmps["p99_s"].n_note()]
        steady = [(LABELS.get(m, m), Cell([r["fault_free_tokens_per_s"] for r in rows if r["method"] == m and
                                           r.get("fault_free_tokens_per_s")])
                   if any(r.get("fault_free_tokens_per_s") for r in rows if r["method"] == m) else None)
                  for m in cmps["p50_s"].methods()]
        lines += throughput_section(steady, "Fault-free throughput (each run's tokens/s before its first fault):",
                                    "throughput (tokens/s)", lambda v: f"{v:.0f}")
        png = plot_path(f"e2e_serve_{result['model']}_{rate}.png")
        if png and _plot([r for r in rows if r.get("seed") == rows[0].get("seed")], float(rate), png[0]):
            lines.append(f"\n![tokens over time under faults at {rate}/s]({png[1]})")
        out.append("\n".join(lines))
        anc, best = cmps["p99_s"].cell("gpu_anchor", "p99 latency"), cmps["p99_s"].strongest("p99 latency")
        if anc and best:
            r99 = cmps["p99_s"].ratio("gpu_anchor", "p99 latency")
            verdicts.append(f"{float(rate) * 100:g} %/s: gpu-anchor p99 {fmt_s(anc.median)} vs the strongest "
                            f"baseline's ({LABELS.get(best[0], best[0])}) {fmt_s(best[1].median)} ({r99.text()}) — "
                            f"{verdict(anc.median <= best[1].median)}")
    note = ("\n\nVerdict (no issue target; p99 latency at most the strongest baseline's): "
            + ("; ".join(verdicts) if verdicts else "not measured") + ". Ratios: the strongest baseline's latency / "
            "this latency (higher is better). Paper (for the reader): end-to-end latency 17.0 % lower than the "
            "strongest baseline.")
    if result["requests"] < 1000:
        note += (f" Scaled down to {result['requests']} requests to fit the device-time budget; the fault rate is "
                 "raised above the issue's 1 %/s where needed so that each run meets faults at all.")
    if result.get("max_faults"):
        note += f" At most {result['max_faults']} faults injected per run."
    if any(not r.get("faults") for rows in result["runs"].values() for r in rows):
        note += " A run with 0 faults measured no recovery: its latencies are fault-free ones."
    if not result.get("protocol"):
        note += (" KV-memory here (measured before issue 20) copied each step's KV on the commit thread with a "
                 "blocking device-to-host copy and copied every block back on restart.")
    note += failure_notes(result)
    return "\n\n".join(out) + note


def _plot(rows, rate, path) -> bool:
    """Generated tokens over wall time per method, kills marked (runs without ``progress``: no plot)."""
    if not any(r.get("progress") for r in rows):
        return False
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, ax = plt.subplots(figsize=(8, 4))
    for r in rows:
        if not r.get("progress"):
            continue
        line, = ax.plot([x[0] for x in r["progress"]], [x[1] for x in r["progress"]], lw=1,
                        label=LABELS.get(r["method"], r["method"]))
        for k in r.get("kills_s", ()):
            ax.axvline(k, color=line.get_color(), ls=":", lw=0.8)
    ax.set_xlabel("wall time (s); dotted: SIGKILL of the engine")
    ax.set_ylabel("tokens generated")
    ax.set_title(f"Serving under faults at {rate * 100:g} %/s")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True
