"""The device side of ``progress="device"``: the progress word, the undo side stream and
the deferred step commit (the state machine is in ``protocol``; docs/training.md).

The word is one anchored int64 that only the device stream writes, between kernels, so
the host never waits inside a step; the step's journal commit is kept pending and lands
with the next step's boundary commit, after the device has finished the step.  A copy step
moves it before each chunk; a fused step only at its start and end (its blocks' tags say
how far it got in between: ``FusedAdam.last_started``).
"""
from __future__ import annotations

import os
import time

import torch

from . import protocol

SIDE_STREAM_ENV = "GPU_ANCHOR_UNDO_STREAM"   # "0": undo copies on the main stream


class DeviceProgress:
    def __init__(self, word: torch.Tensor, device: torch.device, copy_to_undo, stats: dict) -> None:
        self.word = word
        self.device = device
        self._copy_to_undo = copy_to_undo
        self._stats = stats
        self._pending = None     # (journal puts, step, done event) of a step the device may still run
        cuda = device.type == "cuda"
        self._side = torch.cuda.Stream(device) if cuda and os.environ.get(SIDE_STREAM_ENV, "1") != "0" else None

    def resume_point(self, state: protocol.StepState, last_started: int | None = None) -> int | None:
        """Where the device left the in-flight step (``protocol.device_resume_point``)."""
        return protocol.device_resume_point(state, int(self.word.item()), last_started)

    def publish(self, step: int, i: int, save: bool = True) -> None:
        """Save chunk ``i`` (unless the fused update saves it itself: ``save=False``), then let
        the stream record ``cursor = undo = i``."""
        if save:
            self._copy_to_undo(i)
        self.word.fill_(protocol.encode_progress(step, i))

    def save_ahead(self, i: int) -> bool:
        """Start saving chunk ``i`` on the side stream while chunk ``i-1`` is applied (False
        without a side stream: ``advance`` then saves it).

        Slot ``i % 2`` held chunk ``i-2``'s image, dead once the word shows ``i-1`` — which
        the main stream has written before this point; the word moves to ``i`` only after the
        main stream has waited for this copy.  Overlapping the copy with the update kernels
        hides part of its cost (H200, 1B model: step overhead 2.57 % → 1.87 %).
        """
        if self._side is None:
            return False
        self._side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self._side):
            self._copy_to_undo(i)
        return True

    def advance(self, step: int, i: int) -> None:
        """Chunk ``i-1`` of a copy step is applied: move the word to ``i`` once chunk ``i`` is
        saved.  A fused step does not call it: its tags carry the cursor, which spares a
        kernel launch between chunks (docs/training.md, "Fused undo")."""
        if self._side is None:
            self.publish(step, i)
            return
        torch.cuda.current_stream(self.device).wait_stream(self._side)
        self.word.fill_(protocol.encode_progress(step, i))

    def step_written(self, step: int, chunks: int, puts: dict) -> None:
        """Every chunk of ``step`` is enqueued: the word says so, and its commit waits."""
        self.word.fill_(protocol.encode_progress(step, chunks))
        done = None
        if self.device.type == "cuda":
            done = torch.cuda.Event()
            done.record(torch.cuda.current_stream(self.device))
        self._pending = (puts, step + 1, done)

    def take_pending(self) -> tuple[dict, int | None]:
        """The pending step commit ``(puts, committed_steps)``, once the device has finished
        that step (in steady state long since); ``({}, None)`` if there is none."""
        if self._pending is None:
            return {}, None
        puts, landed, done = self._pending
        self._pending = None
        if done is not None:
            t0 = time.perf_counter()
            done.synchronize()
            self._stats["wait_s"] += time.perf_counter() - t0
        return puts, landed
