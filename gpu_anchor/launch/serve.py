"""``gpu-anchor serve MODEL_DIR [--random-weights]``: the frontend process and the engine,
under the one supervisor (the decision table, crash-loop rule and job record of ``run``).

Process tree::

    gpu-anchor serve            supervisor + fork server: imports torch/transformers, runs no torch op
      ├── frontend              python -m gpu_anchor.serve.frontend (torch-free, owns HTTP clients)
      └── engine (forked)       maps anchored weights/KV, restores, serves; re-forked when it dies
          [ranks 1..N-1]        with --tensor-parallel-size N: one engine process per device

The supervisor forks each engine (``gpu_anchor.runtime.fork``) from an interpreter that has
imported torch and transformers but never started a thread pool or touched CUDA, so a new
engine is ready in well under a second plus its bind/restore; ``--warm-pool`` keeps a
``runtime.Standby`` engine instead.  When the engine dies the supervisor decides as for
training (``classify.decide``): shallow (daemon alive, same instance, journal consistent) →
restart in place, the new engine reattaches; the daemon lost → a fresh daemon and an engine
that starts empty, the frontend re-sending every open request with the tokens its clients
already have (serving's "restore"); an engine that keeps failing at start-up → stop, state
kept.  The job record (``gpu-anchor status``) shows the engine, its restarts and decisions.
``--no-anchor`` (the benchmark baseline) starts no daemon; a restarted engine starts empty.
The engine side (arguments, engine configuration, the standby's warm-up) is
``gpu_anchor.serve.cli``.

With ``--tensor-parallel-size N`` the engine is a group of N processes (``serve/tp.py``),
forked together and watched together: the death of any rank is one failure of the whole
group (its process group is broken), so the others are killed, the group's exits are
classified once, and a new group is forked (docs/serving.md, "Tensor parallelism").
"""
from __future__ import annotations

import argparse
import logging
import os
import signal
import subprocess
import sys
import tempfile
import time

from gpu_anchor import runtime

from . import classify, health, jobstate
from .config import RestartPolicy

log = logging.getLogger("gpu_anchor.serve")

STANDBY_AFTER_S = 2.0
# an engine that dies (other than by SIGKILL/SIGTERM, which come from outside) sooner than
# this after its start made no progress: three in a row are a crash loop
STARTUP_S = 30.0


