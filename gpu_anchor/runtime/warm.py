"""What a warm standby does before it is needed (the standby itself is ``gpu_anchor.runtime.Standby``).

``warm_cuda``: the part of a worker's or engine's start-up that touches no anchored state —
CUDA context, cuBLAS handle, a matmul kernel — on scratch tensors.  ``run_prewarm``: the
user's own pre-warm function (``--prewarm MODULE:FUNCTION``), e.g. one step of a 1-layer copy
of the model, so the first real step after a take-over finds its kernels loaded.
"""
from __future__ import annotations

import importlib
import time


def warm_cuda(device: str, dtype=None) -> dict:
    """The part of an engine's start-up that touches no anchored state: CUDA context,
    cuBLAS handle and a matmul kernel in ``dtype`` (on scratch tensors)."""
    import torch
    t0 = time.perf_counter()
    if not device.startswith("cuda"):
        return {"cuda_init_s": 0.0}
    dev = torch.device(device)
    torch.cuda.set_device(dev)
    torch.empty(1, device=dev)
    t1 = time.perf_counter()
    a = torch.randn(256, 256, device=dev, dtype=dtype or torch.bfloat16)
    (a @ a).float().softmax(-1).argmax(-1).cpu()
    torch.cuda.synchronize(dev)
    return {"cuda_init_s": t1 - t0, "kernel_warm_s": time.perf_counter() - t1, "device": device}


PREWARM_ENV = "GPU_ANCHOR_PREWARM"


def check_prewarm_spec(spec: str) -> str:
    """``spec`` if it names a function as ``module:function``, else ValueError saying so."""
    mod, sep, fn = spec.partition(":")
    if not (mod and sep and fn.isidentifier()):
        raise ValueError(f"--prewarm wants MODULE:FUNCTION (e.g. mytrain:prewarm), not {spec!r}")
    return spec


def run_prewarm(spec: str, device: str) -> dict:
    """Call the user's pre-warm function ``module:function`` with the standby's device.

    Contract for that function: it runs in the standby before any failure, while the
    active worker is training, so it must touch scratch tensors only — never connect to
    gpu-anchor or bind anchored state, never write files the job reads.  What it is for:
    one step of a small model with the job's shapes (a 1-layer copy of the model, the
    job's batch and sequence length) loads every kernel and cuBLAS heuristic the first
    real step needs; on the H200 that cut a 1B model's first step after a restart from
    0.62 s to 0.14 s (``bench/first_step.py``).  Free what it allocated
    (``torch.cuda.empty_cache()``) if the GPU is tight: the kernels stay loaded."""
    mod, _, fn = check_prewarm_spec(spec).partition(":")
    t0 = time.perf_counter()
    out = getattr(importlib.import_module(mod), fn)(device)
    info = {"prewarm_s": time.perf_counter() - t0, "prewarm": spec}
    if isinstance(out, dict):  # what the function reports about itself goes into the standby's report
        info.update({k: v for k, v in out.items() if k not in info})
    return info
