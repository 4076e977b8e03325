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

import os
import sys
import threading
import weakref

import torch
from torch._C import _len_torch_dispatch_stack
from torch.utils._python_dispatch import (TorchDispatchMode, _get_current_dispatch_mode_stack, _pop_mode,
                                          _push_mode)

from .op_writes import ObjectMap, _info, _tensors_in, written_tensors  # noqa: F401  (ObjectMap: part of this API)


class _Scope:
    """One thread's tracker scopes: how deep, and whether the mode is on its dispatch stack."""
    __slots__ = ("depth", "installed", "base", "thread")

    def __init__(self, base: int) -> None:
        self.depth, self.installed, self.base = 0, False, base
        self.thread = threading.current_thread().name


_TRACKERS: "weakref.WeakSet[WriteSetTracker]" = weakref.WeakSet()


def _forget_other_threads() -> None:
    """In a forked child only the forking thread exists: other threads' scopes are gone."""
    me = threading.get_ident()
    for tr in list(_TRACKERS):
        tr._scopes = {t: sc for t, sc in tr._scopes.items() if t == me}
        tr._lock = threading.RLock()


os.register_at_fork(after_in_child=_forget_other_threads)


class WriteSetTracker(TorchDispatchMode):
    """A dispatch mode that tells listeners which registered objects each op writes / touches.

    ``with tracker:`` opens a *scope* on the calling thread; the dispatch mode is on the
    thread's stack only while the thread is in a scope **and** some listener is attached
    (docs/checkpoint.md, "When tracking is installed").  An installed mode costs every op
    of the thread a Python round trip (≈6 µs on a CPU, +19 % of an H200 training step
    measured with nobody listening), so between checkpoints nothing is installed.
    """

    def __init__(self) -> None:
        super().__init__()
        self.objects = ObjectMap()
        self.listeners: list = []
        self._want_touched = False
        self.conservative: set = set()  # ops learnt to write without declaring it
        self.ops_seen = 0
        self.lost = 0  # times the mode was found taken off a thread's stack by someone else
        self._lock = threading.RLock()
        self._scopes: dict[int, _Scope] = {}  # thread ident -> its scopes
        self._tls = threading.local()  # .calling: inside a listener callback on this thread
        _TRACKERS.add(self)

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
        """Attach ``listener``; on the calling thread, if it is in a scope, the mode is installed
        before this returns.  Refused while another thread is in a scope without the mode: that
        thread could run ops before it installs it, and the new listener would miss them."""
        with self._lock:
            if listener in self.listeners:
                return
            me = threading.get_ident()
            blind = [sc.thread for t, sc in self._scopes.items() if t != me and sc.depth and not sc.installed]
            if blind:
                raise RuntimeError(
                    f"thread {blind[0]!r} is in this tracker's scope with tracking not installed: attach "
                    f"{type(listener).__name__} on that thread (at a consistent point), or attach it before "
                    "the thread enters `with tracker:`")
            self._set([*self.listeners, listener])
            self._sync_here()

    def remove_listener(self, listener) -> None:
        """Detach ``listener``.  On the calling thread the mode comes off at once when nobody else
        listens; other threads drop theirs at their next ``sync()`` or scope exit (until then their
        ops pay the idle round trip, and nothing is missed)."""
        with self._lock:
            self._set([x for x in self.listeners if x is not listener])
            self._sync_here()

    def _set(self, listeners) -> None:
        # swapped whole: the dispatch path reads both without a lock
        self._want_touched = any(getattr(x, "wants_touched", False) for x in listeners)
        self.listeners = listeners

    def refresh(self) -> None:
        """Re-read the listeners' ``wants_touched`` (a listener that stopped needing it)."""
        self._set(self.listeners)

    # ------------------------------------------------------------------ installation
    def __enter__(self):
        with self._lock:
            sc = self._scopes.get(threading.get_ident())
            if sc is None:
                sc = self._scopes[threading.get_ident()] = _Scope(_len_torch_dispatch_stack())
            sc.depth += 1
            self._sync(sc)
        return self

    def __exit__(self, exc_type=None, exc=None, tb=None):
        self.exit_scope(threading.get_ident())
        return False

    def enter_scope(self) -> int:
        """``__enter__`` for a holder that may close the scope from another thread: returns the
        token (this thread) to pass to ``exit_scope``."""
        self.__enter__()
        return threading.get_ident()

    def exit_scope(self, thread: int) -> None:
        """Close one scope of ``thread``.  From that thread: as ``__exit__``.  From another (a
        checkpoint finished at interpreter exit on the main thread): only the depth changes; the
        owner takes the mode off at its next ``sync()`` or scope exit."""
        with self._lock:
            sc = self._scopes.get(thread)
            if sc is None or sc.depth == 0:
                raise RuntimeError("a tracker scope was exited that the thread never entered")
            sc.depth -= 1
            if thread == threading.get_ident():
                self._sync(sc)  # out of every scope: off the stack
                if sc.depth == 0:
                    del self._scopes[thread]

    def sync(self) -> bool:
        """Match the calling thread's installation to its scope and the listeners (call at a step
        boundary, not from inside an op); returns whether the mode is installed here."""
        with self._lock:
            return self._sync_here()

    @property
    def active(self) -> bool:
        """Is this tracker's mode on the calling thread's dispatch stack?"""
        return any(m is self for m in _get_current_dispatch_mode_stack())

    @property
    def in_scope(self) -> bool:
        """Is the calling thread inside ``with tracker:`` (or a checkpointer's flight)?"""
        sc = self._scopes.get(threading.get_ident())
        return sc is not None and sc.depth > 0

    def _sync_here(self) -> bool:
        sc = self._scopes.get(threading.get_ident())
        if sc is None:
            return False
        if not getattr(self._tls, "calling", False):  # inside our own dispatch the mode is off the stack
            self._sync(sc)
            if sc.depth == 0:  # its last scope was closed from another thread
                del self._scopes[threading.get_ident()]
        return sc.installed

    def _sync(self, sc: _Scope) -> None:
        if sc.installed and not self.active:  # another mode's exit popped ours: ops were not seen
            sc.installed = False
            self.lost += 1
        want = sc.depth > 0 and bool(self.listeners)
        if want and not sc.installed:
            self._install(sc)
        elif sc.installed and not want:
            self._uninstall(sc)

    @staticmethod
    def warm() -> None:
        """Pay now what the first tracked op would: torch wraps a mode's ``__torch_dispatch__`` to keep
        dynamo out of it and imports ``torch._dynamo`` at its first call (1-2 s).  Done before the mode
        is installed, that cost lands in ``start()``'s stall (or ``prepare()``), not inside an op of a
        flight whose copier is already running."""
        if hasattr(WriteSetTracker.__torch_dispatch__, "__wrapped__") and "torch._dynamo" not in sys.modules:
            import torch._dynamo  # noqa: F401

    def _install(self, sc: _Scope) -> None:
        self.warm()
        # at the scope's own place in the stack, as `with tracker:` would have pushed it: modes the
        # user entered inside the scope stay above it and pop themselves at their exit
        above = [_pop_mode() for _ in range(max(0, _len_torch_dispatch_stack() - sc.base))]
        try:
            TorchDispatchMode.__enter__(self)
        finally:
            for m in reversed(above):
                _push_mode(m)
        sc.installed = True

    def _uninstall(self, sc: _Scope) -> None:
        stack = _get_current_dispatch_mode_stack()
        at = max(i for i, m in enumerate(stack) if m is self)
        above = [_pop_mode() for _ in range(len(stack) - 1 - at)]
        try:
            TorchDispatchMode.__exit__(self, None, None, None)
        finally:
            for m in reversed(above):
                _push_mode(m)
        sc.installed = False

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
        slots, view = _info(func)
        conservative = func in self.conservative if self.conservative else False
        if view and not conservative:
            return func(*args, **kwargs)
        written = self.written(func, args, kwargs) if slots or conservative else []
        touched = self.touched(args, kwargs) if self._want_touched else None
        if not written and not touched:  # nothing registered in this op: nobody needs to hear of it
            return func(*args, **kwargs)
        self.ops_seen += 1
        tls = self._tls
        tls.calling = True
        try:
            for listener in listeners:
                listener.before_op(func, written, touched)
            out = func(*args, **kwargs)
            for listener in listeners:
                listener.after_op(func, written)
        finally:
            tls.calling = False
        return out


