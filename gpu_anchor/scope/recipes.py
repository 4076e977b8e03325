"""Init recipes: what was done to each placeholder, replayed only for what gets created.

Every op that creates or mutates a placeholder is recorded as an :class:`Event`, in
one global order (``seq``).  Arguments that are placeholders become :class:`Ref`
(a store plus the geometry of the region used); real tensors are buffered at
interception time, so later changes to them cannot leak into the replay.

Randomness (the part that makes replay exact):
- Each random op (``torch.Tag.nondeterministic_seeded``) consumes its generator.
  Inside the scope nothing runs, so the generator is *not* advanced: the op is
  *pending* on a per-generator :class:`Ledger` whose ``base`` is the generator state
  the first pending op must see (the real generator stays at ``base``).
- Something that needs the true generator position (a native random op on the
  same device, or reading a placeholder's data) *flushes*: every pending op runs,
  in order, on scratch memory of the same geometry, recording ``state_before``.
- At bind, :meth:`Recorder.evaluate` walks the log once: ops on stores that must
  get data (created objects and whatever they were computed from) run on real
  memory, using ``state_before`` when known; other pending random ops run on
  scratch only to advance the generator.  The generator ends exactly where a run
  without gpu-anchor would leave it.
- On a fully-matching restart nothing runs: the post-scope generator states are
  looked up in the journal under a fingerprint of (base states, pending ops).

Invariant: for every generator, ``state(generator) == ledger.base`` while ops are
pending (checked on each new pending op and at exit; a mismatch means the program
reseeded, which the ledger honours: pending ops consume from ``base``, the reseed wins).
"""
from __future__ import annotations

import hashlib

import torch
from .placeholders import Store, real_view


# Op arguments are nested tuples/lists/dicts: plain recursion is several times cheaper than
# torch's pytree, and this runs for every op inside a scope.
def leaves(x) -> list:
    out: list = []
    _leaves(x, out)
    return out


def _leaves(x, out: list) -> None:
    if isinstance(x, (tuple, list)):
        for y in x:
            _leaves(y, out)
    elif isinstance(x, dict):
        for y in x.values():
            _leaves(y, out)
    else:
        out.append(x)


def tmap(fn, x):
    if isinstance(x, tuple):
        return tuple(tmap(fn, y) for y in x)
    if isinstance(x, list):
        return [tmap(fn, y) for y in x]
    if isinstance(x, dict):
        return {k: tmap(fn, v) for k, v in x.items()}
    return fn(x)


def outputs_of(out) -> list:
    """An op's tensor outputs as a flat list (aten ops return a tensor, or a tuple/list of them)."""
    return list(out) if isinstance(out, (tuple, list)) else [out]


def rebuild(out, flat: list):
    """``out``'s structure with ``flat`` in place of its outputs."""
    if isinstance(out, tuple):
        return tuple(flat)
    if isinstance(out, list):
        return list(flat)
    return flat[0]


class Ref:
    """A store region used by a recorded op (``meta`` carries size, stride, offset, dtype)."""

    __slots__ = ("store", "meta")

    def __init__(self, store: Store, meta: torch.Tensor) -> None:
        self.store, self.meta = store, meta

    def describe(self) -> str:
        m = self.meta
        return f"ref({tuple(m.shape)},{m.stride()},{m.storage_offset()},{m.dtype})"


class Held:
    """A real tensor a recorded op read, kept by reference until replay (see ScopeMode._hold).

    ``keep_copy`` is called before the program writes it through the dispatcher; a write the
    dispatcher never sees (numpy, another thread) shows in the version counter at replay."""

    __slots__ = ("t", "version")

    def __init__(self, t: torch.Tensor) -> None:
        self.t, self.version = t, t._version

    def keep_copy(self) -> None:
        self.t = self.t.detach().clone()
        self.version = self.t._version

    def value(self) -> torch.Tensor:
        if self.t._version != self.version:
            raise RuntimeError(
                f"a {tuple(self.t.shape)} {self.t.dtype} tensor that initialised an object inside the managed_scope "
                "was modified in place afterwards, outside torch's dispatcher (numpy, another thread); "
                "pass a copy (.clone()) or leave it unchanged until the scope exits")
        return self.t


