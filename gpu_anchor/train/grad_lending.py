"""Lending the anchored gradient buffers to the forward's saved activations while they hold nothing.

Plain PyTorch frees its gradients at ``zero_grad()`` (``set_to_none=True``, its default), and
the next forward's activations reuse that memory.  An anchored job cannot free them: they are
mapped from the daemon because at the next step's boundary they are that step's redo log.  So
its peak held one gradient buffer more than torch's (``bench train_overhead``: +4.3 % on the
1B Llama at batch 8 x 2 048).  Yet between ``zero_grad()`` and the first gradient of the next
backward the buffers hold nothing anyone reads: the step they were the redo log of is written
(see "Why the buffers are dead" below).  The lender puts them to work in that window: autograd's
saved-tensor hooks copy the *last* tensors the forward saves into them, and the originals go
back to torch's allocator, so the forward's peak is lower by what was lent.

Contract (``StepProtocolConfig.lend_grad_bytes``; one process, plain tensors, the gradients
``zero_grad()`` freed: ``grads.GradientBuffers`` decides):

- **Nothing is overwritten that is still needed.**  A gradient is copied into a buffer only
  after ``arrived`` moved every lent tensor still alive in that buffer's bytes to torch memory.
  A lent tensor is alive while autograd holds it (retained graphs, nodes backward did not
  reach).  ``finalize`` (``step()``) and ``close`` (``zero_grad(set_to_none=False)``) move every
  one back first.
- **The values are torch's.**  A lent tensor is a bit-identical copy with the original's shape,
  contiguous strides and dtype, a tensor of its own (its own version counter), so backward gives
  the same bits.  Only contiguous tensors of at least ``MIN_BYTES`` on the parameters' device
  are lent, never a parameter (a leaf that requires grad, or a view of one: the ``weight.t()``
  a linear layer saves), and nothing while a backward builds
  a graph (``create_graph``).  A saved tensor the hooks keep keeps autograd's check of in-place
  changes (the same error).  A lent copy holds the value it had when it was saved: a program
  that changes a saved tensor in place, which torch refuses, runs with the saved value.
- **What is lent.**  The forward's tail: from its last saved tensor back, each one that still
  fits the byte budget, by the previous forward's sizes (one too large is passed over and the
  ones before it fill the rest), less those whose original outlived the forward (returned to
  the caller: copying them freed nothing).  Backward reads them first.  They go into the
  buffers whose gradients arrived last in the previous backward.  A tensor still alive when
  its buffer's gradient arrives is moved out (``stats["evicted_bytes"]``), and the next budget
  shrinks by what was moved: a budget too large for the model costs copies, never values.
- **Why the buffers are dead.**  The window opens at ``zero_grad(set_to_none=True)``.  By then
  ``step()`` has enqueued the whole update, and the device word that marks the step written
  comes before anything enqueued after it on the stream.  A kill after a lending copy ran
  therefore finds the word past the last chunk, and recovery finishes that step without reading
  a gradient (``recovery``).  This is the same argument as for the next backward's gradients,
  which overwrite the buffers anyway.  Copies run on the stream that was current at
  ``zero_grad()``; a forward on another stream lends nothing.
- **Where.**  Global module hooks (one pair per process, for the optimizer whose window opened
  last) push autograd's saved-tensor hooks around the outermost forward of a module that holds
  the optimizer's parameters, in the window, and pop them when it returns.  Hooks already in
  force (``torch.utils.checkpoint`` around the model, a user's own) win: nothing is lent under
  them.  Hooks left pushed on top of ours when that forward returns stop lending for the
  process, with a warning.  Under ``torch.compile`` tracing the module hooks do nothing.
- **Cost.**  The lent bytes are copied once a step (a read and a write on the device); one
  Python call per saved tensor in windowed forwards; two per module call while a lender lives.
"""
from __future__ import annotations

import threading
import warnings
import weakref

import torch

MIN_BYTES = 1 << 20        # smaller saved tensors are not worth a copy and a Python object
ALIGN = 512                # as the daemon's arena and torch's allocator align


