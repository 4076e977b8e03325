"""The module calls gradient lending hears of (``grad_lending``), and what hearing them costs.

A lender needs to know where a forward of its model begins and ends (the saved-tensor hooks go
on inside it and come off when it returns) and where, inside it, the lent tail begins.

- **Learning** (the first window, and any after the forward changed): global module hooks, one
  pair in the process, routed to the lender whose window opened last.  They see every module
  call, so the lender finds the outermost module of its forwards (its *root*) and numbers each
  module call.  Global hooks put every module call in the process, of every model, on torch's
  slow path, with two Python calls each: about 3 to 6 microseconds a call on the 2-core
  development machine, 214 calls a forward of the 1B Llama.  So they are on only while the
  lender whose window is open learns (or cannot lend without them: ``GradientLender``).
- **Lending**: hooks on two modules only, the root (its calls begin and end a forward of ours)
  and the *mark*, the module whose ``n``-th call in the window is where the first chosen
  candidate came when the lender learnt (``lend_plan.ForwardPlan.target``).  Every other module call
  stays on torch's fast path.

Hooks hold the lender weakly: a model outlives its optimizer, its hooks must not keep the lender.
"""
from __future__ import annotations

import weakref

import torch

_current = None         # weakref to the lender whose window was opened last
_global: tuple = ()     # the global hooks' handles while they are on


def current():
    return _current() if _current is not None else None


def make_current(lender) -> None:
    global _current
    _current = weakref.ref(lender, _forget)


def _forget(ref) -> None:
    global _current
    if _current is ref:
        _current = None
        set_global(False)


def _enter_any(module, args) -> None:
    lender = current()
    if lender is not None and not torch.compiler.is_compiling():
        lender._enter(module)


def _leave_any(module, args, out) -> None:
    lender = current()
    if lender is not None and not torch.compiler.is_compiling():
        lender._leave()


def set_global(on: bool) -> None:
    """Global module hooks on (every module call reaches the current lender) or off."""
    global _global
    if on and not _global:
        from torch.nn.modules import module as nn_module
        _global = (nn_module.register_module_forward_pre_hook(_enter_any),
                   nn_module.register_module_forward_hook(_leave_any, always_call=True))
    elif not on and _global:
        for h in _global:
            h.remove()
        _global = ()


class ModuleHooks:
    """One lender's hooks on its root and mark modules (``place``); gone with the lender."""

    def __init__(self, lender) -> None:
        self.root = self.mark = None           # weakrefs to the modules hooked
        self._handles: list = []
        self._ref = weakref.ref(lender)
        weakref.finalize(lender, _remove, self._handles)

    def place(self, root: torch.nn.Module, mark: torch.nn.Module) -> None:
        if self.root is not None and self.root() is root and self.mark() is mark:
            return
        self.remove()
        # in this order: the root's call is known begun when a root that is its own mark is counted
        self._handles += [root.register_forward_pre_hook(_calling(self._ref, "_root_enter")),
                          mark.register_forward_pre_hook(_calling(self._ref, "_mark_enter")),
                          root.register_forward_hook(_calling(self._ref, "_root_leave"), always_call=True)]
        self.root, self.mark = weakref.ref(root), weakref.ref(mark)

    @property
    def placed(self) -> bool:
        return bool(self._handles)

    def remove(self) -> None:
        _remove(self._handles)
        self.root = self.mark = None


def _calling(ref, method: str):
    """A module hook that calls ``method`` of the lender behind ``ref``, outside tracing."""
    def hook(module, *args):
        lender = ref()
        if lender is not None and not torch.compiler.is_compiling():
            getattr(lender, method)()
    return hook


def _remove(handles: list) -> None:
    for h in handles:
        h.remove()
    handles.clear()
