"""When has a dead engine's last step stopped writing? (the hot takeover's GPU fence; torch-free)

A SIGKILLed engine's process is gone from user space ~0.3 ms after the kill (its sockets and
pipes close then), but the kernels it queued may still run, and the kernel only reports the
process exited (its pidfd) once the driver has torn its CUDA context down, ~80 ms later on an
H200 (``bench/takeover_detect.py``).  A successor that starts at the first event must not
write KV while the dead engine's last step may still write it.

The fence is one shared page, made by the supervisor before it forks any engine (an anonymous
``MAP_SHARED`` mapping, so every forked engine and standby sees the same page):

- ``launched`` (word 0): the engine stores the number of the step it is about to launch
  *before* it enqueues the step's first kernel (a CPU store, visible at once to the others);
- ``mode`` (word 2): how the live engine marks its steps — ``UNMARKED`` (0: it does not, so a
  successor waits for its exit; a new page, a tensor-parallel group, a migrated engine),
  ``DEVICE`` (1: from its CUDA stream), ``HOST`` (2: a CPU engine, whose writes are over once
  its threads are);
- ``done`` (word 1): right after the step's forward — the only kernels that write shared
  memory (the KV cache) — the engine enqueues a stream memory operation
  (``cuStreamWriteValue32``, which is ordered after the stream's earlier work and preceded by
  a memory fence) that writes the same number into the page through its device mapping.

**Invariant:** once the engine's process is dead (no user code of it runs) and
``done == launched``, no kernel of the dead engine can write the KV cache any more.  A process
killed between the store and its step's marker never makes them equal; then ``quiesce`` waits
for the process's exit instead (the slower, always-safe event).  On the CPU a step's writes
are the process's own stores, over when its last thread is, so the fence only records.
"""
from __future__ import annotations

import ctypes
import mmap
import os
import time

from gpu_anchor import fdwait
from gpu_anchor.runtime import liveness

PAGE = 4096
UNMARKED, DEVICE, HOST = 0, 1, 2


class StepFence:
    """The page and its two words; ``register_device`` makes the marker writable from a stream."""

    def __init__(self, page: mmap.mmap | None = None) -> None:
        self.page = page if page is not None else mmap.mmap(-1, PAGE)   # MAP_SHARED | MAP_ANONYMOUS
        self._words = memoryview(self.page).cast("I")
        # the live engine's writer threads (main, commit) hold robust mutexes in a page of their
        # own: their release says those threads are gone, long before the process's descriptors
        # close (runtime/liveness.py); None where glibc's robust mutexes are not there
        self.writers = liveness.Liveness() if page is None and liveness.available() else None
        self._dev = None          # the ``done`` word's device address once registered (CUDA engines)
        self._mapped = None       # the same, once mapped into this process's context
        self._count = self._words[0]

    # ------------------------------------------------------------ the engine's side
    def map_device(self) -> None:
        """Map the page into this process's CUDA context (after CUDA init; once).  A hot standby
        does it before any fault, so that its take-over does not pay for it (the driver's
        bindings and the registration took ~30 ms on the H200)."""
        if self._mapped is not None:
            return
        from gpu_anchor.cuda_driver import check, driver
        drv = driver()
        addr = ctypes.addressof(ctypes.c_char.from_buffer(self.page))
        flags = drv.CU_MEMHOSTREGISTER_DEVICEMAP | drv.CU_MEMHOSTREGISTER_PORTABLE
        try:
            check("cuMemHostRegister", drv.cuMemHostRegister(addr, PAGE, flags))
        except Exception as e:
            if "ALREADY_REGISTERED" not in str(e):
                raise
        base = int(check("cuMemHostGetDevicePointer", drv.cuMemHostGetDevicePointer(addr, 0)))
        self._mapped = drv.CUdeviceptr(base + 4)          # the ``done`` word

    def register_device(self) -> None:
        """This engine marks its steps from its CUDA stream from now on (in the engine, after
        CUDA init; maps the page if ``map_device`` has not)."""
        self.map_device()
        self._dev = self._mapped
        self._count = self._words[0]
        self._words[1] = self._count
        self._words[2] = DEVICE

    def hold_writer(self, writer: int) -> None:
        """The calling thread is writer ``writer`` (0: the engine's main thread, 1: its commit
        thread) of the engine the supervisor armed last, until it dies."""
        if self.writers is None:
            return
        try:
            self.writers.hold(self.writers.current(), writer)
        except (OSError, ValueError) as e:    # unmarked: a successor waits for the lifeline instead
            import logging
            logging.getLogger("gpu_anchor.serve").warning("writer %d does not mark its liveness: %s", writer, e)

    def host_only(self) -> None:
        """A CPU engine: its steps queue no device work."""
        self._dev = None
        self._count = self._words[1] = self._words[0]
        self._words[2] = HOST

    def unmark(self) -> None:
        """From now on this page says nothing of the live engine (a successor waits for its exit)."""
        self._dev = None
        self._words[2] = UNMARKED

    def launching(self) -> None:
        """The next step's kernels are about to be enqueued."""
        self._count = (self._count + 1) & 0xFFFFFFFF
        self._words[0] = self._count

    def launched_all(self, stream_handle: int | None) -> None:
        """Every kernel of the step that writes shared memory is enqueued on ``stream_handle``
        (a ``cudaStream_t`` as an int; None on the CPU: nothing is queued, done now)."""
        if self._words[2] != DEVICE or self._dev is None or stream_handle is None:
            self._words[1] = self._count
            return
        from gpu_anchor.cuda_driver import check, driver
        drv = driver()
        check("cuStreamWriteValue32", drv.cuStreamWriteValue32(drv.CUstream(stream_handle), self._dev,
                                                               self._count, 0))

    # ------------------------------------------------------------ the successor's side
    def state(self) -> tuple[int, int]:
        return int(self._words[0]), int(self._words[1])

    def quiet(self) -> bool:
        """Once the engine's process is dead: can none of its work still write?  True when its
        last launched step's marker arrived, or when it queued no device work (a CPU engine);
        never for an engine that did not mark its steps."""
        mode = self._words[2]
        launched, done = self.state()
        return mode == HOST or (mode == DEVICE and launched == done)

    def quiesce(self, pid: int, timeout: float = 30.0, poll_s: float = 0.0002) -> str:
        """Wait until the dead engine ``pid`` can write no more: returns ``"fence"`` (its last
        step's marker arrived), ``"exit"`` (its process exited first: a zombie or reaped) or
        raises TimeoutError.  Call only once the process is known to be dying (its lifeline
        closed): a live engine launches new steps."""
        if self.quiet():
            return "fence"
        try:
            pidfd = os.pidfd_open(pid)
        except ProcessLookupError:
            return "exit"
        try:
            deadline = time.monotonic() + timeout
            while True:
                if self.quiet():
                    return "fence"
                if fdwait.readable([pidfd], poll_s):
                    return "exit"
                if time.monotonic() > deadline:
                    launched, done = self.state()
                    raise TimeoutError(f"engine {pid}: step {launched} still running after {timeout} s "
                                       f"(marker at {done}) and the process has not exited")
        finally:
            os.close(pidfd)
