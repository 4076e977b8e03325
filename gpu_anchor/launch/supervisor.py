"""``gpu-anchor run``: start a node's daemons and workers, watch, classify, restart.

State machine of a job (one node, ``nproc`` local ranks = one group)::

    STARTING --daemons up, (restore if asked)--> RUNNING(gen g)
    RUNNING --every rank exit 0--> DONE (daemons stopped unless --keep-daemons)
    RUNNING --a rank fails--> KILL GROUP (SIGKILL every rank's process group; the
            collectives of the others are broken anyway) --> CLASSIFY (classify.decide)
    CLASSIFY --restart (shallow)--> RUNNING(g+1): same daemons, workers reattach
            (early start: the successors of g+1 were started at the first rank's death,
            held at their start gates until here — launch/early_start.py)
    CLASSIFY --restore (destructive)--> fresh daemons, namespaces dropped,
            GPU_ANCHOR_RESTORE=DIR:STEP for gen g+1 (until every rank reports "restored")
    CLASSIFY --stop--> STOPPED (daemons and anchored state kept for a rerun)
    any --SIGINT/SIGTERM--> workers terminated, STOPPED, state kept (debug restart)

Invariant: workers of generation g only ever read state of one committed step —
the one in the live daemons (shallow) or the one restored from a complete
checkpoint (destructive); a generation that needs a restore keeps needing it
until all its ranks have restored.  Every decision is logged as one line.
"""
from __future__ import annotations

import os
import selectors
import signal
import sys
import time

from gpu_anchor.checkpoint import format as ckpt_format

from . import classify, daemons as daemons_mod, early_start, events, health, jobstate
from .early_start import EarlyStarter
from .workers import WorkerProcesses, _Worker
from .chaos import Chaos
from .config import SupervisorConfig, split_python  # noqa: F401  (split_python: re-exported)


