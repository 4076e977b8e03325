"""Placeholders: tensors with the right metadata and no memory, handed out inside a scope.

A :class:`Store` is one logical allocation made inside a ``managed_scope`` (an
anchored object-to-be).  A :class:`Placeholder` is a tensor over a store: a
``torch.Tensor`` wrapper subclass that reports the store's device, dtype, shape,
strides and storage offset, but owns no storage.  Its geometry lives in a
*meta mirror*: a tensor on the ``meta`` device that is a view of the store's meta
base, so any view op run on mirrors yields the right size, stride and offset.

Contract:
- Metadata queries (``shape``, ``stride()``, ``dtype``, ``device``, ``numel()``,
  ``is_contiguous()``, ``requires_grad``) answer without any dispatch.
- Ops on placeholders are only legal while their scope's interception mode is
  active; used anywhere else a placeholder raises a clear error.
- At bind, every live placeholder is swapped (``torch.utils.swap_tensors``) with a
  real tensor over the bound memory, so every Python reference to it — module
  attributes, optimizer param groups, dict keys, closures — sees real memory.
"""
from __future__ import annotations

import torch

from gpu_anchor.paths import normalize_device

# Attributes this module sets on placeholder objects; never copied onto real tensors.
OWN_ATTRS = ("_ga_store", "_ga_meta", "_is_param")


class Store:
    """One allocation made inside a scope; ``index`` is its creation order."""

    __slots__ = ("index", "device", "meta", "tensors", "init", "name", "status", "real", "__weakref__")

    # Placeholders report addresses in a range no user-space pointer can have (the kernel's half),
    # one 4 GiB window per store, so that code which finds shared or tied tensors by their
    # storage (safetensors' load_model, transformers) sees a store as one storage.
    FAKE_BASE = 0xFFFF_8000_0000_0000

    def __init__(self, index: int, device: str, meta: torch.Tensor) -> None:
        self.index = index
        self.device = device            # 'cpu' or 'cuda:N'
        self.meta = meta                # meta-device base: shape, stride, dtype of the allocation
        self.tensors: list[Placeholder] = []   # placeholders made over it (each listed once, here only);
        # a placeholder may later move to another store (``.data =``, swap_tensors): group by ``_ga_store``
        self.init = None                # the Event that creates it, or None (empty)
        self.name: str | None = None
        self.status: str | None = None  # matched / created / native after binding
        self.real: torch.Tensor | None = None

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.meta.shape)

    @property
    def fake_address(self) -> int:
        return self.FAKE_BASE + (self.index << 32)

    @property
    def nbytes(self) -> int:
        m = self.meta
        return (1 + sum((s - 1) * st for s, st in zip(m.shape, m.stride()) if s > 0)) * m.element_size() \
            if m.numel() else 0

    @property
    def dtype(self) -> torch.dtype:
        return self.meta.dtype

    def alloc_spec(self) -> tuple[tuple[int, ...], bool]:
        """Shape to allocate, and whether the placeholder strides are the contiguous ones for it."""
        m = self.meta
        if m.is_contiguous():
            return tuple(m.shape), True
        extent = 1 + sum((s - 1) * st for s, st in zip(m.shape, m.stride()) if s > 0) if m.numel() else 0
        return (extent,), False

    def __repr__(self) -> str:
        return f"Store(#{self.index} {self.name or '?'} {list(self.shape)} {self.dtype} {self.device})"


