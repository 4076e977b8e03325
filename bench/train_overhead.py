"""Steady-state cost of AnchoredOptimizer vs plain PyTorch (same model, same warm process).

    python -m bench train_overhead [--tiny] [--device cuda:0] [--steps 10] [--batch 8 --seq 2048]
                                   [--progress device|journal] [--out DIR]

Llama3.2-1B shape (transformers, bf16 weights, AdamW foreach, random tokens) on the GPU;
``--tiny`` runs the same architecture at toy size on the CPU.  Plain first, then
anchored, in one process (warm vs warm).  Per mode: median step time (forward +
backward + step + zero_grad, device-synchronised), median ``optimizer.step()`` time
alone, peak memory.  Reports step-time overhead, extra memory (torch peak + anchored
bytes vs plain torch peak), the protocol's per-step blocking time (anchored step()
minus plain step()), journal commits and host waits per step.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time


def _llama(tiny: bool, device: str, seed: int):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM
    kw = dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
              num_key_value_heads=8, head_dim=64, vocab_size=128256, tie_word_embeddings=True,
              rope_theta=500000.0, rms_norm_eps=1e-5, max_position_embeddings=131072)
    if tiny:
        kw.update(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=16, vocab_size=256, max_position_embeddings=2048)
    cfg = LlamaConfig(**kw)
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(seed)
    with torch.device(device):
        return LlamaForCausalLM(cfg).to(torch.bfloat16)


def _sync(device):
    import torch
    if device.startswith("cuda"):
        torch.cuda.synchronize(device)


def _measure(model, opt, device, batch, seq, steps, warmup, vocab):
    import torch
    g = torch.Generator().manual_seed(0)
    tokens = [torch.randint(0, vocab, (batch, seq), generator=g).to(device) for _ in range(2)]
    step_t, opt_t, losses = [], [], []
    for i in range(warmup + steps):
        _sync(device)
        t0 = time.perf_counter()
        loss = model(input_ids=tokens[i % 2], labels=tokens[i % 2]).loss
        loss.backward()
        _sync(device)
        t1 = time.perf_counter()
        opt.step()
        _sync(device)
        t2 = time.perf_counter()
        opt.zero_grad()
        _sync(device)
        t3 = time.perf_counter()
        losses.append(float(loss.detach()))
        if i >= warmup:
            step_t.append(t3 - t0)
            opt_t.append(t2 - t1)
    return statistics.median(step_t), statistics.median(opt_t), losses


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--device", default=None)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--progress", default=None, choices=["device", "journal"])
    ap.add_argument("--chunk-bytes", type=int, default=None)
    ap.add_argument("--out", default=None, help="result directory (default bench/results)")
    args = ap.parse_args(argv)
    device = args.device or ("cpu" if args.tiny else "cuda:0")
    if args.tiny:
        args.batch, args.seq = min(args.batch, 2), min(args.seq, 64)

    import torch

    import gpu_anchor
    from gpu_anchor.daemon import control
    from gpu_anchor.train import AnchoredOptimizer, anchor_module

    tmp = tempfile.mkdtemp(prefix="ga-train-overhead-")
    sock = os.path.join(tmp, device.replace(":", "") + ".sock")
    daemon = control.start(device, sock)
    out = {"model": "llama3.2-1b" + (" (tiny)" if args.tiny else ""), "device": device,
           "dtype": "bfloat16", "optimizer": "AdamW (foreach default)", "batch": args.batch, "seq": args.seq,
           "steps": args.steps, "warmup": args.warmup}
    try:
        if device.startswith("cuda"):
            out["gpu"] = torch.cuda.get_device_name(device)
            torch.cuda.reset_peak_memory_stats(device)
        # ---- plain PyTorch
        model = _llama(args.tiny, device, 0)
        vocab = model.config.vocab_size
        out["params"] = sum(p.numel() for p in model.parameters())
        opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
        step_p, opt_p, loss_p = _measure(model, opt, device, args.batch, args.seq, args.steps, args.warmup, vocab)
        peak_p = torch.cuda.max_memory_allocated(device) if device.startswith("cuda") else None
        del model, opt
        if device.startswith("cuda"):
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(device)
        # ---- anchored
        client = gpu_anchor.connect(device, namespace="overhead", socket=sock)
        model = _llama(args.tiny, device, 0)
        anchor_module(model, client)
        if device.startswith("cuda"):
            torch.cuda.empty_cache()     # the module's own init copies are dead now
            torch.cuda.reset_peak_memory_stats(device)
        opt = AnchoredOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-5), model=model, client=client,
                                chunk_bytes=args.chunk_bytes, progress=args.progress)
        before = dict(opt.stats)
        step_a, opt_a, loss_a = _measure(model, opt, device, args.batch, args.seq, args.steps, args.warmup, vocab)
        n = opt.stats["steps"] - before["steps"]
        peak_a = torch.cuda.max_memory_allocated(device) if device.startswith("cuda") else None
        anchored = sum(o.nbytes for o in client.objects().values())
        undo = opt.undo_bytes
        out.update({
            "progress": opt.progress, "chunks": opt.num_chunks, "undo_bytes": undo,
            "step_s_plain": step_p, "step_s_anchored": step_a,
            "step_overhead_pct": 100 * (step_a - step_p) / step_p,
            "opt_step_s_plain": opt_p, "opt_step_s_anchored": opt_a,
            "protocol_blocking_ms": 1000 * (opt_a - opt_p),
            "commits_per_step": (opt.stats["commits"] - before["commits"]) / n,
            "commit_ms_per_step": 1000 * (opt.stats["commit_s"] - before["commit_s"]) / n,
            "host_wait_ms_per_step": 1000 * (opt.stats["wait_s"] - before["wait_s"]) / n,
            "anchored_bytes": anchored,
            "losses_plain": loss_p, "losses_anchored": loss_a,
            "losses_identical": loss_p == loss_a,
        })
        if peak_p is not None:
            out.update({"peak_bytes_plain": peak_p, "peak_bytes_anchored_torch": peak_a,
                        "extra_memory_pct": 100 * (peak_a + anchored - peak_p) / peak_p,
                        "undo_pct_of_plain_peak": 100 * undo / peak_p})
        client.drop_namespace()
    finally:
        control.stop(device, sock)
        daemon.wait(timeout=30)
    from bench.common import write_result
    print(json.dumps({k: v for k, v in out.items() if not k.startswith("losses_")}, indent=1))
    name = "train_overhead" + (f"_{args.progress}" if args.progress else "") + ("_tiny" if args.tiny else "")
    print(write_result(name, out, args.out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
