"""Where the training loop stands, derived from the committed step count.

The optimizer step is the unit of progress: after a restart ``opt.completed_steps``
is exact, so anything that is a function of the step (epoch, position in the epoch,
the sampler's seed) is exact too.  Values that are not (tokens seen, a running loss)
go in ``opt.loop_state`` — a dict captured at each step's gradient-finalization
boundary and committed with the step, restored in the next worker.

The data loader itself is the user's: make batch ``k`` of epoch ``e`` a pure function
of ``(seed, e, k)`` (e.g. ``DistributedSampler(..., seed=seed)`` + ``set_epoch(e)``, then
skip ``k`` batches, or index a pre-shuffled permutation directly).  Anything it keeps
in memory (prefetch queues, worker RNG) is rebuilt, not anchored.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class LoopPosition:
    step: int            # next iteration to run == optimizer steps committed
    epoch: int
    batch_in_epoch: int


def position(completed_steps: int, steps_per_epoch: int) -> LoopPosition:
    """Epoch and batch index of the next iteration, given ``steps_per_epoch`` optimizer steps per epoch."""
    if steps_per_epoch <= 0:
        raise ValueError("steps_per_epoch must be positive")
    if completed_steps < 0:
        raise ValueError("completed_steps must be >= 0")
    epoch, k = divmod(completed_steps, steps_per_epoch)
    return LoopPosition(completed_steps, epoch, k)


class LoopState:
    """``LoopState(opt, steps_per_epoch)``: ``.position`` now, ``.data`` = ``opt.loop_state``."""

    def __init__(self, opt, steps_per_epoch: int) -> None:
        self._opt = opt
        self.steps_per_epoch = steps_per_epoch

    @property
    def position(self) -> LoopPosition:
        return position(self._opt.completed_steps, self.steps_per_epoch)

    @property
    def data(self) -> dict:
        return self._opt.loop_state

    def batches(self, total_steps: int):
        """Yield ``(step, epoch, batch_in_epoch)`` from where the last worker stopped."""
        for step in range(self._opt.completed_steps, total_steps):
            e, k = divmod(step, self.steps_per_epoch)
            yield step, e, k
