"""A training loop written for Hugging Face accelerate, as its examples write one: a prepared
model, optimizer and shuffled data loader, gradient accumulation with ``accumulate()``,
``accelerator.backward`` and ``accelerator.clip_grad_norm_``, a transformers LR schedule.

``python accelerate_job.py plain|anchored NAMESPACE`` prints one ``step N DIGEST LR`` line
per optimizer step (the parameters' bytes hashed, the rate that step used).  ``plain`` is
accelerate's own loop with a prepared ``AdamW`` and scheduler; ``anchored`` differs in the
lines a user changes: the model and optimizer built in ``managed_scope``, the scheduler given
to ``AnchoredOptimizer`` (not prepared, never stepped by the loop), and the loop starting at
``opt.completed_steps``.
"""
import hashlib
import math
import sys

import torch
from accelerate import Accelerator, DataLoaderConfiguration
from transformers import Qwen3Config, Qwen3ForCausalLM, get_scheduler

ACCUM, BATCH, SAMPLES, EPOCHS = 3, 2, 20, 2        # 10 micro-batches an epoch: steps end at 3, 6, 9, 10
STEPS_PER_EPOCH = math.ceil(SAMPLES // BATCH / ACCUM)
STEPS = STEPS_PER_EPOCH * EPOCHS


def build():
    config = Qwen3Config(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=8, attention_dropout=0.1)
    torch.manual_seed(0)
    model = Qwen3ForCausalLM(config)
    inner = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    sched = get_scheduler("cosine", inner, num_warmup_steps=2, num_training_steps=STEPS)
    return model, inner, sched


def digest(model) -> str:
    h = hashlib.sha256()
    for p in model.parameters():
        h.update(p.detach().contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()[:16]


def main(mode: str, namespace: str) -> None:
    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=ACCUM,
                              dataloader_config=DataLoaderConfiguration(use_seedable_sampler=True))
    rows = torch.randint(0, 128, (SAMPLES, 16), generator=torch.Generator().manual_seed(1))
    # The loader's own generator: a new iterator draws its seed from it, not from torch's global
    # RNG, which a restarted worker has just set to where the dropout of the next step starts.
    loader = torch.utils.data.DataLoader(rows, batch_size=BATCH, shuffle=True, generator=torch.Generator().manual_seed(2))
    if mode == "plain":
        model, opt, sched = build()
        model, opt, loader, sched = accelerator.prepare(model, opt, loader, sched)
        start = 0
    else:
        import gpu_anchor
        from gpu_anchor.train import AnchoredOptimizer
        with gpu_anchor.managed_scope(namespace=namespace, require=True):
            model, inner, sched = build()
            opt = AnchoredOptimizer(inner, model=model, schedulers=[sched])
        model, opt, loader = accelerator.prepare(model, opt, loader)
        start = opt.completed_steps
    step = start
    first_epoch, done = divmod(start, STEPS_PER_EPOCH)
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
                print(f"step {step} {digest(model)} {lr!r}", flush=True)


if __name__ == "__main__":
    main(*sys.argv[1:3])
