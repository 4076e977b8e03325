"""The LoRA adapters an engine serves, on its device (``lora.py`` reads and checks them).

``capacity`` slots ``S`` of rank ``R``: every adapter is padded to ``R`` and stacked, per (layer,
projection), into ``A`` [S·R, in] and ``B`` [out, S·R] (the scaling folded into ``B``, zeros
where an adapter does not target the projection); projections that read the same input
(``GROUPS``: q/k/v, gate/up) share one ``A`` and one ``B`` tensor.  A step's tokens carry their
adapter's slot (``AttnMeta.lora``: -1 for none), and each group adds ``((x Aᵀ) ⊙ mask) Bᵀ`` to
its outputs, the mask keeping each token's own adapter's ``R`` columns: one cuBLAS matmul, then
on the GPU one ``lora_kernels`` launch for the rest, elsewhere a mask product and an accumulating
matmul a member.  The shapes are the same every step, so a CUDA graph replays them; a decode step
whose tokens have no adapter replays a graph captured without them (``cuda_graphs.py``).

More adapters than slots (one GPU): those in no slot are *parked*, and a step that needs one puts
it in a free slot or in the slot of the least recently used adapter that no running request uses
(``make_resident``), which is parked in its place.  The host keeps the tensors of the
``host_capacity`` adapters used last (vLLM's ``--max-cpu-loras``; None: of every served adapter);
a parked adapter whose tensors it dropped is read again from its files, on a thread of its own
while its requests wait (``ready``), and served only if they are still the tensors it was served
with (its digest; ``lora_host.py``).
The scheduler admits a request only while the adapters of the running ones leave it a slot
(``Scheduler.lora_capacity``), so such a slot always exists.  Slot positions carry no meaning
beyond a step: a step's tokens name their adapter's slot as it is when the step is launched, and
the stacked tensors are written in place on the step's stream, after the steps already enqueued,
so CUDA graphs replay them as they are then (docs/serving.md, "More adapters than --max-loras").

With tensor parallelism each rank holds its cut of every adapter (``lora.shard``), and the other
ranks follow rank 0's adapters loaded while serving (``runtime_table`` / ``follow_table``); there
every served adapter keeps a slot (nothing is parked).
"""
from __future__ import annotations

import json

from .lora import (Adapter, AdapterError, check_host_capacity, full_shapes, projection_shapes, read, shard,
                   targeted_shapes, unparked_because)
from .lora_host import HostCopies

# projections that read the same input, in the order a packed projection (packing.py) stacks them
GROUPS = (("qkv", ("q_proj", "k_proj", "v_proj")), ("o", ("o_proj",)), ("gate_up", ("gate_proj", "up_proj")),
          ("down", ("down_proj",)))


