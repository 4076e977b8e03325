"""How a step's chunks are written and saved: the chunk executor, the two undo slots, and
the fused update's plan (``AnchoredOptimizer``'s part that ``protocol`` calls "undo").

A chunk is saved before it is written, in one of two ways the boundary records
(``_undo_record``): by copies (the chunk's image into a slot, then torch's update), or by the
fused Triton update, which keeps a ring of the blocks in flight in the slots as it writes them.
The slots are sized for the way steps are expected to go (``_slot_bytes``) and grown before a
boundary when a step must save by copies after all (``_grow_undo``).
"""
from __future__ import annotations

import json

from . import fused_adam, layout
from .chunk_exec import ChunkExecutor


class UndoMixin:
    # ------------------------------------------------------------------ pieces
    def _apply(self, i, mask, counts, steps, hps) -> None:
        self._exec.apply(i, mask, counts, steps, hps)

    def _step_tensors(self, mask, counts, hps):
        return self._exec.step_tensors(counts, hps)

    def _copy_to_undo(self, i) -> None:
        self._exec.copy_to_undo(i)

    def _copy_from_undo(self, i) -> None:
        self._exec.copy_from_undo(i)
        self._wait()

    def _scribble(self, i) -> None:
        self._exec.scribble(i)
        self._wait()

    def _half(self, i, groups) -> int:
        """Fault injection: the block at which a fused chunk's launches stop (half of the first's)."""
        return max(1, self._exec.fused._table(i, tuple(groups[0][2]))[2] // 2)

    # ------------------------------------------------------------------ undo slots
    def _slot_bytes(self, boundary: bytes | None) -> int:
        """The undo slots' size.  A step in flight keeps those it was saved in (its boundary
        records their size; a record without one is a chunk's image).  Otherwise: where steps
        are expected fused, the ring alone (a chunk's launches, one per parameter group and
        dtype it spans), else a chunk's image; a copy step grows them (``_grow_undo``)."""
        if self._state.in_flight:
            return json.loads(boundary).get("undo_slot_bytes", self._copy_slot_bytes) \
                if boundary is not None else self._copy_slot_bytes
        if self.fused_reason is not None:
            return self._copy_slot_bytes
        launches = max(len({(self._params[s.param].group, self._params[s.param].local.dtype) for s in c})
                       for c in self._chunks)
        return min(self._copy_slot_bytes, fused_adam.ring_slot_bytes(launches, self.device))

    def _use_undo(self, undo) -> None:
        self._undo = undo       # held: an anchored object is freed once its tensor is collected
        self.undo_bytes = 2 * undo[0].numel()
        self._exec = ChunkExecutor(self._params, self._chunks, self._elem_sizes, undo, self.kind, self._tags)

    def _grow_undo(self) -> None:
        """This step saves by copies and the undo slots hold the fused ring alone: replace them
        by slots of a chunk's image, before the boundary.  The last step lands first (while it
        is in flight a kill reads its ring), so no step names the slots being replaced."""
        self.flush()
        self._wait()
        self._use_undo(layout.rebind_undo(self.client, self.prefix, self._copy_slot_bytes))

    # ------------------------------------------------------------------ fused update
    def _fused_reason(self, tagged: bool) -> str | None:
        if not self.config.fused_update:
            return "off (StepProtocolConfig.fused_update=False)"
        if self.progress != "device":
            return "progress='journal' saves each chunk before its cursor commit"
        if not tagged:
            return "not Adam/AdamW on CUDA"
        from .fused_adam import unavailable_reason
        return unavailable_reason(self.device)

    def _fused_plan(self, mask, counts, hps, finishing: bool = False):
        """This step's fused launches per chunk, or None: it saves by copies.  ``finishing``: a
        step begun fused, finished by the kernel even where the switch is now off."""
        if self.fused_reason is not None and not (finishing and self._exec.fused is not None
                                                  and fused_adam.unavailable_reason(self.device) is None):
            return None
        plan = self._exec.fused_step(mask, counts, hps)
        self.stats["fused_steps" if plan is not None else "copy_steps"] += 1
        return plan

    @staticmethod
    def _fused_block() -> int:
        from .fused_adam import BLOCK
        return BLOCK

    def _undo_record(self, plan) -> dict:
        slots = {"undo_slot_bytes": self.undo_bytes // 2}
        return {"undo": "ring", "undo_block": self._fused_block(), **slots} if plan is not None \
            else {"undo": "copy", **slots}
