"""``AnchoredOptimizer`` in a training loop written for Hugging Face accelerate.

``accelerator.prepare(model, opt, loader)`` hands an ``AnchoredOptimizer`` back as it is (it
prepares ``torch.optim.Optimizer`` instances only), so what accelerate's own optimizer wrapper
would do is done here, read from accelerate's process-wide state (nothing is imported: a job
without accelerate pays two ``sys.modules`` lookups a step):

* inside ``accelerator.accumulate(model)``, on a micro-batch that does not end an accumulation
  (``accelerator.sync_gradients`` false), ``step()`` and ``zero_grad()`` do nothing, exactly as
  accelerate's wrapper skips them; the gradients keep accumulating in anchored memory;
* refused, with the reason, before a step begins: DeepSpeed (its engine owns the optimizer),
  accelerate's FSDP plugin (it shards the model after the optimizer was built; ``fully_shard``
  then ``anchor_fsdp`` is the supported way) and fp16 on a GPU without
  ``scaler=accelerator.scaler`` (``accelerator.backward`` scales the loss there, and the step
  would apply the scaled gradients).

Not done here: accelerate steps a *prepared* LR scheduler once per process per optimizer
step, and ``accelerator.clip_grad_norm_`` unscales only the optimizers it prepared. Give the
scheduler to ``AnchoredOptimizer(schedulers=[...])`` instead of to ``prepare`` (it then steps
once per optimizer step), and clip in bf16 or fp32.
"""
from __future__ import annotations

import sys


def _shared(module: str, cls: str) -> dict:
    mod = sys.modules.get(module)
    state = getattr(getattr(mod, cls, None), "_shared_state", None) if mod is not None else None
    return state if isinstance(state, dict) else {}


def defers_step() -> bool:
    """True on a micro-batch that accelerate's ``accumulate()`` does not end with a step."""
    return not _shared("accelerate.state", "GradientState").get("sync_gradients", True)


def refusal(scaler, device) -> str | None:
    """Why this accelerate configuration cannot run an anchored step on ``device``, or None."""
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
    if state.get("_mixed_precision") == "fp16" and scaler is None and device.type == "cuda":
        return ("accelerate's fp16 scales the loss in accelerator.backward(), and AnchoredOptimizer "
                "would step on the scaled gradients: pass AnchoredOptimizer(..., scaler=accelerator.scaler), "
                "or train in bf16")
    return None
