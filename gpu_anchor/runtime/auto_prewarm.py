"""The automatic pre-warm: what a training job trains, recorded in its worker, replayed by a standby.

A restarted worker's first step meets every kernel, cuBLAS heuristic and allocator block for the
first time.  One step of a 1-layer copy of the model with the job's widths, batch and sequence
length, run by the standby before any failure, loads nearly all of them (``--prewarm`` lets a job
name such a function by hand).  This module does it without user code for the common case: a
transformers ``PreTrainedModel`` trained with a torch optimizer (plain, or wrapped in
``AnchoredOptimizer``, which fires torch's optimizer-step hooks for its inner optimizer).

In the worker, ``Recorder`` (installed by the worker bootstrap when the supervisor asks):

- a global module forward pre-hook finds the first transformers model called (the top-level
  one; a DDP / ``torch.compile`` wrapper is looked through), removes itself and puts a forward
  hook on that model, which records its config, parameter dtype, device, the batch shape (from
  the logits, else the first positional input), whether the forward computed a loss, gradient
  checkpointing and autocast, then removes itself;
- a global optimizer-step post-hook records the optimizer's class and the options that choose
  its kernels (foreach / fused / ...);
- after the first optimizer step (or the second committed step: a loop with its own update) it
  emits one JSON "recipe" — or ``{"skip": reason}`` when there is nothing to replay — and removes every hook.

In the standby, ``run_auto_prewarm(recipe, device)`` builds the 1-layer copy, checks the
memory it needs against what is free (``decide``), runs one forward/backward/optimizer step on
scratch tensors, frees it, and reports what it did or why it did not.  It never raises: the
standby stays a plain warm standby.  It touches no anchored state and writes no file; torch's
RNG state and default dtype are restored (the standby becomes the job's worker afterwards).

Torch-free at import.
"""
from __future__ import annotations

import contextlib
import inspect
import json
import sys
import time

RECIPE_ENV = "GPU_ANCHOR_WARM_RECIPE"   # "1": the worker records its recipe (set by the supervisor)
MAX_RECIPE_BYTES = 48 * 1024            # travels in one datagram to the supervisor
HEADROOM = 2.0                          # run only when free memory >= HEADROOM x the estimated peak
# optimizer options that choose the update's kernels (the rest are numbers the kernels take)
_OPTIMIZER_OPTIONS = ("lr", "betas", "eps", "weight_decay", "momentum", "amsgrad", "maximize", "foreach", "fused",
                      "capturable", "differentiable", "nesterov", "decoupled_weight_decay")


# ---------------------------------------------------------------------------------- recording
def _transformers_model(module):
    """The transformers ``PreTrainedModel`` behind ``module`` (itself or ``torch.compile``'s
    wrapper of one), else None."""
    m = getattr(module, "_orig_mod", module)
    for cls in type(m).__mro__:
        if cls.__name__ == "PreTrainedModel" and cls.__module__.startswith("transformers."):
            return m
    return None


def _model_class(model) -> str:
    """``module:qualname`` of the model's transformers class (a wrapper's dynamic subclass, e.g.
    FSDP2's, is skipped)."""
    for cls in type(model).__mro__:
        if cls.__module__.startswith("transformers."):
            return f"{cls.__module__}:{cls.__qualname__}"
    raise TypeError(f"{type(model).__name__} is not a transformers class")


def _outputs(output) -> list:
    if isinstance(output, dict):     # transformers' ModelOutput is an OrderedDict
        return list(output.values())
    return list(output) if isinstance(output, (tuple, list)) else [output]


def _autocast_dtype(device_type: str):
    import torch
    try:
        if torch.is_autocast_enabled(device_type):
            return str(torch.get_autocast_dtype(device_type)).removeprefix("torch.")
    except (TypeError, RuntimeError):
        pass
    return None