class Adapters:
    """The served adapters on the device, in ``capacity`` slots of rank ``rank``; ``slots``: name
    -> slot.  ``shapes``: (layer, projection) -> (in, out) of every projection an adapter may
    target (all of them when adapters are loaded at run time); ``model``: the same for every
    projection of the model.  Projections that read the same input (``GROUPS``) share one ``A``
    [members·S·R, in] and one ``B`` [their outs, S·R] (each member's rows a view), so that a
    group's terms take one matmul and one accumulating matmul a member (on the GPU: one matmul
    and one ``lora_kernels`` launch).  ``linear``: the batch-invariant matmul of the
    deterministic mode (the terms are then computed by it and added afterwards, so that a row
    does not depend on the batch); None: cuBLAS or ``lora_kernels``."""

    def __init__(self, shapes: dict, capacity: int, rank: int, dtype, device, linear=None,
                 model: dict | None = None, host_capacity: int | None = None, reader=None) -> None:
        import torch
        import torch.nn.functional as F

        from . import lora_kernels
        self.capacity, self.rank = capacity, rank
        self.slots: dict[str, int] = {}                         # the adapters in a slot
        self.served: dict[str, tuple[str, str, bool]] = {}     # name -> (path, digest, loaded while serving)
        # served adapters' tensors on the host: a parked one's only copy unless it was dropped
        # (``host_capacity``), then read again (``reader(name, path)``: as ``lora.read`` gives it)
        self.host = HostCopies(host_capacity, reader, self.served)
        self.stats = {"swaps": 0}              # parked adapters put in a slot
        self.unparked: str | None = None       # why every adapter must keep a slot (None: some may be parked)
        self._used: dict[str, int] = {}        # name -> the last make_resident call that needed it
        self._clock = 0
        self._linear = linear
        self._shrink = linear or F.linear
        model = model or shapes
        kernels = linear is None and lora_kernels.available(device, dtype)
        SR = capacity * rank
        # (layer, group) -> (A, [(member's index in the group, its B)], layout for lora_kernels or None);
        # (layer, proj) -> (group key, its block among the group's stacked members)
        self.groups: dict[tuple, tuple] = {}
        self._where: dict[tuple, tuple] = {}
        for layer in sorted({k[0] for k in shapes}):
            for group, members in GROUPS:
                present = [(j, p) for j, p in enumerate(members) if (layer, p) in shapes]
                if not present:
                    continue
                outs = [shapes[(layer, p)][1] for _, p in present]
                A = torch.zeros(len(present) * SR, shapes[(layer, present[0][1])][0], dtype=dtype, device=device)
                B = torch.zeros(sum(outs), SR, dtype=dtype, device=device)
                Bs, row = [], 0
                for block, ((j, p), o) in enumerate(zip(present, outs)):
                    Bs.append((j, B[row:row + o]))
                    self._where[(layer, p)] = ((layer, group), block)
                    row += o
                lay = None
                if kernels and all((layer, p) in model for p in members):
                    stacked = {j: b for b, (j, _) in enumerate(present)}
                    starts = dict(zip(stacked, [sum(outs[:b]) for b in range(len(outs))]))
                    lay = lora_kernels.layout([model[(layer, p)][1] for p in members],
                                              [stacked.get(j) for j in range(len(members))],
                                              [starts.get(j, 0) for j in range(len(members))], device)
                self.groups[(layer, group)] = (A, Bs, B, lay)
        # each column's slot, for groups of 1, 2 and 3 members (the mask of a step, ``masks``)
        self._columns = {n: torch.arange(n * SR, device=device) // rank % capacity
                         for n in {len(g[1]) for g in self.groups.values()}}
        self.bytes = sum(g[0].numel() * g[0].element_size() + g[2].numel() * g[2].element_size()
                         for g in self.groups.values())

    @property
    def names(self) -> list[str]:
        return list(self.slots)

    @property
    def host_capacity(self) -> int | None:
        return self.host.capacity

    def serve(self, adapter: Adapter, slot: int | None = None, runtime: bool = False) -> int | None:
        """Serve ``adapter``: in a free slot (``slot`` if it is free) if there is one, else parked
        until a step needs it.  Returns its slot, or None (parked)."""
        self._check(adapter)
        if len(self.slots) < self.capacity:
            return self.put(adapter, slot, runtime)
        if self.unparked:
            raise AdapterError(f"LoRA adapter {adapter.name!r}: every one of the {self.capacity} slot(s) holds an "
                               f"adapter ({', '.join(self.slots)}), and {self.unparked}; unload one or raise "
                               "--max-loras")
        self.served[adapter.name] = (adapter.path, adapter.digest, runtime)
        self.host.hold(adapter)
        return None

    def serve_from_disk(self, name: str, path: str, digest: str, runtime: bool = False) -> None:
        """Serve an adapter already read and checked (its ``digest``) without its tensors: parked,
        ``fetch`` reads them from ``path`` when a step needs it.  Only when every slot is taken."""
        if len(self.slots) < self.capacity or self.unparked:
            raise AdapterError(f"LoRA adapter {name!r}: served from disk only when every slot is taken and "
                               "adapters may be parked")
        self.served[name] = (path, digest, runtime)

    @property
    def parked(self) -> list[str]:
        return [n for n in self.served if n not in self.slots]

    def ready(self, name: str) -> bool:
        """Whether a step may take a request on ``name`` without waiting for its files (in a
        slot, its tensors on the host, or their read ended); else its files are being read
        (``lora_host.HostCopies.ready``), and the scheduler holds the request."""
        return name in self.slots or self.host.ready(name)

    def fetch(self, names) -> dict[str, str]:
        """Make sure the tensors of each of ``names`` (served adapters a step uses) in no slot
        are on the host, read again from their files if the host dropped them
        (``lora_host.HostCopies.fetch``).  Returns ``{name: why it cannot be served}``: the step
        must not run their requests."""
        names = list(names)
        return self.host.fetch([n for n in names if n not in self.slots], keep=names)

    def make_resident(self, names, pinned) -> list[str]:
        """Put each of ``names`` (served adapters a step uses) in a slot: a parked one takes a free
        slot, else the slot of the least recently used adapter that is neither in ``names`` nor in
        ``pinned`` (the adapters of running requests), parked in its place.  Returns the adapters
        put in a slot.  Raises ``AdapterError`` when no slot can be freed."""
        self._clock += 1
        for n in names:
            self._used[n] = self._clock
        moved = []
        for n in names:
            if n in self.slots:
                continue
            if len(self.slots) >= self.capacity:
                idle = [m for m in self.slots if m not in pinned and m not in names]
                if not idle:
                    raise AdapterError(f"LoRA adapter {n!r} needs a slot, and the {self.capacity} slot(s) hold "
                                       f"adapters of running requests ({', '.join(self.slots)}): raise --max-loras")
                victim = min(idle, key=lambda m: (self._used.get(m, 0), m))
                self._clear(self.slots.pop(victim))
            if n not in self.host:
                raise AdapterError(f"LoRA adapter {n!r}: its tensors are not on the host (fetch reads them first)")
            self.put(self.host[n], runtime=self.served[n][2], keep=names)
            self.stats["swaps"] += 1
            moved.append(n)
        return moved

    def put(self, adapter: Adapter, slot: int | None = None, runtime: bool = False, keep=()) -> int:
        """Write ``adapter`` into a free slot, ``slot`` if it is free (its rows and columns zeroed
        first); returns the slot.  ``runtime``: loaded while serving (its record says so);
        ``keep``: adapters whose host tensors must stay (``HostCopies.hold``)."""
        free = sorted(set(range(self.capacity)) - set(self.slots.values()))
        if slot in free:
            free.remove(slot)
            free.insert(0, slot)
        if not free:
            raise AdapterError(f"LoRA adapter {adapter.name!r}: every one of the {self.capacity} slot(s) holds an "
                               f"adapter ({', '.join(self.slots)}); unload one or raise --max-loras")
        self._check(adapter)
        i, R = free[0], self.rank
        self._clear(i)
        for key, (a, b) in adapter.tensors.items():
            group, block = self._where[key]
            A, Bs = self.groups[group][:2]
            row = block * self.capacity * R + i * R
            A[row:row + a.shape[0]].copy_(a)
            Bs[block][1][:, i * R:i * R + b.shape[1]].copy_(b)
        self.slots[adapter.name] = i
        self.served[adapter.name] = (adapter.path, adapter.digest, runtime)
        self.host.hold(adapter, keep)
        return i

    def replace(self, adapter: Adapter) -> int | None:
        """Write ``adapter`` over the one served under its name, in its slot (vLLM's
        ``load_inplace``), or in its place among the parked ones; it is checked before anything
        is written.  Returns the slot (None: parked)."""
        self._check(adapter)
        if adapter.name not in self.slots:
            self.served[adapter.name] = (adapter.path, adapter.digest, True)
            self.host.hold(adapter)
            return None
        slot = self.slots.pop(adapter.name)
        del self.served[adapter.name]
        return self.put(adapter, slot, runtime=True)

    def _check(self, adapter: Adapter) -> None:
        if adapter.rank > self.rank:
            raise AdapterError(f"LoRA adapter {adapter.name!r}: rank {adapter.rank} is above --max-lora-rank {self.rank}")
        missing = sorted(set(adapter.tensors) - set(self._where))
        if missing:
            raise AdapterError(f"LoRA adapter {adapter.name!r}: layer {missing[0][0]}'s {missing[0][1]} has no room")

    def remove(self, name: str) -> None:
        if name in self.slots:
            self._clear(self.slots.pop(name))
        del self.served[name]
        self.host.drop(name)
        self._used.pop(name, None)

    def record(self, name: str) -> bytes:
        """``name``'s journal record (``serve/lora/<name>``)."""
        path, digest, runtime = self.served[name]
        return json.dumps({"path": path, "slot": self.slots.get(name, -1), "digest": digest, "runtime": runtime},
                          sort_keys=True).encode()

    def _clear(self, i: int) -> None:
        R, SR = self.rank, self.capacity * self.rank
        for A, Bs, _, _ in self.groups.values():
            for block, (_, B) in enumerate(Bs):
                A[block * SR + i * R:block * SR + (i + 1) * R].zero_()
                B[:, i * R:(i + 1) * R].zero_()

    def masks(self, rows, dtype) -> dict:
        """This step's masks, computed once a forward: members -> [T, members·S·R], 1 where a
        column belongs to the token's adapter (``rows``: slot per token, -1 none); ``"slots"``:
        ``rows`` itself, which ``lora_kernels`` reads instead."""
        out = {n: (rows[:, None] == c[None, :]).to(dtype) for n, c in self._columns.items()}
        out["slots"] = rows
        return out

    def add(self, outs: list, x, layer: int, group: str, masks) -> None:
        """Add to each of ``outs`` (the group's projections of ``x``, in ``GROUPS`` order, [T, out]
        each) the adapters' terms of its tokens, in place.  When ``outs`` are consecutive column
        ranges of one tensor (a packed projection's output) on the GPU, ``lora_kernels`` adds
        them in one launch after the first matmul."""
        from . import lora_kernels
        g = self.groups.get((layer, group))
        if g is None or masks is None:
            return
        A, Bs, B, lay = g
        SR = self.capacity * self.rank
        packed = _packed(outs) if lay is not None else None
        if packed is not None and packed.shape[1] == lay.table.shape[0] * lay.block:
            lora_kernels.expand_(packed, self._shrink(x, A), masks["slots"], B, lay, self.capacity, self.rank)
            return
        t = self._shrink(x, A)
        t.mul_(masks[len(Bs)])
        for block, (j, Bj) in enumerate(Bs):
            tj = t[:, block * SR:(block + 1) * SR]
            if self._linear is None:
                outs[j].addmm_(tj, Bj.t())
            else:
                outs[j].add_(self._linear(tj, Bj))


