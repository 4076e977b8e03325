"""Split parameters (and their optimizer state) into protocol chunks (no torch).

A chunk is a list of slices ``(param_index, start, stop)`` over the flattened
parameters; one parameter may span several chunks.  Every chunk costs at most
``chunk_bytes`` of undo space (parameter slice + its optimizer-state slices, each
padded to ``ALIGN`` bytes), so the two undo slots together are ``2 * chunk_bytes``.
Slice boundaries fall on multiples of ``GRAIN`` elements so device kernels keep their
vectorised paths.  The plan depends only on the parameter sizes and ``chunk_bytes``:
the same inputs give the same chunks in every worker.
"""
from __future__ import annotations

from dataclasses import dataclass

ALIGN = 64      # bytes: each tensor slice inside an undo slot starts on this boundary
GRAIN = 64      # elements: slice boundaries are multiples of this (except at a tensor's end)
DEFAULT_FRACTION = 0.02   # both undo slots together <= 2 % of the anchored training state
MIN_CHUNK_BYTES = 256 << 10


@dataclass(frozen=True)
class Slice:
    param: int
    start: int
    stop: int


def _pad(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


def slice_bytes(n: int, elem_sizes: list[int]) -> int:
    """Undo bytes of ``n`` elements of one parameter whose chunk tensors have ``elem_sizes``."""
    return sum(_pad(n * es) for es in elem_sizes)


def default_chunk_bytes(state_bytes: int, fraction: float = DEFAULT_FRACTION) -> int:
    """Per-slot budget so that both slots are ``fraction`` of ``state_bytes`` (floor 256 KiB)."""
    return max(MIN_CHUNK_BYTES, int(state_bytes * fraction / 2))


def plan(numels: list[int], elem_sizes: list[list[int]], chunk_bytes: int) -> list[list[Slice]]:
    """Greedy, in parameter order: fill a chunk up to ``chunk_bytes``, splitting big parameters.

    ``elem_sizes[p]`` lists the element sizes of parameter ``p`` and of each of its
    optimizer-state tensors (all shaped like the parameter).
    """
    if len(numels) != len(elem_sizes):
        raise ValueError("numels and elem_sizes differ in length")
    per_elem_max = max((sum(es) for es in elem_sizes), default=1)
    if chunk_bytes < GRAIN * per_elem_max + ALIGN * max((len(es) for es in elem_sizes), default=1):
        raise ValueError(f"chunk_bytes={chunk_bytes} is too small to hold {GRAIN} elements of a parameter")
    chunks: list[list[Slice]] = []
    cur: list[Slice] = []
    used = 0
    for p, (n, es) in enumerate(zip(numels, elem_sizes)):
        start = 0
        while start < n:
            room = chunk_bytes - used
            take = n - start
            if slice_bytes(take, es) > room:
                # the largest multiple of GRAIN that fits (padding counted)
                take = max(0, (room - ALIGN * len(es)) // sum(es)) // GRAIN * GRAIN
                while take > 0 and slice_bytes(take, es) > room:
                    take -= GRAIN
            if take == 0:
                chunks.append(cur)
                cur, used = [], 0
                continue
            cur.append(Slice(p, start, start + take))
            used += slice_bytes(take, es)
            start += take
    if cur:
        chunks.append(cur)
    return chunks


def layout(chunk: list[Slice], elem_sizes: list[list[int]]) -> list[list[int]]:
    """Byte offsets inside an undo slot: ``offsets[k][t]`` for slice ``k``, tensor ``t``."""
    out, off = [], 0
    for s in chunk:
        row = []
        for es in elem_sizes[s.param]:
            row.append(off)
            off += _pad((s.stop - s.start) * es)
        out.append(row)
    return out


def chunk_bytes_used(chunk: list[Slice], elem_sizes: list[list[int]]) -> int:
    return sum(slice_bytes(s.stop - s.start, elem_sizes[s.param]) for s in chunk)
