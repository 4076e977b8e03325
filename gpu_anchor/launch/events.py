"""Worker → supervisor timing marks over a Unix datagram socket (torch-free).

A worker calls ``mark("bind")`` when it passes a milestone; the supervisor
stamps the restart it is measuring with it.  Sending never blocks and never
fails the worker: without a supervisor (``GPU_ANCHOR_EVENTS`` unset) or when
the socket is full, the mark is dropped.
"""
from __future__ import annotations

import json
import os
import socket
import time

ENV = "GPU_ANCHOR_EVENTS"
_sock: socket.socket | None = None
_sock_pid = -1


def mark(name: str, **fields) -> None:
    """Report that this worker reached ``name`` now (wall clock, comparable across processes)."""
    global _sock, _sock_pid
    path = os.environ.get(ENV)
    if not path:
        return
    if _sock is None or _sock_pid != os.getpid():
        _sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        _sock.setblocking(False)
        _sock_pid = os.getpid()
    msg = {"event": name, "t": time.time(), "pid": os.getpid(), "rank": int(os.environ.get("RANK", "0")),
           "generation": int(os.environ.get("GPU_ANCHOR_RESTART_COUNT", "0")), **fields}
    try:
        _sock.sendto(json.dumps(msg).encode(), path)
    except OSError:
        pass


class Receiver:
    """The supervisor's end: ``drain()`` returns the marks received so far."""

    def __init__(self, path: str) -> None:
        self.path = path
        if os.path.exists(path):
            os.unlink(path)
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(path)
        self.sock.setblocking(False)

    def fileno(self) -> int:
        return self.sock.fileno()

    def drain(self) -> list[dict]:
        out = []
        while True:
            try:
                data = self.sock.recv(65536)
            except (BlockingIOError, InterruptedError):
                return out
            try:
                out.append(json.loads(data))
            except ValueError:
                continue

    def close(self) -> None:
        self.sock.close()
        try:
            os.unlink(self.path)
        except OSError:
            pass