def _packed(outs: list):
    """The [T, sum of widths] tensor of which ``outs`` are consecutive column ranges, or None."""
    first = outs[0]
    if first.stride(-1) != 1:
        return None
    at = first.data_ptr()
    for o in outs:
        if o.stride() != first.stride() or o.data_ptr() != at or o.shape[0] != first.shape[0]:
            return None
        at += o.shape[1] * o.element_size()
    return first.as_strided((first.shape[0], sum(o.shape[1] for o in outs)), first.stride())


def load(modules, weights: dict, dtype, device, linear, max_rank: int = 16, capacity: int = 0,
         runtime: bool = False, part: tuple[int, int] = (0, 1), full: dict | None = None,
         unparked: str | None = None, host_capacity: int | None = None) -> Adapters | None:
    """``modules``: ``[(name, path)]`` (``parse_modules``) in slots ``0..``, those beyond
    ``capacity`` parked; ``capacity``: the slots (default: as many as adapters); ``runtime``:
    room for adapters loaded later (every projection, rank ``max_rank``); ``linear``: as
    ``Adapters``; ``part``: (rank, ranks) of a tensor-parallel
    group, whose ``weights`` are that rank's shards (``full``: ``full_shapes``, which the adapters
    are checked against before each is cut); ``unparked``: why every adapter must keep a slot
    (``lora.unparked_because``); ``host_capacity``: the adapters whose tensors the host keeps
    (None: all; at least ``capacity``): each adapter is read and checked here, and beyond the
    first ``host_capacity`` only its digest is kept, so the host never holds more.  None when
    there is nothing to serve."""
    if not modules and not runtime:
        return None
    rank, n = part
    capacity = capacity or len(modules)
    if unparked and len(modules) > capacity:
        raise AdapterError(f"{len(modules)} LoRA adapters and {capacity} slot(s): {unparked}; give at most that "
                           "many or raise --max-loras")
    check_host_capacity(host_capacity, capacity)

    def reader(name: str, path: str) -> Adapter:
        return shard(read(name, path, full if n > 1 else weights, max_rank), rank, n)

    adapters, shapes, top = [], {}, 0
    for i, (name, path) in enumerate(modules):
        a = reader(name, path)
        shapes.update(targeted_shapes([a]))
        top = max(top, a.rank)
        adapters.append(a if host_capacity is None or i < host_capacity else (name, path, a.digest))
    model = projection_shapes(weights)
    if runtime:
        shapes, top = model, max_rank
    out = Adapters(shapes, capacity, top, dtype, device, linear, model, host_capacity, reader)
    out.unparked = unparked
    for a in adapters:
        if isinstance(a, Adapter):
            out.serve(a)
        else:
            out.serve_from_disk(*a)
    return out


