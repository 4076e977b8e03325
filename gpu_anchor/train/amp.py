"""fp16 AMP under the protocol: the ``GradScaler`` step, done at the finalization boundary.

``torch.amp.GradScaler.step`` skips ``optimizer.step()`` on inf/NaN gradients, which
would leave ``completed_steps`` behind the training loop.  ``AnchoredOptimizer``
instead does the scaler's work itself at the gradient-finalization boundary: unscale
the anchored gradients in place (they become the redo log, unscaled), agree on
inf/NaN across ranks, update scale and growth tracker exactly as ``GradScaler.update``
would, and commit a step whose update is empty when inf/NaN was found (the Adam step
counts do not advance, as with a skipped ``optimizer.step``).  The scaler's state is
part of the step's carry (``carry.py``): a worker that resumes after step ``s``
gets the scale that iteration ``s + 1`` used in the fault-free run.

Costs one host read of the inf flag per step, as ``GradScaler.step`` does.
"""
from __future__ import annotations

import torch


def check(scaler):
    """``scaler`` if it is an enabled ``torch.amp.GradScaler``, ``None`` if absent/disabled."""
    if scaler is None:
        return None
    if not isinstance(scaler, torch.amp.GradScaler):
        raise TypeError("scaler must be a torch.amp.GradScaler (FSDP1's ShardedGradScaler is not supported)")
    return scaler if scaler.is_enabled() else None


def misuse(opt) -> str | None:
    """Why ``GradScaler.step(opt)`` reached this step, or None.

    ``AnchoredOptimizer`` declares ``_step_supports_amp_scaling``, so ``GradScaler.step(opt)``
    hands it ``grad_scale`` / ``found_inf`` (having changed no gradient) instead of unscaling
    and maybe skipping the step: either would leave ``completed_steps`` behind the loop on an
    inf step, or the scale outside the commit.
    """
    driven = opt.__dict__.pop("grad_scale", None) is not None
    driven = opt.__dict__.pop("found_inf", None) is not None or driven
    if driven:
        return ("torch.amp.GradScaler.step(opt) called this step. Give the scaler to the optimizer, "
                "AnchoredOptimizer(..., scaler=scaler), keep scaler.scale(loss).backward() (and "
                "scaler.unscale_(opt) before clipping), and call opt.step() instead of scaler.step(opt) "
                "and scaler.update(): the step skips an inf/NaN update and updates the scale itself, "
                "committed with the step")
    return None


def unscaled_by_loop(scaler, opt) -> torch.Tensor | None:
    """The inf/NaN flag of this iteration's ``scaler.unscale_(opt)`` (the loop unscaled the
    gradients itself, to clip them), or None if it did not; either way the scaler forgets the
    iteration, as ``GradScaler.update`` does."""
    st = scaler._per_optimizer_states.pop(id(opt), None)
    if st is None or st["stage"] is not torch.amp.grad_scaler.OptState.UNSCALED:
        return None
    flags = list(st["found_inf_per_device"].values())
    return flags[0] if len(flags) == 1 else torch.stack([f.to(flags[0].device) for f in flags]).amax()


def unscale(scaler, grads: list[torch.Tensor], device: torch.device, all_ranks: bool,
            found: torch.Tensor | None = None) -> bool:
    """Unscale ``grads`` in place and update ``scaler``; True if inf/NaN (on any rank) means skip.
    ``found``: the loop unscaled them already (``unscaled_by_loop``), this is its inf/NaN flag."""
    if scaler._scale is None:
        scaler._lazy_init_scale_growth_tracker(device)
    if found is None:
        found = torch.zeros(1, dtype=torch.float32, device=device)
        inv = scaler._scale.double().reciprocal().float()
        by_dtype: dict = {}
        for g in grads:
            by_dtype.setdefault(g.dtype, []).append(g)
        for gs in by_dtype.values():
            torch._amp_foreach_non_finite_check_and_unscale_(gs, found, inv)
    else:
        found = found.reshape(1).to(device=device, dtype=torch.float32)
    if all_ranks:
        # FSDP2 shards differ per rank; DDP's are equal — either way all ranks must skip alike
        import torch.distributed as dist
        flag = found if dist.get_backend() == "nccl" else found.cpu()
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        found = flag.to(device)
    torch._amp_update_scale_(scaler._scale, scaler._growth_tracker, found, scaler._growth_factor,
                             scaler._backoff_factor, scaler._growth_interval)
    return bool(found.item())


def state(scaler) -> dict | None:
    return None if scaler is None else scaler.state_dict()


def restore(scaler, sd: dict | None) -> None:
    if scaler is None:
        return
    if sd is None:
        raise RuntimeError("this run uses a GradScaler but the committed step carries no scaler state "
                           "(was it started without one?)")
    scaler.load_state_dict(sd)
