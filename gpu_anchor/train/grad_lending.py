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
- **Where.**  A learning window hears of every module call (global module hooks,
  ``lend_hooks``): it counts the module calls of the window's outermost forwards of a module
  that holds the optimizer's parameters (another model's forward counts nothing and lends
  nothing), and pushes autograd's saved-tensor hooks at the outermost call.  A lending window
  pushes them at the call where the first chosen candidate came when the lender learnt, so
  the saves before it stay torch's own, and hears of two modules only: the outermost one (the
  *root*) and the one whose call that is (the *mark*, at its ``n``-th call in the window).  The
  hooks are popped when the root's forward returns.  Hooks already in force
  (``torch.utils.checkpoint``, a user's own) win: nothing is lent under them.  Hooks pushed
  inside that forward and still in force when it returns stop lending for the process, with a
  warning.  A window in which our forward ran but the hooks never went on (fewer calls than
  last time), or a backward ran with no call of the root, makes the next one learn again; so
  does a lending window that saw other candidates than the learnt ones, and if the next one
  does too (a forward that changes from step to step), or the learnt forward had several
  outermost modules, the lender keeps the global hooks, whose windows record the calls they
  see.  Under ``torch.compile`` tracing the module hooks do nothing; a compiled frame guards on
  the global hooks, so their going off after learning recompiles it once, and the window that
  recompiled learns again.
- **Cost.**  The lent bytes are copied once a step (a read and a write on the device); one
  Python call and two or three Python objects per saved tensor from the push on; three calls
  per forward on the root and the mark.  Learning, two calls per module call of the process,
  each of which the global hooks put on torch's slow path (``lend_hooks``); before
  2026-12-04's second change every window paid that, and every other model's forward too.
  Python objects made a step and alive across the garbage collector's passes are what brings
  its full passes on (250 ms each on the H200 machine's benchmark process): pushing the hooks
  at the outermost call, as before 2026-12-04, made two per save of the whole forward.
"""
from __future__ import annotations

import bisect
import threading
import warnings
import weakref

import torch

from . import lend_hooks
from .lent_memory import _Area, _areas, _Kept, _Lent, _Residents, _unpack

MIN_BYTES = 1 << 20        # smaller saved tensors are not worth a copy and a Python object
ALIGN = 512                # as the daemon's arena and torch's allocator align


def _top_pack():
    top = torch._C._autograd._top_saved_tensors_default_hooks(True)
    return None if top is None else top[0]


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
        # A learning window logs the module of each call of ours, the outermost one (False:
        # several) and (call, candidate) for each save of a candidate; kept from the last one as
        # (weakref to the module, its n-th call in the window) by call, the root and the saves.
        self._log: list = []
        self._log_root = None
        self._saves: list = []
        self._call_log: list = []
        self._root = None
        self._save_log: list = []
        self._expect: list[int] = []            # a targeted window: the learnt candidates it sees, in order
        self._drifted = False                   # ... and it saw more
        self._drifts = 0                        # targeted windows in a row that saw other candidates
        self._hooks = lend_hooks.ModuleHooks(self)
        self._targeted = False                  # this window hears of the root and mark modules only
        self._mark_at = 0                       # the mark's call in the window where the hooks go on
        self._mark_calls = 0
        self._passed = False                    # ... and it has been reached
        self._ours = False                      # the outermost module in progress holds our parameters
        self._entry_top = None                  # the pack hook in force when it began
        self._chosen: set[int] | None = None    # the candidates to lend (None: learning)
        self._held: set[int] = set()            # candidates whose original outlived the forward
        self._lent_k: list[int] = []            # candidates lent this window, and weak references
        self._lent_src: list = []               # to their originals (held: they outlived the forward)
        self._k = 0
        self._window = False                    # between zero_grad() and the first gradient
        self._thread: int | None = None         # the thread that opened it
        self._depth = 0                         # module calls (a targeted window: root calls) in progress there
        self._pushed = None                     # our pack function while it is on torch's stack
        self._stream: int | None = None         # the raw CUDA stream current at zero_grad(), and its device
        self._stream_device = 0
        self._param_ids = {id(q.p) for q in params}
        self._param_storages = {q.local.untyped_storage().data_ptr() for q in params}
        self._owners: "weakref.WeakKeyDictionary[torch.nn.Module, bool]" = weakref.WeakKeyDictionary()
        self._resident = _Residents(params, self.stats)   # lent tensors not yet moved out
        self._seen: dict[int, object] = {}      # address -> what a candidate there was packed as, this forward
        self._lent = 0
        self._overlapped = 0                    # bytes moved back because a gradient arrived on them

    # ------------------------------------------------------------------ window
    def open(self) -> None:
        """``zero_grad(set_to_none=True)``: the buffers hold nothing needed until the next gradient."""
        self.evict_all()
        if self.disabled is None:
            other = lend_hooks.current()
            if other not in (None, self):
                other._pop()            # the other lender's forward, if one is in progress, is over for it
            lend_hooks.make_current(self)
            lend_hooks.set_global(self._needs_global())
        else:
            self._hooks.remove()
        self._window = self.disabled is None
        self._targeted = self._window and bool(self._chosen) and self._hooks.placed
        self._thread, self._depth = threading.get_ident(), 0
        self._k, self._lent, self._overlapped, self._arrivals, self._seen = 0, 0, 0, [], {}
        self._lent_k, self._lent_src, self._seen_end, self._calls, self._ours = [], [], None, 0, False
        self._log, self._log_root, self._saves, self._mark_calls, self._passed = [], None, [], 0, False
        self._drifted = False
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

    def _needs_global(self) -> bool:
        """Every module call must reach this lender: it learns, or its learnt forward had several
        outermost modules (``lend_hooks``)."""
        return self.disabled is None and (self._chosen is None or (bool(self._chosen) and not self._hooks.placed))

    def _enter(self, module: torch.nn.Module) -> None:
        """A module's forward begins (global hooks).  Within an outermost forward of a module
        that holds this optimizer's parameters (another model's forward lends nothing), the first
        module call from ``_push_at`` on pushes the saved-tensor hooks, which stay until that
        outermost forward returns, unless some are in force already (``torch.utils.checkpoint``,
        a user's own): theirs win."""
        if threading.get_ident() != self._thread or self._targeted:
            return
        self._depth += 1
        if not self._window:
            return
        if self._depth == 1:
            self._ours, self._entry_top = self._owns(module), _top_pack()
            if self._ours and self._chosen is None:
                self._log_root = module if self._log_root in (None, module) else False
        if not self._ours:         # another model's forward (a reference or teacher model, say)
            return
        self._calls += 1
        if self._chosen is None:
            self._log.append(module)
        if self._calls >= self._push_at:
            self._push(self._calls)

    def _root_enter(self) -> None:
        """The root's forward begins (``lend_hooks.ModuleHooks``): a forward of ours.  In a later
        forward of the window than the one that reached the mark, the hooks go on at once, as
        the global hooks would put them on at its first call."""
        if threading.get_ident() != self._thread or not self._targeted:
            return
        self._depth += 1
        if self._depth > 1 or not self._window or lend_hooks.current() is not self:
            return
        self._ours, self._entry_top = True, _top_pack()
        self._calls += 1
        if self._passed:
            self._push(self._push_at)

    def _mark_enter(self) -> None:
        """The mark's forward begins: at its ``_mark_at``-th call in the window, the hooks go on."""
        if threading.get_ident() != self._thread or not self._ours or not self._window:
            return
        self._mark_calls += 1
        if self._mark_calls == self._mark_at:
            self._passed = True
            self._push(self._push_at)

    def _root_leave(self) -> None:
        if self._targeted:
            self._leave()

    def _push(self, call: int) -> None:
        """Our saved-tensor hooks on, at module call ``call``, unless some are in force."""
        if self._pushed is not None or _top_pack() is not None:
            return
        pack = self._pack          # one bound method: _leave knows ours by identity
        try:
            torch._C._autograd._push_saved_tensors_default_hooks(pack, _unpack)
        except RuntimeError:       # torch.autograd.graph.disable_saved_tensors_hooks is in force
            return
        self._pushed = pack
        if self._push_at and not self._targeted:   # the candidates of the calls before this one went by unseen
            self._k = max(self._k, bisect.bisect_left(self._calls_at, call))

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
            self._overlapped += self._resident.arrived(q.index)

    def finalize(self) -> None:
        """``step()``'s gradient boundary: every buffer is the redo log again.  Learns this
        window's forward (sizes) and backward (arrival order) for the next one."""
        self._window = False
        self.evict_all()
        learning = self._chosen is None
        log, log_root, saves = self._log, self._log_root, self._saves
        self._log, self._log_root, self._saves = [], None, []
        if self._seen_end is None or self.disabled is not None:
            if self._chosen and (self._calls or (self._targeted and self._arrivals)):
                # Our forward ran, yet the hooks never went on where the lent tail began last
                # time (fewer module calls now, say), or a backward ran with no call of the root
                # we learnt: learn the whole forward again.
                self._relearn()
            self._arrivals = []
            return
        if self._targeted:
            if self._drifted or self._seen_end != len(self._expect):
                # Other candidates than the forward we learnt: learn it again, or, if the last
                # targeted window did so too (a forward that changes from step to step), go on
                # with the global hooks, whose windows record the calls they see.
                self._drifts += 1
                if self._drifts == 1:
                    self._relearn()
                    self._arrivals = []
                    return
                self._root = None
            else:
                self._drifts = 0
        else:
            del self._sizes[self._seen_end:], self._calls_at[self._seen_end:]   # fewer candidates now, maybe
        if learning:
            # (a module's truth is its len() where it has one: torch.compile's wrapper refuses it)
            self._root = weakref.ref(log_root) if isinstance(log_root, torch.nn.Module) and self._drifts < 2 else None
            nth: dict = {}
            self._call_log = []
            for m in log:
                nth[m] = nth.get(m, 0) + 1
                self._call_log.append((weakref.ref(m), nth[m]))
            self._save_log = saves
        if self._arrivals:
            seen = set(self._arrivals)
            order = self._arrivals + [q.index for q in self.params if q.index not in seen]
            if order != self._order:
                self._order, self._areas = order, None
        self.stats["last_lent_bytes"] = self._lent
        self.budget = max(0, self.budget - self._overlapped)
        if self._order is not None:
            self._chosen = self._plan()
            if not self._chosen:
                self._say_idle()
            self._retarget()
        self._arrivals = []

    def _relearn(self) -> None:
        self._chosen = None
        self._hooks.remove()
        if lend_hooks.current() is self:
            lend_hooks.set_global(self._needs_global())

    def _retarget(self) -> None:
        """After a plan: hooks on the root and on the module whose call began the chosen tail
        when the lender learnt, instead of the global ones (``lend_hooks``), and the candidates
        a window sees from there (``_expect``: each by the first of its saves from that call on;
        a tensor saved before it and again after is seen).  Where the learnt forward had several
        outermost modules, the global hooks stay; with nothing to lend, no hooks."""
        target = None
        if self._chosen and self._root is not None:
            call = self._calls_at[min(self._chosen)]
            if 0 < call <= len(self._call_log):
                mark, nth = self._call_log[call - 1]
                root, mark = self._root(), mark()
                if root is not None and mark is not None:
                    target = root, mark, nth
                    self._expect = list(dict.fromkeys(k for c, k in self._save_log if c >= call))
        if target is None:
            self._hooks.remove()
        else:
            self._hooks.place(target[0], target[1])
            self._mark_at = target[2]
        if lend_hooks.current() is self:
            lend_hooks.set_global(self._needs_global())

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
        if prev is not None and prev[0].same(t):
            # saved again (one input of the q, k and v projections, by each): one candidate
            if self._chosen is None:
                self._saves.append((self._calls, prev[1]))
            return prev[0]
        k = self._candidate(n)
        packed = (self._lend(t, k, n) if k is not None else None) or _Kept(t)
        self._seen[ptr] = packed, k
        return packed

    def _candidate(self, n: int) -> int | None:
        """The index of the next new candidate, of ``n`` bytes, its size recorded.  With the global
        hooks, in order from where the hooks went on, its call recorded too.  In a targeted
        window, which counts no calls, the learnt candidate at that place of ``_expect``; None
        past its end (the forward changed)."""
        i, self._k = self._k, self._k + 1
        self._seen_end = self._k
        if self._targeted:
            if i >= len(self._expect):
                self._drifted = True
                return None
            k = self._expect[i]
            self._sizes[k] = n
            return k
        if i < len(self._sizes):
            self._sizes[i], self._calls_at[i] = n, self._calls
        else:
            self._sizes.append(n)
            self._calls_at.append(self._calls)
        if self._chosen is None:
            self._saves.append((self._calls, i))
        return i

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
        dst = t.new_empty(0).set_(storage, (addr - storage.data_ptr()) // t.element_size(), t.shape)
        dst.copy_(t)
        h = _Lent(dst, addr, addr + n, t)
        self._resident.add(h)
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

    def _say_idle(self) -> None:
        """A plan with nothing in it stays so (no hooks from now on): say why, once."""
        largest = max((a.end - a.base for a in self._ordered_areas()), default=0)
        sizes = [n for k, n in enumerate(self._sizes) if k not in self._held]
        why = (f"the forward saves no tensor of {MIN_BYTES} bytes or more that it does not return" if not sizes else
               f"none of its {len(sizes)} candidates fits: the smallest is {min(sizes)} bytes, the budget "
               f"{self.budget} (lend_grad_bytes less what gradients had to move out) and the largest run of "
               f"gradient buffers {largest}")
        warnings.warn(f"gpu_anchor: gradient lending lends nothing from now on: {why}", RuntimeWarning, stacklevel=2)

    # ------------------------------------------------------------------ eviction
    def evict_all(self) -> None:
        self._resident.evict_all()

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
