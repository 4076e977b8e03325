"""Element types the daemon understands, by name (torch-free).

The daemon stores a dtype as the name torch prints without the ``torch.``
prefix.  It only needs the element size, to check that a requested byte size
matches the shape; it never interprets the data.
"""
from __future__ import annotations

ITEMSIZE = {
    "bool": 1, "uint8": 1, "int8": 1,
    "float8_e4m3fn": 1, "float8_e5m2": 1, "float8_e4m3fnuz": 1, "float8_e5m2fnuz": 1,
    "float8_e8m0fnu": 1,
    "int16": 2, "uint16": 2, "float16": 2, "bfloat16": 2,
    "int32": 4, "uint32": 4, "float32": 4,
    "int64": 8, "uint64": 8, "float64": 8, "complex64": 8,
    "complex128": 16,
}

MAX_DIMS = 64


def check_shape(shape: object) -> tuple[int, ...]:
    if not isinstance(shape, (list, tuple)) or len(shape) > MAX_DIMS:
        raise ValueError(f"shape must be a list of at most {MAX_DIMS} sizes, got {shape!r}")
    for d in shape:
        if not isinstance(d, int) or isinstance(d, bool) or d < 0:
            raise ValueError(f"shape sizes must be non-negative integers, got {shape!r}")
    return tuple(shape)


def nbytes_of(dtype: object, shape: object) -> int:
    if not isinstance(dtype, str) or dtype not in ITEMSIZE:
        raise ValueError(f"unknown dtype {dtype!r}; known: {', '.join(sorted(ITEMSIZE))}")
    n = ITEMSIZE[dtype]
    for d in check_shape(shape):
        n *= d
    return n


def describe(dtype: str, shape) -> str:
    return f"{dtype}{list(shape)}"
