"""The host's copies of the served LoRA adapters' tensors, and reading them again ahead of need.

``--max-cpu-loras N`` (vLLM's) bounds the adapters whose tensors the host keeps: the ``N`` used
last (an LRU); a parked adapter beyond them is *on disk*, known by its path and the digest it was
served with (``lora_slots.Adapters.served``).  Before a step puts such an adapter in a slot its
files must be read again (``fetch``), and it is served only if they still hold the tensors of
that digest.

Reading in the step would stall every stream of the batch for as long as the files take (on one
H100's host, 165 to 340 ms for an 8B model's rank-16 adapter of 87 MB from the page cache, most of
it the digest: ``bench lora_reads``; more from a network disk).  So the scheduler admits a
waiting request whose adapter is on disk only once its files are read (``ready``), which starts
reading them on a thread of their own the first time it is asked; the request is held meanwhile,
and the others pass it as they pass a request whose adapter finds no slot
(``Scheduler.lora_pass_window``).  The contract:

- **Bounded.**  One read at a time; a read's tensors join the LRU only through ``fetch`` or
  ``ready`` on the engine's thread, so the host holds at most ``capacity`` adapters plus the one
  being read.
- **Never other tensors.**  A read's tensors are used only if their digest is the one the name
  is served with *when they are used* (an adapter replaced or unloaded meanwhile drops them).
  A read that failed, or whose tensors are not those the adapter is served with (files replaced
  with ``load_inplace`` while it ran), is not trusted: ``fetch`` reads the files once more itself
  and reports what that read finds.
- **The step waits only for what it must.**  A request that became running before its adapter
  was read (a restored one, say) makes ``fetch`` wait for the read under way or read the files
  itself; ``stats["wait_s"]`` is the time steps spent so, ``stats["read_s"]`` that of every read
  wherever it ran.
"""
from __future__ import annotations

import threading
import time

from .lora import Adapter, describe_failure


def _read(reader, name: str, path: str) -> tuple[Adapter | None, Exception | None, float]:
    """``(adapter, None, seconds)``, or ``(None, why, seconds)`` for files gone or unreadable."""
    t0 = time.perf_counter()
    try:
        return reader(name, path), None, time.perf_counter() - t0
    except Exception as e:
        return None, e, time.perf_counter() - t0


class _Read:
    """One adapter's files read on a daemon thread (an unanswering network disk must not hold
    the process at exit); ``done`` is set once ``adapter`` (None: the read failed) and
    ``seconds`` are."""

    def __init__(self, name: str, path: str, reader) -> None:
        self.name, self.path = name, path
        self.adapter: Adapter | None = None
        self.seconds = 0.0
        self.done = threading.Event()
        threading.Thread(target=self._run, args=(reader,), name=f"lora-read-{name}", daemon=True).start()

    def _run(self, reader) -> None:
        self.adapter, _, self.seconds = _read(reader, self.name, self.path)
        self.done.set()


class HostCopies:
    """``capacity`` adapters' tensors, least recently used first (None: no bound, nothing is
    ever dropped or read again); ``reader(name, path)``: an adapter as ``lora.read`` gives it;
    ``served``: name -> (path, digest, loaded while serving), the engine's (``Adapters.served``).
    Behaves as a read-only mapping name -> ``Adapter`` of the copies held."""

    def __init__(self, capacity: int | None, reader, served: dict) -> None:
        self.capacity, self._reader, self._served = capacity, reader, served
        self._copies: dict[str, Adapter] = {}
        self._ahead: _Read | None = None
        self.stats = {"reads": 0, "read_ahead": 0, "read_s": 0.0, "wait_s": 0.0}

    def __contains__(self, name) -> bool:
        return name in self._copies

    def __getitem__(self, name: str) -> Adapter:
        return self._copies[name]

    def __iter__(self):
        return iter(self._copies)

    def __len__(self) -> int:
        return len(self._copies)

    def hold(self, adapter: Adapter, keep=()) -> None:
        """Keep ``adapter``'s tensors as the most recently used, then drop the least recently
        used others beyond ``capacity`` (never one of ``keep``)."""
        self._copies.pop(adapter.name, None)
        self._copies[adapter.name] = adapter
        if self.capacity is None:
            return
        for name in [n for n in self._copies if n != adapter.name and n not in keep]:
            if len(self._copies) <= self.capacity:
                break
            del self._copies[name]

    def drop(self, name: str) -> None:
        self._copies.pop(name, None)

    def _current(self, read: _Read) -> bool:
        """Whether ``read``'s tensors are those its name is served with now."""
        served = self._served.get(read.name)
        return (read.adapter is not None and served is not None and served[0] == read.path
                and served[1] == read.adapter.digest)

    def ready(self, name: str) -> bool:
        """Whether a step can put ``name`` in a slot without waiting for its files: its tensors
        are held, or their read ended (well or not: ``fetch`` tells which).  Otherwise starts
        reading them, unless another read is under way, and returns False."""
        if self.capacity is None or name in self._copies or name not in self._served:
            return True
        r = self._ahead
        if r is not None and r.name == name and r.path == self._served[name][0]:
            return r.done.is_set()
        if r is not None and not r.done.is_set():
            return False                       # one read at a time: this one waits its turn
        if r is not None:
            self.stats["read_s"] += r.seconds
            if self._current(r):
                self.stats["reads"] += 1
                self.hold(r.adapter)           # read for a request gone since: an LRU entry like another
        self._ahead = _Read(name, self._served[name][0], self._reader)
        self.stats["read_ahead"] += 1
        return False

    def wait(self, timeout: float) -> None:
        """Wait up to ``timeout`` s for the read under way (an engine with nothing else to run)."""
        if self._ahead is not None:
            self._ahead.done.wait(timeout)

    def fetch(self, names, keep=()) -> dict[str, str]:
        """Make the tensors of each of ``names`` (served adapters a step puts in a slot) held,
        reading again from its files those the host dropped, with the read under way for it if
        there is one; never dropping one of ``keep``.  Returns ``{name: why it cannot be
        served}`` for those whose files could not be read or no longer hold the tensors it was
        served with (the files changed): the step must not run their requests."""
        failed = {}
        for n in names:
            if n in self._copies:
                continue
            path, digest, _ = self._served[n]
            t0 = time.perf_counter()
            adapter = error = None
            r = self._ahead
            if r is not None and r.name == n and r.path == path:
                self._ahead = None
                r.done.wait()
                adapter = r.adapter
                self.stats["read_s"] += r.seconds
            if adapter is None or adapter.digest != digest:    # none under way, failed or stale: this step reads
                adapter, error, seconds = _read(self._reader, n, path)
                self.stats["read_s"] += seconds
            self.stats["wait_s"] += time.perf_counter() - t0
            if adapter is None:
                failed[n] = describe_failure(n, error)
            elif adapter.digest != digest:
                failed[n] = (f"LoRA adapter {n!r}: its tensors at {path} are not the ones it was served with "
                             f"(digest {adapter.digest[:12]}, served {digest[:12]}): the files changed while it "
                             "waited on disk; load it again (load_inplace) or restart the server with them")
            else:
                self.stats["reads"] += 1
                self.hold(adapter, keep=keep)
        return failed