def load_for(cfg, mc, weights: dict, model, rank: int) -> Adapters | None:
    """What rank ``rank`` of an engine (``EngineConfig`` ``cfg``; rank 0 without tensor
    parallelism) serves: ``load`` of its adapters on ``model``'s device, dtype and matmul."""
    n = cfg.tensor_parallel_size or 1
    return load(cfg.lora, weights, weights["model.embed_tokens.weight"].dtype, model.device,
                model._linear if cfg.deterministic else None, cfg.max_lora_rank, cfg.max_loras, cfg.runtime_lora,
                part=(rank, n), full=full_shapes(mc) if n > 1 else None,
                unparked=unparked_because(n, cfg.deterministic), host_capacity=cfg.max_cpu_loras)


def runtime_table(ads: Adapters | None) -> list:
    """``[[name, path, slot, digest]]`` of the adapters loaded while serving: what rank 0 sends
    the other ranks of a tensor-parallel group after each change (``follow_table``)."""
    if ads is None:
        return []
    return [[n, path, ads.slots.get(n, -1), digest] for n, (path, digest, runtime) in ads.served.items() if runtime]


def follow_table(ads: Adapters | None, table: list, read_one) -> None:
    """A rank > 0: serve the adapters loaded while serving that rank 0's ``table`` names, in its
    slots, and no other (``read_one(name, path)``: this rank's cut of the file).  Raises
    ``AdapterError`` when a file's tensors are not what rank 0 read (their digest): the ranks
    would serve different weights, so the rank stops and the group starts again."""
    if ads is None:
        return
    want = {n: (path, slot, digest) for n, path, slot, digest in table}
    for name, (path, digest, runtime) in list(ads.served.items()):
        if runtime and want.get(name) != (path, ads.slots[name], digest):
            ads.remove(name)
    for name, (path, slot, digest) in want.items():
        if name not in ads.served:
            adapter = read_one(name, path)
            if adapter.digest != digest:
                raise AdapterError(f"LoRA adapter {name!r}: the tensors at {path} are not the ones rank 0 read "
                                   f"(digest {adapter.digest[:12]}, rank 0's {digest[:12]}): changed in between")
            if ads.put(adapter, slot, runtime=True) != slot:       # rank 0's slot was not free here
                raise AdapterError(f"LoRA adapter {name!r}: slot {slot} is not free on this rank "
                                   f"({', '.join(f'{n}: {i}' for n, i in ads.slots.items())})")
