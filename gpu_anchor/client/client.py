"""The worker-side client: bind names to anchored memory and get zero-copy tensors.

    client = gpu_anchor.connect("cuda:0", namespace="job-42")
    w = client.tensor("model.fc.weight", (4096, 4096), torch.bfloat16)   # same memory in every restart
    client.journal.commit({"cursor": b"3", "step": b"17"})               # atomic

Contract:
- ``tensor``/``bind`` return tensors over daemon-owned memory; the same name in a
  new process returns the same memory and data ("matched"), or fresh memory
  ("created", contents undefined) if it was never anchored.
- A tensor whose last reference dies (with all its views) frees its object in
  the daemon, with this process's next request to it — not during interpreter
  shutdown, not from a forked child, not after a crash: then the object stays
  for the next worker.  ``free`` frees at once.
- One client per process and device is the normal case; it is thread-safe.
"""
from __future__ import annotations

import atexit
import functools
import operator
import os
import threading
import warnings
import weakref
from collections import deque
from dataclasses import dataclass

import torch

from gpu_anchor import fdwait, protocol
from gpu_anchor.dtypes import check_dtype, check_shape
from gpu_anchor.errors import BadRequest
from gpu_anchor.paths import normalize_device

from . import gate, mapping
from .channel import Channel
from .journal import Journal

_EXPORT_BATCH = 200


# Per process, not per client: two clients of one daemon in one process must share
# one lease per object, or the death of one's tensor would free the other's memory.
_segments: "weakref.WeakValueDictionary[tuple, object]" = weakref.WeakValueDictionary()  # (instance, id)
_leases: "weakref.WeakValueDictionary[tuple, object]" = weakref.WeakValueDictionary()  # (instance, ns, name)
_pending_frees: deque[tuple[int, str, str, str, int]] = deque()  # (pid, instance, ns, name, generation)
_by_address: dict[tuple, tuple] = {}  # (device, storage address) -> (lease key, weakref to lease)
_live_clients: "weakref.WeakSet[Client]" = weakref.WeakSet()


def _queue_free(key: tuple, name: str, generation: int) -> None:
    # Runs from a finalizer, possibly in the middle of another request: only queue.
    _pending_frees.append((os.getpid(), key[0], key[1], name, generation))


@atexit.register
def _stop_reporting_frees() -> None:
    """From here on, dying tensors free nothing: what is alive at exit stays anchored.

    Frees still queued are dropped, not sent: a wrapper that caught an exception and
    unwound the frames holding a model (``torch.distributed.elastic``'s ``@record``, a
    user's ``try/except: sys.exit(1)``) must not free the state the next worker needs.
    The price is on the safe side: an object deleted just before exit, with no request
    after it, stays until ``gpu-anchor drop`` (``client.free`` frees at once)."""
    mapping.shutting_down = True


@dataclass(frozen=True)
class ObjectInfo:
    name: str
    dtype: str
    shape: tuple[int, ...]
    nbytes: int
    generation: int


@dataclass
class Bound:
    """One name's answer from the daemon: ``status`` is ``matched``, ``created`` or ``missing``."""
    name: str
    status: str
    tensor: torch.Tensor | None
    info: ObjectInfo | None


def _wire_object(index: int, name: str, shape, dtype) -> dict:
    """One bind entry, checked before it is sent: sizes are ints (``torch.Size``, numpy and
    0-d integer tensors are), never truncated floats; the dtype is a ``torch.dtype``."""
    what = f"objects[{index}] {name!r:.200}"
    if not isinstance(dtype, torch.dtype):
        raise BadRequest(f"{what}: dtype must be a torch.dtype such as torch.float32, got {dtype!r:.40} "
                         f"({type(dtype).__name__})", field="dtype", name=name)
    dims = shape
    if isinstance(shape, (list, tuple)):
        dims = list(shape)
        for i, d in enumerate(dims):
            if not isinstance(d, bool):
                try:
                    dims[i] = operator.index(d)
                except TypeError:
                    pass          # left as it is: check_shape names it
    return {"name": name, "shape": list(check_shape(dims, what, name)),
            "dtype": check_dtype(mapping.dtype_name(dtype), what, name)}


def _info(d: dict) -> ObjectInfo:
    return ObjectInfo(d["name"], d["dtype"], tuple(d["shape"]), d["nbytes"], d["generation"])


@functools.lru_cache(maxsize=None)
def _host_descriptors() -> None:
    """The host backend keeps one descriptor per segment mapped here (a CUDA segment's is closed
    once imported): raise this process's soft limit once, and say so if it cannot be."""
    why = fdwait.raise_descriptor_limit()
    if why:
        warnings.warn(f"gpu_anchor: {why}; the host backend holds one descriptor per segment (measured: about "
                      "one per anchored object), so a process over that many fails to bind more (raise `ulimit -n`)",
                      RuntimeWarning, stacklevel=3)


