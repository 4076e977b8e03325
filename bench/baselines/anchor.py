"""gpu-anchor as a training "method": nothing is saved; the state stays in the daemon.

A (re)started worker builds the model without initialisation, ``anchor_module`` maps the
parameters the previous worker left in the daemon (matched: no copy), and
``AnchoredOptimizer`` maps gradients and optimizer state and finishes or rolls back an
in-flight step from its journal.  The loop resumes at ``completed_steps``: no work is
lost beyond the interrupted step.  Needs a running daemon for the device
(``gpu_anchor.client.control.start``) and ``gpu_anchor.train`` (issue 3).
"""
from __future__ import annotations

from .base import TrainCheckpoint


def available() -> str | None:
    """None when gpu-anchor's training protocol is importable, else why not."""
    try:
        from gpu_anchor.train import AnchoredOptimizer, anchor_module  # noqa: F401
        import gpu_anchor  # noqa: F401
    except Exception as e:  # pragma: no cover - depends on the other helpers' progress
        return f"{type(e).__name__}: {e}"
    return None


class Anchor(TrainCheckpoint):
    name = "gpu_anchor"
    label = "gpu-anchor"
    restores_from = "daemon (zero-copy)"

    def attach(self, model, opt, namespace: str):
        """Anchor ``model`` and wrap ``opt``; returns (anchored optimizer, first step to run)."""
        import gpu_anchor
        from gpu_anchor.train import AnchoredOptimizer, anchor_module
        self.client = gpu_anchor.connect(self.device, namespace=namespace)
        status = anchor_module(model, self.client)
        self.notes["matched"] = sum(1 for s in status.values() if s == "matched")
        self.notes["created"] = sum(1 for s in status.values() if s == "created")
        aopt = AnchoredOptimizer(opt, model=model, client=self.client)
        return aopt, aopt.completed_steps

    def save(self, model, opt, step: int) -> None:  # every step commits; nothing to do
        return None

    def restore(self, model, opt) -> int | None:
        raise RuntimeError("use attach(): gpu-anchor restores by mapping, inside the optimizer")
