"""Client view of a namespace's journal in the daemon (key → bytes, atomic commits)."""
from __future__ import annotations

from gpu_anchor import protocol


class Journal:
    """``get``/``get_many`` read; ``commit`` applies puts and deletes atomically.

    A commit with ``expect_version`` succeeds only if nobody committed since that
    version was read (``errors.VersionMismatch`` otherwise).
    """

    def __init__(self, client) -> None:
        self._client = client

    def get_many(self, keys=None, prefix: str | None = None) -> dict[str, bytes]:
        header = {"op": "journal_get"}
        if keys is not None:
            header["keys"] = list(keys)
        if prefix is not None:
            header["prefix"] = prefix
        reply, blob, _ = self._client._request(header)
        return protocol.unpack_blobs(reply["values"], blob)

    def get(self, key: str, default: bytes | None = None) -> bytes | None:
        return self.get_many([key]).get(key, default)

    @property
    def version(self) -> int:
        return self._client._request({"op": "journal_get", "keys": []})[0]["version"]

    def commit(self, puts: dict[str, bytes] | None = None, deletes=(), expect_version: int | None = None) -> int:
        refs, blob = protocol.pack_blobs(puts or {})
        header = {"op": "journal_commit", "puts": refs, "deletes": list(deletes)}
        if expect_version is not None:
            header["expect_version"] = expect_version
        return self._client._request(header, blob)[0]["version"]

    def put(self, key: str, value: bytes) -> int:
        return self.commit({key: value})
