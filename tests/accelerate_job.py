"""A training loop written for Hugging Face accelerate, as its examples write one: a prepared
model, optimizer and shuffled data loader, gradient accumulation with ``accumulate()``,
``accelerator.backward`` and ``accelerator.clip_grad_norm_``, a transformers LR schedule.

``python accelerate_job.py plain|anchored NAMESPACE`` (``ACC_JOB_CUDA=1``: on the GPU; ``ACC_JOB_FP16=1`` as
well: accelerate's fp16, its scaler given to ``AnchoredOptimizer``, starting at a scale that overflows) prints one
``step N DIGEST LR`` line per optimizer step (the parameters' bytes hashed, the rate that step used; with fp16
the scale after it too) and ``end DIGEST``; ``rank_run`` is
one DDP rank of it under ``ddp_campaign.run_group``.  ``ACC_JOB_CKPT=DIR``: ``accelerator.save_state``
every other step, to ``DIR/step_N``, as accelerate's examples checkpoint; ``ACC_JOB_RESUME=DIR/step_N``
as well: ``accelerator.load_state`` of it first, as those examples resume (the anchored loop only when
``opt.completed_steps`` is 0: a fresh daemon, its state lost), then the loop goes on from the step the
checkpoint holds (``plain``: read from the folder's name, as the examples do; ``anchored``:
``opt.completed_steps``, which the load set).  ``ACC_JOB_KILL_AFTER_LOAD=1``: SIGKILLed right after that load.
``ACC_JOB_KILL_DAEMON_AT=N`` with ``ACC_JOB_DAEMON_PID``: that daemon SIGKILLed right after the
step-N checkpoint.  The anchored loop also resumes from a checkpoint of accelerate's own loop (a job moving to
gpu-anchor): it adds the step count and the scheduler's state to its optimizer's state by hand.  ``plain`` is accelerate's own loop with
a prepared ``AdamW`` and scheduler (its step counts times the processes, as accelerate's
examples write it: a prepared scheduler steps once per process per step); ``anchored`` differs
in the lines a user changes: the model and optimizer built in ``managed_scope``, the scheduler
given to ``AnchoredOptimizer`` with one rank's step counts (not prepared, never stepped by the
loop), and the loop starting at ``opt.completed_steps``.
"""
import hashlib
import math
import os
import signal
import sys
import time

import torch
from accelerate import Accelerator, DataLoaderConfiguration
from accelerate.utils import GradScalerKwargs
from transformers import Qwen3Config, Qwen3ForCausalLM, get_scheduler

ACCUM, BATCH, SAMPLES, WARMUP = 3, 2, 20, 2     # one process: 10 micro-batches an epoch, steps
                                                # end at 3, 6, 9, 10; two: at 3, 5
EPOCHS = int(os.environ.get("ACC_JOB_EPOCHS", "2"))
STEP_SLEEP = float(os.environ.get("ACC_JOB_SLEEP", "0"))     # a longer step, for a supervisor's chaos kills


def steps_per_epoch(world: int) -> int:
    return math.ceil(math.ceil(SAMPLES / BATCH / world) / ACCUM)


def build(schedule_steps: int, warmup: int, device):
    config = Qwen3Config(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=8, attention_dropout=0.1)
    torch.manual_seed(0)
    model = Qwen3ForCausalLM(config).to(device)     # where prepare() would put it (a move copies)
    inner = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    sched = get_scheduler("cosine", inner, num_warmup_steps=warmup, num_training_steps=schedule_steps)
    return model, inner, sched


