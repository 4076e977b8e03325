"""The serving supervisor's standby and its engines' lifelines (a part of ``launch/serve.py``'s
``serve_engines.EngineSupervisor``, which mixes this in; torch-free).

- the standby: made once the engine has started (a hot one once it is built), noted in the job
  record when ready, dismissed (killed, reaped) when the state it maps is given up;
- lifelines: every engine and standby is forked holding the only write end of a pipe; its end of
  file is the process's death, ~0.4 ms after a SIGKILL, while its pidfd waits for the CUDA
  context's teardown (~0.1 s on an H200);
- the early take-over (docs/serving.md, "Taking over at the engine's lifeline"): at a lifeline's
  end, with a hot standby attached and nothing that could make the failure more than a restart
  in place, the standby takes over at once and waits itself, before it reads anything, until the
  dying engine is quiet (``serve/step_fence.py``, the daemon's ``await_gone``); the exit is still
  classified when it comes (``_on_exit(early=...)``), and undoes the take-over unless it is a
  restart.
"""
from __future__ import annotations

import logging
import os
import signal
import time

from gpu_anchor import fdwait, runtime

log = logging.getLogger("gpu_anchor.serve")
GIB = 1 << 30

STANDBY_AFTER_S = 2.0


class StandbyKeeper:
    """Methods of ``EngineSupervisor`` (its fields: ``standby``, ``standby_at``, ``lifelines``,
    ``standby_lifeline``, ``dying``, ``engines``, ``fence``, ...)."""

    def _standby_due(self) -> bool:
        """A standby is made once the engine has started (its CUDA init must not slow that one's);
        a hot one only once the engine is built: before, there is no complete state to attach to."""
        if time.time() - self.started <= STANDBY_AFTER_S:
            return False
        return not self.args.hot_standby or self.progress.reached(self.engines.get(0, -1)) >= 1

    def _make_standby(self) -> None:
        import dataclasses
        # a hot standby's graphs are captured for the fault plan of the incarnation it will serve
        cfg = dataclasses.replace(self.cfg, fault=self.ecli.fault_for(self.args.fault_plan, self.incarnation).get(0))
        esock, worker, ecli, progress, prewarm, hot = (self.esock, self.worker, self.ecli, self.progress,
                                                        self.args.prewarm, self.args.hot_standby)
        fence = self.fence
        life_r, life_w = os.pipe()
        try:
            self.standby = runtime.Standby(lambda: ecli.standby_prepare(cfg, prewarm, hot, fence),
                                           lambda go: ecli.standby_run(cfg, esock, go, worker, progress, fence),
                                           idle=ecli.standby_idle if hot else None,
                                           before_main=lambda: os.close(life_r))
        finally:
            os.close(life_w)
        self.standby_lifeline = life_r
        self.standby_at = (cfg.device, cfg.socket) if hot else None
        self.standby_noted = False

    def _note_standby(self) -> None:
        """Once the standby is ready: what it is, for ``gpu-anchor status`` and the log."""
        sb = self.standby
        if sb is None or self.standby_noted:
            return
        sb.ready()
        if sb.info is None:
            return
        self.standby_noted = True
        info = sb.info
        rec = {"pid": sb.pid, **{k: info[k] for k in ("prepare_s", "engine_prewarm_s", "hot", "attach_s",
                                                      "not_attachable", "failed", "device_bytes", "allocator_bytes",
                                                      "allocator_peak_bytes") if k in info}}
        if "failed" in info:
            log.warning("standby %d failed while preparing (%s): until the next engine starts, an engine failure is "
                        "recovered by a fresh engine instead (about a second or more on a GPU); --no-prewarm or "
                        "--no-hot-standby make the standby smaller or drop it", sb.pid, info["failed"])
        elif "allocator_peak_bytes" in info:
            log.info("standby %d ready: it holds %s of the device (its allocator %.2f GiB; %.2f GiB at its peak while "
                     "preparing); the KV cache's sizing reserves a fixed 3 GiB for it and, with --prewarm, the "
                     "pre-warm's estimated peak", sb.pid,
                     f"{info['device_bytes'] / GIB:.2f} GiB" if "device_bytes" in info else "an unknown share",
                     info["allocator_bytes"] / GIB, info["allocator_peak_bytes"] / GIB)
        if "engine_prewarm_s" in info:
            rec["prewarm_s"] = info["engine_prewarm_s"]
        self.state.data["standbys"] = {"0": rec}
        self.state.save()

    def _dismiss_standby(self, why: str) -> None:
        """Kill and reap the standby (a hot one's mappings would keep memory of a lost state alive)."""
        sb, self.standby = self.standby, None
        if sb is None:
            return
        sb.close()
        self._close_fd(self.standby_lifeline)
        self.standby_lifeline = None
        self.state.data["standbys"] = {}
        if self.args.hot_standby:
            log.info("standby %d closed: %s", sb.pid, why)

    @staticmethod
    def _close_fd(fd: int | None) -> None:
        if fd is not None:
            try:
                os.close(fd)
            except OSError:
                pass

    def _go(self, sb, predecessor: int | None, writers_gone: bool = False) -> int:
        """The standby becomes the engine (``predecessor``: the engine it replaces, which it
        waits to be quiet — step fence, daemon — before it reads the state; ``writers_gone``:
        that engine's writer threads are known dead, so the daemon can ``drain`` what it sent
        rather than wait for its connections to close); returns its pid."""
        cfg = self.cfg
        slot = self._arm_writers()
        pid = sb.go({"started": self.started, "device": cfg.device, "socket": cfg.socket, "fault": cfg.fault,
                     "predecessor": predecessor, "writers_gone": writers_gone})
        if slot is not None:
            self.writer_slots[pid] = slot
        if self.standby_lifeline is not None:
            self.lifelines[pid] = self.standby_lifeline
            self.standby_lifeline = None
        return pid

    # ------------------------------------------------------------ the writers' robust mutexes
    def _arm_writers(self) -> int | None:
        """A fresh slot of the writers' mutexes for the engine about to start (single rank)."""
        w = self.fence.writers
        return w.arm() if w is not None and len(self.ranks) == 1 else None

    def _watch_writers(self) -> None:
        """Once the engine published tokens (its writers hold their mutexes), a watcher process waits on
        them and writes the engine's pid into ``writers_w`` when every one of them died — a
        process, not a thread: this one forks, and forks only while it runs alone."""
        for pid, wpid in list(self.watchers.items()):       # reap the watchers that are done
            if wpid and os.waitpid(wpid, os.WNOHANG)[0]:
                self.watchers[pid] = 0
        pid = self.engines.get(0)
        slot = self.writer_slots.get(pid)
        # armed once the engine published tokens: before, an early take-over is not allowed anyway
        # (``_early_ok``), and the fork stays out of the new engine's first steps
        if slot is None or pid in self.watchers or self.progress.reached(pid) < 2:
            return
        writers, fd = self.fence.writers, self.writers_w

        def watch():
            if writers.writers_gone(slot):
                os.write(fd, pid.to_bytes(4, "little"))

        def keep_only_the_pipe():    # no copy of the supervisor's descriptors outlives it here
            os.closerange(3, fd)
            os.closerange(fd + 1, 1 << 16)
        try:
            self.watchers[pid] = runtime.fork(watch, before_main=keep_only_the_pipe)
        except Exception as e:       # the lifeline still starts the take-over, later
            self.watchers[pid] = 0
            log.warning("engine %d: its writers are not watched (%s): a take-over waits for its lifeline", pid, e)

    def _writers_dead(self) -> list[int]:
        data = os.read(self.writers_r, 4096)
        return [int.from_bytes(data[i:i + 4], "little") for i in range(0, len(data) - 3, 4)]

    def _wait(self, timeout: float):
        """The next event: ``("exit", pid, status)`` of an engine (or of a dying one whose
        successor already runs), ``("lifeline", pid, None)`` when the engine's lifeline closed;
        None after ``timeout`` seconds."""
        pids = [self.engines[k] for k in sorted(self.engines)] + list(self.dying)
        life = self.lifelines.get(self.engines.get(0, -1)) if len(self.ranks) == 1 else None
        if life is None or not hasattr(os, "pidfd_open"):
            r = runtime.wait_any(pids, timeout)
            return None if r is None else ("exit", *r)
        for p in pids:
            r = os.waitpid(p, os.WNOHANG)
            if r[0] != 0:
                return ("exit", *r)
        pidfds = []
        try:
            for p in pids:
                pidfds.append(os.pidfd_open(p))
            ready = fdwait.readable([life, self.writers_r, *pidfds], timeout)
        finally:
            for fd in pidfds:
                os.close(fd)
        for p in pids:
            r = os.waitpid(p, os.WNOHANG)
            if r[0] != 0:
                return ("exit", *r)
        if self.writers_r in ready and self.engines[0] in self._writers_dead():
            return ("lifeline", self.engines[0], "writers")
        if life in ready:
            return ("lifeline", self.engines[0], None)
        return None

    def _early_ok(self, pid: int) -> str:
        """'' if the hot standby may take over from engine ``pid`` now, at its lifeline's end and
        before its exit can be classified; else why not (the exit is then awaited as always).
        Only when the decision cannot but be a restart in place: the engine had published
        tokens (its failure does not count towards a crash loop), restarts are left, the
        daemon's connection is open, nothing was seen lost, the frontend runs."""
        sb = self.standby
        if sb is None or not sb.ready() or not (sb.info or {}).get("hot"):
            return "no hot standby attached"
        if self.standby_at != (self.cfg.device, self.cfg.socket):
            return "the hot standby is attached elsewhere"
        if self.progress.reached(pid) < 2:
            return "the engine had not published tokens"
        if self.restarts >= self.policy.max_restarts:
            return "no restart left"
        if self.lost or not self.anchor.daemons_alive():
            return "the anchored state is lost"
        if self.frontend.poll() is not None:
            return "the frontend exited"
        return ""

    def _on_lifeline(self, pid: int, how: str | None = None) -> None:
        """The engine's process is dying: its writer threads are gone (``how == "writers"``, the
        earliest sign) or its descriptors closed.  With a hot standby attached and nothing that
        could make this more than a restart in place, the standby takes over now; the exit is
        classified when it comes, and a decision other than a restart then undoes the take-over
        (``_on_exit``)."""
        self._close_fd(self.lifelines.pop(pid, None))
        by = how or "lifeline"
        why = self._early_ok(pid)
        if why:
            log.info("engine %d: %s; %s: waiting for its exit", pid,
                     "its writer threads are gone" if how else "its lifeline closed", why)
            return
        sb, self.standby = self.standby, None
        self.state.data["standbys"] = {}
        t_eof = time.time()
        self.dying[pid] = {"started": self.started, "reached": self.progress.reached(pid), "t_eof": t_eof, "by": by}
        self.started = t_eof
        self.cfg.fault = self.ecli.fault_for(self.args.fault_plan, self.incarnation).get(0)
        try:
            self.engines = {0: self._go(sb, pid, writers_gone=how == "writers")}
        except OSError:                   # the standby died meanwhile: the exit path starts one
            log.warning("engine %d: it is dying, and the hot standby is gone", pid)
            self.started = self.dying.pop(pid)["started"]
            self._close_fd(self.standby_lifeline)
            self.standby_lifeline = None
            return
        self.last_engine = pid
        log.info("engine %d: the hot standby takes over at engine %d's %s, before its exit", sb.pid, pid,
                 "writer threads' end" if how else "lifeline end")
        self.incarnation += 1
        self.state.set(generation=self.incarnation - 1, state="running", device=self.cfg.device)
        self.state.set_ranks({0: {"pid": self.engines[0], "how": "hot standby",
                                  "device": self.cfg.device}})

    def _kill_engines(self) -> None:
        for pid in self.engines.values():
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        for pid in self.engines.values():
            os.waitpid(pid, 0)
            self._close_fd(self.lifelines.pop(pid, None))
        self.engines = {}
