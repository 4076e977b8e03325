"""What a standby warms of the anchored optimizer before any fault (``warm_anchored_update``).

A restarted worker's ``AnchoredOptimizer`` meets, after the mapping, work that does not depend
on the job's anchored state: the modules of the step protocol (on CUDA: Triton and the fused
Adam kernel), the first launch of the gradient zeroing (``torch._foreach_zero_``: a lazily
loaded kernel), and — with Adam/AdamW on CUDA — the verification that the fused update
reproduces torch's bit for bit for these hyper-parameters (``fused_adam.verify``: a few probe
steps and the kernel's first load, per structure).  A standby that knows the job's optimizer
(the automatic pre-warm's recipe, ``runtime.auto_prewarm``) does all of it on scratch tensors
before any fault; the verification's answer is kept for the process (``fused_adam.verified``),
so the worker it becomes does not run it again.

Touches no anchored state and no daemon; never raises (what failed is reported instead).
"""
from __future__ import annotations

import time


def warm_anchored_update(recipe: dict, device: str) -> dict:
    """Warm the anchored update of the optimizer in ``recipe`` (``{"model": {"dtype"...},
    "optimizer": {"class", "options"}}``) on ``device``.  Returns ``{"anchored_warm_s",
    "anchored_warm": what ran}`` or ``{"anchored_warm_skipped": why}``; never raises."""
    t0 = time.perf_counter()
    try:
        import torch
        o = recipe.get("optimizer")
        if o is None:
            return {"anchored_warm_skipped": "no optimizer recorded"}
        dtype = getattr(torch, recipe["model"]["dtype"])
        dev = torch.device(device)
        import importlib
        for m in ("chunk_exec", "device_progress", "optimizer"):      # the step protocol's modules
            importlib.import_module(f"{__package__}.{m}")
        from .kinds import AdamKind, kind_of
        mod, _, name = o["class"].partition(":")
        if not mod.startswith("torch.optim"):
            return {"anchored_warm_skipped": f"{o['class']} is not a torch optimizer"}
        cls = importlib.import_module(mod)
        for part in name.split("."):
            cls = getattr(cls, part)
        scratch = torch.zeros(8, dtype=dtype, device=dev, requires_grad=True)
        import inspect
        takes = inspect.signature(cls).parameters
        opt = cls([scratch], **{k: v for k, v in o["options"].items() if k in takes})
        hp = opt.param_groups[0]
        ran = []
        grads = [torch.ones(n, dtype=dtype, device=dev) for n in (8, 4096)]
        torch._foreach_zero_(grads)                  # the optimizer zeroes its anchored gradients
        ran.append("foreach_zero")
        if dev.type == "cuda" and type(kind_of(opt)) is AdamKind:
            from .fused_adam import structure, unavailable_reason, verified
            why = unavailable_reason(dev)
            key = structure(hp, dtype)
            if why is None and key is not None:
                ran.append(f"fused adam {'verified' if verified(key, hp, dev) is not None else 'not reproducible'}")
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        return {"anchored_warm_s": time.perf_counter() - t0, "anchored_warm": ", ".join(ran)}
    except Exception as e:  # noqa: BLE001  (a standby must not fail for its warm-up: reported)
        return {"anchored_warm_failed": f"{type(e).__name__}: {e}"}
