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
- **What is lent** (``lend_plan``).  The forward's tail: from its last saved tensor back, each
  one that still fits the byte budget, by the previous forward's sizes (one too large is passed
  over and the ones before it fill the rest), less those whose original outlived the forward
  (returned to the caller: copying them freed nothing).  A tensor saved by several ops (one
  input of the q, k and v projections) is one candidate, lent at every save or at none.
  Backward reads them first.  They go into the buffers whose gradients arrived last in the
  previous backward.  A tensor still alive when its buffer's gradient arrives is moved out
  (``stats["evicted_bytes"]``), and the next budget shrinks by what was moved: a budget too
  large for the model costs copies, never values.
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
from .lend_plan import ForwardPlan
from .lent_memory import _Kept, _Lent, _Residents, _unpack

MIN_BYTES = 1 << 20        # smaller saved tensors are not worth a copy and a Python object


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
        self.plan = ForwardPlan(params)         # what it learnt of the forward, and lends next
        self._arrivals: list[int] = []          # parameter indices, by arrival in this backward
        self._seen_end: int | None = None       # one past the last candidate this window saw
        self._calls = 0                         # module calls so far in this window's forwards of ours
        self._push_at = 0                       # ... from which the saved-tensor hooks go on
        # A learning window logs the module of each call of ours, the outermost one (False:
        # several) and (call, candidate) for each save of a candidate (``ForwardPlan.learn``)
        self._log: list = []
        self._log_root = None
        self._saves: list = []
        self._drifted = False                   # a targeted window saw more candidates than learnt
        self._hooks = lend_hooks.ModuleHooks(self)
        self._targeted = False                  # this window hears of the root and mark modules only
        self._mark_at = 0                       # the mark's call in the window where the hooks go on
        self._mark_calls = 0
        self._passed = False                    # ... and it has been reached
        self._ours = False                      # the outermost module in progress holds our parameters
        self._entry_top = None                  # the pack hook in force when it began
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
        self._targeted = self._window and bool(self.plan.chosen) and self._hooks.placed
        self._thread, self._depth = threading.get_ident(), 0
        self._k, self._lent, self._overlapped, self._arrivals, self._seen = 0, 0, 0, [], {}
        self._lent_k, self._lent_src, self._seen_end, self._calls, self._ours = [], [], None, 0, False
        self._log, self._log_root, self._saves, self._mark_calls, self._passed = [], None, [], 0, False
        self._drifted = False
        # Learning, the hooks go on at the outermost forward and see every candidate; lending, at
        # the module call where the first chosen one came last time: the saves before it stay
        # torch's own, with no Python objects (two a save fed the garbage collector's full passes).
        self._push_at = self.plan.push_call()
        self.plan.reset_areas()
        if self.device.type == "cuda":
            self._stream = torch.cuda.current_stream(self.device).cuda_stream
            self._stream_device = torch.cuda._get_device_index(self.device, optional=True)
        else:
            self._stream = None
        if self._window and self.plan.chosen is not None:
            self.stats["windows"] += 1

    def _needs_global(self) -> bool:
        """Every module call must reach this lender: it learns, or its learnt forward had several
        outermost modules (``lend_hooks``)."""
        chosen = self.plan.chosen
        return self.disabled is None and (chosen is None or (bool(chosen) and not self._hooks.placed))

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
            if self._ours and self.plan.chosen is None:
                self._log_root = module if self._log_root in (None, module) else False
        if not self._ours:         # another model's forward (a reference or teacher model, say)
            return
        self._calls += 1
        if self.plan.chosen is None:
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
            self._k = max(self._k, bisect.bisect_left(self.plan.calls_at, call))

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
            self.plan.held.update(k for k, src in zip(self._lent_k, self._lent_src) if src() is not None)
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
        plan = self.plan
        learning = plan.chosen is None
        log, log_root, saves = self._log, self._log_root, self._saves
        self._log, self._log_root, self._saves = [], None, []
        arrivals, self._arrivals = self._arrivals, []
        if self._seen_end is None or self.disabled is not None:
            if plan.chosen and (self._calls or (self._targeted and arrivals)):
                # Our forward ran, yet the hooks never went on where the lent tail began last
                # time (fewer module calls now, say), or a backward ran with no call of the root
                # we learnt: learn the whole forward again.
                self._relearn()
            return
        if self._targeted:
            if self._drifted or self._seen_end != len(plan.expect):
                # Other candidates than the forward we learnt: learn it again, or, if the last
                # targeted window did so too (a forward that changes from step to step), go on
                # with the global hooks, whose windows record the calls they see.
                plan.drifts += 1
                if plan.drifts == 1:
                    self._relearn()
                    return
                plan.root = None
            else:
                plan.drifts = 0
        else:
            plan.trim(self._seen_end)
        if learning:
            plan.learn(log, log_root, saves)
        if arrivals:
            plan.arrived_in(arrivals)
        self.stats["last_lent_bytes"] = self._lent
        self.budget = max(0, self.budget - self._overlapped)
        if plan.order is not None:
            if not plan.replan(self.budget):
                warnings.warn("gpu_anchor: gradient lending lends nothing from now on: "
                              + plan.idle_reason(self.budget, MIN_BYTES), RuntimeWarning, stacklevel=2)
            self._retarget()

    def _relearn(self) -> None:
        self.plan.chosen = None
        self._hooks.remove()
        if lend_hooks.current() is self:
            lend_hooks.set_global(self._needs_global())

    def _retarget(self) -> None:
        """After a plan: hooks on the root and the mark (``ForwardPlan.target``) instead of the
        global ones (``lend_hooks``).  Where the learnt forward had several outermost modules, the
        global hooks stay; with nothing to lend, no hooks (a plan with nothing in it stays so)."""
        target = self.plan.target()
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
            return _Kept(t.clone() if self.plan.aliases(t.data_ptr()) else t)
        if not self._window or t.device != self.device or not t.is_contiguous() or (t.is_leaf and t.requires_grad):
            return _Kept(t)
        n = t.numel() * t.element_size()
        if n < MIN_BYTES or t.untyped_storage().data_ptr() in self._param_storages:
            return _Kept(t)          # small, or a parameter seen through a view (linear's weight.t())
        ptr = t.data_ptr()
        prev = self._seen.get(ptr)
        if prev is not None and prev[0].same(t):
            # saved again (one input of the q, k and v projections, by each): one candidate
            if self.plan.chosen is None:
                self._saves.append((self._calls, prev[1]))
            return prev[0]
        k = self._candidate(n)
        packed = (self._lend(t, k, n) if k is not None else None) or _Kept(t)
        self._seen[ptr] = packed, k
        return packed

    def _candidate(self, n: int) -> int | None:
        """The number of the next new candidate, of ``n`` bytes, its size recorded (and with the
        global hooks, its call): ``ForwardPlan.record`` / ``expected``.  None: a targeted
        window saw more candidates than the learnt forward has after the mark."""
        i, self._k = self._k, self._k + 1
        self._seen_end = self._k
        if self._targeted:
            k = self.plan.expected(i, n)
            self._drifted |= k is None
            return k
        if self.plan.chosen is None:
            self._saves.append((self._calls, i))
        return self.plan.record(i, n, self._calls)

    def _lend(self, t: torch.Tensor, k: int, n: int) -> "_Lent | None":
        """Candidate ``k`` (``n`` bytes) copied into the area ``ForwardPlan.place`` gives it, if chosen."""
        chosen = self.plan.chosen
        if chosen is None or k not in chosen or self._lent + n > self.budget:
            return None
        # the raw handle: torch.cuda.current_stream() costs more host time than the copy's launch
        if self._stream is not None and torch._C._cuda_getCurrentRawStream(self._stream_device) != self._stream:
            return None
        placed = self.plan.place(n)
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
