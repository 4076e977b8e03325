"""The one place where the engine's long-lived tensors get their memory.

Weights and the paged KV cache are bound by name (parameter names, ``kv_cache[i]``) to
daemon-owned memory through ``gpu_anchor.connect().bind``: in a restarted engine the
same names come back "matched", with their data, and nothing is read from disk.
``managed_scope`` can replace this module later without touching the engine: the
contract is ``bind(specs) -> (tensors, statuses)`` plus a journal (or ``None``).
With ``enabled=False`` the tensors are ordinary allocations and there is no journal
(the "without anchoring" baseline of the benchmark).
"""
from __future__ import annotations

import torch


class Anchor:
    def __init__(self, device: str, namespace: str | None = None, socket: str | None = None,
                 enabled: bool = True, rank: int = 0, world: int = 1) -> None:
        """``rank`` of ``world``: a tensor-parallel engine group's ranks share the host daemon on
        the CPU, so each binds in its own namespace there (``namespace_for``)."""
        self.device = device
        self.enabled = enabled
        self.client = None
        if enabled:
            import gpu_anchor
            if world > 1:
                from gpu_anchor.client.client import Client, namespace_for
                from gpu_anchor.paths import normalize_device
                self.client = Client(normalize_device(device), namespace_for(namespace or "default", device, rank, world),
                                     socket)
            else:
                self.client = gpu_anchor.connect(device, namespace=namespace, socket=socket)

    @property
    def journal(self):
        return self.client.journal if self.client is not None else None

    def bind(self, specs: list[tuple[str, tuple, torch.dtype]], policy: str = "match_or_create"
             ) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
        """All-or-nothing bind; statuses are "matched" (data survived) or "created".
        ``policy="replace"`` recreates objects whose dtype/shape changed."""
        if not self.enabled:
            tensors = {n: torch.empty(shape, dtype=dt, device=self.device) for n, shape, dt in specs}
            return tensors, {n: "created" for n in tensors}
        bound = self.client.bind(specs, policy=policy)
        return {b.name: b.tensor for b in bound}, {b.name: b.status for b in bound}