class _Kept:
    """A saved tensor the lender did not copy: autograd's own in-place check, by hand (torch
    skips it for hooked tensors)."""
    __slots__ = ("t", "version")

    def __init__(self, t: torch.Tensor) -> None:
        self.t, self.version = t.detach(), t._version


class _Lent:
    """A saved tensor copied into gradient memory ``[lo, hi)`` (byte addresses); ``_evict`` moves
    ``t`` to torch memory."""
    __slots__ = ("t", "lo", "hi", "resident", "__weakref__")

    def __init__(self, t: torch.Tensor, lo: int, hi: int) -> None:
        self.t, self.lo, self.hi, self.resident = t, lo, hi, True


def _unpack(packed) -> torch.Tensor:
    if isinstance(packed, _Kept) and packed.t._version != packed.version:
        raise RuntimeError(
            "one of the variables needed for gradient computation has been modified by an inplace "
            f"operation: [{packed.t.type()} {list(packed.t.shape)}] is at version {packed.t._version}; "
            f"expected version {packed.version} instead (seen by gpu_anchor's gradient lending, "
            "which keeps torch's check for the tensors it does not copy)")
    return packed.t


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


# One pair of global module hooks serves the process: they call the lender whose window was
# opened last (a discarded optimizer's open window lends nothing), and go when no lender is left.
_lenders: "weakref.WeakSet[GradientLender]" = weakref.WeakSet()
_current = None         # weakref to the lender that opened a window last
_handles: tuple = ()


def _enter_hook(module, args) -> None:
    lender = _current() if _current is not None else None
    if lender is not None and not torch.compiler.is_compiling():
        lender._enter(module)


def _leave_hook(module, args, out) -> None:
    lender = _current() if _current is not None else None
    if lender is not None and not torch.compiler.is_compiling():
        lender._leave()


def _register(lender: "GradientLender") -> None:
    global _handles
    from torch.nn.modules import module as nn_module
    _lenders.add(lender)
    if not _handles:
        _handles = (nn_module.register_module_forward_pre_hook(_enter_hook),
                    nn_module.register_module_forward_hook(_leave_hook, always_call=True))
    weakref.finalize(lender, _unregister)


def _unregister() -> None:
    global _handles
    if _handles and next(iter(_lenders), None) is None:     # iteration skips the dying one
        for h in _handles:
            h.remove()
        _handles = ()


