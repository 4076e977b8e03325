"""What ``AnchoredOptimizer`` anchors, and its one bind.

- ``collect``: the optimizer's parameters in optimizer order, each named by the model's access
  path (``model=``) or ``g<group>.p<index>``; refused: a parameter twice, a non-contiguous one,
  none at all, more than one device.
- ``check_anchored``: every parameter must be in anchored memory already (refused otherwise).
- ``connect``: the daemon client the state goes to: the open scope's namespace, else the one
  the parameters are anchored in, else the default one.
- ``signature`` / ``describe``: what the journal's ``meta`` records of them (names, shapes,
  dtypes), and how an error names an optimizer; ``foreign_state`` is the error for another
  optimizer's state under the same prefix.
- ``bind_state``: ``<prefix>.grad.<param>`` and ``<prefix>.state.<param>.<key>`` in one bind
  (a resumed run that finds them created lost its state: refused), then the two undo slots,
  the device progress word and (CUDA + Adam) the fused kernel's per-block undo tags — matched
  when a step is in flight (a missing undo slot is then refused), replaced otherwise;
  ``rebind_undo`` replaces the undo slots alone, at another size.  The anchored tensors are
  set on each parameter's record (``grad``, ``gview``, ``states`` and their flat views).

The optimizer's journal, chunk plan and recovery stay in ``optimizer``; this module only
names, checks and binds.
"""
from __future__ import annotations

import torch

from . import fused_adam
from .fsdp import like as _like, local as _local


class AnchoredParam:
    # ``local``: the memory this rank owns (an FSDP2 DTensor's shard, else ``p``); ``gview``: what
    # ``p.grad`` is set to (a DTensor over ``grad`` for DTensor parameters, else ``grad``)
    __slots__ = ("index", "name", "group", "p", "local", "grad", "gview", "states", "flat", "gflat", "sflat")


def collect(optimizer: torch.optim.Optimizer, model) -> tuple[list[AnchoredParam], torch.device]:
    """The parameters in optimizer order and their one device."""
    names = {id(p): n for n, p in model.named_parameters()} if model is not None else {}
    params: list[AnchoredParam] = []
    for gi, group in enumerate(optimizer.param_groups):
        for j, p in enumerate(group["params"]):
            if any(q.p is p for q in params):
                raise ValueError("a parameter appears twice in the optimizer")
            if not _local(p).is_contiguous():
                raise ValueError("AnchoredOptimizer needs contiguous parameters")
            e = AnchoredParam()
            e.index, e.group, e.p, e.local = len(params), gi, p, _local(p)
            e.name = names.get(id(p), f"g{gi}.p{j}")
            params.append(e)
    if not params:
        raise ValueError("the optimizer has no parameters")
    devices = {q.local.device for q in params}
    if len(devices) != 1:
        raise ValueError(f"all parameters must be on one device, got {sorted(map(str, devices))}")
    return params, devices.pop()


def group_lists(optimizer: torch.optim.Optimizer) -> list:
    """What a step compares the wrapped optimizer's groups by, cheaply (0.5 us for 300
    parameters): each group's list and its length."""
    return [(id(g["params"]), len(g["params"])) for g in optimizer.param_groups]


def groups_changed(opt) -> str | None:
    """At the start of ``opt.step()``: why the wrapped optimizer's groups no longer hold the
    parameters anchored at construction (``add_param_group`` on it, a group's list edited), or
    None.  The step updates the anchored ones only, so a parameter added later would never be
    updated, silently.  Each parameter is compared only when ``group_lists`` changed."""
    lists = group_lists(opt.optimizer)
    if lists == opt._group_lists:
        return None
    now = [p for g in opt.optimizer.param_groups for p in g["params"]]
    if len(now) == len(opt._params) and all(a is q.p for a, q in zip(now, opt._params)):
        opt._group_lists = lists          # new list objects, the same parameters
        return None
    return (f"the optimizer AnchoredOptimizer wraps now holds {len(now)} parameter(s) in "
            f"{len(opt.optimizer.param_groups)} group(s), and {len(opt._params)} were anchored when it was built "
            "(add_param_group, or a group's list changed): a parameter added since would never be updated. "
            "Build the optimizer with every group (trainable or not: a frozen parameter gets no update), in a "
            "new namespace or prefix")


def outside_anchored(named) -> list[str]:
    """The names of the ``(name, tensor)`` pairs whose tensor is not in anchored memory."""
    from gpu_anchor.client.client import anchored_name
    return [n for n, t in named if anchored_name(t) is None]


def check_anchored(params: list[AnchoredParam]) -> None:
    """Refuse parameters outside anchored memory: a restarted worker would resume the optimizer's
    state and step count over weights its script made afresh."""
    missing = outside_anchored((q.name, q.local) for q in params)
    if missing:
        more = f" and {len(missing) - 3} more" if len(missing) > 3 else ""
        raise ValueError(
            f"AnchoredOptimizer: {len(missing)} of {len(params)} parameter(s) are not in anchored memory "
            f"({', '.join(missing[:3])}{more}), so a restarted worker would resume the optimizer's state and "
            "step count over weights made afresh. Build the model inside gpu_anchor.managed_scope() (or anchor "
            "it with gpu_anchor.train.anchor_module) before the optimizer; a move after that (.to(), .cuda(), a "
            "framework placing it on its device) copies it out of anchored memory: move it inside the scope.")


