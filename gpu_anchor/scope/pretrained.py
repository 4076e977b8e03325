"""``from_pretrained`` inside a scope: a restart whose weights are all anchored reads no weight file.

First run: transformers loads as usual (its thread pool makes native tensors, which the
scope adopts at exit).  At exit the scope records, in the namespace's journal, a *load
hint* for each model ``from_pretrained`` returned in the block: for every state-dict key,
the anchored object's name, shape, dtype and device.  The hint's key is a hash of the
class, the resolved path and the keyword arguments that shape the weights.

Restart (same class, path and arguments): one ``lookup`` round trip per device; if every
object is there with its shape and dtype, the model is built by transformers from a state
dict of the anchored tensors (``from_pretrained(None, config=..., state_dict=...)``, the
documented no-file path), with the device map the hint recorded, and the generation
config read from the directory as usual.  No weight file is opened, nothing is copied,
and the adopted objects are reported *matched*.  Anything else (no hint, a missing object,
a model whose state dict does not come out as the anchored tensors) falls back to the
ordinary load, which the scope adopts as on a first run: slower, never wrong.
"""
from __future__ import annotations

import hashlib
import json
import os

import torch

HINT_KEY = "scope/pretrained/"
_UNHASHED = {"output_loading_info", "local_files_only", "cache_dir", "token", "proxies", "force_download",
             "trust_remote_code", "use_safetensors", "low_cpu_mem_usage", "attn_implementation"}


def _simple(v):
    if isinstance(v, (str, int, float, bool, type(None))):
        return v
    if isinstance(v, (torch.dtype, torch.device)):
        return str(v)
    if isinstance(v, dict):
        return {str(k): _simple(x) for k, x in sorted(v.items(), key=lambda kv: str(kv[0]))}
    if isinstance(v, (list, tuple)):
        return [_simple(x) for x in v]
    to_dict = getattr(v, "to_dict", None)        # a config object: its content shapes the weights
    return _simple(to_dict()) if callable(to_dict) else type(v).__name__


def load_key(cls, path, kwargs: dict) -> str | None:
    if path is None or kwargs.get("state_dict") is not None or kwargs.get("gguf_file"):
        return None
    path = os.path.abspath(path) if os.path.isdir(path) else str(path)
    if os.path.isfile(os.path.join(path, "adapter_config.json")):
        return None                                 # peft adapter directories load a base model too
    args = {k: _simple(v) for k, v in kwargs.items() if k not in _UNHASHED}
    blob = json.dumps([cls.__module__, cls.__qualname__, path, args], sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:32]


def record(scope, key: str, model) -> None:
    """After the bind: journal the hint for ``model`` (only if every state-dict tensor is a
    whole anchored object, so that the restart can hand exactly those tensors back)."""
    from gpu_anchor.client.client import anchored_name
    hint, devices = {}, set()
    for k, t in model.state_dict(keep_vars=True).items():
        named = anchored_name(t) if t.device.type in ("cpu", "cuda") else None
        if named is None or t.storage_offset() != 0 or not t.is_contiguous():
            return
        dev = "cpu" if t.device.type == "cpu" else f"cuda:{t.device.index}"
        hint[k] = [named[1], list(t.shape), str(t.dtype).removeprefix("torch."), dev]
        devices.add(dev)
    blob = json.dumps(hint, sort_keys=True).encode()
    for dev in sorted(devices):
        client = scope._client(dev)
        if client is not None:
            client.journal.put(HINT_KEY + key, blob)


def resident(scope, key: str, device_hint) -> dict | None:
    """``{state-dict key: anchored tensor}`` if the hint exists and every object matches."""
    from gpu_anchor.scope.interception import suspended
    candidates = [device_hint] if isinstance(device_hint, str) and device_hint != "auto" else []
    if torch.cuda.is_available():
        candidates.append(f"cuda:{torch.cuda.current_device()}")
    candidates.append("cpu")
    hint = None
    for dev in dict.fromkeys(d if d != "cuda" else "cuda:0" for d in candidates):
        try:
            client = scope._client(dev) if scope._is_anchored(dev) else None
        except Exception:
            client = None
        if client is not None:
            blob = client.journal.get(HINT_KEY + key)
            if blob:
                hint = json.loads(blob)
                break
    if not hint:
        return None
    by_dev: dict[str, list] = {}
    for k, (name, shape, dtype, dev) in hint.items():
        by_dev.setdefault(dev, []).append((k, name, shape, getattr(torch, dtype)))
    out = {}
    with suspended():
        for dev, items in by_dev.items():
            if not scope._is_anchored(dev):
                return None
            found = scope._client(dev).bind([(n, s, d) for _, n, s, d in items], "lookup")
            if any(b.status != "matched" for b in found):
                return None
            out.update({k: b.tensor for (k, *_), b in zip(items, found)})
    return {"tensors": out, "devices": sorted(by_dev)}


def _fast_load(cls, orig, path, args, kwargs, found):
    from transformers import AutoConfig, GenerationConfig
    kw = dict(kwargs)
    config = kw.pop("config", None)
    if config is None or isinstance(config, (str, os.PathLike)):
        config = AutoConfig.from_pretrained(config or path, trust_remote_code=kw.get("trust_remote_code", False))
    if kw.get("generation_config") is None:
        try:
            kw["generation_config"] = GenerationConfig.from_pretrained(path)
        except (OSError, ValueError):
            pass
    devs = found["devices"]
    if kw.get("device_map") is not None:
        kw["device_map"] = {"": devs[0]} if len(devs) == 1 else kw["device_map"]
    for k in ("revision", "subfolder", "variant", "use_safetensors", "cache_dir", "local_files_only", "token",
              "force_download", "proxies"):
        kw.pop(k, None)
    return orig(cls, None, *args, config=config, state_dict=found["tensors"], **kw)


def _from_pretrained(orig_cm):
    orig = orig_cm.__func__

    def from_pretrained(cls, pretrained_model_name_or_path=None, *args, **kwargs):
        from gpu_anchor.scope.scope import current
        scope = current()
        key = load_key(cls, pretrained_model_name_or_path, kwargs) if scope is not None and not args else None
        if key is None or kwargs.get("output_loading_info"):
            return orig(cls, pretrained_model_name_or_path, *args, **kwargs)
        found = resident(scope, key, kwargs.get("device_map"))
        if found is not None and kwargs.get("device_map") is None and found["devices"] != ["cpu"]:
            found = None     # the call returns a host model (moved later, by the program): load it as asked
        model = None
        if found is not None:
            model = _fast_load(cls, orig, pretrained_model_name_or_path, args, kwargs, found)
            sd = model.state_dict(keep_vars=True)
            if any(k not in sd or sd[k].data_ptr() != t.data_ptr() for k, t in found["tensors"].items()):
                model = None                        # transformers copied or dropped a tensor: load normally
            else:
                scope.report.resident_loads += 1
        if model is None:
            model = orig(cls, pretrained_model_name_or_path, *args, **kwargs)
        scope._pretrained.append((key, model))
        return model

    return classmethod(from_pretrained)


def hook_targets():
    from transformers import PreTrainedModel
    return [(PreTrainedModel, "from_pretrained", _from_pretrained)]
