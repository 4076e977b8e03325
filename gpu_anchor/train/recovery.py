"""Recovery at attach: what ``AnchoredOptimizer`` does with the journal it finds.

``_resume(vals)`` runs in the constructor (or when ``managed_scope`` binds) once the anchored
objects are bound, with the journal's values under the optimizer's prefix:

- the last committed step's step counts, hyper-parameters, scheduler states and step offset
  (``state_dict``) are restored;
- a step in flight is discarded when no device got past its boundary (device progress, the
  word never published), else finished: the chunk at the cursor (the word's, or in fused
  steps the last tagged chunk's) is rolled back (its undo slot; in fused steps the blocks
  in flight, from the undo ring) and chunks ``cursor..N-1`` are redone from the anchored
  gradients with the boundary's mask, counts and hyper-parameters (in fused steps only the
  blocks of chunk ``cursor`` not written yet);
- with several ranks the ranks agree first (``distributed.decide`` / ``decide_device``), so
  every rank discards or every rank finishes;
- a step 0 discarded drops what a load committed before it (``state_dict``): a peer that never
  reached that boundary started afresh, and every rank must stand where it does;
- the carried loop / RNG state of the last step (committed or just finished) is restored.

A kill during recovery is recovered the same way: rolling back and redoing a chunk writes
what the interrupted step would have written.  docs/training.md, "Failure points and
recovery", has the state machine; the tests kill at every transition and compare with a
fault-free run.
"""
from __future__ import annotations

import json

from . import distributed, protocol
from .hparams import set_hparams as _set_hparams
from .protocol import key


class RecoveryMixin:
    def _resume(self, vals: dict) -> None:
        p = self.prefix
        st = self._state
        device = self.progress == "device"
        cursor = None     # device mode: where the device left the in-flight step (None: never began)
        if st.in_flight and device:
            fused = json.loads(vals[key(p, "boundary")]).get("undo") == "ring"
            cursor = self._dev.resume_point(st, self._exec.fused.last_started(st.step) if fused else None)
        if self._world > 1 and device:
            report = distributed.device_report(st.step, st.in_flight, cursor, len(self._chunks))
            action = distributed.decide_device(distributed.gather_states(report), self._rank)
            if st.in_flight and report[1] is None:
                action = "finish"            # fully written on the device: land its commit
        elif self._world > 1:
            action = distributed.decide(distributed.gather_states((st.step, st.step if st.in_flight else None)),
                                        self._rank)
        elif not st.in_flight:
            action = "none"
        else:
            action = "discard" if device and cursor is None else "finish"
        stale = []
        if action == "discard" and st.step == 0:
            # The first step after a load into a fresh namespace (state_dict.py), and a peer that
            # never reached its boundary started afresh, dropping that load's records: drop ours
            # too, so that every rank stands at step 0 and the job loads again on each.
            stale = [key(p, k) for k in ("committed", "sched", "carry") if key(p, k) in vals]
            vals = {k: v for k, v in vals.items() if k not in stale}
            if stale:
                self._zero_states()
        if key(p, "committed") in vals:
            committed = json.loads(vals[key(p, "committed")])
            self._counts = committed["counts"]
            self._step_offset = committed.get("step_offset", 0)
            for g, hp in zip(self.optimizer.param_groups, committed["hparams"]):
                _set_hparams(g, hp)
            self.schedulers.load(vals[key(p, "sched")])
        if action == "discard":
            # No device (of any rank) got past the boundary: no chunk was written.
            new = self._state.discard()
            self._commit({key(p, "state"): new.encode()}, deletes=stale)
            self._state = new
        elif action == "finish":
            b = json.loads(vals[key(p, "boundary")])
            mask = [c == "1" for c in b["mask"]]
            for g, hp in zip(self.optimizer.param_groups, b["hparams"]):
                _set_hparams(g, hp)
            carry = vals[key(p, "carry_inflight")]
            self._schedulers_step = b.get("schedulers_step", True)
            fused = b.get("undo") == "ring"        # how this step saves its chunks (boundary)
            if b.get("undo") not in ("ring", "copy", None) or (fused and b.get("undo_block") != self._fused_block()):
                raise RuntimeError(f"the step in flight was saved by another version's fused update "
                                   f"({b.get('undo')!r}, blocks of {b.get('undo_block')} elements; this one: 'ring', "
                                   f"{self._fused_block()}): finish it with that version or restore from a checkpoint")
            plan = None
            if device:
                if fused:
                    plan = self._fused_plan(mask, b["counts"], b["hparams"], finishing=True)
                    if plan is None and (cursor is None or cursor < len(self._chunks)):
                        raise RuntimeError(
                            f"step {st.step} was begun by the fused update and this worker cannot run it "
                            f"({self.fused_reason or 'the kernel does not reproduce this configuration here'}); "
                            "its written blocks have no undo image, so it can only be finished by the kernel: "
                            "run this worker where Triton imports (nothing anchored was changed)")
                if cursor is None:      # another rank's device began it: ours has the final gradients
                    cursor = 0
                    self._dev.publish(st.step, 0, save=not fused)
                elif cursor < len(self._chunks) and fused:
                    self._exec.restore_fused(cursor, protocol.encode_progress(st.step, cursor))
                    self._wait()
                elif cursor < len(self._chunks):
                    self._copy_from_undo(cursor)
            else:
                cursor = self._state.cursor
                if self._state.rollback_chunk() is not None:
                    self._copy_from_undo(cursor)
            if cursor == len(self._chunks):
                self._finish(mask, b["counts"], carry)
            else:
                self._run_from(cursor, mask, b["counts"], b["hparams"], carry, plan)
            vals = dict(vals, **{key(p, "carry"): carry})
        if key(p, "carry") in vals:
            self._restore_carry(vals[key(p, "carry")])
