"""Early start: a failed worker's successor starts when the dead worker's threads are gone,
not when the kernel has finished tearing its process down.

A SIGKILLed worker leaves user space at once, but its exit (what ``waitpid`` reports) comes
only after its address space and its CUDA context are torn down: 0.125 s for the 1B
model's worker on the H200 (``docs/benchmarks.md``), the largest part of a restart that
takes ~0.5 s.  Robust mutexes are released at the start of that teardown (``runtime.liveness``),
~0.3 ms after the kill.  So the supervisor:

1. gives every worker it starts through the fork server a liveness slot
   (``worker.LIVENESS_ENV``); the worker's main thread holds the slot's mutexes from before
   the user's code runs until it dies, and lets go of them when the code ends cleanly;
2. watches each slot from a thread: ``"died"`` (a mutex was released by the kernel) starts
   the **successor group** at once — one worker per rank, each behind a start gate
   (``client.gate``): it runs the user's code (imports, the model built inside
   ``managed_scope``) and waits before its first request that reads or changes anchored
   state;
3. classifies the failure as always, once every old worker's exit is known
   (``launch.classify``).  A **restart** (shallow) adopts the successor group and opens its
   gates; anything else (restore, stop, a signal, a successor that died) drops it: its
   processes are SIGKILLed, their gates closed, and the supervisor goes on as without early
   start.

Invariant (what makes it safe): no successor sends a daemon anything but ``hello`` before
every worker of the failed generation has exited and the supervisor decided to restart in
place — exactly when a successor started without early start would send its first request.
What the early start moves ahead of that point is only the successor's own, private work.

Not used for a restore (the successor first restores a checkpoint, which needs the
decision), nor for cold starts (no fork server), nor with more than ``runtime.liveness.SLOTS // 2``
ranks (a generation and its successor group each hold a slot per rank; 15 here).
"""
from __future__ import annotations

import os
import signal
import threading
import time

from gpu_anchor.client.gate import ENV as GATE_ENV, Gate
from gpu_anchor.runtime import liveness

from . import jobstate
from .worker import LIVENESS_ENV


def usable(nproc: int) -> str | None:
    """Why early start cannot be used for ``nproc`` ranks on this machine (None: it can)."""
    if not liveness.available():
        return "no process-shared robust mutexes (glibc) here"
    if 2 * nproc > liveness.SLOTS:
        return f"{nproc} ranks: more than the liveness page holds for two generations ({liveness.SLOTS} slots)"
    return None