class Client:
    def __init__(self, device: str = "cpu", namespace: str = "default", socket_path: str | None = None) -> None:
        self.device = normalize_device(device)
        self.namespace = namespace
        self._channel = Channel(self.device, socket_path)
        hello = self._channel.hello
        if hello.get("device") != self.device:
            raise RuntimeError(f"{self._channel.path} serves {hello.get('device')}, not {self.device}")
        if self.device == "cpu":
            _host_descriptors()
            self._mapper = mapping.HostMapper()
        else:
            self._mapper = mapping.CudaMapper(int(self.device.split(":")[1]), hello.get("uuid"))
        self._instance = hello["instance"]
        self._lock = threading.RLock()
        self.journal = Journal(self)
        _live_clients.add(self)

    # ------------------------------------------------------------------ plumbing
    @property
    def socket_path(self) -> str:
        return self._channel.path

    def _request(self, header: dict, blob: bytes = b"") -> tuple[dict, bytes, list[int]]:
        if os.getpid() != self._channel.pid:
            raise RuntimeError("this gpu-anchor client was created in the parent process; call connect() in the child")
        gate.wait_open()         # a worker started early touches no anchored state before its supervisor says so
        self.flush_frees()
        header.setdefault("namespace", self.namespace)
        return self._channel.request(header, blob)

    def flush_frees(self) -> None:
        """Forward frees of objects whose tensors died; runs before every request."""
        if not _pending_frees or os.getpid() != self._channel.pid:
            return
        mine: dict[str, list] = {}
        pid = os.getpid()
        for _ in range(len(_pending_frees)):
            entry = _pending_frees.popleft()
            if entry[0] != pid:
                continue  # inherited through fork: the parent's to send, not ours
            if entry[1] == self._instance:
                mine.setdefault(entry[2], []).append([entry[3], entry[4]])
            else:
                _pending_frees.append(entry)  # another daemon's: its own client will send it
        for ns, names in mine.items():
            try:
                self._channel.request({"op": "free", "namespace": ns, "names": names})
            except Exception:
                pass  # daemon gone: nothing to free any more

    # ------------------------------------------------------------------ objects
    def bind(self, specs, policy: str = "match_or_create") -> list[Bound]:
        """Bind many ``(name, shape, dtype)`` at once: one round trip, all-or-nothing.

        ``policy``: ``match_or_create`` (conflict raises ``ConflictError``, nothing
        changes), ``replace`` (a conflicting object is freed and recreated) or
        ``lookup`` (absent names come back as ``missing``, nothing is created).

        Tensors from ``lookup`` do not own their objects: an observer (a checkpointer,
        a status tool, a test) that looks and lets go never frees a job's state.
        """
        objects = [_wire_object(i, n, shape, dtype) for i, (n, shape, dtype) in enumerate(specs)]
        with self._lock:
            reply = self._request({"op": "bind", "objects": objects, "policy": policy})[0]
            sizes = {int(k): v for k, v in reply["segments"].items()}
            segs = {sid: _segments.get((self._instance, sid)) for sid in sizes}
            self._map_segments([sid for sid, s in segs.items() if s is None], segs)
            out = []
            for res in reply["results"]:
                if res["status"] == "missing":
                    out.append(Bound(res["name"], "missing", None, None))
                    continue
                info = _info(res)
                tensor = self._wrap(info, segs[res["segment"]], res["offset"], owning=policy != "lookup")
                out.append(Bound(info.name, res["status"], tensor, info))
            return out

    def _map_segments(self, ids: list[int], into: dict) -> None:
        for i in range(0, len(ids), _EXPORT_BATCH):
            chunk = ids[i:i + _EXPORT_BATCH]
            reply, _, fds = self._request({"op": "export", "segments": chunk})
            try:
                for k, (sid, size) in enumerate(zip(reply["segments"], reply["sizes"])):
                    seg = self._mapper.open_segment(sid, fds[k], size)
                    fds[k] = -1
                    _segments[(self._instance, sid)] = into[sid] = seg
            finally:
                protocol.close_fds([fd for fd in fds if fd >= 0])

    def _wrap(self, info: ObjectInfo, seg, offset: int, owning: bool) -> torch.Tensor:
        dtype = mapping.torch_dtype(info.dtype)
        if info.nbytes == 0:
            return torch.empty(info.shape, dtype=dtype, device=self._mapper.device)
        key = (self._instance, self.namespace, info.name)
        lease = _leases.get(key)
        if lease is None or lease.generation != info.generation:
            lease = self._mapper.lease(seg, offset, info.nbytes, info.name, info.generation, None)
            _leases[key] = lease
        if owning and lease._on_release is None:
            lease._on_release = functools.partial(_queue_free, key)
        t = mapping.as_typed(self._mapper.raw(lease), dtype, info.shape)
        _by_address[(self.device, t.untyped_storage().data_ptr())] = (key, weakref.ref(lease))
        return t

    def tensor(self, name: str, shape, dtype: torch.dtype = torch.float32, policy: str = "match_or_create") -> torch.Tensor:
        """Get-or-create one named tensor (see ``bind``)."""
        return self.bind([(name, shape, dtype)], policy)[0].tensor

    def lookup(self, name: str, shape, dtype: torch.dtype) -> torch.Tensor | None:
        """The anchored tensor if ``name`` exists with this dtype and shape, else ``None``; creates nothing."""
        return self.bind([(name, shape, dtype)], "lookup")[0].tensor

    def objects(self) -> dict[str, ObjectInfo]:
        return {o["name"]: _info(o) for o in self._request({"op": "list"})[0]["objects"]}

    def objects_since(self, version: int | None) -> tuple[int | None, dict[str, ObjectInfo] | None]:
        """``(version, objects)`` of the namespace's object table, or ``(version, None)`` when it is
        still at ``version`` (one small round trip).  The daemon gives the table a new version at
        every create, replace and free, never reused within one daemon; a daemon that predates
        versions answers ``(None, objects)``."""
        reply = self._request({"op": "list", "since": version} if version is not None else {"op": "list"})[0]
        objs = reply["objects"]
        return reply.get("version"), None if objs is None else {o["name"]: _info(o) for o in objs}

    def names(self) -> list[str]:
        return sorted(self.objects())

    def free(self, *names: str) -> list[str]:
        """Free objects now; tensors still held over them must not be used afterwards."""
        return self._request({"op": "free", "names": list(names)})[0]["freed"]

    def drop_namespace(self) -> int:
        """Free every object and the journal of this client's namespace."""
        return self._request({"op": "drop"})[0]["freed"]

    def status(self) -> dict:
        return self._request({"op": "status"})[0]

    def close(self) -> None:
        self.flush_frees()
        self._channel.close()
        _live_clients.discard(self)

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"Client(device={self.device!r}, namespace={self.namespace!r}, socket={self.socket_path!r})"


