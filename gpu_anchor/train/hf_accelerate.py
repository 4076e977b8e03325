"""``AnchoredOptimizer`` in a training loop written for Hugging Face accelerate.

``accelerator.prepare(model, opt, loader)`` hands an ``AnchoredOptimizer`` back as it is (it
prepares ``torch.optim.Optimizer`` instances only), so what accelerate's own optimizer wrapper
would do is done here, read from accelerate's process-wide state (nothing is imported: a job
without accelerate pays two ``sys.modules`` lookups a step):

* inside ``accelerator.accumulate(model)``, on a micro-batch that does not end an accumulation
  (``accelerator.sync_gradients`` false), ``step()`` and ``zero_grad()`` do nothing, exactly as
  accelerate's wrapper skips them; the gradients keep accumulating in anchored memory;
* with fp16, ``AnchoredOptimizer(..., scaler=accelerator.scaler)`` joins that Accelerator's
  optimizers (``join``), as ``prepare`` would have put its wrapper there: its
  ``clip_grad_norm_`` (``unscale_gradients()``) then unscales the anchored gradients before it
  clips them, and ``optimizer_step_was_skipped`` reads ``step_was_skipped``.  Joined, a step
  the scaler skips steps the given LR schedulers exactly when accelerate's scheduler wrapper (and
  Trainer) would step theirs (``skips_schedulers``);
* refused, with the reason, before a step begins: DeepSpeed (its engine owns the optimizer),
  accelerate's FSDP plugin (it shards the model after the optimizer was built; ``fully_shard``
  then ``anchor_fsdp`` is the supported way), fp16 on a GPU without ``scaler=accelerator.scaler``
  (``accelerator.backward`` scales the loss there, and the step would apply the scaled
  gradients), and a scaler of its own (``backward`` scales with accelerate's).

Not done here: accelerate steps a *prepared* LR scheduler once per process per optimizer
step. Give the scheduler to ``AnchoredOptimizer(schedulers=[...])`` instead of to ``prepare``
(it then steps once per optimizer step).  ``accelerator.save_state`` / ``load_state`` are not a
way to checkpoint an anchored job (``gpu-anchor run`` checkpoints it): without fp16 they do not
see the optimizer, joined they see it but not the schedulers given to it.
"""
from __future__ import annotations

import gc
import sys


def _shared(module: str, cls: str) -> dict:
    mod = sys.modules.get(module)
    state = getattr(getattr(mod, cls, None), "_shared_state", None) if mod is not None else None
    return state if isinstance(state, dict) else {}


def defers_step() -> bool:
    """True on a micro-batch that accelerate's ``accumulate()`` does not end with a step."""
    return not _shared("accelerate.state", "GradientState").get("sync_gradients", True)


def join(opt, scaler):
    """With accelerate's fp16, add ``opt`` to the optimizers of the Accelerator whose scaler is
    ``scaler`` and return that Accelerator; None (and nothing done) otherwise.  Finding it walks
    the collector's objects once (about 0.1 s), only when a scaler is given under accelerate."""
    if scaler is None or _shared("accelerate.state", "AcceleratorState").get("_mixed_precision") != "fp16":
        return None
    cls = getattr(sys.modules.get("accelerate.accelerator"), "Accelerator", None)
    if cls is None:
        return None
    for obj in gc.get_objects():
        if issubclass(type(obj), cls) and obj.scaler is scaler:      # type(): no __class__ property read
            # an accelerate whose Accelerator keeps them otherwise: refused at step()
            return obj if rejoin(opt, obj) else None
    return None


def rejoin(opt, accelerator) -> bool:
    """Put ``opt`` back among ``accelerator``'s optimizers if it is not there (its
    ``free_memory()``, which Trainer calls as each ``train()`` starts, empties them); False if
    this accelerate keeps them where this cannot add one."""
    prepared = getattr(accelerator, "_optimizers", None)
    if not isinstance(prepared, list):
        return False
    if not any(o is opt for o in prepared):
        prepared.append(opt)
    return True


def skips_schedulers(inner) -> bool:
    """Whether accelerate holds a prepared scheduler back on a step its scaler skipped, for the
    torch optimizer ``inner``.  Its wrapper calls a step skipped when ``GradScaler.step`` did not
    call the optimizer's; an optimizer that takes the scaler's inf flag itself (fused Adam, AdamW,
    SGD: torch's ``_step_supports_amp_scaling``) is always called, so accelerate, and Trainer
    after it, step the schedule on every step with those (read in accelerate 1.16's
    ``AcceleratedOptimizer.step``; seen on the H200 as Trainer's default fused AdamW)."""
    return not getattr(inner, "_step_supports_amp_scaling", False)


def refusal(scaler, device, joined=None, opt=None) -> str | None:
    """Why this accelerate configuration cannot run an anchored step on ``device``, or None;
    ``joined``: the Accelerator ``join`` found for the optimizer's scaler; ``opt``: the optimizer,
    which must still be among its optimizers (else its clip did not unscale it)."""
    state = _shared("accelerate.state", "AcceleratorState")
    if not state:
        return None
    kind = str(state.get("distributed_type", ""))
    if kind.endswith("DEEPSPEED"):
        return ("accelerate runs DeepSpeed here, whose engine owns the optimizer step; "
                "AnchoredOptimizer does not run under it")
    if kind.endswith("FSDP"):
        return ("accelerate's FSDP plugin shards the model in prepare(), after the optimizer was built "
                "over its parameters; shard it yourself first (torch's fully_shard, then "
                "gpu_anchor.train.fsdp.anchor_fsdp, then AnchoredOptimizer: FSDP2 is supported that way)")
    if state.get("_mixed_precision") == "fp16" and device.type == "cuda":
        if scaler is None:
            return ("accelerate's fp16 scales the loss in accelerator.backward(), and AnchoredOptimizer "
                    "would step on the scaled gradients: pass AnchoredOptimizer(..., scaler=accelerator.scaler), "
                    "or train in bf16")
        if joined is None:
            return ("the scaler given to AnchoredOptimizer is not accelerator.scaler (the one "
                    "accelerator.backward() scales the loss with), or the Accelerator keeps its optimizers "
                    "where this version cannot add one: pass AnchoredOptimizer(..., scaler=accelerator.scaler), "
                    "built after the Accelerator")
        if opt is not None and not any(o is opt for o in getattr(joined, "_optimizers", ())):
            rejoin(opt, joined)
            return ("accelerator.free_memory() (or clear()) dropped AnchoredOptimizer from the Accelerator's "
                    "optimizers since the last step, so a clip_grad_norm_ this iteration clipped its gradients "
                    "still scaled; it has joined again: run the iteration again (nothing was stepped), or build "
                    "the optimizer after free_memory()")
    return None
