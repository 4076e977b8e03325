"""Concurrent checkpoint of a job's anchored objects + journal while the job runs.

    tracker = WriteSetTracker()
    ckpt = ConcurrentCheckpointer([client], directory, tracker)
    with tracker:
        for step in ...:
            train_step(); client.journal.commit({"gpu_anchor/step": b"%d" % step})
            ckpt.boundary(step)            # starts a due checkpoint, completes one in flight
    ckpt.finish()

Contract: call ``start``/``boundary``/``finish`` only at a consistent point (a committed
step: nothing in flight that writes anchored state), on the thread that runs the job.
While a checkpoint is in flight the tracker must see every write: ``start`` attaches the
flight's listeners and opens a tracker scope of its own on that thread (``manage_mode``),
which installs the dispatch mode; the flight's completion removes both, so between
checkpoints ops pay nothing, with or without ``with tracker:`` around the loop
(docs/checkpoint.md, "When tracking is installed": the states, the invariant).  Other
threads that write anchored state must enter the tracker themselves.

Policies (PhoenixOS §4), chosen per checkpoint and reported:

* **soft copy-on-write** (``cow``) — the checkpoint is the state at ``start``.  A
  background copier (a thread; on CUDA a low-priority side stream) moves every
  object to pinned host staging.  An op's not-yet-copied write set is copied first, on
  its thread, as one group (on CUDA a GPU-side clone each and one event while the budget
  allows, drained later; else to host and one wait); objects the copier holds are waited
  for.  Invariant: every staged object equals its value at ``start``.
* **soft recopy** (``recopy``) — copies without ever blocking an op; objects written
  after (or while) their copy started are *dirty*.  The checkpoint is the state at
  the boundary where the background copy is found finished: only the dirty objects
  are recopied there, with the job paused.  Invariant: staged = value at that
  boundary.  Cheap when little is written per step (inference: weights, append-only
  KV), no better than stop-the-world when everything is (training).
* **device-side snapshot** (``device``) — copy-on-write at the coarsest grain: at
  ``start`` every CUDA object that fits ``gpu_buffer_fraction`` of free device memory is
  cloned on its device and the job thread waits for the clones (device-to-device: HBM
  bandwidth, not PCIe); they drain to host in the background.  Nothing cloned needs
  tracking — if everything fit, no mode is installed and no op pays anything; the rest
  (host objects, what did not fit) is soft copy-on-write.  Invariant as ``cow``.

``policy="auto"`` picks ``recopy`` when the bytes written per step (measured by the
tracker during the previous checkpoint, or ``expected_dirty_fraction``) are below
``recopy_threshold`` of the total, else ``cow`` (never ``device``: it holds device memory
the size of what it clones).  With a ``Validator`` attached, an
undeclared write during the flight marks the checkpoint invalid; it is not written,
the op is then treated as writing all its inputs, and the checkpoint is retaken at
the next boundary.  Files: ``gpu_anchor.checkpoint.format`` layout, which
``snapshot.restore`` and the supervisor read.
"""
from __future__ import annotations

import json
import os
import threading
import time
import weakref
from dataclasses import dataclass, field, replace

import torch
from torch.utils._python_dispatch import _disable_current_modes

from gpu_anchor.journal_keys import TOUCH_KEY

from . import snapshot
from .format import complete_ranks, step_dir
from .object_table import ObjectTable
from .copying import Copies
from .transfer import CHUNK_BYTES, DONE, Runner, TransferQueue
from .settings import CheckpointSettings
from .writeset import Recorder, WriteSetTracker

POLICIES = ("auto", "cow", "recopy", "stw", "device")


@dataclass
class CheckpointResult:
    step: int
    policy: str
    reason: str
    valid: bool = True
    started_at: int = 0
    stall_s: float = 0.0
    seconds: float = 0.0
    bytes: int = 0
    objects: int = 0
    cow_foreground: list = field(default_factory=list)
    gpu_buffered: int = 0
    recopied: list = field(default_factory=list)
    misses: list = field(default_factory=list)
    path: str | None = None


