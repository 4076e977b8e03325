"""Memory backends of the daemon (torch-free).

A backend makes segments (``create(size) -> handle``), exports a fresh
descriptor for one (``export(handle) -> fd``; the caller closes it after
sending) and returns them (``release(handle)``).
"""
from __future__ import annotations


def open_backend(device: str):
    if device == "cpu":
        from .host import HostBackend
        return HostBackend()
    from .cuda import CudaBackend
    return CudaBackend(int(device.split(":")[1]))
