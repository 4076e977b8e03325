"""Supervision: ``gpu-anchor run`` / ``gpu-anchor torchrun`` (see docs/supervisor.md).

Worker-side hook (the only call a training loop needs for checkpoints and
recovery timing)::

    client.journal.commit({..., "gpu_anchor/step": b"%d" % step})
    gpu_anchor.launch.step_boundary(step, client, ...)

Importing this package does not import torch.
"""
from __future__ import annotations

from .events import mark
from .health import INCONSISTENT_KEY, STEP_KEY

_first_step_marked = False


def step_boundary(step: int, *clients) -> bool:
    """Call on every rank right after the journal commit that made ``step`` durable.

    Reports the first step of this worker to the supervisor (recovery timing),
    and takes a checkpoint of ``clients``' namespaces when one is due
    (``--checkpoint-every``): concurrently by default (``gpu_anchor.checkpoint.supervised``;
    the job runs on while it copies), stop-the-world with ``--checkpoint-mode
    stop-the-world``.  Returns True if a checkpoint was started.
    """
    global _first_step_marked
    if not _first_step_marked:
        _first_step_marked = True
        mark("first_step", step=step)
    import os

    from .snapshot_paths import DIR_ENV, MODE_ENV, RESTORE_MODE_ENV
    concurrent = bool(os.environ.get(DIR_ENV)) and os.environ.get(MODE_ENV, "concurrent") == "concurrent"
    if concurrent or os.environ.get(RESTORE_MODE_ENV) == "on_demand":
        from gpu_anchor.checkpoint import supervised   # the job keeps running while it copies
        if concurrent:
            return supervised.boundary(step, clients)
        supervised.poll()
    return snapshot_at_step(step, clients)


def snapshot_at_step(step: int, clients) -> bool:
    from . import snapshot
    return snapshot.at_step(step, *clients)


def checkpoint_due(step: int) -> bool:
    """True if ``step_boundary(step)`` will take a checkpoint (``--checkpoint-every``):
    a worker that defers its step commits must make that step durable first."""
    from . import snapshot
    return snapshot.due(step)


__all__ = ["INCONSISTENT_KEY", "STEP_KEY", "checkpoint_due", "mark", "step_boundary"]
