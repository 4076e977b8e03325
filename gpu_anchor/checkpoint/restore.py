"""On-demand restore: the job runs before its state is back.

    tracker = WriteSetTracker()
    r = OnDemandRestore(directory, tracker).start()   # objects bound, journal back, nothing loaded yet
    with tracker:
        job = build_job(client)                       # binds the same names: all "matched"
        ... train ...                                 # an op touching an unloaded object loads it first
    r.wait()                                          # the rest streamed in the background

State machine per object: PENDING → MOVING → DONE (``transfer.TransferQueue``).  The
background loader walks objects in the order the previous run first touched them
(recorded by the checkpointer under ``TOUCH_KEY``), then the rest; an op touching a
PENDING object (read or write) claims it and loads it on its own thread first.

Invariant: no op reads or writes an object before it holds the checkpoint's bytes,
provided every access goes through aten ops while ``tracker`` is active (code that
reaches the memory otherwise — NCCL, raw pointers, ``.numpy()`` — must call ``wait``
or ``ensure`` first).

Crash safety: ``start`` drops the namespaces, binds fresh objects and commits the
checkpoint's journal together with ``RESTORING_KEY`` and the supervisor's
``INCONSISTENT_KEY``; both are deleted only after every object is loaded.  A worker
(``incomplete``) or the supervisor (``health``: inconsistent → restore) that finds them
knows the daemon holds a partial restore and restores again.
"""
from __future__ import annotations

import base64
import contextlib
import json
import os
import threading
import time

import torch

from gpu_anchor.client.client import Client
from gpu_anchor.journal_keys import INCONSISTENT_KEY, RESTORED_KEY, RESTORING_KEY, STEP_KEY, TOUCH_KEY
from torch.utils._python_dispatch import _disable_current_modes

from . import snapshot
from .format import latest_complete, read_manifest, step_dir
from .transfer import TransferQueue, chunked_copy


@contextlib.contextmanager
def on_demand(directory: str, step: int | None = None, rank: int | None = None, device_map: dict | None = None,
              tracker=None):
    """Run the body while the checkpoint streams in (the worker's restore hook).

    Starts an ``OnDemandRestore`` and keeps its tracker active around the body; the
    loader detaches itself once everything is in.  Yields the restore object.
    """
    from .writeset import WriteSetTracker
    tracker = tracker if tracker is not None else WriteSetTracker()
    r = OnDemandRestore(directory, tracker, step=step, rank=rank, device_map=device_map).start()
    with tracker:
        yield r
    r.wait()


def incomplete(client) -> int | None:
    """The step of an on-demand restore that never finished in this namespace, else None."""
    v = client.journal.get(RESTORING_KEY)
    return int(v) if v is not None else None


def _specs(source) -> list[tuple]:
    if isinstance(source, dict):
        return [(n, tuple(t.shape), t.dtype) for n, t in source.items()]
    from safetensors import safe_open
    with safe_open(source, framework="pt") as f:
        return [(n, tuple(f.get_slice(n).get_shape()), snapshot.torch_dtype_of(f.get_slice(n).get_dtype()))
                for n in f.keys()]


