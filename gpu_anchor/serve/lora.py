"""LoRA adapters served beside the base model (vLLM's ``--enable-lora --lora-modules NAME=PATH``).

An adapter is a directory as peft's ``save_pretrained`` writes it: ``adapter_config.json`` and
``adapter_model.safetensors`` (or ``.bin``).  A request names one by its ``model`` field; its
tokens then go through ``W x + (B A x) * scaling`` in every projection the adapter targets, as
peft computes them, and through the base weights elsewhere.  Requests with different adapters
(or none) share a step.

What is served: LoRA (``peft_type`` LORA) on the decoder's ``q/k/v/o_proj`` and
``gate/up/down_proj`` in any subset of layers, any rank (``rank_pattern`` included) up to
``--max-lora-rank``, ``lora_alpha`` and rsLoRA's scaling.  Anything else an adapter holds or
asks for (DoRA, trained biases, ``modules_to_save``, embedding or ``lm_head`` adapters,
``alpha_pattern``) is refused when the server starts, with the field or tensor named: a
server that answered with part of an adapter would be silently wrong.

On the device (``Adapters``): every adapter is padded to the largest rank ``R`` and stacked, per
(layer, projection), into ``A`` [S·R, in] and ``B`` [out, S·R] (the scaling folded into ``B``,
zeros where an adapter does not target the projection); the ``A`` of projections that read the
same input (q/k/v, gate/up) are one tensor.  A step's tokens carry their adapter's slot
(``AttnMeta.lora``: -1 for none); ``masks`` turns it into a 0/1 matrix once per forward, and each
group of targeted projections adds ``((x Aᵀ) ⊙ mask) Bᵀ`` to its outputs: one matmul and one
product a group, then one matmul a projection that also accumulates (vLLM's punica kernels do the
same work in fewer launches).  The shapes are the same every step, so a CUDA graph replays them;
a decode step whose tokens have no adapter replays a graph captured without them
(``cuda_graphs.py``).  The adapters
are read from their files at every engine start (they are megabytes; the base weights stay
anchored), and a request's adapter name is part of its journal record, so a request resumed
after a SIGKILL goes on with its adapter.

What a restart trusts (``record`` / ``parse_records``): each served adapter has a journal record,
``serve/lora/<name>``, with its path, slot, whether it was loaded while serving, and the
BLAKE2b digest of the tensors it serves (``Adapter.digest``).  A new engine loads the ones loaded
while serving again, from their paths, into their slots, before it restores any request; a
request whose adapter is gone, or whose adapter's tensors differ from the digest its KV was
computed with (the files were changed), is dropped by name and recomputed by the frontend,
never continued on KV from other weights.  The digest is also the adapter's name in the prefix
cache (``BlockManager.adapter_tags``): blocks computed under other weights are never found.
"""
from __future__ import annotations

import hashlib
import json
import math
import os
import re
from dataclasses import dataclass

PROJECTIONS = {"q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn", "o_proj": "self_attn",
               "gate_proj": "mlp", "up_proj": "mlp", "down_proj": "mlp"}
# projections that read the same input, in the order a packed projection (packing.py) stacks them
GROUPS = (("qkv", ("q_proj", "k_proj", "v_proj")), ("o", ("o_proj",)), ("gate_up", ("gate_proj", "up_proj")),
          ("down", ("down_proj",)))
_KEY = re.compile(r"^base_model\.model\.model\.layers\.(\d+)\.(self_attn|mlp)\.(\w+)\.lora_([AB])\.weight$")
# adapter_config.json fields that change what the adapter computes, with the value that does not
_PLAIN = {"use_dora": False, "bias": "none", "lora_bias": False, "fan_in_fan_out": False, "modules_to_save": None,
          "alpha_pattern": {}, "layer_replication": None, "trainable_token_indices": None, "use_qalora": False,
          "alora_invocation_tokens": None, "target_parameters": None}


class AdapterError(ValueError):
    """An adapter that cannot be served as it is; the message names the adapter and why."""


