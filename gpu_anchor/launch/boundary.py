"""The supervisor's side of a worker's committed steps (runs in the worker).

``SupervisedSteps`` listens to the training protocol's "step committed" event
(``gpu_anchor.train.step_hooks``): it reports the first step of this worker to the
supervisor (recovery timing) and takes a checkpoint of the clients' namespaces when one is
due (``--checkpoint-every``): concurrently by default (``gpu_anchor.checkpoint.supervised``;
the job runs on while it copies), stop-the-world with ``--checkpoint-mode stop-the-world``.
The worker bootstrap subscribes it (``worker.subscribe``); a custom loop without
``AnchoredOptimizer`` calls ``gpu_anchor.launch.step_boundary`` itself.
Torch is imported only when a checkpoint is due.
"""
from __future__ import annotations

from gpu_anchor.checkpoint.settings import CheckpointSettings

from .events import mark


class SupervisedSteps:
    def __init__(self, settings: CheckpointSettings | None = None) -> None:
        self.settings = settings
        self._first_marked = False
        # told of each committed step first, from AnchoredOptimizer and step_boundary alike (the
        # automatic pre-warm's recorder, ``runtime.auto_prewarm.Recorder``, installed by the worker)
        self.watchers: list = []

    def _settings(self) -> CheckpointSettings:
        # what the supervisor gave this worker (a few dict lookups: read at each step, so a
        # forked child never sees its parent's)
        return self.settings or CheckpointSettings.from_env()

    def wants_landed(self, step: int) -> bool:
        return self._settings().due(step)

    def step_committed(self, step: int, clients) -> bool:
        """True if a checkpoint was started at this step."""
        for w in self.watchers:
            w.step_committed(step, clients)
        if not self._first_marked:
            self._first_marked = True
            mark("first_step", step=step)
        s = self._settings()
        if s.concurrent or s.restore_mode == "on_demand":
            from gpu_anchor.checkpoint import supervised   # the job keeps running while it copies
            if s.concurrent:
                return supervised.boundary(step, clients, s)
            supervised.poll()
        from gpu_anchor.checkpoint import snapshot
        return snapshot.at_step(step, *clients, settings=s)


# One per worker process: the bootstrap subscribes it, ``step_boundary`` calls it.
STEPS = SupervisedSteps()
