"""Packing objects into backend segments (plain Python, torch-free).

Every backend allocation ("segment") is a multiple of the allocation
granularity (2 MiB on the H200).  Giving each tiny norm weight its own segment
would waste most of it and cost one mapping each (~60 µs on the H200), so
objects are placed best-fit into the free extents of existing segments and a
new segment is made only when nothing fits.  A segment sized for a large
object is rounded up to the granularity and its tail is reused for small
objects, so the waste of an LLM-shaped tensor set stays well under 1 %.

Segments are returned to the backend as soon as their last object is freed.
Segment ids are never reused within a daemon's life, so a client may cache its
mapping of a segment by id.
"""
from __future__ import annotations

import bisect
from dataclasses import dataclass, field
from typing import Any, Callable

ALIGN = 512  # torch's own CUDA allocator aligns to 512 B; vectorised kernels rely on it


def round_up(n: int, to: int) -> int:
    return (n + to - 1) // to * to


@dataclass
class Segment:
    id: int
    size: int
    handle: Any
    free: list[tuple[int, int]] = field(default_factory=list)  # sorted (offset, length)
    live: int = 0  # objects placed here

    def free_bytes(self) -> int:
        return sum(length for _, length in self.free)


class Arena:
    """Places objects in segments obtained from ``create(size) -> handle``."""

    def __init__(self, create: Callable[[int], Any], release: Callable[[Any], None], granularity: int):
        if granularity <= 0 or granularity % ALIGN:
            raise ValueError(f"granularity {granularity} must be a positive multiple of {ALIGN}")
        self._create, self._release, self.granularity = create, release, granularity
        self.segments: dict[int, Segment] = {}
        self._next_id = 1

    @staticmethod
    def footprint(nbytes: int) -> int:
        return round_up(max(nbytes, 1), ALIGN)

    def allocate(self, nbytes: int) -> tuple[Segment, int]:
        need = self.footprint(nbytes)
        best = None  # (waste, segment, index)
        for seg in self.segments.values():
            for i, (_, length) in enumerate(seg.free):
                if length >= need and (best is None or length - need < best[0]):
                    best = (length - need, seg, i)
                    if best[0] == 0:
                        break
            if best is not None and best[0] == 0:
                break
        if best is None:
            size = round_up(need, self.granularity)
            handle = self._create(size)  # may raise; nothing changed yet
            seg = Segment(self._next_id, size, handle, [(0, size)])
            self._next_id += 1
            self.segments[seg.id] = seg
            index = 0
        else:
            _, seg, index = best
        off, length = seg.free[index]
        if length == need:
            del seg.free[index]
        else:
            seg.free[index] = (off + need, length - need)
        seg.live += 1
        return seg, off

    def release(self, segment_id: int, offset: int, nbytes: int) -> None:
        seg = self.segments[segment_id]
        need = self.footprint(nbytes)
        i = bisect.bisect_left(seg.free, (offset, 0))
        seg.free.insert(i, (offset, need))
        # coalesce with the right, then the left neighbour
        if i + 1 < len(seg.free) and offset + need == seg.free[i + 1][0]:
            seg.free[i] = (offset, need + seg.free[i + 1][1])
            del seg.free[i + 1]
        if i > 0 and seg.free[i - 1][0] + seg.free[i - 1][1] == seg.free[i][0]:
            seg.free[i - 1] = (seg.free[i - 1][0], seg.free[i - 1][1] + seg.free[i][1])
            del seg.free[i]
        seg.live -= 1
        if seg.live == 0:
            del self.segments[segment_id]
            self._release(seg.handle)

    def reserved_bytes(self) -> int:
        return sum(s.size for s in self.segments.values())

    def release_all(self) -> None:
        for seg in list(self.segments.values()):
            self._release(seg.handle)
        self.segments.clear()
