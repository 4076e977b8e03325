"""FSDP2 training of a Llama / Qwen2-shaped model under the protocol, one process per GPU.

Two ways to run a rank:

* by the kill campaign (``ddp_campaign.run_group(..., parallel="fsdp:<shape>")``), which
  calls ``rank_train`` with a file rendezvous and a per-rank namespace;
* under ``gpu-anchor torchrun`` / ``gpu-anchor run`` (issue 9), as a script:

      gpu-anchor torchrun --nproc-per-node 8 -m gpu_anchor.testing.fsdp_llama \\
          --shape qwen14b --steps 50 --log-dir /tmp/fsdp14b

  (env:// rendezvous from torchrun's variables, namespace from the supervisor).

The model is built on every rank from the same seed (``SHAPES``; random weights,
bf16), ``fully_shard`` per decoder layer plus the root, the shards anchored
(``anchor_fsdp``), AdamW wrapped in ``AnchoredOptimizer``.  Tokens are synthetic,
drawn from ``(seed, step, rank)``.  Each rank appends to ``<log>``: ``resume <step>
<construct_s>``, ``<step> <loss hex bits> <loss>`` per iteration, ``stats <json>``
(step time, protocol commit/wait time) and ``digest <sha256>`` at the end.
"""
from __future__ import annotations

import argparse
import json
import os
import struct
import time

SHAPES = {
    # name: (architecture, config) — tiny runs on CPU; qwen14b is Qwen2.5-14B's shape
    "tiny": ("llama", dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                           num_key_value_heads=2, head_dim=16, vocab_size=256)),
    "small": ("llama", dict(hidden_size=1024, intermediate_size=2816, num_hidden_layers=8, num_attention_heads=16,
                            num_key_value_heads=4, head_dim=64, vocab_size=32000)),
    "qwen14b": ("qwen2", dict(hidden_size=5120, intermediate_size=13824, num_hidden_layers=48,
                              num_attention_heads=40, num_key_value_heads=8, vocab_size=152064,
                              rope_theta=1000000.0, rms_norm_eps=1e-6)),
}


def build(shape: str, device, seed: int = 0):
    import torch
    arch, kw = SHAPES[shape]
    if arch == "qwen2":
        from transformers import Qwen2Config as Cfg
        from transformers import Qwen2ForCausalLM as Model
    else:
        from transformers import LlamaConfig as Cfg
        from transformers import LlamaForCausalLM as Model
    cfg = Cfg(**kw, tie_word_embeddings=False, max_position_embeddings=4096)
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(seed)
    with torch.device(device):
        return Model(cfg).to(torch.bfloat16)


def preload(shape: str) -> None:
    """Import what ``rank_train`` imports (the model's transformers module, FSDP2) in the
    process that forks CPU ranks, so that a rank forked after each kill does not again."""
    import torch.distributed.device_mesh  # noqa: F401
    import torch.distributed.fsdp  # noqa: F401
    if SHAPES[shape][0] == "qwen2":
        from transformers import Qwen2Config, Qwen2ForCausalLM  # noqa: F401
    else:
        from transformers import LlamaConfig, LlamaForCausalLM  # noqa: F401


def shard(model, dev, world: int) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    mesh = init_device_mesh(dev.type, (world,))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)


def rank_train(rank: int, world: int, init_method: str, namespace: str | None, shape: str, steps: int,
               log_path: str, device: str, *, batch: int = 2, seq: int = 256, seed: int = 0, fault: str | None = None,
               plain: bool = False, chunk_bytes: int | None = None) -> None:
    import torch
    import torch.distributed as dist
    from datetime import timedelta

    import gpu_anchor

    from gpu_anchor.train import faults
    from gpu_anchor.train.fsdp import anchor_fsdp
    from gpu_anchor.train.optimizer import AnchoredOptimizer

    t0 = time.perf_counter()
    faults.arm(fault)
    dev = torch.device(device)
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    dist.init_process_group("nccl" if dev.type == "cuda" else "gloo", init_method=init_method, rank=rank,
                            world_size=world, timeout=timedelta(seconds=300))
    model = build(shape, dev, seed)
    shard(model, dev, world)
    inner = torch.optim.AdamW(model.parameters(), lr=3e-4, weight_decay=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(inner, lambda s: min(1.0, (s + 1) / 5))
    if plain:
        opt, start = inner, 0
    else:
        client = gpu_anchor.connect(device, namespace=namespace)
        anchor_fsdp(model, client)
        opt = AnchoredOptimizer(inner, model=model, client=client, schedulers=[sched], chunk_bytes=chunk_bytes)
        start = opt.completed_steps
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
    fd = os.open(log_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    os.write(fd, f"resume {start} {time.perf_counter() - t0:.3f}\n".encode())
    vocab = model.config.vocab_size
    times = []
    for step in range(start, steps):
        ts = time.perf_counter()
        g = torch.Generator().manual_seed(seed * 1000003 + step * 1009 + rank)
        tokens = torch.randint(0, vocab, (batch, seq), generator=g).to(dev)
        loss = model(input_ids=tokens, labels=tokens).loss
        loss.backward()
        v = float(loss.detach())
        os.write(fd, f"{step} {struct.unpack('<I', struct.pack('<f', v))[0]:08x} {v!r}\n".encode())
        opt.step()
        if plain:
            sched.step()
        opt.zero_grad()
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        times.append(time.perf_counter() - ts)
    stats = {"steps_run": len(times), "step_s_median": sorted(times)[len(times) // 2] if times else None}
    if not plain:
        stats.update({k: v for k, v in opt.stats.items()}, chunks=opt.num_chunks, undo_bytes=opt.undo_bytes)
        from .ddp_campaign import state_digest
        os.write(fd, f"stats {json.dumps(stats)}\n".encode())
        os.write(fd, f"digest {state_digest(model, opt)}\n".encode())
    os.write(fd, f"done {steps}\n".encode())
    os.close(fd)
    dist.destroy_process_group()


def parse(log: str) -> dict:
    """``{"losses": {step: [float, ...]}, "bits": {step: [hex, ...]}, "resumes": [step, ...], "stats": [...]}``."""
    out = {"losses": {}, "bits": {}, "resumes": [], "stats": [], "digests": []}
    for line in log.splitlines():
        head, _, rest = line.partition(" ")
        if head == "resume":
            out["resumes"].append(int(rest.split()[0]))
        elif head == "stats":
            out["stats"].append(json.loads(rest))
        elif head == "digest":
            out["digests"].append(rest)
        elif head.isdigit():
            bits, val = rest.split()
            out["bits"].setdefault(int(head), []).append(bits)
            out["losses"].setdefault(int(head), []).append(float(val))
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", choices=sorted(SHAPES), default="small")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--log-dir", required=True)
    ap.add_argument("--plain", action="store_true", help="plain FSDP2, no anchoring (the baseline)")
    args = ap.parse_args(argv)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local = int(os.environ.get("LOCAL_RANK", rank))
    import torch
    device = f"cuda:{local}" if torch.cuda.is_available() else "cpu"
    os.makedirs(args.log_dir, exist_ok=True)
    rank_train(rank, world, "env://", None, args.shape, args.steps, os.path.join(args.log_dir, f"rank{rank}.log"),
               device, batch=args.batch, seq=args.seq, plain=args.plain)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