class _Flight:
    def __init__(self, step, policy, reason, entries, staging, journals):
        self.result = CheckpointResult(step=step, policy=policy, reason=reason, started_at=step)
        self.entries = entries          # key -> (client index, object name, live tensor)
        self.staging = staging          # key -> host tensor
        self.journals = journals        # per client: dict
        # foreground GPU-side copies, one entry per op's group: (keys, device copies, one event after them)
        self.gpu_groups: list[tuple[list[str], list[torch.Tensor], object]] = []
        self.dirty: set[str] = set()
        self.queue: TransferQueue | None = None
        self.t0 = time.perf_counter()


class ConcurrentCheckpointer:
    wants_touched = False

    def __init__(self, clients, directory: str, tracker: WriteSetTracker, policy: str = "auto", *,
                 recopy_threshold: float = 0.25, expected_dirty_fraction: float | None = None,
                 gpu_buffer_fraction: float = 0.5, validator=None, rank: int | None = None,
                 world: int | None = None, throttle_s: float | None = None, write: bool = True,
                 chunk_bytes: int = CHUNK_BYTES, manage_mode: bool = True, settings=None) -> None:
        if policy not in POLICIES:
            raise ValueError(f"policy must be one of {POLICIES}, not {policy!r}")
        if not 0.0 <= recopy_threshold <= 1.0:
            raise ValueError("recopy_threshold is a fraction of the checkpointed bytes (0..1)")
        self.clients = list(clients)
        if not self.clients:
            raise ValueError("give at least one client whose namespace to checkpoint")
        self.directory, self.tracker, self.policy = directory, tracker, policy
        self.settings = settings or replace(CheckpointSettings.from_env(), directory=directory)  # when due
        self.recopy_threshold, self.expected_dirty_fraction = recopy_threshold, expected_dirty_fraction
        self.copies = Copies(chunk_bytes, gpu_buffer_fraction)
        self.rank = int(os.environ.get("RANK", "0")) if rank is None else rank
        self.world = int(os.environ.get("WORLD_SIZE", "1")) if world is None else world
        env = os.environ.get("GPU_ANCHOR_CKPT_THROTTLE_S", "0") or 0
        self.throttle_s = float(env) if throttle_s is None else throttle_s
        self.write_files = write
        self.captured: list[dict] | None = None  # the last checkpoint, when write=False
        self.manage_mode, self._entered = manage_mode, None  # the job thread while its flight's scope is open
        self._lost_at_arm = 0
        # tests: called with each state of the flight as it is entered (docs/checkpoint.md)
        self.transition_hook = None
        self.recorder = Recorder(tracker)
        self.results: list[CheckpointResult] = []
        self.retake_pending = False
        self._flight: _Flight | None = None
        self._writer: threading.Thread | None = None
        self._copier = Runner("gpu-anchor-ckpt-copier")  # one thread for every flight's background copies
        weakref.finalize(self, self._copier.stop)  # an idle copier thread must not outlive its checkpointer
        self._writer_error: list[BaseException] = []
        self._table = ObjectTable(self.clients, tracker)
        self._observed: int | None = None  # bytes the job wrote per step, seen during the last flight
        self._derived: tuple | None = None  # (entries, total bytes, staging, CUDA device) for those entries
        self.validator = validator
        if validator is not None:
            validator.on_miss.append(self._on_miss)

    @classmethod
    def from_env(cls, clients, tracker: WriteSetTracker, settings=None, **kw) -> "ConcurrentCheckpointer":
        """The supervisor's ``CheckpointSettings`` (default: from this worker's environment): call
        ``boundary(step)`` after every step commit instead of ``snapshot.at_step``."""
        if not (settings := settings or CheckpointSettings.from_env()).directory:
            raise RuntimeError("no checkpoint directory: the supervisor did not ask for checkpoints")
        return cls(clients, settings.directory, tracker, settings=settings, **kw)

    # ------------------------------------------------------------------ public
    @property
    def in_flight(self) -> bool:
        return self._flight is not None

    def start(self, step: int, policy: str | None = None) -> str:
        """Begin a checkpoint of the state at this consistent point; returns the policy used."""
        if self._flight is not None:
            raise RuntimeError(f"a checkpoint (step {self._flight.result.step}) is still in flight; "
                               "call boundary()/finish() first")
        self._wait_writer()
        t0 = time.perf_counter()
        entries = self._table.entries()
        if self._derived is None or self._derived[0] is not entries:  # same table: same staging and sizes
            total = sum(t.numel() * t.element_size() for _, _, t in entries.values())
            staging = {k: self._staging(k, t) for k, (_, _, t) in entries.items()}
            dev = next((t.device for _, _, t in entries.values() if t.is_cuda), None)
            self._derived = (entries, total, staging, dev)
        _, total, staging, dev = self._derived
        policy, reason = self._choose(policy or self.policy, total)
        fl = self._flight = _Flight(step, policy, reason, entries, staging, None)
        fl.t0 = t0  # the checkpoint's duration counts from the start() call, as its stall does
        fl.result.objects, fl.result.bytes = len(entries), total
        if policy == "stw":  # the baseline: every copy queued on the job's stream, one wait
            self._capture_point(fl, dev)
            with _disable_current_modes(), torch.no_grad():
                for k, (_, _, t) in entries.items():
                    staging[k].copy_(t, non_blocking=t.is_cuda)
            self._sync()
            fl.result.stall_s = time.perf_counter() - t0
            self._complete(step)
            return policy
        order = list(entries)
        if self.recorder.write_order_last:  # what the last observed step wrote first goes first
            first = [k for k in self.recorder.write_order_last if k in entries]
            seen = set(first)
            order = first + [k for k in order if k not in seen]
            fl.result.reason += "; copy order: last step's first writes"
        self.recorder.reset()
        self._lost_at_arm = self.tracker.lost
        self.copies.set_budget(dev)
        clone = self.copies.plan_device_copy(fl, order) if policy == "device" else []
        rest = [k for k in order if k not in set(clone)] if clone else order
        fl.queue = TransferQueue(rest, self._move, throttle_s=self.throttle_s, move_many=self._move_many)
        # docs/checkpoint.md, "When tracking is installed": ARMED (listeners attached and the mode on
        # this thread's stack) before CAPTURED (the state the checkpoint records) before COPYING
        if rest:
            self._arm()
            self._transition("armed")
        self._capture_point(fl, dev)
        if clone:
            self.copies.copy_on_device(fl, clone)
        self._transition("captured")
        fl.queue.start(self._copier)
        self._transition("copying")
        fl.result.stall_s += time.perf_counter() - t0
        return policy

    def _arm(self) -> None:
        self.tracker.add_listener(self)
        self.tracker.add_listener(self.recorder)
        if self.manage_mode:  # a scope of the flight's own: the mode is installed only while in flight
            self._entered = self.tracker.enter_scope()
        if not self.tracker.active:
            self._detach()
            self._flight = None
            raise RuntimeError("this thread is in no scope of the tracker, so the checkpoint would miss the job's "
                               "writes: use manage_mode=True (the default) or call start() inside `with tracker:`")

    def _capture_point(self, fl: _Flight, dev) -> None:
        """The state the checkpoint records: the journal now, and (CUDA) every write queued so far."""
        fl.journals = [c.journal.get_many() for c in self.clients]
        self.copies.capture_point(dev)

    def _transition(self, name: str) -> None:
        hook = self.transition_hook
        if hook is not None:
            hook(name)

    @property
    def copied(self) -> bool:
        """Every object of the flight in flight is copied (it completes at the next ``boundary``)."""
        fl = self._flight
        return fl is not None and fl.queue is not None and fl.queue.done()

    def prepare(self) -> int:
        """Pay now what the first ``start`` would (staging, object table, copier, the dispatch path's
        one-time import); returns bytes."""
        self._copier.ensure_started()
        self.tracker.warm()
        entries = self._table.entries()
        return sum(self._staging(k, t).nbytes for k, (_, _, t) in entries.items())

    def prioritize(self, names) -> None:
        """Copy these objects next (e.g. the chunk the training protocol writes next)."""
        if self._flight is not None and self._flight.queue is not None:
            self._flight.queue.prioritize(names)

    def written_untracked(self, names) -> None:
        """Objects the job writes where the tracker cannot see (a Triton kernel): a soft-recopy
        flight recopies them at its closing boundary; call before ``finish``."""
        fl = self._flight
        if fl is not None:
            if fl.result.policy != "recopy":
                raise ValueError("only a soft-recopy checkpoint can take untracked writes")
            fl.dirty.update(n for n in names if n in fl.entries)

    def boundary(self, step: int, due: bool | None = None) -> CheckpointResult | None:
        """Call at every committed step boundary: completes a finished flight (recopy: at this
        step), retakes an invalid one, starts one if ``due`` (``None``: when ``settings.every``
        says so and the step is not on disk yet; one due while another is in flight starts at
        the first boundary after that one completes).  Returns the checkpoint completed here."""
        if due is None:
            due = self.settings.due(step) and not complete_ranks(step_dir(self.directory, step), self.world).get(self.rank)
        self.tracker.sync()  # a step boundary: the mode is installed on this thread iff someone listens
        done = None
        fl = self._flight
        if fl is not None and fl.queue.done():
            self._transition("copied")
            done = self._complete(step)
        elif fl is not None:
            self.recorder.close_group()
        self.retake_pending |= bool(due)  # due while one is in flight: start right after it
        if self._flight is None and self.retake_pending:
            self.retake_pending = False
            self.start(step)
        return done

    def finish(self, step: int | None = None) -> CheckpointResult | None:
        """Block until the in-flight checkpoint is complete and written.  For ``recopy``
        the job must be at a consistent point: ``step`` is that boundary's step."""
        fl = self._flight
        if fl is None:
            self._wait_writer()
            return self.results[-1] if self.results else None
        if fl.result.policy == "recopy" and step is None:
            raise ValueError("finishing a soft-recopy checkpoint needs the current committed step")
        t0 = time.perf_counter()
        fl.queue.join()
        if fl.result.policy == "recopy":
            fl.result.stall_s += time.perf_counter() - t0  # the job waits here
        self._transition("copied")
        res = self._complete(step if step is not None else fl.result.step)
        self._wait_writer()
        return res

    def stop_the_world(self, step: int) -> CheckpointResult:
        """Synchronous copy of everything (the baseline), written like the others."""
        self.start(step, policy="stw")
        self._wait_writer()
        return self.results[-1]

    def close(self) -> None:
        if self._flight is not None and self._flight.queue is not None:
            self._flight.queue.stop()
            self._detach()
            self._flight = None
        self._copier.stop()
        self._wait_writer()

    # ------------------------------------------------------------------ listener
    def before_op(self, func, written, touched) -> None:
        fl = self._flight
        if fl is None or not written:
            return
        if fl.result.policy != "recopy":  # cow, device: copy before the write
            q = fl.queue
            if not q.left:  # everything copied (a hint read without the lock: it only decreases)
                return
            t0 = time.perf_counter()
            state = q.state
            # DONE is final, so a name seen DONE here needs nothing; the rest are settled under
            # the queue's lock: PENDING ones claimed and copied as one group, MOVING ones waited for
            need = [n for n in written if state.get(n, DONE) != DONE]
            if need:
                q.ensure_many(need)
                fl.result.stall_s += time.perf_counter() - t0
        else:
            self._mark_dirty(fl, written)

    def after_op(self, func, written) -> None:
        fl = self._flight
        if fl is not None and fl.result.policy == "recopy" and written:
            self._mark_dirty(fl, written)  # a copy claimed while the op ran may be torn

    def _mark_dirty(self, fl, written) -> None:
        for n in written:
            if n in fl.entries and not fl.queue.is_pending(n):
                fl.dirty.add(n)

    def _on_miss(self, func, names) -> None:
        fl = self._flight
        self.tracker.treat_as_writing(func)
        if fl is not None:
            fl.result.valid = False
            fl.result.misses.append({"op": str(func), "objects": sorted(names)})

    # ------------------------------------------------------------------ copying (copying.Copies)
    def _staging(self, key, t) -> torch.Tensor:
        return self.copies.staging(key, t)

    def _move(self, key: str, foreground: bool) -> None:
        if foreground:
            self._move_many([key], True)
        else:
            self.copies.copy(self._flight, key)

    def _move_many(self, keys: list[str], foreground: bool) -> None:
        self.copies.move_many(self._flight, keys, foreground)

    def _sync(self) -> None:
        self.copies.sync()

    def _detach(self) -> None:
        self.tracker.remove_listener(self)
        self.tracker.remove_listener(self.recorder)
        if self._entered is not None:
            thread, self._entered = self._entered, None
            self.tracker.exit_scope(thread)

    def _complete(self, step: int) -> CheckpointResult:
        fl = self._flight
        res = fl.result
        if self.validator is not None:
            self.validator.flush()  # a miss in the open op group must count before this completes
        if fl.queue is not None:
            self.tracker.sync()  # finds a mode another mode's exit took off this thread's stack
            if self.tracker.lost != self._lost_at_arm:
                res.valid = False
                res.misses.append({"op": "tracking was removed from the dispatch stack while in flight (a dispatch "
                                         "mode entered inside the tracker's scope exited out of order)",
                                   "objects": sorted(fl.entries)})
            self._detach()
            fl.queue.join()
            if res.policy != "recopy":
                res.cow_foreground = list(fl.queue.foreground)
        if res.policy == "recopy":
            t0 = time.perf_counter()
            res.recopied = sorted(fl.dirty)
            for k in res.recopied:
                _, _, src = fl.entries[k]
                with _disable_current_modes():
                    fl.staging[k].copy_(src)
            self._sync()
            fl.journals = [c.journal.get_many() for c in self.clients]  # state at this boundary
            res.step = step
            res.stall_s += time.perf_counter() - t0
        if fl.queue is not None:
            if self.recorder.group_written:
                self.recorder.close_group()
            if self.recorder.bytes_written_last is not None:
                self._observed = self.recorder.bytes_written_last
        touch = list(self.recorder.first_touch)
        self._flight = None
        res.seconds = time.perf_counter() - fl.t0
        self.results.append(res)
        self._transition("completed")
        if not res.valid:
            self.retake_pending = True
            return res
        self._start_writer(fl, touch)
        return res

    def _choose(self, policy: str, total: int) -> tuple[str, str]:
        if policy != "auto":
            return policy, "requested"
        frac = self.expected_dirty_fraction
        source = "expected_dirty_fraction"
        observed = self._observed
        if frac is None and observed is not None and total:
            frac, source = observed / total, "measured write volume per step"
        if frac is None:
            return "cow", "no write-volume estimate yet: copy-on-write is safe for any dirty set"
        pick = "recopy" if frac < self.recopy_threshold else "cow"
        return pick, f"dirty fraction {frac:.3f} ({source}) vs threshold {self.recopy_threshold}"

    # ------------------------------------------------------------------ writing
    def _capture(self, fl: _Flight, touch: list[str]) -> list[dict]:
        """The flight as ``snapshot.write`` takes it: per client, staged tensors + journal."""
        captured = []
        for ci, client in enumerate(self.clients):
            names = {k: n for k, (c, n, _) in fl.entries.items() if c == ci}
            journal = dict(fl.journals[ci])
            journal[TOUCH_KEY] = json.dumps([names[k] for k in touch if k in names]).encode()
            captured.append({"device": client.device, "namespace": client.namespace, "journal": journal,
                             "tensors": {n: fl.staging[k] for k, n in sorted(names.items(), key=lambda x: x[1])}})
        return captured

    def _start_writer(self, fl: _Flight, touch: list[str]) -> None:
        res = fl.result
        captured = self._capture(fl, touch)
        if not self.write_files:  # kept in host memory for the caller (migration)
            self.copies.drain(fl)
            self.captured = captured
            return

        def run():
            try:
                self.copies.drain(fl)
                self._transition("writing")
                res.path = snapshot.write(self.directory, res.step, self.rank, self.world, captured,
                                          self.settings.keep)
                self._transition("committed")
            except BaseException as e:
                self._writer_error.append(e)
        self._writer = threading.Thread(target=run, name="gpu-anchor-ckpt-writer", daemon=True)
        self._writer.start()

    def _wait_writer(self) -> None:
        if self._writer is not None:
            self._writer.join()
            self._writer = None
        if self._writer_error:
            raise RuntimeError("writing the last checkpoint failed") from self._writer_error.pop()
