"""Interception: the TorchDispatchMode that hands out placeholders inside a scope.

Every aten op issued while a scope is open passes through :class:`ScopeMode`:

- *factory* ops (no tensor input, or only a ``*_like``/``new_*`` template) whose
  output lands on an anchored device get a placeholder; ``zeros/ones/full/rand/
  randn/randint`` are recorded as an empty allocation plus the in-place op the
  eager kernel itself runs (``zero_``, ``fill_``, ``uniform_``, ``normal_``,
  ``random_``), which is bit-identical and lets replay write straight into the
  anchored memory;
- *view* ops on placeholders give placeholders over the same store (geometry from
  the meta mirror);
- *in-place* ops whose written arguments are placeholders are recorded, not run
  (``uniform_``, ``normal_``, ``copy_``, ``fill_``, ``zero_``, ``mul_``, …);
- other ops producing tensors on an anchored device (``clone``, ``.to()``,
  arithmetic, ``torch.tensor(...)`` via ``lift_fresh``) are recorded lazily:
  placeholder outputs, inputs kept as references or buffered copies;
- anything that needs a placeholder's *data* now (``.item()``, ``.tolist()``,
  writes into a real tensor, an op without a meta kernel) evaluates the recipe
  eagerly — correct, but work that a fully-matching restart also pays;
- everything else (ops on real tensors, outputs on non-anchored devices) runs
  natively; a native random op first flushes pending random ops of its generator.

Outside a scope nothing is intercepted: no cost on the hot path.
"""
from __future__ import annotations

import contextlib
import sys
import threading

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from gpu_anchor.paths import normalize_device

from .placeholders import Placeholder, new_store
from .recipes import Held, Recorder, Ref, default_generator, leaves, outputs_of, rebuild, tmap

aten = torch.ops.aten
_state = threading.local()


@contextlib.contextmanager
def suspended():
    """Run a block with interception off: tensors made in it are ordinary (or, from a
    ``Client``, already anchored) and pass through the scope untouched.

    Use it around ``client.bind``/``client.tensor`` calls made while a scope is open
    (e.g. an optimizer wrapper that anchors its own buffers).  Placeholders must not be
    *computed with* inside the block — they have no memory until the scope exits.
    """
    _state.depth = getattr(_state, "depth", 0) + 1
    try:
        yield
    finally:
        _state.depth -= 1


def is_suspended() -> bool:
    return getattr(_state, "depth", 0) > 0


_EMPTY = {"empty", "empty_strided", "new_empty", "new_empty_strided", "empty_like"}
_ZERO = {"zeros", "new_zeros", "zeros_like"}
_ONE = {"ones", "new_ones", "ones_like"}
_FULL = {"full", "new_full", "full_like"}
_RAND = {"rand", "rand_like"}
_RANDN = {"randn", "randn_like"}
_RANDINT = {"randint", "randint_like"}
_FACTORIES = _EMPTY | _ZERO | _ONE | _FULL | _RAND | _RANDN | _RANDINT


def _named(func, args, kwargs) -> dict:
    out = dict(kwargs)
    for a, v in zip(func._schema.arguments, args):
        out[a.name] = v
    return out


def _written(func, args, kwargs) -> list:
    """Tensors this op mutates, from its schema (``alias_info.is_write``)."""
    out = []
    named = None
    for i, a in enumerate(func._schema.arguments):
        if a.alias_info is not None and a.alias_info.is_write:
            if named is None:
                named = _named(func, args, kwargs)
            v = named.get(a.name)
            out.extend(x for x in leaves(v) if isinstance(x, torch.Tensor))
    return out


def _aliased_return(func, args, kwargs):
    """What an in-place/out= op returns: the arguments its returns alias."""
    named = _named(func, args, kwargs)
    by_set = {}
    for a in func._schema.arguments:
        if a.alias_info is not None and a.alias_info.is_write:
            by_set[frozenset(a.alias_info.before_set)] = named.get(a.name)
    rets = [by_set.get(frozenset(r.alias_info.before_set)) if r.alias_info else None for r in func._schema.returns]
    if not rets:
        return None
    return rets[0] if len(rets) == 1 else tuple(rets)


def _to_meta(x):
    if isinstance(x, Placeholder):
        return x._ga_meta
    if isinstance(x, torch.Tensor):
        return torch.empty_strided(x.size(), x.stride(), dtype=x.dtype, device="meta")
    if isinstance(x, torch.device):
        return torch.device("meta")
    return x