class Supervisor(WorkerProcesses, EarlyStarter):
    def __init__(self, cfg: SupervisorConfig) -> None:
        if cfg.nproc < 1:
            raise ValueError("--nproc-per-node must be >= 1")
        if not cfg.command:
            raise ValueError("nothing to run: give the command after --")
        if cfg.checkpoint.every and not cfg.checkpoint.directory:
            raise ValueError("--checkpoint-every needs --checkpoint-dir")
        self.cfg = cfg
        self.py = split_python(cfg.command)
        stem = os.path.splitext(os.path.basename(self.py[1][1] if self.py and self.py[1][0] == "-m"
                                                 else (self.py[1][0] if self.py else cfg.command[0])))[0]
        self.namespace = cfg.namespace or os.environ.get("GPU_ANCHOR_NAMESPACE") or f"job-{stem}"
        self.devices = daemons_mod.local_devices(cfg.device_type, cfg.nproc)
        self.daemons = daemons_mod.JobDaemons(self.devices, self.namespace, cfg.keep_daemons, self.log)
        self.health = health.DeviceHealth([int(d.split(":")[1]) for d in self.devices])
        self.chaos = Chaos(cfg.chaos.kills, cfg.chaos.every, cfg.chaos.seed, cfg.chaos.target)
        self.crash = classify.CrashLoop(cfg.restart.crash_loop)
        self.zygote = None
        self.early: early_start.EarlyStart | None = None
        self._early_events: list[dict] = []
        self.auto_prewarm = False             # standbys replay the recipe the workers record
        self.workers: dict[int, _Worker] = {}
        self.gen = 0
        self.restarts = 0
        self.pending_restore: int | None = None
        self.restored_ranks: set[int] = set()
        self.current: dict | None = None      # the restart being measured
        self.last_fail_step: int | None = None
        self.no_progress = 0
        self.chaos_victim: int | None = None
        self.t_chaos: float | None = None
        self._stop_signal: int | None = None
        self._hang_reason: str | None = None
        self._gen_stepped = False
        self._mtime = self._code_mtime()

    # ------------------------------------------------------------------ logging
    def log(self, msg: str) -> None:
        if not self.cfg.quiet:
            print(f"[gpu-anchor] {msg}", file=sys.stderr, flush=True)

    # ------------------------------------------------------------------ main
    def run(self) -> int:
        self._lock = jobstate.lock(self.namespace)  # one supervisor per job namespace
        self.daemons.ensure()
        self.state = jobstate.JobState(self.namespace, self.cfg.command, self.cfg.nproc, self.devices,
                                       bool(self.py and self.cfg.warm.enabled))
        self.events = events.Receiver(jobstate.events_path(self.namespace))
        self._install_signals()
        try:
            self._start_zygote()
            self._start_early_start()
            self.pending_restore = self._initial_restore()
            self._start_group()
            return self._loop()
        finally:
            self._shutdown()

    def _loop(self) -> int:
        while True:
            self._wait_io()
            self._early_tick()
            self._collect_exits()
            self._drain_events()
            if self._stop_signal is not None:
                self.log(f"{signal.Signals(self._stop_signal).name} received: stopping workers; anchored state kept")
                self._kill_group(signal.SIGTERM, grace=10.0)
                self.state.set(state="stopped", result=f"interrupted by {signal.Signals(self._stop_signal).name}")
                self.daemons.keep = True
                return 128 + self._stop_signal
            self._chaos_tick()
            self._hang_tick()
            failed = [w for w in self.workers.values() if w.status not in (None, 0)]
            if failed:
                action = self._on_failure(min(failed, key=lambda w: w.t_exit))
                if action is not None:
                    return action
            elif all(w.status == 0 for w in self.workers.values()):
                self.log("all ranks exited 0: job done")
                self.state.set(state="done", result="success")
                return 0

    def _chaos_tick(self) -> None:
        if self.chaos.target == "daemon" and self.cfg.checkpoint.directory and self.chaos.timeout() == 0 and \
                ckpt_format.latest_complete(self.cfg.checkpoint.directory, self.cfg.nproc) is None:
            return  # a daemon kill before the first complete checkpoint could only end the job: wait
        fired = self.chaos.fire({r: w.pid for r, w in self.workers.items() if w.status is None},
                                self._daemon_pids())
        if fired:
            self.t_chaos = time.time()
            self.chaos_victim = fired[1]
            self.log(f"chaos: SIGKILL {fired[0]} (pid {fired[1]}), {self.chaos.left} kill(s) left")

    def _hang_tick(self) -> None:
        """Kill a group whose committed step stopped advancing (a hung collective, a deadlock)."""
        if not self.cfg.restart.hang_timeout or not self._gen_stepped or any(w.status is not None
                                                                      for w in self.workers.values()):
            return
        now = time.monotonic()
        if now - self._hang_polled < min(1.0, self.cfg.restart.hang_timeout / 4):
            return
        self._hang_polled = now
        steps = [v["step"] for v in self._views() if v and v["step"] is not None]
        step = min(steps) if steps else None
        if step != self._hang_step:
            self._hang_step, self._hang_since = step, now
        elif now - self._hang_since > self.cfg.restart.hang_timeout:
            self._hang_reason = f"hang: no new committed step for {now - self._hang_since:.0f} s (step {step})"
            self.log(f"{self._hang_reason}: killing the group")
            self._kill_group()  # every rank now has an exit status: the loop classifies it

    def _views(self) -> list:
        ranks = list(range(self.cfg.nproc))
        return [health.read_namespace(d, self.daemons.paths[d], ns) for d in self.daemons.devices
                for ns in self.daemons.namespaces_of(d, self.cfg.nproc, ranks)]

    # ------------------------------------------------------------------ workers
    def _start_group(self, adopted: dict | None = None) -> None:
        """Start generation ``self.gen``'s workers, or make ``adopted`` (the early-started
        successor group, its gates open) that generation."""
        self._gen_stepped = False
        self._hang_step, self._hang_since, self._hang_polled = None, time.monotonic(), 0.0
        self.restored_ranks = set()
        t0 = time.time()
        if self.early is not None and adopted is None:
            self.early.close_gates()
        self.workers = adopted if adopted is not None else self._spawn_group(self.gen)
        how = "warm (forked)" if self.zygote is not None else "cold"
        if self.zygote is not None:
            # every rank's standby was used or dismissed by these spawns; reports that arrived
            # before them are about those standbys
            self.zygote.pool_ready()
        self.state.data["standbys"] = {}
        self.state.set(generation=self.gen, state="running")
        self.state.set_ranks({r: {"pid": w.pid, "how": how} for r, w in self.workers.items()})
        if self.current is not None:
            self.current["spawn_s"] = time.time() - t0
            self.current["how"] = how
        self._mtime = self._code_mtime()
        if adopted is not None:     # what the successors reported while they waited at their gates
            events_, self._early_events = self._early_events, []
            self._drain_events(events_)

    # ------------------------------------------------------------------ decisions
    def _on_failure(self, first: _Worker) -> int | None:
        t_detect = time.time()
        self._kill_group()
        exits = [classify.Exit.from_status(first.rank, first.status)] + [
            classify.Exit.from_status(w.rank, w.status if w.status is not None else -signal.SIGKILL)
            for w in self.workers.values() if w is not first]
        by_chaos = self.chaos_victim is not None  # we killed something since the last failure
        alive, same, dproblems = self.daemons.check()
        healthy, dev_problem = self.health.check()
        views = self._views() if alive and same else []
        jproblem = health.journal_problem(views) if views else ""
        steps = [v["step"] for v in views if v and v["step"] is not None]
        step = min(steps) if steps else None
        code_changed = self._code_mtime() != self._mtime
        if code_changed:
            self.crash.reset()
        loop = False if by_chaos else self.crash.record(step, exits[0].key())
        ckpt = ckpt_format.latest_complete(self.cfg.checkpoint.directory, self.cfg.nproc) \
            if self.cfg.checkpoint.directory else None
        obs = classify.Observation(
            tuple(exits), self.cfg.nproc, alive, same, healthy, dev_problem, not jproblem, jproblem,
            self.restarts, self.cfg.restart.max_restarts, ckpt is not None, loop, self.crash.detail() if loop else "")
        d = classify.decide(obs)
        if d.action == "restart" and self.pending_restore is not None:
            d = classify.Decision("restore", d.reason + "; the previous restore did not finish -> restore again",
                                  "destructive")
        if self._hang_reason:
            d = classify.Decision(d.action, f"{self._hang_reason}; {d.reason}", d.kind)
            self._hang_reason = None
        reason = d.reason + ("; code changed since the last start" if code_changed else "") + \
            (" [chaos]" if by_chaos else "") + (f" ({'; '.join(dproblems)})" if dproblems else "")
        self.log(f"decision: {d.action.upper()} — {reason}")
        if d.action != "restart":
            self._drop_early()
        rec = {"action": d.action, "kind": d.kind, "reason": reason, "step": step, "chaos": by_chaos,
               "t_detect": t_detect, "t_kill": self.t_chaos if by_chaos else None,
               "t_exit": first.t_exit, "generation": self.gen + 1, "marks": {}, "recovery_s": None}
        self.state.add_restart(rec)
        self.chaos_victim, self.t_chaos = None, None
        self.chaos.disarm()
        if d.action == "stop":
            self.state.set(state="stopped", result=reason)
            self.daemons.keep = True
            self.log(f"stopped. Anchored state kept in namespace {self.namespace!r}: rerun the same command to "
                     f"continue, or free it with `gpu-anchor drop {self.namespace}` / `gpu-anchor stop`")
            return 1
        # backoff: only when failures repeat without progress
        progressed = step is not None and (self.last_fail_step is None or step > self.last_fail_step)
        self.no_progress = 0 if (progressed or by_chaos) else self.no_progress + 1
        self.last_fail_step = step
        if self.no_progress and self.cfg.restart.backoff > 0:
            delay = min(30.0, self.cfg.restart.backoff * 2 ** (self.no_progress - 1))
            self.log(f"no progress since the last failure: waiting {delay:.1f} s")
            time.sleep(delay)
        if d.action == "restore":
            fresh = self.daemons.replace_dead()
            self.daemons.drop_namespace()
            self.pending_restore = ckpt
            self.log(f"restore: fresh daemon(s) {fresh or 'none needed'}; restoring checkpoint step {ckpt}")
            rec["restore_step"] = ckpt
        self.restarts += 1
        self.gen += 1
        self.current = rec
        rec["decide_s"] = round(time.time() - t_detect, 4)
        self._start_group(self._adopt_early(rec))
        self.state.save()
        return None

    def _initial_restore(self) -> int | None:
        """Resume from the newest complete checkpoint if the daemons hold nothing of this job."""
        if not (self.cfg.resume and self.cfg.checkpoint.directory):
            return None
        ckpt = ckpt_format.latest_complete(self.cfg.checkpoint.directory, self.cfg.nproc)
        if ckpt is None:
            return None
        for d in self.daemons.devices:
            for ns in self.daemons.namespaces_of(d, self.cfg.nproc, list(range(self.cfg.nproc))):
                v = health.read_namespace(d, self.daemons.paths[d], ns)
                if v and v["step"] is not None:
                    self.log(f"anchored state of {self.namespace!r} found at step {v['step']}: reattaching "
                             f"(checkpoint step {ckpt} not needed)")
                    return None
        self.log(f"no anchored state for {self.namespace!r}: resuming from checkpoint step {ckpt}")
        return ckpt

    # ------------------------------------------------------------------ events
    def _drain_events(self, received: list[dict] | None = None) -> None:
        for ev in self.events.drain() if received is None else received:
            if self.early is not None and self.early.group is not None and ev.get("generation") == self.gen + 1:
                self._early_events.append(ev)     # an early-started worker: its generation is not decided
                continue
            if ev.get("generation") != self.gen:
                continue
            if ev["event"] == "restored":
                self.restored_ranks.add(ev["rank"])
                if self.restored_ranks >= set(range(self.cfg.nproc)):
                    self.pending_restore = None
            if ev["event"] == "warm_recipe":
                self._warm_recipe(ev)
                continue
            if ev["event"] == "first_step":
                self.chaos.arm()
                self._gen_stepped = True
            if self.current is None:
                continue
            marks = self.current["marks"].setdefault(str(ev["rank"]), {})
            marks.setdefault(ev["event"], ev["t"])
            if ev["event"] == "user_code" and ev.get("how") == "standby":
                self.current["how"] = "warm standby"
            if ev["event"] == "first_step" and all(
                    "first_step" in self.current["marks"].get(str(r), {}) for r in range(self.cfg.nproc)):
                t0 = self.current["t_kill"] or self.current["t_exit"] or self.current["t_detect"]
                last = max(self.current["marks"][str(r)]["first_step"] for r in range(self.cfg.nproc))
                self.current["recovery_s"] = round(last - t0, 4)
                self.log(f"recovered: first step of generation {self.gen} done "
                         f"{self.current['recovery_s']:.3f} s after the failure ({self.current.get('how')}"
                         f"{', started early' if self.current.get('early') else ''})")
                self.current = None
            self.state.save()

    def _warm_recipe(self, ev: dict) -> None:
        """A worker recorded what its first step trained (or why it could not): kept in the job
        record and, when new, handed to the fork server, whose standby for that rank is made
        again to replay it (``runtime.auto_prewarm``)."""
        rank, recipe = str(ev["rank"]), ev.get("recipe")
        known = self.state.data.setdefault("warm_recipes", {})
        entry = {"recipe": recipe} if recipe is not None else {"skip": ev.get("skip", "no recipe")}
        if known.get(rank) == entry:
            return
        known[rank] = entry
        if recipe is None:
            self.log(f"automatic pre-warm off for rank {rank}: {entry['skip']}; its standby stays a plain warm one")
        elif self.zygote is not None:
            m = recipe["model"]
            self.log(f"rank {rank} trains {m['class'].rpartition(':')[2]} ({m['config'].get('num_hidden_layers')} "
                     f"layers, {m['dtype']}, batch {'x'.join(map(str, m['batch']))}"
                     f"{', ' + recipe['optimizer']['class'].rpartition(':')[2] if recipe.get('optimizer') else ''}): "
                     "its standby is made again to pre-warm one step of a 1-layer copy")
            self.state.data.get("standbys", {}).pop(rank, None)   # that standby is being replaced
            try:
                self.zygote.recipe(int(rank), recipe)
            except RuntimeError as e:
                self.log(f"could not pass the recipe to the warm-worker server ({e})")
        self.state.save()

    def _wait_io(self, timeout: float | None = None) -> None:
        sel = selectors.DefaultSelector()
        try:
            sel.register(self.events, selectors.EVENT_READ)
            if self.zygote is not None:
                sel.register(self.zygote, selectors.EVENT_READ)
            sel.register(self._wake_r, selectors.EVENT_READ)
            if self.early is not None:
                sel.register(self.early, selectors.EVENT_READ)
            t = 0.25 if timeout is None else timeout
            ct = self.chaos.timeout()
            if ct is not None:
                t = min(t, ct)
            if any(w.popen is not None and w.status is None for w in self.workers.values()) and not self._sigchld:
                t = min(t, 0.01)
            for key, _ in sel.select(t):
                if key.fileobj == self._wake_r:
                    try:
                        os.read(self._wake_r, 4096)
                    except BlockingIOError:
                        pass
        finally:
            sel.close()

    def _install_signals(self) -> None:
        self._wake_r, w = os.pipe()
        os.set_blocking(self._wake_r, False), os.set_blocking(w, False)
        self._sigchld = False
        try:
            signal.set_wakeup_fd(w)
            signal.signal(signal.SIGCHLD, lambda *_: None)
            self._sigchld = True

            def stop(sig, _frame):
                self._stop_signal = sig
            signal.signal(signal.SIGINT, stop)
            signal.signal(signal.SIGTERM, stop)
        except ValueError:  # not the main thread: poll instead
            pass

    # ------------------------------------------------------------------ misc
    def _daemon_pids(self) -> dict[str, int]:
        out = {}
        if self.chaos.target != "daemon" or self.chaos.due is None:
            return out
        # the daemons holding the job's tensors: the GPUs' when there are any
        for d in [d for d in self.daemons.devices if d != "cpu"] or ["cpu"]:
            v = health.probe_daemon(d, self.daemons.paths[d])
            if v.alive and v.pid:
                out[d] = v.pid
        return out

    def _code_mtime(self) -> float | None:
        if not self.py or self.py[1][0] in ("-m", "-c"):
            return None
        try:
            return os.stat(self.py[1][0]).st_mtime
        except OSError:
            return None

    def _shutdown(self) -> None:
        if any(w.status is None for w in self.workers.values()):
            self._kill_group(signal.SIGKILL, 5.0)
        if self.early is not None:
            self.early.close()
        if self.zygote is not None:
            self.zygote.close()
        self.events.close()
        if self.state.data["state"] == "done" and not self.daemons.keep:
            self.daemons.drop_namespace()
        for said in self.daemons.stop():
            self.log(said)
        self.state.save()
