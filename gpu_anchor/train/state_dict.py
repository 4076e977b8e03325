"""``state_dict`` / ``load_state_dict`` for AnchoredOptimizer (checkpoints in torch's format).

A state_dict is the wrapped optimizer's (``state``: the anchored tensors and the current step
counts; ``param_groups``) with one entry of ours in the first group,
``param_groups[0]["gpu_anchor"] = {"completed_steps": N, "schedulers": [...]}``: what a step
commits besides the tensors.  It sits in a group, not at the top, because
``torch.distributed.checkpoint``'s ``get_state_dict`` / ``set_state_dict`` keep only ``state``
and ``param_groups``; so a checkpoint written by someone else's code (``accelerator.save_state``,
Trainer's, ``torch.save(opt.state_dict())``, DCP's helpers, flattened or not) restores the job
whole.  A torch optimizer loading it keeps the entry as an unused group key.

Every way in is the same code: the wrapped optimizer's own ``state_dict()`` / ``load_state_dict()``
run ours through torch's optimizer hooks, so DCP's helpers handed either ``opt`` or
``opt.optimizer``, and code holding the wrapped optimizer, cannot bypass the anchored state
(before, a load through the wrapped optimizer put the loaded tensors beside the anchored ones,
and the next step used the old ones, silently).  The live first group holds the key with a
placeholder, because DCP's flattened load reads only the keys the live groups have.

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
import weakref
from collections.abc import Mapping

import torch

from .fsdp import like, local
from .hparams import EXTRA, hparams as _hparams
from .protocol import key

# The live first group's value for our key: the entry itself is written into each state_dict.
PLACEHOLDER = "set in state_dict(): completed_steps and the schedulers' state (gpu_anchor)"


class StateView(Mapping):
    """``opt.state``: parameter -> its state as ``state_dict`` packs it (anchored tensors, DTensors
    under FSDP2, the current ``step``), built per access; never empty, so DCP's helpers never
    run their initialising step (a real step, here) on an AnchoredOptimizer."""

    def __init__(self, opt) -> None:
        self._opt = opt
        self._index = {q.p: q for q in opt._params}

    def __getitem__(self, p) -> dict:
        return self._opt._packed(self._index[p])

    def __iter__(self):
        return iter(self._index)

    def __len__(self) -> int:
        return len(self._index)


def _hook(ref, method):
    """A hook on the wrapped optimizer that calls ``method`` of the AnchoredOptimizer while it
    lives (weakly held: the wrapped optimizer must not keep the anchored state alive)."""
    def call(*args):
        opt = ref()
        return None if opt is None else getattr(opt, method)(*args[1:])
    return call


class StateDictMixin:
    def state_dict(self) -> dict:
        """The wrapped optimizer's ``state_dict`` (anchored tensors, current step counts), with
        ``completed_steps`` and the given schedulers' states in ``param_groups[0]["gpu_anchor"]``."""
        return self.optimizer.state_dict()

    def load_state_dict(self, state_dict: dict) -> None:
        """Load a ``state_dict`` (ours, or a torch optimizer's) into the anchored state.

        Only between steps.  Commits the step counts, hyper-parameters and the schedulers'
        state so that a restart keeps them.  Ours also sets the given schedulers' state and
        ``completed_steps`` (the module's docstring); from a torch optimizer's, load the
        schedulers' state first, and ``completed_steps`` is not changed.
        Checked before anything changes: a bad entry of ours, a state tensor of another shape, a
        moment without its step count, each refused by name.
        """
        self.optimizer.load_state_dict(state_dict)

    @property
    def state(self) -> StateView:
        if self._state is None:
            raise RuntimeError("AnchoredOptimizer built inside managed_scope has its state when the scope exits")
        return StateView(self)

    def __iter__(self):
        """One optimizer: DCP's ``get_state_dict(model, optimizers)`` takes a
        ``torch.optim.Optimizer`` or an iterable of them, and this is not a torch optimizer
        (accelerate and LR schedulers must not take it for one)."""
        yield self

    # ------------------------------------------------------------------ the wrapped optimizer's hooks
    def _hook_state_dicts(self) -> None:
        inner, ref = self.optimizer, weakref.ref(self)
        inner.param_groups[0][EXTRA] = PLACEHOLDER
        inner.register_state_dict_pre_hook(_hook(ref, "_before_save"))
        inner.register_state_dict_post_hook(_hook(ref, "_after_save"))
        inner.register_load_state_dict_pre_hook(_hook(ref, "_before_load"))
        inner.register_load_state_dict_post_hook(_hook(ref, "_after_load"))

    def _packed(self, q) -> dict:
        st = {k: like(q.p, t) for k, t in q.states.items()}     # DTensors for FSDP2 (DCP-ready)
        if self.kind.has_step:
            st["step"] = torch.tensor(float(self._counts[q.index]))
        return st

    def _before_save(self) -> None:
        for q in self._params:
            self.optimizer.state[q.p] = self._packed(q)

    def _after_save(self, sd: dict) -> None:
        for q in self._params:
            self.optimizer.state[q.p] = q.states     # the live state stays the anchored tensors
        sd["param_groups"][0][EXTRA] = {"completed_steps": self.completed_steps,
                                        "schedulers": [sch.state_dict() for sch in self.schedulers.items]}

    def _before_load(self, state_dict):
        if self._state is None:
            raise RuntimeError("AnchoredOptimizer built inside managed_scope loads after the scope exits")
        if self._state.in_flight:
            raise RuntimeError("load_state_dict during an optimizer step")
        if not isinstance(state_dict, dict) or not isinstance(state_dict.get("param_groups"), list):
            return None     # torch's load names what is wrong
        groups = [dict(g) if isinstance(g, dict) else g for g in state_dict["param_groups"]]
        extras = [g.pop(EXTRA) for g in groups if isinstance(g, dict) and EXTRA in g]
        extra = next((e for e in extras if e != PLACEHOLDER), None)
        if extra is not None:
            self._check_extra(extra)
        state_dict = {**state_dict, "param_groups": groups}
        self._check_shapes(state_dict)
        self.flush()     # a pending step commit must not land over what this commits
        self._loading = extra
        return state_dict

    def _after_load(self) -> None:
        extra, self._loading = self._loading, None
        with torch.no_grad():
            for q in self._params:
                st = self.optimizer.state.get(q.p, {})      # torch cast into fresh tensors ...
                for k, t in q.states.items():               # ... which we copy into anchored memory
                    t.copy_(local(st[k])) if k in st else t.zero_()
                if self.kind.has_step:
                    self._counts[q.index] = int(st["step"]) if "step" in st else 0
                else:    # SGD: a loaded momentum buffer means "not the first step any more"
                    self._counts[q.index] = int(any(k in st for k in q.states))
                self.optimizer.state[q.p] = q.states
            self._wait()
        self.optimizer.param_groups[0][EXTRA] = PLACEHOLDER    # torch's load replaced the groups
        if extra is not None:
            for sch, sd in zip(self.schedulers.items, extra["schedulers"]):
                sch.load_state_dict(sd)
            self._step_offset = int(extra["completed_steps"]) - self._state.step
        self._commit_loaded()

    # ------------------------------------------------------------------ checks (before anything changes)
    def _check_shapes(self, state_dict) -> None:
        """Each state tensor fits the anchored one it is copied into (torch checks the groups,
        not the state's shapes: a mismatch would fail half way through the copies), and a
        moment comes with its step count (DCP's flattened load reads the names the live state
        has: handed the wrapped optimizer, whose live state has no ``step``, it drops them)."""
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
            if self.kind.has_step and "step" not in st and any(k in st for k in q.states):
                raise ValueError(f"state_dict['state'][{pid!r}] has {sorted(k for k in st if k in q.states)} but no "
                                 f"'step': the moments of {q.name!r} without their step count would restart Adam's "
                                 "bias correction (DCP's flattened set_state_dict handed opt.optimizer loads no step: "
                                 "hand it the AnchoredOptimizer); nothing was loaded")

    def _check_extra(self, extra) -> None:
        where = f"state_dict['param_groups'][0][{EXTRA!r}]"
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
