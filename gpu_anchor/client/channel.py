"""A blocking request/reply channel to one daemon (torch-free)."""
from __future__ import annotations

import os
import socket
import threading

from gpu_anchor import errors, protocol
from gpu_anchor.paths import default_socket, normalize_device


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
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(timeout)
        try:
            sock.connect(self.path)
        except (FileNotFoundError, ConnectionRefusedError):
            sock.close()
            raise errors.DaemonUnavailable(start_hint(self.device, self.path)) from None
        except PermissionError:
            sock.close()
            raise errors.PermissionDenied(
                f"cannot reach {self.path}: it belongs to another user (you are uid {os.getuid()}). "
                "Each user runs their own daemons; set GPU_ANCHOR_SOCKET_DIR to a directory of yours.") from None
        self._sock = sock
        self.hello = self.request({"op": "hello", "pid": os.getpid()})[0]

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

    def close(self) -> None:
        try:
            self._sock.close()
        except OSError:
            pass