def _checkpointing(model) -> bool:
    # transformers 5 renamed is_gradient_checkpointing (deprecated, warns) to is_activation_checkpointing
    name = "is_activation_checkpointing" if hasattr(type(model), "is_activation_checkpointing") else \
        "is_gradient_checkpointing"
    return bool(getattr(model, name, False))


class Recorder:
    """Records a job's warm-up recipe once and hands it to ``emit(dict)`` (see the module
    docstring).  Also told of committed steps (``step_committed``, by the supervisor's
    ``launch.boundary.STEPS``): the second one ends recording when no torch optimizer step was
    seen (a loop with its own update)."""

    def __init__(self, emit) -> None:
        self.emit = emit
        self.model: dict | None = None
        self.optimizer: dict | None = None
        self.done = False
        self._commits = 0
        self._handles: list = []
        # a hook ran inside a graph torch.compile traced: that graph's guards now include the
        # hooks, and removing one would recompile it, so they all stay (no-ops once done)
        self._traced = False
        self._watching = False

    def install(self) -> "Recorder":
        import torch
        from torch.optim.optimizer import register_optimizer_step_post_hook
        self._handles = [torch.nn.modules.module.register_module_forward_pre_hook(
                             lambda m, a: self._guard(self._module_pre, m, a)),
                         register_optimizer_step_post_hook(lambda o, a, k: self._guard(self._record_optimizer, o))]
        return self

    def remove(self) -> None:
        for h in self._handles:
            if not self._traced:
                h.remove()
        self._handles = []

    def _guard(self, fn, *args) -> None:
        """A hook must never break the job: a failure ends recording with its reason."""
        import torch
        if torch.compiler.is_compiling():
            self._traced = True
            return
        if self.done:
            return
        try:
            fn(*args)
        except Exception as e:  # noqa: BLE001  (reported in the recipe, never raised into training)
            self._finish(f"recording failed: {type(e).__name__}: {e}")

    def _module_pre(self, module, args) -> None:
        model = _transformers_model(module)
        if model is None or self._watching:
            return
        self._watching = True
        if not self._traced:
            self._handles[0].remove()      # the first transformers model called is the top-level one
        self._handles.append(module.register_forward_hook(lambda m, a, out: self._guard(self._model_post, m, a, out)))

    def _model_post(self, module, args, output) -> None:
        import torch
        h = self._handles.pop()
        if not self._traced:
            h.remove()
        model = _transformers_model(module)
        cfg = model.config.to_dict()
        vocab = cfg.get("vocab_size")
        p = next(model.parameters())
        outs = [t for t in _outputs(output) if torch.is_tensor(t)]
        logits = next((t for t in outs if t.dim() == 3 and t.shape[-1] == vocab), None)
        first = args[0] if args and torch.is_tensor(args[0]) and args[0].dim() == 2 else None
        shape = logits.shape[:2] if logits is not None else (first.shape if first is not None else None)
        if shape is None:
            raise ValueError("no (batch, sequence) shape in the model's output or inputs")
        self.model = {"class": _model_class(model), "config": cfg, "dtype": str(p.dtype).removeprefix("torch."),
                      "device": str(p.device), "batch": [int(shape[0]), int(shape[1])],
                      "loss": any(t.dim() == 0 for t in outs),
                      "attn_implementation": getattr(model.config, "_attn_implementation", None),
                      "gradient_checkpointing": _checkpointing(model),
                      "autocast": _autocast_dtype(p.device.type)}

    def _record_optimizer(self, opt) -> None:
        cls = type(opt)
        opts = {}
        for k in _OPTIMIZER_OPTIONS:
            v = opt.defaults.get(k)
            if isinstance(v, tuple):
                v = list(v)
            if k in opt.defaults and (v is None or isinstance(v, (bool, int, float, str, list))):
                opts[k] = v
        self.optimizer = {"class": f"{cls.__module__}:{cls.__qualname__}", "options": opts}
        self._finish()

    def step_committed(self, step: int, clients) -> None:
        # AnchoredOptimizer commits a step before it runs torch's step hooks: the optimizer is
        # recorded by then at the second commit, if it ever will be
        if self._commits:
            self._guard(self._finish)
        self._commits += 1

    def _finish(self, problem: str | None = None) -> None:
        if self.done:
            return
        self.done = True
        self.remove()
        if problem is None and self.model is None:
            problem = ("the model runs inside a torch.compile graph, where the recorder does not look (a "
                       "--prewarm function can warm it)" if self._traced else
                       "no transformers model (PreTrainedModel) ran a forward before the first step")
        out = {"skip": problem} if problem else {"recipe": {"model": self.model, "optimizer": self.optimizer}}
        size = len(json.dumps(out, default=str))
        if size > MAX_RECIPE_BYTES:
            out = {"skip": f"the recipe is {size} bytes, over {MAX_RECIPE_BYTES}"}
        self.emit(json.loads(json.dumps(out, default=str)))


