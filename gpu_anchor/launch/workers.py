"""The worker processes of ``gpu-anchor run``'s supervisor (a part of ``launch/supervisor.py``'s
``Supervisor``, which mixes this in): each rank's environment, how a generation's workers are
started (through the warm fork server — a standby or a fork — or cold), their exits as the
fork server or ``Popen`` reports them, the standbys' readiness, and killing a group.
The decisions about them stay in the supervisor."""
from __future__ import annotations

import dataclasses
import os
import signal
import sys
import time

from gpu_anchor.checkpoint.settings import RESTORE_ENV
from gpu_anchor.paths import socket_dir
from gpu_anchor.runtime.auto_prewarm import RECIPE_ENV

from . import early_start, events, jobstate
from .config import free_port, resolve_standby


class _Worker:
    __slots__ = ("rank", "pid", "popen", "status", "t_exit")

    def __init__(self, rank, pid, popen=None):
        self.rank, self.pid, self.popen, self.status, self.t_exit = rank, pid, popen, None, None


class WorkerProcesses:
    """Methods of ``Supervisor`` (its fields: ``cfg``, ``py``, ``zygote``, ``early``, ``workers``, ``gen``,
    ``events``, ``state``, ``pending_restore``, ``auto_prewarm``, ``current``, ...)."""

    def _env(self, rank: int, port: int, gen: int | None = None) -> dict:
        gen = self.gen if gen is None else gen
        env = dict(os.environ)
        env.update({"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(self.cfg.nproc),
                    "LOCAL_WORLD_SIZE": str(self.cfg.nproc), "GROUP_RANK": "0", "ROLE_RANK": str(rank),
                    "ROLE_WORLD_SIZE": str(self.cfg.nproc), "MASTER_ADDR": self.cfg.master_addr,
                    "MASTER_PORT": str(port), "TORCHELASTIC_RESTART_COUNT": str(gen),
                    "GPU_ANCHOR_NAMESPACE": self.namespace, "GPU_ANCHOR_SOCKET_DIR": socket_dir(),
                    "GPU_ANCHOR_RESTART_COUNT": str(gen), events.ENV: self.events.path})
        if self.cfg.device_type == "cpu":   # no GPU daemon runs: a worker that found the GPUs would anchor nothing there
            env["CUDA_VISIBLE_DEVICES"] = ""
        env.pop("GPU_ANCHOR_SOCKET", None)
        env.pop(RESTORE_ENV, None)
        env.pop(RECIPE_ENV, None)
        if self.auto_prewarm:
            env[RECIPE_ENV] = "1"
        restore = None
        if self.pending_restore is not None:
            restore = f"{os.path.abspath(self.cfg.checkpoint.directory)}:{self.pending_restore}"
        env.update(dataclasses.replace(self.cfg.checkpoint, restore=restore).to_env())
        return env

    def _spawn_group(self, gen: int, gated: bool = False) -> dict:
        port = free_port()
        workers = {}
        for rank in range(self.cfg.nproc):
            env = self._env(rank, port, gen)
            if self.zygote is not None:
                slot = self.early.arm(env) if self.early is not None else None
                if gated:
                    if rank == 0:
                        self.early.close_gates()    # the current generation's: passed long ago
                    self.early.gate(rank, env)
                try:
                    workers[rank] = _Worker(rank, self.zygote.spawn(self.py[1], env, os.getcwd()))
                    if slot is not None:
                        self.early.watch(workers[rank].pid, slot)
                    continue
                except (RuntimeError, OSError) as e:
                    self.log(f"warm start failed ({e}); falling back to cold starts")
                    self.zygote = None
                    if gated:       # the early start needs the fork server: drop what it started
                        for w in workers.values():
                            os.killpg(w.pid, signal.SIGKILL)
                        raise
            env.pop(early_start.LIVENESS_ENV, None)
            workers[rank] = self._cold(rank, env)
        return workers

    def _cold(self, rank: int, env: dict) -> _Worker:
        import subprocess
        if self.py:
            cmd = [self.py[0], "-m", "gpu_anchor.launch.worker", *self.py[1]]
        else:
            if self.pending_restore is not None:  # not Python: restore in a helper first
                subprocess.run([sys.executable, "-m", "gpu_anchor.launch.worker", "--restore-only"], env=env,
                               check=True)
            cmd = self.cfg.command
        p = subprocess.Popen(cmd, env=env, stdin=subprocess.DEVNULL, process_group=0)
        return _Worker(rank, p.pid, p)

    def _start_zygote(self) -> None:
        if self.py and self.cfg.warm.enabled:
            from .zygote import start_server
            w = self.cfg.warm
            standby = resolve_standby(w, self.devices)
            self.zygote = start_server(self.py[0], w.preload, self.log, standby=self.cfg.nproc if standby else 0,
                                       prewarm=w.prewarm, hide_gpus=self.cfg.device_type == "cpu")
            self.auto_prewarm = self.zygote is not None and standby and w.auto_prewarm and not w.prewarm
            if self.zygote is not None and standby:
                self.log("a standby worker per rank takes over after a failure (its CUDA context made"
                         + (f", {w.prewarm} run" if w.prewarm else "")
                         + ("; once the first step is done, also one step of a 1-layer copy of the model: the "
                            "automatic pre-warm, --no-auto-prewarm for none" if self.auto_prewarm else "") + ")"
                         + ("; the default for GPU jobs: each holds a CUDA context on its GPU, --no-warm-pool "
                            "for none" if w.standby is None and not w.prewarm else ""))

    def _collect_exits(self) -> None:
        now = time.time()
        if self.zygote is not None:
            try:
                msgs = self.zygote.messages()
            except RuntimeError:
                self.log("warm-worker server died; its workers die with it; cold starts from now on")
                self.zygote = None
                for w in self.workers.values():
                    if w.status is None and w.popen is None:
                        w.status, w.t_exit = -signal.SIGKILL, now
                msgs = []
            for m in self.zygote.pool_ready() if self.zygote is not None else ():
                self._standby_ready(m)
            by_pid = {w.pid: w for w in self.workers.values()}
            early = self.early.pids() if self.early is not None else set()
            for m in msgs:
                if self.early is not None:
                    self.early.forget(m["pid"])
                if m["pid"] in early:
                    self.log(f"early-started worker pid {m['pid']} exited ({m['status']}) at its gate: "
                             "its group is dropped")
                    self._drop_early()
                    early = set()
                w = by_pid.get(m["pid"])
                if w is not None and w.status is None:
                    w.status, w.t_exit = m["status"], m.get("t", now)
        for w in self.workers.values():
            if w.popen is not None and w.status is None and w.popen.poll() is not None:
                w.status, w.t_exit = w.popen.returncode, now

    def _standby_ready(self, m: dict) -> None:
        """The fork server says a rank's standby finished preparing: record it (``gpu-anchor status``
        shows it; benchmarks wait for it before the next kill)."""
        info = m.get("info") or {}
        rec = {"pid": m.get("pid"), "t": m.get("t"), **{k: info[k] for k in jobstate.STANDBY_KEYS if k in info}}
        self.state.data.setdefault("standbys", {})[str(m["rank"])] = rec
        self.state.save()
        if "failed" in info:
            self.log(f"standby for rank {m['rank']} failed to prepare ({info['failed']}); that rank forks on restart")
        else:
            self.log(f"standby for rank {m['rank']} ready (pid {m.get('pid')}, prepared in "
                     f"{info.get('prepare_s', 0):.2f} s){jobstate.prewarm_text(info)}")

    def _kill_group(self, sig=signal.SIGKILL, grace: float = 10.0) -> None:
        for w in self.workers.values():
            if w.status is None:
                try:
                    os.killpg(w.pid, sig)
                except (ProcessLookupError, PermissionError):
                    pass
        deadline = time.monotonic() + grace
        while any(w.status is None for w in self.workers.values()):
            if time.monotonic() > deadline:
                if sig == signal.SIGKILL:
                    break
                return self._kill_group(signal.SIGKILL, grace=10.0)
            self._wait_io(0.02)
            self._collect_exits()
