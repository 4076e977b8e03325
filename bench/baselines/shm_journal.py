"""A metadata journal in host shared memory for the inference baselines.

The baselines need what any serving system keeps outside the engine process to resume
requests (prompt, sampling parameters, tokens sent so far, and for KV-memory the block
tables): the same records gpu-anchor's engine commits, written here to an append-only
log on tmpfs instead of the daemon's journal.  Same interface as the daemon journal
(``get``, ``get_many``, ``commit``), so the engine's own commit and recovery code runs
unchanged.  ``before_commit`` (KV-memory) runs first, so a commit never names KV that is
not yet in host memory.  A torn last record (SIGKILL mid-write) is dropped on open.
"""
from __future__ import annotations

import os
import pickle
import struct

_HDR = struct.Struct("<Q")
COMPACT_BYTES = 64 << 20


class ShmJournal:
    def __init__(self, directory: str) -> None:
        os.makedirs(directory, exist_ok=True)
        self.path = os.path.join(directory, "journal.log")
        self.data: dict[str, bytes] = {}
        self.version = 0
        self.before_commit = None
        self._load()
        self._compact()

    def _load(self) -> None:
        try:
            with open(self.path, "rb") as f:
                raw = f.read()
        except FileNotFoundError:
            return
        pos = 0
        while pos + _HDR.size <= len(raw):
            (n,) = _HDR.unpack_from(raw, pos)
            if pos + _HDR.size + n > len(raw):
                break  # torn tail
            puts, deletes = pickle.loads(raw[pos + _HDR.size:pos + _HDR.size + n])
            self._apply(puts, deletes)
            pos += _HDR.size + n

    def _apply(self, puts, deletes) -> None:
        for k in deletes:
            self.data.pop(k, None)
        self.data.update(puts)
        self.version += 1

    def _compact(self) -> None:
        tmp = self.path + ".tmp"
        blob = pickle.dumps((self.data, []))
        with open(tmp, "wb") as f:
            f.write(_HDR.pack(len(blob)) + blob)
        os.replace(tmp, self.path)
        self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND)
        self._written = 0

    def get(self, key: str) -> bytes | None:
        return self.data.get(key)

    def get_many(self, keys=None, prefix: str | None = None) -> dict[str, bytes]:
        if keys is not None:
            return {k: self.data[k] for k in keys if k in self.data}
        return {k: v for k, v in self.data.items() if prefix is None or k.startswith(prefix)}

    def commit(self, puts=None, deletes=(), expect_version=None) -> int:
        if self.before_commit is not None:
            self.before_commit()
        puts, deletes = dict(puts or {}), list(deletes)
        blob = pickle.dumps((puts, deletes))
        os.write(self._fd, _HDR.pack(len(blob)) + blob)  # one write: all or (torn) nothing
        self._apply(puts, deletes)
        self._written += len(blob)
        if self._written > COMPACT_BYTES:
            os.close(self._fd)
            self._compact()
        return self.version

    def put(self, key: str, value: bytes) -> int:
        return self.commit({key: value})
