"""Anchoring optimizer state: torch optimizers create it lazily at the first ``step()``,
after any scope has closed.  :func:`init_optimizer_state` creates it *inside* the scope,
exactly as the first step would (same keys, dtypes, devices, zero values), so that the
state is named ``optimizer.state[model.fc.weight]['exp_avg']`` and anchored too.

    with gpu_anchor.managed_scope():
        model = build_model()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        gpu_anchor.scope.init_optimizer_state(opt)

Supported: optimizers with an ``_init_group(group, params, grads, ...)`` method that
creates state for params with a gradient (Adam, AdamW, Adamax, NAdam, RAdam, RMSprop,
Adadelta, ...).  SGD creates its momentum buffer from the first gradient, so it has
nothing to pre-create (its state after step 1 is not anchored).  Adam's ``step`` is a CPU
tensor unless ``capturable=True`` (or ``fused=True``): it is anchored only when the host
has a daemon too.
"""
from __future__ import annotations

import inspect

import torch


def init_optimizer_state(optimizer: torch.optim.Optimizer) -> int:
    """Create ``optimizer``'s per-parameter state now; returns how many params got state.

    Call inside ``managed_scope``, after constructing the optimizer and before any step.
    Params that already have state are left alone (a second call does nothing).
    """
    init_group = getattr(optimizer, "_init_group", None)
    if init_group is None:
        raise TypeError(f"{type(optimizer).__name__} has no _init_group; create its state explicitly inside the scope")
    n_lists = len(inspect.signature(init_group).parameters) - 1  # after ``group``
    count = 0
    for group in optimizer.param_groups:
        todo = [p for p in group["params"] if len(optimizer.state.get(p, {})) == 0]
        saved = [p.grad for p in todo]
        try:
            for p in todo:
                p.grad = torch.zeros_like(p)
            init_group(group, *[[] for _ in range(n_lists)])
        finally:
            for p, g in zip(todo, saved):
                p.grad = g
        count += sum(1 for p in todo if len(optimizer.state.get(p, {})) > 0)
    return count
