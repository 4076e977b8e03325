"""GPU memory as CUDA VMM allocations exported as POSIX file descriptors.

The daemon calls ``cuInit`` and never creates a context: ``cuMemCreate`` and
``cuMemExportToShareableHandle`` need none, so the daemon costs no GPU memory
of its own and cannot be hurt by a sticky context error.  Workers import the
descriptors and map them into their own context.
"""
from __future__ import annotations

from gpu_anchor.cuda_driver import (CudaError, check, device_allocation_prop, device_uuid, driver,
                                    posix_fd_handle_type)

from ..registry import OutOfMemory


class CudaBackend:
    kind = "cuda"

    def __init__(self, ordinal: int) -> None:
        drv = driver()
        check("cuInit", drv.cuInit(0))
        count = check("cuDeviceGetCount", drv.cuDeviceGetCount())
        if not 0 <= ordinal < count:
            raise ValueError(f"cuda:{ordinal} does not exist: {count} CUDA device(s) visible")
        self.ordinal = ordinal
        self.device = f"cuda:{ordinal}"
        self._dev = check("cuDeviceGet", drv.cuDeviceGet(ordinal))
        self._prop = device_allocation_prop(ordinal)
        flag = drv.CUmemAllocationGranularity_flags.CU_MEM_ALLOC_GRANULARITY_RECOMMENDED
        self.granularity = int(check("cuMemGetAllocationGranularity",
                                     drv.cuMemGetAllocationGranularity(self._prop, flag)))
        self.uuid = device_uuid(ordinal)
        self.total_bytes = int(check("cuDeviceTotalMem", drv.cuDeviceTotalMem(self._dev)))
        self.name = check("cuDeviceGetName", drv.cuDeviceGetName(64, self._dev)).split(b"\0")[0].decode()

    def create(self, size: int):
        drv = driver()
        try:
            return check("cuMemCreate", drv.cuMemCreate(size, self._prop, 0))
        except CudaError as e:
            if e.code == drv.CUresult.CUDA_ERROR_OUT_OF_MEMORY:
                raise OutOfMemory(f"{size} B requested on {self.device}: out of GPU memory") from None
            raise

    def export(self, handle) -> int:
        fd = check("cuMemExportToShareableHandle",
                   driver().cuMemExportToShareableHandle(handle, posix_fd_handle_type(), 0))
        return int(fd)

    def release(self, handle) -> None:
        check("cuMemRelease", driver().cuMemRelease(handle))

    def info(self) -> dict:
        out = {"backend": self.kind, "device": self.device, "granularity": self.granularity,
               "uuid": self.uuid, "name": self.name, "total_bytes": self.total_bytes}
        try:  # free memory needs a context in the driver API; NVML does not
            import pynvml
            pynvml.nvmlInit()
            mem = pynvml.nvmlDeviceGetMemoryInfo(pynvml.nvmlDeviceGetHandleByUUID(self.uuid))
            out["available_bytes"] = int(mem.free)
        except Exception:
            pass
        return out
