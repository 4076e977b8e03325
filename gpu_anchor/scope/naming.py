"""Naming (the Rebinder): an object's name is the first access path that reaches it.

One deterministic BFS from a set of named roots (the scope's caller frame locals):

- children of an ``nn.Module``: every parameter, buffer and submodule under it,
  by its dotted path (``layers[3].mlp.up.weight``; numeric parts become ``[i]``),
  then the module's other attributes; all one level below the module, so weights
  are named by the module tree, not by whatever else happens to hold them;
- children of a ``dict``: its values, accessor ``['key']`` (``repr`` of the key);
  a tensor key is written as its own path (``optimizer.state[model.fc.weight]``),
  so such an entry is expanded once its key has a name;
- children of a ``list``/``tuple``: ``[i]``; of other objects: ``.attr`` from
  ``__dict__`` and ``__slots__``;
- at each node children are visited in lexicographic order of their accessor
  (sequence indices in numeric order); a visited set breaks cycles;
- *wrapper modules are transparent*: the attribute through which a known wrapper
  holds the module it wraps is left out of paths (peft's ``base_model`` / ``.model`` /
  ``base_layer``, torch.compile's ``_orig_mod``, DDP's ``module``, FSDP1's and
  activation checkpointing's wrapped module; :func:`register_wrapper` adds more), so
  ``model = get_peft_model(model, cfg)`` keeps the base weights' names; roots that are
  not wrappers are walked before roots that are, so a base model kept in its own
  variable is named from that variable;
- never entered: modules, classes, functions, methods, code, frames, generators,
  atomic values, tensors (a tensor is a leaf), sets (no stable order), and objects
  whose ``repr`` key would carry an address.

The walk stops early once every wanted object has a name.
"""
from __future__ import annotations

import enum
import re
import types
from collections import deque
from typing import Callable, Iterable

import torch

_SKIP_TYPES = (types.ModuleType, type, types.FunctionType, types.BuiltinFunctionType, types.MethodType,
               types.BuiltinMethodType, types.CodeType, types.FrameType, types.GeneratorType,
               types.CoroutineType, types.AsyncGeneratorType, types.TracebackType, property,
               classmethod, staticmethod, types.MethodWrapperType, types.WrapperDescriptorType,
               types.GetSetDescriptorType, types.MemberDescriptorType, types.MappingProxyType,
               types.SimpleNamespace.__class__)
_ATOMIC = (str, bytes, bytearray, int, float, complex, bool, type(None), torch.dtype, torch.device,
           torch.Size, range, slice, enum.Enum, torch.Generator, memoryview, type(Ellipsis))
_MODULE_INTERNALS = frozenset(vars(torch.nn.Module()).keys())
_ADDRESS = re.compile(r" at 0x[0-9a-fA-F]+")
_DIGITS = re.compile(r"\.(\d+)(?=\.|$)")

# (top-level package, class name in the MRO) -> the attribute holding the wrapped module
_WRAPPERS: dict[tuple[str, str], str] = {
    ("peft", "PeftModel"): "base_model",
    ("peft", "BaseTuner"): "model",
    ("peft", "BaseTunerLayer"): "base_layer",
    ("torch", "OptimizedModule"): "_orig_mod",
    ("torch", "DistributedDataParallel"): "module",
    ("torch", "DataParallel"): "module",
    ("torch", "FullyShardedDataParallel"): "_fsdp_wrapped_module",
    ("torch", "CheckpointWrapper"): "_checkpoint_wrapped_module",
}
_edge_cache: dict[type, str | None] = {}


def register_wrapper(cls: type, attribute: str) -> None:
    """Make wrapper modules of type ``cls`` (and subclasses) transparent in access paths:
    ``wrapper.<attribute>.x`` is named as ``wrapper.x``."""
    _WRAPPERS[(cls.__module__.split(".")[0], cls.__name__)] = attribute
    _edge_cache.clear()


def wrapper_attribute(obj) -> str | None:
    """The attribute through which ``obj`` (a wrapper module) holds the module it wraps."""
    t = type(obj)
    if t not in _edge_cache:
        _edge_cache[t] = next((_WRAPPERS[k] for c in t.__mro__
                               if (k := ((c.__module__ or "").split(".")[0], c.__name__)) in _WRAPPERS), None)
    attr = _edge_cache[t]
    return attr if attr is not None and isinstance(getattr(obj, "_modules", {}).get(attr), torch.nn.Module) else None


def canonical_module_path(module: torch.nn.Module, dotted: str) -> str:
    """``dotted`` (a path from ``module``, as in ``named_parameters``) without wrapper segments."""
    parts = dotted.split(".")
    out, cur = [], module
    for seg in parts[:-1]:
        if wrapper_attribute(cur) != seg:
            out.append(seg)
        cur = cur._modules.get(seg) if isinstance(cur, torch.nn.Module) else None
        if cur is None:
            return dotted
    out.append(parts[-1])
    return ".".join(out)


def _module_path(dotted: str) -> str:
    return _DIGITS.sub(r"[\1]", "." + dotted)


def _skip(obj) -> bool:
    if isinstance(obj, _ATOMIC) or isinstance(obj, _SKIP_TYPES) or isinstance(obj, (set, frozenset)):
        return True
    mod = type(obj).__module__ or ""
    return mod.startswith(("gpu_anchor.client", "gpu_anchor.scope", "threading", "logging", "socket", "_io", "io"))


def _sort_key(acc):
    return (0, acc, "") if isinstance(acc, int) else (1, 0, acc)


