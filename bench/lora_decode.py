"""What serving LoRA adapters costs a decode step (``gpu_anchor/serve/lora.py``).

One engine serving ``--adapters`` random adapters of rank ``--rank`` on every projection of every
layer (written as peft writes them), and the same engine without adapters, on the same random
base weights, decode the same batch of requests, alternating, ``--rounds`` times each:

- ``plain``: no adapter served (the baseline: what the server pays without ``--enable-lora``);
- ``served, base requests``: the adapters served, no request uses one (its steps replay the
  graphs captured without the adapters' terms; eager steps skip them);
- ``served, one adapter``: every request on the first adapter;
- ``served, mixed``: request ``i`` on adapter ``i mod adapters``;
- ``--slots N`` (fewer than ``--adapters``) replaces the cases above by three engines (three 8B
  engines and their KV fit one 80 GB GPU): ``served, mixed`` (a slot each, the baseline), and
  with ``--max-loras N`` (the other adapters parked on the host) the same mixed requests, once as
  the scheduler admits them (a request held for a slot lets the next ``max_num_seqs`` arrivals on
  running adapters pass) and once first come, first served (``lora_pass_window`` 0: the rule
  before 2026-12-06).

Each cell: decode step ms and decode tokens/s, median [min–max] over the rounds (decode-only
steps, ``serve_decode.decode_run``), the step's extra over the baseline (``plain``; with
``--slots``, ``served, mixed``), and the whole run's
tokens/s (prefills, swaps and the steps of smaller batches included: what parking costs).

    python -m bench lora_decode --device cuda:0            # Qwen3-8B shape, 64 streams, 4 x rank 16
    python -m bench lora_decode --tiny                     # toy sizes on the CPU
"""
from __future__ import annotations

import argparse
import json
import os
import tempfile

from bench.common import write_result
from bench import models
from bench.protocol import Cell

PROJ = {"q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn", "o_proj": "self_attn",
        "gate_proj": "mlp", "up_proj": "mlp", "down_proj": "mlp"}


def write_adapter(path: str, weights_shapes: dict, layers: int, rank: int, seed: int) -> str:
    """A random LoRA adapter of every projection, saved as peft's ``save_pretrained`` saves one."""
    import torch
    from safetensors.torch import save_file
    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for i in range(layers):
        for proj, kind in PROJ.items():
            out, inp = weights_shapes[f"model.layers.{i}.{kind}.{proj}.weight"]
            key = f"base_model.model.model.layers.{i}.{kind}.{proj}"
            tensors[key + ".lora_A.weight"] = (torch.randn(rank, inp, generator=g) * inp ** -0.5).to(torch.bfloat16)
            tensors[key + ".lora_B.weight"] = (torch.randn(out, rank, generator=g) * 0.01).to(torch.bfloat16)
    os.makedirs(path, exist_ok=True)
    save_file(tensors, os.path.join(path, "adapter_model.safetensors"))
    with open(os.path.join(path, "adapter_config.json"), "w") as f:
        json.dump({"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": sorted(PROJ),
                   "bias": "none", "use_dora": False, "use_rslora": False}, f)
    return path


