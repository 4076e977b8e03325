"""Which registered objects an aten op writes, and where a tensor lives (torch, no dispatch mode).

- ``ObjectMap``: registered objects by address range (non-overlapping, one address space for
  host and CUDA memory); ``find`` maps any tensor or view to the object its first byte is in.
- ``written_tensors(func, args, kwargs)``: the tensors an op's schema marks as mutated
  (``alias_info.is_write``: in-place ``self``, ``out=``, ``_foreach_*_`` lists); ``_info``
  caches per op its written argument slots and whether it is a pure view (which touches no
  bytes).

``writeset.WriteSetTracker`` uses both on every op while a listener is attached.
"""
from __future__ import annotations

import bisect

import torch


def _span(t: torch.Tensor) -> tuple[int, int] | None:
    """(start, end) of the storage ``t`` lives in; None for meta / storage-less tensors."""
    if t.device.type == "meta":
        return None
    try:
        st = t.untyped_storage()
        start, n = st.data_ptr(), st.nbytes()
    except (RuntimeError, NotImplementedError):
        return None
    if start == 0 or n == 0:
        return None
    return start, start + n


class ObjectMap:
    """Registered objects by address range; non-overlapping.

    One address space for every device: host mappings and CUDA allocations share the
    process's virtual address space (UVA), so an address names one object.  Lookups use
    ``data_ptr()`` only (a view's first byte lies inside the object it views): the
    dispatch path pays a pointer read and a bisect per tensor argument.
    """

    def __init__(self) -> None:
        self.tensors: dict[str, torch.Tensor] = {}
        self._starts: list[int] = []
        self._items: list[tuple[int, str]] = []  # (end, name), parallel to _starts

    def add(self, name: str, tensor: torch.Tensor) -> None:
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"{name!r}: expected a tensor, got {type(tensor).__name__}")
        if name in self.tensors:
            self.remove(name)
        span = _span(tensor)
        if span is None:
            raise ValueError(f"{name!r} has no storage (meta or empty tensor) and cannot be tracked")
        start, end = span
        starts, items = self._starts, self._items
        i = bisect.bisect_left(starts, start)
        if (i > 0 and items[i - 1][0] > start) or (i < len(starts) and starts[i] < end):
            other = items[i - 1][1] if i > 0 and items[i - 1][0] > start else items[i][1]
            raise ValueError(f"{name!r} overlaps the registered object {other!r}")
        starts.insert(i, start)
        items.insert(i, (end, name))
        self.tensors[name] = tensor

    def remove(self, name: str) -> None:
        t = self.tensors.pop(name, None)
        if t is None:
            return
        i = next(k for k, (_, n) in enumerate(self._items) if n == name)
        del self._starts[i], self._items[i]

    def find(self, t: torch.Tensor) -> str | None:
        try:
            ptr = t.data_ptr()
        except (RuntimeError, NotImplementedError):  # fake / functional tensors: no memory
            return None
        i = bisect.bisect_right(self._starts, ptr) - 1
        if i >= 0 and ptr and self._items[i][0] > ptr:
            return self._items[i][1]
        return None


def _write_slots(func) -> list[tuple[int, str, bool]]:
    """(position, name, kwarg_only) of every argument the schema says is written."""
    slots = []
    for i, arg in enumerate(func._schema.arguments):
        if arg.alias_info is not None and arg.alias_info.is_write:
            slots.append((i, arg.name, arg.kwarg_only))
    return slots


def _tensors_in(value):
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, (list, tuple)):
        for v in value:
            if isinstance(v, torch.Tensor):
                yield v


def written_tensors(func, args, kwargs) -> list[torch.Tensor]:
    """The tensors ``func(*args, **kwargs)`` declares it writes (from its schema)."""
    out = []
    for i, name, kwarg_only in _info(func)[0]:
        if not kwarg_only and i < len(args):
            value = args[i]
        else:
            value = kwargs.get(name)
        out.extend(_tensors_in(value))
    return out


_INFO: dict = {}


def _info(func) -> tuple[list, bool]:
    """``(write slots, is a pure view)`` of an op, cached.  A pure view (``t``, ``view``,
    ``detach``, ``select`` ...) neither reads nor writes bytes: the op that later uses the
    view is the one that touches the object."""
    info = _INFO.get(func)
    if info is None:
        schema = hasattr(func, "_schema")
        slots = _write_slots(func) if schema else []
        info = _INFO[func] = (slots, bool(schema and not slots and getattr(func, "is_view", False)))
    return info
