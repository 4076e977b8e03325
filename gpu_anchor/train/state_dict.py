"""``state_dict`` / ``load_state_dict`` for AnchoredOptimizer (checkpoints in torch's format).

``opt.state_dict()`` is the wrapped optimizer's (``state``, ``param_groups``) plus one entry of
ours, ``"gpu_anchor": {"completed_steps": N, "schedulers": [...]}``: what a step commits besides
the tensors, so that a checkpoint written by someone else's code (``accelerator.save_state``,
Trainer's, a plain ``torch.save(opt.state_dict())``) restores the job whole.  A torch optimizer
loading it ignores that entry; ``load_state_dict`` takes a torch optimizer's too.

Loading is between steps, and commits at once what it set besides the tensors (step counts,
hyper-parameters, the schedulers' state, the step count): the anchored tensors are overwritten
in place, so the journal must describe them.  ``completed_steps`` is kept as an offset over the
journal's own step (``step_offset``), which the protocol's numbers (device word, fused tags, the
supervisor's step key) never see.  A worker killed during or right after a load into a namespace
with no step yet starts it afresh (``completed_steps`` 0), and so does one whose first step after
the load is discarded (``recovery``: with several ranks, a peer that never reached its boundary
started afresh), so a script that loads its checkpoint when ``completed_steps == 0`` loads it
again on every rank, RNG states included (accelerate and Trainer set those after the
optimizer's load).  Into a namespace with steps, a load is not atomic (the
model's weights are loaded by other code, before it): a worker killed during it resumes with
what had been loaded; load again.
"""
from __future__ import annotations

import json

import torch

from .fsdp import like, local
from .hparams import hparams as _hparams
from .protocol import key

EXTRA = "gpu_anchor"      # our entry in a state_dict


class StateDictMixin:
    def state_dict(self) -> dict:
        """The wrapped optimizer's ``state_dict`` (anchored tensors, current step counts), with
        ``completed_steps`` and the given schedulers' states under ``"gpu_anchor"``."""
        for q in self._params:
            st = {k: like(q.p, t) for k, t in q.states.items()}     # DTensors for FSDP2 (DCP-ready)
            if self.kind.has_step:
                st["step"] = torch.tensor(float(self._counts[q.index]))
            self.optimizer.state[q.p] = st
        sd = self.optimizer.state_dict()
        sd[EXTRA] = {"completed_steps": self.completed_steps,
                     "schedulers": [sch.state_dict() for sch in self.schedulers.items]}
        return sd

    def load_state_dict(self, state_dict: dict) -> None:
        """Load a ``state_dict`` (ours, or a torch optimizer's) into the anchored state.

        Only between steps.  Commits the step counts, hyper-parameters and the schedulers'
        state so that a restart keeps them.  Ours also sets the given schedulers' state and
        ``completed_steps`` (the module's docstring); from a torch optimizer's, load the
        schedulers' state first, and ``completed_steps`` is not changed.
        Checked before anything changes: a bad entry of ours is refused by name.
        """
        if self._state.in_flight:
            raise RuntimeError("load_state_dict during an optimizer step")
        extra = state_dict.get(EXTRA) if isinstance(state_dict, dict) else None
        if extra is not None:
            self._check_extra(extra)
            state_dict = {k: v for k, v in state_dict.items() if k != EXTRA}
        self._check_shapes(state_dict)
        self.flush()     # a pending step commit must not land over what this commits
        self.optimizer.load_state_dict(state_dict)     # torch casts into fresh tensors ...
        with torch.no_grad():
            for q in self._params:
                st = self.optimizer.state.get(q.p, {})
                for k, t in q.states.items():          # ... which we copy into anchored memory
                    t.copy_(local(st[k])) if k in st else t.zero_()
                if self.kind.has_step:
                    self._counts[q.index] = int(st["step"]) if "step" in st else 0
                else:    # SGD: a loaded momentum buffer means "not the first step any more"
                    self._counts[q.index] = int(any(k in st for k in q.states))
                self.optimizer.state[q.p] = q.states
            self._wait()
        if extra is not None:
            for sch, sd in zip(self.schedulers.items, extra["schedulers"]):
                sch.load_state_dict(sd)
            self._step_offset = int(extra["completed_steps"]) - self._state.step
        self._commit_loaded()

    def _check_shapes(self, state_dict) -> None:
        """Each state tensor fits the anchored one it is copied into (torch checks the groups,
        not the state's shapes: a mismatch would fail half way through the copies)."""
        groups, state = state_dict.get("param_groups"), state_dict.get("state")
        if not isinstance(groups, list) or not isinstance(state, dict):
            return          # torch's load names what is missing
        order = {pid: j for j, pid in enumerate(pid for g in groups if isinstance(g, dict) for pid in g.get("params", ()))}
        for pid, st in state.items():
            j = order.get(pid)
            if j is None or j >= len(self._params) or not isinstance(st, dict):
                continue    # torch's load ignores or refuses it
            q = self._params[j]
            for k, t in q.states.items():
                v = st.get(k)
                if isinstance(v, torch.Tensor) and tuple(local(v).shape) != tuple(t.shape):
                    raise ValueError(f"state_dict['state'][{pid!r}][{k!r}] has shape {tuple(local(v).shape)}, and the "
                                     f"anchored {k} of {q.name!r} {tuple(t.shape)}: the checkpoint is another model's "
                                     "(or another sharding's); nothing was loaded")

    def _check_extra(self, extra) -> None:
        where = f"state_dict[{EXTRA!r}]"
        if not isinstance(extra, dict):
            raise ValueError(f"{where} is a {type(extra).__name__}, not the dict AnchoredOptimizer.state_dict() writes")
        n = extra.get("completed_steps")
        if isinstance(n, bool) or not isinstance(n, int) or n < 0:
            raise ValueError(f"{where}['completed_steps'] is {n!r}, not a step count (an int >= 0); nothing was loaded")
        scheds = extra.get("schedulers")
        if not isinstance(scheds, list) or len(scheds) != len(self.schedulers.items):
            given = len(scheds) if isinstance(scheds, list) else repr(scheds)
            raise ValueError(f"{where}['schedulers'] holds {given} scheduler state(s) and this optimizer was given "
                             f"{len(self.schedulers.items)}: the checkpoint is another job's (give the same "
                             "schedulers, in the same order); nothing was loaded")

    def _commit_loaded(self) -> None:
        """Commit what a load set between steps (step counts, hyper-parameters, the schedulers'
        state, the step offset), so that a restart keeps it; the schedulers' position becomes the
        one ``step()`` expects."""
        committed = json.dumps({"counts": self._counts, "hparams": [_hparams(g) for g in self.optimizer.param_groups],
                                **self._offset_record()}).encode()
        self._commit({key(self.prefix, "committed"): committed, key(self.prefix, "sched"): self.schedulers.state()})
        self.schedulers.mark()

    def _offset_record(self) -> dict:
        return {"step_offset": self._step_offset} if self._step_offset else {}
