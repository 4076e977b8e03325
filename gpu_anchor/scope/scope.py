"""``managed_scope``: anchor the long-lived state a ``with`` block builds.

    with gpu_anchor.managed_scope() as scope:
        model = LlamaForCausalLM(config).to("cuda")
        engine.kv_cache = {f"layer_{i}": torch.zeros(shape, device="cuda") for i in range(n)}
    print(scope.report)        # .matched / .created / .conflicts (lists of names)

State machine of one scope (see docs/scope.md):

    OPEN ──(block raises)──────────────────────────────▶ ABANDONED (nothing bound)
      │ exit
      ▼
    NAMED ──(a name conflicts, on_conflict="error")────▶ REFUSED (ConflictError; daemon untouched)
      │ bound (matched / created / replaced)
      ▼
    FILLED (recipes replayed into created objects only; RNG settled)
      │ placeholders swapped for real tensors
      ▼
    BOUND
"""
from __future__ import annotations

import base64
import gc
import inspect
import json
import os
import sys
import threading
import time
import warnings
import weakref
from dataclasses import dataclass, field

import torch

from gpu_anchor.errors import AnchorError, DaemonUnavailable
from gpu_anchor.paths import normalize_device

from . import adoption, binding, hooks
from .interception import ScopeMode
from .naming import walk
from .placeholders import Placeholder, Store

NAMINGS = ("access_path", "allocation_order")
_current = threading.local()


def current() -> "ManagedScope | None":
    """The scope open in this thread, if any (for components built inside one)."""
    return getattr(_current, "scope", None)
RNG_KEY = "scope/rng/"


@dataclass
class Report:
    """What binding did; lists hold names.

    ``adopted``: the subset of ``matched``/``created`` that were native tensors (made by a
    loader) adopted at exit.  ``not_anchored``: every tensor the block made that is *not*
    anchored, name → reason (no daemon for its device, still on meta, unreachable, ...).
    ``native``: the unreachable placeholders among them (ordinary memory, with a warning)."""
    matched: list[str] = field(default_factory=list)
    created: list[str] = field(default_factory=list)
    conflicts: list[str] = field(default_factory=list)
    adopted: list[str] = field(default_factory=list)
    not_anchored: dict[str, str] = field(default_factory=dict)
    native: list[str] = field(default_factory=list)
    rng: str = "untouched"          # untouched / journal / replayed / advanced
    resident_loads: int = 0          # from_pretrained calls served from anchored memory (no file read)
    eager_evaluations: int = 0       # placeholder reads that forced a replay inside the block
    replayed_ops: int = 0            # recorded ops actually run (0 on a fully-matching restart)
    timings_ms: dict = field(default_factory=dict)

    def __str__(self) -> str:
        t = ", ".join(f"{k} {v:.1f}" for k, v in self.timings_ms.items())
        text = (f"managed_scope: {len(self.matched)} matched, {len(self.created)} created "
                f"({len(self.adopted)} adopted from loaders), {len(self.conflicts)} conflicts, "
                f"{len(self.not_anchored)} not anchored; rng {self.rng}; ms: {t}")
        for name, why in list(self.not_anchored.items())[:5]:
            text += f"\n  not anchored: {name}: {why}"
        if len(self.not_anchored) > 5:
            text += f"\n  ... and {len(self.not_anchored) - 5} more (scope.report.not_anchored)"
        return text


