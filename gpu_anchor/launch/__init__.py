"""Supervision: ``gpu-anchor run`` / ``gpu-anchor torchrun`` / ``gpu-anchor serve``
(see docs/supervisor.md).

Worker side: ``AnchoredOptimizer`` needs nothing (the worker bootstrap subscribes the
supervisor to its "step committed" event).  A custom loop calls, on every rank, right
after the journal commit that made ``step`` durable::

    client.journal.commit({..., "gpu_anchor/step": b"%d" % step})
    gpu_anchor.launch.step_boundary(step, client, ...)

Importing this package does not import torch.
"""
from __future__ import annotations

from gpu_anchor.journal_keys import INCONSISTENT_KEY, STEP_KEY

from .boundary import STEPS
from .events import mark


def step_boundary(step: int, *clients) -> bool:
    """Report a committed step to the supervisor: recovery timing, and a checkpoint of
    ``clients``' namespaces when one is due (``--checkpoint-every``).  Returns True if a
    checkpoint was started."""
    return STEPS.step_committed(step, clients)


def checkpoint_due(step: int) -> bool:
    """True if ``step_boundary(step)`` will take a checkpoint (``--checkpoint-every``):
    a worker that defers its step commits must make that step durable first."""
    return STEPS.wants_landed(step)


__all__ = ["INCONSISTENT_KEY", "STEP_KEY", "checkpoint_due", "mark", "step_boundary"]
