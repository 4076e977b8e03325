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
  the caller: copying them freed nothing).  A tensor saved by several ops (one input of the
  q, k and v projections) is one candidate, lent at every save or at none.  Backward reads
  them first.  They go into the buffers whose gradients arrived last in the previous backward.  A tensor still alive when
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
  last) count the module calls of the window's outermost forwards of a module that holds the
  optimizer's parameters (another model's forward counts nothing and lends nothing).  A
  learning window pushes autograd's saved-tensor hooks at the outermost call; a lending one at
  the call where the first chosen candidate came last time, so the saves before it stay
  torch's own.  The hooks are popped when the outermost forward returns.  Hooks already in
  force (``torch.utils.checkpoint``, a user's own) win: nothing is lent under them.  Hooks
  pushed inside that forward and still in force when it returns stop lending for the process,
  with a warning.  A window in which our forward ran but the hooks never went on (fewer calls
  than last time) makes the next one learn again.  Under ``torch.compile`` tracing the module
  hooks do nothing.
- **Cost.**  The lent bytes are copied once a step (a read and a write on the device); one
  Python call and two or three Python objects per saved tensor from the push on; two calls per
  module call while a lender lives.  Python objects made a step and alive across the garbage
  collector's passes are what brings its full passes on (250 ms each on the H200 machine's
  benchmark process): pushing the hooks at the outermost call, as before 2026-12-04, made two
  per save of the whole forward.
