"""A Hugging Face Trainer job as a user writes it, for ``test_train_hf.py``.

A tiny Qwen3 with dropout (so the RNG matters), 20 samples, batches of 4 with two
micro-batches a step (so each epoch ends on a step of one micro-batch), warm-up then linear
decay, weight decay, gradient clipping, Trainer's default optimizer, nine steps over three
epochs.  After each step a line ``step <global step> <sha1 of every parameter's bytes>`` is
appended to the log; at the end, ``done <global step>``.
"""
from __future__ import annotations

import hashlib
import json
import os
import time
import warnings

import torch

import gpu_anchor

SAMPLES, BATCH, ACCUMULATE, STEPS = 20, 4, 2, 9
_extra_callbacks: list = []


class Tokens(torch.utils.data.Dataset):
    def __len__(self):
        return SAMPLES

    def __getitem__(self, i):
        ids = torch.randint(0, 256, (24,), generator=torch.Generator().manual_seed(1000 + i))
        return {"input_ids": ids, "labels": ids}


def build_model(lora: bool = False):
    """``lora``: peft's LoRA on the attention projections (rank 4, dropout 0.1); only the
    adapters train."""
    from transformers import Qwen3Config, Qwen3ForCausalLM
    config = Qwen3Config(vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=8, attention_dropout=0.1,
                         attn_implementation="eager")
    torch.manual_seed(0)
    model = Qwen3ForCausalLM(config)
    if lora:
        from peft import LoraConfig, get_peft_model
        model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, lora_dropout=0.1,
                                                 target_modules=["q_proj", "k_proj", "v_proj", "o_proj"]))
    return model


def arguments(out_dir: str, **overrides):
    from transformers import TrainingArguments
    kw = dict(output_dir=out_dir, per_device_train_batch_size=BATCH, gradient_accumulation_steps=ACCUMULATE,
              max_steps=STEPS, learning_rate=3e-3, warmup_steps=2, lr_scheduler_type="linear", weight_decay=0.01,
              max_grad_norm=1.0, logging_steps=1, save_strategy="no", report_to=[], use_cpu=True, seed=7,
              dataloader_num_workers=0, disable_tqdm=True)
    kw.update(overrides)
    return TrainingArguments(**kw)


