"""Training under gpu-anchor: an optimizer step that survives SIGKILL at any instant.

``AnchoredOptimizer`` (the protocol), ``AnchoredTrainer`` (Hugging Face's ``Trainer`` on it;
needs transformers), ``anchor_module`` (anchor a model's parameters
until managed_scope does it), ``LoopState`` / ``position`` (loop position from the
committed step), ``training_state`` (torch-free fallback hook for the supervisor), ``StepProtocolConfig``
(the protocol's settings as one record).
Torch is imported only when a torch-using name is first used.
"""
from __future__ import annotations

_LAZY = {"AnchoredOptimizer": ".optimizer", "AnchoredTrainer": ".hf", "anchor_module": ".anchor", "LoopState": ".loop_state",
         "position": ".loop_state", "training_state": ".status", "StepProtocolConfig": ".config"}


def __getattr__(name):
    if name in _LAZY:
        import importlib
        return getattr(importlib.import_module(_LAZY[name], __name__), name)
    raise AttributeError(name)


__all__ = list(_LAZY)