class OnDemandRestore:
    wants_touched = True

    def __init__(self, directory: str | None, tracker, step: int | None = None, rank: int | None = None,
                 device_map: dict | None = None, socket_paths: dict | None = None,
                 throttle_s: float = 0.0, background: bool = True, captured: list[dict] | None = None) -> None:
        """Restore ``directory``'s checkpoint ``step`` (default: the newest complete one), or,
        with ``captured`` (``ConcurrentCheckpointer(write=False).captured``), from host memory."""
        self.rank = int(os.environ.get("RANK", "0")) if rank is None else rank
        if captured is not None:
            self.step = int(captured[0]["journal"].get(STEP_KEY, b"0"))
            self._entries = [(c["device"], c["namespace"], c["journal"], c["tensors"]) for c in captured]
        else:
            world = int(os.environ.get("WORLD_SIZE", "1"))
            self.step = latest_complete(directory, world) if step is None else step
            if self.step is None:
                raise FileNotFoundError(f"no complete checkpoint in {directory}")
            rdir = os.path.join(step_dir(directory, self.step), f"rank{self.rank}")
            man = read_manifest(rdir)
            if man is None:
                raise FileNotFoundError(f"{rdir} is not a complete checkpoint")
            self._entries = [(e["device"], e["namespace"],
                              {k: base64.b64decode(v) for k, v in e["journal"].items()},
                              os.path.join(rdir, e["file"])) for e in man["files"]]
        self.tracker, self.device_map, self.socket_paths = tracker, device_map or {}, socket_paths or {}
        self.throttle_s, self.background = throttle_s, background
        self.clients: list[Client] = []
        self.targets: dict[str, tuple] = {}  # key -> (source: file path or dict of tensors, object name, tensor)
        self.queue: TransferQueue | None = None
        self.stats: dict = {}
        self._local = threading.local()
        self._stream = None
        self._done = False
        self._finisher: threading.Thread | None = None
        self._error: list[BaseException] = []

    # ------------------------------------------------------------------ public
    def start(self) -> "OnDemandRestore":
        """Bind every object (fresh memory), restore the journal, start loading; returns at once."""
        t0 = time.perf_counter()
        many = len(self._entries) > 1
        order: list[str] = []
        for recorded, namespace, journal, source in self._entries:
            device = self.device_map.get(recorded, recorded)
            client = Client(device, namespace, self.socket_paths.get(device))
            self.clients.append(client)
            client.drop_namespace()
            bound = client.bind(_specs(source), "replace")
            journal = dict(journal)
            touch = json.loads(journal.pop(TOUCH_KEY, b"[]"))
            keys = {}
            for b in bound:
                key = f"{device}/{b.name}" if many else b.name
                keys[b.name] = key
                self.targets[key] = (source, b.name, b.tensor)
                snapshot.HELD[(device, namespace, b.name)] = b.tensor  # keep until the job holds them
                if b.tensor.numel():
                    self.tracker.register(key, b.tensor)
            first = [keys[n] for n in dict.fromkeys(touch) if n in keys]
            seen = set(first)
            order += first + [keys[n] for n in sorted(keys) if keys[n] not in seen]
            if device.startswith("cuda") and self._stream is None:
                self._stream = torch.cuda.Stream(device=torch.device(device), priority=0)
            journal[RESTORED_KEY] = b"%d" % self.step
            journal[RESTORING_KEY] = b"%d" % self.step
            # the supervisor's contract: a namespace marked inconsistent is restored, not reused
            journal[INCONSISTENT_KEY] = b"on-demand restore of step %d not finished" % self.step
            client.journal.commit(journal)
        self.queue = TransferQueue(order, self._load, name="gpu-anchor-restore", throttle_s=self.throttle_s)
        self.tracker.add_listener(self)
        self.stats["start_s"] = time.perf_counter() - t0
        self._t0 = t0
        if self.background:
            self.queue.start()
            self._finisher = threading.Thread(target=self._finish, name="gpu-anchor-restore-done", daemon=True)
            self._finisher.start()
        return self

    def ensure(self, *keys: str) -> None:
        """Load these objects now (for accesses the tracker cannot see)."""
        for k in keys:
            self.queue.ensure(k)

    def wait(self) -> dict:
        """Block until every object is loaded and the restore is marked complete in the journal."""
        if self._finisher is not None:
            self._finisher.join()
            if self._error:
                raise RuntimeError("on-demand restore failed") from self._error[0]
        else:
            self._finish()
        return self.stats

    @property
    def done(self) -> bool:
        return self._done

    def _finish(self) -> None:
        # Runs on its own thread once the loader is through (or in wait()): the listener
        # goes away and the journal stops saying "restoring" only when every byte is in.
        try:
            if self._done:
                return
            self.queue.join()
            self.tracker.remove_listener(self)
            if self._stream is not None:
                torch.cuda.synchronize(self._stream.device)  # on-demand loads ran on the job's streams
            for c in self.clients:
                c.journal.commit(deletes=[RESTORING_KEY, INCONSISTENT_KEY])
            self.stats.update(seconds=time.perf_counter() - self._t0, objects=len(self.targets),
                              on_demand=list(self.queue.foreground), background=list(self.queue.background))
            self._done = True
        except BaseException as e:
            self._error.append(e)
            if threading.current_thread() is threading.main_thread():
                raise

    # ------------------------------------------------------------------ listener
    def before_op(self, func, written, touched) -> None:
        q = self.queue
        if not touched or len(q.foreground) + len(q.background) == len(q.state):
            return
        for n in touched:
            if q.state.get(n) not in (None, "done"):
                q.ensure(n)

    def after_op(self, func, written) -> None:
        pass

    # ------------------------------------------------------------------ loading
    def _file(self, path):
        files = getattr(self._local, "files", None)
        if files is None:
            files = self._local.files = {}
        if path not in files:
            from safetensors import safe_open
            files[path] = safe_open(path, framework="pt").__enter__()
        return files[path]

    def _load(self, key: str, foreground: bool) -> None:
        source, name, dst = self.targets[key]
        if dst.numel() == 0:
            return
        src = source[name] if isinstance(source, dict) else self._file(source).get_tensor(name)
        with _disable_current_modes(), torch.no_grad():
            if not dst.is_cuda:
                dst.copy_(src)
            elif foreground:
                dst.copy_(src)  # on the op's stream: ordered before the op
            else:
                chunked_copy(dst, src, self._stream)
