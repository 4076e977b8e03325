"""Thin access to the CUDA driver API through NVIDIA's cuda-bindings (torch-free).

Shared by the daemon's cuda backend and the client's mapper; everything here
is importable without a GPU, and fails with an actionable message when the
bindings are missing.
"""
from __future__ import annotations

import functools


@functools.lru_cache(maxsize=None)
def driver():
    try:
        from cuda.bindings import driver as drv  # cuda-bindings >= 12.6
    except ImportError:
        try:
            from cuda import cuda as drv  # older cuda-python layout
        except ImportError:
            raise ImportError(
                "CUDA support needs NVIDIA's cuda-bindings: pip install 'gpu-anchor[cuda]' "
                "(or pip install cuda-bindings matching your driver)") from None
    return drv


class CudaError(RuntimeError):
    def __init__(self, call: str, code) -> None:
        self.code = code
        name = getattr(code, "name", str(code))
        super().__init__(f"{call} failed: {name}")


def check(call: str, result):
    """Unpack a cuda-bindings ``(CUresult, *values)`` tuple, raising on error."""
    drv = driver()
    err, *values = result if isinstance(result, tuple) else (result,)
    if err != drv.CUresult.CUDA_SUCCESS:
        raise CudaError(call, err)
    if not values:
        return None
    return values[0] if len(values) == 1 else tuple(values)


def posix_fd_handle_type():
    return driver().CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR


def device_allocation_prop(ordinal: int):
    drv = driver()
    prop = drv.CUmemAllocationProp()
    prop.type = drv.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
    prop.location.type = drv.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
    prop.location.id = ordinal
    prop.requestedHandleTypes = posix_fd_handle_type()
    return prop


def device_uuid(ordinal: int) -> str:
    drv = driver()
    dev = check("cuDeviceGet", drv.cuDeviceGet(ordinal))
    raw = check("cuDeviceGetUuid", drv.cuDeviceGetUuid(dev)).bytes
    h = bytes(raw).hex()
    return f"GPU-{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:32]}"
