"""Baselines the benchmarks compare gpu-anchor with, each implemented as a careful user would.

Training (``TrainCheckpoint`` subclasses, see ``base``): ``torch_save``, ``checkfreq``,
``inmemory``, ``dcp_async``; gpu-anchor's own adapter is ``anchor``.  Inference:
``replay`` and ``kv_memory``.

    python -m bench baselines --tiny     # round-trip check: save, SIGKILL-free restore, bit-exact
"""
from __future__ import annotations

import importlib

TRAIN = {"torch_save": ("torch_save", "TorchSave"), "checkfreq": ("checkfreq", "CheckFreq"),
         "inmemory": ("inmemory", "InMemory"), "dcp_async": ("dcp_async", "DcpAsync")}


def method(name: str):
    """The TrainCheckpoint class of baseline ``name`` (or ``gpu_anchor``)."""
    if name == "gpu_anchor":
        from .anchor import Anchor
        return Anchor
    if name not in TRAIN:
        raise ValueError(f"unknown training method {name!r}; known: {', '.join(list(TRAIN) + ['gpu_anchor'])}")
    mod, cls = TRAIN[name]
    return getattr(importlib.import_module(f"{__name__}.{mod}"), cls)


def main(argv=None) -> int:
    from .roundtrip import main as rt
    return rt(argv)


def render(result: dict) -> str:
    from .roundtrip import render as r
    return r(result)
