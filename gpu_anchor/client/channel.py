"""A blocking request/reply channel to one daemon (torch-free)."""
from __future__ import annotations

import os
import random
import socket
import threading
import time

from gpu_anchor import errors, fdwait, protocol
from gpu_anchor.paths import daemon_alive, default_socket, normalize_device

# Pauses between connect attempts: doubling from the first to the last, with jitter so that
# a storm of clients does not come back in lock step.
CONNECT_BACKOFF = (0.001, 0.1)


def resolve_socket(device: str, socket_path: str | None = None) -> str:
    """Explicit path, then ``GPU_ANCHOR_SOCKET``, then the per-user default for ``device``."""
    return socket_path or os.environ.get("GPU_ANCHOR_SOCKET") or default_socket(device)


def start_hint(device: str, path: str) -> str:
    sock = "" if path == default_socket(device) else f" --socket {path}"
    return (f"no gpu-anchor daemon answers at {path}. Start one with:\n"
            f"    gpu-anchor daemon --device {device}{sock} --detach\n"
            f"or run your job under `gpu-anchor run`, which starts the daemons it needs.")


class Channel:
    """One connection; requests are serialised by a lock (one in flight at a time)."""

    def __init__(self, device: str, socket_path: str | None = None, timeout: float | None = 60.0) -> None:
        self.device = normalize_device(device)
        self.path = resolve_socket(self.device, socket_path)
        self._lock = threading.Lock()
        self.pid = os.getpid()
        self.connect_retries = 0
        sock = self._connect(timeout)
        sock.settimeout(timeout)
        self._sock = sock
        self.hello = self.request({"op": "hello", "pid": os.getpid()})[0]

    def _connect(self, timeout: float | None) -> socket.socket:
        """Connect, retrying while the daemon's accept queue is full (EAGAIN: a non-blocking
        Unix connect never waits) or while a daemon that holds the socket's lock is still
        starting, until ``timeout``; no daemon at all fails at once."""
        deadline = None if timeout is None else time.monotonic() + timeout
        pause = CONNECT_BACKOFF[0]
        while True:
            try:
                return self._attempt()
            except BlockingIOError:
                why = "its queue of connections waiting to be accepted stayed full"
            except (FileNotFoundError, ConnectionRefusedError):
                if not daemon_alive(self.path):
                    raise errors.DaemonUnavailable(start_hint(self.device, self.path)) from None
                why = "it holds its lock but is not listening"
            except PermissionError:
                raise errors.PermissionDenied(
                    f"cannot reach {self.path}: it belongs to another user (you are uid {os.getuid()}). "
                    "Each user runs their own daemons; set GPU_ANCHOR_SOCKET_DIR to a directory of yours.") from None
            except OSError as e:
                raise errors.DaemonUnavailable(f"cannot connect to {self.path}: {e}") from None
            if deadline is not None and time.monotonic() + pause > deadline:
                raise errors.DaemonUnavailable(
                    f"the gpu-anchor daemon at {self.path} accepted no connection within {timeout:g} s "
                    f"({self.connect_retries + 1} attempts): {why}. It may be overloaded or stuck: see "
                    "`gpu-anchor status` and its log; or pass a longer timeout")
            self.connect_retries += 1
            time.sleep(pause * random.uniform(0.5, 1.0))
            pause = min(2 * pause, CONNECT_BACKOFF[1])

    def _attempt(self) -> socket.socket:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.setblocking(False)
            sock.connect(self.path)
            return sock
        except BaseException:
            sock.close()
            raise

    def request(self, header: dict, blob: bytes = b"") -> tuple[dict, bytes, list[int]]:
        with self._lock:
            try:
                try:
                    protocol.send_frame(self._sock, header, blob)
                except (BrokenPipeError, ConnectionResetError):
                    pass  # the daemon may have said why before closing (a refusal): read it
                reply, out_blob, fds = protocol.recv_frame(self._sock)
            except (ConnectionError, BrokenPipeError, socket.timeout, OSError) as e:
                raise errors.DaemonUnavailable(
                    f"lost the gpu-anchor daemon at {self.path} ({e}); anchored memory already mapped stays usable, "
                    "but nothing new can be bound until a daemon answers") from None
        if not reply.get("ok"):
            protocol.close_fds(fds)
            raise errors.from_reply(reply.get("error", {}))
        return reply, out_blob, fds

    def peer_closed(self) -> bool:
        """True once the daemon's end of this idle connection is closed: the daemon process is
        gone (the kernel closes its sockets at its death), whatever its socket path holds now.
        Never blocks; only for a connection with no request in flight."""
        with self._lock:
            try:
                if not fdwait.readable([self._sock], 0):
                    return False
                return self._sock.recv(1, socket.MSG_PEEK) == b""
            except OSError:
                return True

    def close(self) -> None:
        try:
            self._sock.close()
        except OSError:
            pass
