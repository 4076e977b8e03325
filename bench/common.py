"""What every benchmark shares: the machine description, timing, and writing results."""
from __future__ import annotations

import json
import os
import platform
import statistics
import subprocess
import sys
import time

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")


def machine() -> dict:
    """Python, torch, GPU and driver.  Asks nvidia-smi, not torch.cuda, about the GPU: a driver
    process that writes results must not create a CUDA context next to the workers it measures."""
    info = {"python": platform.python_version(), "host_cpus": os.cpu_count(), "platform": platform.platform()}
    try:
        import torch
        info["torch"] = torch.__version__
    except ImportError:
        pass
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=10)
        rows = [[x.strip() for x in line.split(",")] for line in out.stdout.strip().splitlines() if "," in line]
        if out.returncode == 0 and rows:
            info["gpu"], info["driver"] = rows[0][0], rows[0][1]
            info["gpu_count"] = len(rows)
    except (OSError, subprocess.TimeoutExpired):
        pass
    if os.environ.get("CUDA_VISIBLE_DEVICES"):
        info["cuda_visible_devices"] = os.environ["CUDA_VISIBLE_DEVICES"]
    return info


def median_ms(fn, repeat: int = 5, warmup: int = 1) -> float:
    for _ in range(warmup):
        fn()
    samples = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        samples.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(samples)


def write_result(name: str, result: dict, out_dir: str | None = None) -> str:
    """Write ``<out_dir>/<name>.json`` (default bench/results) with the machine and the command line."""
    out_dir = out_dir or os.environ.get("GPU_ANCHOR_BENCH_OUT") or RESULTS
    os.makedirs(out_dir, exist_ok=True)
    argv = list(sys.argv)
    if argv and argv[0].endswith(os.path.join("bench", "__main__.py")):
        argv[0] = "python -m bench"
    payload = {"benchmark": name, "command": " ".join(argv), "machine": machine(),
               "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"), **result}
    if os.environ.get("GPU_ANCHOR_BENCH_CONCURRENT"):  # set by bench/h200_all.sh: shared host, other GPU busy
        payload["concurrent"] = os.environ["GPU_ANCHOR_BENCH_CONCURRENT"]
    path = os.path.join(out_dir, f"{name}.json")
    with open(path, "w") as f:
        json.dump(payload, f, indent=2)
    return path


# ---------------------------------------------------------------- shared by the scenarios

class private_daemon:
    """``with private_daemon("cuda:0") as sockdir:`` — a gpu-anchor daemon of our own.

    Sets ``GPU_ANCHOR_SOCKET_DIR`` to a fresh directory (inherited by worker processes)
    so a benchmark never touches a user's daemon; stops it on exit.
    """

    def __init__(self, *devices: str) -> None:
        self.devices = devices

    def __enter__(self) -> str:
        import tempfile

        from gpu_anchor.client import control
        self._old = os.environ.get("GPU_ANCHOR_SOCKET_DIR")
        self.dir = tempfile.mkdtemp(prefix="ga-bench-")
        os.environ["GPU_ANCHOR_SOCKET_DIR"] = self.dir
        for d in self.devices:
            control.start(d)
        return self.dir

    def __exit__(self, *exc) -> None:
        from gpu_anchor.client import control
        for d in self.devices:
            try:
                control.stop(d)
            except Exception:
                pass
        if self._old is None:
            os.environ.pop("GPU_ANCHOR_SOCKET_DIR", None)
        else:
            os.environ["GPU_ANCHOR_SOCKET_DIR"] = self._old


def int_list(ap, flag: str, text: str) -> list[int]:
    """``"32,64,128"`` as ``[32, 64, 128]`` (empty items skipped); anything else ends in
    ``ap.error`` naming the flag."""
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        ap.error(f"{flag} takes integers separated by commas, got {text!r}")


def default_device(device: str | None) -> str:
    if device:
        return device
    import torch
    return "cuda:0" if torch.cuda.is_available() else "cpu"


def speedup(value: float | None, best: float | None) -> str:
    """``best / value`` as "4.2×" (how many times better than the strongest baseline)."""
    if value is None or best is None or value <= 0:
        return "—"
    r = best / value
    return f"{r:.3g}×" if r < 1e4 else f"{r:.3e}×"


def verdict(ok: bool | None) -> str:
    return "—" if ok is None else ("met" if ok else "**MISSED**")


def failure_notes(result: dict) -> str:
    """The paragraphs a table ends with when a method failed or the warm fork server had to
    be restarted (a result file records both; a missing row must say why)."""
    out = "".join(f"\n\n{k} FAILED — {err}" for k, err in result.get("failed", {}).items())
    return out + "".join(f"\n\nThe warm fork server was restarted {why}."
                         for why in result.get("warm_server_restarts", []))


def fmt_s(v: float | None, digits: int = 3) -> str:
    if v is None:
        return "—"
    if v < 0.01:
        return f"{v * 1e3:.2f} ms"
    return f"{v:.{digits}g} s"