class _Walk:
    def __init__(self, want: Callable[[object], bool], remaining: int | None, found=None) -> None:
        self.want = want
        self.remaining = remaining
        self.found = found                         # callback(path, tensor) -> True when done
        self.names: dict[int, str] = {}           # id(tensor) -> first path, for wanted tensors
        self.objects: dict[int, object] = {}       # keeps named objects alive for the caller
        self.visited: set[int] = set()
        self.queue: deque = deque()
        self.deferred: dict[int, list] = {}        # id(key tensor) -> [(path of dict, key, value, state)]
        self.tensor_paths: dict[int, str] = {}     # any tensor's first path (for tensor dict keys)
        self.tensors: list[tuple[str, torch.Tensor, bool]] = []  # every tensor: (first path, tensor, is state)
        self.modules: list[tuple[str, torch.nn.Module]] = []     # every module reached, with its path

    def push(self, path: str, obj, state: bool = False) -> None:
        if id(obj) in self.visited or (not isinstance(obj, torch.Tensor) and _skip(obj)):
            return
        self.visited.add(id(obj))
        if isinstance(obj, torch.Tensor):
            self.tensor_paths[id(obj)] = path
            self.tensors.append((path, obj, state))
            if self.want(obj):
                self.names[id(obj)] = path
                self.objects[id(obj)] = obj
                if self.remaining is not None:
                    self.remaining -= 1
                if self.found is not None and self.found(path, obj):
                    self.remaining = 0
            for parent, key, value, st in self.deferred.pop(id(obj), ()):
                self.push(f"{parent}[{path}]", value, st)
            return
        if isinstance(obj, torch.nn.Module):
            self.modules.append((path, obj))
        self.queue.append((path, obj, state or isinstance(obj, torch.optim.Optimizer)))

    def run(self) -> None:
        while self.queue and (self.remaining is None or self.remaining > 0):
            path, obj, state = self.queue.popleft()
            for acc, child, st in self.children(path, obj, state):
                self.push(acc, child, st)

    def children(self, path: str, obj, state: bool) -> Iterable[tuple[str, object, bool]]:
        if isinstance(obj, torch.nn.Module):
            yield from self._module_children(path, obj)
            return
        if isinstance(obj, dict):
            plain = []
            for k, v in list(obj.items()):
                if isinstance(k, torch.Tensor):
                    kp = self.tensor_paths.get(id(k))
                    if kp is None:
                        self.deferred.setdefault(id(k), []).append((path, k, v, state))
                    else:
                        plain.append((kp, f"{path}[{kp}]", v))
                    continue
                r = repr(k)
                if _ADDRESS.search(r):
                    continue
                plain.append((r, f"{path}[{r}]", v))
            for _, p, v in sorted(plain, key=lambda x: x[0]):
                yield p, v, state
            return
        if isinstance(obj, (list, tuple)):
            for i, v in enumerate(obj):
                yield f"{path}[{i}]", v, state
            return
        attrs = {}
        d = getattr(obj, "__dict__", None)
        if isinstance(d, dict):
            attrs.update(d)
        for cls in type(obj).__mro__:
            for slot in getattr(cls, "__slots__", ()) if isinstance(getattr(cls, "__slots__", ()), (tuple, list)) else ():
                if slot not in ("__dict__", "__weakref__") and hasattr(obj, slot):
                    attrs.setdefault(slot, getattr(obj, slot))
        for k in sorted(attrs):
            if isinstance(k, str):
                yield f"{path}.{k}", attrs[k], state

    def _module_children(self, path: str, mod: torch.nn.Module):
        covered = getattr(self, "_covered", None)
        if covered is None:
            covered = self._covered = set()
        items = []
        if id(mod) not in covered:
            raw = [(n, p, True) for n, p in mod.named_parameters(remove_duplicate=False)]
            raw += [(n, b, True) for n, b in mod.named_buffers(remove_duplicate=False)]
            for n, m in mod.named_modules(remove_duplicate=False):
                if n:
                    covered.add(id(m))
                    raw.append((n, m, False))
            owner: dict[str, int] = {}
            for n, v, st in raw:
                c = canonical_module_path(mod, n + ".x")[:-2] if not st else canonical_module_path(mod, n)
                if owner.setdefault(c, id(v)) != id(v):
                    c = n                     # two objects, one wrapper-free path: keep the full one
                items.append((c, v, st))
        for n, v, st in sorted(items, key=lambda x: x[0]):
            yield (path + _module_path(n) if n else path), v, st
        for k in sorted(vars(mod)):
            if k in _MODULE_INTERNALS:
                continue
            yield f"{path}.{k}", vars(mod)[k], False


def _root_order(roots: dict) -> list[str]:
    """Roots in lexicographic order, wrapper modules after everything else."""
    return sorted((n for n in roots if not n.startswith("__")),
                  key=lambda n: (isinstance(roots[n], torch.nn.Module) and wrapper_attribute(roots[n]) is not None, n))


def walk(roots: dict, want: Callable[[object], bool] = lambda t: False, found=None) -> _Walk:
    """The whole BFS from ``roots``; ``.tensors`` lists every tensor reached, in order."""
    w = _Walk(want, None, found)
    for name in _root_order(roots):
        w.push(name, roots[name])
    w.run()
    return w


def access_paths(roots: dict, want: Callable[[object], bool] = lambda t: True,
                 expected: int | None = None, found=None) -> dict[str, torch.Tensor]:
    """``{path: tensor}`` for every wanted tensor reachable from ``roots`` (name → object).

    Roots are taken in lexicographic order of their names (wrapper modules last); names
    starting with ``__`` and roots that are modules, classes or functions are skipped.
    ``expected``: stop as soon as that many wanted tensors have names; ``found(path,
    tensor)`` is called for each wanted tensor in BFS order and may return True to stop.
    """
    w = _Walk(want, expected, found)
    for name in _root_order(roots):
        w.push(name, roots[name])
    w.run()
    return {w.names[i]: w.objects[i] for i in w.names}
