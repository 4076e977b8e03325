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
    (``--checkpoint-every``).  Returns True if a checkpoint was started.
    """
    global _first_step_marked
    if not _first_step_marked:
        _first_step_marked = True
        mark("first_step", step=step)
    from . import snapshot
    return snapshot.at_step(step, *clients)


__all__ = ["INCONSISTENT_KEY", "STEP_KEY", "mark", "step_boundary"]
