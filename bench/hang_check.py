"""The CI hang check: many consecutive fault-free 2-rank CPU runs of the demo under
``gpu-anchor run``, with busy loops loading every core, counting hangs.

    python -m bench hang_check [--runs 200] [--busy 2] [--steps 120] [--timeout 180] [--out DIR]

Each run is ``gpu-anchor run --device-type cpu --nproc-per-node 2 -- python
examples/demo_train.py --steps N`` in a fresh socket directory and session, exactly as the
test suite's fault-free reference job.  A run that outlives ``--timeout`` is a hang: before
it is killed, every process of the job (supervisor, fork server, workers, daemons) is
described from /proc (state, wait channel, each thread's name) and, where gdb is installed,
its native and Python stacks are taken, so a hang explains itself.  A run that exits non-zero
is a failure (its output tail is kept).  Prints one line per run and a summary, and writes
``hang_check.json`` (summary, every run's record, a hang's stacks included) to bench/results
or ``--out``.  ``--tiny``: two short runs, no busy loops.  Needs no GPU; loads the whole machine.
"""
from __future__ import annotations

import argparse
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEMO = os.path.join(ROOT, "examples", "demo_train.py")


def _busy_loops(n: int) -> list[subprocess.Popen]:
    return [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(n)]


def descendants(root: int) -> list[int]:
    """Every live descendant of ``root`` (from /proc), parents before children."""
    children: dict[int, list[int]] = {}
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(d))
    out, todo = [], [root]
    while todo:
        for c in children.get(todo.pop(), []):
            out.append(c)
            todo.append(c)
    return out


def _read(path: str) -> str:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return "?"


def describe(pid: int) -> str:
    """Command line, and per thread: name, state and kernel wait channel."""
    lines = [f"pid {pid}: {_read(f'/proc/{pid}/cmdline').replace(chr(0), ' ')}"]
    try:
        tids = sorted(os.listdir(f"/proc/{pid}/task"), key=int)
    except OSError:
        return lines[0] + " (gone)"
    for tid in tids:
        stat = _read(f"/proc/{pid}/task/{tid}/stat")
        state = stat.rsplit(")", 1)[1].split()[0] if ")" in stat else "?"
        lines.append(f"  thread {tid} {_read(f'/proc/{pid}/task/{tid}/comm')!r} state {state} "
                     f"wchan {_read(f'/proc/{pid}/task/{tid}/wchan')}")
    return "\n".join(lines)


_FRAME = re.compile(r"^(#\d+)\s+(?:0x[0-9a-f]+ in )?([^\s(]+)")
_WHERE = re.compile(r"\) (?:at|from) (\S+)$")


def stacks(pid: int) -> str:
    """Native and Python stacks of every thread of ``pid`` (gdb), or why not."""
    gdb = shutil.which("gdb")
    if gdb is None:
        return "(gdb not installed: no stacks)"
    try:
        out = subprocess.run([gdb, "-p", str(pid), "-batch", "-nx", "-iex", "set auto-load safe-path /",
                              "-ex", "thread apply all bt 30", "-ex", "thread apply all py-bt"],
                             capture_output=True, text=True, timeout=120)
    except subprocess.TimeoutExpired:
        return "(gdb timed out)"
    keep = []
    for ln in out.stdout.splitlines():
        m = _FRAME.match(ln)
        if m:   # native frame: function and where, without gdb's argument dumps
            where = _WHERE.search(ln)
            keep.append(f"  {m.group(1)} {m.group(2)}" + (f" ({where.group(1)})" if where else ""))
        elif ln.startswith(("Thread", "Traceback", "  File", "    ")):
            keep.append(ln[:300])
    return "\n".join(keep)