def describe_failure(name: str, e: Exception) -> str:
    """What the client is told when loading or unloading ``name`` failed with ``e`` (a check's
    own message; anything else, such as an unreadable file, named with its type)."""
    return str(e) if isinstance(e, ValueError) else f"LoRA adapter {name!r}: {type(e).__name__}: {e}"


@dataclass
class Adapter:
    name: str
    path: str
    rank: int                                  # the largest of its tensors' ranks
    tensors: dict                              # (layer, projection) -> (A [r, in], B [out, r] * scaling)
    digest: str = ""                           # of the tensors as served (``_digest``)


def parse_modules(values: list[str] | None) -> list[tuple[str, str]]:
    """``--lora-modules`` as vLLM takes it: ``NAME=PATH`` or a JSON object with ``name`` and
    ``path`` (``base_model_name`` allowed), each value one adapter; ``[(name, path)]``."""
    out = []
    for v in values or []:
        if v.lstrip().startswith("{"):
            try:
                d = json.loads(v)
            except json.JSONDecodeError as e:
                raise AdapterError(f"--lora-modules {v!r}: not JSON ({e})") from None
            extra = set(d) - {"name", "path", "base_model_name"}
            if extra or not isinstance(d.get("name"), str) or not isinstance(d.get("path"), str):
                raise AdapterError(f"--lora-modules {v!r}: a JSON adapter has a string name and path"
                                   + (f" (unknown: {', '.join(sorted(extra))})" if extra else ""))
            name, path = d["name"], d["path"]
        else:
            name, sep, path = v.partition("=")
            if not sep or not name or not path:
                raise AdapterError(f"--lora-modules {v!r}: give NAME=PATH (or JSON with name and path)")
        if any(name == n for n, _ in out):
            raise AdapterError(f"--lora-modules: the name {name!r} is given twice")
        out.append((name, path))
    return out


def _config(name: str, path: str) -> dict:
    try:
        with open(os.path.join(path, "adapter_config.json")) as f:
            cfg = json.load(f)
    except FileNotFoundError:
        raise AdapterError(f"LoRA adapter {name!r}: no adapter_config.json in {path} (a directory as peft's "
                           "save_pretrained writes it)") from None
    except json.JSONDecodeError as e:
        raise AdapterError(f"LoRA adapter {name!r}: {path}/adapter_config.json is not JSON ({e})") from None
    if cfg.get("peft_type", "LORA") != "LORA":
        raise AdapterError(f"LoRA adapter {name!r}: peft_type {cfg.get('peft_type')!r} is not served (LORA is)")
    for k, plain in _PLAIN.items():
        v = cfg.get(k, plain)
        if (v or None) != (plain or None):          # an empty list or dict is as good as none
            raise AdapterError(f"LoRA adapter {name!r}: {k} = {v!r} is not served (only plain LoRA on the decoder's "
                               f"projections; {k} would change what the adapter computes)")
    return cfg


def _tensors(name: str, path: str) -> dict:
    import torch
    st, pt = os.path.join(path, "adapter_model.safetensors"), os.path.join(path, "adapter_model.bin")
    if os.path.exists(st):
        from safetensors.torch import load_file
        return load_file(st)
    if os.path.exists(pt):
        return torch.load(pt, map_location="cpu", weights_only=True)
    raise AdapterError(f"LoRA adapter {name!r}: neither adapter_model.safetensors nor adapter_model.bin in {path}")


