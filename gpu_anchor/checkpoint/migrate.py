"""Live migration of a job's anchored state to another daemon (another GPU, another host daemon).

    m = Migration([client], tracker, {"cuda:0": "cuda:1"})
    m.start(step)                         # pre-copy to host memory while the job keeps running
    ... job runs; at each committed step: if m.ready(): break ...
    restore = m.cutover(step)             # job stopped at a consistent point: recopy dirty, bind there
    with tracker:                         # required: the tracker must see the destination's ops
        job continues on cuda:1           # objects stream in; a touched one is loaded first
    restore.wait()

The pre-copy is a soft-recopy checkpoint kept in pinned host memory (no disk): it must
end at the cut-over step, which copy-on-write (the state at ``start``) cannot give.
``cutover`` is the only downtime: the dirty objects' recopy, the destination binds
and one journal commit; then an on-demand restore from host memory feeds the
destination while the job runs there.  The source namespace is left as it was (the
caller drops it once the destination is done: ``restore.wait()``).

State: PRECOPY (``start`` … ``ready``) → CUTOVER (``cutover``) → STREAMING (until
``restore.wait()``).  Failure points: a crash of the source before ``cutover`` returns
leaves the source intact (nothing was changed there); a crash of the destination while
STREAMING leaves its journal saying ``restoring`` (``restore.incomplete``): migrate
again from the source, which the caller has not dropped yet.
"""
from __future__ import annotations

import time

from .concurrent import ConcurrentCheckpointer
from .restore import OnDemandRestore
from .writeset import WriteSetTracker

# The interface serving is given (``gpu_anchor.serve.migration.provide``): keep these names stable.
__all__ = ["Migration", "WriteSetTracker"]


class Migration:
    def __init__(self, clients, tracker: WriteSetTracker, device_map: dict[str, str],
                 socket_paths: dict[str, str] | None = None, dest_tracker: WriteSetTracker | None = None,
                 throttle_s: float | None = None) -> None:
        """``device_map``: source device → destination device; ``socket_paths``: destination
        device → daemon socket (a different daemon for the same device kind: another host
        directory).  ``dest_tracker`` (default: ``tracker``) watches the job on the destination."""
        if not device_map:
            raise ValueError("device_map must name at least one destination")
        same = [c.device for c in clients if device_map.get(c.device, c.device) == c.device
                and (socket_paths or {}).get(c.device) in (None, c.socket_path)]
        if same:
            raise ValueError(f"{same} would migrate onto the same daemon: give another device or socket")
        self.ckpt = ConcurrentCheckpointer(clients, None, tracker, policy="recopy", write=False,
                                           throttle_s=throttle_s)
        self.throttle_s = throttle_s or 0.0  # tests: widen both transfer windows
        self.device_map, self.socket_paths = device_map, socket_paths or {}
        self.dest_tracker = dest_tracker or tracker
        self.downtime_s: float | None = None
        self.result = None

    def start(self, step: int) -> None:
        """Begin the pre-copy at a consistent point (a committed step)."""
        self.ckpt.start(step)

    def ready(self) -> bool:
        """True when the pre-copy is through: cut over at the next consistent point."""
        fl = self.ckpt._flight
        return fl is not None and fl.queue.done()

    def cutover(self, step: int, background: bool = True) -> OnDemandRestore:
        """At a consistent point, with the job stopped on the source for good: copy what was
        written since its pre-copy, bind everything at the destination and start streaming.
        Returns the running restore (``wait()`` for the rest; ``background=False``: objects
        load only when touched or at ``wait()``)."""
        t0 = time.perf_counter()
        self.result = self.ckpt.finish(step)
        if self.result is None or not self.result.valid:
            raise RuntimeError(f"the pre-copy is not usable: {self.result}")
        restore = OnDemandRestore(None, self.dest_tracker, device_map=self.device_map,
                                  socket_paths=self.socket_paths, captured=self.ckpt.captured,
                                  throttle_s=self.throttle_s, background=background).start()
        self.downtime_s = time.perf_counter() - t0
        return restore