def one_run(i: int, steps: int, timeout: float) -> dict:
    work = tempfile.mkdtemp(prefix=f"ga-hang-{i}-")
    env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""),
           "GPU_ANCHOR_SOCKET_DIR": os.path.join(work, "sock")}
    cmd = [sys.executable, "-m", "gpu_anchor.cli", "run", "--device-type", "cpu", "--nproc-per-node", "2",
           "--", sys.executable, DEMO, "--steps", str(steps), "--out", "out.pt"]
    t0 = time.monotonic()
    p = subprocess.Popen(cmd, cwd=work, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                         start_new_session=True)
    rec = {"run": i}
    try:
        out, _ = p.communicate(timeout=timeout)
        rec.update(rc=p.returncode, seconds=round(time.monotonic() - t0, 2))
        if p.returncode != 0:
            rec["output"] = out[-4000:]
    except subprocess.TimeoutExpired:
        procs = descendants(p.pid)
        rec.update(rc=None, seconds=round(time.monotonic() - t0, 2),
                   processes=[describe(q) for q in [p.pid, *procs]],
                   stacks={str(q): stacks(q) for q in [p.pid, *procs]})
        os.killpg(p.pid, signal.SIGKILL)
        for q in procs:
            try:
                os.kill(q, signal.SIGKILL)
            except ProcessLookupError:
                pass
        out, _ = p.communicate()
        rec["output"] = out[-6000:]
    finally:
        sock = os.path.join(work, "sock")
        if os.path.isdir(sock):
            sys.path.insert(0, ROOT)
            from gpu_anchor.client import control
            for dev, path in control.discover(sock).items():
                control.stop(dev, path)
        shutil.rmtree(work, ignore_errors=True)
    return rec


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=200)
    ap.add_argument("--busy", type=int, default=os.cpu_count() or 2, help="busy loops (default: one per core)")
    ap.add_argument("--steps", type=int, default=120)
    ap.add_argument("--timeout", type=float, default=180.0, help="seconds after which a run counts as hung")
    ap.add_argument("--stop-at-hang", action="store_true", help="stop at the first hang (diagnosis)")
    ap.add_argument("--tiny", action="store_true", help="smoke size: 2 runs of 20 steps, no busy loops")
    ap.add_argument("--out", default=None, help="results directory (default bench/results)")
    a = ap.parse_args(argv)
    if a.tiny:
        a.runs, a.steps, a.busy = 2, 20, 0
    busy = _busy_loops(a.busy)
    records, t_start = [], time.monotonic()
    try:
        for i in range(1, a.runs + 1):
            rec = one_run(i, a.steps, a.timeout)
            records.append(rec)
            what = "HANG" if rec["rc"] is None else ("ok" if rec["rc"] == 0 else f"FAILED rc {rec['rc']}")
            print(f"run {i}/{a.runs}: {what} in {rec['seconds']:.1f} s (load {os.getloadavg()[0]:.1f})", flush=True)
            if rec["rc"] is None:
                print("\n".join(rec["processes"]), flush=True)
                for pid, st in rec["stacks"].items():
                    print(f"--- stacks of {pid}\n{st}", flush=True)
                if a.stop_at_hang:
                    break
            elif rec["rc"] != 0:
                print(rec["output"], flush=True)
    finally:
        for b in busy:
            b.kill()
            b.wait()
    hangs = sum(r["rc"] is None for r in records)
    fails = sum(r["rc"] not in (0, None) for r in records)
    secs = [r["seconds"] for r in records if r["rc"] == 0]
    summary = {"runs": len(records), "hangs": hangs, "failures": fails, "busy_loops": a.busy, "steps": a.steps,
               "timeout_s": a.timeout, "wall_s": round(time.monotonic() - t_start, 1),
               "run_s_min_median_max": [min(secs), sorted(secs)[len(secs) // 2], max(secs)] if secs else None}
    print(f"hang check: {summary['runs']} runs, {hangs} hang(s), {fails} failure(s); "
          f"{a.busy} busy loops; run time min/median/max {summary['run_s_min_median_max']} s; "
          f"total {summary['wall_s']} s")
    from bench.common import write_result
    write_result("hang_check" + ("_tiny" if a.tiny else ""), {"summary": summary, "runs": records}, a.out)
    return 0 if hangs == 0 and fails == 0 else 1


def title(result: dict) -> str:
    return "CI hang check: consecutive fault-free 2-rank CPU runs of the demo under load"


def render(result: dict) -> str:
    s = result["summary"]
    lo, med, hi = s["run_s_min_median_max"] or ("-", "-", "-")
    return (f"| runs | hangs | failures | busy loops | steps per run | run time min / median / max (s) | total (s) |\n"
            f"| --- | --- | --- | --- | --- | --- | --- |\n"
            f"| {s['runs']} | {s['hangs']} | {s['failures']} | {s['busy_loops']} | {s['steps']} | "
            f"{lo} / {med} / {hi} | {s['wall_s']} |\n\n"
            f"A run that outlives {s['timeout_s']:.0f} s counts as a hang (docs/supervisor.md, \"The CI hang\").")


if __name__ == "__main__":
    sys.exit(main())
