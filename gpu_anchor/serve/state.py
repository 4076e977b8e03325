"""One engine process's anchored state: its weights and its paged KV cache, bound by name.

    st = bind_state(cfg, mc, dtype, device, report)     # matched (a restart) or created + loaded
    why = st.kv_problem()                               # "" if the KV cache can be trusted
    st.record_layout()                                  # after the decision is committed

Both kinds of engine process use it: the engine (rank 0, the only one with a scheduler and a
journal of requests) and every other rank of a tensor-parallel group (``tp.serve_rank``),
each with its shard (``shards.py``) in its own device's daemon and namespace.

Journal keys of every rank's namespace: ``serve/weights`` (the fingerprint of completely
loaded weights: deleted before a load starts, written after it ends) and ``serve/layout``
(the KV shape, dtype, weights and part the KV refers to).  Weights are read from disk only
when the daemon created them or their fingerprint is missing.

``serve/layout`` vouches for the KV memory beside it: it is deleted the moment that memory
(or the weights) turns out new or different, before anything else happens, and written
again only once rank 0's journal no longer counts on the old contents (rank 0: in the
restore's commit; the others: after rank 0's ``go``).  A crash in between leaves no record,
so the next start recomputes again instead of trusting memory no step wrote.

``attach=True`` (a hot standby, ``Engine(standby=True)``) binds without owning: the objects are
looked up (``policy="lookup"``: created never, freed never by this process), nothing is
loaded, zeroed or written to the journal, and anything short of a complete, fingerprinted
namespace of this layout raises ``NotAttachable``.  ``RankState.recheck`` repeats the journal
check at take-over and judges the KV by the journal as it is then.
"""
from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass, field

import torch

from gpu_anchor.errors import ConflictError

from . import commit as C
from . import packing, shards
from .anchor import Anchor
from .model_runner import head_dim, init_random, load_weights, param_specs, weights_fingerprint

log = logging.getLogger("gpu_anchor.serve")


class NotAttachable(RuntimeError):
    """A hot standby cannot attach to (or take over) the namespace as it is: the caller builds an
    ordinary engine instead (the standby is then a warm one)."""


@dataclass
class RankState:
    anchor: Anchor
    weights: dict[str, torch.Tensor]       # Hugging Face names (members of packed ones: row views)
    kv: list[torch.Tensor]
    status: dict[str, str]                 # name -> "matched" | "created"
    kv_names: list[str]
    layout: bytes                          # this rank's serve/layout record
    weights_loaded: bool                   # read from disk / drawn again in this process
    problem: str = ""                      # why the KV cannot be trusted ("" if it can)
    timings: dict[str, float] = field(default_factory=dict)
    packed: dict[str, torch.Tensor] = field(default_factory=dict)   # packing.py: qkv_proj, gate_up_proj
    fingerprint: str = ""                  # what serve/weights must say for these weights

    @property
    def journal(self):
        return self.anchor.journal

    @property
    def kv_matched(self) -> bool:
        return all(self.status[n] == "matched" for n in self.kv_names)

    def kv_problem(self) -> str:
        """Why this rank's anchored KV cannot be trusted ("" if it can), as found at bind."""
        return self.problem

    def _judge(self, old: bytes | None) -> str:
        if old is not None and old != self.layout:
            return "the KV layout or the weights changed since the commit"
        if not self.kv_matched:
            return "the KV cache memory is new (the daemon lost it)"
        if old is None:
            return "no layout record"
        if self.weights_loaded:
            return "the weights had to be loaded again"
        return ""

    def recheck(self) -> None:
        """At a hot standby's take-over: the journal must still vouch for the weights this process
        attached to; the KV is judged by the layout record as it is now (``kv_problem``)."""
        j = self.journal
        if j.get(C.WEIGHTS) != self.fingerprint.encode():
            raise NotAttachable("the weights' fingerprint changed since the standby attached")
        self.problem = self._judge(j.get(C.LAYOUT))

    def record_layout(self) -> None:
        if self.journal is not None:
            self.journal.commit({C.LAYOUT: self.layout})


