"""Packing objects into backend segments (plain Python, torch-free).

Every backend allocation ("segment") is a multiple of the allocation
granularity (2 MiB on the H200).  Giving each tiny norm weight its own segment
would waste most of it and cost one mapping each (~60 µs on the H200), so
objects are placed best-fit into the free extents of existing segments, and
what does not fit is packed end to end into new segments (up to 1 GiB each;
a larger object gets one of its own), rounded up to the granularity once per
segment.  The tail left by that rounding serves later small objects, so the
waste of an LLM-shaped tensor set stays well under 1 %.

Segments are returned to the backend as soon as their last object is freed.
Segment ids are never reused within a daemon's life, so a client may cache its
mapping of a segment by id.
"""
from __future__ import annotations

import bisect
from dataclasses import dataclass, field
from typing import Any, Callable

ALIGN = 512  # torch's own CUDA allocator aligns to 512 B; vectorised kernels rely on it
MAX_PACK = 1 << 30  # a new segment packs a batch's objects up to this size


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
        return self.allocate_many([nbytes])[0]

    def allocate_many(self, sizes: list[int]) -> list[tuple[Segment, int]]:
        """Place a batch: best fit into existing free extents first, then pack the rest
        end to end, in request order, into new segments of up to ``MAX_PACK`` bytes.

        Packing a whole batch (a model's parameters, bound in one call) wastes at most
        one granule's rounding per new segment, whatever the tensors' sizes, and keeps the
        number of segments a worker must map small.  All or nothing: on failure every
        placement made by this call is released again.
        """
        placed: list[tuple[Segment, int] | None] = [None] * len(sizes)
        pending = []
        try:
            for k, nbytes in enumerate(sizes):
                need = self.footprint(nbytes)
                hit = self._best_fit(need)
                if hit is None:
                    pending.append(k)
                else:
                    placed[k] = self._take(hit[0], hit[1], need)
            groups, current, used = [], [], 0
            for k in pending:
                need = self.footprint(sizes[k])
                if current and used + need > MAX_PACK:
                    groups.append(current)
                    current, used = [], 0
                current.append(k)
                used += need
            if current:
                groups.append(current)
            for group in groups:
                size = round_up(sum(self.footprint(sizes[k]) for k in group), self.granularity)
                handle = self._create(size)
                seg = Segment(self._next_id, size, handle, [(0, size)])
                self._next_id += 1
                self.segments[seg.id] = seg
                for k in group:
                    placed[k] = self._take(seg, 0, self.footprint(sizes[k]))
        except BaseException:
            for k, p in enumerate(placed):
                if p is not None:
                    self.release(p[0].id, p[1], sizes[k])
            raise
        return placed

    def _best_fit(self, need: int) -> tuple[Segment, int] | None:
        best = None  # (waste, segment, index)
        for seg in self.segments.values():
            for i, (_, length) in enumerate(seg.free):
                if length >= need and (best is None or length - need < best[0]):
                    best = (length - need, seg, i)
                    if best[0] == 0:
                        return seg, i
        return None if best is None else (best[1], best[2])

    @staticmethod
    def _take(seg: Segment, index: int, need: int) -> tuple[Segment, int]:
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