class EarlyStart:
    def __init__(self, liveness_path: str, gate_prefix: str) -> None:
        self.path, self.gate_prefix = liveness_path, gate_prefix
        self.live = liveness.Liveness(liveness.shared_file(liveness_path, create=True))
        self._r, self._w = os.pipe()
        os.set_blocking(self._r, False)
        self._stop: dict[int, threading.Event] = {}     # pid -> its watcher's stop
        self.group: dict | None = None      # rank -> worker of the successor group, while undecided
        self.gates: dict[int, Gate] = {}
        self.started_at: float | None = None
        self.trigger: int | None = None      # the pid whose death started the group

    # ------------------------------------------------------------ every worker
    def arm(self, env: dict) -> int:
        """A slot for the next worker, named in its environment."""
        slot = self.live.arm()
        env[LIVENESS_ENV] = f"{self.path}:{slot}"
        return slot

    def watch(self, pid: int, slot: int) -> None:
        """Report ``(pid, "died" | "released")`` once the worker's writers are gone."""
        stop = self._stop[pid] = threading.Event()

        def watcher():
            while not self.live.held(slot):      # the worker takes them before the user's code
                if stop.wait(0.005):
                    return
            how = self.live.wait_writers(slot)
            if how is not None and not stop.is_set():
                os.write(self._w, f"{pid} {how}\n".encode())
        threading.Thread(target=watcher, name=f"gpu-anchor-liveness-{pid}", daemon=True).start()

    def forget(self, pid: int) -> None:
        """``pid``'s exit is known: its watcher need not report (it returns once the mutexes go)."""
        ev = self._stop.pop(pid, None)
        if ev is not None:
            ev.set()

    def fileno(self) -> int:
        return self._r

    def deaths(self) -> list[tuple[int, str]]:
        """The ``(pid, how)`` reports received so far."""
        out = b""
        while True:
            try:
                chunk = os.read(self._r, 4096)
            except BlockingIOError:
                break
            if not chunk:
                break
            out += chunk
        return [(int(p), how) for p, how in (line.split() for line in out.decode().splitlines())]

    # ------------------------------------------------------------ the successor group
    def gate(self, rank: int, env: dict) -> None:
        """Put a start gate in front of rank ``rank``'s successor (its environment names it)."""
        g = self.gates[rank] = Gate(f"{self.gate_prefix}.gate{rank}")
        env[GATE_ENV] = g.path

    def begin(self, group: dict, trigger: int, started_at: float) -> None:
        self.group, self.trigger, self.started_at = group, trigger, started_at

    def pids(self) -> set[int]:
        return {w.pid for w in (self.group or {}).values()}

    def adopt(self) -> dict:
        """The successor group, its gates open: it is the new generation."""
        group, self.group = self.group, None
        for g in self.gates.values():
            g.open()
        return group

    def drop(self) -> None:
        """SIGKILL the successor group (none of it sent a request: it waits at its gates)."""
        group, self.group = self.group or {}, None
        for w in group.values():
            try:
                os.killpg(w.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
            self.forget(w.pid)
        self.close_gates()

    def close_gates(self) -> None:
        for g in self.gates.values():
            g.close()
        self.gates = {}

    def close(self) -> None:
        self.drop()
        for ev in self._stop.values():
            ev.set()
        self._stop.clear()
        for fd in (self._r, self._w):
            os.close(fd)
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass


class EarlyStarter:
    """The supervisor's side (``launch/supervisor.py``'s ``Supervisor`` mixes this in; its
    fields ``early``, ``workers``, ``gen``, ``zygote``, ``daemons``, ``pending_restore``, ...):
    the successor group is started on a death (``_early_tick``, from the main loop), adopted
    by a restart decision (``_adopt_early``) and dropped by any other (``_drop_early``)."""

    def _start_early_start(self) -> None:
        if not (self.cfg.warm.early_start and self.zygote is not None):
            return
        why = usable(self.cfg.nproc)
        if why:
            self.log(f"early start off: {why}")
            return
        base = jobstate.path_for(self.namespace)[:-len(".json")]
        self.early = EarlyStart(base + ".liveness", base)

    def _early_tick(self) -> None:
        """A worker of this generation died (its writers' mutexes released by the kernel, before
        its exit): start the successor group now, each behind its start gate."""
        if self.early is None:
            return
        for pid, how in self.early.deaths():
            w = next((w for w in self.workers.values() if w.pid == pid), None)
            if (how != "died" or w is None or w.status is not None or self.early.group is not None
                    or self._stop_signal is not None or self.pending_restore is not None
                    or self.zygote is None or not self.daemons.seem_alive()):
                continue
            t0 = time.time()
            try:
                group = self._spawn_group(self.gen + 1, gated=True)
            except (RuntimeError, OSError) as e:
                self.log(f"early start of generation {self.gen + 1} failed ({e})")
                self.early.close_gates()
                return
            self.early.begin(group, pid, t0)
            self.log(f"rank {w.rank} (pid {pid}) died: generation {self.gen + 1} started early, "
                     "held at its start gates until the failure is classified")

    def _adopt_early(self, rec: dict) -> dict | None:
        """The early-started successor group, its gates now open (None: there is none)."""
        if self.early is None or self.early.group is None:
            return None
        started = self.early.started_at
        group = self.early.adopt()
        rec["early"], rec["t_gate"] = True, time.time()
        rec["early_s"] = round(rec["t_gate"] - started, 4)   # how far ahead of the decision it started
        rec["t_started"] = started
        self.log(f"generation {self.gen}: the early-started workers go on ({rec['early_s'] * 1e3:.0f} ms "
                 "after their start)")
        return group

    def _drop_early(self) -> None:
        if self.early is not None and self.early.group is not None:
            self.early.drop()
            self._early_events = []
