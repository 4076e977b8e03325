"""``AnchoredOptimizer`` in a training loop written for Hugging Face accelerate.

``accelerator.prepare(model, opt, loader)`` hands an ``AnchoredOptimizer`` back as it is (it
prepares ``torch.optim.Optimizer`` instances only), so what accelerate's own optimizer wrapper
would do is done here, read from accelerate's process-wide state (nothing is imported: a job
without accelerate pays two ``sys.modules`` lookups a step):

* inside ``accelerator.accumulate(model)``, on a micro-batch that does not end an accumulation
  (``accelerator.sync_gradients`` false), ``step()`` and ``zero_grad()`` do nothing, exactly as
  accelerate's wrapper skips them; the gradients keep accumulating in anchored memory;
* the optimizer joins the Accelerator's optimizers (``join``), as ``prepare`` would have put its
  wrapper there, so that what accelerate does with its prepared optimizers reaches it:
  ``save_state`` / ``load_state`` save and load its ``state_dict`` (which carries the given LR
  schedulers and the step count: ``state_dict``); with fp16 (``scaler=accelerator.scaler``),
  ``clip_grad_norm_`` (``unscale_gradients()``) unscales the anchored gradients before it clips
  them, and ``optimizer_step_was_skipped`` reads ``step_was_skipped``.  Joined in fp16, a step
  the scaler skips steps the given LR schedulers exactly when accelerate's scheduler wrapper (and
  Trainer) would step theirs (``holds_back_schedulers``);
* refused, with the reason, before a step begins: DeepSpeed (its engine owns the optimizer),
  accelerate's FSDP plugin (it shards the model after the optimizer was built; ``fully_shard``
  then ``anchor_fsdp`` is the supported way), fp16 on a GPU without ``scaler=accelerator.scaler``
  (``accelerator.backward`` scales the loss there, and the step would apply the scaled
  gradients), and a scaler of its own (``backward`` scales with accelerate's).

Not done here: accelerate steps a *prepared* LR scheduler once per process per optimizer
step. Give the scheduler to ``AnchoredOptimizer(schedulers=[...])`` instead of to ``prepare``
(it then steps once per optimizer step, and ``save_state`` saves it inside the optimizer's state).
"""
from __future__ import annotations

import gc
import sys
import warnings


def _shared(module: str, cls: str) -> dict:
    mod = sys.modules.get(module)
    state = getattr(getattr(mod, cls, None), "_shared_state", None) if mod is not None else None
    return state if isinstance(state, dict) else {}


def defers_step() -> bool:
    """True on a micro-batch that accelerate's ``accumulate()`` does not end with a step."""
    return not _shared("accelerate.state", "GradientState").get("sync_gradients", True)


def join(opt, scaler, params=()):
    """Add ``opt`` to the optimizers of the Accelerator it trains under and return that
    Accelerator; None (and nothing done) when accelerate is not in use or none is found.  Which
    one: with accelerate's fp16, the one whose scaler is ``scaler`` (only that one: its clip
    must unscale ``opt``), none without a scaler; else the only one alive, or, with several,
    the one that prepared a model holding ``params[0]`` (known once ``prepare`` ran: the first
    step looks again).  Finding it walks the collector's objects (about 0.1 s), only under
    accelerate."""
    state = _shared("accelerate.state", "AcceleratorState")
    live = _alive() if state else []
    if not live:
        return None
    if state.get("_mixed_precision") == "fp16":      # without its scaler: refused at step() on a GPU
        live = [a for a in live if scaler is not None and a.scaler is scaler]
    elif len(live) > 1:
        live = [a for a in live if params and _prepared_a_model_with(a, params[0])]
    # an accelerate whose Accelerator keeps its optimizers otherwise: refused at step() in fp16
    return live[0] if len(live) == 1 and rejoin(opt, live[0]) else None


def _alive() -> list:
    cls = getattr(sys.modules.get("accelerate.accelerator"), "Accelerator", None)
    return [o for o in gc.get_objects() if issubclass(type(o), cls)] if cls is not None else []   # type(): no property read


def _prepared_a_model_with(accelerator, param) -> bool:
    return any(any(p is param for p in m.parameters()) for m in getattr(accelerator, "_models", ())
               if callable(getattr(m, "parameters", None)))


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


def holds_back_schedulers(accelerator, scaler, inner) -> bool:
    """Whether accelerate, joined through its fp16 ``scaler``, holds a prepared scheduler back on
    a step its scaler skipped, for the torch optimizer ``inner``.  Its wrapper calls a step
    skipped when ``GradScaler.step`` did not call the optimizer's; an optimizer that takes the
    scaler's inf flag itself (fused Adam, AdamW, SGD: torch's ``_step_supports_amp_scaling``) is
    always called, so accelerate, and Trainer after it, step the schedule on every step with
    those (read in accelerate 1.16's ``AcceleratedOptimizer.step``; seen on the H200 as Trainer's
    default fused AdamW).  A scaler of the loop's own is torch's recipe: the schedule steps."""
    return (accelerator is not None and scaler is not None and accelerator.scaler is scaler
            and not getattr(inner, "_step_supports_amp_scaling", False))


def before_step(opt) -> str | None:
    """At the start of ``opt.step()``: why accelerate's configuration refuses the step, or None.
    The first step looks for the Accelerator again if none was found at construction (``prepare``
    has run now), and a step puts the optimizer back among its optimizers after a
    ``free_memory()`` (in fp16 that step is refused: ``refusal``)."""
    if not opt._accelerator_looked:
        opt._accelerator_looked = True
        opt._accelerator = join(opt, opt.scaler, [q.p for q in opt._params[:1]])
        state = _shared("accelerate.state", "AcceleratorState")
        if opt._accelerator is None and state and state.get("_mixed_precision") != "fp16" and _alive():
            warnings.warn("gpu_anchor: AnchoredOptimizer found no Accelerator that prepared its model among the "
                          f"{len(_alive())} alive, so none has it among its optimizers: accelerator.save_state() "
                          "will not save it. Prepare the model with the Accelerator that checkpoints the job",
                          RuntimeWarning, stacklevel=4)
    why = refusal(opt.scaler, opt.device, opt._accelerator, opt)
    if why is None and opt._accelerator is not None:
        rejoin(opt, opt._accelerator)
    return why


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
