"""Waiting until file descriptors are readable, whatever their numbers, and the descriptor limit.

``select.select`` refuses a descriptor numbered ``FD_SETSIZE`` (1024) or more (``ValueError:
filedescriptor out of range in select()``).  A process that anchors many objects holds many
descriptors (the host backend keeps one per segment: a model with its gradients and Adam state
is over a thousand objects), so a socket, pipe or pidfd it opens later is numbered above 1024,
and every ``select`` on it failed: the client's check of its daemon connection, a serving
engine's wait for its frontend, a takeover's wait for the dead engine.  ``poll`` has no limit.
"""
from __future__ import annotations

import resource
import select
import time

_EVENTS = select.POLLIN | select.POLLPRI | select.POLLHUP | select.POLLERR


def readable(fds, timeout: float | None = None) -> list:
    """Those of ``fds`` (descriptors, or objects with ``fileno()``) that are readable, or whose
    peer hung up, within ``timeout`` seconds (None: wait for one), in the order given.  ``poll``
    counts whole milliseconds, so a shorter positive timeout polls, sleeps it and polls again."""
    poller = select.poll()
    by_fd: dict[int, list] = {}
    for f in fds:
        fd = f if isinstance(f, int) else f.fileno()
        if fd not in by_fd:
            poller.register(fd, _EVENTS)
        by_fd.setdefault(fd, []).append(f)
    if timeout is not None and 0 < timeout < 0.001:
        ready = poller.poll(0)
        if not ready:
            time.sleep(timeout)
            ready = poller.poll(0)
    else:
        ready = poller.poll(None if timeout is None else max(0, int(timeout * 1000 + 0.999)))
    hit = {fd for fd, _ in ready}
    return [f for fd, group in by_fd.items() if fd in hit for f in group]


def raise_descriptor_limit(cap: int = 1 << 16) -> str | None:
    """Take the hard descriptor limit as the soft one (at most ``cap``): every anchored segment
    and connection holds a descriptor, and a soft limit of 1024 (a common default) would fail
    the thousandth.  Returns why it could not, or None."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = cap if hard == resource.RLIM_INFINITY else min(hard, cap)
    if soft == resource.RLIM_INFINITY or soft >= want:
        return None
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
    except (ValueError, OSError) as e:
        return f"the descriptor limit stays at {soft}: {e}"
    return None