def anchored_name(t: torch.Tensor) -> tuple[str, str] | None:
    """``(namespace, name)`` of the anchored object ``t`` (or a view of it) lives in, else None."""
    try:
        ptr = t.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError):
        return None
    dev = t.device
    device = "cpu" if dev.type == "cpu" else f"cuda:{dev.index}" if dev.type == "cuda" else None
    entry = _by_address.get((device, ptr)) if device and ptr else None
    if entry is None:
        return None
    if entry[1]() is None:           # the object was unmapped here; the address may be reused
        _by_address.pop((device, ptr), None)
        return None
    return entry[0][1], entry[0][2]


def default_device() -> str:
    if torch.cuda.is_available():
        return f"cuda:{torch.cuda.current_device()}"
    return "cpu"


def default_namespace(device: str) -> str:
    """``GPU_ANCHOR_NAMESPACE`` or ``default``; on the host daemon, which a node's ranks
    share, a rank suffix keeps their names apart."""
    ns = os.environ.get("GPU_ANCHOR_NAMESPACE", "default")
    return namespace_for(ns, device)


def namespace_for(ns: str, device: str, rank: int | None = None, world_size: int | None = None) -> str:
    """The namespace a rank uses on ``device``'s daemon: ``ns/rank<r>`` on the host daemon,
    which a node's ranks share, when there are several ranks; ``ns`` otherwise (a GPU's
    daemon serves one rank).  ``rank`` and ``world_size`` default to ``RANK`` and ``WORLD_SIZE``."""
    world = int(os.environ.get("WORLD_SIZE", "1")) if world_size is None else world_size
    if device == "cpu" and world > 1:
        return f"{ns}/rank{os.environ.get('RANK', '0') if rank is None else rank}"
    return ns


def connect(device=None, namespace: str | None = None, socket: str | None = None) -> Client:
    """Connect to the daemon of ``device`` (default: the current CUDA device, else ``cpu``).

    The daemon is found at ``socket``, else ``GPU_ANCHOR_SOCKET``, else the per-user
    default path; if none answers, the error says how to start one.
    """
    device = normalize_device(device if device is not None else default_device())
    ns = namespace_for(namespace, device) if namespace is not None else default_namespace(device)
    return Client(device, ns, socket)
