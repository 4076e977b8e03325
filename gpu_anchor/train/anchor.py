"""Move a module's parameters and buffers into anchored memory (until managed_scope).

``anchor_module(model, client)`` binds every parameter and buffer by its access path
(``<prefix>.<module path>.<name>``, e.g. ``model.layers.3.mlp.up_proj.weight``) with
match-or-create semantics: a *matched* object keeps the daemon's data (the state of the
previous worker, no copy), a *created* one receives the module's current values.
A crash between ``bind`` and the end of the copy must not leave half-initialised
weights that the next worker would then "match": the journal key
``anchor/<prefix>/ready`` is committed once the initial values are in, and until it
exists every object is (re)initialised from the module, matched or not.
Parameters keep their identity (``p.data`` is re-pointed), so optimizers built before
or after see the anchored memory.  Tied parameters are anchored once.

This is deliberately small and separate: ``gpu_anchor.managed_scope`` does the same
for everything built inside it, and tensors it already anchored are left alone here
if you pass ``skip=`` their names, or simply do not call this function.
"""
from __future__ import annotations

import torch


def anchor_module(model: torch.nn.Module, client, prefix: str = "model", skip=()) -> dict[str, str]:
    """Anchor ``model``'s parameters and buffers; returns ``{name: "matched"|"created"}``.

    Call once per worker, right after building the model and before training.
    A name that exists with another dtype/shape raises ``gpu_anchor.ConflictError``
    and changes nothing.
    """
    skip = set(skip)
    params = [(n, p) for n, p in model.named_parameters() if n not in skip]
    buffers = [(n, b) for n, b in model.named_buffers() if b is not None and n not in skip]
    for n, t in params + buffers:
        if t.device != torch.device(client.device):
            raise ValueError(f"{n} lives on {t.device} but the client serves {client.device}; "
                             "move the model first (model.to(device))")
    specs = [(f"{prefix}.{n}", tuple(t.shape), t.dtype) for n, t in params + buffers]
    ready_key = f"anchor/{prefix}/ready"
    ready = client.journal.get(ready_key) is not None
    bound = client.bind(specs)
    out = {}
    with torch.no_grad():
        for (n, t), b in zip(params + buffers, bound):
            if b.status == "created" or not ready:
                b.tensor.copy_(t)
            out[n] = b.status if ready else "created"
        if not ready:
            if t.device.type == "cuda":
                torch.cuda.synchronize(t.device)
            client.journal.put(ready_key, b"1")
        for (n, p), b in zip(params, bound[:len(params)]):
            p.data = b.tensor
        for (n, _), b in zip(buffers, bound[len(params):]):
            owner, _, leaf = n.rpartition(".")
            mod = model.get_submodule(owner) if owner else model
            mod._buffers[leaf] = b.tensor
    return out
