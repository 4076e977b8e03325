"""What gradient lending packs a saved tensor as, and where lent bytes go (``grad_lending``).

- ``_Kept``: a saved tensor left in torch memory, with autograd's in-place check done by hand
  (torch skips it for tensors its saved-tensor hooks packed).
- ``_Lent``: a bit-identical copy in gradient-buffer memory ``[lo, hi)``; ``grad_lending``
  moves it to torch memory (``resident`` False) before a gradient lands on those bytes.
- ``_Residents``: the lent tensors still in gradient memory, and moving them out.
- ``_Area``: a run of gradient buffers that touch end to end, one bump allocator a window.
"""
from __future__ import annotations

import bisect
import weakref

import torch


class _Kept:
    """A saved tensor the lender did not copy: autograd's own in-place check, by hand (torch
    skips it for hooked tensors)."""
    __slots__ = ("t", "version")

    def __init__(self, t: torch.Tensor) -> None:
        self.t, self.version = t.detach(), t._version

    def same(self, t: torch.Tensor) -> bool:
        """``t`` at ``self.t``'s address holds these very bytes, unchanged (``self.t`` keeps its
        storage alive, so no other storage can have that address)."""
        return _same_bytes(self.t.data_ptr(), self.version, self.t, t)


def _same_bytes(ptr: int, version: int, like: torch.Tensor, t: torch.Tensor) -> bool:
    """``t`` is at ``ptr``, at ``version``, with ``like``'s dtype, shape and strides."""
    return version == t._version and ptr == t.data_ptr() and like.dtype == t.dtype \
        and like.shape == t.shape and like.stride() == t.stride()


class _Lent:
    """A saved tensor copied into gradient memory ``[lo, hi)`` (byte addresses); ``_evict`` moves
    ``t`` to torch memory.  ``src``: a weak reference to the original's storage, whose bytes at
    ``ptr`` were saved at ``version``.  The storage, not the tensor: a linear layer given a batch
    of sequences saves a 2-D view that torch makes in C++, whose Python object dies as soon as
    the hook returns, while the storage (one Python object as long as it lives) is the input's."""
    __slots__ = ("t", "lo", "hi", "resident", "src", "ptr", "version", "__weakref__")

    def __init__(self, t: torch.Tensor, lo: int, hi: int, original: torch.Tensor) -> None:
        self.t, self.lo, self.hi, self.resident = t, lo, hi, True
        self.src, self.ptr, self.version = weakref.ref(original.untyped_storage()), original.data_ptr(), original._version

    def same(self, t: torch.Tensor) -> bool:
        """``t`` holds the original's bytes, unchanged (its storage alive keeps the address its own)."""
        s = self.src()
        return self.resident and s is not None and _same_bytes(self.ptr, self.version, self.t, t) \
            and t.untyped_storage() is s


def _unpack(packed) -> torch.Tensor:
    if isinstance(packed, _Kept) and packed.t._version != packed.version:
        raise RuntimeError(
            "one of the variables needed for gradient computation has been modified by an inplace "
            f"operation: [{packed.t.type()} {list(packed.t.shape)}] is at version {packed.t._version}; "
            f"expected version {packed.version} instead (seen by gpu_anchor's gradient lending, "
            "which keeps torch's check for the tensors it does not copy)")
    return packed.t


class _Residents:
    """Weak references to the lent tensors not yet moved out (alive: autograd holds them), in
    lending order; at the backward's first gradient, indexed by the parameters whose gradient
    bytes they lie in, so that each arrival looks at its own only.  ``stats["evicted_bytes"]``
    counts what was moved."""

    def __init__(self, params, stats: dict) -> None:
        self.params, self.stats = params, stats
        self._refs: list = []
        self._by_param: dict[int, list] | None = None

    def __bool__(self) -> bool:
        return bool(self._refs)

    def add(self, h: _Lent) -> None:
        self._refs.append(weakref.ref(h))
        self._by_param = None

    def arrived(self, index: int) -> int:
        """Parameter ``index``'s gradient is about to land: the lent tensors in its bytes moved
        out; returns their bytes."""
        if self._by_param is None:
            self._by_param = self._index()
        refs = self._by_param.pop(index, None)
        return self._evict(refs) if refs else 0

    def evict_all(self) -> None:
        if self._refs:
            self._evict(self._refs)
            self._refs, self._by_param = [], None

    def _index(self) -> dict[int, list]:
        """The live lent tensors by the parameter whose gradient bytes they overlap (lent copies
        never overlap each other: each area is a bump allocator)."""
        live = sorted(((h.lo, h.hi, r) for r in self._refs if (h := r()) is not None and h.resident),
                      key=lambda e: e[0])
        his = [hi for _, hi, _ in live]
        out: dict[int, list] = {}
        for q in self.params:
            lo = q.grad.data_ptr()
            hi = lo + q.grad.numel() * q.grad.element_size()
            i = bisect.bisect_right(his, lo)       # the first one that ends after lo
            while i < len(live) and live[i][0] < hi:
                out.setdefault(q.index, []).append(live[i][2])
                i += 1
        return out

    def _evict(self, refs) -> int:
        """Moves the lent tensors behind ``refs`` that are alive and still in gradient memory to
        torch memory; returns their bytes."""
        moved = 0
        for r in refs:
            h = r()
            if h is not None and h.resident:
                h.t = h.t.clone()
                h.resident = False
                moved += h.hi - h.lo
        self.stats["evicted_bytes"] += moved
        return moved


class _Area:
    """Address-adjacent gradient buffers: one bump allocator per window."""
    __slots__ = ("base", "end", "params", "top", "buf")

    def __init__(self, buf: torch.Tensor, params: list) -> None:
        self.buf, self.params = buf, params          # buf: a uint8 view over the whole run
        self.base = buf.data_ptr()
        self.end = self.base + buf.numel()
        self.top = self.base


class _DeviceBytes:
    """``n`` bytes of device memory at ``ptr``, for ``torch.as_tensor``: a run of gradient buffers
    that touch end to end spans several anchored objects, each its own storage."""

    def __init__(self, ptr: int, n: int) -> None:
        self.__cuda_array_interface__ = {"data": (ptr, False), "shape": (n,), "typestr": "|u1", "version": 3}


def _areas(params) -> list[_Area]:
    """The gradient buffers grouped into runs that touch end to end on a CUDA device (``layout``
    binds them in one batch, gradients first, and the arena packs a batch end to end); on the
    host each buffer is its own mapping, so its own area."""
    spans = sorted(((q.grad.data_ptr(), q.grad.numel() * q.grad.element_size(), q) for q in params
                    if q.grad.numel()), key=lambda s: s[0])
    runs: list[list] = []
    for ptr, n, q in spans:
        if runs and q.grad.is_cuda and runs[-1][0] + runs[-1][1] == ptr:
            runs[-1][1] += n
            runs[-1][2].append(q)
        else:
            runs.append([ptr, n, [q]])
    out = []
    for ptr, n, qs in runs:
        g = qs[0].grad
        buf = g.view(-1).view(torch.uint8) if len(qs) == 1 else \
            torch.as_tensor(_DeviceBytes(ptr, n), device=g.device)
        out.append(_Area(buf, qs))
    return out
