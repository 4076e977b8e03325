"""What reading a LoRA adapter's files costs the other streams (``--max-cpu-loras``, ``lora_host.py``).

One engine serves ``--adapters`` random adapters of rank ``--rank`` on every projection (written as
peft writes them) with ``--max-loras 2 --max-cpu-loras 2``: the host keeps two adapters' tensors,
the others are on disk.  ``--streams`` requests on the base model decode; meanwhile, every
``--every`` steps, a short request arrives on the next adapter in turn, so each arrival's adapter
is one whose tensors the host dropped (its files are in the page cache: the best case for a
read).  Two arms, alternating by round on the same engine, round 0 warming both:

- ``read ahead``: as served: the request waits while its adapter's files are read on a thread of
  their own, and the others' steps go on;
- ``read in the step``: the request is admitted at once and the step that puts its adapter in a
  slot reads the files (``Scheduler.lora_ready`` unset: the engine before 2026-12-06).

Per arm, over the rounds: the wall time of the decode steps that put no adapter in a slot (host wall
around ``Engine.step``, as the streams see it) as median, 99th percentile and max; of those that
did (each admits an adapter request: the slot's write and its prefill), median and max; the
seconds steps waited for files
(``HostCopies.stats["wait_s"]``); the reads; each adapter request's time from arrival to its
first token.  Medians [min–max] over the rounds.

    python -m bench lora_reads --device cuda:0 --layers 36     # Qwen3-8B shape, 32 streams
    python -m bench lora_reads --tiny                          # toy sizes on the CPU
"""
from __future__ import annotations

import argparse
import os
import statistics
import time

from bench import models
from bench.common import write_result
from bench.lora_decode import model_and_adapters
from bench.protocol import Cell

ARMS = ("read ahead", "read in the step")


def _round(eng, arm: str, prompts, adapter_prompt, names, a) -> dict:
    """One round of ``arm``: the base streams prefilled (not timed), then decode steps timed while
    one adapter request arrives every ``a.every`` steps; run to the end of every request."""
    from gpu_anchor.serve.sequence import SamplingParams
    ads = eng.model.lora
    eng.scheduler.lora_ready = ads.ready if arm == ARMS[0] else None
    tag = f"{arm[:5].replace(' ', '')}{time.monotonic_ns()}"
    steps = a.arrivals * a.every + a.tail
    for i, p in enumerate(prompts):
        eng.add_request(f"{tag}-b{i}", p, SamplingParams(max_tokens=steps + 2, ignore_eos=True))
    started = set()
    while len(started) < len(prompts):           # prefills
        started |= {rid for rid, _, toks, _ in eng.step() if toks}
    stats0 = dict(ads.host.stats)
    step_ms, swap_ms, arrived, first = [], [], {}, {}
    k = 0
    while eng.has_work():
        if k % a.every == 0 and len(arrived) < a.arrivals:
            j = len(arrived)
            rid = f"{tag}-a{j}"
            arrived[rid] = time.perf_counter()
            eng.add_request(rid, adapter_prompt, SamplingParams(max_tokens=a.adapter_tokens, ignore_eos=True,
                                                                lora=names[(a.first + j) % len(names)]))
        swaps = ads.stats["swaps"]
        t0 = time.perf_counter()
        events = eng.step()
        t1 = time.perf_counter()
        (swap_ms if ads.stats["swaps"] > swaps else step_ms).append((t1 - t0) * 1e3)
        for rid, _, toks, _ in events:
            if toks and rid in arrived and rid not in first:
                first[rid] = t1 - arrived[rid]
        k += 1
    a.first += a.arrivals                          # the next round starts on the adapters the host dropped first
    if eng.failures:
        raise RuntimeError(f"requests failed: {eng.failures}")
    ordered = sorted(step_ms)
    return {"step_ms_median": statistics.median(step_ms), "step_ms_p99": ordered[int(0.99 * (len(ordered) - 1))],
            "step_ms_max": ordered[-1], "steps": len(step_ms),
            "swap_step_ms_median": statistics.median(swap_ms) if swap_ms else 0.0,
            "swap_step_ms_max": max(swap_ms, default=0.0), "swap_steps": len(swap_ms),
            "wall_s": (sum(step_ms) + sum(swap_ms)) / 1e3,
            "wait_s": ads.host.stats["wait_s"] - stats0["wait_s"], "reads": ads.host.stats["reads"] - stats0["reads"],
            "read_s": ads.host.stats["read_s"] - stats0["read_s"],
            "adapter_ttft_ms_median": statistics.median(first.values()) * 1e3,
            "adapter_ttft_ms_max": max(first.values()) * 1e3}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    models.add_shape_args(ap)
    ap.add_argument("--streams", type=int, default=32)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--adapters", type=int, default=6)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--every", type=int, default=24, help="decode steps between two adapter requests")
    ap.add_argument("--arrivals", type=int, default=6, help="adapter requests a round")
    ap.add_argument("--adapter-tokens", type=int, default=4)
    ap.add_argument("--tail", type=int, default=8, help="decode steps after the last arrival")
    models.add_run_args(ap)
    a = ap.parse_args(argv)
    import torch

    from gpu_anchor.serve.engine import Engine, EngineConfig
    device, dtype = models.device_and_dtype(a)
    if a.tiny:
        a.streams, a.prompt_len, a.adapters, a.rank, a.every, a.arrivals, a.rounds = 4, 16, 4, 4, 4, 3, 1
    if a.adapters < 3:
        ap.error(f"--adapters must be at least 3 (two stay on the host), not {a.adapters}")
    mc = models.config(a.model, tiny=a.tiny, layers=a.layers)
    tmp, adapters = model_and_adapters(mc, a.adapters, a.rank, "lora-reads-")
    file_bytes = os.path.getsize(os.path.join(adapters[0][1], "adapter_model.safetensors"))
    ctx = a.prompt_len + a.arrivals * a.every + a.tail + 8
    eng = Engine(EngineConfig(model=os.path.join(tmp, "config.json"), random_weights=True, seed=0, device=device,
                              dtype=dtype, block_size=16, num_blocks=(a.streams + a.arrivals) * -(-ctx // 16) + 16,
                              max_num_seqs=a.streams + a.arrivals, max_model_len=ctx + 16,
                              max_batched_tokens=max(2048, a.prompt_len), anchor=False, max_lora_rank=a.rank,
                              lora=adapters, max_loras=2, max_cpu_loras=2))
    names = [n for n, _ in adapters]
    a.first = 2                                    # a0 and a1 are on the host at start
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(10, mc.vocab_size - 10, (a.prompt_len,), generator=g).tolist() for _ in range(a.streams)]
    adapter_prompt = torch.randint(10, mc.vocab_size - 10, (16,), generator=g).tolist()
    runs: dict = {k: [] for k in ARMS}
    for r in range(a.rounds + 1):                  # round 0 warms both arms and is not kept
        for arm in (ARMS if r % 2 == 0 else ARMS[::-1]):
            x = _round(eng, arm, prompts, adapter_prompt, names, a)
            if r:
                runs[arm].append(x)
            print(f"[bench] round {r} {arm}: step {x['step_ms_median']:.2f} ms median, {x['step_ms_p99']:.2f} p99, "
                  f"{x['step_ms_max']:.2f} max; {x['swap_steps']} swap steps {x['swap_step_ms_median']:.1f} ms median, "
                  f"{x['swap_step_ms_max']:.1f} max; steps waited {x['wait_s'] * 1e3:.1f} ms for {x['reads']} reads "
                  f"({x['read_s'] * 1e3:.1f} ms of reading); adapter TTFT {x['adapter_ttft_ms_median']:.1f} ms",
                  flush=True)
    cells = {arm: {m: Cell([x[m] for x in v]).summary() for m in v[0]} for arm, v in runs.items()}
    name = models.result_name("lora_reads", device, a.tiny)
    print(write_result(name, {"model": a.model, "layers": mc.num_hidden_layers, "device": device, "dtype": dtype,
                              "streams": a.streams, "prompt_len": a.prompt_len, "adapters": a.adapters,
                              "rank": a.rank, "every": a.every, "arrivals": a.arrivals,
                              "adapter_tokens": a.adapter_tokens, "rounds": a.rounds,
                              "adapter_file_bytes": file_bytes, "cuda_graphs": eng.graphs is not None
                              and eng.graphs.capture, "cells": cells}, a.out))
    return 0


