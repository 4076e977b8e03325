"""``AnchoredOptimizer``: a torch optimizer whose step survives SIGKILL at any instant.

    model = build_model(); anchor_module(model, client)          # or managed_scope
    opt = AnchoredOptimizer(torch.optim.AdamW(model.parameters(), lr=3e-4))
    for step in range(opt.completed_steps, total):
        loss = model(batch(step)).loss; loss.backward()
        opt.step(); opt.zero_grad()

What it anchors itself (one ``bind``, names under ``prefix``, parameters named by the
model's access paths if ``model=`` is given, else ``g<group>.p<index>`` in optimizer
order): ``<prefix>.grad.<param>`` (``p.grad`` points there, so backward accumulates into
anchored memory), ``<prefix>.state.<param>.<key>`` (optimizer state, created up front),
``<prefix>.undo.0`` / ``.1`` (the two undo slots).  Step counts, hyper-parameters,
scheduler state, RNG state and ``loop_state`` go to the journal (see ``protocol``).
The parameters themselves must already be anchored (``anchor_module`` or managed_scope).

Recovery happens in the constructor: an in-flight step is rolled back / redone from
the anchored gradients (``recovery``), so ``completed_steps`` is always a whole number of steps;
what is anchored and bound is ``layout``'s.
"""
from __future__ import annotations

import json
import time
import warnings
import weakref

import torch

from . import carry as carry_mod
from . import chunking, distributed, faults
from .config import AUTO, StepProtocolConfig
from .device_progress import DeviceProgress
from .fsdp import local as _local
from . import amp
from .hparams import hparams as _hparams
from .recovery import RecoveryMixin
from .schedulers import Schedulers
from .state_dict import StateDictMixin
from .undo import UndoMixin
from .kinds import kind_of
from . import protocol
from .protocol import StepState, key
from gpu_anchor.journal_keys import STEP_KEY

from . import step_hooks
from .grads import GradientBuffers
from .grad_lending import GradientLender
from . import fused_adam, hf_accelerate, layout

def _open_scope():
    """The managed_scope open in this thread, if that package is present."""
    try:
        from gpu_anchor.scope import current
    except Exception:   # the scope package is optional here; without it nothing is open
        return None
    return current()


# The optimizer that keeps its state under each (daemon socket, namespace, prefix) in this
# process: a second one over other parameters is refused by name before it touches anything.
_holders: "weakref.WeakValueDictionary[tuple, AnchoredOptimizer]" = weakref.WeakValueDictionary()


