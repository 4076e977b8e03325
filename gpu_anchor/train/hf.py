"""``AnchoredTrainer``: Hugging Face's ``transformers.Trainer`` on anchored state.

    args = TrainingArguments(...)
    with gpu_anchor.managed_scope():
        model = AutoModelForCausalLM.from_pretrained(name).to(args.device)   # where Trainer wants it
    trainer = AnchoredTrainer(model=model, args=args, train_dataset=ds)
    trainer.train()      # a worker started again continues at the step the last one committed

A trainer built on ``Trainer`` (TRL's ``SFTTrainer``, say) takes it as the first base:
``class AnchoredSFTTrainer(AnchoredTrainer, SFTTrainer): pass``.

The contract:

- **The optimizer.**  The model's parameters are anchored (built in ``managed_scope``, or
  ``anchor_module``).  The torch optimizer Trainer builds (``args.optim``, its weight-decay
  groups) or the one passed in ``optimizers=`` is wrapped in an ``AnchoredOptimizer``
  (``anchor_config``: its ``StepProtocolConfig``) when ``train()`` starts, before the loop
  decides where to begin: its constructor is where a killed step is finished or discarded.
- **The LR scheduler** (``args.lr_scheduler_type``, or the one passed in) is built on the torch
  optimizer before that, and steps inside the anchored step, its state committed with it;
  Trainer's own ``lr_scheduler.step()`` call after ``optimizer.step()`` does nothing.
- **Where the loop stands.**  Each step commits, with its gradients' boundary, Trainer's state
  as it is once that step is done (global step, epoch, FLOs, tokens seen, best metric) and Python's,
  NumPy's and torch's RNG states.  ``train()`` on a journal with committed steps resumes through
  Trainer's own resume path from that state: the same epoch and position in it (its data loader
  skips the batches already trained, in the seedable sampler's order), the RNG states set where
  Trainer sets a checkpoint's.  No model, optimizer, scheduler, scaler or RNG file is read: they
  are anchored or carried.  ``state.log_history`` is not carried (it grows with the run): after a
  restart it holds what was logged since, and the earlier entries are where ``report_to`` sent
  them when they were logged.  A data collator that draws random numbers draws the first batch
  after a restart before the RNG states are set (Trainer sets them after fetching it).  The anchored state is newer than any checkpoint on disk, so a
  ``resume_from_checkpoint`` given as well is not read (a warning says so); with no committed
  step (a new daemon after the old one was lost) Trainer reads that checkpoint as usual, into
  the anchored memory.
- **Several ranks** (``torchrun``; DDP through accelerate): the optimizer is anchored, and the
  ranks agree on a killed step, before accelerate wraps the model (DDP broadcasts rank 0's
  weights when it is built).  Trainer places the model on ``args.device`` when it is built:
  build it there, inside the scope (a parameter outside anchored memory is refused, naming it).
- **Refused, with the reason** (not silently run unanchored): an ``AnchoredOptimizer`` passed in
  (this class builds its own), ``model_init`` / hyper-parameter search, DeepSpeed and FSDP
  through accelerate, ``reduce_lr_on_plateau`` (stepped with a metric, outside the optimizer step),
  ``auto_find_batch_size``, and on transformers before 5.3 an epoch whose batches do not divide
  by ``gradient_accumulation_steps`` (that Trainer resumes such an epoch wrongly).
"""
from __future__ import annotations

import dataclasses
import inspect
import os
import random
import shutil
import tempfile
import warnings

import numpy as np
import torch
import transformers
from transformers import Trainer, TrainerCallback
from transformers.trainer_callback import TrainerState
from transformers.trainer_utils import TrainOutput

from . import hf_accelerate, layout
from .config import StepProtocolConfig
from .optimizer import AnchoredOptimizer

LOOP_KEY = "hf_trainer"      # AnchoredOptimizer.loop_state[LOOP_KEY]: what the next worker resumes from
STATE_FILE = "trainer_state.json"     # transformers' TRAINER_STATE_NAME


def _resume_is_wrong_here(version: str, loader, accumulate: int) -> str | None:
    """Why Trainer's resume would not continue where the killed run was, else None.  Before
    transformers 5.3 the resumed epoch counts its steps from the skipped batches on, so an
    epoch whose batches do not divide by the accumulation ends its last, shorter step without
    a sync: it is merged into the next epoch's first (Trainer's own checkpoints resume the same
    way; seen with 4.56.2)."""
    major, minor = (int(x) for x in version.split(".")[:2])
    if (major, minor) >= (5, 3) or accumulate <= 1 or not hasattr(loader, "__len__"):
        return None
    n = len(loader)
    if n % accumulate == 0:
        return None
    return (f"transformers {version} resumes a position inside an epoch wrongly when the epoch's {n} batches do not "
            f"divide by gradient_accumulation_steps={accumulate} (the epoch's last, shorter step is merged into "
            "the next epoch's first; its own checkpoints resume the same way): use transformers >= 5.3, or a "
            "batch count that divides")