class Event:
    __slots__ = ("seq", "func", "args", "kwargs", "writes", "creates", "gen", "state_before")

    def __init__(self, seq, func, args, kwargs, writes=(), creates=(), gen=None) -> None:
        self.seq, self.func, self.args, self.kwargs = seq, func, args, kwargs
        self.writes: list[Store] = list(writes)          # stores mutated in place
        self.creates: list[tuple[int, Store]] = list(creates)  # (flat output index, store)
        self.gen = gen                                   # torch.Generator consumed, or None
        self.state_before = None                         # generator state this op must see, once known

    def refs(self) -> list[Ref]:
        return [x for x in leaves((self.args, self.kwargs)) if isinstance(x, Ref)]

    def outputs(self) -> list[Store]:
        return self.writes + [s for _, s in self.creates]

    def describe(self) -> str:
        def d(x):
            if isinstance(x, Ref):
                return x.describe()
            if isinstance(x, Held):
                x = x.t
            if isinstance(x, torch.Tensor):
                return f"buf({tuple(x.shape)},{x.dtype})"
            if isinstance(x, torch.Generator):
                return "gen"
            return repr(x)
        parts = [d(x) for x in leaves((self.args, self.kwargs))]
        return f"{self.func}({','.join(parts)})"


def generator_key(gen: torch.Generator) -> str | None:
    """'cpu' / 'cuda:N' for default generators (whose state the journal may restore), else None."""
    if gen is torch.default_generator:
        return "cpu"
    if gen.device.type == "cuda":
        idx = gen.device.index or 0
        if idx < len(torch.cuda.default_generators) and gen is torch.cuda.default_generators[idx]:
            return f"cuda:{idx}"
    return None


def default_generator(device: str) -> torch.Generator:
    if device == "cpu":
        return torch.default_generator
    torch.cuda.init()
    return torch.cuda.default_generators[int(device.split(":")[1])]


def _state_bytes(gen: torch.Generator) -> bytes:
    return gen.get_state().numpy().tobytes()


class Ledger:
    def __init__(self, gen: torch.Generator) -> None:
        self.gen = gen
        self.base: bytes | None = None
        self.pending: list[Event] = []


