"""Has every writer thread of a SIGKILLed process stopped?  Known ~0.3 ms after the kill.

A killed process leaves user space at once, but the kernel closes its descriptors only after
it has unmapped its whole address space (``exit_mm`` before ``exit_files``): ~80 ms per GiB
of resident memory here, 50–80 ms for a serving engine on the H200 — so a pipe's end of file
(the engine's lifeline) comes late.  Robust futexes come early: each exiting thread releases
the robust mutexes it holds (marking them *owner died*) at the very start of ``exit_mm``,
before any unmapping (``tests/test_liveness.py`` measures both).

``Liveness`` is one shared anonymous page (``MAP_SHARED``, made before the fork, so the
supervisor, the engines and the standbys see the same page) of ``SLOTS`` slots.  A slot is
``WRITERS`` process-shared robust mutexes, one per thread that may change shared state (an
engine: its main thread — the KV cache through its stream, the journal at start-up — and its
commit thread), each followed by the tid that holds it:

- the supervisor ``arm()`` s a fresh slot (it becomes ``current()``) before it starts or
  hands over to the process;
- each writer thread of that process calls ``hold(slot, writer)`` before it writes anything
  shared, and before the process says it is ready, and holds it until it dies;
- a watcher thread of the supervisor calls ``writers_gone(slot)`` once the process is ready:
  it returns once, for each writer's mutex, ``pthread_mutex_lock`` returned ``EOWNERDEAD``
  (or False at once if a writer did not take its mutex: nothing is known then).

**Invariant:** once ``writers_gone`` returned, no thread that held a mutex of the slot executes
another instruction: whatever it sent on a socket is already in the receiver's queue (a
daemon can handle all of it now: ``drain``), whatever it queued on a GPU stream is for the
step fence to say.  A process whose writer threads exit cleanly also releases them (so the
signal means "its writers are gone", never more).  Only SIGKILL-like deaths matter here: a
thread that exits on its own first also ends its writes.

Torch-free; glibc (``pthread_mutex_*``) through ctypes.  A process that cannot use it (no
glibc robust mutexes) gets ``available() == False``: its supervisor waits for the lifeline.
"""
from __future__ import annotations

import ctypes
import errno
import mmap
import os
import threading

PAGE = 4096
MUTEX = 40                   # sizeof(pthread_mutex_t), x86-64 and aarch64 glibc
ENTRY = 64                   # a mutex and its holder's tid (int32 at +48), cache-line apart
WRITERS = 2                  # an engine's main thread and its commit thread
HEADER = PAGE - ENTRY        # the last entry's place holds the slot armed last (int32)
SLOTS = HEADER // (ENTRY * WRITERS)
_TID = 48
_lib = None


def _libc():
    global _lib
    if _lib is None:
        lib = ctypes.CDLL(None, use_errno=True)
        for name in ("pthread_mutexattr_init", "pthread_mutexattr_setpshared", "pthread_mutexattr_setrobust",
                     "pthread_mutex_init", "pthread_mutex_lock", "pthread_mutex_unlock", "pthread_mutex_consistent"):
            getattr(lib, name).restype = ctypes.c_int
        _lib = lib
    return _lib


def available() -> bool:
    """glibc's process-shared robust mutexes are there (Linux with glibc)."""
    try:
        _libc().pthread_mutexattr_setrobust
        return True
    except (OSError, AttributeError):
        return False