class _SteppedWithTheOptimizer:
    """Trainer's handle on the LR scheduler.  ``AnchoredOptimizer`` steps the scheduler inside its
    step and commits its state with it, so Trainer's own ``step()`` call after the optimizer's
    does nothing; between the two, ``get_last_lr`` still gives the rate the step used, which is
    what Trainer logs.  The rest (``state_dict``, ``load_state_dict``, ...) is the scheduler's."""

    def __init__(self, scheduler) -> None:
        self.scheduler = scheduler
        self._used: list | None = None

    def before_step(self) -> None:
        self._used = self.scheduler.get_last_lr()

    def get_last_lr(self) -> list:
        return self._used if self._used is not None else self.scheduler.get_last_lr()

    def step(self, *args, **kwargs) -> None:
        self._used = None

    def __getattr__(self, name):
        return getattr(self.scheduler, name)


class _CarryLoop(TrainerCallback):
    """Puts into the step's carried loop state what Trainer's resume reads from a checkpoint."""

    def __init__(self, trainer: "AnchoredTrainer") -> None:
        self.trainer = trainer

    def on_pre_optimizer_step(self, args, state, control, **kwargs):
        # Not the log history: it grows with the run, and this is journaled at every step.
        done = {f.name: getattr(state, f.name) for f in dataclasses.fields(state) if f.name != "log_history"}
        done["global_step"] = state.global_step + 1     # as it is once this step is done
        rng = {"python": random.getstate(), "numpy": np.random.get_state(), "cpu": torch.get_rng_state()}
        if torch.cuda.is_available():
            rng["cuda"] = torch.cuda.get_rng_state_all()
        self.trainer.anchored.loop_state[LOOP_KEY] = {"state": done, "rng": rng}
        self.trainer._scheduler_handle.before_step()

    def on_step_end(self, args, state, control, **kwargs):
        # Trainer clears the gradients with model.zero_grad(); the optimizer's own zero_grad
        # marks the boundary between steps (and opens gradient lending's window, if configured).
        self.trainer.anchored.zero_grad()