class ScopeMode(TorchDispatchMode):
    """The interception mode of one scope; ``anchored(device)`` says which devices have a daemon."""

    def __init__(self, anchored) -> None:
        super().__init__()
        self.anchored = anchored
        self.recorder = Recorder()
        self.stores = []
        self.eager_evaluations = 0
        self._memo: dict = {}
        self._held: dict[tuple, list[Held]] = {}   # storage of a real tensor an op read -> its holders
        self.stop_frame = None                    # the frame running the ``with``: see _importing

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        # torch wraps a mode's __torch_dispatch__ in a dynamo-disable whose first call imports
        # torch._dynamo (seconds).  Nothing is compiled inside a scope: keep the import off the
        # restart path.
        return False

    # ------------------------------------------------------------------ dispatch
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if is_suspended():
            self._flush_for(func, args, kwargs)  # a native random op still needs the true generator position
            if self._held:
                self._copy_before_write(_written(func, args, kwargs))
            return func(*args, **kwargs)
        has_ph = any(isinstance(x, Placeholder) for x in leaves((args, kwargs)))
        if has_ph:
            if func.is_view:
                return self._view(func, args, kwargs)
            if func in _SET_STORAGE and isinstance(args[0], Placeholder) and not isinstance(args[1], Placeholder):
                return self._become_native(func, args, kwargs)
            written = _written(func, args, kwargs)
            if torch.Tag.inplace_view in func.tags and isinstance(args[0], Placeholder):
                return self._inplace_view(func, args, kwargs)
            if written:
                if all(isinstance(w, Placeholder) for w in written):
                    return self._inplace(func, args, kwargs, written)
                if all(isinstance(w, Placeholder) or w.device.type == "meta" for w in written):
                    return self._on_meta(func, args, kwargs)  # writes only meta tensors: needs no data
                return self._eager(func, args, kwargs)
            return self._compute(func, args, kwargs)
        if func is aten.lift_fresh.default:  # torch.tensor(data, device=...): only this op is visible
            dev = _norm(args[0].device)
            if self.anchored(dev) and not self._importing():
                return self._record_create(func, args, kwargs, [args[0]], dev, snapshot=False)
            return func(*args, **kwargs)
        written = _written(func, args, kwargs)
        if func.is_view or written:
            self._flush_for(func, args, kwargs)
            if self._held and written:
                self._copy_before_write(written)
            return func(*args, **kwargs)
        dev = self._out_device(func, args, kwargs)
        if dev is not None and self.anchored(dev) and self._returns_tensors(func) and not self._importing():
            return self._compute(func, args, kwargs)
        self._flush_for(func, args, kwargs)
        return func(*args, **kwargs)

    def _importing(self) -> bool:
        """Is a module being imported between the block's frame and this op?  A module's
        constants (``def f(x, scale=torch.tensor(1))`` in a library imported lazily inside the
        block) belong to the module, not to the block's state: they are made natively."""
        f, stop = sys._getframe(2), self.stop_frame
        while f is not None and f is not stop:
            if f.f_code.co_filename.startswith("<frozen importlib"):
                return True
            f = f.f_back
        return False

    # ------------------------------------------------------------------ helpers
    @staticmethod
    def _returns_tensors(func) -> bool:
        rets = func._schema.returns
        return bool(rets) and all(str(r.type) in ("Tensor", "List[Tensor]", "Tensor[]") for r in rets)

    @staticmethod
    def _out_device(func, args, kwargs) -> str | None:
        named = _named(func, args, kwargs)
        dev = named.get("device")
        if dev is not None:
            if torch.device(dev).type == "meta":
                return "meta"
            try:
                return normalize_device(dev)
            except ValueError:
                return None
        tensors = [x for x in leaves((args, kwargs)) if isinstance(x, torch.Tensor)]
        for t in tensors:
            if isinstance(t, Placeholder):
                return t._ga_store.device
        for t in tensors:
            if t.dim() > 0 or t.device.type != "cpu":
                return _norm(t.device)
        if tensors:
            return _norm(tensors[0].device)
        return "cpu" if func.overloadpacket.__name__ in _FACTORIES or not tensors else None

    def _flush_for(self, func, args, kwargs) -> None:
        """A native random op is about to consume a generator: settle what is pending on it."""
        if torch.Tag.nondeterministic_seeded not in func.tags or not self.recorder.has_pending():
            return
        gen = _named(func, args, kwargs).get("generator")
        if gen is None:
            dev = self._out_device(func, args, kwargs)
            if dev is None:
                self.recorder.flush()
                return
            gen = default_generator(dev)
        self.recorder.flush(only=gen)

    def _new_placeholder(self, dev: str, meta: torch.Tensor) -> Placeholder:
        store = new_store(len(self.stores), dev, meta)
        self.stores.append(store)
        return Placeholder(store, store.meta)

    def _generator(self, func, named, dev):
        if torch.Tag.nondeterministic_seeded not in func.tags:
            return None
        return named.get("generator") or default_generator(dev)

    def _convert(self, x, snapshot: bool):
        if isinstance(x, Placeholder):
            return Ref(x._ga_store, x._ga_meta)
        if isinstance(x, torch.Tensor) and snapshot:
            return self._hold(x)
        return x

    def _hold(self, t: torch.Tensor):
        """Keep a real input by reference, not by copy: a weight file's bytes (an mmap) are then
        read only if a created object needs them.  A later write the mode sees copies it first."""
        key = _storage_key(t)
        if key is None:
            return t.detach().clone()        # no version counter (inference tensor) or no storage
        h = Held(t)
        self._held.setdefault(key, []).append(h)
        return h

    def holders_of(self, t: torch.Tensor) -> list:
        return self._held.get(_storage_key(t), []) if self._held else []

    def _copy_before_write(self, written) -> None:
        for w in written:
            if isinstance(w, torch.Tensor) and not isinstance(w, Placeholder):
                for h in self._held.pop(_storage_key(w), ()):
                    h.keep_copy()

    def _become_native(self, func, args, kwargs):
        """``placeholder.set_(storage, ...)`` (how ``torch.load`` rebuilds every tensor): the
        tensor now lives on that real storage, so it stops being a placeholder.  A native tensor
        in a module or optimizer is adopted at the scope's exit."""
        from .binding import swap_native
        ph = args[0]
        real = torch.empty(0, dtype=ph.dtype, device=ph.device)
        func(real, *args[1:], **kwargs)
        swap_native(ph, real)
        return ph

    def _on_meta(self, func, args, kwargs):
        """An op whose results are all meta tensors needs no data: run it on meta mirrors."""
        func(*tmap(_to_meta_keep, args), **tmap(_to_meta_keep, kwargs))
        return _aliased_return(func, args, kwargs)

    # ------------------------------------------------------------------ op kinds
    def _view(self, func, args, kwargs):
        out = func(*tmap(_to_meta, args), **tmap(_to_meta, kwargs))
        src = next(x for x in leaves((args, kwargs)) if isinstance(x, Placeholder))
        store = src._ga_store
        return rebuild(out, [Placeholder(store, m) if isinstance(m, torch.Tensor) else m for m in outputs_of(out)])

    def _inplace_view(self, func, args, kwargs):
        """``t_``, ``transpose_``, ``unsqueeze_``, ...: change the placeholder's geometry, not data."""
        ph = args[0]
        m = ph._ga_meta
        mirror = m.as_strided(m.size(), m.stride(), m.storage_offset())
        func(mirror, *tmap(_to_meta, args[1:]), **tmap(_to_meta, kwargs))
        ph._ga_meta = mirror
        with torch.utils._mode_utils.no_dispatch():
            # update the wrapper's own sizes/strides, as torch's return_and_correct_aliasing does
            was = torch._C._meta_in_tls_dispatch_include()
            torch._C._set_meta_in_tls_dispatch_include(True)
            try:
                func(*args, **kwargs)
            finally:
                torch._C._set_meta_in_tls_dispatch_include(was)
        return ph

    def _inplace(self, func, args, kwargs, written):
        if sum(isinstance(x, torch.Tensor) for x in leaves((args, kwargs))) > 1:
            try:  # an op with other tensor inputs can fail on shapes: raise what the real op would
                func(*tmap(_to_meta, args), **tmap(_to_meta, kwargs))
            except NotImplementedError:
                pass
        named = _named(func, args, kwargs)
        stores = list(dict.fromkeys(w._ga_store for w in written))
        gen = self._generator(func, named, stores[0].device)
        self.recorder.record(func, tmap(lambda x: self._convert(x, True), args),
                             tmap(lambda x: self._convert(x, True), kwargs), writes=stores, gen=gen)
        return _aliased_return(func, args, kwargs)

    def _compute(self, func, args, kwargs):
        dev = self._out_device(func, args, kwargs)
        name = func.overloadpacket.__name__
        try:
            meta_out = func(*tmap(_to_meta, args), **tmap(_to_meta, kwargs))
        except Exception:
            return self._eager(func, args, kwargs)
        flat = outputs_of(meta_out)
        if dev == "meta":
            return meta_out                      # e.g. ``.to("meta")`` (accelerate's init_empty_weights)
        if dev is None or not self.anchored(dev) or not flat or not all(isinstance(m, torch.Tensor) for m in flat):
            return self._eager(func, args, kwargs)
        if all(m.numel() == 0 for m in flat) and not any(isinstance(x, Placeholder) for x in leaves((args, kwargs))):
            # Nothing to anchor, and C++ callers (``torch.load`` moving a storage to the GPU:
            # ``at::empty({0}).set_(storage).copy_(src)``) go on using the very tensor they got.
            self._flush_for(func, args, kwargs)
            return func(*args, **kwargs)
        named = _named(func, args, kwargs)
        if name in _FACTORIES:
            ph = self._new_placeholder(dev, flat[0])
            init = _factory_init(name, named)
            if init is not None:
                op, op_args, op_kwargs = init
                gen = self._generator(op, op_kwargs, dev)
                self.recorder.record(op, (Ref(ph._ga_store, ph._ga_meta), *op_args), op_kwargs,
                                     writes=[ph._ga_store], gen=gen)
            return ph
        return self._record_create(func, args, kwargs, flat, dev, like=meta_out)

    def _record_create(self, func, args, kwargs, metas, dev, snapshot=True, like=None):
        phs = [self._new_placeholder(dev, m if m.device.type == "meta" else _to_meta(m)) for m in metas]
        gen = self._generator(func, _named(func, args, kwargs), dev)
        self.recorder.record(func, tmap(lambda x: self._convert(x, snapshot), args),
                             tmap(lambda x: self._convert(x, snapshot), kwargs),
                             creates=[(i, p._ga_store) for i, p in enumerate(phs)], gen=gen)
        return phs[0] if like is None else rebuild(like, phs)

    def _eager(self, func, args, kwargs):
        """Evaluate the placeholders this op reads, then run it for real."""
        self.eager_evaluations += 1
        self.recorder.flush()

        def real(x):
            if not isinstance(x, Placeholder):
                return x
            from .placeholders import real_view
            store = x._ga_store
            key = (id(store), len(self.recorder.events))
            base = self._memo.get(key)
            if base is None:
                base = self.recorder.evaluate({store: None}, advance_pending=False)[store]
                self._memo = {key: base}
            return real_view(base, x._ga_meta)

        writes = _written(func, args, kwargs)
        if self._held and writes:
            self._copy_before_write(writes)
        out = func(*tmap(real, args), **tmap(real, kwargs))
        flat = outputs_of(out) if isinstance(out, (torch.Tensor, tuple, list)) else [out]
        written = {id(w) for w in writes}
        if not any(isinstance(t, torch.Tensor) and id(t) not in written and self.anchored(_norm(t.device)) for t in flat):
            return out
        # A real result on an anchored device made inside the scope is state too: buffer it.
        res = []
        for t in flat:
            if isinstance(t, torch.Tensor) and self.anchored(_norm(t.device)):
                res.append(self._record_create(aten.clone.default, (t.detach(),), {}, [t], _norm(t.device), snapshot=False))
            else:
                res.append(t)
        return rebuild(out, res)


