"""The daemon's request handlers that need no connection (torch-free): ``Daemon`` inherits them.

Each ``_op_<name>(req, blob)`` gets a decoded header (``protocol.decode_header``) and the
frame's blob, validates every field it reads before use (the trust boundary: a client's
request is data, never code), and returns ``(header, blob, descriptors)`` for the reply, or
raises: ``BadRequest`` (naming the field), ``ConflictError``, ``OutOfMemory``,
``VersionMismatch`` / ``JournalError``, which ``Daemon._handle_frame`` turns into an error
reply.  They work on ``self.registry`` (namespaces, objects, journals), ``self.arena``
(segments) and ``self.backend``; the ops that need their connection (``await_gone``,
``drain``) and ``shutdown`` stay in ``server``.
"""
from __future__ import annotations

import os
import time

from gpu_anchor import protocol
from gpu_anchor.errors import BadRequest

MAX_EXPORT = 200  # descriptors per reply, under SCM_MAX_FD


class Operations:
    @staticmethod
    def _ns(req: dict) -> str:
        ns = req.get("namespace")
        if not isinstance(ns, str):
            raise BadRequest("namespace must be a string")
        return ns

    def _op_hello(self, req, blob):
        info = self.backend.info()
        return {"version": protocol.PROTOCOL_VERSION, "instance": self.instance, "pid": os.getpid(),
                "uid": self.uid, "device": self.device, **info}, b"", []

    def _op_ping(self, req, blob):
        return {}, b"", []

    def _op_bind(self, req, blob):
        policy = req.get("policy", "match_or_create")
        results = self.registry.bind(self._ns(req), req.get("objects"), policy)
        out = []
        for req_obj, (status, obj) in zip(req["objects"], results):
            out.append({"status": status, **(obj.describe() if obj else {"name": req_obj["name"]})})
        segs = {o["segment"]: self.arena.segments[o["segment"]].size for o in out if "segment" in o}
        return {"results": out, "segments": segs}, b"", []

    def _op_export(self, req, blob):
        ids = req.get("segments")
        if not isinstance(ids, list) or len(ids) > MAX_EXPORT:
            raise BadRequest(f"segments must be a list of at most {MAX_EXPORT} ids")
        fds, sizes = [], []
        try:
            for sid in ids:
                seg = self.arena.segments.get(sid) if isinstance(sid, int) else None
                if seg is None:
                    raise BadRequest(f"no segment {sid!r:.40} (freed, or never existed)")
                fds.append(self.backend.export(seg.handle))
                sizes.append(seg.size)
        except BaseException:
            protocol.close_fds(fds)
            raise
        return {"segments": ids, "sizes": sizes}, b"", fds

    def _op_free(self, req, blob):
        return {"freed": self.registry.free(self._ns(req), req.get("names"))}, b"", []

    def _op_list(self, req, blob):
        ns = self.registry.namespace(self._ns(req), create=False)
        version = ns.version if ns else 0
        if req.get("since") == version:  # the caller's copy is current: skip the table
            return {"objects": None, "version": version}, b"", []
        objs = [o.describe() for o in ns.objects.values()] if ns else []
        return {"objects": objs, "version": version}, b"", []

    def _op_drop(self, req, blob):
        return {"freed": self.registry.drop(self._ns(req))}, b"", []

    def _op_journal_get(self, req, blob):
        ns = self.registry.namespace(self._ns(req), create=False)
        keys, prefix = req.get("keys"), req.get("prefix")
        if keys is not None and (not isinstance(keys, list) or not all(isinstance(k, str) for k in keys)):
            raise BadRequest("keys must be a list of strings")
        if prefix is not None and not isinstance(prefix, str):
            raise BadRequest("prefix must be a string")
        values = ns.journal.get(keys, prefix) if ns else {}
        refs, out = protocol.pack_blobs(values)
        return {"values": refs, "version": ns.journal.version if ns else 0}, out, []

    def _op_journal_commit(self, req, blob):
        puts = protocol.unpack_blobs(req.get("puts", {}), blob)
        deletes = req.get("deletes", [])
        expect = req.get("expect_version")
        if not isinstance(deletes, list):
            raise BadRequest("deletes must be a list")
        if expect is not None and (not isinstance(expect, int) or isinstance(expect, bool)):
            raise BadRequest("expect_version must be an integer")
        version = self.registry.namespace(self._ns(req)).journal.commit(puts, deletes, expect)
        return {"version": version}, b"", []

    def _op_status(self, req, blob):
        namespaces = {}
        for name, ns in self.registry.namespaces.items():
            namespaces[name] = {
                "objects": [o.describe() for o in ns.objects.values()],
                "object_bytes": sum(o.nbytes for o in ns.objects.values()),
                "journal_keys": sorted(ns.journal.values),
                "journal_bytes": ns.journal.nbytes,
                "journal_version": ns.journal.version,
            }
        header = {"device": self.device, "pid": os.getpid(), "instance": self.instance,
                  "uptime_s": round(time.time() - self.started, 1), "connections": len(self._conns),
                  "requests": self.requests, "segments": len(self.arena.segments),
                  "reserved_bytes": self.arena.reserved_bytes(), "object_bytes": self.registry.object_bytes(),
                  "backend": self.backend.info(), "namespaces": namespaces}
        return header, b"", []
