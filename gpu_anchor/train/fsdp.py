"""FSDP2 (``torch.distributed.fsdp.fully_shard``): each rank anchors its own shards.

    model = build_model()
    for block in model.layers: fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    anchor_fsdp(model, client)                       # shards -> anchored memory (per rank)
    opt = AnchoredOptimizer(torch.optim.AdamW(model.parameters()), model=model, client=client)

After ``fully_shard`` every parameter is a ``DTensor`` whose ``_local_tensor`` is a
narrow view of the ``FSDPParam``'s padded 1-D ``_sharded_param_data``; all-gathers read
that padded buffer.  ``anchor_fsdp`` binds one anchored tensor per parameter, shaped
like the *padded* local shard, and re-points both views at it (FSDP2's own
``reset_sharded_param`` then sees the same storage and leaves it alone).  Names are
``<prefix>.<fqn>``; ranks are kept apart by their daemon / namespace (one per rank).

Gradients need no copy: FSDP2 accumulates the reduce-scattered shard into an existing
``p.grad`` (``grad._local_tensor += new_shard``), and ``AnchoredOptimizer`` keeps
``p.grad`` a DTensor over its anchored gradient buffer, zeroed between steps.  If the
user sets ``p.grad`` to something else, the finalization boundary copies it home.

Order that matters (as with DDP): ``fully_shard`` -> ``anchor_fsdp`` ->
``AnchoredOptimizer`` (recovery, which may finish an in-flight step on the local
shards) -> the first forward.  The optimizer works elementwise on the local shards, so
AdamW/Adam/SGD give exactly what they give on FSDP2's DTensors.
"""
from __future__ import annotations

import torch


def is_dtensor(t) -> bool:
    return hasattr(t, "_local_tensor") and hasattr(t, "device_mesh")


def local(t: torch.Tensor) -> torch.Tensor:
    """The tensor whose memory a rank owns: a DTensor's local shard, else ``t`` itself."""
    return t._local_tensor if is_dtensor(t) else t


def like(p: torch.Tensor, buf: torch.Tensor) -> torch.Tensor:
    """``buf`` (this rank's part) seen as ``p`` is: a DTensor over it with ``p``'s mesh and placements
    for DTensor ``p``, else ``buf`` itself — what ``p.grad`` and ``state_dict()`` state are set to."""
    if not is_dtensor(p):
        return buf
    from torch.distributed.tensor import DTensor
    with torch.no_grad():
        return DTensor.from_local(buf, p.device_mesh, p.placements, run_check=False,
                                  shape=p.shape, stride=p.stride())


def fsdp_params(model: torch.nn.Module) -> list:
    """``[(fqn, FSDPParam)]`` of every ``fully_shard``-ed module in ``model``, by the module's access path."""
    from torch.distributed.fsdp import FSDPModule
    names = {id(m): n for n, m in model.named_modules()}
    out, seen = [], set()
    for mod in model.modules():
        if not isinstance(mod, FSDPModule):
            continue
        state = mod._get_fsdp_state()
        groups = getattr(state, "_fsdp_param_groups", None)    # newer torch: a list per module
        if groups is None:
            groups = [state._fsdp_param_group] if state._fsdp_param_group is not None else []
        for fp in (fp for g in groups for fp in g.fsdp_params):
            if id(fp) not in seen:
                seen.add(id(fp))
                owner = names[id(fp._module_info.module)]
                out.append((f"{owner}.{fp._module_info.param_name}" if owner else fp._module_info.param_name, fp))
    return out


def anchor_fsdp(model: torch.nn.Module, client, prefix: str = "model") -> dict[str, str]:
    """Move this rank's FSDP2 parameter shards into anchored memory; ``{fqn: "matched"|"created"}``.

    Call after ``fully_shard`` and before the first forward / the optimizer.  Like
    ``anchor_module``: a matched shard keeps the daemon's data (the previous worker's
    state), a created one receives the current values; until ``anchor/<prefix>/ready``
    is committed every shard is (re)initialised.  Buffers are not sharded by FSDP2:
    anchor them with ``anchor_module(..., skip=<param names>)`` if they change in training.
    """
    from torch.distributed.fsdp import FSDPModule
    if not any(isinstance(m, FSDPModule) for m in model.modules()):
        raise ValueError("anchor_fsdp needs a model with fully_shard applied (use anchor_module otherwise)")
    params = fsdp_params(model)
    for fqn, fp in params:
        if fp.offload_to_cpu:
            raise NotImplementedError(f"{fqn}: FSDP2 CPU offload is not supported with anchored shards")
        if fp._sharded_param_data.device != torch.device(client.device):
            raise ValueError(f"{fqn}: shard lives on {fp._sharded_param_data.device}, "
                             f"the client serves {client.device}")
        if fp.fsdp_placement.dim != 0:
            raise NotImplementedError(f"{fqn}: only Shard(0) FSDP placements are supported")
    specs = [(f"{prefix}.{fqn}", tuple(fp.padded_sharded_param_size), fp._sharded_param_data.dtype)
             for fqn, fp in params]
    ready_key = f"anchor/{prefix}/ready"
    ready = client.journal.get(ready_key) is not None
    bound = client.bind(specs)
    out = {}
    with torch.no_grad():
        for (fqn, fp), b in zip(params, bound):
            if b.status == "created" or not ready:
                b.tensor.view(-1).copy_(fp._sharded_param_data)
            out[fqn] = b.status if ready else "created"
            length = fp.sharded_param._local_tensor.size(0)
            fp._sharded_param_data = b.tensor.view(-1)
            fp.sharded_param._local_tensor = b.tensor.narrow(0, 0, length)
        if not ready and bound:
            if bound[0].tensor.device.type == "cuda":
                torch.cuda.synchronize(bound[0].tensor.device)
            client.journal.put(ready_key, b"1")
    return out