class Recorder:
    """A listener that records write sets per group (step) and first-touch order.

    ``bytes_written_last`` (bytes of distinct objects written in the last closed
    group) feeds the checkpointer's choice between soft copy-on-write and soft recopy;
    ``write_order_last`` (objects in the order the last group first wrote them) orders
    its copier, so what the job will write first is copied first.  ``first_touch`` is
    the order of the first group after ``reset`` (what a restored job touches first):
    once that group is closed, or every object was touched, the recorder stops asking
    for touched sets, so the rest of a flight pays only for ops that write.
    """

    def __init__(self, tracker: WriteSetTracker) -> None:
        self.tracker = tracker
        self.wants_touched = True
        self.group_written: dict[str, None] = {}  # insertion order = first-write order
        self.bytes_written_last: int | None = None
        self.write_order_last: list[str] = []
        self.first_touch: list[str] = []
        self._touched: set[str] = set()

    def reset(self) -> None:
        """A new flight: record first touches again (attach after this)."""
        self.first_touch.clear()
        self._touched.clear()
        self.group_written.clear()  # (write_order_last survives: it orders the next copy)
        self.wants_touched = True

    def _enough_touches(self) -> None:
        self.wants_touched = False
        self.tracker.refresh()

    def before_op(self, func, written, touched) -> None:
        for n in written:
            self.group_written.setdefault(n)
        if touched and self.wants_touched:
            for n in touched:
                if n not in self._touched:
                    self._touched.add(n)
                    self.first_touch.append(n)
            if len(self._touched) >= len(self.tracker.tensors):
                self._enough_touches()

    def after_op(self, func, written) -> None:
        pass

    def close_group(self) -> set[str]:
        """End a group (a step): remember its write volume; returns the names written."""
        if self.wants_touched:
            self._enough_touches()
        done, self.group_written = self.group_written, {}
        ts = self.tracker.tensors
        self.bytes_written_last = sum(ts[n].numel() * ts[n].element_size() for n in done if n in ts)
        self.write_order_last = list(done)
        return set(done)
