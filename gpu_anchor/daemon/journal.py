"""A namespace's journal: key → bytes with atomic multi-key commits (torch-free).

The consistency protocols keep their cursors and committed metadata here.  A
commit applies all its puts and deletes or none of them, and bumps the
journal's version; a caller may ask for the commit to happen only if the
version is still the one it read (``expect_version``), which makes
read-modify-write safe when two writers share a journal.

The journal lives in the daemon's memory: it survives any number of worker
crashes and dies with the daemon (then the checkpoint is the fallback).
"""
from __future__ import annotations

MAX_KEY = 1024
MAX_JOURNAL_BYTES = 256 << 20


class JournalError(ValueError):
    pass


class VersionMismatch(JournalError):
    pass


class Journal:
    def __init__(self) -> None:
        self.values: dict[str, bytes] = {}
        self.version = 0
        self.nbytes = 0

    def get(self, keys=None, prefix: str | None = None) -> dict[str, bytes]:
        if keys is not None:
            return {k: self.values[k] for k in keys if k in self.values}
        if prefix is not None:
            return {k: v for k, v in self.values.items() if k.startswith(prefix)}
        return dict(self.values)

    def commit(self, puts: dict[str, bytes], deletes=(), expect_version: int | None = None) -> int:
        for key in list(puts) + list(deletes):
            if not isinstance(key, str) or not key or len(key) > MAX_KEY:
                raise JournalError(f"journal keys must be strings of 1..{MAX_KEY} characters, got {key!r:.80}")
        if expect_version is not None and expect_version != self.version:
            raise VersionMismatch(f"journal is at version {self.version}, commit expected {expect_version}")
        size = self.nbytes
        for key in deletes:
            if key in self.values and key not in puts:
                size -= len(key) + len(self.values[key])
        for key, value in puts.items():
            old = self.values.get(key)
            size += len(key) + len(value) - (0 if old is None else len(key) + len(old))
        if size > MAX_JOURNAL_BYTES:
            raise JournalError(f"journal would hold {size} B, over the {MAX_JOURNAL_BYTES} B limit")
        for key in deletes:
            self.values.pop(key, None)
        self.values.update(puts)
        self.nbytes = size
        self.version += 1
        return self.version
