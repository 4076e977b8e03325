"""Host memory as memfd segments: anchors CPU tensors, and lets every test run without a GPU."""
from __future__ import annotations

import os

from ..registry import OutOfMemory

GRANULARITY = 2 << 20


def available_memory() -> int:
    """MemAvailable, further capped by a cgroup v2 memory limit if one is set."""
    avail = None
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                avail = int(line.split()[1]) * 1024
    try:
        with open("/sys/fs/cgroup/memory.max") as f:
            limit = f.read().strip()
        with open("/sys/fs/cgroup/memory.current") as f:
            current = int(f.read())
        if limit != "max":
            avail = min(avail, int(limit) - current) if avail is not None else int(limit) - current
    except OSError:
        pass
    return avail if avail is not None else 1 << 62


class HostBackend:
    kind = "host"
    granularity = GRANULARITY

    def __init__(self) -> None:
        self.device = "cpu"

    def create(self, size: int) -> int:
        if size > available_memory():
            raise OutOfMemory(f"{size} B requested, {available_memory()} B of host memory available")
        fd = os.memfd_create(f"gpu-anchor-{size}", os.MFD_CLOEXEC)
        try:
            os.ftruncate(fd, size)
        except OSError as e:
            os.close(fd)
            raise OutOfMemory(str(e)) from None
        return fd

    def export(self, handle: int) -> int:
        return os.dup(handle)

    def release(self, handle: int) -> None:
        os.close(handle)

    def info(self) -> dict:
        return {"backend": self.kind, "device": self.device, "granularity": self.granularity,
                "available_bytes": available_memory()}