class AnchoredTrainer(Trainer):
    """``transformers.Trainer`` whose optimizer step survives SIGKILL at any instant and whose
    ``train()`` resumes at the last committed step (module docstring: the contract).
    ``anchor_config``: the ``StepProtocolConfig`` of the ``AnchoredOptimizer`` it builds."""

    def __init__(self, *args, anchor_config: StepProtocolConfig | None = None, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.anchor_config = anchor_config
        self.anchored: AnchoredOptimizer | None = None
        self._scheduler_handle = None
        self._resume_dir = None
        self._planned_steps = 0
        why = self._unsupported()
        if why:
            raise ValueError(f"AnchoredTrainer: {why}")
        self.add_callback(_CarryLoop(self))

    def _unsupported(self) -> str | None:
        a = self.args
        if isinstance(self.optimizer, AnchoredOptimizer):
            return ("pass the torch optimizer (optimizers=(torch.optim.AdamW(...), None)) or none (args.optim): "
                    "AnchoredTrainer wraps it in an AnchoredOptimizer itself, with Trainer's LR scheduler inside")
        if self.model_init is not None:
            return "model_init builds a new model for each run; build the model once, in managed_scope"
        if self.is_deepspeed_enabled or self.is_fsdp_enabled:
            return "DeepSpeed and FSDP through accelerate own the optimizer state; they are not anchored"
        if str(getattr(a.lr_scheduler_type, "value", a.lr_scheduler_type)) == "reduce_lr_on_plateau":
            return "reduce_lr_on_plateau steps with a metric after evaluation, outside the optimizer step"
        if a.auto_find_batch_size:
            return "auto_find_batch_size changes the batch size, and with it the step, between attempts"
        return None

    # ---------------------------------------------------------------- Trainer's hooks
    def train(self, resume_from_checkpoint=None, trial=None, ignore_keys_for_eval=None, **kwargs):
        self._anchor()
        carried = self.anchored.loop_state.get(LOOP_KEY)
        if carried is not None and carried["state"]["global_step"] >= self._planned_steps:
            # The last worker committed the last step (and died before returning): nothing to
            # train.  Trainer's resume would run one more step before it checks.
            self.state = TrainerState(**carried["state"])
            return TrainOutput(self.state.global_step, float("nan"), {})
        if carried is not None:
            if resume_from_checkpoint:
                warnings.warn(f"AnchoredTrainer: resume_from_checkpoint={resume_from_checkpoint!r} is not read: the "
                              f"anchored state, at step {carried['state']['global_step']}, is newer", stacklevel=2)
            self._resume_dir = tempfile.mkdtemp(prefix="gpu-anchor-resume-")
            TrainerState(**carried["state"]).save_to_json(os.path.join(self._resume_dir, STATE_FILE))
            resume_from_checkpoint = self._resume_dir
        try:
            return super().train(resume_from_checkpoint=resume_from_checkpoint, trial=trial,
                                 ignore_keys_for_eval=ignore_keys_for_eval, **kwargs)
        finally:
            if self._resume_dir is not None:
                shutil.rmtree(self._resume_dir, ignore_errors=True)
                self._resume_dir = None

    def create_optimizer(self, model=None):
        if self.anchored is not None:
            return self.anchored
        return super().create_optimizer(model)

    def create_scheduler(self, num_training_steps: int, optimizer=None):
        if self._scheduler_handle is not None:
            if self.anchored._accelerator is not None:
                # train() began with accelerator.free_memory(), which dropped the optimizer from
                # those its clip unscales in fp16; Trainer makes the scheduler after that
                hf_accelerate.rejoin(self.anchored, self.anchored._accelerator)
            self.lr_scheduler = self._scheduler_handle
            return self.lr_scheduler
        return super().create_scheduler(num_training_steps, optimizer)

    def _move_model_to_device(self, model, device):
        # Torch copies a CPU tensor on `.to("cpu:N")` (the device Trainer gives each rank of a
        # CPU group) though it is on the CPU already: a move that changes nothing must not take
        # the weights out of anchored memory.  Any other move goes ahead (and is refused at
        # train(), with the fix, if it took the weights out).
        if torch.device(device).type == "cpu" and all(p.device.type == "cpu" for p in model.parameters()):
            return
        super()._move_model_to_device(model, device)

    def _load_from_checkpoint(self, resume_from_checkpoint, model=None):
        if resume_from_checkpoint != self._resume_dir:      # the weights are anchored
            return super()._load_from_checkpoint(resume_from_checkpoint, model)

    def _load_optimizer_and_scheduler(self, checkpoint):
        if checkpoint != self._resume_dir:                 # so are the optimizer and the scheduler
            super()._load_optimizer_and_scheduler(checkpoint)
            if checkpoint is not None:     # Trainer loads the scheduler after the optimizer: commit it too
                self.anchored._commit_loaded()

    def _load_scaler(self, checkpoint):
        if checkpoint != self._resume_dir:
            return super()._load_scaler(checkpoint)

    def _load_rng_state(self, checkpoint):
        if checkpoint is None or checkpoint != self._resume_dir:
            return super()._load_rng_state(checkpoint)
        rng = self.anchored.loop_state[LOOP_KEY]["rng"]
        random.setstate(rng["python"])
        np.random.set_state(rng["numpy"])
        torch.set_rng_state(rng["cpu"])
        if "cuda" in rng and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(rng["cuda"])

    # ---------------------------------------------------------------- the anchored optimizer
    def _anchor(self) -> None:
        """Build the torch optimizer and the scheduler as Trainer would, then the AnchoredOptimizer
        over both (which recovers a killed step here, before the loop reads where it stands)."""
        if self.anchored is not None:
            return
        moved = layout.outside_anchored((n, p) for n, p in self.model.named_parameters() if p.requires_grad)
        if moved:
            raise ValueError(
                f"AnchoredTrainer: {len(moved)} trainable parameter(s) are not in anchored memory ({', '.join(moved[:3])}"
                f"{', ...' if len(moved) > 3 else ''}). Trainer places the model on args.device ({self.args.device}) "
                "when it is built, and a move copies it out of anchored memory: build the model on that device "
                "inside gpu_anchor.managed_scope() (`.to(args.device)` in the block).")
        if self.args.device.type == "cpu":
            self.accelerator.device_placement = False      # accelerate's .to("cpu:N"): the copy above
        inner = super().create_optimizer()
        if not isinstance(inner, torch.optim.Optimizer):
            raise TypeError(f"AnchoredTrainer: the optimizer is a {type(inner).__name__}, not a torch.optim.Optimizer")
        loader = self.get_train_dataloader()
        why = _resume_is_wrong_here(transformers.__version__, loader, self.args.gradient_accumulation_steps)
        if why:
            raise ValueError(f"AnchoredTrainer: {why}")
        self._planned_steps = self._max_steps(loader)
        scheduler = super().create_scheduler(self._planned_steps, optimizer=inner)
        self._created_lr_scheduler = False      # Trainer drops a scheduler it made at each train(); this one stays
        # fp16: the step unscales with accelerate's scaler (or its clip_grad_norm_ did).  It joins
        # the Accelerator's optimizers, so that optimizer_step_was_skipped reads it (hf_accelerate)
        self.anchored = AnchoredOptimizer(inner, model=self.model, schedulers=[scheduler],
                                          scaler=self.accelerator.scaler, config=self.anchor_config)
        if self.anchored._accelerator is None and hf_accelerate.rejoin(self.anchored, self.accelerator):
            self.anchored._accelerator = self.accelerator     # not found by the optimizer: Trainer's is this one
        self.anchored._accelerator_looked = True
        self.optimizer = self.anchored
        self.lr_scheduler = self._scheduler_handle = _SteppedWithTheOptimizer(scheduler)

    def _max_steps(self, loader) -> int:
        """The step count Trainer gives its scheduler (the last of ``set_initial_training_values``)."""
        args = self.args
        f = self.set_initial_training_values
        if "total_train_batch_size" in inspect.signature(f).parameters:      # transformers 4.x
            return f(args, loader, self._train_batch_size * args.gradient_accumulation_steps * args.world_size)[-1]
        return f(args, loader)[-1]
