"""``from_pretrained`` inside a scope: a restart whose weights are all anchored reads no weight file.

First run: transformers loads as usual (its thread pool makes native tensors, which the
scope adopts at exit).  At exit the scope records, in the namespace's journal, a *load
hint* for each model ``from_pretrained`` returned in the block: for every parameter and
buffer, the anchored object's name, shape, dtype and device.  The hint's key is a hash of
the class, the resolved path and the keyword arguments that shape the weights.

Restart (same class, path and arguments): one ``lookup`` round trip per device; if every
object is there with its shape and dtype, the model is built on the meta device from its
config (``cls._from_config``: no weight touched, no loader run) and every parameter and
buffer is set to its anchored tensor (tied weights stay one ``Parameter``); then what
``from_pretrained`` does after loading: ``eval()``, the directory's generation config,
``hf_device_map``.  No weight file is opened and nothing is copied.  Anything else (no
hint, a missing object, a module the hint does not cover, an error while building) falls
back to the ordinary load, which the scope adopts as on a first run: slower, never wrong.
"""
from __future__ import annotations

import contextlib
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


def tensors(model):
    """Every parameter and buffer (non-persistent ones too), with duplicates: ``(dotted, tensor, kind)``."""
    for n, p in model.named_parameters(remove_duplicate=False):
        yield n, p, "p"
    for n, b in model.named_buffers(remove_duplicate=False):
        yield n, b, "b"


def record(scope, key: str, model) -> None:
    """After the bind: journal the hint for ``model`` (only if every parameter and buffer is a
    whole anchored object, so that a restart can hand exactly those tensors back)."""
    from gpu_anchor.client.client import anchored_name
    hint, devices = {}, set()
    for k, t, kind in tensors(model):
        named = anchored_name(t) if t.device.type in ("cpu", "cuda") else None
        if named is None or t.storage_offset() != 0 or not t.is_contiguous():
            return
        dev = "cpu" if t.device.type == "cpu" else f"cuda:{t.device.index}"
        hint[k] = [named[1], list(t.shape), str(t.dtype).removeprefix("torch."), dev, kind,
                   bool(t.requires_grad)]
        devices.add(dev)
    blob = json.dumps(hint, sort_keys=True).encode()
    for dev in sorted(devices):
        client = scope._client(dev)
        if client is not None:
            client.journal.put(HINT_KEY + key, blob)


def resident(scope, key: str, device_hint) -> dict | None:
    """The hint and its anchored tensors (by object name) if every object matches, else None."""
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
    by_dev: dict[str, dict] = {}
    for name, shape, dtype, dev, *_ in hint.values():
        by_dev.setdefault(dev, {})[name] = (shape, getattr(torch, dtype))
    objects = {}
    with suspended():
        for dev, wanted in by_dev.items():
            if not scope._is_anchored(dev):
                return None
            names = sorted(wanted)
            found = scope._client(dev).bind([(n, *wanted[n]) for n in names], "lookup")
            if any(b.status != "matched" for b in found):
                return None
            objects.update({n: b.tensor for n, b in zip(names, found)})
    return {"hint": hint, "objects": objects, "devices": sorted(by_dev)}


@contextlib.contextmanager
def _without_modes():
    """No torch-function or dispatch mode (the scope's, or any other) around a build that makes
    meta tensors only: each op through two Python modes cost ~20 µs, thousands per model."""
    from torch.overrides import _pop_mode, _push_mode
    from torch.utils._python_dispatch import _disable_current_modes
    popped = []
    try:
        while torch._C._len_torch_function_stack():
            popped.append(_pop_mode())
        with _disable_current_modes():
            yield
    finally:
        for m in reversed(popped):
            _push_mode(m)


def _no_init_weights():
    try:                                               # transformers >= 5
        from transformers.initialization import no_init_weights
    except ImportError:
        try:
            from transformers.modeling_utils import no_init_weights
        except ImportError:
            return contextlib.nullcontext()
    return no_init_weights()


def _build(cls, path, kwargs, found):
    """The model from its config on the meta device, every parameter and buffer set to its
    anchored tensor; None if the hint does not cover the module exactly."""
    from transformers import AutoConfig, GenerationConfig

    from gpu_anchor.scope.interception import suspended
    config = kwargs.get("config")
    if config is None or isinstance(config, (str, os.PathLike)):
        config = AutoConfig.from_pretrained(config or path, trust_remote_code=kwargs.get("trust_remote_code", False))
    hint, objects = found["hint"], found["objects"]
    dtypes = {v[2] for v in hint.values() if v[4] == "p"}
    dtype = getattr(torch, dtypes.pop()) if len(dtypes) == 1 else None
    # every tensor is replaced by its anchored one below: skip the initialisation and keep the
    # scope's modes out of a meta-only build (on an 8B model these were most of the restart)
    with suspended(), _without_modes(), _no_init_weights(), torch.device("meta"):
        model = cls._from_config(config, **({"dtype": dtype} if dtype is not None else {}))
    params: dict[str, torch.nn.Parameter] = {}
    for dotted, t, kind in list(tensors(model)):
        h = hint.get(dotted)
        if h is None or h[4] != kind or list(t.shape) != h[1]:
            return None
        mod_path, _, leaf = dotted.rpartition(".")
        mod = model.get_submodule(mod_path)
        real = objects[h[0]]
        if kind == "p":
            p = params.get(h[0])
            if p is None:
                p = params[h[0]] = torch.nn.Parameter(real, requires_grad=h[5])
            mod._parameters[leaf] = p
        else:
            mod._buffers[leaf] = real
    if any(t.device.type == "meta" for _, t, _ in tensors(model)):
        return None
    model.eval()
    if kwargs.get("device_map") is not None:
        model.hf_device_map = {"": found["devices"][0]} if len(found["devices"]) == 1 else kwargs["device_map"]
    if model.can_generate():
        gen = kwargs.get("generation_config")
        try:
            model.generation_config = gen if gen is not None else GenerationConfig.from_pretrained(path)
        except (OSError, ValueError):
            pass
    return model


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
            try:
                model = _build(cls, pretrained_model_name_or_path, kwargs, found)
            except Exception as e:   # a model class this path cannot build: the ordinary load is right
                import logging
                logging.getLogger("gpu_anchor.scope").info("from_pretrained from anchored memory failed (%s); "
                                                           "loading the files", e)
                model = None
            if model is not None:
                scope.report.resident_loads += 1
        if model is None:
            model = orig(cls, pretrained_model_name_or_path, *args, **kwargs)
        scope._pretrained.append((key, model))
        return model

    return classmethod(from_pretrained)


def hook_targets():
    from transformers import PreTrainedModel
    return [(PreTrainedModel, "from_pretrained", _from_pretrained)]
