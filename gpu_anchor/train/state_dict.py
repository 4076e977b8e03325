"""``state_dict`` / ``load_state_dict`` for AnchoredOptimizer (checkpoints in torch's format)."""
from __future__ import annotations

import json

import torch

from .fsdp import like, local
from .hparams import hparams as _hparams
from .protocol import key


class StateDictMixin:
    def state_dict(self) -> dict:
        """The wrapped optimizer's ``state_dict`` (anchored tensors, current step counts)."""
        for q in self._params:
            st = {k: like(q.p, t) for k, t in q.states.items()}     # DTensors for FSDP2 (DCP-ready)
            if self.kind.has_step:
                st["step"] = torch.tensor(float(self._counts[q.index]))
            self.optimizer.state[q.p] = st
        return self.optimizer.state_dict()

    def load_state_dict(self, state_dict: dict) -> None:
        """Load a torch ``state_dict`` (e.g. from a checkpoint) into the anchored state.

        Only between steps.  Commits the step counts and hyper-parameters so that a
        restart keeps them, with the schedulers' state (load theirs first); ``completed_steps``
        is not changed.
        """
        if self._state.in_flight:
            raise RuntimeError("load_state_dict during an optimizer step")
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
        self._commit_loaded()

    def _commit_loaded(self) -> None:
        """Commit what a load set between steps (step counts, hyper-parameters, the schedulers'
        state), so that a restart keeps it; the schedulers' position becomes the one ``step()`` expects."""
        committed = json.dumps({"counts": self._counts,
                                "hparams": [_hparams(g) for g in self.optimizer.param_groups]}).encode()
        self._commit({key(self.prefix, "committed"): committed, key(self.prefix, "sched"): self.schedulers.state()})
        self.schedulers.mark()
