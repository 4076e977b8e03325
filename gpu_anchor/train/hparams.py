"""Hyper-parameters of a param group as JSON (journaled with each step, restored at resume)."""
from __future__ import annotations

import torch

EXTRA = "gpu_anchor"      # our key in the first param group (``state_dict``): not a hyper-parameter
_HP_SKIP = ("params", EXTRA)


def hparams(group: dict) -> dict:
    out = {}
    for k, v in group.items():
        if k in _HP_SKIP:
            continue
        if isinstance(v, torch.Tensor):
            raise TypeError(f"tensor hyper-parameter {k!r} is not supported by AnchoredOptimizer; use a float")
        out[k] = list(v) if isinstance(v, tuple) else v
    return out


def set_hparams(group: dict, hp: dict) -> None:
    for k, v in hp.items():
        group[k] = tuple(v) if isinstance(group.get(k), tuple) else v