class ManagedScope:
    """See :func:`managed_scope`.  ``objects`` maps each anchored name to its tensor (it holds
    references: clear it, or drop the scope, to let the program free objects)."""

    def __init__(self, namespace: str | None = None, on_conflict: str = "error", naming: str = "access_path",
                 require: bool = False) -> None:
        if on_conflict not in ("error", "replace"):
            raise ValueError(f"on_conflict must be 'error' or 'replace', got {on_conflict!r}")
        if naming not in NAMINGS:
            raise ValueError(f"naming must be one of {NAMINGS}, got {naming!r}")
        if namespace is not None and (not isinstance(namespace, str) or not namespace):
            raise ValueError(f"namespace must be a non-empty string, got {namespace!r}")
        self.namespace = namespace if namespace is not None else os.environ.get("GPU_ANCHOR_NAMESPACE", "default")
        self.on_conflict = on_conflict
        self.naming = naming
        self.require = bool(require)
        self.report = Report()
        self._before: dict[int, weakref.ref] = {}
        self._unprotected: list[str] = []
        self._pretrained: list = []          # (load key, model) for from_pretrained calls in the block
        self.objects: dict[str, torch.Tensor] = {}
        self._mode: ScopeMode | None = None
        self._anchored: dict[str, object] = {}
        self._after: list = []
        self._state = "new"

    def on_bound(self, fn) -> None:
        """Call ``fn()`` once the scope has bound, with real tensors in place.

        For components built inside the block that must *read or modify data* at start-up
        (e.g. an optimizer that rolls back an interrupted step): inside the block tensors
        are placeholders, and an in-place op on one that ends up *matched* is recorded,
        never applied.  Not called if the block raises or the bind is refused."""
        if self._state not in ("new", "open"):
            raise RuntimeError("on_bound after the scope has closed: call fn() directly")
        self._after.append(fn)

    # ------------------------------------------------------------------ devices
    def _client(self, device: str):
        if device not in self._anchored:
            self._anchored[device] = binding.client_for(device, self.namespace)
        return self._anchored[device]

    def _is_anchored(self, device: str) -> bool:
        try:
            return self._client(normalize_device(device)) is not None
        except ValueError:
            return False

    # ------------------------------------------------------------------ with
    def __enter__(self) -> "ManagedScope":
        if self._state != "new":
            raise RuntimeError("a managed_scope object can be entered once")
        if any(isinstance(m, ScopeMode) for m in torch.utils._python_dispatch._get_current_dispatch_mode_stack()):
            raise RuntimeError("managed_scope cannot be nested: put all the state in one scope")
        frame = sys._getframe(1)
        # Tensors reachable before the block are not the block's to adopt (a reference model, a
        # dataset): remember them by weak reference, so that a reused id cannot be mistaken.
        pre = walk({k: v for k, v in frame.f_locals.items() if not isinstance(v, ManagedScope)}).tensors
        self._before = {id(t): weakref.ref(t) for _, t, _ in pre}
        del pre
        self._mode = ScopeMode(self._is_anchored)
        self._mode.stop_frame = frame
        del frame
        self._fmode = hooks.FunctionMode(self._mode)
        hooks.install()
        try:
            self._mode.__enter__()
            self._fmode.__enter__()
        except BaseException:
            hooks.uninstall()
            raise
        self._state = "open"
        _current.scope = self
        return self

    def __exit__(self, exc_type, exc, tb) -> bool:
        mode = self._mode
        self._fmode.__exit__(None, None, None)
        mode.__exit__(None, None, None)
        mode.stop_frame = None
        hooks.uninstall()
        _current.scope = None
        if exc_type is not None:
            self._state = "abandoned"
            for s in mode.stores:
                s.tensors.clear()
            return False
        frame = sys._getframe(1)
        locs = frame.f_locals
        roots = dict(locs)
        if (sys.version_info < (3, 13) and frame.f_code.co_flags & inspect.CO_OPTIMIZED and locs is not frame.f_globals
                and sys.gettrace() is None and frame.f_trace is None):
            # Python < 3.13 caches a snapshot of a function's locals on the frame when f_locals is
            # read; left there it would keep every object the block made alive after the program
            # deletes it.  Safe to drop when no tracer will write the snapshot back.
            locs.clear()
        del frame, locs
        try:
            self._finish(roots)
        finally:
            roots.clear()
            self._mode = None
        after, self._after = self._after, []
        for fn in after:
            fn()
        return False

    # ------------------------------------------------------------------ exit
    def _finish(self, roots: dict) -> None:
        t0 = time.perf_counter()
        mode, rep = self._mode, self.report
        rep.eager_evaluations = mode.eager_evaluations
        stores = mode.stores
        by_store = binding.live_placeholders(stores)
        live = [s for s in stores if s in by_store]
        named, state = self._name(live, roots)
        roots.clear()
        before = self._before
        state = [e for e in state if (r := before.get(id(e[1]))) is None or r() is not e[1]]
        self._before = {}
        cand, rep.not_anchored, self._unprotected = adoption.classify(state, self._is_anchored, binding.why_not)
        state.clear()
        adopted = adoption.group(cand, len(stores))
        cand.clear()
        t1 = time.perf_counter()
        orphans = [s for s in live if s.name is None]
        if orphans:
            by_store = {}
            gc.collect()
            by_store = binding.live_placeholders(stores)
            orphans = [s for s in orphans if s in by_store]
            for s in orphans:
                rep.not_anchored[f"#{s.index} {list(s.shape)} {s.dtype}"] = (
                    "made in the block but not reachable from its variables (a temporary a cache or closure "
                    "keeps): it gets no memory, and using it raises an error naming it")
            if orphans:
                warnings.warn(
                    f"managed_scope: {len(orphans)} tensor(s) made in the block are alive but not reachable from its "
                    "local variables; they get no memory and raise if used (keep state in a variable, attribute "
                    "or container of the block's frame): see scope.report.not_anchored", stacklevel=3)
        self._check_coverage(named, adopted)
        by_client: dict = {}
        for s in named + adopted:
            by_client.setdefault(self._client(s.device), []).append(s)
        try:
            conflicts = binding.bind(by_client, self.on_conflict)
        except Exception:
            self._state = "refused"
            for s in stores:
                s.tensors.clear()
            raise
        rep.conflicts = [c.get("name") for c in conflicts]
        t2 = time.perf_counter()
        created = [s for s in named if s.status == "created"]
        self._settle(created, [s for s in adopted if s.status == "created"], by_client)
        t3 = time.perf_counter()
        for s in named:
            binding.swap_in(by_store[s], s.real)
            (rep.matched if s.status == "matched" else rep.created).append(s.name)
            self.objects[s.name] = s.real  # the whole allocation
            s.real = None
        for s in orphans:
            rep.native.append(f"#{s.index} {list(s.shape)}")
            for t in by_store[s]:
                t._ga_store.status = "dead"
        by_store.clear()
        for s in stores:
            s.tensors.clear()
        for s in adopted:
            (rep.matched if s.status == "matched" else rep.created).append(s.name)
            rep.adopted.append(s.name)
            self.objects[s.name] = s.real
        adoption.swap_all(adopted, binding.swap)
        self._settle_pretrained()
        for dev in sorted({s.device for s in adopted if s.device.startswith("cuda")}):
            torch.cuda.empty_cache()              # the adopted native copies: give the memory back
        t4 = time.perf_counter()
        rep.replayed_ops = mode.recorder.executed
        rep.timings_ms = {"naming": 1e3 * (t1 - t0), "bind": 1e3 * (t2 - t1), "replay": 1e3 * (t3 - t2),
                          "swap": 1e3 * (t4 - t3), "total": 1e3 * (t4 - t0)}
        self._state = "bound"
        self._warn_if_unprotected()

    def _settle_pretrained(self) -> None:
        """Models from_pretrained served from anchored memory are matched objects too; every
        model it returned leaves a load hint for the next restart (see pretrained.py)."""
        from gpu_anchor.client.client import anchored_name
        from . import pretrained
        rep, known = self.report, set(self.report.matched) | set(self.report.created)
        for key, model in self._pretrained:
            for _, t, _ in pretrained.tensors(model):
                named = anchored_name(t) if t.device.type in ("cpu", "cuda") else None
                if named is not None and named[1] not in known:
                    known.add(named[1])
                    rep.matched.append(named[1])
                    rep.adopted.append(named[1])
                    self.objects[named[1]] = t
            pretrained.record(self, key, model)
        self._pretrained = []

    def _check_coverage(self, named: list[Store], adopted: list) -> None:
        """``require=True``: refuse, before the daemon is asked anything, if any parameter,
        buffer or optimizer state the block made would stay unanchored."""
        if not self.require or not self._unprotected:
            return
        lines = "\n".join(f"  {n}: {self.report.not_anchored[n]}" for n in self._unprotected)
        self._state = "refused"
        for s in self._mode.stores:
            s.tensors.clear()
        cls = DaemonUnavailable if any(self.report.not_anchored[n].startswith("no daemon")
                                       for n in self._unprotected) else AnchorError
        raise cls(f"managed_scope(require=True): {len(self._unprotected)} tensor(s) the block made would not be "
                  f"anchored; nothing was bound:\n{lines}")

    def _warn_if_unprotected(self) -> None:
        rep, state = self.report, self._unprotected
        self._unprotected = []
        if not state:
            return
        why = sorted({rep.not_anchored[n] for n in state})
        head = ("managed_scope anchored nothing" if not rep.matched and not rep.created else
                f"managed_scope left {len(state)} parameter/buffer/optimizer tensor(s) unanchored")
        warnings.warn(f"{head}: {'; '.join(why)} (e.g. {state[0]}; managed_scope(require=True) raises instead)",
                      stacklevel=3)

    def _name(self, live: list[Store], roots: dict) -> tuple[list[Store], list]:
        """Name live placeholders; also return every tensor the walk reached (for adoption)."""
        clean = {k: v for k, v in roots.items() if not isinstance(v, ManagedScope)}
        if self.naming == "allocation_order":
            for s in live:
                s.name = f"alloc[{s.index}]"
            return list(live), []
        live_ids = {id(s) for s in live}
        fallback: dict[int, str] = {}

        def found(path, t) -> bool:
            s = t._ga_store
            if s.name is not None or id(s) not in live_ids:
                return False
            m, b = t._ga_meta, s.meta
            if m.dtype == b.dtype and m.shape == b.shape and m.stride() == b.stride() and m.storage_offset() == 0:
                s.name = path
            else:
                fallback.setdefault(id(s), path + "@base")
            return False

        w = walk(clean, want=lambda t: isinstance(t, Placeholder), found=found)
        for s in live:
            if s.name is None and id(s) in fallback:
                s.name = fallback[id(s)]
        return [s for s in live if s.name is not None], w.tensors

    def _settle(self, created: list[Store], adopted: list, by_client: dict) -> None:
        """Fill created objects by replaying their recipes, and created adopted objects with
        their native bytes; leave every generator where a run without gpu-anchor would; then
        clear the unfilled markers (FILLED)."""
        rec, rep = self._mode.recorder, self.report
        adoption.fill(adopted)
        fp = rec.fingerprint()
        clients = sorted(by_client, key=lambda c: c.device)
        journal = clients[0].journal if clients else None
        key = RNG_KEY + fp[0] if fp else None
        puts: dict = {}
        if not created:
            if rec.has_pending():
                blob = journal.get(key) if fp and journal is not None else None
                if blob is not None:
                    rec.settle_pending({k: base64.b64decode(v) for k, v in json.loads(blob).items()})
                    rep.rng = "journal"
                    fp = None                          # already journaled
                else:
                    rec.flush()
                    rep.rng = "advanced"
            else:
                fp = None
        else:
            targets = {s: (s.real if s.status != "native" else None) for s in created}
            out = rec.evaluate(targets, advance_pending=True)
            for s in created:
                if s.status == "native":
                    s.real = out[s]
            rep.rng = "replayed"
        for dev in sorted({s.device for s in created + adopted if s.device.startswith("cuda")}):
            torch.cuda.synchronize(dev)           # filled before the marker says so
            torch.cuda.empty_cache()              # replay temporaries: give the memory back
        created = created + adopted
        if not created and fp is None:
            return
        if fp and journal is not None:
            puts[key] = json.dumps({k: base64.b64encode(g.get_state().numpy().tobytes()).decode()
                                    for k, g in fp[1].items()}).encode()
        made = {id(s) for s in created}
        for c in clients:
            filled = {s.name for s in by_client[c] if id(s) in made}
            if filled or (c is clients[0] and puts):
                binding.mark_filled(c, filled, puts if c is clients[0] else None)