def digest(model) -> str:
    h = hashlib.sha1()
    for _, p in sorted(model.named_parameters()):
        h.update(p.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def _log_callback(log_path: str, model):
    from transformers import TrainerCallback

    class LogSteps(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            with open(log_path, "a") as f:
                f.write(f"step {state.global_step} {digest(model)}\n")
    return LogSteps()


def run(namespace: str | None, log_path: str, out_dir: str, fault: str | None = None,
        resume_from_checkpoint=None, lora: bool = False, lend: int = 0, in_place: bool = False,
        **overrides) -> int:
    """One worker: ``namespace`` None trains with plain ``transformers.Trainer``; else with
    ``AnchoredTrainer`` on the host daemon's ``namespace``.  ``fault``: a
    ``GPU_ANCHOR_TRAIN_FAULT`` spec (the step protocol kills this process there);
    ``resume_from_checkpoint``: ``Trainer.train``'s; ``lora``: ``build_model``'s; ``lend``:
    ``StepProtocolConfig.lend_grad_bytes`` (a line ``lent <bytes>`` at the end); ``in_place``:
    ``StepProtocolConfig.grads_in_place`` (a line ``in_place <gradients>`` at the end).  Warnings are
    appended to ``out_dir/warnings``."""
    from transformers import Trainer
    if fault:
        os.environ["GPU_ANCHOR_TRAIN_FAULT"] = fault
    args = arguments(out_dir, **overrides)
    if namespace is None:
        model = build_model(lora).to(args.device)
        trainer = Trainer(model=model, args=args, train_dataset=Tokens(), eval_dataset=Tokens())
    else:
        from gpu_anchor.train import AnchoredTrainer
        with gpu_anchor.managed_scope(namespace=namespace):
            model = build_model(lora).to(args.device)     # where Trainer wants it (under DDP on CPU: cpu:0)
        from gpu_anchor.train import StepProtocolConfig
        trainer = AnchoredTrainer(model=model, args=args, train_dataset=Tokens(), eval_dataset=Tokens(),
                                  anchor_config=StepProtocolConfig(lend_grad_bytes=lend, grads_in_place=in_place))
    trainer.add_callback(_log_callback(log_path, model))
    for cb in _extra_callbacks:
        trainer.add_callback(cb)
    os.makedirs(out_dir, exist_ok=True)

    def record(message, *args, **kwargs):       # as each comes: a killed worker writes no summary
        with open(os.path.join(out_dir, "warnings"), "a") as f:
            f.write(f"{message}\n")
    warnings.showwarning = record
    warnings.simplefilter("always")
    trainer.train(resume_from_checkpoint=resume_from_checkpoint)
    logs = [{k: e[k] for k in ("step", "loss", "grad_norm", "learning_rate", "epoch") if k in e}
            for e in trainer.state.log_history if "loss" in e]
    with open(log_path, "a") as f:
        if lend:
            f.write(f"lent {trainer.anchored.lender.stats['lent_bytes']}\n")
        if in_place:
            f.write(f"in_place {trainer.anchored._grads.stats['in_place']}\n")
        f.write(f"logs {json.dumps(logs)}\n")
        f.write(f"done {trainer.state.global_step} {digest(model)}\n")
    return 0


def steps(log: str) -> dict[int, str]:
    """Each step's parameter digest; a step logged twice (a killed worker's step replayed)
    must have logged the same bits both times."""
    out: dict[int, str] = {}
    for line in log.splitlines():
        if line.startswith("step "):
            _, step, sha = line.split()
            if out.setdefault(int(step), sha) != sha:
                raise AssertionError(f"step {step} logged two different parameter digests")
    return out


def finished(log: str) -> tuple[int, str, list]:
    """The last worker's ``(global step, parameter digest, log history)``."""
    lines = log.splitlines()
    _, step, sha = lines[-1].split()
    return int(step), sha, json.loads(lines[-2].split(" ", 1)[1])


def rank_run(rank, world, store, namespace, cfg, log_path, fault, device, plain, width, parallel) -> None:
    """One DDP rank of the job under ``ddp_campaign.run_group`` (its ``target``): gloo over
    ``store``, then ``run`` as torchrun's worker would (``plain``: ``transformers.Trainer``)."""
    from datetime import timedelta

    import torch.distributed as dist
    from accelerate.state import AcceleratorState
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world),
                      OMP_NUM_THREADS="1")
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=60))
    AcceleratorState._reset_state(True)     # forked: not the parent's one-process state
    run(None if plain else namespace, log_path, os.path.join(os.path.dirname(log_path), f"out{rank}"), fault)
    dist.barrier()       # as ddp_campaign.rank_train: no rank leaves while its peer may need it


def _pace(seconds: float):
    from transformers import TrainerCallback

    class Pace(TrainerCallback):        # a longer step, so that a supervisor's chaos kill lands inside the job
        def on_step_end(self, args, state, control, **kwargs):
            time.sleep(seconds)
    return Pace()


if __name__ == "__main__":
    # a worker of `gpu-anchor run -- python hf_trainer_job.py LOG OUT STEPS STEP_SLEEP`, in the
    # namespace the supervisor gives the job (LOG.rank<r> and OUT.rank<r> with several ranks)
    # HF_JOB_CUDA=1: on this process's GPU, with torch's deterministic algorithms (a kill test
    # compares bits); HF_JOB_PLAIN=1: plain transformers.Trainer; HF_JOB_FP16=1 (with HF_JOB_CUDA):
    # fp16=True; GPU_ANCHOR_TRAIN_FAULT: a kill.
    import sys
    _extra_callbacks.append(_pace(float(sys.argv[4])))
    rank = f".rank{os.environ['RANK']}" if int(os.environ.get("WORLD_SIZE", "1")) > 1 else ""
    cuda = os.environ.get("HF_JOB_CUDA") == "1"
    if cuda:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True)
    namespace = None if os.environ.get("HF_JOB_PLAIN") == "1" else os.environ.get("GPU_ANCHOR_NAMESPACE", "default")
    sys.exit(run(namespace, sys.argv[1] + rank, sys.argv[2] + rank, os.environ.get("GPU_ANCHOR_TRAIN_FAULT"),
                 max_steps=int(sys.argv[3]), **({"use_cpu": False} if cuda else {}),
                 **({"fp16": True} if cuda and os.environ.get("HF_JOB_FP16") == "1" else {})))
