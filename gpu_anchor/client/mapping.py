"""Mapping daemon segments into this process and wrapping objects as tensors, with no copy.

A *segment* is one backend allocation received as a file descriptor; it is
mapped once per process and shared by every object placed in it.  A *lease*
is this process's hold on one named object: the tensor's storage keeps the
lease alive (host: the lease is the buffer ``torch.frombuffer`` wraps; CUDA:
the lease is the ``__cuda_array_interface__`` owner ``torch.as_tensor`` keeps),
so when the last tensor or view over the object dies, the lease dies and
reports the free to its client.  Leases report nothing during interpreter
shutdown or in a forked child, and a crash runs no code at all: in those
cases the object stays in the daemon for the next worker.
"""
from __future__ import annotations

import mmap
import os
import sys
from typing import Callable

import torch

from gpu_anchor.cuda_driver import check, device_uuid, driver, posix_fd_handle_type

_PAGE = mmap.PAGESIZE
shutting_down = False  # set by the client's atexit hook


def torch_dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise TypeError(f"torch {torch.__version__} has no dtype {name!r}")
    return dtype


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


class _LeaseMixin:
    """Reports the end of this process's hold on an object, when that is safe."""

    def _init_lease(self, name: str, generation: int, on_release: Callable[[str, int], None] | None) -> None:
        self.name, self.generation = name, generation
        self._on_release, self._pid = on_release, os.getpid()

    def _report_release(self) -> None:
        cb = self._on_release
        if cb is None or shutting_down or sys.is_finalizing() or os.getpid() != self._pid:
            return
        try:
            cb(self.name, self.generation)
        except Exception:
            pass


# ---------------------------------------------------------------------- host
class HostSegment:
    def __init__(self, seg_id: int, fd: int, size: int) -> None:
        self.id, self.fd, self.size = seg_id, fd, size

    def __del__(self) -> None:
        try:
            os.close(self.fd)
        except OSError:
            pass


class HostLease(mmap.mmap, _LeaseMixin):
    """A MAP_SHARED window over one object; its buffer is what the tensor wraps."""

    def __del__(self) -> None:
        self._report_release()


class HostMapper:
    device = torch.device("cpu")

    def open_segment(self, seg_id: int, fd: int, size: int) -> HostSegment:
        return HostSegment(seg_id, fd, size)

    def lease(self, seg: HostSegment, offset: int, nbytes: int, name: str, generation: int, on_release):
        base = offset - offset % _PAGE
        lease = HostLease(seg.fd, offset - base + nbytes, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE,
                          offset=base)
        lease._init_lease(name, generation, on_release)
        lease.segment, lease.delta, lease.nbytes = seg, offset - base, nbytes
        return lease

    @staticmethod
    def raw(lease: HostLease) -> torch.Tensor:
        return torch.frombuffer(lease, dtype=torch.uint8, count=lease.nbytes, offset=lease.delta)


# ---------------------------------------------------------------------- cuda
class CudaSegment:
    """An imported allocation mapped at a fresh address in this process's context."""

    def __init__(self, seg_id: int, fd: int, size: int, ordinal: int) -> None:
        drv = driver()
        self.id, self.size, self.ordinal, self.ptr = seg_id, size, ordinal, 0
        try:
            handle = check("cuMemImportFromShareableHandle",
                           drv.cuMemImportFromShareableHandle(fd, posix_fd_handle_type()))
        finally:
            os.close(fd)
        try:
            self.ptr = int(check("cuMemAddressReserve", drv.cuMemAddressReserve(size, 0, 0, 0)))
            check("cuMemMap", drv.cuMemMap(self.ptr, size, 0, handle, 0))
            desc = drv.CUmemAccessDesc()
            desc.location.type = drv.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
            desc.location.id = ordinal
            desc.flags = drv.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE
            check("cuMemSetAccess", drv.cuMemSetAccess(self.ptr, size, [desc], 1))
        except BaseException:
            self._unmap()
            raise
        finally:
            check("cuMemRelease", drv.cuMemRelease(handle))  # the mapping holds its own reference

    def _unmap(self) -> None:
        if not self.ptr:
            return
        drv = driver()
        drv.cuMemUnmap(self.ptr, self.size)
        drv.cuMemAddressFree(self.ptr, self.size)
        self.ptr = 0

    def __del__(self) -> None:
        if self.ptr and not sys.is_finalizing():
            try:
                torch.cuda.synchronize(self.ordinal)  # no kernel may still touch the range
            except Exception:
                pass
            self._unmap()


class CudaLease(_LeaseMixin):
    def __init__(self, seg: CudaSegment, offset: int, nbytes: int) -> None:
        self.segment, self.offset, self.nbytes = seg, offset, nbytes

    @property
    def __cuda_array_interface__(self) -> dict:
        return {"shape": (self.nbytes,), "typestr": "|u1", "data": (self.segment.ptr + self.offset, False),
                "version": 2, "strides": None}

    def __del__(self) -> None:
        if not (shutting_down or sys.is_finalizing()) and os.getpid() == self._pid:
            try:  # kernels queued on this object must finish before the daemon may reuse it
                torch.cuda.synchronize(self.segment.ordinal)
            except Exception:
                pass
        self._report_release()


class CudaMapper:
    def __init__(self, ordinal: int, daemon_uuid: str | None) -> None:
        self.ordinal = ordinal
        self.device = torch.device("cuda", ordinal)
        torch.cuda.init()
        torch.cuda.set_device(ordinal)
        torch.empty(0, device=self.device)  # make the primary context current on this thread
        mine = device_uuid(ordinal)
        if daemon_uuid and daemon_uuid != mine:
            raise RuntimeError(
                f"the daemon for cuda:{ordinal} manages {daemon_uuid}, but this process's cuda:{ordinal} is {mine}: "
                "start daemons with the same CUDA_VISIBLE_DEVICES as the workers")

    def open_segment(self, seg_id: int, fd: int, size: int) -> CudaSegment:
        return CudaSegment(seg_id, fd, size, self.ordinal)

    def lease(self, seg: CudaSegment, offset: int, nbytes: int, name: str, generation: int, on_release):
        lease = CudaLease(seg, offset, nbytes)
        lease._init_lease(name, generation, on_release)
        return lease

    def raw(self, lease: CudaLease) -> torch.Tensor:
        return torch.as_tensor(lease, device=self.device)


def as_typed(raw: torch.Tensor, dtype: torch.dtype, shape) -> torch.Tensor:
    return raw.view(dtype).view(tuple(shape))
