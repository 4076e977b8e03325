"""Element types the daemon understands, by name (torch-free).

The daemon stores a dtype as the name torch prints without the ``torch.``
prefix.  It only needs the element size, to check that a requested byte size
matches the shape; it never interprets the data.
"""
from __future__ import annotations

from gpu_anchor.errors import BadRequest

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


def _refuse(what: str, field: str, message: str, name: str | None) -> BadRequest:
    return BadRequest(f"{what}: {field} {message}", field=field, **({"name": name} if name is not None else {}))


def check_shape(shape: object, what: str = "object", name: str | None = None) -> tuple[int, ...]:
    """``shape`` as a tuple of plain non-negative ints, else ``BadRequest`` naming the entry.

    Nothing is converted: a float (``2.5``, or even ``2.0``), a string, ``None`` or a bool is
    refused, never truncated or guessed at."""
    if not isinstance(shape, (list, tuple)) or len(shape) > MAX_DIMS:
        raise _refuse(what, "shape", f"must be a list of at most {MAX_DIMS} sizes, got {shape!r:.80}", name)
    for i, d in enumerate(shape):
        if not isinstance(d, int) or isinstance(d, bool) or d < 0:
            raise _refuse(what, f"shape[{i}]", f"must be a non-negative integer, got {d!r:.40} "
                                               f"({type(d).__name__})", name)
    return tuple(shape)


def check_dtype(dtype: object, what: str = "object", name: str | None = None) -> str:
    if not isinstance(dtype, str) or dtype not in ITEMSIZE:
        raise _refuse(what, "dtype", f"{dtype!r:.40} is not one of: {', '.join(sorted(ITEMSIZE))}", name)
    return dtype


def nbytes_of(dtype: object, shape: object, what: str = "object", name: str | None = None) -> int:
    n = ITEMSIZE[check_dtype(dtype, what, name)]
    for d in check_shape(shape, what, name):
        n *= d
    return n


def describe(dtype: str, shape) -> str:
    return f"{dtype}{list(shape)}"
