"""The LR schedulers an ``AnchoredOptimizer`` steps, and the ways a job can get them wrong.

Contract: a scheduler given as ``AnchoredOptimizer(inner, schedulers=[...])`` steps once at
the end of every optimizer step, inside ``step()``, and its state commits atomically with
that step; a restarted worker gets the state the last committed step left.  The job does not
step it.  A schedule written in epochs is written in optimizer steps instead
(``LambdaLR(inner, lambda s: f(s // steps_per_epoch))``).

A scheduler's state outside the commit would be silently wrong after a restart: the optimizer
resumes at its committed step while the schedule is a step (or a whole run) off.  So each
way of getting there is refused, naming the scheduler and the fix, before it does harm:

* at construction: a scheduler built on another optimizer; ``ReduceLROnPlateau`` (it steps on
  a metric the optimizer step never sees);
* at the start of ``step()``, before anything commits:
  - a given scheduler the job stepped itself since the last step (its position moved);
  - an LR scheduler built on the wrapped optimizer and not given (torch marks the optimizer's
    ``step`` when one is built; the live scheduler is then looked up once, so a scheduler
    built and dropped does not count).

Not detected: a second scheduler built on the optimizer next to one that is given (torch
marks the optimizer once), and a ``ReduceLROnPlateau`` built on it and not given (it does
not mark the optimizer).
"""
from __future__ import annotations

import gc
import pickle

import torch


def _position(sch):
    """Where ``sch`` is in its schedule: its ``last_epoch`` and its children's (Sequential,
    Chained); any ``step()`` moves it."""
    own = getattr(sch, "last_epoch", None)
    children = getattr(sch, "_schedulers", None)
    if children is None:
        return own
    return own, tuple(_position(c) for c in children)


def _name(sch) -> str:
    return type(sch).__name__


class Schedulers:
    """The schedulers ``AnchoredOptimizer.step()`` steps and commits (see the module's contract)."""

    def __init__(self, schedulers, optimizer: torch.optim.Optimizer) -> None:
        self.items = list(schedulers)
        self._optimizer = optimizer
        for i, sch in enumerate(self.items):
            if isinstance(sch, torch.optim.lr_scheduler.ReduceLROnPlateau):
                raise ValueError(
                    f"schedulers[{i}] is a ReduceLROnPlateau: it steps on a metric that "
                    "AnchoredOptimizer.step() does not see, so its state cannot commit with the step. "
                    "Use a schedule in optimizer steps (e.g. transformers.get_scheduler or LambdaLR)")
            for method in ("step", "state_dict", "load_state_dict"):
                if not callable(getattr(sch, method, None)):
                    raise TypeError(f"schedulers[{i}] ({_name(sch)}) has no {method}(): not an LR scheduler")
            if getattr(sch, "optimizer", optimizer) is not optimizer:
                raise ValueError(f"schedulers[{i}] ({_name(sch)}) is built on another optimizer: build it on "
                                 "the one AnchoredOptimizer wraps")
        self._positions = None         # after our last step (or restore); None: not yet known
        self._looked_up = None         # the marked optimizer.step we last looked behind

    # ------------------------------------------------------------------ the step
    def check(self) -> None:
        """At the start of ``step()``: refuse a scheduler stepped by the job, or one not given."""
        if self._positions is not None:
            for i, (sch, was) in enumerate(zip(self.items, self._positions)):
                if _position(sch) != was:
                    raise RuntimeError(
                        f"LR scheduler schedulers[{i}] ({_name(sch)}) was stepped outside "
                        "AnchoredOptimizer.step(): a scheduler given to it steps once inside each step() "
                        "and its state commits with that step. Remove the job's own scheduler.step() "
                        "call (stepped twice, the schedule runs ahead, and a restarted worker would not "
                        "match). A schedule in epochs is written in optimizer steps "
                        "(LambdaLR(inner, lambda s: f(s // steps_per_epoch))); with transformers.Trainer, "
                        "which steps its scheduler itself, use gpu_anchor.train.AnchoredTrainer. "
                        "This step did not begin.")
        marked = getattr(self._optimizer.step, "_wrapped_by_lr_sched", False)
        if marked and not self.items and self._looked_up is not self._optimizer.step:
            self._looked_up = self._optimizer.step
            stray = self._built_on_the_optimizer()
            if stray:
                names = ", ".join(sorted({_name(s) for s in stray}))
                raise RuntimeError(
                    f"an LR scheduler ({names}) is built on the optimizer AnchoredOptimizer wraps but is "
                    "not given to it: after a restart the optimizer resumes at its committed step while "
                    "that scheduler starts its schedule again. Build it on the inner optimizer, pass "
                    "AnchoredOptimizer(inner, schedulers=[scheduler]), and do not call its step() "
                    "yourself: it steps inside each step() and commits with it. This step did not begin.")

    def _built_on_the_optimizer(self) -> list:
        """Live LR schedulers on the wrapped optimizer that no other one steps (a SequentialLR's
        children are its own).  Walks the collector's objects: once per marked optimizer."""
        found = [o for o in gc.get_objects()
                 if issubclass(type(o), torch.optim.lr_scheduler.LRScheduler) and o.optimizer is self._optimizer]
        children = {id(c) for o in found for c in getattr(o, "_schedulers", ())}
        return [o for o in found if id(o) not in children]

    def step(self) -> None:
        """At the end of the step, before its commit: one step of each, in order."""
        for sch in self.items:
            sch.step()
        self.mark()

    # ------------------------------------------------------------------ what commits
    def state(self) -> bytes:
        return pickle.dumps([sch.state_dict() for sch in self.items])

    def load(self, raw: bytes) -> None:
        """The state a committed step left (a restarted worker, or a loaded checkpoint)."""
        for sch, sd in zip(self.items, pickle.loads(raw)):
            sch.load_state_dict(sd)
        self.mark()

    def mark(self) -> None:
        """Where the schedulers are now is ours: the job steps them from here only through ``step()``."""
        self._positions = [_position(s) for s in self.items]
