"""The serving supervisor's engine lifecycle (``EngineSupervisor``, made by ``launch/serve.py``'s
``main``; torch-free here: the engine side is ``gpu_anchor.serve.cli`` and ``worker``).

- start: the engine (group) is handed over from a ready standby, else forked from this fork
  server; a tensor-parallel group gets a fresh rendezvous per incarnation;
- watch: each engine's pidfd and lifeline, its daemons (an idle connection: death is seen at
  once; the namespace once a second), SIGINT/SIGTERM;
- an exit: the group's other ranks killed, its exits classified once (``classify.decide``):
  restart in place, restore (a fresh daemon or namespace, every open request recomputed by
  the frontend), or give up (every open request ends with an error, ``/health`` 503);
- shutdown: standby, engines and frontend down, then the anchored state freed or kept.

The standby and the lifelines are ``serve_standby.StandbyKeeper``'s, mixed in.
"""
from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import time

from gpu_anchor import runtime
from gpu_anchor.serve.step_fence import StepFence

from . import classify, health
from .config import RestartPolicy
from .serve_standby import StandbyKeeper
from .serve_state import EngineFailures, EngineProgress

log = logging.getLogger("gpu_anchor.serve")


class EngineSupervisor(StandbyKeeper):
    """One engine (group) at a time, for ``launch.serve.main``: forks it (or hands over to the
    standby), watches it and its daemons, classifies its exit, restarts / restores / gives up,
    and shuts everything down."""

    def __init__(self, args, ranks, esock, worker, engine_cli, anchor, state, frontend, control) -> None:
        self.args, self.ranks, self.esock, self.worker, self.ecli = args, ranks, esock, worker, engine_cli
        self.cfg = ranks[0]
        self.anchor, self.state, self.frontend, self.control = anchor, state, frontend, control
        self.policy = RestartPolicy(max_restarts=sys.maxsize if args.max_restarts is None else args.max_restarts)
        self.failures = EngineFailures(self.policy.crash_loop)
        self.health = classify_health(ranks)
        self.progress = EngineProgress()
        self.engines: dict[int, int] = {}          # rank -> pid: the running engine (group)
        self.rendezvous: str | None = None         # this incarnation's control socket + store prefix
        self.standby = None
        self.standby_at = None             # a hot standby's placement (device, daemon socket)
        self.standby_noted = False
        self.incarnation = self.restarts = 0
        self.started = 0.0
        self.stopping = None
        self.failed: str | None = None     # why it gave up: no engine is started any more
        self.lost = ""                     # what the watch saw before it killed the engine
        # the page every engine marks its steps in (step_fence), shared by fork with each
        # engine and standby; made before the first of them
        self.fence = StepFence()
        # pid -> the read end of a pipe only that engine (or standby) holds the write end of:
        # its end of file is the process's death, ~0.3 ms after a SIGKILL, long before its
        # pidfd (the CUDA context's teardown comes first)
        self.lifelines: dict[int, int] = {}
        self.standby_lifeline: int | None = None
        # engines whose lifeline closed and whose hot standby already took over: pid -> what
        # the exit's classification needs of them once their pidfd says they exited
        self.dying: dict[int, dict] = {}
        self.last_engine: int | None = None    # the pid of the engine before the current one
        # the writers' robust mutexes (runtime/liveness.py): pid -> its slot, the engines a
        # watcher process waits on, and the pipe each watcher writes a dead engine's pid into
        self.writer_slots: dict[int, int] = {}
        self.watchers: dict[int, int] = {}     # engine pid -> its watcher's pid
        self.writers_r, self.writers_w = os.pipe()

    def run(self) -> int:
        def on_signal(signum, frame):
            self.stopping = signum
        signal.signal(signal.SIGTERM, on_signal)
        signal.signal(signal.SIGINT, on_signal)
        while self.stopping is None:
            if self.frontend.poll() is not None:
                log.error("frontend exited (%s); stopping", self.frontend.returncode)
                self.state.set(state="stopped", result=f"frontend exited ({self.frontend.returncode})")
                return 1
            if self.failed is not None:          # the frontend answers 503 until we are stopped
                time.sleep(0.25)
                continue
            if not self.engines:
                self._start_engines()
                continue
            if self.args.warm_pool and self.standby is None and self._standby_due():
                self._make_standby()
            self._note_standby()
            self._watch_writers()
            # pidfds (a death is seen when it happens) and the engine's lifeline (its start)
            r = self._wait(0.25)
            if r is not None:
                kind, pid, status = r
                if kind == "lifeline":
                    self._on_lifeline(pid, status)
                elif pid in self.dying:
                    self._on_exit(pid, status, early=self.dying.pop(pid))
                else:
                    self._on_exit(pid, status)
                continue
            if len(self.ranks) == 1:
                self.ecli.follow_migration(self.cfg, self.worker.placement_path(self.esock))
                self.anchor.follow()
                if self.standby is not None and self.standby_at not in (None, (self.cfg.device, self.cfg.socket)):
                    self._dismiss_standby("the engine moved (gpu-anchor migrate); a new one attaches there")
            lost = self.anchor.watch_problem(ready=self.progress.reached(self.engines.get(0, -1)) >= 1)
            if lost:
                # the engine still runs on memory the daemon no longer holds for it: stop it before
                # it trips over the loss (or writes into memory handed to someone else)
                log.warning("anchored state lost under engine %s: %s; killing it",
                            ", ".join(str(p) for p in self.engines.values()), lost)
                self.lost = lost
                for pid in self.engines.values():
                    os.kill(pid, signal.SIGKILL)
        self.state.set(state="stopped", result=f"interrupted by {signal.Signals(self.stopping).name}"
                       + (f" after giving up ({self.failed})" if self.failed else ""))
        return 1 if self.failed else 0

    def _start_engines(self) -> None:
        """Fork the engine (rank 0) and, with tensor parallelism, the other ranks of its group."""
        cfg = self.cfg
        faults = self.ecli.fault_for(self.args.fault_plan, self.incarnation, len(self.ranks))
        cfg.fault = faults.get(0)
        if len(self.ranks) == 1:
            self.ecli.follow_migration(cfg, self.worker.placement_path(self.esock))
        try:
            self.anchor.ensure()
        except Exception as e:           # no daemon can be started: nothing to serve from
            self._give_up(f"no anchor daemon at {', '.join(self.anchor.sockets())}: {e}")
            return
        self.started = time.time()
        how = "forked"
        sb, self.standby = self.standby, None
        self.state.data["standbys"] = {}
        if sb is not None and sb.ready(timeout=10.0):
            try:
                self.engines = {0: self._go(sb, self.last_engine)}
                how = "hot standby" if (sb.info or {}).get("hot") else "warm standby"
                log.info("engine %d: the %s takes over", sb.pid, how)
            except OSError:              # the standby died meanwhile: start one the usual way
                log.warning("the warm standby is gone; forking an engine")
        if not self.engines:
            if sb is not None:
                sb.close()
                self._close_fd(self.standby_lifeline)
                self.standby_lifeline = None
            started, worker, esock, progress = self.started, self.worker, self.esock, self.progress
            if len(self.ranks) > 1:
                # a fresh control socket and process-group store for each incarnation of the group
                self.rendezvous = os.path.join(os.path.dirname(esock), f"tp{self.incarnation}")
                for c in self.ranks:
                    c.rendezvous = self.rendezvous
                    c.fault = faults.get(c.rank)
            from gpu_anchor.serve.tp import serve_rank
            fence = self.fence if len(self.ranks) == 1 else None
            for c in self.ranks:
                main = (lambda c=c: worker.run(c, esock, started_at=started, on_progress=progress, fence=fence)) \
                    if c.rank == 0 else (lambda c=c: serve_rank(c))
                if fence is None:
                    self.engines[c.rank] = runtime.fork(main)
                    continue
                life_r, life_w = os.pipe()
                slot = self._arm_writers()
                try:
                    self.engines[c.rank] = runtime.fork(main, before_main=lambda: os.close(life_r))
                finally:
                    os.close(life_w)
                self.lifelines[self.engines[c.rank]] = life_r
                if slot is not None:
                    self.writer_slots[self.engines[c.rank]] = slot
        self.incarnation += 1
        self.state.set(generation=self.incarnation - 1, state="running", device=cfg.device)
        self.state.set_ranks({r: {"pid": pid, "how": how, "device": self.ranks[r].device}
                              for r, pid in self.engines.items()})

    def _stop_group(self, first: tuple[int, int]) -> list[classify.Exit]:
        """The engine group after one of its processes exited: the ranks that also exited on
        their own, then the rest killed (a broken process group cannot go on).  Returns the
        exits that were not ours, the cause first: a signal, then an error, then the others."""
        by_pid = {pid: r for r, pid in self.engines.items()}
        seen = [first]
        for pid in by_pid:
            if pid != first[0]:
                r = os.waitpid(pid, os.WNOHANG)
                if r[0] != 0:
                    seen.append(r)
        done = {p for p, _ in seen}
        for pid in by_pid:
            if pid not in done:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                os.waitpid(pid, 0)
        self.engines = {}
        if self.rendezvous:
            from gpu_anchor.serve.tp import paths
            for path in paths(self.rendezvous):
                try:
                    os.unlink(path)
                except FileNotFoundError:
                    pass
        exits = []
        for pid, status in seen:
            rc = -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)
            exits.append(classify.Exit.from_status(by_pid[pid], rc))
        return sorted(exits, key=lambda e: (e.signal is None, e.ok))

    def _what(self, text: str) -> str:
        """The decision table speaks of ranks; here a rank is an engine (of a group)."""
        if len(self.ranks) == 1:
            return text.replace("rank 0", "engine")
        return text.replace("rank ", "engine rank ")

    def _on_exit(self, pid: int, status: int, early: dict | None = None) -> None:
        """Classify the engine (group)'s death and act: restart, restore (fresh state), or give up.
        ``early``: the engine's hot standby already took over at its lifeline's end (and what
        was known of the engine then): a restart is then done, any other decision undoes it."""
        if early is not None and early.get("superseded"):
            log.info("engine %d exited; the state its successor took over had been given up meanwhile (%s)", pid,
                     early["superseded"])
            return
        if early is not None:
            rc = -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)
            alive_s = time.time() - early["started"]
            exits = [classify.Exit.from_status(0, rc)]
            reached = early["reached"]
        else:
            rank0 = self.engines.get(0)
            alive_s = time.time() - self.started
            exits = self._stop_group((pid, status))
            reached = self.progress.reached(rank0) if rank0 is not None else 0
            self.last_engine = pid if len(self.ranks) == 1 else None
        self._close_fd(self.lifelines.pop(pid, None))
        ex = exits[0]
        rest = ""
        if len(self.ranks) > 1:
            rest = "; the rest of the group " + ("also exited: " + ", ".join(e.describe() for e in exits[1:])
                                                 if exits[1:] else "was stopped")
        log.warning("%s after %.2f s, %s%s", self._what(ex.describe()), alive_s,
                    ("having published tokens", "serving, before publishing a token", "before it was built")
                    [2 - reached], self._what(rest))
        # the placement may have moved (gpu-anchor migrate): judge the daemon the next engine uses
        if len(self.ranks) == 1:
            self.ecli.follow_migration(self.cfg, self.worker.placement_path(self.esock))
            self.anchor.follow()
        healthy, dev_problem = self.health.check()
        lost, self.lost = self.lost, ""
        seen = self.anchor.observe(lost)
        destructive = not (seen.get("daemons_alive", True) and seen.get("daemons_same", True)
                           and seen.get("journal_consistent", True))
        loop, restore_first = self.failures.record(reached, ex.key(), ex.signal in (signal.SIGKILL, signal.SIGTERM),
                                                   destructive)
        if restore_first:      # unsure -> restore: the anchored state may be what they trip over
            seen = dict(seen, journal_consistent=False,
                        journal_problem=f"{self.failures.detail()} on the anchored state; the next one starts "
                                        "on a fresh state")
        obs = classify.Observation(tuple(exits), len(self.ranks), device_healthy=healthy, device_problem=dev_problem,
                                   restarts_done=self.restarts, max_restarts=self.policy.max_restarts,
                                   # serving's restore: the frontend re-sends every open request
                                   have_checkpoint=True, crash_loop=loop,
                                   crash_loop_detail=self.failures.detail() if loop else "", **seen)
        d = classify.decide(obs)
        reason = self._what(d.reason).replace(
            "restore last checkpoint", "fresh state: the weights loaded again, every open request recomputed from "
                                       "the tokens its client has")
        if d.action == "stop":
            reason = reason.split(". Anchored state is kept")[0]     # the training advice does not apply
        log.warning("decision: %s — %s", d.action.upper(), reason)
        self.state.add_restart({"action": d.action, "kind": d.kind, "reason": reason, "step": None,
                                "chaos": False, "t_detect": early["t_eof"] if early else time.time(),
                                **({"detected_by": early["by"]} if early else {}),
                                "t_exit": time.time(), "generation": self.incarnation, "marks": {},
                                "recovery_s": None, "rank": ex.rank, **({"early": True} if early else {})})
        if early is not None:
            if d.action == "restart":
                log.info("engine %d exited %.0f ms after its lifeline closed; its hot standby had already taken over",
                         pid, (time.time() - early["t_eof"]) * 1e3)
                self.restarts += 1
                return
            # not a restart in place after all: the early take-over is undone
            log.warning("the decision is %s: the engine that took over early (%s) is stopped", d.action,
                        ", ".join(str(p) for p in self.engines.values()))
            self._kill_engines()
        if d.action != "restart":
            for gone in self.dying.values():     # engines still exiting: their state is given up too
                gone["superseded"] = d.action
        if d.action != "restart" and self.standby_at is not None:
            # a hot standby maps the state that is being given up (and keeps its memory alive)
            self._dismiss_standby(f"{d.action}: the state it attached to is not used again")
        if d.action == "stop":
            self._give_up(reason)
            return
        if d.action == "restore":
            t0 = time.perf_counter()
            try:
                self.anchor.replace()
            except Exception as e:
                self._give_up(f"{reason}; a fresh daemon could not be started: {e}")
                return
            self.failures.restored()
            self._tell({"t": "restore", "reason": reason.split(" -> ")[0], "replace_s": time.perf_counter() - t0})
        self.restarts += 1

    def _tell(self, msg: dict) -> None:
        from gpu_anchor.serve import wire
        try:
            self.control.sendall(wire.encode(msg))
        except OSError:
            pass                          # the frontend is gone: the loop sees it

    def _give_up(self, reason: str) -> None:
        """No engine is started any more: the frontend ends every open request with an error
        event and answers 503 until this process is stopped."""
        self.failed = reason
        self.state.set(state="failed", result=reason)
        self._tell({"t": "fatal", "reason": f"the server stopped serving: {reason}"})
        log.error("gave up: %s. Every open request ended with an error; /health answers 503 until this server is "
                  "stopped (SIGTERM); the anchored state stays until then", reason)

    def shutdown(self, clean: bool) -> None:
        """Engine and frontend down (the frontend ends every open stream with an error event
        first); then, on a clean stop, the namespace freed and the daemon we started stopped,
        unless ``--keep-state``.  One log line says what became of the state."""
        if self.standby is not None:
            self.standby.close()
        for pid in self.dying:
            os.waitpid(pid, 0)           # killed already: exiting
        self.dying = {}
        self._kill_engines()
        if self.frontend.poll() is None:
            self.frontend.terminate()
            try:
                self.frontend.wait(15)
            except subprocess.TimeoutExpired:
                self.frontend.kill()
        self.control.close()
        self.health.close()
        if self.anchor.daemons is not None:
            how = f"stopped ({signal.Signals(self.stopping).name})" if clean else "stopped abnormally"
            try:
                line = self.anchor.release(self.args.keep_state or not clean, how)
            except Exception as e:       # a daemon that does not answer: nothing more to free here
                line = f"{how}; could not free the anchored state: {e}"
            log.info("%s", line)
            self.state.set(state_after_stop=line)
        self.state.save()


def classify_health(ranks) -> health.ProbedDeviceHealth:
    # in a child: this process forks engines, and NVML would leave threads here
    return health.ProbedDeviceHealth([int(c.device.split(":")[1]) for c in ranks if c.device.startswith("cuda:")])
