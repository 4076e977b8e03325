"""The per-device daemon: one process, one thread, a Unix socket (torch-free).

State machine of a connection::

    ACCEPTED --peer uid != ours--> REFUSED (error frame, closed)
    ACCEPTED --peer uid ok--> SERVING
    SERVING --valid frame--> handle op, reply, SERVING
    SERVING --bad request (valid frame, bad fields)--> error reply, SERVING
    SERVING --framing error (bad magic, oversize)--> error reply, CLOSED
    SERVING --peer closed / died--> CLOSED   (frees nothing: anchored state outlives sessions)
    SERVING --await_gone(pid) while pid has connections--> WAITING (no reply yet)
    WAITING --pid's last connection CLOSED--> reply, SERVING
    SERVING --drain(pid)--> every whole frame pid's connections hold is handled now, reply, SERVING

The daemon trusts nothing a client sends: every field is validated before use,
descriptors sent by clients are closed unread, and a handler that raises turns
into an error reply.  It runs no user code, no kernels, and holds no CUDA
context.  See docs/daemon.md.
"""
from __future__ import annotations

import errno
import fcntl
import logging
import os
import secrets
import selectors
import signal
import socket
import struct
import time
from collections import deque

from gpu_anchor import fdwait, protocol
from gpu_anchor.errors import BadRequest
from gpu_anchor.paths import ensure_private_dir, lock_path, process_identity

from .arena import Arena
from .backends import open_backend
from .journal import JournalError, VersionMismatch
from .operations import Operations
from .registry import ConflictError, OutOfMemory, Registry

log = logging.getLogger("gpu_anchor.daemon")

MAX_CONNECTIONS = 1024
# Connections the kernel queues before accept: a job's ranks, a supervisor's warm pool and a
# restart storm all connect at once.  The kernel caps it at net.core.somaxconn (4096 on
# Linux >= 5.4, 128 before); past that, clients retry with backoff (client/channel.py).
LISTEN_BACKLOG = 4096
ACCEPTS_PER_WAKEUP = 64    # drain the queue in bursts without starving established peers
MAX_PENDING_REPLY = 64 << 20  # a peer that does not read its replies stops being read
_PEERCRED = struct.Struct("3i")


class _Conn:
    __slots__ = ("sock", "uid", "pid", "inbuf", "outq", "outbytes", "closing")

    def __init__(self, sock: socket.socket, pid: int, uid: int) -> None:
        self.sock, self.pid, self.uid = sock, pid, uid
        self.inbuf = bytearray()
        self.outq: deque[tuple[memoryview, list[int]]] = deque()
        self.outbytes = 0
        self.closing = False


