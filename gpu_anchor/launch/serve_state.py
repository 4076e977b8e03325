"""The serving engine's anchored state as ``gpu-anchor serve``'s supervisor sees it (torch-free).

- ``AnchorGroup``: the ``ServeAnchor`` of every rank of an engine group (one with TP = 1).
- ``ServeAnchor``: one rank's daemon and namespace — started if none answers (``launch.daemons.JobDaemons``),
  watched while an engine runs (an idle connection whose end the kernel closes when the daemon
  dies; the namespace's objects and ``gpu_anchor/inconsistent`` once a second), replaced when
  the state is lost, freed at a clean stop (the namespace; the daemon only if this server
  started it and no other job keeps objects there).
- ``EngineProgress``: how far the current engine got (built; published tokens), written by the
  engine process itself into memory shared with the supervisor, read after its death.
- ``EngineFailures``: serving's crash-loop rule over those deaths (pure).

The state machine these serve: docs/serving.md, "Destructive failures".
"""
from __future__ import annotations

import logging
import mmap
import os
import struct
import time

from . import classify, health
from .daemons import JobDaemons

log = logging.getLogger("gpu_anchor.serve")

WATCH_S = 1.0          # the namespace of a live engine is checked this often (the daemon's death: at once)


class ServeAnchor:
    """The engine's daemon as the supervisor sees it (none with ``--no-anchor``): started if none
    answers (``JobDaemons``), watched while an engine runs, replaced when lost, freed at a clean
    stop.  ``watch`` is an idle connection to the daemon instance the state lives in: the kernel
    closes it when that process dies, whatever its socket path holds afterwards."""

    def __init__(self, cfg) -> None:
        from gpu_anchor.client.client import namespace_for
        self.cfg = cfg
        # a rank's namespace: ranks of a group that share the host daemon each have their own
        self.namespace = namespace_for(cfg.namespace, "cpu" if cfg.device == "cpu" else "cuda",
                                       getattr(cfg, "rank", 0), getattr(cfg, "tensor_parallel_size", 1))
        self.daemons: JobDaemons | None = None
        self.watch = None
        self.bound = 0              # most objects seen in the namespace since it was last fresh
        self.suspect = ""           # a namespace problem seen at the last check (acted on when seen twice)
        self.next_check = 0.0
        if cfg.anchor:
            dev = self.device()
            self.daemons = JobDaemons([dev], self.namespace, log=log.info, paths={dev: cfg.socket}, host=False)

    def device(self) -> str:
        from gpu_anchor.paths import normalize_device
        return normalize_device(self.cfg.device)

    def _where(self) -> tuple[str, str]:
        return self.device(), self.cfg.socket

    def ensure(self) -> None:
        """A daemon for the next engine (the one watched, or a new one if it is gone)."""
        if self.daemons is None:
            return
        self.follow()
        if self.watch is not None and not self.watch.peer_closed():
            return
        self.daemons.ensure()
        self._watch()

    def follow(self) -> None:
        """After a migration (``cfg`` already points at the destination): watch that daemon."""
        dev, sock = self._where()
        if self.daemons is not None and self.daemons.paths.get(dev) != sock:
            self.daemons.follow(dev, sock)
            self._watch()

    def _watch(self) -> None:
        from gpu_anchor import errors
        from gpu_anchor.client.channel import Channel
        if self.watch is not None:
            self.watch.close()
        self.watch, self.bound, self.suspect = None, 0, ""
        try:
            self.watch = Channel(*self._where(), timeout=10.0)
        except (errors.AnchorError, OSError):
            pass                  # none answers: the next engine's death is judged by a probe, and
                                  # ensure() starts one before the engine after that

    def _namespace_problem(self, ready: bool = False) -> str:
        """Why the namespace is unusable now ('' if it is fine, or the daemon is too busy to say).
        ``ready``: the engine has bound its state, so an empty namespace was emptied under it
        (a drop before the first check saw any object)."""
        dev, sock = self._where()
        v = health.read_namespace(dev, sock, self.namespace, timeout=2.0)
        if v is None:
            return ""
        if v["inconsistent"] is not None:
            return f"the anchored state was marked inconsistent: {v['inconsistent']}"
        if ready and v["objects"] == 0 and self.bound == 0:
            return (f"the anchored objects of namespace {self.namespace!r} are gone (the namespace is empty "
                    "under an engine that has bound its state: dropped under the engine)")
        if v["objects"] < self.bound:
            return (f"{self.bound - v['objects']} of the {self.bound} anchored objects of namespace "
                    f"{self.namespace!r} are gone (dropped or freed under the engine)")
        self.bound = max(self.bound, v["objects"])
        return ""

    def watch_problem(self, ready: bool = False) -> str:
        """Checked while an engine runs: why its anchored state is lost, or ''.  A namespace
        problem counts when two checks in a row see one (a migration drops the source namespace
        a moment before it names the destination)."""
        if self.watch is None:
            return ""
        if self.watch.peer_closed():
            return f"the daemon at {self.cfg.socket} died (its memory is gone)"
        now = time.monotonic()
        if now < self.next_check:
            return ""
        self.next_check = now + WATCH_S
        problem = self._namespace_problem(ready)
        seen_before, self.suspect = self.suspect, problem
        return problem if problem and seen_before else ""

    def observe(self, lost: str = "") -> dict:
        """What ``classify.Observation`` needs about the daemon and the state, after an engine died
        (``lost``: what the watch saw before the supervisor killed it)."""
        if self.daemons is None:
            return {}
        if self.watch is None or self.watch.peer_closed():
            dev, sock = self._where()
            return {"daemons_alive": health.probe_daemon(dev, sock).alive, "daemons_same": False}
        problem = lost or self._namespace_problem()
        return {"daemons_alive": True, "daemons_same": True, "journal_consistent": not problem,
                "journal_problem": problem}

    def replace(self) -> None:
        """A fresh daemon where the old one died; the job's namespace dropped where it lives on."""
        self.daemons.replace_dead()
        self.daemons.drop_namespace()
        self._watch()

    def release(self, keep: bool, how: str) -> str:
        """At the end: free the namespace and stop the daemon we started, or keep both; one line."""
        ns, (dev, sock) = self.namespace, self._where()
        if self.watch is not None:
            self.watch.close()
            self.watch = None
        if keep:
            held = _namespace_bytes(dev, sock, ns)
            ours = " (started by this server)" if self.daemons.started else ""
            return (f"{how}; kept namespace {ns!r} ({_size(held)}) in the daemon at {sock}{ours}: the next "
                    f"`gpu-anchor serve` of this model maps it instead of loading; free it with `gpu-anchor drop "
                    f"{ns}`{' and `gpu-anchor stop`' if ours else ''}")
        objects, nbytes = self.daemons.drop_namespace()
        said = self.daemons.stop() or [f"the daemon at {sock} was running before this server and stays"]
        return f"{how}; freed namespace {ns!r} ({objects} objects, {_size(nbytes)}); {'; '.join(said)}"


