"""Replay, the inference baseline without KV persistence: restart the engine, reload the
weights from local safetensors (already in the page cache, as in the paper), and
recompute the prefill of every interrupted request (prompt + tokens generated so far).

Implemented as a drop-in for the serving engine's memory provider
(``gpu_anchor.serve.anchor.Anchor``): ordinary ``torch.empty`` allocations, the request
metadata in a tmpfs journal (``shm_journal``).  On a restart the weights are loaded here,
with the engine's own safetensors loader, and reported as present, while the KV cache is
reported new, so the engine's recovery path drops every KV block and re-prefills.
"""
from __future__ import annotations

import os
import time

import torch

from .shm_journal import ShmJournal

WEIGHTS_KEY = "serve/weights"


def checkpoint_views(model_dir: str, specs, tensors) -> dict[str, torch.Tensor]:
    """The bound weights under the checkpoint's names: the engine binds q/k/v and gate/up
    packed (``serve/packing.py``), the safetensors files hold them apart."""
    from gpu_anchor.serve import packing
    from gpu_anchor.serve.model_runner import load_config, param_specs
    full = param_specs(load_config(model_dir), specs[0][2])
    _, groups = packing.pack_specs(full)
    views = packing.member_views(tensors, groups, full)
    return {n: views[n] if n in views else tensors[n] for n, _, _ in full}


class ReplayAnchor:
    name = "replay"
    model_dir: str = ""
    state_dir: str = ""
    timings: dict = {}

    def __init__(self, device: str, namespace=None, socket=None, enabled: bool = True) -> None:
        self.device = device
        self.journal = ShmJournal(os.path.join(self.state_dir, "journal"))
        self.restart = self.journal.get(WEIGHTS_KEY) is not None
        type(self).timings = {}

    def _weights(self, specs, tensors) -> dict[str, str]:
        from gpu_anchor.serve.model_runner import load_weights
        if not self.restart:
            return {n: "created" for n, _, _ in specs}
        t0 = time.perf_counter()
        load_weights(self.model_dir, checkpoint_views(self.model_dir, specs, tensors))
        if torch.device(self.device).type == "cuda":
            torch.cuda.synchronize(self.device)
        type(self).timings["weights_load_s"] = time.perf_counter() - t0
        return {n: "matched" for n, _, _ in specs}

    def _kv(self, specs, tensors) -> dict[str, str]:
        return {n: "created" for n, _, _ in specs}

    def bind(self, specs):
        tensors = {n: torch.empty(shape, dtype=dt, device=self.device) for n, shape, dt in specs}
        w = [s for s in specs if not s[0].startswith("kv_cache[")]
        kv = [s for s in specs if s[0].startswith("kv_cache[")]
        status = self._weights(w, tensors)
        status.update(self._kv(kv, tensors))
        return tensors, status

    def replace(self, specs):
        return self.bind(specs)[0]