class Liveness:
    def __init__(self, page: mmap.mmap | None = None) -> None:
        self.page = page if page is not None else mmap.mmap(-1, PAGE)
        self._base = ctypes.addressof(ctypes.c_char.from_buffer(self.page))
        self._next = 0

    def _entry(self, slot: int, writer: int) -> int:
        if not (0 <= slot < SLOTS and 0 <= writer < WRITERS):
            raise ValueError(f"slot {slot} / writer {writer} out of range ({SLOTS} x {WRITERS})")
        return self._base + (slot * WRITERS + writer) * ENTRY

    def _tid(self, slot: int, writer: int) -> ctypes.c_int32:
        return ctypes.c_int32.from_address(self._entry(slot, writer) + _TID)

    # ------------------------------------------------------------ the supervisor
    def arm(self) -> int:
        """A fresh slot for the next process (its mutexes initialised, unheld), which becomes
        ``current()`` — what that process takes (``hold``).  Slots are reused round-robin, one
        every ``SLOTS`` processes, long after their watchers returned."""
        slot, self._next = self._next, (self._next + 1) % SLOTS
        lib = _libc()
        attr = ctypes.create_string_buffer(16)
        for call, args in (("pthread_mutexattr_init", ()), ("pthread_mutexattr_setpshared", (1,)),
                           ("pthread_mutexattr_setrobust", (1,))):
            if getattr(lib, call)(attr, *args):
                raise OSError(f"{call} failed")
        for w in range(WRITERS):
            ctypes.memset(self._entry(slot, w), 0, ENTRY)
            if lib.pthread_mutex_init(ctypes.c_void_p(self._entry(slot, w)), attr):
                raise OSError("pthread_mutex_init failed")
        ctypes.c_int32.from_address(self._base + HEADER).value = slot
        return slot

    def current(self) -> int:
        return ctypes.c_int32.from_address(self._base + HEADER).value

    def held(self, slot: int) -> bool:
        """Every writer of ``slot`` took its mutex (the process marks its writers)."""
        return all(self._tid(slot, w).value for w in range(WRITERS))

    def writers_gone(self, slot: int) -> bool:
        """Block until every writer of ``slot`` is dead (the module's invariant) and return True;
        False at once if some writer has not taken its mutex: then nothing is known (wait for the
        process's lifeline instead).  The watched process takes every mutex before it says it is
        ready; call this after that."""
        return self.wait_writers(slot) is not None

    def wait_writers(self, slot: int) -> str | None:
        """``writers_gone``, saying how: ``"died"`` if some writer ended holding its mutex (killed,
        or the process exited without ``release``), ``"released"`` if every writer let go of its
        own (a clean end), None at once if some writer has not taken its mutex."""
        if not self.held(slot):
            return None
        lib = _libc()
        how = "released"
        for w in range(WRITERS):
            m = ctypes.c_void_p(self._entry(slot, w))
            rc = lib.pthread_mutex_lock(m)
            if rc == errno.EOWNERDEAD:
                lib.pthread_mutex_consistent(m)
                how = "died"
            elif rc:
                raise OSError(rc, f"pthread_mutex_lock: {os.strerror(rc)}")
            lib.pthread_mutex_unlock(m)
        return how

    # ------------------------------------------------------------ the watched process
    def hold(self, slot: int, writer: int) -> None:
        """The calling thread holds writer ``writer``'s mutex of ``slot`` until it dies."""
        m = ctypes.c_void_p(self._entry(slot, writer))
        rc = _libc().pthread_mutex_lock(m)
        if rc == errno.EOWNERDEAD:          # never blocks on a dead holder
            _libc().pthread_mutex_consistent(m)
        elif rc:
            raise OSError(rc, f"pthread_mutex_lock: {os.strerror(rc)}")
        self._tid(slot, writer).value = threading.get_native_id()

    def release(self, slot: int, writer: int) -> None:
        """The calling thread, which ``hold`` s the mutex, lets go of it: its writes are over (a
        clean end; the watcher's ``wait_writers`` then says ``"released"``)."""
        rc = _libc().pthread_mutex_unlock(ctypes.c_void_p(self._entry(slot, writer)))
        if rc:
            raise OSError(rc, f"pthread_mutex_unlock: {os.strerror(rc)}")


def shared_file(path: str, create: bool = False) -> mmap.mmap:
    """A page for ``Liveness`` that processes which do not share a fork ancestor map by path
    (``gpu-anchor run``'s workers are forked by its fork server, a process of its own)."""
    fd = os.open(path, (os.O_RDWR | os.O_CREAT | os.O_TRUNC) if create else os.O_RDWR, 0o600)
    try:
        if create:
            os.ftruncate(fd, PAGE)
        return mmap.mmap(fd, PAGE, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
    finally:
        os.close(fd)