def model_and_adapters(mc, count: int, rank: int, prefix: str) -> tuple[str, tuple]:
    """A temporary directory holding ``mc``'s config and ``count`` random adapters of rank ``rank``
    (``write_adapter``): ``(directory, ((name, path), ...))``, named ``a0``, ``a1``, ..."""
    import torch

    from gpu_anchor.serve.model_runner import param_specs
    tmp = tempfile.mkdtemp(prefix=prefix)
    mc.save_pretrained(tmp)
    shapes = {n: s for n, s, _ in param_specs(mc, torch.float32)}
    return tmp, tuple((f"a{i}", write_adapter(os.path.join(tmp, f"a{i}"), shapes, mc.num_hidden_layers, rank, i))
                      for i in range(count))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    models.add_shape_args(ap)
    ap.add_argument("--streams", type=int, default=64)
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--adapters", type=int, default=4)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--slots", type=int, default=0,
                    help="also serve the adapters with this many slots (--max-loras), the rest parked")
    models.add_run_args(ap)
    a = ap.parse_args(argv)
    import torch

    from bench.serve_decode import decode_run
    from gpu_anchor.serve.engine import Engine, EngineConfig
    from gpu_anchor.serve.sequence import SamplingParams
    device, dtype = models.device_and_dtype(a)
    if a.tiny:
        a.streams, a.prompt_len, a.max_tokens, a.adapters, a.rank, a.rounds = 4, 16, 8, 2, 4, 1
        a.slots = min(a.slots, 1)
    if a.slots and not 0 < a.slots < a.adapters:
        ap.error(f"--slots must be between 1 and --adapters - 1 ({a.adapters - 1}), not {a.slots}")
    mc = models.config(a.model, tiny=a.tiny, layers=a.layers)
    tmp, adapters = model_and_adapters(mc, a.adapters, a.rank, "lora-decode-")
    ctx = a.prompt_len + a.max_tokens
    blocks = a.streams * -(-ctx // 16) + 16
    common = dict(model=os.path.join(tmp, "config.json"), random_weights=True, seed=0, device=device, dtype=dtype,
                  block_size=16, num_blocks=blocks, max_num_seqs=a.streams, max_model_len=ctx + 16,
                  max_batched_tokens=max(2048, a.prompt_len), anchor=False, max_lora_rank=a.rank)
    served = Engine(EngineConfig(**common, lora=adapters))
    lora_bytes = served.model.lora.bytes
    names = [n for n, _ in adapters]
    if a.slots:
        parked = Engine(EngineConfig(**common, lora=adapters, max_loras=a.slots))
        fcfs = Engine(EngineConfig(**common, lora=adapters, max_loras=a.slots))
        fcfs.scheduler.lora_pass_window = 0
        base_case = "served, mixed"
        cases = {base_case: (served, names), f"{a.slots} slots, mixed": (parked, names),
                 f"{a.slots} slots, mixed, first come first served": (fcfs, names)}
    else:
        base_case = "plain"
        cases = {"plain": (Engine(EngineConfig(**common)), [None]), "served, base requests": (served, [None]),
                 "served, one adapter": (served, names[:1]), "served, mixed": (served, names)}
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(10, mc.vocab_size - 10, (a.prompt_len,), generator=g).tolist() for _ in range(a.streams)]
    runs: dict = {k: [] for k in cases}
    phases = list(served.step_times)
    for r in range(a.rounds + 1):          # round 0 warms every case (graphs, kernels) and is not kept
        for name in (list(cases) if r % 2 == 0 else list(cases)[::-1]):
            eng, use = cases[name]
            sps = [SamplingParams(max_tokens=a.max_tokens, ignore_eos=True, lora=use[i % len(use)])
                   for i in range(a.streams)]
            swaps = eng.model.lora.stats["swaps"] if eng.model.lora is not None else 0
            x = decode_run(eng, prompts, sps, device, phases)
            x["swaps"] = (eng.model.lora.stats["swaps"] if eng.model.lora is not None else 0) - swaps
            if r:
                runs[name].append(x)
            print(f"[bench] round {r} {name}: decode step {x['decode_step_ms']:.2f} ms, "
                  f"{x['decode_tokens_per_s']:.0f} decode tokens/s, {x['tokens_per_s']:.0f} tokens/s in "
                  f"{x['steps']} steps, {x['swaps']} swaps", flush=True)
    cells = {k: {m: Cell([x[m] for x in v]).summary()
                 for m in ("decode_step_ms", "decode_tokens_per_s", "tokens_per_s", "steps", "swaps")}
             for k, v in runs.items()}
    base = cells[base_case]["decode_step_ms"]["median"]
    for k, c in cells.items():
        c["extra_step_pct"] = (c["decode_step_ms"]["median"] / base - 1) * 100
    name = models.result_name("lora_decode" + (f"_slots{a.slots}" if a.slots else ""), device, a.tiny)
    print(write_result(name, {"model": a.model, "layers": mc.num_hidden_layers, "device": device, "dtype": dtype,
                              "streams": a.streams, "prompt_len": a.prompt_len, "max_tokens": a.max_tokens,
                              "adapters": a.adapters, "rank": a.rank, "rounds": a.rounds, "slots": a.slots,
                              "baseline": base_case,
                              "adapter_bytes": lora_bytes, "cuda_graphs": served.graphs is not None
                              and served.graphs.capture, "cells": cells}, a.out))
    return 0


def title(r: dict) -> str:
    return (f"Serving with LoRA adapters: the decode step ({r['model']} shape, {r['streams']} streams, "
            f"{r['adapters']} adapters of rank {r['rank']}, {r['device']})"
            + (f": {r['slots']} slots (--max-loras {r['slots']}), the other adapters parked, against a slot each"
               if r.get("slots") else "")
            + (f": {r['variant']}" if r.get("variant") else ""))


def render(r: dict) -> str:
    lines = [f"{r['adapters']} random adapters of rank {r['rank']} on every projection of {r['layers']} layers "
             f"({r['adapter_bytes'] / 1e6:.0f} MB stacked on the device), {r['dtype']}, {r['streams']} streams of "
             f"{r['prompt_len']}-token prompts and {r['max_tokens']} tokens each, CUDA graphs "
             f"{'on' if r['cuda_graphs'] else 'off'}; {r['rounds']} alternating rounds after a warm-up round, "
             "median [min–max].", "",
             f"| engine, requests | decode step ms | decode tokens/s | step over {r.get('baseline', 'plain')} |",
             "| --- | --- | --- | --- |"]
    whole = all("tokens_per_s" in c for c in r["cells"].values())     # older results have no whole-run cells
    if whole:
        lines[-2] += " tokens/s, whole run | steps | swaps |"
        lines[-1] += " --- | --- | --- |"
    for k, c in r["cells"].items():
        s, t = c["decode_step_ms"], c["decode_tokens_per_s"]
        extra = "—" if k == r.get("baseline", "plain") else f"{c['extra_step_pct']:+.1f} %"
        row = (f"| {k} | {s['median']:.2f} [{s['min']:.2f}–{s['max']:.2f}] | {t['median']:.0f} "
               f"[{t['min']:.0f}–{t['max']:.0f}] | {extra} |")
        if whole:
            w = c["tokens_per_s"]
            row += f" {w['median']:.0f} [{w['min']:.0f}–{w['max']:.0f}] | {c['steps']['median']:.0f} | {c['swaps']['median']:.0f} |"
        lines.append(row)
    return "\n".join(lines) + "\n"
