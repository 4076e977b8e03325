"""Live migration of a serving engine to another device or daemon, between its steps.

    mig = EngineMigration(eng, "cuda:1")          # or ("cpu", socket="/other/host/daemon.sock")
    mig.start()                                   # pre-copy: weights + KV to pinned host memory
    while not mig.ready(): publish(eng.step())    # the engine keeps serving meanwhile
    eng, events = mig.cutover()                   # downtime: dirty KV recopy, bind there, rebuild
    publish(events)                               # the old engine's last published tokens
    ... serve with eng; call mig.poll() between steps ...   # objects stream in on demand

Runs inside the engine process (``serve.worker``), so the frontend connection, the
client streams and the process's interpreter/imports stay as they are; only the engine
object is rebuilt on the destination.  How state moves between daemons is the checkpoint
library's (``gpu_anchor.checkpoint.migrate``: ``Migration``, ``WriteSetTracker``), which
serving does not import (docs/serving.md, "Layering"): whoever starts the engine process
hands it over with ``provide(gpu_anchor.checkpoint.migrate)`` — the supervisor before it
forks engines, tests and benchmarks in their own process.  The state moves through ``Migration`` (soft
recopy pre-copy, then an on-demand restore from host memory): the new engine binds the
same names at the destination daemon, finds them "matched" with the journal's weight
fingerprint and KV layout, and restores every committed sequence with its KV — no
prefill is recomputed.  A request the old engine held but had not committed yet (added
after its last step) is re-added from the old engine's memory; aborts still pending
are passed on.  Untracked writes: on CUDA the KV is stored by a Triton kernel (and CUDA
graph replays bypass the dispatcher), so the tracker sees no KV write: every KV object is
recopied at the cut-over and loaded at the destination before the first step (only the
weights load on demand, and nothing writes those).  The old engine keeps its CUDA graphs
during the pre-copy; the new one decodes eagerly until ``poll`` is done (a capture would
record on-demand loads instead of running them).

Consistency: ``cutover`` first lands the old engine's in-flight commit (``flush``), so
the journal, the KV and the published tokens agree; the recopy then captures exactly
that state.  Failure: until ``poll`` reports the restore done, the source namespace is
kept (the old engine object holds it) and ``placement`` still names the source, so a
destination crash makes the supervisor restart the engine on the source, which replays
from the cut-over state (the frontend dedups and checks replayed tokens).  Once done,
the source objects and journal are dropped and ``placement`` names the destination.
"""
from __future__ import annotations

import dataclasses
import logging
import time

log = logging.getLogger("gpu_anchor.serve")

_library = None      # gpu_anchor.checkpoint.migrate, once provided


def provide(library) -> None:
    """Hand this process the state-migration library (a module with ``Migration`` and
    ``WriteSetTracker``: ``gpu_anchor.checkpoint.migrate``)."""
    global _library
    _library = library


