"""Generic consistency guard: group copy-on-write over anchored tensors.

For state that breaks the training / inference protocols' assumptions (an optimizer
fused into backward, a recurrent state updated in place): make a group of ops (one
step) all-or-nothing across a crash.

    guard = GroupGuard(client, tracker, job_tensors)
    guard.recover()                          # at worker start, before any write
    with tracker:
        for step in ...:
            guard.begin(step)
            run_step()                       # first write of each object: backed up first
            guard.commit({"gpu_anchor/step": b"%d" % step})   # atomic with the drop of backups

State machine (journal keys under ``gpu_anchor/guard/``, per protected object X)::

    clean ──first write of X in group g: copy X → backup(X), then commit b/X=g──▶ backed
    backed ──more writes of X in g──▶ backed
    backed(all) ──commit(g): one journal commit deletes every b/X + applies the user's puts──▶ clean
    backed ──crash; recover(): copy backup(X) → X, then delete b/X──▶ clean

Invariant: whenever the journal has no ``b/X``, X holds its value at the last
committed group or X was not written since; whenever it has ``b/X``, ``backup(X)``
holds that value.  Failure points: crash during the backup copy (no ``b/X`` yet, X
untouched: nothing to do); after ``b/X`` and during/after writes (X restored from
the backup); during ``commit`` (atomic: either the whole group is committed or the
rollback restores all of it); during ``recover`` (idempotent: run again).

Backups are anchored objects of the namespace ``<ns>/guard`` in the same daemon
(GPU-side: a device-to-device copy), or in the host daemon if that fails for lack
of memory, so they and the journal survive the worker.  On CUDA the copy is
synchronised before the journal names it, since the journal must never point to a
backup still in a queue.  Writes the dispatcher cannot see are not covered (use
``tracker.declare_write`` or validation).
"""
from __future__ import annotations

import torch
from torch.utils._python_dispatch import _disable_current_modes

from gpu_anchor.client.client import Client
from gpu_anchor.journal_keys import INCONSISTENT_KEY

PREFIX = "gpu_anchor/guard/"


class GroupGuard:
    wants_touched = False

    def __init__(self, client, tracker, tensors: dict[str, torch.Tensor], host_socket: str | None = None) -> None:
        """Protect ``tensors`` (anchored objects of ``client``'s namespace, by object name)."""
        self.client, self.tracker = client, tracker
        self.host_socket = host_socket
        self.protected: dict[str, str] = {}   # tracker key -> object name
        self.tensors: dict[str, torch.Tensor] = {}
        for name, t in tensors.items():
            key = tracker.name_of(t)
            if key is None:
                key = name
                tracker.register(key, t)
            self.protected[key] = name
            self.tensors[name] = t
        self._backups: dict[str, torch.Tensor] = {}
        self._backup_client = Client(client.device, f"{client.namespace}/guard", client.socket_path)
        self._host_client: Client | None = None
        self.group: int | None = None
        self.backed: set[str] = set()
        self.stats = {"backups": 0, "backup_bytes": 0, "host_backups": 0, "rolled_back": 0}
        tracker.add_listener(self)

    # ------------------------------------------------------------------ protocol
    def recover(self) -> list[str]:
        """Roll back every object written by an uncommitted group; returns their names."""
        entries = self.client.journal.get_many(prefix=PREFIX + "b/")
        names = [k[len(PREFIX) + 2:] for k in entries]
        with _disable_current_modes(), torch.no_grad():
            for name, value in zip(names, entries.values()):
                if name not in self.tensors:
                    self._give_up(f"the guard journal names {name!r}, which this worker does not protect: "
                                  "recover with the program that wrote it, or restore from a checkpoint")
                where = value.split()[1].decode() if len(value.split()) > 1 else "device"
                backup = self._backup(name, where, create=False)
                if backup is None:
                    self._give_up(f"the backup of {name!r} is gone: restore from a checkpoint")
                self.tensors[name].copy_(backup)
            if self.client.device.startswith("cuda") and names:
                torch.cuda.synchronize(torch.device(self.client.device))
        if names:
            self.client.journal.commit(deletes=list(entries))
        self.stats["rolled_back"] += len(names)
        return names

    def _give_up(self, reason: str) -> None:
        """State that cannot be rolled back: tell the supervisor (restore, do not reuse), then raise."""
        self.client.journal.commit({INCONSISTENT_KEY: reason.encode()})
        raise RuntimeError(reason)

    def begin(self, group: int) -> None:
        if self.group is not None:
            raise RuntimeError(f"group {self.group} is still open: commit it first")
        self.group = group
        self.backed = set()

    def commit(self, puts: dict[str, bytes] | None = None) -> int:
        """Close the group: the user's ``puts`` and the drop of every backup in one journal commit."""
        if self.group is None:
            raise RuntimeError("no group is open")
        if self.client.device.startswith("cuda"):  # the group's writes are done before it counts
            torch.cuda.current_stream(torch.device(self.client.device)).synchronize()
        version = self.client.journal.commit(puts or {}, deletes=[PREFIX + "b/" + n for n in sorted(self.backed)])
        self.group = None
        self.backed = set()
        return version

    def close(self) -> None:
        self.tracker.remove_listener(self)

    # ------------------------------------------------------------------ listener
    def before_op(self, func, written, touched) -> None:
        if self.group is None or not written:
            return
        need = [self.protected[k] for k in written if k in self.protected and self.protected[k] not in self.backed]
        if need:
            self._backup_now(need)

    def after_op(self, func, written) -> None:
        pass

    # ------------------------------------------------------------------ backups
    def _backup_now(self, names: list[str]) -> None:
        puts = {}
        with _disable_current_modes(), torch.no_grad():
            for n in names:
                t = self.tensors[n]
                b, where = self._backup(n, "device", create=True), "device"
                if b is None:
                    b, where = self._backup(n, "host", create=True), "host"
                    self.stats["host_backups"] += 1
                b.copy_(t)
                puts[PREFIX + "b/" + n] = b"%d %s" % (self.group, where.encode())
                self.stats["backups"] += 1
                self.stats["backup_bytes"] += t.numel() * t.element_size()
            if self.client.device.startswith("cuda"):
                torch.cuda.current_stream(torch.device(self.client.device)).synchronize()
        self.client.journal.commit(puts)
        self.backed.update(names)

    def _backup(self, name: str, where: str, create: bool) -> torch.Tensor | None:
        key = (name, where)
        if key in self._backups:
            return self._backups[key]
        t = self.tensors[name]
        client = self._backup_client if where == "device" else self._host()
        if client is None:
            return None
        try:
            b = client.bind([(name, tuple(t.shape), t.dtype)], "match_or_create" if create else "lookup")[0].tensor
        except Exception:
            if where == "device" and create:
                return None  # no device memory for it: the caller falls back to the host daemon
            raise
        if b is not None:
            self._backups[key] = b
        return b

    def _host(self) -> Client | None:
        if self.client.device == "cpu":
            return self._backup_client
        if self._host_client is None:
            try:
                self._host_client = Client("cpu", f"{self.client.namespace}/guard/{self.client.device}",
                                           self.host_socket)
            except Exception:
                return None
        return self._host_client
