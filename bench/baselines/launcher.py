"""Starting, watching and killing training workers, cold or warm, for every method alike.

Cold: ``python -m bench.baselines.trainer ...`` in a fresh interpreter.
Warm: the same module run in a child forked by gpu-anchor's own fork server
(``gpu_anchor.launch.zygote``), which has imported torch, transformers, the model code
and the benchmark's modules and touched no CUDA.  Baselines and gpu-anchor get the same
server with the same preloads, so warm compares with warm.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PRELOAD = ["torch", "transformers", "transformers.models.llama.modeling_llama",
           "transformers.models.qwen3.modeling_qwen3", "bench.models", "bench.baselines.trainer",
           "bench.baselines.checkfreq", "bench.baselines.inmemory", "bench.baselines.torch_save",
           "bench.baselines.dcp_async", "bench.baselines.anchor", "gpu_anchor.train.optimizer",
           "torch.distributed.checkpoint", "gpu_anchor.serve.engine", "bench.baselines.server",
           "bench.baselines.kv_memory"]


def worker_env() -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = ROOT + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    return env


class WorkerDied(RuntimeError):
    pass


class EventLog:
    """Tails a worker's events file (JSON lines, see ``trainer.Events``)."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.events: list[dict] = []
        self._pos = 0
        self._part = b""

    def poll(self) -> list[dict]:
        try:
            with open(self.path, "rb") as f:
                f.seek(self._pos)
                data = f.read()
        except FileNotFoundError:
            return []
        self._pos += len(data)
        data = self._part + data
        lines = data.split(b"\n")
        self._part = lines.pop()
        new = [json.loads(x) for x in lines if x.strip()]
        self.events += new
        return new

    def wait(self, pred, alive, timeout: float = 900.0) -> dict:
        """The first event (old or new) satisfying ``pred``; raises WorkerDied if ``alive()`` turns False."""
        deadline = time.monotonic() + timeout
        seen = 0
        while True:
            self.poll()
            for e in self.events[seen:]:
                if pred(e):
                    return e
            seen = len(self.events)
            if not alive():
                self.poll()
                for e in self.events[seen:]:
                    if pred(e):
                        return e
                raise WorkerDied(f"worker exited before the expected event (log {self.path})")
            if time.monotonic() > deadline:
                raise TimeoutError(f"no expected event within {timeout:.0f} s (log {self.path})")
            time.sleep(0.002)


class Launcher:
    """``spawn(args) -> pid``, ``alive(pid)``, ``kill(pid)`` (SIGKILL, returns once reaped)."""

    def __init__(self, warm: bool, log_dir: str) -> None:
        self.warm = warm
        self.log_dir = log_dir
        self._procs: dict[int, subprocess.Popen] = {}
        self._dead: set[int] = set()
        self.zygote = None
        self.ready = {}
        if warm:
            from gpu_anchor.launch.zygote import Zygote
            self.zygote = Zygote(sys.executable, PRELOAD, worker_env())
            self.ready = self.zygote.ready

    def spawn(self, args: list[str], module: str = "bench.baselines.trainer") -> int:
        target = ["-m", module] + args
        if self.zygote is not None:
            return self.zygote.spawn(target, worker_env(), ROOT)
        log = open(os.path.join(self.log_dir, f"worker-{time.time_ns()}.log"), "wb")
        p = subprocess.Popen([sys.executable] + target, cwd=ROOT, env=worker_env(), stdout=log,
                             stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)
        self._procs[p.pid] = p
        return p.pid

    def _reap(self) -> None:
        if self.zygote is not None:
            for m in self.zygote.messages():
                self._dead.add(m["pid"])
        for pid, p in list(self._procs.items()):
            if p.poll() is not None:
                self._dead.add(pid)
                del self._procs[pid]

    def alive(self, pid: int) -> bool:
        self._reap()
        return pid not in self._dead

    def kill(self, pid: int, timeout: float = 60.0) -> None:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        deadline = time.monotonic() + timeout
        while self.alive(pid):
            if time.monotonic() > deadline:
                raise TimeoutError(f"worker {pid} survived SIGKILL for {timeout} s")
            time.sleep(0.001)

    def wait_exit(self, pid: int, timeout: float = 900.0) -> None:
        deadline = time.monotonic() + timeout
        while self.alive(pid):
            if time.monotonic() > deadline:
                raise TimeoutError(f"worker {pid} still running after {timeout} s")
            time.sleep(0.01)

    def server_exit(self) -> str | None:
        """How the warm fork server ended (``None`` while it runs, and for a cold launcher)."""
        if self.zygote is None or self.zygote.proc.poll() is None:
            return None
        return self.zygote.exit_status()

    def close(self) -> None:
        for pid in list(self._procs):
            self.kill(pid)
        if self.zygote is not None:
            self.zygote.close()


def revive(launchers: dict, log_dir: str) -> str | None:
    """Replace a warm launcher whose fork server has exited (the next method's figures should
    not be lost with it); returns how the old one ended, for the result file, or None."""
    old = launchers.get("warm")
    why = old.server_exit() if old is not None else None
    if why is None:
        return None
    print(f"the warm fork server exited ({why}); starting a new one", flush=True)
    try:
        old.close()
    except Exception:
        pass
    launchers["warm"] = Launcher(True, log_dir)
    return why
