"""How a concurrent checkpoint's bytes move (``concurrent.ConcurrentCheckpointer`` decides when).

- **staging**: one pinned host tensor per object (pageable for host objects), cached by
  (name, shape, dtype), so checkpoint after checkpoint reuses the same buffers;
- **the capture point**: on CUDA a low-priority side stream made to wait for everything the
  job's stream queued so far, so background copies read the state at the consistent point;
- **background copies**: one object at a time on that stream, one chunk in the copy engines
  at a time (``transfer.chunked_copy``); a soft-recopy flight waits for the job's stream first
  (an op may have queued a write while the object was still pending);
- **foreground groups** (an op's not-yet-copied write set, copy-on-write): host objects in one
  ``_foreach_copy_``; CUDA objects cloned on the op's stream while the device-buffer budget
  allows (one event per group), the rest straight to pinned staging and one wait;
- **device-side snapshot**: the CUDA objects that fit the budget cloned at ``start`` on the
  job's stream, the job thread waiting for the clones;
- **drain**: GPU-side buffers to staging on the side stream, one chunk at a time, once the
  flight completes (in the writer thread).

The budget is ``gpu_buffer_fraction`` of the device's free memory at the flight's start.
"""
from __future__ import annotations

import torch
from torch.utils._python_dispatch import _disable_current_modes

from .transfer import CHUNK_BYTES, chunked_copy