"""
from __future__ import annotations

import bisect
import threading
import warnings
import weakref

import torch

from .lent_memory import _Area, _Kept, _Lent, _areas, _unpack

MIN_BYTES = 1 << 20        # smaller saved tensors are not worth a copy and a Python object
ALIGN = 512                # as the daemon's arena and torch's allocator align


def _top_pack():
    top = torch._C._autograd._top_saved_tensors_default_hooks(True)
    return None if top is None else top[0]


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
        # By candidate index: its size and the module call it came in (the last window that saw
        # it; a lending window sees the tail only, from the call where the hooks went on)
        self._sizes: list[int] = []
        self._calls_at: list[int] = []
        self._seen_end: int | None = None       # one past the last candidate this window saw
        self._calls = 0                         # module calls so far in this window's forwards of ours
        self._push_at = 0                       # ... from which the saved-tensor hooks go on
        self._ours = False                      # the outermost module in progress holds our parameters
        self._entry_top = None                  # the pack hook in force when it began
        self._chosen: set[int] | None = None    # the candidates to lend (None: learning)
        self._held: set[int] = set()            # candidates whose original outlived the forward
        self._lent_k: list[int] = []            # candidates lent this window, and weak references
        self._lent_src: list = []               # to their originals (held: they outlived the forward)
        self._k = 0
        self._window = False                    # between zero_grad() and the first gradient
        self._thread: int | None = None         # the thread that opened it
        self._depth = 0                         # module calls in progress on that thread
        self._pushed = None                     # our pack function while it is on torch's stack
        self._stream: int | None = None         # the raw CUDA stream current at zero_grad(), and its device
        self._stream_device = 0
        self._param_ids = {id(q.p) for q in params}
        self._param_storages = {q.local.untyped_storage().data_ptr() for q in params}
        self._owners: "weakref.WeakKeyDictionary[torch.nn.Module, bool]" = weakref.WeakKeyDictionary()
        # Weak references to the lent tensors not yet moved out (alive: autograd holds them), in
        # lending order; at the backward's first gradient, indexed by the parameters whose
        # gradient bytes they lie in, so that each arrival looks at its own only.
        self._resident: list = []
        self._by_param: dict[int, list] | None = None
        self._seen: dict[int, object] = {}      # address -> what a candidate there was packed as, this forward
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
        self._k, self._lent, self._overlapped, self._arrivals, self._seen = 0, 0, 0, [], {}
        self._lent_k, self._lent_src, self._seen_end, self._calls, self._ours = [], [], None, 0, False
        # Learning, the hooks go on at the outermost forward and see every candidate; lending, at
        # the module call where the first chosen one came last time: the saves before it stay
        # torch's own, with no Python objects (two a save fed the garbage collector's full passes).
        self._push_at = self._calls_at[min(self._chosen)] if self._chosen else 0
        for a in self._areas or ():
            a.top = a.base
        if self.device.type == "cuda":
            self._stream = torch.cuda.current_stream(self.device).cuda_stream
            self._stream_device = torch.cuda._get_device_index(self.device, optional=True)
        else:
            self._stream = None
        if self._window and self._chosen is not None:
            self.stats["windows"] += 1

    def _enter(self, module: torch.nn.Module) -> None:
        """A module's forward begins.  Within an outermost forward of a module that holds this
        optimizer's parameters (another model's forward lends nothing), the first module call
        from ``_push_at`` on pushes the saved-tensor hooks, which stay until that outermost
        forward returns, unless some are in force already (``torch.utils.checkpoint``, a
        user's own): theirs win."""
        if threading.get_ident() != self._thread:
            return
        self._depth += 1
        if not self._window:
            return
        if self._depth == 1:
            self._ours, self._entry_top = self._owns(module), _top_pack()
        if not self._ours:         # another model's forward (a reference or teacher model, say)
            return
        self._calls += 1
        if self._pushed is None and self._calls >= self._push_at \
                and torch._C._autograd._top_saved_tensors_default_hooks(True) is None:
            pack = self._pack      # one bound method: _leave knows ours by identity
            try:
                torch._C._autograd._push_saved_tensors_default_hooks(pack, _unpack)
            except RuntimeError:   # torch.autograd.graph.disable_saved_tensors_hooks is in force
                return
            self._pushed = pack
            if self._push_at:      # the candidates of the calls before this one went by unseen
                self._k = max(self._k, bisect.bisect_left(self._calls_at, self._calls))

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
            self._seen = {}        # the forward is over: what it packed is autograd's alone again
            self._pop()
            self._ours = False

    def arrived(self, q) -> None:
        """A gradient is about to be copied into ``q.grad``: the window is over, and nothing lent
        may stay in ``q.grad``'s bytes."""
        if self._window:
            # A lent tensor whose original is still alive here (returned to the caller, like
            # the logits) freed nothing: the next forwards keep it.
            self._held.update(k for k, src in zip(self._lent_k, self._lent_src) if src() is not None)
            self._lent_k, self._lent_src = [], []
        self._window = False
        self._arrivals.append(q.index)
        if self._resident:
            if self._by_param is None:
                self._by_param = self._index()
            refs = self._by_param.pop(q.index, None)
            if refs:
                self._overlapped += self._evict(refs)

    def finalize(self) -> None:
        """``step()``'s gradient boundary: every buffer is the redo log again.  Learns this
        window's forward (sizes) and backward (arrival order) for the next one."""
        self._window = False
        self.evict_all()
        if self._seen_end is None or self.disabled is not None:
            if self._calls and self._chosen:
                # Our forward ran, yet the hooks never went on where the lent tail began last
                # time (fewer module calls now, say): learn the whole forward again.
                self._chosen = None
            self._arrivals = []
            return
        del self._sizes[self._seen_end:], self._calls_at[self._seen_end:]   # fewer candidates now, maybe
        if self._arrivals:
            seen = set(self._arrivals)
            order = self._arrivals + [q.index for q in self.params if q.index not in seen]
            if order != self._order:
                self._order, self._areas = order, None
        self.stats["last_lent_bytes"] = self._lent
        self.budget = max(0, self.budget - self._overlapped)
        if self._order is not None:
            self._chosen = self._plan()
        self._arrivals = []

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
        ptr = t.data_ptr()
        prev = self._seen.get(ptr)
        if prev is not None and prev.same(t):
            return prev    # saved again (one input of the q, k and v projections, by each): one candidate
        k, self._k = self._k, self._k + 1
        if k < len(self._sizes):
            self._sizes[k], self._calls_at[k] = n, self._calls
        else:
            self._sizes.append(n)
            self._calls_at.append(self._calls)
        self._seen_end = self._k
        packed = self._lend(t, k, n) or _Kept(t)
        self._seen[ptr] = packed
        return packed

    def _lend(self, t: torch.Tensor, k: int, n: int) -> "_Lent | None":
        """Candidate ``k`` (``n`` bytes) copied into the area ``_place`` gives it, if chosen."""
        if self._chosen is None or k not in self._chosen or self._lent + n > self.budget:
            return None
        # the raw handle: torch.cuda.current_stream() costs more host time than the copy's launch
        if self._stream is not None and torch._C._cuda_getCurrentRawStream(self._stream_device) != self._stream:
            return None
        placed = self._place(n)
        if placed is None:
            return None
        area, addr = placed
        # Its own tensor, not a view of the area: its own version counter, which copies into
        # other slots of the area do not move.
        storage = area.buf.untyped_storage()
        dst = torch.empty(0, dtype=t.dtype, device=t.device).set_(
            storage, (addr - storage.data_ptr()) // t.element_size(), t.shape)
        dst.copy_(t)
        h = _Lent(dst, addr, addr + n, t)
        self._resident.append(weakref.ref(h))
        self._by_param = None
        self._lent_k.append(k)
        self._lent_src.append(h.src)
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
        if self._resident:
            self._evict(self._resident)
            self._resident, self._by_param = [], None

    def _index(self) -> dict[int, list]:
        """The live lent tensors by the parameter whose gradient bytes they overlap (lent copies
        never overlap each other: each area is a bump allocator)."""
        live = sorted(((h.lo, h.hi, r) for r in self._resident if (h := r()) is not None and h.resident),
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

    def _pop(self) -> None:
        if self._pushed is None:
            if self._ours and _top_pack() is not self._entry_top:     # pushed inside, before ours went on
                self._stop()
            return
        if _top_pack() is not self._pushed:
            self._stop()
            self._pushed = None      # ours stay below theirs; from now on _pack keeps everything
            return
        torch._C._autograd._pop_saved_tensors_default_hooks()
        self._pushed = None

    def _stop(self) -> None:
        self.disabled = "saved-tensor hooks pushed inside a module's forward were still in force when it returned"
        warnings.warn(f"gpu_anchor: gradient lending stops: {self.disabled}", RuntimeWarning, stacklevel=4)
        self._window = False
