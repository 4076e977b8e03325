"""Validation of the speculated write sets (PhoenixOS validates with instrumentation).

A ``Validator`` is a tracker listener.  Around each group of ``group_ops`` ops it
checksums every registered object the group was *not* predicted to write: before
the group's first op and after its last.  A changed checksum is a speculation
miss — an op wrote an object without declaring it (a ``torch.library`` op whose
schema omits ``(a!)``, a Triton kernel, a raw pointer write).  On a miss it:

* records ``{"ops": [...], "objects": [...]}`` in ``misses``;
* blames the ops of the group that touched a missed object without declaring a
  write to it, and makes the tracker treat them as writing every tensor argument
  from then on (``tracker.treat_as_writing``), so the retaken checkpoint is safe;
* calls every ``on_miss(func, names)`` callback (the checkpointer marks its
  in-flight checkpoint invalid and retakes it at the next boundary).

Cost: a checksum of every registered object per group — a debugging / qualifying
mode, not for every run.  ``group_ops=1`` attributes each miss to one op.
"""
from __future__ import annotations

import zlib

import torch
from torch.utils._python_dispatch import _disable_current_modes


def checksum(t: torch.Tensor):
    """An exact-enough fingerprint of ``t``'s bytes (crc32 on host, two sums on device)."""
    with _disable_current_modes(), torch.no_grad():
        b = t.detach().reshape(-1).view(torch.uint8)
        if not b.is_cuda:
            return zlib.crc32(memoryview(b.numpy()))
        w = (b.view(torch.int32) if b.numel() % 4 == 0 else b).to(torch.int64)
        idx = torch.arange(w.numel(), device=w.device, dtype=torch.int64) % 65521 + 1
        return torch.stack([w.sum(), (w * idx).sum()]).tolist()


class Validator:
    wants_touched = True

    def __init__(self, tracker, group_ops: int = 1) -> None:
        if group_ops < 1:
            raise ValueError("group_ops must be >= 1")
        self.tracker = tracker
        self.group_ops = group_ops
        self.on_miss: list = []
        self.misses: list[dict] = []
        self.groups_checked = 0
        self._sums: dict | None = None
        self._ops: list = []

    def attach(self) -> "Validator":
        self.tracker.add_listener(self)
        return self

    def detach(self) -> None:
        self.flush()
        self.tracker.remove_listener(self)

    def before_op(self, func, written, touched) -> None:
        if self._sums is None:
            self._sums = {n: checksum(t) for n, t in self.tracker.tensors.items()}
            self._predicted: set[str] = set()
            self._ops = []
        self._predicted.update(written)
        self._ops.append((func, set(touched or ()), set(written)))

    def after_op(self, func, written) -> None:
        if len(self._ops) >= self.group_ops:
            self.flush()

    def flush(self) -> None:
        """Check the open group now (call at a group boundary, e.g. before a checkpoint completes)."""
        if self._sums is None:
            return
        sums, self._sums = self._sums, None
        self.groups_checked += 1
        ts = self.tracker.tensors
        missed = sorted(n for n, s in sums.items() if n not in self._predicted and n in ts and checksum(ts[n]) != s)
        if not missed:
            return
        blamed = [f for f, touched, wrote in self._ops if any(n in touched and n not in wrote for n in missed)]
        if not blamed:  # nothing in the group touched them through the dispatcher: blame the whole group
            blamed = [f for f, _, _ in self._ops]
        self.misses.append({"ops": sorted({str(f) for f in blamed}), "objects": missed})
        for f in dict.fromkeys(blamed):
            for cb in self.on_miss:
                cb(f, missed)
            self.tracker.treat_as_writing(f)