class AnchoredOptimizer(StateDictMixin, RecoveryMixin, UndoMixin):
    """Wraps ``optimizer`` (Adam, AdamW or SGD; foreach/fused as configured).

    ``client``: a ``gpu_anchor`` client for the parameters' device (default: connect).
    ``chunk_bytes``: undo bytes per chunk (default: both slots <= 2 % of the anchored state).
    ``schedulers``: LR schedulers built on ``optimizer``; they step inside ``step()``
    and their state commits with it — do not call their ``step()`` yourself (``schedulers``
    says what is refused, and when).
    ``scaler``: a ``torch.amp.GradScaler`` for fp16 AMP: ``step()`` unscales (skipping the update
    on inf/NaN, all ranks alike) and updates it; its state commits with the step.  Use
    ``scaler.scale(loss).backward(); opt.step()`` (with ``scaler.unscale_(opt)`` before clipping,
    as torch's recipe has it), never ``scaler.step`` / ``update``; ``step_was_skipped`` says
    whether the last step's update was empty.  With accelerate's fp16 pass ``accelerator.scaler``:
    ``accelerator.clip_grad_norm_`` then unscales this optimizer too (``hf_accelerate``).
    ``track_rng``: journal torch's CPU (and this device's CUDA) RNG state at each step.
    ``progress``: where the per-chunk cursor lives — ``"journal"`` (one journal commit
    and one device wait per chunk) or ``"device"`` (an anchored int64 written by the
    device stream between chunks: one journal commit per step and no device wait in
    steady state; see ``protocol``).  Default: ``"device"`` on CUDA, ``"journal"`` on the host.
    ``config``: the same four settings as one ``StepProtocolConfig`` (then those keywords are not read).
    """

    _step_supports_amp_scaling = True     # GradScaler.step(opt) then reaches step() untouched: amp.misuse

    def __init__(self, optimizer: torch.optim.Optimizer, *, model: torch.nn.Module | None = None,
                 client=None, prefix: str = "train", chunk_bytes: int | None = None,
                 schedulers=(), track_rng: bool = True, progress: str | None = None, scaler=None,
                 config: StepProtocolConfig | None = None) -> None:
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError("AnchoredOptimizer wraps a torch.optim.Optimizer")
        if config is None:
            config = StepProtocolConfig(prefix=prefix, chunk_bytes=chunk_bytes, progress=progress, track_rng=track_rng)
        elif not isinstance(config, StepProtocolConfig):
            raise TypeError(f"config must be a StepProtocolConfig, got {type(config).__name__}")
        self.config = config
        prefix, chunk_bytes, progress, track_rng = config.prefix, config.chunk_bytes, config.progress, config.track_rng
        if any(len(s) for s in optimizer.state.values()):
            raise ValueError("wrap the optimizer before its first step (its state must start anchored)")
        self.optimizer = optimizer
        self.kind = kind_of(optimizer)
        self.schedulers = Schedulers(schedulers, optimizer)
        self.scaler = amp.check(scaler)
        self.step_was_skipped = False       # the last step's update was empty: the scaler found inf/NaN
        self._schedulers_step = True        # the step in flight steps the schedulers (boundary record)
        # under accelerate, its Accelerator saves this optimizer and, in fp16, unscales its gradients
        self._accelerator = hf_accelerate.join(self, self.scaler)
        self._accelerator_looked = self._accelerator is not None     # else the first step looks again
        # completed_steps = the journal's step + this; a loaded state_dict moves it (``state_dict``)
        self._step_offset = 0
        self._loading = None                # our entry of a state_dict being loaded (``state_dict``)
        self.track_rng = track_rng
        self.prefix = prefix
        self.loop_state: dict = {}          # user's JSON/pickle-able loop data, carried with each step
        self.stats = {"steps": 0, "commits": 0, "commit_s": 0.0, "wait_s": 0.0, "fused_steps": 0, "copy_steps": 0}
        faults.arm_from_env()
        self._state = None
        self._dev = None              # DeviceProgress (progress="device")
        self._landed_one = False
        scope = _open_scope()
        args = (model, client, prefix, chunk_bytes, progress, scope.namespace if scope is not None else None)
        if scope is not None:
            # Inside managed_scope the parameters are placeholders until the scope binds:
            # bind our own state and recover once they are real.
            scope.on_bound(lambda: self._attach(*args))
        else:
            self._attach(*args)

    def _attach(self, model, client, prefix, chunk_bytes, progress, namespace=None) -> None:
        optimizer = self.optimizer
        self._params, self.device = layout.collect(optimizer, model)
        layout.check_anchored(self._params)
        if client is None:
            client = layout.connect(self._params, self.device, namespace)
        self.client = client
        self._journal = client.journal
        holder_key = (getattr(client, "socket_path", None), getattr(client, "namespace", None), prefix)
        mine = layout.describe(type(optimizer).__name__, self._signature())
        other = _holders.get(holder_key)
        if other is not None and other._signature() != self._signature():
            raise layout.foreign_state(
                f"another AnchoredOptimizer in this process keeps its state under prefix {prefix!r} in namespace "
                f"{holder_key[1]!r}: {layout.describe(type(other.optimizer).__name__, other._signature())}", mine, prefix)

        # ------------------------------------------------------------ journal first
        vals = self._journal.get_many(prefix=prefix + "/")
        self._state = StepState.decode(vals.get(key(prefix, "state")))
        meta = json.loads(vals[key(prefix, "meta")]) if key(prefix, "meta") in vals else None
        resuming = self._state.step > 0 or self._state.in_flight
        if resuming and meta is not None and meta["params"] != self._signature():
            # The journal records which parameters (names, shapes, dtypes) the state belongs to.
            raise layout.foreign_state(
                f"namespace {holder_key[1]!r} holds another optimizer's state under prefix {prefix!r}: "
                f"{layout.describe(meta.get('optimizer', '?'), meta['params'], self._state.step)}", mine, prefix,
                "; if this is that optimizer and the model changed, its anchored state does not fit: restore from "
                f"a checkpoint, or drop the namespace (`gpu-anchor drop {holder_key[1]}`) to start over.")
        keys_of = [self.kind.state_keys(optimizer.param_groups[q.group]) for q in self._params]
        sizes = [[q.local.element_size()] * (1 + len(k)) for q, k in zip(self._params, keys_of)]
        total = sum(q.local.numel() * (sum(s) + q.local.element_size()) for q, s in zip(self._params, sizes))
        if self._state.in_flight:
            if meta is None:
                raise RuntimeError("journal shows a step in flight but no protocol metadata")
            chunk_bytes = meta["chunk_bytes"]
            progress = meta.get("progress", "journal")
        elif chunk_bytes is None:
            chunk_bytes = chunking.default_chunk_bytes(total)
        self.chunk_bytes = int(chunk_bytes)
        self.progress = progress or ("device" if self.device.type == "cuda" else "journal")
        if self.progress not in ("journal", "device"):
            raise ValueError(f"progress must be 'journal' or 'device', not {progress!r}")
        self._elem_sizes = sizes
        self._chunks = chunking.plan([q.local.numel() for q in self._params], sizes, self.chunk_bytes)
        if self._state.in_flight and len(self._chunks) != self._state.chunks:
            raise RuntimeError(f"in-flight step has {self._state.chunks} chunks, the plan now {len(self._chunks)}")
        tagged = fused_adam.tagged(self.device, self.kind)
        # a copy step's slot holds a chunk's image (and, tagged, a ring: a step begun fused is
        # finished by the kernel even by a worker that then saves by copies)
        self._copy_slot_bytes = max(chunking.chunk_bytes_used(c, sizes) for c in self._chunks)
        if tagged:
            self._copy_slot_bytes = max(self._copy_slot_bytes, fused_adam.RING_MIN_BYTES)
        self.fused_reason = self._fused_reason(tagged)   # None: steps may use the fused update
        slot_bytes = self._slot_bytes(vals.get(key(prefix, "boundary")))

        # ------------------------------------------------------------ bind everything at once
        undo, self._word, self._tags = layout.bind_state(      # _word held: an anchored object lives while referenced
            client, prefix, self._params, keys_of, self._chunks, slot_bytes, self.kind, self.device,
            in_flight=self._state.in_flight, committed_steps=self._state.step if resuming else None)
        for q in self._params:
            optimizer.state[q.p] = q.states   # the wrapped optimizer's state is the anchored tensors
        self._group_lists = layout.group_lists(optimizer)     # groups_changed compares with it
        self._hook_state_dicts()
        self._use_undo(undo)
        if self.progress == "device":
            self._dev = DeviceProgress(self._word, self.device, self._copy_to_undo, self.stats)
        self._counts = [0] * len(self._params)
        self._rank, self._world = distributed.world()
        fresh = self._world == 1 and all(_local(q.p) is q.p for q in self._params)
        asked = self.config
        self.config = cfg = asked.resolve(fresh and self.device.type == "cuda",
                                          sum(q.grad.numel() * q.grad.element_size() for q in self._params))
        self.lender = GradientLender(self._params, cfg.lend_grad_bytes, self.device) \
            if fresh and cfg.lend_grad_bytes > 0 else None
        framework = "under DDP / FSDP2 the gradient buffers are the framework's and zero_grad() does not free them"
        why_not = (framework if cfg.lend_grad_bytes > 0 and not fresh else
                   self.lender.disabled if self.lender is not None else None)
        if why_not and asked.lend_grad_bytes is not AUTO:      # an automatic choice stays quiet
            warnings.warn(f"gpu_anchor: StepProtocolConfig.lend_grad_bytes lends nothing here: {why_not}",
                          RuntimeWarning, stacklevel=3)
        if cfg.grads_in_place and not fresh:
            warnings.warn(f"gpu_anchor: StepProtocolConfig.grads_in_place writes no gradient in place here: {framework}",
                          RuntimeWarning, stacklevel=3)
        self._grads = GradientBuffers(self._params, fresh=fresh, lender=self.lender,
                                      in_place=cfg.grads_in_place and fresh,
                                      quiet=asked.grads_in_place is AUTO)
        self._barrier = distributed.BoundaryBarrier(self.device) if self._world > 1 else None

        with torch.no_grad():
            if not resuming:
                self._zero_states()
                # a namespace with no step starts afresh: what a load committed before (the
                # states were zeroed above) is not this worker's (state_dict.py)
                stale = [key(prefix, k) for k in ("committed", "sched", "carry") if key(prefix, k) in vals]
                self._commit({key(prefix, "state"): StepState(0, "idle", 0, -1, len(self._chunks)).encode(),
                              key(prefix, "meta"): self._meta()}, deletes=stale)
                vals = {k: v for k, v in vals.items() if k not in stale}
            if resuming or self._world > 1:
                # With several ranks every rank joins the agreement, a fresh one too: a peer
                # killed after its first boundary commit resumes, and its all-gather needs us.
                self._resume(vals)
            if resuming and (meta is None or json.loads(self._meta()) != meta):
                self._commit({key(prefix, "meta"): self._meta()})
            self._grads.zero()
        self.schedulers.mark()
        _holders[holder_key] = self

    # ------------------------------------------------------------------ public
    @property
    def completed_steps(self) -> int:
        """Optimizer steps committed; the training loop continues at this iteration."""
        if self._state is None:
            raise RuntimeError("AnchoredOptimizer built inside managed_scope attaches when the scope exits")
        return self._state.step + self._step_offset

    @property
    def param_groups(self):
        return self.optimizer.param_groups

    def add_param_group(self, param_group: dict) -> None:
        """Refused: the state of every parameter is anchored when the optimizer is built."""
        raise TypeError("AnchoredOptimizer anchors the state of every parameter when it is built, so it takes no "
                        "group later (a parameter added then would never be updated). Build the wrapped optimizer "
                        "with every group (trainable or not: a frozen parameter gets no update), in a new namespace "
                        "or prefix")

    @property
    def num_chunks(self) -> int:
        return len(self._chunks)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Start the next step's gradients.

        ``set_to_none=True`` (torch's default): in one process with plain tensors ``p.grad``
        becomes None, as in torch, and the gradient backward makes is copied into the anchored
        buffer as soon as it is accumulated (``p.grad`` then points at the buffer); under DDP or
        FSDP2 the anchored buffers are zeroed in place.  Either way a parameter that receives no
        gradient before the next ``step`` is skipped by it, exactly as torch skips ``grad is None``.
        ``set_to_none=False``: the anchored buffers are zeroed in place and ``p.grad`` keeps
        pointing at them.
        """
        if self.completed_steps is not None and self._state.in_flight:
            raise RuntimeError("zero_grad during an optimizer step")
        if hf_accelerate.defers_step():     # the gradients accumulate on
            return
        faults.hit("between_steps", self._state.step - 1)   # "after step s committed"
        with torch.no_grad():
            self._grads.zero(cleared=set_to_none)

    def step(self, closure=None) -> None:
        """Finalize gradients, then apply the update chunk by chunk under the protocol.

        Call after backward (and any all-reduce), on every rank.  With ``progress="journal"``
        it returns when the step is committed in the journal.  With ``progress="device"`` it
        returns once the step is enqueued: the device stream records its own progress, and
        the step's journal commit lands with the next step's (or at ``flush()``, on the
        first step of a worker and when a checkpoint is due).  A kill at any instant after
        ``step()`` returns still resumes after this step.  Inside accelerate's ``accumulate()``,
        on a micro-batch that ends no accumulation, it does nothing (``hf_accelerate``).
        """
        if closure is not None:
            raise ValueError("AnchoredOptimizer.step does not take a closure")
        self.completed_steps    # raises if not attached yet
        if hf_accelerate.defers_step():     # inside accelerate's accumulate(), as its own wrapper does
            return
        why = amp.misuse(self) or layout.groups_changed(self) or hf_accelerate.before_step(self)
        if why:
            raise RuntimeError(f"AnchoredOptimizer: {why}. This step did not begin.")
        self.schedulers.check()
        st = self._state
        faults.hit("before_boundary", st.step)
        with torch.no_grad():
            mask = self._finalize_grads()
            counts = list(self._counts)
            hps = [_hparams(g) for g in self.optimizer.param_groups]
            carry = self._capture_carry()
            device = self.progress == "device"
            plan = self._fused_plan(mask, counts, hps)
            if plan is None and self.undo_bytes < 2 * self._copy_slot_bytes:
                self._grow_undo()
            if not device:
                self._copy_to_undo(0)
                self._wait()     # the gradients (and chunk 0's undo image) are in memory
            # Device mode: no wait — the device word, not this commit, marks the gradients
            # final.  The previous step's pending commit rides along (device past it first).
            puts, landed = self._dev.take_pending() if device else ({}, None)
            # on a step the scaler skipped, joined to accelerate, step the schedules as it would
            self._schedulers_step = not (self.step_was_skipped and hf_accelerate.holds_back_schedulers(
                self._accelerator, self.scaler, self.optimizer))
            boundary = json.dumps({"mask": "".join("1" if m else "0" for m in mask), "counts": counts,
                                   "hparams": hps, **self._undo_record(plan),
                                   **({} if self._schedulers_step else {"schedulers_step": False})}).encode()
            new = st.begin(len(self._chunks), device_progress=device)
            puts.update({key(self.prefix, "state"): new.encode(), key(self.prefix, "boundary"): boundary,
                         key(self.prefix, "carry_inflight"): carry})
            self._commit(puts)
            self._state = new
            if landed is not None:
                step_hooks.step_committed(landed, self.client)
            faults.hit("after_boundary", st.step)
            if self._barrier is not None:
                self._barrier()
            if device:
                self._dev.publish(new.step, 0, save=plan is None)
            self._run_from(0, mask, counts, hps, carry, plan)
        step_hooks.optimizer_stepped(self.optimizer)   # torch's step post-hooks, as inner.step() runs them

    def flush(self) -> None:
        """Land the last step's journal commit now (waits for the device to finish it).

        Only ``progress="device"`` leaves one pending; without ``flush`` it lands with the
        next ``step()``.  Durability does not need it (a killed worker's successor lands it
        from the device word); call it before reading the journal from another process.
        """
        if self._dev is None:
            return
        puts, landed = self._dev.take_pending()
        if landed is not None:
            self._commit(puts)
            step_hooks.step_committed(landed, self.client)

    # ------------------------------------------------------------------ protocol
    def _run_from(self, c0: int, mask, counts, hps, carry, plan=None) -> None:
        """Chunks ``c0..N-1`` of the step in flight; ``plan``: the fused update's launches
        per chunk (device mode only: each chunk saves itself as it is written), else copies."""
        steps = self._step_tensors(mask, counts, hps) if plan is None else None
        n = len(self._chunks)
        s = self._state.step
        device = self.progress == "device"
        for i in range(c0, n):
            faults.hit("before_update", s, i, before_kill=self._wait)
            if plan is not None:
                if faults.armed("mid_chunk", s, i):      # a kill inside the kernel: stop it half way
                    self._exec.apply_fused(i, plan[i], protocol.encode_progress(s, i), stop=self._half(i, plan[i]))
                    faults.hit("mid_chunk", s, i, before_kill=self._wait)
                self._exec.apply_fused(i, plan[i], protocol.encode_progress(s, i))
            else:
                if device and i + 1 < n:
                    self._dev.save_ahead(i + 1)      # overlaps the update of chunk i
                self._apply(i, mask, counts, steps, hps)
            if plan is None and faults.armed("mid_chunk", s, i):
                faults.hit("mid_chunk", s, i, before_kill=lambda: self._scribble(i))
            if i + 1 < n and not device:
                self._copy_to_undo(i + 1)
                self._wait()
            faults.hit("after_update", s, i, before_kill=self._wait)
            if i + 1 == n:
                self._finish(mask, counts, carry)
            elif not device:
                new = self._state.chunk_done(i)
                self._commit({key(self.prefix, "state"): new.encode()})
                self._state = new
            elif plan is None:
                self._dev.advance(s, i + 1)
            # else: a fused chunk's tags are the cursor (FusedAdam.last_started)
            faults.hit("after_commit", s, i, before_kill=self._wait)
        self.stats["steps"] += 1

    def _finish(self, mask, counts, carry) -> None:
        self.optimizer._opt_called = True   # the step did happen (schedulers warn otherwise)
        if self._schedulers_step:
            self.schedulers.step()
        new_counts = [c + (1 if m else 0) for c, m in zip(counts, mask)]
        committed = json.dumps({"counts": new_counts, "hparams": [_hparams(g) for g in self.optimizer.param_groups],
                                **self._offset_record()}).encode()
        sched = self.schedulers.state()
        new = self._state.finish()
        p = self.prefix
        # STEP_KEY in the same commit: the supervisor's contract (docs/supervisor.md) — crash-loop
        # detection, status, and checkpoints only at committed step boundaries.
        puts = {key(p, "state"): new.encode(), key(p, "committed"): committed, key(p, "sched"): sched,
                key(p, "carry"): carry, STEP_KEY: b"%d" % new.step}
        self._state = new
        self._counts = new_counts
        if self.progress == "device":
            self._dev.step_written(new.step - 1, len(self._chunks), puts)
            # The first step of a worker lands at once (the supervisor times recovery by it),
            # and so does one a listener must see committed (a checkpoint due there).
            if not self._landed_one or step_hooks.wants_landed(new.step):
                self._landed_one = True
                self.flush()
            return
        self._wait()
        self._commit(puts, deletes=[key(p, "boundary"), key(p, "carry_inflight")])
        step_hooks.step_committed(new.step, self.client)  # the supervisor's checkpoints, recovery timing

    def _finalize_grads(self) -> list[bool]:
        """The gradient-finalization boundary (``grads.GradientBuffers.finalize``), then the
        GradScaler's unscale: an inf/NaN masks every parameter out, as ``GradScaler.step`` skips."""
        mask = self._grads.finalize()
        self.step_was_skipped = self.scaler is not None and amp.unscale(
            self.scaler, [q.grad for q, m in zip(self._params, mask) if m], self.device, self._world > 1,
            found=amp.unscaled_by_loop(self.scaler, self))
        return [False] * len(mask) if self.step_was_skipped else mask

    def _zero_states(self) -> None:
        states = [t for q in self._params for t in q.states.values()]
        if states:
            torch._foreach_zero_(states)

    def _capture_carry(self) -> bytes:
        return carry_mod.capture(self.loop_state, self.device if self.track_rng else None, self.scaler)

    def _restore_carry(self, raw: bytes) -> None:
        self.loop_state = carry_mod.restore(raw, self.device, self.scaler)

    def _wait(self) -> None:
        if self.device.type == "cuda":
            t0 = time.perf_counter()
            torch.cuda.current_stream(self.device).synchronize()
            self.stats["wait_s"] += time.perf_counter() - t0

    def _commit(self, puts: dict, deletes=()) -> None:
        t0 = time.perf_counter()
        self._journal.commit(puts, deletes)
        self.stats["commit_s"] += time.perf_counter() - t0
        self.stats["commits"] += 1

    def _signature(self) -> list:
        return layout.signature(self._params)

    def _meta(self) -> bytes:
        return json.dumps({"params": self._signature(), "chunk_bytes": self.chunk_bytes, "progress": self.progress,
                           "optimizer": type(self.optimizer).__name__}).encode()

    def __repr__(self) -> str:
        return (f"AnchoredOptimizer({type(self.optimizer).__name__}, params={len(self._params)}, "
                f"chunks={len(self._chunks)}, undo={self.undo_bytes} B, completed_steps={self.completed_steps})")