class GradientLender:
    """See the module docstring.  ``params``: ``layout.AnchoredParam`` records (``q.grad`` set);
    ``budget``: bytes to lend a window at most.  The first window only learns (sizes, arrival
    order); lending starts with the second."""

    def __init__(self, params, budget: int, device: torch.device) -> None:
        self.params, self.device = params, device
        self.budget = int(budget)
        self.stats = {"windows": 0, "lent_bytes": 0, "lent_tensors": 0, "evicted_bytes": 0, "last_lent_bytes": 0}
        self.disabled: str | None = None if hasattr(torch._C._autograd, "_top_saved_tensors_default_hooks") else \
            "this torch cannot tell which saved-tensor hooks are innermost"
        self._order: list[int] | None = None    # parameter indices, by arrival in the last backward
        self._areas: list[_Area] | None = None
        self._arrivals: list[int] = []          # ... in this backward
        self._sizes: list[int] = []             # candidate sizes, this forward
        self._chosen: set[int] | None = None    # the candidates to lend (None: learning)
        self._held: set[int] = set()            # candidates whose original outlived the forward
        self._originals: list[tuple] = []       # (candidate, weakref to the original), this window
        self._k = 0
        self._window = False                    # between zero_grad() and the first gradient
        self._thread: int | None = None         # the thread that opened it
        self._depth = 0                         # module calls in progress on that thread
        self._pushed = None                     # our pack function while it is on torch's stack
        self._stream = None
        self._param_ids = {id(q.p) for q in params}
        self._param_storages = {q.local.untyped_storage().data_ptr() for q in params}
        self._owners: "weakref.WeakKeyDictionary[torch.nn.Module, bool]" = weakref.WeakKeyDictionary()
        self._live: "weakref.WeakSet[_Lent]" = weakref.WeakSet()
        self._seen: dict[int, tuple] = {}       # id(original) -> (weakrefs to it, version, weakref to handle)
        self._lent = 0
        self._overlapped = 0                    # bytes moved back because a gradient arrived on them
        if self.disabled is None:
            _register(self)

    # ------------------------------------------------------------------ window
    def open(self) -> None:
        """``zero_grad(set_to_none=True)``: the buffers hold nothing needed until the next gradient."""
        global _current
        self.evict_all()
        if self.disabled is None:
            if _current is not None and _current() not in (None, self):
                _current()._pop()       # the other lender's forward, if one is in progress, is over for it
            _current = weakref.ref(self)
        self._window = self.disabled is None
        self._thread, self._depth = threading.get_ident(), 0
        self._k, self._lent, self._overlapped, self._sizes, self._arrivals, self._seen = 0, 0, 0, [], [], {}
        self._originals = []
        for a in self._areas or ():
            a.top = a.base
        self._stream = torch.cuda.current_stream(self.device) if self.device.type == "cuda" else None
        if self._window and self._chosen is not None:
            self.stats["windows"] += 1

    def _enter(self, module: torch.nn.Module) -> None:
        """A module's forward begins: the outermost one in the window pushes the saved-tensor
        hooks if it holds this optimizer's parameters (another model's forward lends nothing),
        unless some are in force already (``torch.utils.checkpoint`` around the model, a user's
        own): theirs win."""
        if threading.get_ident() != self._thread:
            return
        self._depth += 1
        if self._depth == 1 and self._window and self._owns(module) \
                and torch._C._autograd._top_saved_tensors_default_hooks(True) is None:
            pack = self._pack      # one bound method: _leave knows ours by identity
            try:
                torch._C._autograd._push_saved_tensors_default_hooks(pack, _unpack)
            except RuntimeError:   # torch.autograd.graph.disable_saved_tensors_hooks is in force
                return
            self._pushed = pack

    def _owns(self, module: torch.nn.Module) -> bool:
        owns = self._owners.get(module)
        if owns is None:
            owns = self._owners[module] = any(id(p) in self._param_ids for p in module.parameters())
        return owns

    def _leave(self) -> None:
        if threading.get_ident() != self._thread or self._depth == 0:
            return
        self._depth -= 1
        if self._depth == 0:
            self._pop()

    def arrived(self, q) -> None:
        """A gradient is about to be copied into ``q.grad``: the window is over, and nothing lent
        may stay in ``q.grad``'s bytes."""
        if self._window:
            # A lent tensor whose original is still alive here (returned to the caller, like
            # the logits) freed nothing: the next forwards keep it.
            self._held.update(k for k, ref in self._originals if ref() is not None)
            self._originals = []
        self._window = False
        self._arrivals.append(q.index)
        if self._live:
            lo = q.grad.data_ptr()
            hi = lo + q.grad.numel() * q.grad.element_size()
            self._overlapped += self._evict(lambda h: h.lo < hi and lo < h.hi)

    def finalize(self) -> None:
        """``step()``'s gradient boundary: every buffer is the redo log again.  Learns this
        window's forward (sizes) and backward (arrival order) for the next one."""
        self._window = False
        self.evict_all()
        if not self._sizes or self.disabled is not None:
            self._arrivals = []
            return
        if self._arrivals:
            seen = set(self._arrivals)
            order = self._arrivals + [q.index for q in self.params if q.index not in seen]
            if order != self._order:
                self._order, self._areas = order, None
        self.stats["last_lent_bytes"] = self._lent
        self.budget = max(0, self.budget - self._overlapped)
        if self._order is not None:
            self._chosen = self._plan()
        self._arrivals, self._sizes = [], []

    def close(self) -> None:
        """Any other write into the buffers (``zero_grad(set_to_none=False)``): nothing lent stays."""
        self._window = False
        self.evict_all()

    # ------------------------------------------------------------------ hooks
    def _pack(self, t: torch.Tensor):
        if torch._C._current_graph_task_id() != -1:
            # A backward that builds a graph (create_graph): lend nothing, and keep no alias of a
            # lent tensor (its bytes are a gradient buffer's once its handle is gone).
            return _Kept(t.clone() if self._aliases_areas(t) else t)
        if not self._window or t.device != self.device or not t.is_contiguous() or (t.is_leaf and t.requires_grad):
            return _Kept(t)
        n = t.numel() * t.element_size()
        if n < MIN_BYTES or t.untyped_storage().data_ptr() in self._param_storages:
            return _Kept(t)          # small, or a parameter seen through a view (linear's weight.t())
        k, self._k = self._k, self._k + 1
        self._sizes.append(n)
        if self._chosen is None or k not in self._chosen or self._lent + n > self.budget:
            return _Kept(t)
        prev = self._seen.get(id(t))
        h = prev[2]() if prev is not None and prev[0]() is t and prev[1] == t._version else None
        if h is not None and h.resident:
            return h
        if self._stream is not None and torch.cuda.current_stream(self.device) != self._stream:
            return _Kept(t)
        placed = self._place(n)
        if placed is None:
            return _Kept(t)
        area, addr = placed
        # Its own tensor, not a view of the area: its own version counter, which copies into
        # other slots of the area do not move.
        storage = area.buf.untyped_storage()
        dst = torch.empty(0, dtype=t.dtype, device=t.device).set_(
            storage, (addr - storage.data_ptr()) // t.element_size(), t.shape)
        dst.copy_(t)
        h = _Lent(dst, addr, addr + n)
        self._live.add(h)
        original = weakref.ref(t)
        self._seen[id(t)] = (original, t._version, weakref.ref(h))    # weak: autograd alone keeps h alive
        self._originals.append((k, original))
        self._lent += n
        self.stats["lent_bytes"] += n
        self.stats["lent_tensors"] += 1
        return h

    def _aliases_areas(self, t: torch.Tensor) -> bool:
        p = t.data_ptr()
        return any(a.base <= p < a.end for a in self._areas or ())

    def _place(self, n: int):
        for a in self._ordered_areas():
            start = (a.top + ALIGN - 1) // ALIGN * ALIGN
            if start + n <= a.end:
                a.top = start + n
                return a, start
        return None

    def _ordered_areas(self) -> list[_Area]:
        """Areas whose first gradient arrives last come first: the tail of the forward, which
        backward reads first, goes where gradients arrive last."""
        if self._areas is None:
            rank = {i: r for r, i in enumerate(self._order or ())}
            self._areas = sorted(_areas(self.params), key=lambda a: -min(rank.get(q.index, 0) for q in a.params))
        return self._areas

    def _plan(self) -> set[int]:
        """The candidates to lend, by the sizes seen: from the forward's last one back, each that
        still fits the budget.  One too large (the logits, say) is passed over, not an end: the
        ones before it fill what is left.  ``_place`` puts them in forward order, so the earlier
        ones, which backward frees last, take the areas whose gradients arrive last."""
        largest = max((a.end - a.base for a in self._ordered_areas()), default=0)
        total, chosen = 0, set()
        for k in range(len(self._sizes) - 1, -1, -1):
            n = self._sizes[k]
            if n > largest or k in self._held or total + n > self.budget:
                continue
            total += n
            chosen.add(k)
        return chosen

    # ------------------------------------------------------------------ eviction
    def evict_all(self) -> None:
        if self._live:
            self._evict(lambda h: True)

    def _evict(self, overlaps) -> int:
        """Moves the live lent tensors ``overlaps`` picks to torch memory; returns their bytes."""
        moved = 0
        for h in [h for h in self._live if h.resident and overlaps(h)]:
            h.t = h.t.clone()
            h.resident = False
            self._live.discard(h)
            moved += h.hi - h.lo
        self.stats["evicted_bytes"] += moved
        return moved

    def _pop(self) -> None:
        if self._pushed is None:
            return
        top = torch._C._autograd._top_saved_tensors_default_hooks(True)
        if top is None or top[0] is not self._pushed:
            self.disabled = "saved-tensor hooks pushed inside a module's forward were still in force when it returned"
            warnings.warn(f"gpu_anchor: gradient lending stops: {self.disabled}", RuntimeWarning, stacklevel=3)
            self._pushed = None      # ours stay below theirs; from now on _pack keeps everything
            self._window = False
            return
        torch._C._autograd._pop_saved_tensors_default_hooks()
        self._pushed = None
