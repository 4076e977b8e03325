"""Counting weight-file openings (tests and benchmarks): a restart served from anchored memory must open none.

``count_opens()`` wraps, in this process, the entry points through which the loaders the tests use
open weight files — transformers' ``safe_open``, safetensors' ``safe_open`` and ``torch.load`` —
and returns a one-element list holding the count so far.
"""
from __future__ import annotations


def count_opens() -> list[int]:
    import safetensors
    import safetensors.torch
    import torch
    import transformers.modeling_utils as mu
    n = [0]

    def counting(fn):
        def wrapper(*a, **k):
            n[0] += 1
            return fn(*a, **k)
        return wrapper
    mu.safe_open = counting(mu.safe_open)
    safetensors.safe_open = counting(safetensors.safe_open)
    safetensors.torch.safe_open = counting(safetensors.torch.safe_open)
    torch.load = counting(torch.load)
    return n