class AnchorGroup:
    """Every rank's ``ServeAnchor`` (rank 0's namespace holds the journal of requests).  A lost
    daemon or namespace of any rank is the group's loss: the group is restored as a whole."""

    def __init__(self, ranks) -> None:
        self.members = [ServeAnchor(c) for c in ranks]
        self.lost_rank = 0                              # whose state the watch last saw lost
        self.daemons = self.members[0].daemons        # None with --no-anchor

    def sockets(self) -> list[str]:
        return sorted({str(m.cfg.socket) for m in self.members})

    def ensure(self) -> None:
        for m in self.members:
            m.ensure()

    def follow(self) -> None:                          # migration moves a single engine only
        self.members[0].follow()

    def daemons_alive(self) -> bool:
        """At once, no round trip: every daemon's watched connection is still open."""
        return all(m.watch is None or not m.watch.peer_closed() for m in self.members)

    def watch_problem(self, ready: bool = False) -> str:
        for i, m in enumerate(self.members):
            problem = m.watch_problem(ready)
            if problem:
                self.lost_rank = i
                return problem
        return ""

    def observe(self, lost: str = "") -> dict:
        """A dead or replaced daemon of any rank is the group's loss; of the namespaces, rank 0's
        decides (it holds the journal of requests): another rank whose objects are gone is a
        shallow failure — its next engine finds new memory, and the group's start-up agreement
        has every rank recompute (docs/serving.md, "Tensor parallelism", I4)."""
        rank, self.lost_rank = self.lost_rank, 0
        views = [self.members[0].observe(lost if rank == 0 else "")] + [m.observe() for m in self.members[1:]]
        if not views[0]:
            return {}
        out = dict(views[0])
        out["daemons_alive"] = all(v["daemons_alive"] for v in views)
        out["daemons_same"] = all(v["daemons_same"] for v in views)
        if not (out["daemons_alive"] and out["daemons_same"]):
            out.pop("journal_consistent", None)
            out.pop("journal_problem", None)
        return out

    def replace(self) -> None:
        for m in self.members:
            m.replace()

    def release(self, keep: bool, how: str) -> str:
        # the last rank first: rank 0 started a shared host daemon, and stops it once it is empty
        lines = [m.release(keep, how) for m in reversed(self.members)]
        return lines[-1] if len(lines) == 1 else " | ".join(reversed(lines))