def read(name: str, path: str, weights: dict, max_rank: int) -> Adapter:
    """One adapter, checked against the base model's ``weights`` (``{hf name: tensor}``: every
    targeted projection must exist with the shapes the adapter's tensors multiply)."""
    cfg = _config(name, path)
    pairs: dict = {}
    for key, t in _tensors(name, path).items():
        m = _KEY.match(key)
        if m is None or PROJECTIONS.get(m.group(3)) != m.group(2):
            raise AdapterError(f"LoRA adapter {name!r}: the tensor {key!r} is not served (adapters of the decoder "
                               f"layers' {', '.join(PROJECTIONS)} are)")
        pairs.setdefault((int(m.group(1)), m.group(3)), {})[m.group(4)] = t
    if not pairs:
        raise AdapterError(f"LoRA adapter {name!r}: {path} holds no LoRA tensors")
    tensors, top = {}, 0
    for (layer, proj), ab in sorted(pairs.items()):
        where = f"model.layers.{layer}.{PROJECTIONS[proj]}.{proj}"
        base = weights.get(where + ".weight")
        if set(ab) != {"A", "B"}:
            raise AdapterError(f"LoRA adapter {name!r}: {where} has lora_{''.join(ab)} without its pair")
        a, b = ab["A"], ab["B"]
        if base is None:
            raise AdapterError(f"LoRA adapter {name!r}: the base model has no {where} (another model's adapter?)")
        r = a.shape[0]
        if a.dim() != 2 or b.dim() != 2 or b.shape[1] != r or (b.shape[0], a.shape[1]) != tuple(base.shape):
            raise AdapterError(f"LoRA adapter {name!r}: {where}: lora_A {tuple(a.shape)} and lora_B {tuple(b.shape)} do "
                               f"not fit the base weight {tuple(base.shape)} (another model's adapter?)")
        if r > max_rank:
            raise AdapterError(f"LoRA adapter {name!r}: rank {r} at {where} is above --max-lora-rank {max_rank}")
        alpha = float(cfg.get("lora_alpha", 8))
        scaling = alpha / math.sqrt(r) if cfg.get("use_rslora") else alpha / r
        tensors[(layer, proj)] = (a, b * scaling)
        top = max(top, r)
    return Adapter(name, path, top, tensors, _digest(tensors))