def managed_scope(namespace: str | None = None, on_conflict: str = "error", require: bool = False) -> ManagedScope:
    """Anchor the tensors a ``with`` block creates on devices that have a gpu-anchor daemon.

    Inside the block, tensor creation on an anchored device returns placeholders (right
    metadata, no memory) and records how each was initialised.  At exit every placeholder
    still reachable from the block's local variables is named by its access path
    (``model.layers[3].mlp.up.weight``) and bound: *matched* (the object survived a previous
    worker: its data is kept, nothing is replayed), *created* (the recorded initialisation
    is replayed into fresh anchored memory, bit-identical to running without gpu-anchor),
    or a *conflict* (same name, other dtype/shape: ``on_conflict="error"`` raises
    ``ConflictError`` and leaves the daemon untouched; ``"replace"`` recreates it).

    Native tensors that loaders put into the block's modules and optimizers
    (``from_pretrained``, ``torch.load``, safetensors, ``assign=True``) are *adopted*:
    anchored under their access path, their bytes kept on a match.  Every tensor the block
    made that stays unanchored is listed in ``scope.report.not_anchored`` with the reason;
    a block that anchors nothing because no daemon answers warns.

    ``namespace``: default ``$GPU_ANCHOR_NAMESPACE``, then ``"default"``.
    ``require``: raise (``DaemonUnavailable`` / ``AnchorError``, before anything is bound)
    instead of leaving any of the block's tensors unanchored.
    """
    return ManagedScope(namespace, on_conflict, require=require)
