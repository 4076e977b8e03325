"""Write sets by speculation: which anchored objects is each aten op about to write?

PhoenixOS infers a kernel's buffers from its launch arguments and validates the
guess with binary instrumentation.  At the PyTorch level the guess is exact for
every aten op: ``op._schema.arguments[i].alias_info.is_write`` marks each
argument the op mutates — in-place ``self``, ``out=`` and the tensor lists of
``_foreach_*_`` ops alike.  What the schema cannot see (a custom op or Triton
kernel that mutates an input without declaring it, NCCL writing a buffer) is
caught by ``validation`` and then treated conservatively (every tensor argument
of such an op counts as written).

One ``WriteSetTracker`` serves every user: the concurrent checkpointer (soft
copy-on-write / soft recopy), the group copy-on-write guard, on-demand restore
and validation.  Each registers a *listener*; for every op the tracker calls
``listener.before_op(func, written, touched)`` before the op runs and
``listener.after_op(func, written)`` after it, where ``written`` / ``touched``
are lists of registered object names (``touched`` = every object any tensor
argument lives in, computed only when some listener sets ``wants_touched``).

Contract: register the objects (``register``/``register_many``) and keep the
tracker active (``with tracker:``) around all code that may touch them while a
listener is attached.  Resolution is per object: a write into a view of an
object counts as a write of the whole object.
"""
from __future__ import annotations

import bisect
import threading

import torch
from torch.utils._python_dispatch import TorchDispatchMode


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
    for i, name, kwarg_only in _slots_cached(func):
        if not kwarg_only and i < len(args):
            value = args[i]
        else:
            value = kwargs.get(name)
        out.extend(_tensors_in(value))
    return out


_SLOTS: dict = {}


def _slots_cached(func):
    slots = _SLOTS.get(func)
    if slots is None:
        slots = _SLOTS[func] = _write_slots(func) if hasattr(func, "_schema") else []
    return slots


class WriteSetTracker(TorchDispatchMode):
    """A dispatch mode that tells listeners which registered objects each op writes / touches."""

    def __init__(self) -> None:
        super().__init__()
        self.objects = ObjectMap()
        self.listeners: list = []
        self._want_touched = False
        self.conservative: set = set()  # ops learnt to write without declaring it
        self.ops_seen = 0
        self._lock = threading.Lock()

    # ------------------------------------------------------------------ registry
    def register(self, name: str, tensor: torch.Tensor) -> None:
        self.objects.add(name, tensor)

    def register_many(self, tensors: dict[str, torch.Tensor]) -> None:
        for n, t in tensors.items():
            self.register(n, t)

    def unregister(self, *names: str) -> None:
        for n in names:
            self.objects.remove(n)

    @property
    def tensors(self) -> dict[str, torch.Tensor]:
        return self.objects.tensors

    def name_of(self, t: torch.Tensor) -> str | None:
        return self.objects.find(t)

    # ------------------------------------------------------------------ listeners
    def add_listener(self, listener) -> None:
        with self._lock:
            if listener not in self.listeners:
                self._set([*self.listeners, listener])

    def remove_listener(self, listener) -> None:
        with self._lock:
            self._set([x for x in self.listeners if x is not listener])

    def _set(self, listeners) -> None:
        # swapped whole: the dispatch path reads both without a lock
        self._want_touched = any(getattr(x, "wants_touched", False) for x in listeners)
        self.listeners = listeners

    @property
    def active(self) -> bool:
        """Is this tracker on the calling thread's dispatch-mode stack?"""
        from torch.utils._python_dispatch import _get_current_dispatch_mode_stack
        return any(m is self for m in _get_current_dispatch_mode_stack())

    def treat_as_writing(self, func) -> None:
        """From now on every tensor argument of ``func`` counts as written (after a validation miss)."""
        self.conservative.add(func)

    # ------------------------------------------------------------------ speculation
    # Both dedupe through a dict (insertion order = first-seen order): a list's ``in`` made a
    # _foreach_ op over 120 objects cost 140 us (written) / 420 us (touched, 240) on CPU.
    def written(self, func, args, kwargs) -> list[str]:
        if func in self.conservative:
            return self.touched(args, kwargs)
        find, names = self.objects.find, {}
        for t in written_tensors(func, args, kwargs):
            n = find(t)
            if n is not None:
                names[n] = None
        return list(names)

    def touched(self, args, kwargs) -> list[str]:
        find, names = self.objects.find, {}
        for value in (*args, *kwargs.values()):
            for t in _tensors_in(value):
                n = find(t)
                if n is not None:
                    names[n] = None
        return list(names)

    def declare_write(self, *names: str, func: str = "declared") -> None:
        """Announce a write the dispatcher cannot see (NCCL, a raw kernel) before doing it."""
        for listener in self.listeners:
            listener.before_op(func, list(names), list(names))
        for listener in self.listeners:
            listener.after_op(func, list(names))

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        listeners = self.listeners
        if not listeners or not self.objects.tensors:
            return func(*args, **kwargs)
        self.ops_seen += 1
        written = self.written(func, args, kwargs)
        touched = self.touched(args, kwargs) if self._want_touched else None
        for listener in listeners:
            listener.before_op(func, written, touched)
        out = func(*args, **kwargs)
        for listener in listeners:
            listener.after_op(func, written)
        return out


class Recorder:
    """A listener that records write sets per group (step) and first-touch order.

    ``bytes_written_last`` (bytes of distinct objects written in the last closed
    group) feeds the checkpointer's choice between soft copy-on-write and soft recopy;
    ``write_order_last`` (objects in the order the last group first wrote them) orders
    its copier, so what the job will write first is copied first.
    """

    wants_touched = True

    def __init__(self, tracker: WriteSetTracker) -> None:
        self.tracker = tracker
        self.group_written: dict[str, None] = {}  # insertion order = first-write order
        self.bytes_written_last: int | None = None
        self.write_order_last: list[str] = []
        self.first_touch: list[str] = []
        self._touched: set[str] = set()

    def before_op(self, func, written, touched) -> None:
        for n in written:
            self.group_written.setdefault(n)
        for n in touched or ():
            if n not in self._touched:
                self._touched.add(n)
                self.first_touch.append(n)

    def after_op(self, func, written) -> None:
        pass

    def close_group(self) -> set[str]:
        """End a group (a step): remember its write volume; returns the names written."""
        done, self.group_written = self.group_written, {}
        ts = self.tracker.tensors
        self.bytes_written_last = sum(ts[n].numel() * ts[n].element_size() for n in done if n in ts)
        self.write_order_last = list(done)
        return set(done)