class Recorder:
    """The global op log of one scope, with one :class:`Ledger` per generator."""

    def __init__(self) -> None:
        self.events: list[Event] = []
        self.ledgers: dict[int, Ledger] = {}
        self.flushes = 0
        self.executed = 0      # ops actually run (replay, scratch advance, eager reads)

    # ------------------------------------------------------------- recording
    def record(self, func, args, kwargs, writes=(), creates=(), gen=None) -> Event:
        ev = Event(len(self.events), func, args, kwargs, writes, creates, gen)
        if gen is not None:
            led = self.ledgers.setdefault(id(gen), Ledger(gen))
            now = _state_bytes(gen)
            if led.pending and now != led.base:
                self.flush()  # reseeded since the last pending op: settle those first
                now = _state_bytes(gen)
            if not led.pending:
                led.base = now
            led.pending.append(ev)
        self.events.append(ev)
        for _, s in ev.creates:
            s.init = ev
        return ev

    def has_pending(self) -> bool:
        return any(led.pending for led in self.ledgers.values())

    def flush(self, only: torch.Generator | None = None) -> None:
        """Advance generators (all, or ``only``) past their pending ops on scratch memory,
        recording the state each op consumed."""
        if only is not None and not self.ledgers.get(id(only), Ledger(only)).pending:
            return
        if self.has_pending():
            self.flushes += 1
            self.evaluate({}, advance_pending=True, only=only)

    # ------------------------------------------------------------- journal fingerprint
    def fingerprint(self) -> tuple[str, dict[str, torch.Generator]] | None:
        """Hash of (generator, base state, pending ops) for default generators, or None when a
        custom generator has pending ops or a generator was reseeded after its last pending op."""
        h = hashlib.sha256()
        gens = {}
        for led in sorted(self.ledgers.values(), key=lambda l: str(generator_key(l.gen))):
            if not led.pending:
                continue
            key = generator_key(led.gen)
            if key is None or _state_bytes(led.gen) != led.base:
                return None
            gens[key] = led.gen
            h.update(key.encode() + hashlib.sha256(led.base).digest())
            for ev in led.pending:
                h.update(ev.describe().encode())
        return (h.hexdigest(), gens) if gens else None

    def settle_pending(self, states: dict[str, bytes]) -> None:
        """Set default generators to journaled post-scope states; pending ops count as consumed."""
        for led in self.ledgers.values():
            if led.pending:
                key = generator_key(led.gen)
                led.gen.set_state(torch.frombuffer(bytearray(states[key]), dtype=torch.uint8))
                led.pending.clear()

    # ------------------------------------------------------------- replay
    def evaluate(self, targets: dict[Store, torch.Tensor | None], advance_pending: bool,
                 only: torch.Generator | None = None) -> dict[Store, torch.Tensor]:
        """Replay the log so that each target store holds its recorded contents.

        ``targets`` maps a store to the allocation to fill (a tensor of the store's
        alloc shape) or ``None`` (a temporary is made).  With ``advance_pending``,
        pending random ops on other stores run on scratch so every generator ends
        where the program without gpu-anchor would leave it.
        """
        need = set(targets)
        needed: set[int] = set()
        for ev in reversed(self.events):
            if any(s in need for s in ev.outputs()):
                needed.add(ev.seq)
                need.update(r.store for r in ev.refs())
        last_use: dict[Store, int] = {}
        for ev in self.events:
            if ev.seq in needed:
                for s in ev.outputs() + [r.store for r in ev.refs()]:
                    last_use[s] = ev.seq

        ledgers = [led for led in self.ledgers.values() if only is None or led.gen is only] if advance_pending else []
        pending = {id(e) for led in ledgers for e in led.pending}
        rewind = []
        if advance_pending:
            for led in ledgers:
                if led.pending:
                    cur = _state_bytes(led.gen)
                    if cur != led.base:
                        led.gen.set_state(torch.frombuffer(bytearray(led.base), dtype=torch.uint8))
                        rewind.append((led.gen, cur))
        reals: dict[Store, torch.Tensor] = {}

        def base_of(store: Store) -> torch.Tensor:
            t = reals.get(store)
            if t is None:
                t = targets.get(store)
                if t is None:
                    shape, _ = store.alloc_spec()
                    t = torch.empty(shape, dtype=store.dtype, device=store.device)
                reals[store] = t
            return t

        def to_real(x):
            if isinstance(x, Ref):
                return real_view(base_of(x.store), x.meta)
            return x.value() if isinstance(x, Held) else x

        def to_scratch(x):
            if isinstance(x, Ref):
                shape, _ = x.store.alloc_spec()
                return real_view(torch.empty(shape, dtype=x.store.dtype, device=x.store.device), x.meta)
            return x.value() if isinstance(x, Held) else x

        with torch.no_grad():
            for ev in self.events:
                if ev.seq in needed:
                    self.executed += 1
                    out = _run(ev, tmap(to_real, ev.args), tmap(to_real, ev.kwargs))
                    if ev.creates:
                        flat = outputs_of(out)
                        for i, s in ev.creates:
                            if s in need:
                                real_view(base_of(s), s.meta).copy_(flat[i])
                    for s in set(ev.outputs() + [r.store for r in ev.refs()]):
                        if last_use.get(s) == ev.seq and s not in targets:
                            reals.pop(s, None)  # a temporary nobody needs any more
                elif id(ev) in pending:
                    self.executed += 1
                    _run(ev, tmap(to_scratch, ev.args), tmap(to_scratch, ev.kwargs))
        for gen, cur in rewind:
            gen.set_state(torch.frombuffer(bytearray(cur), dtype=torch.uint8))
        for led in ledgers:
            led.pending.clear()
        return {s: base_of(s) for s in targets}   # a store no op wrote (a bare empty()) is uninitialised


def _run(ev: Event, args, kwargs):
    gen = ev.gen
    if gen is None:
        return ev.func(*args, **kwargs)
    if ev.state_before is not None:
        cur = gen.get_state()
        gen.set_state(ev.state_before)
        try:
            return ev.func(*args, **kwargs)
        finally:
            gen.set_state(cur)
    ev.state_before = gen.get_state()  # consumed at the generator's true position
    return ev.func(*args, **kwargs)