# ---------------------------------------------------------------------------------- the decision
_ITEMSIZE = {"float64": 8, "float32": 4, "bfloat16": 2, "float16": 2}


def estimate_peak_bytes(recipe: dict, n_params: int) -> int:
    """The pre-warm's peak memory, from the recipe and the 1-layer copy's parameter count
    (generous, not exact): weights, gradients, two optimizer moments and a foreach temporary
    of the same size; the logits (batch x seq x vocab) in the model's dtype plus a float32 copy
    for the loss and its float32 gradient; one decoder layer's activations (SDPA: no seq x seq
    matrix), taken as batch x seq x (16 x hidden + 4 x intermediate) elements."""
    m = recipe["model"]
    c = m["config"]
    b, s = m["batch"]
    w = _ITEMSIZE.get(m.get("autocast") or m["dtype"], 4)
    pw = _ITEMSIZE.get(m["dtype"], 4)
    hidden = int(c["hidden_size"])
    inter = int(c.get("intermediate_size") or 4 * hidden)
    state = n_params * pw * 5
    logits = b * s * int(c["vocab_size"]) * (w + 4 + 4)
    acts = b * s * (16 * hidden + 4 * inter) * w
    return int(state + logits + acts)


def decide(free_bytes: int | None, recipe: dict, n_params: int) -> tuple[bool, str]:
    """``(run, reason)``: run only when ``free_bytes`` is at least ``HEADROOM`` x the estimate."""
    est = estimate_peak_bytes(recipe, n_params)
    gib = 2 ** 30
    if free_bytes is None:
        return False, "free memory on the device unknown"
    if free_bytes < HEADROOM * est:
        return False, (f"{free_bytes / gib:.2f} GiB free on the device, under {HEADROOM:g} x the estimated "
                       f"peak {est / gib:.2f} GiB")
    return True, f"estimated peak {est / gib:.2f} GiB, {free_bytes / gib:.2f} GiB free"


# ---------------------------------------------------------------------------------- the replay
class _Skip(Exception):
    pass


def _free_bytes(device: str) -> int | None:
    import torch
    if device.startswith("cuda"):
        return int(torch.cuda.mem_get_info(torch.device(device))[0])
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def _load(spec: str, prefix: str, what: str):
    import importlib
    mod, _, name = spec.partition(":")
    if not mod.startswith(prefix):
        raise _Skip(f"the {what} {spec} is not a {prefix.rstrip('.')} class")
    obj = importlib.import_module(mod)
    for part in name.split("."):
        obj = getattr(obj, part)
    return obj