def bind_state(cfg, mc, dtype: torch.dtype, device: torch.device, report=None, provider=Anchor,
               attach: bool = False) -> RankState:
    """Bind this rank's weights and KV cache (``cfg.rank`` of ``cfg.tensor_parallel_size``);
    load or draw the weights unless they are anchored and complete; zero a new KV cache.
    ``report(phase, done, total)``: start-up progress (``bind``, ``weights``).  ``provider``:
    the memory provider, ``Anchor``'s interface (the benchmarks' baselines bring their own).
    ``attach``: a hot standby's bind, which writes nothing (the module's doc)."""
    report = report or (lambda phase, done=None, total=None: None)
    rank, n = cfg.rank, cfg.tensor_parallel_size
    t0 = time.perf_counter()
    # the HF module on the meta device (names, shapes): built once per process, before forking
    # engines under the supervisor; timed apart so that "bind" is the memory's cost alone
    full = param_specs(mc, dtype)
    specs_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    anchor = provider(str(device), cfg.namespace, cfg.socket, enabled=cfg.anchor,
                      **({"rank": rank, "world": n} if n > 1 else {}))
    wspecs = shards.shard_specs(full, mc.vocab_size, rank, n)
    bspecs, groups = packing.pack_specs(wspecs)
    L, d = mc.num_hidden_layers, head_dim(mc)
    kshape = (2, cfg.num_blocks, cfg.block_size, mc.num_key_value_heads // n, d)
    kspecs = [(f"kv_cache[{i}]", kshape, dtype) for i in range(L)]
    report("bind", None, sum(math.prod(shape) * dt.itemsize for _, shape, dt in bspecs + kspecs))
    if attach:
        return _attach(anchor, cfg, mc, dtype, wspecs, bspecs, kspecs, groups, full, specs_s, t0)
    try:
        tensors, status = anchor.bind(bspecs + kspecs)
    except ConflictError as e:   # another layout or model under these names: start them afresh
        log.warning("anchored objects do not fit this engine (%s); replacing them", str(e).splitlines()[0])
        tensors, status = anchor.bind(bspecs + kspecs, policy="replace")
    timings = {"model_specs_s": specs_s, "bind_s": time.perf_counter() - t0}
    tensors.update(packing.member_views(tensors, groups, wspecs))
    status.update({m: status[p] for p, ms in groups.items() for m in ms})
    weights = {nm: tensors[nm] for nm, _, _ in wspecs}
    kv = [tensors[nm] for nm, _, _ in kspecs]
    journal = anchor.journal
    fp, rec = _identity(cfg, mc, dtype, kspecs)
    t1 = time.perf_counter()
    have = journal.get(C.WEIGHTS) if journal is not None else None
    matched = all(status[nm] == "matched" for nm, _, _ in wspecs) and have == fp.encode()
    st = RankState(anchor, weights, kv, status, [nm for nm, _, _ in kspecs], C.layout_record(rec), not matched,
                   timings=timings, packed={p: tensors[p] for p in groups}, fingerprint=fp)
    if journal is not None:
        old = journal.get(C.LAYOUT)
        st.problem = st._judge(old)
        # before the memory is touched: the layout record (see the module's doc), and the
        # weights' fingerprint, so that a crash mid-load does not look complete
        gone = ([C.LAYOUT] if st.problem and old is not None else []) + ([C.WEIGHTS] if not matched else [])
        if gone:
            journal.commit({}, gone)
    if not matched:
        total = sum(t.numel() * t.element_size() for t in weights.values())
        report("weights", 0, total)
        index = None
        if n > 1:
            def index(name, shape):
                return shards.index(name, shape, mc.vocab_size, rank, n)
        if cfg.random_weights:
            init_random(weights, mc, cfg.seed, progress=lambda done: report("weights", done, total),
                        full_shapes={nm: s for nm, s, _ in full}, part=index)
            if device.type == "cuda":
                # the float32 draws' blocks go back now: a later small allocation split from one
                # would pin the whole block (2.5 GB for the 8B embedding) for the process's life
                torch.cuda.empty_cache()
        else:
            load_weights(cfg.model, weights, progress=lambda done: report("weights", done, total), part=index)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        if journal is not None:
            journal.commit({C.WEIGHTS: fp.encode()})
    timings["weights_s"] = time.perf_counter() - t1
    if any(status[nm] == "created" for nm, _, _ in kspecs):
        for t in kv:          # fresh CUDA memory is undefined: start from zeros (once, at creation)
            t.zero_()
    return st


def _attach(anchor, cfg, mc, dtype, wspecs, bspecs, kspecs, groups, full, specs_s, t0) -> RankState:
    """``bind_state(attach=True)``: look the objects up and check the journal; write nothing."""
    if anchor.journal is None:
        raise NotAttachable("the engine runs without anchoring (--no-anchor): there is nothing to attach to")
    try:
        tensors, status = anchor.bind(bspecs + kspecs, policy="lookup")
    except ConflictError as e:
        raise NotAttachable(f"the anchored objects have another shape or dtype: {str(e).splitlines()[0]}") from None
    missing = [nm for nm, st in status.items() if st != "matched"]
    if missing:
        raise NotAttachable(f"{len(missing)} of {len(status)} objects are not anchored (e.g. {missing[0]!r}): no "
                            "complete engine state to attach to")
    timings = {"model_specs_s": specs_s, "bind_s": time.perf_counter() - t0, "weights_s": 0.0}
    tensors.update(packing.member_views(tensors, groups, wspecs))
    status.update({m: status[p] for p, ms in groups.items() for m in ms})
    fp, rec = _identity(cfg, mc, dtype, kspecs)
    journal = anchor.journal
    if journal.get(C.WEIGHTS) != fp.encode():
        raise NotAttachable("the journal has no fingerprint of these weights (never loaded completely, or another "
                            "model)")
    layout = C.layout_record(rec)
    if journal.get(C.LAYOUT) != layout:
        raise NotAttachable("the journal has no layout record of this KV cache (the live engine has not committed "
                            "its start, or it uses another layout)")
    return RankState(anchor, {nm: tensors[nm] for nm, _, _ in wspecs}, [tensors[nm] for nm, _, _ in kspecs], status,
                     [nm for nm, _, _ in kspecs], layout, False, timings=timings,
                     packed={p: tensors[p] for p in groups}, fingerprint=fp)


def _identity(cfg, mc, dtype, kspecs) -> tuple[str, dict]:
    """The weights' fingerprint and the ``serve/layout`` record of this rank's configuration."""
    rank, n = cfg.rank, cfg.tensor_parallel_size
    part = f"tp{rank}/{n}" if n > 1 else ""
    fp = weights_fingerprint(cfg.model, mc, dtype, cfg.seed if cfg.random_weights else None, part)
    rec = {"fp": fp, "kv": [list(kspecs[0][1])], "layers": mc.num_hidden_layers, "dtype": cfg.dtype}
    if n > 1:
        rec["tp"] = [rank, n]
    return fp, rec