class Copies:
    def __init__(self, chunk_bytes: int = CHUNK_BYTES, gpu_buffer_fraction: float = 0.5) -> None:
        self.chunk_bytes, self.gpu_buffer_fraction = chunk_bytes, gpu_buffer_fraction
        self.stream = self.job_stream = None
        self.gpu_budget = 0
        self._staging_cache: dict[tuple, torch.Tensor] = {}

    def staging(self, key, t) -> torch.Tensor:
        ck = (key, tuple(t.shape), t.dtype)
        buf = self._staging_cache.get(ck)
        if buf is None:
            buf = torch.empty(t.shape, dtype=t.dtype, pin_memory=t.is_cuda)
            self._staging_cache[ck] = buf
        return buf

    def set_budget(self, dev) -> None:
        self.gpu_budget = int(torch.cuda.mem_get_info(dev)[0] * self.gpu_buffer_fraction) if dev is not None else 0

    def capture_point(self, dev) -> None:
        """(CUDA) copies on the side stream start after everything the job queued so far."""
        if dev is not None:
            self.stream = self.stream or torch.cuda.Stream(device=dev, priority=0)  # 0 = the lowest priority
            self.job_stream = torch.cuda.current_stream(dev)
            self.stream.wait_stream(self.job_stream)

    def plan_device_copy(self, fl, order: list[str]) -> list[str]:
        """``device``: the CUDA objects that fit the device-buffer budget, in copy order."""
        fit = []
        for k in order:
            src = fl.entries[k][2]
            n = src.numel() * src.element_size()
            if src.is_cuda and n <= self.gpu_budget:
                self.gpu_budget -= n
                fit.append(k)
        return fit

    def copy_on_device(self, fl, keys: list[str]) -> None:
        """``device``: clone ``keys`` on their device now, on the job's stream (after everything it
        queued before this point), and wait for the clones: every write issued after ``start``
        returns, on any stream and by any kernel (aten or not), runs after them.  They are drained
        to host staging with the GPU-side copy-on-write buffers (``drain``)."""
        by_dev: dict = {}
        for k in keys:
            by_dev.setdefault(fl.entries[k][2].device, []).append(k)
        with torch.no_grad(), _disable_current_modes():
            for dev, ks in by_dev.items():
                bufs = [fl.entries[k][2].clone() for k in ks]
                ev = torch.cuda.Event()
                ev.record(torch.cuda.current_stream(dev))
                fl.gpu_groups.append((ks, bufs, ev))
            for _, _, ev in fl.gpu_groups:
                ev.synchronize()
        fl.result.gpu_buffered += len(keys)

    def move_many(self, fl, keys: list[str], foreground: bool) -> None:
        """Copy several objects as one group (an op's not-yet-copied write set), on the calling
        thread.  Host objects: one ``_foreach_copy_`` into staging.  CUDA objects, foreground:
        a device-side clone of each while the budget allows (on the op's stream, so ordered
        before its write; one event for the group, which the drain waits for), the rest straight
        to pinned host staging on the op's stream and one wait."""
        if not foreground:
            for k in keys:
                self.copy(fl, k)
            return
        host, cuda = [], {}
        for k in keys:
            src = fl.entries[k][2]
            if src.is_cuda:
                cuda.setdefault(src.device, []).append(k)
            else:
                host.append(k)
        with torch.no_grad(), _disable_current_modes():
            if host:
                torch._foreach_copy_([fl.staging[k] for k in host], [fl.entries[k][2] for k in host])
            for dev, ks in cuda.items():
                self._copy_cuda_group(fl, dev, ks)

    def _copy_cuda_group(self, fl, dev, keys: list[str]) -> None:
        stream = torch.cuda.current_stream(dev)
        fit, direct, need = [], [], 0
        for k in keys:
            src = fl.entries[k][2]
            nbytes = src.numel() * src.element_size()
            if need + nbytes <= self.gpu_budget:
                fit.append(k)
                need += nbytes
            else:
                direct.append(k)
        if fit:
            self.gpu_budget -= need
            # one clone per object (the caching allocator reuses its blocks checkpoint after
            # checkpoint); one packed buffer for the whole group measured 3x slower on the H200
            # (101.7 vs 31.2 ms stall per checkpoint: a multi-GB allocation per op)
            bufs = [fl.entries[k][2].clone() for k in fit]
            ev = torch.cuda.Event()
            ev.record(stream)  # the drain waits for these copies
            fl.gpu_groups.append((fit, bufs, ev))
            fl.result.gpu_buffered += len(fit)
        if direct:  # no GPU memory to spare: to pinned host on the op's stream, then wait once
            torch._foreach_copy_([fl.staging[k] for k in direct], [fl.entries[k][2] for k in direct],
                                 non_blocking=True)
            stream.synchronize()

    def copy(self, fl, key: str) -> None:
        """One object, background copier."""
        _, _, src = fl.entries[key]
        dst = fl.staging[key]
        if not src.is_cuda:
            with torch.no_grad(), _disable_current_modes():
                dst.copy_(src)
            return
        if fl.result.policy == "recopy":
            # an op may have queued a write while this object was PENDING (so it is not dirty):
            # copy after everything the job has queued so far, never before it
            self.stream.wait_stream(self.job_stream)
        chunked_copy(dst, src, self.stream, self.chunk_bytes)

    def sync(self) -> None:
        if self.stream is not None:
            torch.cuda.synchronize(self.stream.device)

    def drain(self, fl) -> None:
        """GPU-side copy-on-write buffers → host staging, on the low-priority stream, one chunk in
        the copy engines at a time (``chunked_copy``), as the background copier already did.
        Enqueued all at once (12 GB, the MLP benchmark on the H200), the drain coincided once
        with a training step of 448 ms against ~225 (1 of 5 device-snapshot repetitions; the
        drain takes ~220 ms); one chunk at a time, none of the next 8 repetitions (MLP and 1B
        Llama) had such a step.  Our reading, not established: the job's work queued behind
        the side stream's copies."""
        if not fl.gpu_groups:
            return
        for keys, bufs, ev in fl.gpu_groups:
            self.stream.wait_event(ev)
            with torch.no_grad():
                for k, buf in zip(keys, bufs):
                    chunked_copy(fl.staging[k], buf, self.stream, self.chunk_bytes)
        fl.gpu_groups.clear()