def connect(params: list[AnchoredParam], device: torch.device, namespace: str | None):
    """The client for the optimizer's state, next to its parameters: the open scope's
    ``namespace``; else, for an optimizer built after its scope closed (or by a library, such
    as ``hf.AnchoredTrainer``), the namespace its parameters are anchored in (``check_anchored``
    first); else, theirs spread over several, the default one."""
    from gpu_anchor.client.client import Client, anchored_name, connect as connect_default
    dev = "cpu" if device.type == "cpu" else str(device)
    if namespace is not None:
        return connect_default(dev, namespace=namespace)
    found = {anchored_name(q.local)[0] for q in params}
    if len(found) == 1:
        return Client(dev, found.pop())      # already this rank's namespace on a shared daemon
    return connect_default(dev)


def signature(params: list[AnchoredParam]) -> list:
    return [[q.name, list(q.local.shape), str(q.local.dtype)] for q in params]


def describe(optimizer_name: str, params: list, step: int | None = None) -> str:
    shown = ", ".join(f"{n} {d.removeprefix('torch.')}{s}" for n, s, d in params[:3])
    more = f", ... {len(params) - 3} more" if len(params) > 3 else ""
    at = f", {step} step(s) committed" if step is not None else ""
    return f"{optimizer_name} over {len(params)} parameter(s) ({shown}{more}){at}"


def foreign_state(found: str, mine: str, prefix: str, advice: str = ".") -> RuntimeError:
    return RuntimeError(
        f"{found}; this one is {mine}. Two optimizers in one namespace need their own prefixes: "
        f"AnchoredOptimizer(..., prefix={prefix + '2'!r}){advice}")


def bind_state(client, prefix: str, params: list[AnchoredParam], keys_of: list, chunks: list, slot_bytes: int,
               kind, device: torch.device, *, in_flight: bool, committed_steps: int | None):
    """Binds the gradients, optimizer state, undo slots, progress word and undo tags; returns
    ``(undo slots, progress word, tags or None)``.  ``committed_steps``: the journal's count
    when resuming (its state must be found), None for a fresh start."""
    # Gradients first: created in one batch they lie end to end, so ``grad_lending`` can lend
    # them as a few large runs (a resumed run keeps wherever its objects are).
    specs = [(f"{prefix}.grad.{q.name}", tuple(q.local.shape), q.local.dtype) for q in params]
    for q, ks in zip(params, keys_of):
        specs += [(f"{prefix}.state.{q.name}.{k}", tuple(q.local.shape), q.local.dtype) for k in ks]
    bound = client.bind(specs)
    lost = [b.name for b in bound if b.status == "created"]
    if committed_steps is not None and lost:
        ns = getattr(client, "namespace", "?")
        raise RuntimeError(f"the journal of namespace {ns!r} says {committed_steps} steps were committed but the "
                           f"anchored optimizer state is gone ({lost[:3]}...): its objects were freed (a live "
                           "process dropped every tensor over them, as `del opt` does; `gpu-anchor drop`; or the "
                           "daemon lost its memory): restore from a checkpoint, or start over in a fresh namespace "
                           f"(`gpu-anchor drop {ns}`)")
    tag_spec = []
    if fused_adam.tagged(device, kind):     # the fused update's per-block undo tags, a row per slot
        nblocks = fused_adam.FusedAdam.max_blocks([[s.stop - s.start for s in c] for c in chunks])
        tag_spec = [(f"{prefix}.undo.tags", (2, nblocks), torch.int64)]
    undo = client.bind(_undo_specs(prefix, slot_bytes) + [(f"{prefix}.progress", (1,), torch.int64)] + tag_spec,
                       policy="match_or_create" if in_flight else "replace")
    if in_flight and any(b.status == "created" for b in undo):
        raise RuntimeError("a step is in flight but the undo buffer is gone: restore from a checkpoint")
    word = undo[2].tensor
    tags = undo[3].tensor if tag_spec else None
    if not in_flight:
        word.fill_(-1)
        if tags is not None:
            tags.fill_(-1)     # no block of any (step, chunk) saved
    grads, it = bound[:len(params)], iter(bound[len(params):])
    for q, ks, g in zip(params, keys_of, grads):
        q.grad = g.tensor
        q.gview = _like(q.p, q.grad)
        q.states = {k: next(it).tensor for k in ks}
        q.flat = q.local.detach().view(-1)
        q.gflat = q.grad.view(-1)
        q.sflat = {k: t.view(-1) for k, t in q.states.items()}
    return [b.tensor for b in undo[:2]], word, tags


def rebind_undo(client, prefix: str, slot_bytes: int) -> list[torch.Tensor]:
    """Replaces the two undo slots by slots of ``slot_bytes`` (no step may be in flight)."""
    return [b.tensor for b in client.bind(_undo_specs(prefix, slot_bytes), policy="replace")]


def _undo_specs(prefix: str, slot_bytes: int) -> list:
    return [(f"{prefix}.undo.{i}", (slot_bytes,), torch.uint8) for i in (0, 1)]
