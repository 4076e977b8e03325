"""The training protocol's one outward event: "step committed" (torch-free).

``AnchoredOptimizer`` knows when a step became durable; what should happen then (report the
first step of a restarted worker, take a checkpoint that is due) belongs to whoever
supervises the job.  So the optimizer only emits, and a supervisor subscribes — the worker
bootstrap of ``gpu-anchor run`` / ``gpu-anchor torchrun`` does, before the user's code
runs — and ``train/`` imports nothing above it::

    class Listener:
        def wants_landed(self, step: int) -> bool: ...       # must this step's commit land now?
        def step_committed(self, step: int, clients: tuple) -> None: ...

    step_hooks.subscribe(Listener())

``wants_landed``: with device-side progress a step's journal commit lands with the next
step's; a listener that will read the journal at ``step`` (a checkpoint due there) says so
and the optimizer lands it at once.  ``step_committed`` runs on the training thread right
after the commit, before anchored state is touched again.  An exception in a listener
propagates (a checkpoint that cannot be taken must not pass in silence).
"""
from __future__ import annotations

_listeners: list = []


def subscribe(listener) -> None:
    """Add ``listener`` (once; subscribing it again changes nothing)."""
    if listener not in _listeners:
        _listeners.append(listener)


def unsubscribe(listener) -> None:
    if listener in _listeners:
        _listeners.remove(listener)


def wants_landed(step: int) -> bool:
    return any(li.wants_landed(step) for li in _listeners)


def step_committed(step: int, *clients) -> None:
    for li in list(_listeners):
        li.step_committed(step, clients)


def optimizer_stepped(optimizer) -> None:
    """Run torch's optimizer-step post-hooks for ``optimizer`` (its own, then the global ones
    of ``torch.optim.optimizer.register_optimizer_step_post_hook``), as its ``step()`` would:
    ``AnchoredOptimizer`` applies the inner optimizer's update itself, and tools that watch
    steps through torch's hooks (the supervisor's automatic pre-warm among them) must see it.
    Pre-hooks are not run: they may rewrite ``step``'s arguments, which this step has none of."""
    from torch.optim import optimizer as torch_optimizer
    for hook in (*getattr(optimizer, "_optimizer_step_post_hooks", {}).values(),
                 *torch_optimizer._global_optimizer_post_hooks.values()):
        hook(optimizer, (), {})
