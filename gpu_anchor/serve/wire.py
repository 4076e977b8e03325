"""Engine <-> frontend messages: 4-byte little-endian length + UTF-8 JSON, over a Unix socket.

frontend -> engine: ``{"t": "add", "rid", "prompt": [ids], "params": {...}, "out": [ids already delivered]}``,
                    ``{"t": "abort", "rid"}``, ``{"t": "readd", ...like add}`` (replace the history)
engine -> frontend: ``{"t": "loading", "pid", "phase", "done", "total", "elapsed_s"}`` (while it starts),
                    ``{"t": "hello", "pid", "rids": [...], "timings": {...}, "notes": [...]}`` (once built),
                    ``{"t": "toks", "ev": [[rid, first_index, [ids], finish_reason|null], ...],
                    "lp": [[rid, index, logprob, [[id, logprob], ...]], ...]}`` ("lp" only for requests
                    that asked for log-probabilities; "plp": prompt log-probabilities; "cached":
                    [[rid, prompt tokens found cached], ...] with a first token), ``{"t": "load", "running",
                    "waiting", "kv_blocks_used", "kv_blocks", "preemptions", "prefix_queries", "prefix_hits"}``,
                    ``{"t": "err", "rid", "msg"}``, ``{"t": "stats", ...}``, ``{"t": "readd_ok", "rid"}``
Token events carry their index, so the receiver can drop duplicates after a restart.
"""
from __future__ import annotations

import json
import struct

MAX_FRAME = 64 << 20


def encode(obj) -> bytes:
    data = json.dumps(obj, separators=(",", ":")).encode()
    return struct.pack("<I", len(data)) + data


class Decoder:
    """Incremental decoder for a byte stream (the engine side uses plain sockets)."""

    def __init__(self) -> None:
        self.buf = bytearray()

    def feed(self, data: bytes) -> list:
        self.buf += data
        out = []
        while len(self.buf) >= 4:
            (n,) = struct.unpack_from("<I", self.buf)
            if n > MAX_FRAME:
                raise ValueError(f"frame of {n} bytes exceeds {MAX_FRAME}")
            if len(self.buf) < 4 + n:
                break
            out.append(json.loads(bytes(self.buf[4:4 + n])))
            del self.buf[:4 + n]
        return out


async def read(reader):
    """Next message from an ``asyncio.StreamReader``; raises ``IncompleteReadError`` at EOF."""
    head = await reader.readexactly(4)
    (n,) = struct.unpack("<I", head)
    if n > MAX_FRAME:
        raise ValueError(f"frame of {n} bytes exceeds {MAX_FRAME}")
    return json.loads(await reader.readexactly(n))


def describe_loading(msg: dict) -> str:
    """One line for a ``loading`` message: what is happening, how far along, since when."""
    what = {"cuda_init": "creating the CUDA context", "group": "connecting the tensor-parallel ranks",
            "bind": "mapping the anchored weights and KV cache",
            "weights": "loading weights", "restore": "restoring requests from the journal"}.get(msg["phase"],
                                                                                            msg["phase"])
    done, total = msg.get("done"), msg.get("total")
    if msg["phase"] == "weights" and total:
        what += f" {_size(done or 0)} of {_size(total)} ({100 * (done or 0) / total:.0f} %)"
    elif total:
        what += f" ({_size(total)})"
    return f"{what}, {msg['elapsed_s']:.1f} s since the engine started"


def _size(n: int) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"