def title(r: dict) -> str:
    return (f"Serving with LoRA adapters on disk (--max-cpu-loras 2): what reading one costs the other streams "
            f"({r['model']} shape, {r['layers']} layers, {r['streams']} streams, {r['device']})"
            + (f": {r['variant']}" if r.get("variant") else ""))


def render(r: dict) -> str:
    lines = [f"{r['adapters']} random adapters of rank {r['rank']} on every projection ({r['adapter_file_bytes'] / 1e6:.0f}"
             f" MB a file, in the page cache), `--max-loras 2 --max-cpu-loras 2`, {r['dtype']}; {r['streams']} "
             f"streams on the base model decode while a {r['adapter_tokens']}-token request on the next adapter "
             f"arrives every {r['every']} steps ({r['arrivals']} a round); CUDA graphs "
             f"{'on' if r['cuda_graphs'] else 'off'}; {r['rounds']} alternating rounds after a warm-up round, "
             "median [min–max] over the rounds.", "",
             "| arm | other steps: ms, median | p99 | max | steps putting an adapter in a slot: ms, median | max | "
             "steps waited for files, ms | reads | adapter request's TTFT, ms |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]

    def f(c, k, scale=1.0, d=2):
        return f"{c[k]['median'] * scale:.{d}f} [{c[k]['min'] * scale:.{d}f}–{c[k]['max'] * scale:.{d}f}]"
    for arm, c in r["cells"].items():
        swaps = (f"{f(c, 'swap_step_ms_median', 1, 1)} | {f(c, 'swap_step_ms_max', 1, 1)}" if "swap_steps" in c
                 else "(counted with the others) | —")     # a result of the first tree, 528fceb
        lines.append(f"| {arm} | {f(c, 'step_ms_median')} | {f(c, 'step_ms_p99')} | {f(c, 'step_ms_max')} | "
                     f"{swaps} | {f(c, 'wait_s', 1e3, 1)} | {c['reads']['median']:.0f} | {f(c, 'adapter_ttft_ms_median', 1, 1)} |")
    return "\n".join(lines) + "\n"
