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

How the served adapters are stacked on the device and computed: ``lora_slots.py``.  They are read
from their files at every engine start (they are megabytes; the base weights stay anchored), and
a request's adapter name is part of its journal record, so a request resumed after a SIGKILL goes
on with its adapter.

What a restart trusts (``Adapters.record`` / ``parse_records``): each served adapter has a journal record,
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


def _digest(tensors: dict, chunk: int = 8 << 20) -> str:
    """BLAKE2b-128 of every (layer, projection)'s A and scaled B: their dtypes, shapes and bytes.

    The bytes are hashed ``chunk`` at a time (concatenated), not tensor by tensor: hashing
    releases the GIL, and a reading thread (``lora_host.py``) that released and took it back
    some 500 times an adapter slowed the thread beside it (an 8B model's rank-16 adapter, the
    2-core development machine: a Python loop took 1.06 to 1.22 ms a pass during the read
    against 0.71 alone; 0.71 to 0.77 with the chunks).  The digest is the same."""
    import torch
    h = hashlib.blake2b(digest_size=16)
    parts, size = [], 0

    def text(s: str):
        return torch.frombuffer(bytearray(s.encode()), dtype=torch.uint8)
    for (layer, proj), pair in sorted(tensors.items()):
        parts.append(text(f"{layer}.{proj}"))
        for t in pair:
            t = t.detach().to("cpu").contiguous()
            parts.append(text(f"{t.dtype}{tuple(t.shape)}"))
            if t.numel():
                parts.append(t.view(-1).view(torch.uint8))
                size += t.numel() * t.element_size()
        if size >= chunk:
            h.update(torch.cat(parts).numpy())
            parts, size = [], 0
    if parts:
        h.update(torch.cat(parts).numpy())
    return h.hexdigest()


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


def unparked_because(tensor_parallel_size: int, deterministic: bool) -> str | None:
    """Why every served adapter must keep a slot here (None: more than ``--max-loras`` may be
    served, the others parked on the host: ``lora_slots``)."""
    if (tensor_parallel_size or 1) > 1:
        return "with --tensor-parallel-size every adapter keeps a slot (the ranks' slot tables must match)"
    if deterministic:
        return ("with --deterministic every adapter keeps a slot (the batch-invariant matmul sums over every "
                "slot's columns, so an adapter's bits could change with its slot)")
    return None


def runtime_updating() -> bool:
    """Whether adapters may be loaded and unloaded while serving (vLLM's environment variable)."""
    return os.environ.get(RUNTIME_ENV, "").strip().lower() in ("1", "true", "yes")


def stacked_numel(shapes: dict, capacity: int, rank: int) -> int:
    """Elements of ``Adapters``' stacked tensors: per (layer, projection), S·R·(in + out)."""
    return sum(capacity * rank * (i + o) for i, o in shapes.values())


def targeted_shapes(adapters: list[Adapter]) -> dict:
    """(layer, projection) -> (in, out) of every projection one of ``adapters`` targets."""
    return {k: (ab[0].shape[1], ab[1].shape[0]) for a in adapters for k, ab in a.tensors.items()}


def from_options(args, mc, served_name: str) -> tuple[tuple, int, bool, int]:
    """``--enable-lora --lora-modules --max-loras`` (vLLM's) and ``VLLM_ALLOW_RUNTIME_LORA_UPDATING``:
    ``((name, path), ...)``, the slots, whether adapters are loaded at run time too, and the
    elements their stacked tensors take on the device (``stacked_numel``).  Each adapter is read
    and checked against the model's shapes now, so that a server never starts with an adapter it
    would refuse or serve wrong.  At run time every projection gets ``--max-loras`` slots of
    ``--max-lora-rank`` (an adapter loaded later may target any).  On one GPU more adapters than
    ``--max-loras`` may be given: the others wait on the host for a free slot (``lora_slots``);
    ``--max-cpu-loras`` (vLLM's, at least ``--max-loras``) bounds the adapters whose tensors the
    host keeps, the others being read again from their files when a request needs them."""
    given = getattr(args, "lora_modules", None)
    if not getattr(args, "enable_lora", False):
        if given:
            raise AdapterError("--lora-modules needs --enable-lora (as in vLLM)")
        return (), 0, False, 0
    shapes = full_shapes(mc)
    modules = parse_modules(given)
    runtime = runtime_updating()
    ranks = args.tensor_parallel_size or 1
    if not modules and not runtime:
        raise AdapterError(f"--enable-lora serves the adapters of --lora-modules, and none is given (or set "
                           f"{RUNTIME_ENV}=True to load them while serving, as in vLLM)")
    most = getattr(args, "max_loras", None)
    capacity = most if most is not None else max(len(modules), 1)
    why = unparked_because(ranks, getattr(args, "deterministic", False))
    if len(modules) > capacity and why:
        raise AdapterError(f"--lora-modules gives {len(modules)} adapters and --max-loras is {most}: {why}, so give "
                           "at most that many or raise it")
    if any(name == served_name for name, _ in modules):
        raise AdapterError(f"--lora-modules: {served_name!r} is the base model's served name; name the adapter "
                           "otherwise")
    check_host_capacity(getattr(args, "max_cpu_loras", None), capacity)
    targeted, top = {}, 0
    for n, p in modules:              # one at a time: only their shapes are kept
        a = read(n, p, shapes, args.max_lora_rank)
        targeted.update(targeted_shapes([a]))
        top = max(top, a.rank)
    if runtime:
        numel = stacked_numel(shard_shapes(projection_shapes(shapes), ranks), capacity, args.max_lora_rank)
    else:
        numel = stacked_numel(shard_shapes(targeted, ranks), capacity, top)
    return tuple(modules), capacity, runtime, numel


def check_host_capacity(host: int | None, capacity: int) -> None:
    """``--max-cpu-loras`` (None: unbounded) against the slots, as vLLM checks it."""
    if host is not None and host < capacity:
        raise AdapterError(f"--max-cpu-loras ({host}) must be at least --max-loras ({capacity}), as in vLLM: the "
                           "host keeps at least the adapters of the slots")


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


def read_for(cfg, mc, weights: dict, name: str, path: str, rank: int) -> Adapter:
    """``read`` for rank ``rank`` of an engine: checked against the whole model, then its cut."""
    n = cfg.tensor_parallel_size or 1
    return shard(read(name, path, full_shapes(mc) if n > 1 else weights, cfg.max_lora_rank), rank, n)
