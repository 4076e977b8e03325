"""Wire format shared by the daemon and its clients (torch-free).

A frame is ``MAGIC | u32 header_len | u32 blob_len | header JSON | blob``.
The header is a JSON object; the blob carries raw bytes (journal values) that
the header refers to by ``[offset, length]`` pairs.  File descriptors travel as
SCM_RIGHTS ancillary data on the first ``sendmsg`` of a frame and the header
says how many to expect (``"nfds"``).  Only the daemon sends descriptors; any
descriptor a client sends is closed unread.

Limits are enforced before anything is allocated, so a hostile length field
cannot make either side reserve memory.
"""
from __future__ import annotations

import array
import json
import os
import socket
import struct

MAGIC = b"GAN1"
PROTOCOL_VERSION = 1
PREFIX = struct.Struct("<4sII")
MAX_HEADER = 4 << 20
MAX_BLOB = 256 << 20
MAX_FDS_PER_FRAME = 253  # SCM_MAX_FD on Linux


class ProtocolError(Exception):
    """The peer sent something that is not a valid frame; the connection is unusable."""


def encode(header: dict, blob: bytes = b"") -> bytes:
    body = json.dumps(header, separators=(",", ":")).encode()
    if len(body) > MAX_HEADER or len(blob) > MAX_BLOB:
        raise ProtocolError(f"frame too large: header {len(body)} B, blob {len(blob)} B")
    return PREFIX.pack(MAGIC, len(body), len(blob)) + body + blob


def parse_prefix(prefix: bytes) -> tuple[int, int]:
    magic, hlen, blen = PREFIX.unpack(prefix)
    if magic != MAGIC:
        raise ProtocolError(f"bad magic {magic!r}: not a gpu-anchor peer, or protocol mismatch")
    if hlen > MAX_HEADER or blen > MAX_BLOB:
        raise ProtocolError(f"frame too large: header {hlen} B, blob {blen} B")
    return hlen, blen


def decode_header(raw: bytes) -> dict:
    try:
        header = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ProtocolError(f"header is not JSON: {e}") from None
    if not isinstance(header, dict):
        raise ProtocolError("header is not a JSON object")
    return header


def pack_blobs(values: dict[str, bytes]) -> tuple[dict[str, list[int]], bytes]:
    """Lay values end to end; return ``{key: [offset, length]}`` and the blob."""
    refs, parts, offset = {}, [], 0
    for key, value in values.items():
        value = bytes(value)
        refs[key] = [offset, len(value)]
        parts.append(value)
        offset += len(value)
    return refs, b"".join(parts)


def unpack_blobs(refs: object, blob: bytes) -> dict[str, bytes]:
    if not isinstance(refs, dict):
        raise ValueError("blob references must be an object of key -> [offset, length]")
    out = {}
    for key, ref in refs.items():
        if (not isinstance(ref, list) or len(ref) != 2
                or not all(isinstance(x, int) and not isinstance(x, bool) for x in ref)):
            raise ValueError(f"bad blob reference for {key!r}: {ref!r}")
        off, length = ref
        if off < 0 or length < 0 or off + length > len(blob):
            raise ValueError(f"blob reference for {key!r} out of range")
        out[key] = blob[off:off + length]
    return out


def send_frame(sock: socket.socket, header: dict, blob: bytes = b"", fds: list[int] = ()) -> None:
    """Blocking send of one frame (client side)."""
    data = encode(header, blob)
    ancillary = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))] if fds else []
    sent = sock.sendmsg([data], ancillary)
    if sent < len(data):
        sock.sendall(memoryview(data)[sent:])


def recv_frame(sock: socket.socket) -> tuple[dict, bytes, list[int]]:
    """Blocking receive of one frame with any descriptors that came with it."""
    fds: list[int] = []
    try:
        prefix = _recv_exact(sock, PREFIX.size, fds)
        hlen, blen = parse_prefix(prefix)
        header = decode_header(_recv_exact(sock, hlen, fds))
        blob = _recv_exact(sock, blen, fds) if blen else b""
        want = header.get("nfds", 0)
        if isinstance(want, int) and len(fds) < want:
            # Descriptors ride on the first sendmsg; wait for stragglers only if promised.
            raise ProtocolError(f"expected {want} descriptors, got {len(fds)}")
    except BaseException:
        close_fds(fds)
        raise
    return header, blob, fds


def _recv_exact(sock: socket.socket, n: int, fds: list[int]) -> bytes:
    buf = bytearray()
    fd_space = socket.CMSG_SPACE(MAX_FDS_PER_FRAME * 4)
    while len(buf) < n:
        data, anc, flags, _ = sock.recvmsg(n - len(buf), fd_space)
        fds.extend(fds_from_ancillary(anc))
        if flags & socket.MSG_CTRUNC:
            raise ProtocolError("descriptor list truncated")
        if not data:
            raise ConnectionError("connection closed by peer")
        buf += data
    return bytes(buf)


def fds_from_ancillary(anc) -> list[int]:
    out = []
    for level, kind, data in anc:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            arr = array.array("i")
            arr.frombytes(data[: len(data) - len(data) % arr.itemsize])
            out.extend(arr)
    return out


def close_fds(fds) -> None:
    for fd in fds:
        try:
            os.close(fd)
        except OSError:
            pass