DOCS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "docs")
IMG_DIR = os.path.join(DOCS, "img")  # set by bench.report to sit next to the document it writes


def plot_path(filename: str) -> tuple[str, str] | None:
    """(absolute path, path relative to the rendered markdown) for a plot, or None without matplotlib."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return None
    d = IMG_DIR
    os.makedirs(d, exist_ok=True)
    return os.path.join(d, filename), f"img/{filename}"


def median_by_mode(trials: dict[str, list[dict]]) -> dict[str, dict]:
    """Per mode: the median of every numeric field that all trials have, plus the trials themselves."""
    out = {}
    for mode, ts in trials.items():
        out[mode] = {k: statistics.median(t[k] for t in ts) for k in ts[0]
                     if isinstance(ts[0][k], (int, float)) and not isinstance(ts[0][k], bool)
                     and all(t.get(k) is not None for t in ts)}
        out[mode]["trials"] = ts
    return out


# ---------------------------------------------------------------- one method, one process

FORKSERVER_PRELOAD = ["torch", "transformers", "bench.models", "bench.baselines.trainer"]



def get_json(url: str, timeout: float = 10) -> dict:
    """The JSON body of a GET, also of an error status (``/health`` answers 503 while no engine is up)."""
    import urllib.error
    import urllib.request
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return json.loads(r.read())
    except urllib.error.HTTPError as e:
        return json.loads(e.read())


def stop_process(proc: subprocess.Popen, grace_s: float = 60) -> None:
    """SIGTERM, then SIGKILL if it has not exited after ``grace_s``."""
    import signal
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(grace_s)
    except subprocess.TimeoutExpired:
        proc.kill()


def _isolated_child(conn, env, fn, args):
    # forked by multiprocessing's fork server (it only imported modules, FORKSERVER_PRELOAD):
    # the rest of what a fork of ours does (gpu_anchor.runtime), here in the child
    from gpu_anchor import runtime
    runtime.after_fork_in_child()
    os.environ.clear()
    os.environ.update(env)  # the fork server's environment is from when it started, not from now
    try:
        conn.send((True, fn(*args)))
    except BaseException as e:  # noqa: BLE001 - every failure goes back to the parent as text
        import traceback
        conn.send((False, f"{type(e).__name__}: {e}\n{traceback.format_exc(limit=4)}"))
    finally:
        conn.close()


def run_isolated(fn, *args, timeout: float = 600.0):
    """``fn(*args)`` in a fresh child process; returns its (picklable) result.

    Several methods measured in one process contaminate each other on a GPU (a baseline's
    ``cudaHostRegister`` makes the next one's fail, caches and pools carry over), so each
    runs in a child of a ``forkserver`` that imported torch and transformers and never
    touched CUDA: a clean CUDA context per method, without paying the imports again.  The
    child sees the caller's current environment.  Raises RuntimeError with the child's
    error (or exit code), TimeoutError after ``timeout`` seconds (the child is killed).
    """
    import multiprocessing as mp
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(FORKSERVER_PRELOAD)
    recv, send = ctx.Pipe(duplex=False)
    p = ctx.Process(target=_isolated_child, args=(send, dict(os.environ), fn, args))
    p.start()
    send.close()
    try:
        if not recv.poll(timeout):
            raise TimeoutError(f"{getattr(fn, '__name__', fn)} ran over {timeout:.0f} s; child killed")
        try:
            ok, value = recv.recv()
        except EOFError:
            p.join(5)
            raise RuntimeError(f"{getattr(fn, '__name__', fn)}: child died (exit code {p.exitcode})") from None
        p.join(30)  # it has sent its result; let it release the GPU before the next method starts
    finally:
        if p.is_alive():  # timed out, or we are being stopped (SIGTERM -> SystemExit)
            p.kill()
            p.join()
        recv.close()
    if not ok:
        raise RuntimeError(value)
    return value


def plot_breakdown(rows: list[dict], labels: dict, parts, title: str, path: str) -> bool:
    """Stacked bars, one per (method, mode) of ``rows`` (``{"method", "modes": {mode: {key: s}}}``),
    one segment per ``(key, legend)`` in ``parts``; False without matplotlib."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    import textwrap
    names, vals = [], {k: [] for k, _ in parts}
    for r in rows:
        for mode, x in r["modes"].items():
            # a long label ("Replay (page cache warm)") wraps at its words instead of running into its neighbour
            label = textwrap.fill(labels.get(r["method"], r["method"]), 14)
            names.append(f"{label}\n{mode}")
            for k, _ in parts:
                vals[k].append(x.get(k) or 0.0)
    fig, ax = plt.subplots(figsize=(max(6, 1.1 * len(names)), 4.3))
    bottom = [0.0] * len(names)
    for k, legend in parts:
        ax.bar(names, vals[k], bottom=bottom, label=legend)
        bottom = [b + v for b, v in zip(bottom, vals[k])]
    ax.set_ylabel("seconds (kill → recovered)")
    ax.set_title(title)
    ax.legend()
    plt.xticks(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True