def _namespace_bytes(device: str, sock: str, namespace: str) -> int | None:
    from gpu_anchor.client.channel import Channel
    try:
        ch = Channel(device, sock, timeout=10.0)
    except Exception:
        return None
    try:
        return ch.request({"op": "status"})[0]["namespaces"].get(namespace, {}).get("object_bytes", 0)
    except Exception:
        return None
    finally:
        ch.close()


def _size(nbytes: int | None) -> str:
    if nbytes is None:
        return "size unknown: the daemon did not answer"
    return f"{nbytes / 2**30:.2f} GiB" if nbytes >= 2**30 else f"{nbytes / 2**20:.1f} MiB"


class EngineProgress:
    """How far the current engine got, written by the engine itself (a forked child) into a page
    shared with the supervisor: its pid and 1 (built, said hello) or 2 (published tokens).  Read
    after its death, so a crash at start-up is told from a failure after progress."""
    LEVELS = {"ready": 1, "tokens": 2}

    def __init__(self) -> None:
        self.mem = mmap.mmap(-1, 16)          # anonymous and shared: every forked engine writes here

    def __call__(self, what: str) -> None:    # in the engine
        struct.pack_into("<qq", self.mem, 0, os.getpid(), self.LEVELS[what])

    def reached(self, pid: int) -> int:
        who, level = struct.unpack_from("<qq", self.mem, 0)
        return level if who == pid else 0


class EngineFailures:
    """Serving's crash-loop rule (pure).  An engine failure counts when the engine failed by
    itself before publishing a token: not a kill from outside (SIGKILL, SIGTERM), not a death
    that followed the loss of its anchored state, not after progress.  ``limit`` counted
    failures in a row are a crash loop.  Unsure -> restore: the second counted failure in a
    row on a state that is not known fresh restores first (the state may be what the engines
    trip over), so a loop is only declared once an engine on a fresh state failed too."""

    def __init__(self, limit: int) -> None:
        self.loop = classify.CrashLoop(limit)
        self.in_row = 0           # counted failures in a row
        self.fresh = False        # a restore made the state and no engine published a token since
        self._n = 0

    def record(self, reached: int, exit_key: str, outside: bool, destructive: bool) -> tuple[bool, bool]:
        """One engine's death (``reached``: ``EngineProgress`` level).  Returns (crash loop,
        restore first)."""
        self._n += 1
        if reached >= 2:
            self.fresh = False
        counted = reached < 2 and not outside and not destructive
        self.in_row = self.in_row + 1 if counted else 0
        loop = self.loop.record(None if counted else self._n, exit_key)
        return loop, counted and not loop and self.in_row >= 2 and not self.fresh

    def restored(self) -> None:
        self.fresh = True

    def detail(self) -> str:
        return f"{self.in_row} engines in a row failed before publishing a token"