class Placeholder(torch.Tensor):
    """A tensor over a :class:`Store`; see the module docstring."""

    _ga_store: Store
    _ga_meta: torch.Tensor

    @staticmethod
    def __new__(cls, store, meta=None, requires_grad: bool = False, **attrs):
        if not isinstance(store, Store):
            # ``type(param)(tensor, **param.__dict__)`` (accelerate re-creating a parameter):
            # act as ``nn.Parameter`` would, keeping the attributes
            p = torch.nn.Parameter(store, requires_grad=attrs.pop("requires_grad", requires_grad) if meta is None
                                   else bool(meta))
            for k, v in attrs.items():
                if k not in OWN_ATTRS:
                    setattr(p, k, v)
            return p
        t = torch.Tensor._make_wrapper_subclass(
            cls, meta.size(), strides=meta.stride(), storage_offset=meta.storage_offset(),
            dtype=meta.dtype, device=torch.device(store.device), requires_grad=requires_grad)
        t._ga_store = store
        t._ga_meta = meta
        store.tensors.append(t)
        return t

    def __init__(self, *args, **kwargs) -> None:
        pass

    __torch_function__ = torch._C._disabled_torch_function_impl

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        # Only reached when no scope mode is active (modes are consulted before subclasses).
        dead = [x._ga_store for x in _flat((args, kwargs)) if isinstance(x, Placeholder)
                and x._ga_store.status == "dead"]
        if dead:
            raise RuntimeError(
                f"{func} used {dead[0]!r}, a tensor made inside a managed_scope that no variable of the block "
                "reached when it closed, so it got no memory.  Keep it reachable from the block's frame (a "
                "variable, a module attribute or buffer, a container), or create it after the block.")
        raise RuntimeError(
            f"gpu-anchor placeholder used by {func} outside its managed_scope (or inside "
            "gpu_anchor.scope.suspended()): it has no memory until the scope exits and binds it. "
            "Keep a reference to it from the scope's frame so that it gets a name and memory.")

    # Storage identity without memory: see Store.FAKE_BASE.
    def data_ptr(self) -> int:
        m = self._ga_meta
        return self._ga_store.fake_address + m.storage_offset() * m.element_size()

    def untyped_storage(self) -> "FakeStorage":
        return FakeStorage(self._ga_store)

    def __repr__(self, *, tensor_contents=None) -> str:
        s = self._ga_store
        return (f"Placeholder(shape={list(self.shape)}, dtype={self.dtype}, device={self.device}, "
                f"object=#{s.index}{' ' + s.name if s.name else ''})")

    # ``param.data = other`` (what ``module.to(dtype)``/``.half()`` do) is not an aten op: the
    # C++ setter copies ``other``'s metadata into this tensor, and this tensor must follow
    # ``other`` to its store too.
    def _get_data(self):
        return torch._C.TensorBase.data.__get__(self)

    def _set_data(self, new):
        if not isinstance(new, Placeholder):
            raise TypeError("inside managed_scope, a placeholder's .data can only be set to another placeholder "
                            f"(got {type(new).__name__}); build the tensor inside the scope instead")
        torch._C.TensorBase.data.__set__(self, new)
        self._ga_store, self._ga_meta = new._ga_store, new._ga_meta

    data = property(_get_data, _set_data)

    def __reduce_ex__(self, protocol):
        raise TypeError("a gpu-anchor placeholder cannot be pickled or deep-copied before its scope binds it")


class FakeStorage:
    """What ``placeholder.untyped_storage()`` returns: identity and size of its store, no bytes."""

    __slots__ = ("_store",)

    def __init__(self, store: Store) -> None:
        self._store = store

    def data_ptr(self) -> int:
        return self._store.fake_address

    def nbytes(self) -> int:
        return self._store.nbytes

    def size(self) -> int:
        return self._store.nbytes

    @property
    def device(self) -> torch.device:
        return torch.device(self._store.device)

    def __eq__(self, other) -> bool:
        return isinstance(other, FakeStorage) and other._store is self._store

    def __hash__(self) -> int:
        return hash(id(self._store))

    def __getattr__(self, name):
        raise RuntimeError(f"placeholder storage has no '{name}' before its managed_scope binds it")


def _flat(x) -> list:
    if isinstance(x, (tuple, list)):
        return [z for y in x for z in _flat(y)]
    if isinstance(x, dict):
        return [z for y in x.values() for z in _flat(y)]
    return [x]


def new_store(index: int, device, meta: torch.Tensor) -> Store:
    """A store whose geometry is ``meta``'s (a meta tensor with storage offset 0)."""
    base = torch.empty_strided(meta.shape, meta.stride(), dtype=meta.dtype, device="meta")
    return Store(index, normalize_device(device), base)


def mirror_of(store: Store, meta: torch.Tensor) -> torch.Tensor:
    """A meta view of ``store.meta`` with ``meta``'s geometry (so later view ops compose)."""
    if meta.dtype != store.meta.dtype:
        return meta  # dtype-reinterpreting views keep their own meta; see real_view
    return store.meta.as_strided(meta.size(), meta.stride(), meta.storage_offset())


def real_view(base: torch.Tensor, meta: torch.Tensor) -> torch.Tensor:
    """The view of the real allocation ``base`` (of the store's alloc shape) that ``meta`` describes."""
    flat = base.reshape(-1) if base.is_contiguous() else base
    if meta.dtype != base.dtype:
        flat = flat.view(meta.dtype)
    return flat.as_strided(meta.size(), meta.stride(), flat.storage_offset() + meta.storage_offset())


def is_placeholder(x) -> bool:
    return isinstance(x, Placeholder)