def _digest(tensors: dict) -> str:
    """BLAKE2b-128 of every (layer, projection)'s A and scaled B: their dtypes, shapes and bytes."""
    import torch
    h = hashlib.blake2b(digest_size=16)
    for (layer, proj), pair in sorted(tensors.items()):
        h.update(f"{layer}.{proj}".encode())
        for t in pair:
            t = t.detach().to("cpu").contiguous()
            h.update(f"{t.dtype}{tuple(t.shape)}".encode())
            h.update(t.view(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()


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
                 model: dict | None = None) -> None:
        import torch
        import torch.nn.functional as F

        from . import lora_kernels
        self.capacity, self.rank = capacity, rank
        self.slots: dict[str, int] = {}
        self.served: dict[str, tuple[str, str, bool]] = {}     # name -> (path, digest, loaded while serving)
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

    def put(self, adapter: Adapter, slot: int | None = None, runtime: bool = False) -> int:
        """Write ``adapter`` into a free slot, ``slot`` if it is free (its rows and columns zeroed
        first); returns the slot.  ``runtime``: loaded while serving (its record says so)."""
        free = sorted(set(range(self.capacity)) - set(self.slots.values()))
        if slot in free:
            free.remove(slot)
            free.insert(0, slot)
        if not free:
            raise AdapterError(f"LoRA adapter {adapter.name!r}: every one of the {self.capacity} slot(s) holds an "
                               f"adapter ({', '.join(self.slots)}); unload one or raise --max-loras")
        if adapter.rank > self.rank:
            raise AdapterError(f"LoRA adapter {adapter.name!r}: rank {adapter.rank} is above --max-lora-rank {self.rank}")
        missing = sorted(set(adapter.tensors) - set(self._where))
        if missing:
            raise AdapterError(f"LoRA adapter {adapter.name!r}: layer {missing[0][0]}'s {missing[0][1]} has no room")
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
        return i

    def remove(self, name: str) -> None:
        self._clear(self.slots.pop(name))
        del self.served[name]

    def record(self, name: str) -> bytes:
        """``name``'s journal record (``serve/lora/<name>``)."""
        path, digest, runtime = self.served[name]
        return json.dumps({"path": path, "slot": self.slots[name], "digest": digest, "runtime": runtime},
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


def projection_shapes(weights: dict) -> dict:
    """(layer, projection) -> (in, out) of every decoder projection in ``weights`` ({hf name: tensor})."""
    out = {}
    for name, t in weights.items():
        m = re.match(r"^model\.layers\.(\d+)\.(self_attn|mlp)\.(\w+)\.weight$", name)
        if m and PROJECTIONS.get(m.group(3)) == m.group(2):
            out[(int(m.group(1)), m.group(3))] = (t.shape[1], t.shape[0])
    return out


RUNTIME_ENV = "VLLM_ALLOW_RUNTIME_LORA_UPDATING"      # vLLM's switch for /v1/load_lora_adapter


def parse_records(raw: dict, prefix: str) -> tuple[dict, dict]:
    """The adapter records among journal entries ``raw`` (keys ``prefix + name``): ``({name:
    {path, slot, digest, runtime}}, {name: why its record is damaged})``."""
    out, damaged = {}, {}
    for key, blob in raw.items():
        if not key.startswith(prefix):
            continue
        name = key[len(prefix):]
        try:
            r = json.loads(blob)
            if not (isinstance(r.get("path"), str) and isinstance(r.get("slot"), int)
                    and isinstance(r.get("digest"), str) and isinstance(r.get("runtime"), bool)):
                raise ValueError(f"fields {sorted(r)}")
        except (ValueError, AttributeError) as e:
            damaged[name] = f"has a damaged journal record ({e})"
            continue
        out[name] = r
    return out, damaged


def runtime_updating() -> bool:
    """Whether adapters may be loaded and unloaded while serving (vLLM's environment variable)."""
    return os.environ.get(RUNTIME_ENV, "").strip().lower() in ("1", "true", "yes")


def stacked_numel(shapes: dict, capacity: int, rank: int) -> int:
    """Elements of ``Adapters``' stacked tensors: per (layer, projection), S·R·(in + out)."""
    return sum(capacity * rank * (i + o) for i, o in shapes.values())


def _targeted(adapters: list[Adapter]) -> dict:
    return {k: (ab[0].shape[1], ab[1].shape[0]) for a in adapters for k, ab in a.tensors.items()}


def from_options(args, mc, served_name: str) -> tuple[tuple, int, bool, int]:
    """``--enable-lora --lora-modules --max-loras`` (vLLM's) and ``VLLM_ALLOW_RUNTIME_LORA_UPDATING``:
    ``((name, path), ...)``, the slots, whether adapters are loaded at run time too, and the
    elements their stacked tensors take on the device (``stacked_numel``).  Each adapter is read
    and checked against the model's shapes now, so that a server never starts with an adapter it
    would refuse or serve wrong.  At run time every projection gets ``--max-loras`` slots of
    ``--max-lora-rank`` (an adapter loaded later may target any)."""
    given = getattr(args, "lora_modules", None)
    if not getattr(args, "enable_lora", False):
        if given:
            raise AdapterError("--lora-modules needs --enable-lora (as in vLLM)")
        return (), 0, False, 0
    shapes = full_shapes(mc)
    modules = parse_modules(given)
    runtime = runtime_updating()
    n = args.tensor_parallel_size or 1
    if not modules and not runtime:
        raise AdapterError(f"--enable-lora serves the adapters of --lora-modules, and none is given (or set "
                           f"{RUNTIME_ENV}=True to load them while serving, as in vLLM)")
    most = getattr(args, "max_loras", None)
    capacity = most if most is not None else max(len(modules), 1)
    if len(modules) > capacity:
        raise AdapterError(f"--lora-modules gives {len(modules)} adapters and --max-loras is {most}: every adapter "
                           "is kept on the device here (none is swapped in per batch, as vLLM does beyond "
                           "--max-loras), so give at most that many or raise it")
    if any(name == served_name for name, _ in modules):
        raise AdapterError(f"--lora-modules: {served_name!r} is the base model's served name; name the adapter "
                           "otherwise")
    adapters = [read(n, p, shapes, args.max_lora_rank) for n, p in modules]
    if runtime:
        numel = stacked_numel(shard_shapes(projection_shapes(shapes), n), capacity, args.max_lora_rank)
    else:
        numel = stacked_numel(shard_shapes(_targeted(adapters), n), capacity, max(a.rank for a in adapters))
    return tuple(modules), capacity, runtime, numel


def full_shapes(mc) -> dict:
    """{hf name: a meta tensor of the whole parameter's shape}: what ``read`` checks an adapter
    against when the bound weights are one rank's shards."""
    import torch

    from .model_runner import param_specs
    return {n: torch.empty(shape, device="meta") for n, shape, _ in param_specs(mc, torch.float32)}


def shard(adapter: Adapter, rank: int, n: int) -> Adapter:
    """Rank ``rank``'s part of ``adapter`` under ``n``-way tensor parallelism, cut as the base
    weight is (``shards.py``): a column-parallel projection's ``B`` by output rows, a
    row-parallel one's ``A`` by input columns (its partial terms then join the partial output
    before the all-reduce: the sum is linear in them).  The digest stays the whole adapter's."""
    from . import shards
    if n == 1:
        return adapter
    out = {}
    for (layer, proj), (a, b) in adapter.tensors.items():
        name = f"model.layers.{layer}.{PROJECTIONS[proj]}.{proj}.weight"
        dim, lo, hi = shards.split(name, (b.shape[0], a.shape[1]), 0, rank, n)
        out[(layer, proj)] = (a, b[lo:hi].contiguous()) if dim == 0 else (a[:, lo:hi].contiguous(), b)
    return Adapter(adapter.name, adapter.path, adapter.rank, out, adapter.digest)


def shard_shapes(shapes: dict, n: int) -> dict:
    """``shapes`` ((layer, projection) -> (in, out)) as one rank of ``n`` holds them (``shard``)."""
    from . import shards
    return {(layer, p): ((i, o // n) if p in shards.COLUMN else (i // n, o)) for (layer, p), (i, o) in shapes.items()}


def load(modules, weights: dict, dtype, device, linear, max_rank: int = 16, capacity: int = 0,
         runtime: bool = False, part: tuple[int, int] = (0, 1), full: dict | None = None) -> Adapters | None:
    """``modules``: ``[(name, path)]`` (``parse_modules``) in slots ``0..``; ``capacity``: the slots
    (default: as many as adapters); ``runtime``: room for adapters loaded later (every projection,
    rank ``max_rank``); ``linear``: as ``Adapters``; ``part``: (rank, ranks) of a tensor-parallel
    group, whose ``weights`` are that rank's shards (``full``: ``full_shapes``, which the adapters
    are checked against before each is cut).  None when there is nothing to serve."""
    if not modules and not runtime:
        return None
    rank, n = part
    adapters = [shard(read(name, p, full if n > 1 else weights, max_rank), rank, n) for name, p in modules]
    capacity = capacity or len(adapters)
    model = projection_shapes(weights)
    if runtime:
        out = Adapters(model, capacity, max_rank, dtype, device, linear, model)
    else:
        out = Adapters(_targeted(adapters), capacity, max(a.rank for a in adapters), dtype, device, linear, model)
    for a in adapters:
        out.put(a)
    return out


def load_for(cfg, mc, weights: dict, model, rank: int) -> Adapters | None:
    """What rank ``rank`` of an engine (``EngineConfig`` ``cfg``; rank 0 without tensor
    parallelism) serves: ``load`` of its adapters on ``model``'s device, dtype and matmul."""
    n = cfg.tensor_parallel_size or 1
    return load(cfg.lora, weights, weights["model.embed_tokens.weight"].dtype, model.device,
                model._linear if cfg.deterministic else None, cfg.max_lora_rank, cfg.max_loras, cfg.runtime_lora,
                part=(rank, n), full=full_shapes(mc) if n > 1 else None)


def read_for(cfg, mc, weights: dict, name: str, path: str, rank: int) -> Adapter:
    """``read`` for rank ``rank`` of an engine: checked against the whole model, then its cut."""
    n = cfg.tensor_parallel_size or 1
    return shard(read(name, path, full_shapes(mc) if n > 1 else weights, cfg.max_lora_rank), rank, n)


def runtime_table(ads: Adapters | None) -> list:
    """``[[name, path, slot, digest]]`` of the adapters loaded while serving: what rank 0 sends
    the other ranks of a tensor-parallel group after each change (``follow_table``)."""
    if ads is None:
        return []
    return [[n, path, ads.slots[n], digest] for n, (path, digest, runtime) in ads.served.items() if runtime]


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
            ads.put(adapter, slot, runtime=True)
