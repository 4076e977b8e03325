"""Prioritized per-object transfer: a background mover plus foreground "this one, now".

Used by the concurrent checkpointer (device → host staging) and by on-demand
restore (file → device).  Every object is in one state::

    PENDING ──claim (background, in priority order)──▶ MOVING ──▶ DONE
    PENDING ──claim (foreground: an op needs it now)──▶ MOVING ──▶ DONE

Invariant: an object is moved exactly once (per queue); ``ensure(name)`` and
``ensure_many(names)`` return only when every name asked for is DONE, so the op
that asked runs after its moves.  A foreground claim moves the object on the
calling thread (top priority); if the background mover holds it, the caller
waits for that one move only.  ``ensure_many`` claims every PENDING name of an
op's write set under one lock acquisition and moves them with ONE
``move_many`` call (one grouped copy instead of one per object), then waits
for the names the background mover held.
``prioritize`` puts names at the front of the background order (the chunk the
training protocol will write next, tensors about to be written).
"""
from __future__ import annotations

import atexit
import queue
import threading
import time
import weakref
from collections import OrderedDict

import torch
from torch.utils._python_dispatch import _disable_current_modes

PENDING, MOVING, DONE = "pending", "moving", "done"
CHUNK_BYTES = 64 << 20


def chunked_copy(dst: torch.Tensor, src: torch.Tensor, stream, chunk_bytes: int = CHUNK_BYTES) -> None:
    """Copy on ``stream`` one chunk at a time, waiting for each: the copy engines never hold
    more than one chunk of ours, so the job's own host<->device transfers wait at most that long."""
    flat_d, flat_s = dst.reshape(-1), src.reshape(-1)
    n = flat_s.numel()
    step = max(1, chunk_bytes // max(1, src.element_size()))
    dev = src.device if src.is_cuda else dst.device
    with torch.cuda.device(dev), torch.cuda.stream(stream), _disable_current_modes():
        for i in range(0, n, step):
            flat_d[i:i + step].copy_(flat_s[i:i + step], non_blocking=True)
            stream.synchronize()


class Runner:
    """One long-lived daemon thread that runs queues' background movers, one queue after another.

    ``TransferQueue.start()`` with its own thread blocks the caller in ``Thread.start()`` until
    the new thread runs, and then until the GIL comes back (up to the interpreter's 5 ms switch
    interval while the mover runs Python): measured 0.1-4 ms of job stall per checkpoint on CPU.
    Handing the mover to a thread that already exists is a put on a queue: it never waits.
    The thread lives until ``stop()`` (its owner's ``close()``, the owner being collected, or
    interpreter exit: an idle daemon thread is let go before finalization, not frozen in it)."""

    def __init__(self, name: str) -> None:
        self._name = name
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        _runners.add(self)

    def _ensure_locked(self) -> None:
        if self._thread is None or not self._thread.is_alive():  # not alive: e.g. in a forked child
            self._jobs = queue.SimpleQueue()  # each thread its own queue: a stopped one never takes work
            self._thread = threading.Thread(target=self._loop, args=(self._jobs,), name=self._name, daemon=True)
            self._thread.start()

    def ensure_started(self) -> None:
        """Create the thread now (e.g. in ``prepare()``) instead of at the first ``submit``."""
        with self._lock:
            self._ensure_locked()

    def submit(self, fn) -> None:
        """Run ``fn()`` on the thread after what was submitted before; ``fn`` must not raise."""
        with self._lock:
            self._ensure_locked()
            self._jobs.put(fn)

    def stop(self) -> None:
        """Let the thread end once what was submitted has run (a later ``submit`` starts a new one)."""
        with self._lock:
            if self._thread is not None and self._thread.is_alive():
                self._jobs.put(None)
            self._thread = None

    @staticmethod
    def _loop(jobs) -> None:
        while True:
            fn = jobs.get()
            if fn is None:
                return
            fn()
            del fn  # while idle, hold nothing of the last queue (nor, through it, of its owner)


_runners: "weakref.WeakSet[Runner]" = weakref.WeakSet()


@atexit.register
def _stop_runners() -> None:
    for r in list(_runners):
        r.stop()


class TransferQueue:
    def __init__(self, names, move, name: str = "gpu-anchor-transfer", throttle_s: float = 0.0,
                 move_many=None) -> None:
        """``move(name, foreground: bool)`` does one object's transfer, synchronously;
        ``move_many(names, foreground: bool)`` (optional) does several at once, synchronously
        as far as the caller's ordering needs (``ensure_many``; default: ``move`` one by one)."""
        self._order: OrderedDict[str, None] = OrderedDict((n, None) for n in names)
        self.state: dict[str, str] = {n: PENDING for n in self._order}
        # not DONE yet; read without the lock as a hint (it only ever decreases): 0 = all DONE
        self.left = len(self.state)
        self._move = move
        self._move_many = move_many or (lambda ns, fg: [move(n, fg) for n in ns])
        self._cv = threading.Condition()
        self._thread: threading.Thread | None = None
        self._thread_name = name
        self._stop = False
        self.throttle_s = throttle_s  # tests and benches: widen the in-flight window
        self.foreground: list[str] = []
        self.background: list[str] = []
        self.error: BaseException | None = None
        self._finished: threading.Event | None = None  # set when the background mover returns

    # ------------------------------------------------------------------ background
    def start(self, runner: Runner | None = None) -> None:
        """Start the background mover: on ``runner``'s thread if given, else on a new thread."""
        self._finished = threading.Event()
        if runner is not None:
            runner.submit(self._run)
            return
        self._thread = threading.Thread(target=self._run, name=self._thread_name, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            self._run_loop()
        finally:
            self._finished.set()

    def _run_loop(self) -> None:
        try:
            while True:
                with self._cv:
                    name = next((n for n in self._order if self.state[n] == PENDING), None)
                    if name is None or self._stop:
                        return
                    self.state[name] = MOVING
                    del self._order[name]
                try:
                    self._move(name, False)
                finally:
                    with self._cv:
                        self.state[name] = DONE
                        self.left -= 1
                        self.background.append(name)
                        self._cv.notify_all()
                if self.throttle_s:
                    time.sleep(self.throttle_s)
        except BaseException as e:  # surfaced by join()
            self.error = e
            with self._cv:
                self._cv.notify_all()

    def prioritize(self, names) -> None:
        with self._cv:
            for n in reversed(list(names)):
                if n in self._order:
                    self._order.move_to_end(n, last=False)

    # ------------------------------------------------------------------ foreground
    def ensure(self, name: str) -> bool:
        """Make ``name`` DONE before returning; True if this call moved it."""
        with self._cv:
            st = self.state.get(name)
            if st is None or st == DONE:
                return False
            if st == MOVING:
                while self.state[name] != DONE and self.error is None:
                    self._cv.wait()
                if self.error is not None:
                    raise RuntimeError("background transfer failed") from self.error
                return False
            self.state[name] = MOVING
            self._order.pop(name, None)
        try:
            self._move(name, True)
        finally:
            with self._cv:
                self.state[name] = DONE
                self.left -= 1
                self.foreground.append(name)
                self._cv.notify_all()
        return True

    def ensure_many(self, names) -> list[str]:
        """Make every one of ``names`` DONE before returning; returns those this call moved.

        The PENDING ones are claimed together (one lock acquisition) and moved with one
        ``move_many`` call on this thread; then the call waits for those the background
        mover held (each of those is moved by it, once).  A name claimed here is never
        moved again; unknown names are ignored."""
        claimed, held = [], []
        with self._cv:
            state = self.state
            for n in names:
                st = state.get(n)
                if st == PENDING:
                    state[n] = MOVING
                    self._order.pop(n, None)
                    claimed.append(n)
                elif st == MOVING:
                    held.append(n)  # the background mover's (or a name listed twice: ours, DONE below)
        if claimed:
            try:
                self._move_many(claimed, True)
            finally:
                with self._cv:
                    for n in claimed:
                        state[n] = DONE
                    self.left -= len(claimed)
                    self.foreground.extend(claimed)
                    self._cv.notify_all()
        if held:
            with self._cv:
                while self.error is None and any(state[n] != DONE for n in held):
                    self._cv.wait()
                if self.error is not None:  # as ``ensure``: a failed mover may have left one torn
                    raise RuntimeError("background transfer failed") from self.error
        return claimed

    def done(self) -> bool:
        with self._cv:
            return self.left == 0

    def is_pending(self, name: str) -> bool:
        return self.state.get(name) == PENDING

    def join(self) -> None:
        """Wait for every object (moving the rest here if no background thread runs)."""
        if self._finished is not None:
            self._finished.wait()
        for n in list(self.state):
            self.ensure(n)
        if self.error is not None:
            raise RuntimeError("background transfer failed") from self.error

    def stop(self) -> None:
        """Stop the background mover after its current object (abandoning the rest)."""
        with self._cv:
            self._stop = True
        if self._finished is not None:
            self._finished.wait()