def digest(model) -> str:
    h = hashlib.sha256()
    for p in model.parameters():
        h.update(p.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()[:16]


def main(mode: str, namespace: str, out=sys.stdout) -> None:
    # Several CPU processes: accelerate places each one's model on cpu:0, and torch copies a
    # CPU tensor moved there, out of anchored memory (AnchoredOptimizer's step says so).
    several = int(os.environ.get("WORLD_SIZE", "1")) > 1
    cuda = os.environ.get("ACC_JOB_CUDA") == "1"      # this process's GPU, torch's deterministic algorithms
    if cuda:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True)
    fp16 = cuda and os.environ.get("ACC_JOB_FP16") == "1"
    # fp16: a first scale that overflows, backing off fast and growing after every good step,
    # so that skipped and applied steps mix
    scaling = [GradScalerKwargs(init_scale=2.0 ** 24, backoff_factor=2.0 ** -4, growth_interval=1)] if fp16 else []
    accelerator = Accelerator(cpu=not cuda, gradient_accumulation_steps=ACCUM, device_placement=cuda or not several,
                              mixed_precision="fp16" if fp16 else "no", kwargs_handlers=scaling,
                              dataloader_config=DataLoaderConfiguration(use_seedable_sampler=True))
    rows = torch.randint(0, 128, (SAMPLES, 16), generator=torch.Generator().manual_seed(1))
    # The loader's own generator: a new iterator draws its seed from it, not from torch's global
    # RNG, which a restarted worker has just set to where the dropout of the next step starts.
    loader = torch.utils.data.DataLoader(rows, batch_size=BATCH, shuffle=True, generator=torch.Generator().manual_seed(2))
    world = accelerator.num_processes
    per_epoch = steps_per_epoch(world)
    ckpt, resume = os.environ.get("ACC_JOB_CKPT"), os.environ.get("ACC_JOB_RESUME")
    if mode == "plain":
        model, opt, sched = build(per_epoch * EPOCHS * world, WARMUP * world, accelerator.device)
        model, opt, loader, sched = accelerator.prepare(model, opt, loader, sched)
        start = 0
        if resume:
            accelerator.load_state(resume)
            start = int(os.path.basename(resume).replace("step_", ""))
    else:
        import gpu_anchor
        from gpu_anchor.train import AnchoredOptimizer
        with gpu_anchor.managed_scope(namespace=namespace, require=True):
            model, inner, sched = build(per_epoch * EPOCHS, WARMUP, accelerator.device)
            opt = AnchoredOptimizer(inner, model=model, schedulers=[sched], scaler=accelerator.scaler)
        model, opt, loader = accelerator.prepare(model, opt, loader)
        if resume and opt.completed_steps == 0:
            accelerator.load_state(resume)
            if not os.path.exists(os.path.join(resume, "scheduler.bin")):
                pass          # written by an anchored job: its optimizer's state carries the rest
            else:             # written by accelerate's own loop: add what the anchored state_dict carries
                sd = opt.state_dict()
                sd["param_groups"][0]["gpu_anchor"] = {"completed_steps": int(os.path.basename(resume).replace("step_", "")),
                                    "schedulers": [torch.load(os.path.join(resume, "scheduler.bin"), weights_only=True)]}
                opt.load_state_dict(sd)
            if os.environ.get("ACC_JOB_KILL_AFTER_LOAD") == "1":
                os.kill(os.getpid(), signal.SIGKILL)
        start = opt.completed_steps
    step = start
    first_epoch, done = divmod(start, per_epoch)
    for epoch in range(first_epoch, EPOCHS):
        loader.set_epoch(epoch)
        batches = accelerator.skip_first_batches(loader, done * ACCUM) if epoch == first_epoch and done else loader
        for ids in batches:
            with accelerator.accumulate(model):
                loss = model(input_ids=ids, labels=ids).loss
                accelerator.backward(loss)
                if accelerator.sync_gradients:
                    accelerator.clip_grad_norm_(model.parameters(), 1.0)
                lr = opt.param_groups[0]["lr"]
                opt.step()
                if mode == "plain":
                    sched.step()
                opt.zero_grad()
            if accelerator.sync_gradients:
                step += 1
                scale = f" {accelerator.scaler.get_scale()!r}" if fp16 else ""
                print(f"step {step} {digest(model)} {lr!r}{scale}", file=out, flush=True)
                if ckpt and step % 2 == 0:
                    accelerator.save_state(os.path.join(ckpt, f"step_{step}"))
                    if step == int(os.environ.get("ACC_JOB_KILL_DAEMON_AT", "-1")):     # the daemon dies
                        os.kill(int(os.environ["ACC_JOB_DAEMON_PID"]), signal.SIGKILL)
                time.sleep(STEP_SLEEP)
    print(f"end {digest(model)}", file=out, flush=True)


def rank_run(rank, world, store, namespace, cfg, log_path, fault, device, plain, width, parallel) -> None:
    """One DDP rank under ``ddp_campaign.run_group`` (its ``target``): gloo over ``store``, then
    the loop as ``accelerate launch``'s worker would run it, its lines appended to ``log_path``."""
    from datetime import timedelta

    import torch.distributed as dist
    from accelerate.state import AcceleratorState
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world),
                      OMP_NUM_THREADS="1")
    if fault:
        os.environ["GPU_ANCHOR_TRAIN_FAULT"] = fault
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=60))
    AcceleratorState._reset_state(True)     # forked: not the parent's one-process state
    with open(log_path, "a") as out:
        main("plain" if plain else "anchored", namespace, out)
    dist.barrier()       # no rank leaves while its peer may need it


if __name__ == "__main__":
    # python accelerate_job.py MODE [NAMESPACE]: without NAMESPACE, the one a supervisor gives
    # (`gpu-anchor run [--nproc-per-node N] -- python accelerate_job.py anchored`); ACC_JOB_LOG:
    # the lines go to that file (LOG.rank<r> with several ranks), else to stdout.
    namespace = sys.argv[2] if len(sys.argv) > 2 else os.environ.get("GPU_ANCHOR_NAMESPACE", "default")
    log = os.environ.get("ACC_JOB_LOG")
    if log and int(os.environ.get("WORLD_SIZE", "1")) > 1:
        log += f".rank{os.environ['RANK']}"
    with open(log, "a") if log else open(os.dup(1), "w") as out:
        main(sys.argv[1], namespace, out)
