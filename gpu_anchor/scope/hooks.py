"""What the dispatch mode cannot see: a light torch-function mode for the block's thread,
and process-wide hooks in place while any scope is open (reference-counted).

:class:`FunctionMode` (thread-local, entered with the scope's dispatch mode):

- ``native.data = placeholder`` (``Model(cfg).cuda()`` / ``.to(device)`` with native CPU
  parameters and anchored CUDA: ``nn.Module._apply`` sets ``param.data``): the C++ setter
  would copy a storage-less wrapper into a native tensor (CUDA: an illegal memory access at
  the first read).  The native tensor object becomes that placeholder instead, keeping its
  identity (an optimizer built before ``.cuda()`` still holds it).
- ``torch.asarray`` over a storage (how safetensors makes every tensor): under any dispatch
  mode torch reads the storage as a nested sequence and fails; it runs with the modes off,
  giving a native tensor over the file mapping (read only if something uses it).

Process-wide, changing behaviour only where a placeholder is involved:

- ``torch.utils.swap_tensors`` (``nn.Module._apply`` under
  ``torch.__future__.set_swap_module_params_on_conversion(True)``, ``load_state_dict``):
  keeps the scope's bookkeeping of which Python objects are placeholders.
- ``nn.RNNBase.flatten_parameters``: cuDNN's flattening needs data pointers; with
  placeholder weights it is skipped (after binding, the weights are separate anchored
  objects and cuDNN compacts them per call, as torch warns).
- ``transformers.PreTrainedModel.from_pretrained`` (only if transformers is imported):
  see :mod:`gpu_anchor.scope.pretrained`.
"""
from __future__ import annotations

import sys
import threading

import torch
from torch.overrides import TorchFunctionMode

from .placeholders import Placeholder

_lock = threading.Lock()
_depth = 0
_saved: list[tuple[object, str, object]] = []


_DATA = torch._C.TensorBase.data          # its ``__set__`` arrives as a new method-wrapper each time
_STORAGES = (torch.UntypedStorage, torch.TypedStorage)


class FunctionMode(TorchFunctionMode):
    """See the module docstring; every other call passes straight through."""

    def __init__(self, dispatch_mode) -> None:
        super().__init__()
        self.dispatch_mode = dispatch_mode

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if (getattr(func, "__self__", None) is _DATA and func.__name__ == "__set__"
                and isinstance(args[1], Placeholder) and not isinstance(args[0], Placeholder)):
            from .binding import become_placeholder
            t = args[0]
            holders = [h for h in self.dispatch_mode.holders_of(t) if h.t is t]
            old = become_placeholder(t, args[1])
            for h in holders:          # a recipe read t's data (``t.to(...)``): it now lives in ``old``
                h.t = old
            return None
        if func is torch.asarray and args and isinstance(args[0], _STORAGES):
            with torch.utils._python_dispatch._disable_current_modes():
                return func(*args, **(kwargs or {}))
        return func(*args, **(kwargs or {}))


def _swap_tensors(orig):
    def swap_tensors(t1, t2):
        if isinstance(t1, Placeholder) or isinstance(t2, Placeholder):
            from .binding import swap_placeholder_objects
            return swap_placeholder_objects(t1, t2)
        return orig(t1, t2)
    return swap_tensors


def _flatten(orig):
    def flatten_parameters(self):
        if any(isinstance(w, Placeholder) for w in getattr(self, "_flat_weights", ())):
            return None
        return orig(self)
    return flatten_parameters


def _targets():
    out = [(torch.utils, "swap_tensors", _swap_tensors),
           (torch.nn.modules.rnn.RNNBase, "flatten_parameters", _flatten)]
    if "transformers" in sys.modules:
        from . import pretrained
        out.extend(pretrained.hook_targets())
    return out


def install() -> None:
    global _depth
    with _lock:
        _depth += 1
        if _depth > 1:
            return
        for owner, name, make in _targets():
            orig = owner.__dict__[name] if isinstance(owner, type) else getattr(owner, name)
            _saved.append((owner, name, orig))
            setattr(owner, name, make(orig))


def uninstall() -> None:
    global _depth
    with _lock:
        _depth -= 1
        if _depth > 0:
            return
        while _saved:
            owner, name, orig = _saved.pop()
            setattr(owner, name, orig)