def one_layer_config(model_cls, recipe: dict):
    """The recorded config with one decoder layer (per-layer lists cut to their first entry)."""
    d = dict(recipe["model"]["config"])
    layers = d.get("num_hidden_layers")
    if not isinstance(layers, int) or layers < 1:
        raise _Skip("the model's config has no num_hidden_layers")
    for k, v in d.items():
        if isinstance(v, list) and len(v) == layers and layers > 1:
            d[k] = v[:1]
    d["num_hidden_layers"] = 1
    cfg = model_cls.config_class.from_dict(d)
    if recipe["model"].get("attn_implementation"):
        cfg._attn_implementation = recipe["model"]["attn_implementation"]
    return cfg


@contextlib.contextmanager
def _default_dtype(dtype):
    import torch
    prev = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(prev)


def _step(model_cls, cfg, recipe: dict, device: str) -> dict:
    """One training step of the 1-layer copy on scratch tensors; returns what it ran."""
    import torch
    m, o = recipe["model"], recipe.get("optimizer")
    dtype = getattr(torch, m["dtype"])
    with _default_dtype(dtype), torch.device(device):
        model = model_cls(cfg)
    model.train()
    if m.get("gradient_checkpointing"):
        (getattr(model, "activation_checkpointing_enable", None) or model.gradient_checkpointing_enable)()
    opt, note = None, None
    if o is not None:
        try:
            cls = _load(o["class"], "torch.optim.", "optimizer")
            takes = inspect.signature(cls).parameters     # ``defaults`` may hold more than __init__ takes
            opt = cls(model.parameters(), **{k: v for k, v in o["options"].items() if k in takes})
        except _Skip as e:
            note = f"{e}: forward and backward only"
    b, s = m["batch"]
    ids = torch.randint(0, cfg.vocab_size, (b, s), device=device)
    dev_type = torch.device(device).type
    amp = torch.autocast(dev_type, dtype=getattr(torch, m["autocast"])) if m.get("autocast") else \
        contextlib.nullcontext()
    with amp:
        out = model(input_ids=ids, labels=ids if m.get("loss") else None)
        loss = out.loss if m.get("loss") else torch.nn.functional.cross_entropy(
            out.logits.flatten(0, 1).float(), ids.flatten())
    loss.backward()
    if opt is not None:
        opt.step()
        opt.zero_grad(set_to_none=True)
    float(loss.detach())    # waits for the step
    return {"auto_prewarm_note": note} if note else {}


def run_auto_prewarm(recipe: dict, device: str) -> dict:
    """One step of a 1-layer copy of the recorded model in this standby.  Returns
    ``{"auto_prewarm_s", "auto_prewarm_peak_estimate"}`` when it ran, ``{"auto_prewarm_skipped":
    reason}`` when it should not run, ``{"auto_prewarm_failed": error}`` when it failed; never raises."""
    t0 = time.perf_counter()
    try:
        import torch
        model_cls = _load(recipe["model"]["class"], "transformers.", "model")
        cfg = one_layer_config(model_cls, recipe)
        with torch.device("meta"):
            n_params = sum(p.numel() for p in model_cls(cfg).parameters())
        ok, why = decide(_free_bytes(device), recipe, n_params)
        if not ok:
            return {"auto_prewarm_skipped": why}
        cuda = [torch.device(device).index or 0] if device.startswith("cuda") else []
        with torch.random.fork_rng(devices=cuda):   # the standby becomes the job's worker: its RNG as found
            info = _step(model_cls, cfg, recipe, device)
        return {"auto_prewarm_s": time.perf_counter() - t0,
                "auto_prewarm_peak_estimate": estimate_peak_bytes(recipe, n_params), **info}
    except _Skip as e:
        return {"auto_prewarm_skipped": str(e)}
    except Exception as e:  # noqa: BLE001  (a default must not fail the standby: reported instead)
        return {"auto_prewarm_failed": f"{type(e).__name__}: {e}"}
    finally:
        import gc
        gc.collect()
        torch = sys.modules.get("torch")
        if torch is not None and device.startswith("cuda") and torch.cuda.is_initialized():
            torch.cuda.empty_cache()    # the blocks go back; the loaded kernels stay