def add_parser(subparsers) -> argparse.ArgumentParser:
    from gpu_anchor.serve.cli import add_arguments
    p = subparsers.add_parser("serve", help="OpenAI-compatible server whose requests survive engine crashes",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(p)
    p.add_argument("--max-restarts", type=int, default=None,
                   help="stop after this many engine restarts (default: no limit)")
    p.set_defaults(func=main)
    return p


class _Anchor:
    """The engine group's daemons as the supervisor sees them (one per device its ranks use;
    none with ``--no-anchor``).  Rank 0's namespace holds the journal of requests."""

    def __init__(self, cfgs) -> None:
        self.cfgs = cfgs                                # one EngineConfig per rank
        self.instances: dict[str, str | None] = {}     # socket -> instance the engine bound in

    @property
    def cfg(self):
        return self.cfgs[0]

    def places(self) -> list[tuple[str, str, list[str]]]:
        """``(device, socket, namespaces of the ranks there)`` of every daemon the group uses."""
        from gpu_anchor.client.client import namespace_for
        from gpu_anchor.paths import normalize_device
        out: dict[str, tuple[str, list[str]]] = {}
        for c in self.cfgs:
            dev = "cpu" if c.device == "cpu" else normalize_device(c.device)
            ns = namespace_for(c.namespace, dev, c.rank, c.tensor_parallel_size)
            out.setdefault(c.socket, (dev, []))[1].append(ns)
        return [(dev, sock, nss) for sock, (dev, nss) in out.items()]

    def ensure(self) -> None:
        if not self.cfg.anchor:
            return
        from gpu_anchor.client import control
        for dev, sock, _ in self.places():
            if control.ping(dev, sock) is None:
                control.start(dev, sock)
                log.info("started the anchor daemon for %s at %s", dev, sock)
            self.instances.setdefault(sock, health.probe_daemon(dev, sock).instance)

    def observe(self) -> dict:
        """What ``classify.Observation`` needs about the daemons and the journal."""
        if not self.cfg.anchor:
            return {}
        alive = same = True
        for dev, sock, _ in self.places():
            view = health.probe_daemon(dev, sock)
            alive &= view.alive
            same &= view.alive and view.instance == self.instances.get(sock, view.instance)
        out = {"daemons_alive": alive, "daemons_same": same}
        if alive and same:
            dev, sock, nss = self.places()[0]          # rank 0's: the journal of requests
            problem = health.journal_problem([health.read_namespace(dev, sock, nss[0])])
            out.update(journal_consistent=not problem, journal_problem=problem)
        return out

    def replace(self) -> None:
        """Fresh daemons where the old ones died; the group's namespaces dropped where they live on."""
        from gpu_anchor.client import control
        from gpu_anchor.client.channel import Channel
        for dev, sock, nss in self.places():
            if control.ping(dev, sock) is None:
                control.start(dev, sock)
            else:
                ch = Channel(dev, sock, timeout=10.0)
                try:
                    for ns in nss:
                        ch.request({"op": "drop", "namespace": ns})
                finally:
                    ch.close()
            self.instances[sock] = health.probe_daemon(dev, sock).instance


def main(args) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s serve %(levelname)s %(message)s")
    started_at = time.time()
    from gpu_anchor.serve import cli as engine_cli
    from gpu_anchor.serve import options
    try:
        options.check(args)
    except options.OptionError as e:
        print(f"gpu-anchor serve: {e}", file=sys.stderr)
        return 2
    args.warm_pool |= args.prewarm
    # The fork server's role: import the heavy modules once, run nothing that starts threads.
    import torch  # noqa: F401
    from gpu_anchor.serve.model_runner import load_config, meta_model
    try:
        mc = load_config(args.model)
    except (ValueError, FileNotFoundError) as e:
        print(f"gpu-anchor serve: {e}", file=sys.stderr)
        return 2
    from gpu_anchor.checkpoint import migrate
    from gpu_anchor.serve import migration, worker
    migration.provide(migrate)   # `gpu-anchor migrate` moves engine state with the checkpoint library
    meta_model(mc)        # imports the modeling code once, here, for every forked engine
    try:
        cfg = engine_cli.engine_config(args, mc)
    except options.OptionError as e:
        print(f"gpu-anchor serve: {e}", file=sys.stderr)
        return 2
    if cfg.anchor:
        from gpu_anchor.paths import default_socket, normalize_device
        cfg.socket = args.socket or default_socket("cpu" if cfg.device == "cpu" else normalize_device(cfg.device))
    try:
        lock = jobstate.lock(cfg.namespace)
    except jobstate.JobBusy as e:
        print(f"gpu-anchor serve: {e}", file=sys.stderr)
        return 2
    ranks = engine_cli.rank_configs(cfg)
    anchor = _Anchor(ranks)
    anchor.ensure()
    rundir = tempfile.mkdtemp(prefix="gpu-anchor-serve-")
    try:
        template = options.chat_template_file(args.chat_template, rundir)
    except options.OptionError as e:
        print(f"gpu-anchor serve: {e}", file=sys.stderr)
        lock.close()
        return 2
    esock = os.path.join(rundir, "engine.sock")
    name = args.served_model_name or os.path.basename(os.path.normpath(args.model))
    tok = args.tokenizer or (args.model if os.path.isdir(args.model) else None)
    fe_cmd = [sys.executable, "-m", "gpu_anchor.serve.frontend", "--engine-socket", esock,
              "--vocab-size", str(mc.vocab_size), "--model-name", name, "--max-model-len", str(cfg.max_model_len),
              "--host", args.host, "--port", str(args.port), "--started-at", repr(started_at)]
    if tok:
        fe_cmd += ["--tokenizer", tok]
    if template:
        fe_cmd += ["--chat-template", template]
    if args.port_file:
        fe_cmd += ["--port-file", args.port_file]
    key = options.api_key(args)      # in the environment: a command line is visible to every user
    frontend = subprocess.Popen(fe_cmd, env=dict(os.environ, GPU_ANCHOR_SERVE_API_KEY=key or ""))
    state = jobstate.JobState(cfg.namespace, ["gpu-anchor", "serve", *sys.argv[1:]], len(ranks),
                              [] if cfg.device == "cpu" else [c.device for c in ranks], True, kind="serve")
    state.set(frontend_pid=frontend.pid, engine_socket=esock)
    sup = _EngineSupervisor(args, ranks, esock, worker, engine_cli, anchor, state, frontend)
    try:
        return sup.run()
    finally:
        sup.shutdown()
        lock.close()


class _EngineSupervisor:
    def __init__(self, args, ranks, esock, worker, engine_cli, anchor, state, frontend) -> None:
        self.args, self.ranks, self.esock, self.worker, self.ecli = args, ranks, esock, worker, engine_cli
        self.cfg = ranks[0]
        self.anchor, self.state, self.frontend = anchor, state, frontend
        self.policy = RestartPolicy(max_restarts=sys.maxsize if args.max_restarts is None else args.max_restarts)
        self.crash = classify.CrashLoop(self.policy.crash_loop)
        self.health = classify_health(ranks)
        self.engines: dict[int, int] = {}          # rank -> pid: the running engine (group)
        self.rendezvous: str | None = None         # this incarnation's control socket + store prefix
        self.standby = None
        self.incarnation = self.restarts = 0
        self.started = 0.0
        self.stopping = None

    def run(self) -> int:
        def on_signal(signum, frame):
            self.stopping = signum
        signal.signal(signal.SIGTERM, on_signal)
        signal.signal(signal.SIGINT, on_signal)
        while self.stopping is None:
            if self.frontend.poll() is not None:
                log.error("frontend exited (%s); stopping", self.frontend.returncode)
                self.state.set(state="stopped", result=f"frontend exited ({self.frontend.returncode})")
                return 0
            if not self.engines:
                self._start_engines()
            if self.args.warm_pool and self.standby is None and time.time() - self.started > STANDBY_AFTER_S:
                # made once the engine has started, so its CUDA init does not slow that one's
                cfg, esock, worker, ecli = self.cfg, self.esock, self.worker, self.ecli
                self.standby = runtime.Standby(lambda: ecli.standby_prepare(cfg, self.args.prewarm),
                                               lambda go: ecli.standby_run(cfg, esock, go, worker))
            # pidfds: a death is seen when it happens
            r = runtime.wait_any([self.engines[k] for k in sorted(self.engines)], 0.25)
            if r is not None and self._on_exit(*r) is not None:
                return 1
        self.state.set(state="stopped", result=f"interrupted by {signal.Signals(self.stopping).name}")
        return 0

    def _start_engines(self) -> None:
        """Fork the engine (rank 0) and, with tensor parallelism, the other ranks of its group."""
        cfg = self.cfg
        faults = self.ecli.fault_for(self.args.fault_plan, self.incarnation, len(self.ranks))
        cfg.fault = faults.get(0)
        if len(self.ranks) == 1:
            self.ecli.follow_migration(cfg, self.worker.placement_path(self.esock))
        self.anchor.ensure()
        self.started = time.time()
        how = "forked"
        sb, self.standby = self.standby, None
        if sb is not None and sb.ready(timeout=10.0):
            try:
                self.engines = {0: sb.go({"started": self.started, "device": cfg.device, "socket": cfg.socket,
                                          "fault": cfg.fault})}
                how = "warm standby"
            except OSError:              # the standby died meanwhile: start one the usual way
                log.warning("the warm standby is gone; forking an engine")
        if not self.engines:
            if sb is not None:
                sb.close()
            started, worker, esock = self.started, self.worker, self.esock
            if len(self.ranks) > 1:
                # a fresh control socket and process-group store for each incarnation of the group
                self.rendezvous = os.path.join(os.path.dirname(esock), f"tp{self.incarnation}")
                for c in self.ranks:
                    c.rendezvous = self.rendezvous
                    c.fault = faults.get(c.rank)
            from gpu_anchor.serve.tp import serve_rank
            for c in self.ranks:
                main = (lambda c=c: worker.run(c, esock, started_at=started)) if c.rank == 0 else \
                    (lambda c=c: serve_rank(c))
                self.engines[c.rank] = runtime.fork(main)
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

    def _on_exit(self, pid: int, status: int) -> int | None:
        """Classify the engine (group)'s failure; None: a new one is on its way, else the exit code."""
        alive_s = time.time() - self.started
        exits = self._stop_group((pid, status))
        ex = exits[0]
        rest = ""
        if len(self.ranks) > 1:
            rest = "; the rest of the group " + ("also exited: " + ", ".join(e.describe() for e in exits[1:])
                                                 if exits[1:] else "was stopped")
        log.warning("%s after %.2f s%s", self._what(ex.describe()), alive_s, self._what(rest))
        # the placement may have moved (gpu-anchor migrate): judge the daemon the next engine uses
        if len(self.ranks) == 1:
            self.ecli.follow_migration(self.cfg, self.worker.placement_path(self.esock))
        healthy, dev_problem = self.health.check()
        # no progress = died at start-up, not killed from outside: three in a row are a loop
        outside = ex.signal in (signal.SIGKILL, signal.SIGTERM)
        loop = self.crash.record(None if alive_s < STARTUP_S and not outside else self.incarnation, ex.key())
        obs = classify.Observation(tuple(exits), len(self.ranks), device_healthy=healthy, device_problem=dev_problem,
                                   restarts_done=self.restarts, max_restarts=self.policy.max_restarts,
                                   # serving's restore: the frontend re-sends every open request
                                   have_checkpoint=True, crash_loop=loop,
                                   crash_loop_detail=(self.crash.detail() + f", each within {STARTUP_S:.0f} s "
                                                      "of its start") if loop else "",
                                   **self.anchor.observe())
        d = classify.decide(obs)
        reason = self._what(d.reason).replace("restore last checkpoint",
                                              "fresh daemon, the frontend re-sends open requests")
        log.warning("decision: %s — %s", d.action.upper(), reason)
        self.state.add_restart({"action": d.action, "kind": d.kind, "reason": reason, "step": None,
                                "chaos": False, "t_detect": time.time(), "t_exit": time.time(),
                                "generation": self.incarnation, "marks": {}, "recovery_s": None, "rank": ex.rank})
        if d.action == "stop":
            self.state.set(state="stopped", result=reason)
            log.error("stopped; anchored state kept in namespace %r", self.cfg.namespace)
            return 1
        if d.action == "restore":
            self.anchor.replace()
        self.restarts += 1
        return None

    def shutdown(self) -> None:
        if self.standby is not None:
            self.standby.close()
        for pid in self.engines.values():
            os.kill(pid, signal.SIGKILL)
        for pid in self.engines.values():
            os.waitpid(pid, 0)
        self.engines = {}
        if self.frontend.poll() is None:
            self.frontend.terminate()
            try:
                self.frontend.wait(10)
            except subprocess.TimeoutExpired:
                self.frontend.kill()
        self.state.save()


def classify_health(ranks) -> health.DeviceHealth:
    return health.DeviceHealth([int(c.device.split(":")[1]) for c in ranks if c.device.startswith("cuda:")])


def cli(argv=None) -> int:
    """``python -m gpu_anchor.serve ARGS`` = ``gpu-anchor serve ARGS``."""
    ap = argparse.ArgumentParser(prog="gpu-anchor")
    sub = ap.add_subparsers(dest="cmd", required=True)
    add_parser(sub)
    args = ap.parse_args(["serve", *(sys.argv[1:] if argv is None else argv)])
    return args.func(args)