class EngineMigration:
    def __init__(self, eng, device: str, socket: str | None = None, throttle_s: float | None = None,
                 background: bool = True) -> None:
        if eng.anchor.client is None:
            raise ValueError("migration needs an anchored engine (not --no-anchor)")
        if eng.tp is not None:
            raise ValueError("migration of a tensor-parallel engine group is not supported (each rank would "
                             "move its shards, in step with the others)")
        if _library is None:
            raise RuntimeError("no state-migration library in this engine process: start it with gpu-anchor "
                               "serve, or call gpu_anchor.serve.migration.provide(gpu_anchor.checkpoint.migrate)")
        Migration, WriteSetTracker = _library.Migration, _library.WriteSetTracker
        self.old = eng
        self.src_device, self.src_socket = str(eng.device), eng.anchor.client.socket_path
        self.device = "cpu" if device == "cpu" else str(device)
        self.socket = socket
        self.tracker = WriteSetTracker()
        paths = {self.device: socket} if socket else None
        self.m = Migration([eng.anchor.client], self.tracker, {self.src_device: self.device},
                           socket_paths=paths, throttle_s=throttle_s)
        self.background = background      # False: objects move only when touched, the rest at finish()
        self.restore = None
        self.new = None
        self.stats: dict = {}
        self._entered = False
        self._t0 = None
        self._graphs = None

    def start(self) -> None:
        """Begin the pre-copy (the engine keeps stepping; the tracker marks KV it dirties)."""
        self._t0 = time.perf_counter()
        if self.device.startswith("cuda"):   # the destination's CUDA context: now, not in the downtime
            import torch
            torch.empty(1, device=self.device)
        self.m.start(self.old.steps)

    def ready(self) -> bool:
        return self.m.ready()

    def cutover(self):
        """Stop the old engine for good and rebuild it on the destination.  Returns
        ``(new_engine, events)``: ``events`` are tokens the old engine's last commit made
        publishable (publish them before the new engine's)."""
        from .engine import Engine
        old = self.old
        t0 = time.perf_counter()
        self.stats["precopy_s"] = t0 - self._t0 if self._t0 else 0.0
        events = old.flush()
        # On CUDA the KV is written by a Triton kernel, which the tracker cannot see: every
        # KV object counts as dirty, and is loaded at the destination before any step.
        kv = [f"kv_cache[{i}]" for i in range(old.mc.num_hidden_layers)]
        self.m.ckpt.written_untracked(kv)
        self.restore = self.m.cutover(old.steps, background=self.background)
        self.restore.ensure(*[k for k in kv if k in self.restore.targets])
        self.tracker.__enter__()            # the new engine's ops load what they touch first
        self._entered = True
        cfg = dataclasses.replace(old.cfg, device=self.device, socket=self.socket or
                                  (self.src_socket if self.device == self.src_device else None), fault=None)
        new = Engine(cfg)
        # A CUDA graph captured now would record the on-demand loads instead of running them:
        # decode runs eagerly until every object is in (``poll`` hands the graphs back).
        self._graphs, new.graphs = getattr(new, "graphs", None), None
        restored = {s.rid for s in new.restored}
        carried = 0
        for rid, s in list(old.scheduler.seqs.items()):
            if rid not in restored:         # added after the old engine's last commit
                events += [tuple(e) for e in new.add_request(rid, s.prompt_ids, s.params, s.output_ids)]
                carried += 1
        for rid in old._gone:
            new.abort(rid)
        self.new = new
        self.stats.update(cutover_s=time.perf_counter() - t0, recopy_s=self.m.downtime_s,
                          recopied=len(self.m.result.recopied), objects=self.m.result.objects,
                          bytes=self.m.result.bytes, restored=len(restored), carried=carried,
                          engine_init_s=new.timings.get("init_s"))
        return new, events

    def poll(self) -> bool:
        """Call between steps on the engine's thread: True once every object is at the
        destination (the source is then dropped; ``placement`` names the destination)."""
        if self.restore is None or not self.restore.done:
            return False
        if self._entered:
            self.restore.wait()
            self.tracker.__exit__(None, None, None)
            self._entered = False
            self.new.graphs = self._graphs
            self.stats["stream_s"] = self.restore.stats.get("seconds")
            self.stats["on_demand_objects"] = len(self.restore.stats.get("on_demand", []))
            self.stats["background_objects"] = len(self.restore.stats.get("background", []))
            client = self.old.anchor.client
            self.old = None                   # its tensors go: the source objects are freed
            try:
                client.drop_namespace()
            except Exception as e:            # the source daemon is gone: nothing left to free
                log.warning("dropping the source namespace failed: %s", e)
        return True

    def finish(self) -> dict:
        """Block until the destination holds everything (tests, benchmarks)."""
        if self.restore is not None:
            self.restore.wait()
        self.poll()
        return self.stats

    @property
    def placement(self) -> dict:
        """Where the engine lives now (for the supervisor's next fork)."""
        done = self.restore is not None and self.restore.done and not self._entered
        if done:
            return {"device": self.device, "socket": self.new.anchor.client.socket_path}
        return {"device": self.src_device, "socket": self.src_socket}