class Daemon(Operations):
    def __init__(self, device: str, socket_path: str, backend=None) -> None:
        self.device = device
        self.socket_path = socket_path
        self.backend = backend or open_backend(device)
        self.arena = Arena(self.backend.create, self.backend.release, self.backend.granularity)
        self.registry = Registry(self.arena)
        self.instance = secrets.token_hex(8)
        self.started = time.time()
        self.uid = os.getuid()
        self._sel = selectors.DefaultSelector()
        self._conns: dict[int, _Conn] = {}
        self._running = False
        self._listener: socket.socket | None = None
        self._listening = False   # False while accept is paused for lack of descriptors
        self._lock_fd: int | None = None
        self.requests = 0
        self._gone_waiters: dict[int, list[_Conn]] = {}   # pid -> connections awaiting its departure

    # ---------------------------------------------------------------- lifecycle
    def bind_socket(self) -> None:
        ensure_private_dir(os.path.dirname(self.socket_path) or ".")
        self._lock_fd = os.open(lock_path(self.socket_path), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(self._lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            raise RuntimeError(f"a daemon for {self.device} is already running at {self.socket_path}") from None
        os.ftruncate(self._lock_fd, 0)   # who holds it: clients wait for a daemon that is starting
        os.pwrite(self._lock_fd, (process_identity(os.getpid()) or "").encode(), 0)
        if os.path.exists(self.socket_path):
            os.unlink(self.socket_path)  # stale: whoever made it no longer holds the lock
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        old = os.umask(0o077)
        try:
            sock.bind(self.socket_path)
        finally:
            os.umask(old)
        sock.listen(LISTEN_BACKLOG)
        sock.setblocking(False)
        self._listener = sock
        self._sel.register(sock, selectors.EVENT_READ, None)
        self._listening = True

    def serve_forever(self) -> None:
        if self._listener is None:
            self.bind_socket()
        self._running = True
        signal.signal(signal.SIGTERM, lambda *_: self.stop())
        signal.signal(signal.SIGINT, lambda *_: self.stop())
        log.info("serving %s at %s (instance %s)", self.device, self.socket_path, self.instance)
        try:
            while self._running:
                for key, events in self._sel.select(timeout=1.0):
                    if key.data is None:
                        self._accept()
                    else:
                        conn = key.data
                        try:
                            if events & selectors.EVENT_READ:
                                self._on_readable(conn)
                            if events & selectors.EVENT_WRITE and conn.sock.fileno() >= 0:
                                self._flush(conn)
                                if conn.sock.fileno() >= 0 and conn.outbytes < MAX_PENDING_REPLY:
                                    self._on_buffered(conn)  # frames held back while replies were backlogged
                        except Exception:  # never let one connection take the daemon down
                            log.exception("connection from pid %s failed; dropping it", conn.pid)
                            self._close(conn)
        finally:
            self._shutdown()

    def stop(self) -> None:
        self._running = False

    def _shutdown(self) -> None:
        for conn in list(self._conns.values()):
            self._close(conn)
        if self._listener is not None:
            if self._listening:
                self._sel.unregister(self._listener)
            self._listener.close()
            self._listener = None
            try:
                os.unlink(self.socket_path)
            except FileNotFoundError:
                pass
        self.arena.release_all()
        if self._lock_fd is not None:
            os.close(self._lock_fd)
        log.info("stopped")

    # ---------------------------------------------------------------- connections
    def _accept(self) -> None:
        for _ in range(ACCEPTS_PER_WAKEUP):
            try:
                sock, _ = self._listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as e:
                if e.errno not in (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM):
                    log.warning("accept failed: %s", e)   # e.g. the peer gave up already
                    return
                # Out of descriptors: leave the rest queued (their clients wait and retry) and
                # stop polling the listener, or it would wake us in a busy loop; the next close resumes.
                log.warning("cannot accept more connections (%s, %d open); pausing accept", e, len(self._conns))
                self._sel.unregister(self._listener)
                self._listening = False
                return
            self._admit(sock)

    def _admit(self, sock: socket.socket) -> None:
        pid, uid, _ = _PEERCRED.unpack(sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _PEERCRED.size))
        if uid != self.uid or len(self._conns) >= MAX_CONNECTIONS:
            why = (f"refused: this gpu-anchor daemon belongs to uid {self.uid}; you are uid {uid}"
                   if uid != self.uid else f"refused: {MAX_CONNECTIONS} connections already open")
            log.warning("%s (pid %d)", why, pid)
            try:
                sock.settimeout(0.5)
                protocol.send_frame(sock, {"ok": False, "error": {"code": "permission", "message": why}})
            except OSError:
                pass
            sock.close()
            return
        sock.setblocking(False)
        conn = _Conn(sock, pid, uid)
        self._conns[sock.fileno()] = conn
        self._sel.register(sock, selectors.EVENT_READ, conn)

    def _close(self, conn: _Conn) -> None:
        fd = conn.sock.fileno()
        if fd >= 0:
            self._conns.pop(fd, None)
            try:
                self._sel.unregister(conn.sock)
            except (KeyError, ValueError):
                pass
        for _, fds in conn.outq:
            protocol.close_fds(fds)
        conn.outq.clear()
        conn.sock.close()
        for waiters in self._gone_waiters.values():
            if conn in waiters:
                waiters.remove(conn)
        if conn.pid in self._gone_waiters and not any(c.pid == conn.pid for c in self._conns.values()):
            for w in self._gone_waiters.pop(conn.pid):
                if w.sock.fileno() >= 0:
                    self._queue(w, {"ok": True, "pid": conn.pid})
                    self._flush(w)
        if not self._listening and self._listener is not None:
            self._sel.register(self._listener, selectors.EVENT_READ, None)
            self._listening = True

    def _on_readable(self, conn: _Conn) -> None:
        try:
            data, anc, _, _ = conn.sock.recvmsg(1 << 20, socket.CMSG_SPACE(protocol.MAX_FDS_PER_FRAME * 4))
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            self._close(conn)
            return
        protocol.close_fds(protocol.fds_from_ancillary(anc))  # clients never send descriptors
        if not data:
            self._close(conn)
            return
        conn.inbuf += data
        self._on_buffered(conn)

    def _on_buffered(self, conn: _Conn) -> None:
        """Handle every complete frame in the input buffer, unless replies are backlogged."""
        while not conn.closing and conn.outbytes < MAX_PENDING_REPLY:
            if len(conn.inbuf) < protocol.PREFIX.size:
                break
            try:
                hlen, blen = protocol.parse_prefix(bytes(conn.inbuf[: protocol.PREFIX.size]))
            except protocol.ProtocolError as e:
                self._reply_error(conn, "protocol", str(e))
                conn.closing = True
                break
            total = protocol.PREFIX.size + hlen + blen
            if len(conn.inbuf) < total:
                break
            raw = bytes(conn.inbuf[protocol.PREFIX.size: total])
            del conn.inbuf[:total]
            self._handle_frame(conn, raw[:hlen], raw[hlen:])
        if conn.sock.fileno() >= 0:
            self._flush(conn)

    def _queue(self, conn: _Conn, header: dict, blob: bytes = b"", fds: list[int] = ()) -> None:
        header["nfds"] = len(fds)
        frame = protocol.encode(header, blob)
        conn.outq.append((memoryview(frame), list(fds)))
        conn.outbytes += len(frame)

    def _reply_error(self, conn: _Conn, code: str, message: str, **extra) -> None:
        self._queue(conn, {"ok": False, "error": {"code": code, "message": message, **extra}})

    def _flush(self, conn: _Conn) -> None:
        while conn.outq:
            data, fds = conn.outq[0]
            anc = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, struct.pack(f"{len(fds)}i", *fds))] if fds else []
            try:
                sent = conn.sock.sendmsg([data], anc)
            except (BlockingIOError, InterruptedError):
                break
            except OSError as e:
                if e.errno not in (errno.EPIPE, errno.ECONNRESET):
                    log.warning("send to pid %d failed: %s", conn.pid, e)
                self._close(conn)
                return
            protocol.close_fds(fds)  # the peer has its own copies now (or never will)
            conn.outbytes -= sent
            if sent < len(data):
                conn.outq[0] = (data[sent:], [])
                break
            conn.outq.popleft()
        if conn.closing and not conn.outq:
            self._close(conn)
            return
        backlogged = conn.outbytes >= MAX_PENDING_REPLY
        want = (0 if backlogged else selectors.EVENT_READ) | (selectors.EVENT_WRITE if conn.outq else 0)
        self._sel.modify(conn.sock, want, conn)

    # ---------------------------------------------------------------- requests
    def _handle_frame(self, conn: _Conn, raw_header: bytes, blob: bytes) -> None:
        self.requests += 1
        try:
            req = protocol.decode_header(raw_header)
        except protocol.ProtocolError as e:
            self._reply_error(conn, "bad_request", str(e))
            return
        op = req.get("op")
        handler = getattr(self, f"_op_{op}", None) if isinstance(op, str) and op.isidentifier() else None
        if op == "await_gone":        # the ops that need their connection: this reply may wait
            handler = lambda req, blob: self._await_gone(conn, req)    # noqa: E731
        elif op == "drain":
            handler = lambda req, blob: self._drain(conn, req)    # noqa: E731
        if handler is None:
            self._reply_error(conn, "bad_request", f"unknown op {op!r:.60}")
            return
        try:
            header, out_blob, fds = handler(req, blob)
        except ConflictError as e:
            self._reply_error(conn, "conflict", str(e), conflicts=e.conflicts)
        except (OutOfMemory, MemoryError) as e:
            self._reply_error(conn, "out_of_memory", str(e) or "out of memory")
        except VersionMismatch as e:
            self._reply_error(conn, "version_mismatch", str(e))
        except BadRequest as e:   # names the field (and object) in ``details``
            self._reply_error(conn, "bad_request", f"{op}: {e}", **e.details)
        except (JournalError, ValueError, TypeError, KeyError) as e:
            self._reply_error(conn, "bad_request", f"{op}: {e}")
        except Exception as e:  # a backend failure: report it, keep serving
            log.exception("op %s failed", op)
            self._reply_error(conn, "internal", f"{op}: {type(e).__name__}: {e}")
        else:
            if header is not None:          # None: the reply comes later (await_gone)
                header["ok"] = True
                self._queue(conn, header, out_blob, fds)
        if op == "shutdown":
            self.stop()

    def _await_gone(self, conn: _Conn, req: dict):
        """Reply once no connection of process ``pid`` is open any more: every frame it sent
        whole has then been handled (frames are handled in order as they are read, and a
        connection closes only at its end of file).  A successor that takes over from a dead
        process calls this before it reads the journal, so no commit of the dead one can land
        after that read."""
        pid = self._peer_pid(conn, req)
        if not any(c.pid == pid for c in self._conns.values()):
            return {"pid": pid}, b"", []
        self._gone_waiters.setdefault(pid, []).append(conn)
        return None, b"", []

    def _peer_pid(self, conn: _Conn, req: dict) -> int:
        pid = req.get("pid")
        if not isinstance(pid, int) or isinstance(pid, bool) or pid <= 0:
            raise BadRequest("pid must be a positive integer")
        if pid == conn.pid:
            raise BadRequest("a process cannot wait for its own departure")
        return pid

    def _drain(self, conn: _Conn, req: dict):
        """Handle now every whole frame process ``pid`` has sent.  The caller knows that no
        thread of ``pid`` that could send runs any more (``runtime.liveness``): all it sent is
        in its connections' queues, so after this a journal read sees its last commit if that
        commit reached the daemon whole; a torn last frame stays unhandled (and is dropped at
        the connection's end).  Its replies are dropped (nobody reads them).  Replies ``pid``
        and ``torn``: the bytes of such a frame."""
        pid = self._peer_pid(conn, req)
        torn = 0
        for c in [c for c in self._conns.values() if c.pid == pid]:
            while c.sock.fileno() >= 0:
                try:
                    data, anc, _, _ = c.sock.recvmsg(1 << 20, socket.CMSG_SPACE(protocol.MAX_FDS_PER_FRAME * 4))
                except (BlockingIOError, InterruptedError):
                    break
                except OSError:
                    break
                protocol.close_fds(protocol.fds_from_ancillary(anc))
                if not data:
                    break
                c.inbuf += data
            while c.sock.fileno() >= 0:      # every whole frame, however many replies pile up
                self._drop_replies(c)
                left = len(c.inbuf)
                self._on_buffered(c)
                if len(c.inbuf) == left:
                    break
            self._drop_replies(c)
            torn += len(c.inbuf)
        return {"pid": pid, "torn": torn}, b"", []

    @staticmethod
    def _drop_replies(conn: _Conn) -> None:
        for _, fds in conn.outq:
            protocol.close_fds(fds)
        conn.outq.clear()
        conn.outbytes = 0

    def _op_shutdown(self, req, blob):
        return {}, b"", []


def _raise_descriptor_limit() -> None:
    """Every connection and every segment holds a descriptor: take the hard limit (bounded)."""
    why = fdwait.raise_descriptor_limit()
    if why:
        log.warning("%s", why)


def run(device: str, socket_path: str) -> None:
    _raise_descriptor_limit()
    daemon = Daemon(device, socket_path)
    daemon.bind_socket()
    print(f"gpu-anchor daemon: {device} at {socket_path} (pid {os.getpid()})", flush=True)
    daemon.serve_forever()
