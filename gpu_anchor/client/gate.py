"""The start gate: a worker started before its predecessor is gone waits here, before its
first request to a daemon, until its supervisor lets it through (torch-free).

``gpu-anchor run`` starts a failed worker's successor as soon as the dead worker's threads
are gone (``runtime.liveness``, ~0.3 ms after a SIGKILL), not when the kernel has finished
tearing the process down (~0.1 s for a 1B model's worker on the H200).  Until then the dead
worker's GPU work may still be landing in the anchored memory, and the supervisor has not
decided yet whether the job restarts in place at all (``launch.classify``).  So the
successor runs the user's code — imports, model construction inside ``managed_scope`` —
up to the first request that reads or changes anchored state, and waits there.

Contract:

- A process whose environment names a gate (``GPU_ANCHOR_START_GATE``: a FIFO's path)
  sends nothing but ``hello`` to any daemon until the gate is **open** (``wait_open``, called
  by ``Client._request`` before every request).  ``hello`` reads and changes nothing.
- The supervisor makes the FIFO and holds it open for reading and writing (``Gate``)
  before it starts the process.  ``Gate.open()`` writes one byte that nobody reads: every
  process that checks the gate from then on sees it open.  Once open, a process does not
  check again (the variable is removed from its environment).
- If the supervisor's end closes without the byte (it died, or dropped the worker), the gate
  is **refused**: ``wait_open`` exits the process before it touches anything.  A dropped
  worker is normally SIGKILLed by the supervisor first; this covers the supervisor's death.
"""
from __future__ import annotations

import array
import fcntl
import os
import sys
import termios

from gpu_anchor import fdwait

ENV = "GPU_ANCHOR_START_GATE"


def wait_open() -> None:
    """Return once this process's start gate is open (at once when it has none); exit the
    process if the gate is refused."""
    path = os.environ.get(ENV)
    if not path:
        return
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    except FileNotFoundError:
        _refused(f"its start gate {path} is gone")
    try:
        while True:
            fdwait.readable([fd])
            if _pending(fd):
                break
            # readable with nothing to read: end of file, every writer gone without opening
            _refused("the supervisor closed its start gate without opening it")
    finally:
        os.close(fd)
    os.environ.pop(ENV, None)


def _refused(why: str):
    sys.exit(f"gpu-anchor: this worker was started early and dropped ({why}): it exits before touching "
             "any anchored state")


def _pending(fd: int) -> int:
    n = array.array("i", [0])
    fcntl.ioctl(fd, termios.FIONREAD, n)
    return n[0]


class Gate:
    """The supervisor's end of one worker's start gate."""

    def __init__(self, path: str) -> None:
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass
        os.mkfifo(path, 0o600)
        self.path = path
        # read + write: a writer exists from now on (a reader never sees a spurious end of
        # file), and writing never blocks for want of a reader
        self._fd: int | None = os.open(path, os.O_RDWR | os.O_NONBLOCK)
        self.opened = False

    def open(self) -> None:
        if self._fd is None:
            raise RuntimeError(f"start gate {self.path} is closed")
        if not self.opened:
            os.write(self._fd, b"1")
            self.opened = True

    def close(self) -> None:
        """Drop the supervisor's end and the path: a process still waiting (not opened) exits."""
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass
