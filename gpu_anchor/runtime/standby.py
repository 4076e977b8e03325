"""A standby process: forked ahead of need, its start-up done, waiting for "go" (torch-free).

    sb = Standby(prepare=lambda: warm_cuda("cuda:0"), run=lambda go: serve(go))
    ...                                  # the active worker dies
    pid = sb.go({"started": time.time()})   # the standby becomes the worker at once
    sb = Standby(...)                    # and a new standby is made (later, off the critical path)

The child (``runtime.fork``: same fork rules, death signal, faulthandler, exit path) runs
``prepare`` right after the fork — work that touches no state the active worker owns: a CUDA
context, cuBLAS warmed on scratch tensors, a user's pre-warm function — reports what it
returned, then blocks on a pipe.  ``go(msg)`` sends ``msg`` (a JSON object: what is only
known at take-over, e.g. placement, fault plan, start time) and the child calls
``run(msg)``; its exit status is ``exit_path``'s.  If the parent dies, the pipe closes and
the standby exits (and the death signal kills it).  This is the one standby of the project:
the fork server's per-rank pool, ``gpu-anchor serve --warm-pool`` and the benchmarks'
baselines all use it.

``wait_exit`` waits for a child's death with a pidfd when the kernel has them, so a death is
seen the moment it happens, not at the next poll.
"""
from __future__ import annotations

import json
import logging
import os
import signal
import time

from gpu_anchor import fdwait

from .fork import fork

log = logging.getLogger("gpu_anchor.runtime")


IDLE_EVERY = 1.0      # seconds between a waiting standby's ``idle`` calls


class Standby:
    def __init__(self, prepare, run, idle=None, **fork_options) -> None:
        """``idle``: called in the child about every ``IDLE_EVERY`` seconds while it waits for
        "go" (work that keeps it current with the active worker; best effort: an exception is
        logged and the wait goes on)."""
        go_r, go_w = os.pipe()
        ready_r, ready_w = os.pipe()
        self.forked_at = time.time()

        caller_before = fork_options.pop("before_main", None)

        def close_parent_ends() -> None:
            os.close(go_w)
            os.close(ready_r)
            if caller_before is not None:
                caller_before()

        try:
            pid = fork(lambda: _child(prepare, run, go_r, ready_w, idle), before_main=close_parent_ends, **fork_options)
        except BaseException:
            for fd in (go_r, go_w, ready_r, ready_w):
                os.close(fd)
            raise
        os.close(go_r)
        os.close(ready_w)
        self.pid, self._go_w, self._ready_r = pid, go_w, ready_r
        self.info: dict | None = None
        self.used = False

    def ready(self, timeout: float = 0.0) -> bool:
        """True once the child finished ``prepare`` (``info`` holds what it reported)."""
        if self.info is None and fdwait.readable([self._ready_r], timeout):
            data = os.read(self._ready_r, 1 << 16)
            self.info = json.loads(data) if data else {"failed": "the standby died while preparing"}
        return self.info is not None and "failed" not in self.info

    def go(self, msg: dict) -> int:
        """Hand the work over; returns the child's pid (now the active worker)."""
        os.write(self._go_w, json.dumps(msg).encode())
        os.close(self._go_w)
        os.close(self._ready_r)
        self.used = True
        return self.pid

    def close(self) -> None:
        """Dismiss an unused standby (kill and reap it)."""
        if self.used:
            return
        self.used = True
        for fd in (self._go_w, self._ready_r):
            try:
                os.close(fd)
            except OSError:
                pass
        try:
            os.kill(self.pid, signal.SIGKILL)
            os.waitpid(self.pid, 0)
        except (ProcessLookupError, ChildProcessError):
            pass


def _child(prepare, run, go_r: int, ready_w: int, idle=None):
    try:
        t0 = time.time()
        info = dict(prepare() or {}, prepare_s=time.time() - t0, pid=os.getpid())
    except BaseException as e:
        os.write(ready_w, json.dumps({"failed": f"{type(e).__name__}: {e}"}).encode())
        raise
    os.write(ready_w, json.dumps(info).encode())
    os.close(ready_w)
    while idle is not None and not fdwait.readable([go_r], IDLE_EVERY):
        try:
            idle()
        except Exception:       # noqa: BLE001 — keeping current is an optimisation; the take-over redoes it
            log.exception("standby %d: its idle work failed", os.getpid())
    data = b""
    while True:             # the message arrives whole or not at all (one write, then close)
        chunk = os.read(go_r, 1 << 16)
        if not chunk:
            break
        data += chunk
    if not data:
        return None         # dismissed, or the parent is gone: exit 0
    return run(json.loads(data))


def wait_exit(pid: int, timeout: float) -> tuple[int, int] | None:
    """``os.waitpid(pid)`` result if ``pid`` exits within ``timeout`` seconds, else None.
    Sleeps on a pidfd (woken at the exit) where available, else polls every 20 ms."""
    return wait_any([pid], timeout)


def wait_any(pids, timeout: float) -> tuple[int, int] | None:
    """``(pid, status)`` of the first of ``pids`` to exit within ``timeout`` seconds (the
    lowest-listed one if several already have), else None.  Woken at the exit by pidfds
    where the kernel has them, else polls every 20 ms."""
    def reap():
        for p in pids:
            r = os.waitpid(p, os.WNOHANG)
            if r[0] != 0:
                return r
        return None
    r = reap()
    if r is not None:
        return r
    fds = []
    if hasattr(os, "pidfd_open"):
        for p in pids:
            try:
                fds.append(os.pidfd_open(p))
            except OSError:
                break
    if fds and len(fds) == len(pids):
        try:
            fdwait.readable(fds, timeout)
        finally:
            for fd in fds:
                os.close(fd)
        return reap()
    for fd in fds:
        os.close(fd)
    time.sleep(min(timeout, 0.02))
    return reap()