def _norm(device: torch.device) -> str:
    if device.type == "cuda":
        return f"cuda:{device.index if device.index is not None else torch.cuda.current_device()}"
    return device.type


def _to_meta_keep(x):
    """Placeholders to their meta mirrors; real meta tensors stay (they are written)."""
    return x._ga_meta if isinstance(x, Placeholder) else x


def _storage_key(t: torch.Tensor):
    try:
        t._version
        st = t.untyped_storage()
    except (RuntimeError, NotImplementedError):
        return None
    ptr = st.data_ptr()
    return (t.device.type, t.device.index, ptr) if ptr else None


_SET_STORAGE = {aten.set_.source_Storage, aten.set_.source_Storage_storage_offset}


def _factory_init(name: str, named: dict):
    """The in-place op the eager factory kernel runs on its fresh allocation (None: none)."""
    gen = named.get("generator")
    if name in _EMPTY:
        return None
    if name in _ZERO:
        return aten.zero_.default, (), {}
    if name in _ONE:
        return aten.fill_.Scalar, (1,), {}
    if name in _FULL:
        return aten.fill_.Scalar, (named["fill_value"],), {}
    if name in _RAND:
        return aten.uniform_.default, (0.0, 1.0), {"generator": gen}
    if name in _RANDN:
        return aten.normal_.default, (0.0, 1.0), {"generator": gen}
    if name in _RANDINT:
        return aten.random_.from_ if False else getattr(aten.random_, "from"), (named.get("low", 0), named["high"]), {"generator": gen}
    raise AssertionError(name)
