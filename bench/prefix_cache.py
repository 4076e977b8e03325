"""What prefix caching saves (``gpu_anchor/serve/prefix_cache.py``): the same engine with and
without it, on the same random weights and the same requests, alternating rounds.

Two workloads, each starting cold (every round draws new tokens, so nothing is cached from the
round before):

- ``shared system prompt``: ``--requests`` requests arrive together, each a ``--system``-token
  system prompt (the same for all) and ``--unique`` tokens of its own, ``--max-tokens`` each;
- ``conversation turns``: ``--conversations`` conversations of ``--turns`` turns; every turn of
  every conversation is sent together, each turn's prompt being the conversation so far (its
  earlier prompts and answers) and ``--unique`` new tokens.

Per cell: the workload's wall time, the time to first token (median and p90 over the requests),
the prompt tokens computed (prefill) and found cached, median [min–max] over the rounds.  The
baseline is the same engine with ``prefix_caching=False`` (vLLM's ``--no-enable-prefix-caching``).

    python -m bench prefix_cache --device cuda:0        # Qwen3-8B shape
    python -m bench prefix_cache --tiny                 # toy sizes on the CPU
"""
from __future__ import annotations

import argparse
import itertools
import os
import statistics
import tempfile
import time

from bench.common import write_result
from bench import models
from bench.protocol import Cell

_ids = itertools.count()


def _serve(eng, prompts, sp) -> tuple[list, dict]:
    """Run ``prompts`` together to the end: (outputs, {"wall_s", "ttft_s": [...]})."""
    from gpu_anchor.serve.sequence import SamplingParams
    t0 = time.perf_counter()
    rids = [f"q{next(_ids)}" for _ in prompts]
    for rid, p in zip(rids, prompts):
        eng.add_request(rid, p, SamplingParams(**sp.to_dict()))
    out, first = {rid: [] for rid in rids}, {}
    while eng.has_work():
        for rid, i, ids, _ in eng.step():
            if ids and rid not in first:
                first[rid] = time.perf_counter() - t0
            out[rid][i:i + len(ids)] = ids
    return [out[r] for r in rids], {"wall_s": time.perf_counter() - t0, "ttft_s": [first[r] for r in rids]}


def _workload(eng, kind: str, a, rng, vocab: int, sp) -> dict:
    def toks(n):
        return [rng.randrange(10, vocab - 10) for _ in range(n)]
    s0 = eng.scheduler
    q0, h0 = s0.prefix_queries, s0.prefix_hits
    prompt_tokens, wall, ttft = 0, 0.0, []
    if kind == "shared system prompt":
        system = toks(a.system)
        prompts = [system + toks(a.unique) for _ in range(a.requests)]
        _, t = _serve(eng, prompts, sp)
        prompt_tokens, wall, ttft = sum(map(len, prompts)), t["wall_s"], t["ttft_s"]
    else:
        convs = [toks(a.system) for _ in range(a.conversations)]
        for _ in range(a.turns):
            prompts = [c + toks(a.unique) for c in convs]
            outs, t = _serve(eng, prompts, sp)
            convs = [p + o for p, o in zip(prompts, outs)]
            prompt_tokens += sum(map(len, prompts))
            wall += t["wall_s"]
            ttft += t["ttft_s"]
    hits = s0.prefix_hits - h0
    ttft.sort()
    return {"wall_s": wall, "ttft_median_s": statistics.median(ttft), "ttft_p90_s": ttft[int(0.9 * (len(ttft) - 1))],
            "prompt_tokens": prompt_tokens, "cached_tokens": hits, "prefill_tokens": prompt_tokens - hits,
            "looked_up": s0.prefix_queries - q0}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    models.add_shape_args(ap)
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--system", type=int, default=1024, help="tokens of the shared system prompt / a conversation's start")
    ap.add_argument("--unique", type=int, default=64, help="tokens of each request's own (each turn's new) part")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--conversations", type=int, default=16)
    ap.add_argument("--turns", type=int, default=4)
    models.add_run_args(ap)
    a = ap.parse_args(argv)
    import random

    from gpu_anchor.serve.engine import Engine, EngineConfig
    from gpu_anchor.serve.sequence import SamplingParams
    device, dtype = models.device_and_dtype(a)
    if a.tiny:
        a.requests, a.system, a.unique, a.max_tokens, a.conversations, a.turns, a.rounds = 8, 64, 8, 8, 4, 3, 1
    mc = models.config(a.model, tiny=a.tiny, layers=a.layers)
    tmp = tempfile.mkdtemp(prefix="prefix-cache-")
    mc.save_pretrained(tmp)
    longest = a.system + a.turns * (a.unique + a.max_tokens) + 16
    blocks = max(a.requests, a.conversations) * -(-longest // 16) + 64
    common = dict(model=os.path.join(tmp, "config.json"), random_weights=True, seed=0, device=device, dtype=dtype,
                  block_size=16, num_blocks=blocks, max_num_seqs=max(a.requests, a.conversations),
                  max_model_len=longest + 16, max_batched_tokens=2048, anchor=False)
    engines = {"prefix caching off": Engine(EngineConfig(**common, prefix_caching=False)),
               "prefix caching on": Engine(EngineConfig(**common, prefix_caching=True))}
    sp = SamplingParams(max_tokens=a.max_tokens, ignore_eos=True)
    kinds = ("shared system prompt", "conversation turns")
    runs: dict = {(k, e): [] for k in kinds for e in engines}
    for r in range(a.rounds + 1):              # round 0 warms every engine (kernels, graphs) and is not kept
        order = list(engines) if r % 2 == 0 else list(engines)[::-1]
        for k in kinds:
            for e in order:
                x = _workload(engines[e], k, a, random.Random(1000 * r + kinds.index(k)), mc.vocab_size, sp)
                if r:
                    runs[(k, e)].append(x)
                print(f"[bench] round {r} {k}, {e}: {x['wall_s']:.3f} s, TTFT median {x['ttft_median_s'] * 1e3:.1f} ms,"
                      f" {x['cached_tokens']} of {x['prompt_tokens']} prompt tokens cached", flush=True)
    cells = []
    for (k, e), xs in runs.items():
        cells.append({"workload": k, "engine": e, **{m: Cell([x[m] for x in xs]).summary() for m in xs[0]}})
    name = models.result_name("prefix_cache", device, a.tiny)
    print(write_result(name, {"model": a.model, "layers": mc.num_hidden_layers, "device": device, "dtype": dtype,
                              "requests": a.requests, "system": a.system, "unique": a.unique,
                              "max_tokens": a.max_tokens, "conversations": a.conversations, "turns": a.turns,
                              "rounds": a.rounds, "cells": cells, "summary": summary(cells)}, a.out))
    return 0


def summary(cells: list) -> dict:
    """Per workload (``shared`` / ``turns``), caching off over on, medians: wall time and median TTFT."""
    by = {(c["workload"], c["engine"]): c for c in cells}
    out = {}
    for key, w in (("shared", "shared system prompt"), ("turns", "conversation turns")):
        off, on = by[(w, "prefix caching off")], by[(w, "prefix caching on")]
        out[key + "_wall_ratio"] = off["wall_s"]["median"] / on["wall_s"]["median"]
        out[key + "_ttft_ratio"] = off["ttft_median_s"]["median"] / on["ttft_median_s"]["median"]
        out[key + "_cached_pct"] = on["cached_tokens"]["median"] / on["prompt_tokens"]["median"] * 100
    return out


def title(r: dict) -> str:
    return f"Serving with prefix caching: shared system prompts and conversation turns ({r['model']} shape, {r['device']})"


def render(r: dict) -> str:
    lines = [f"{r['layers']} layers, {r['dtype']}, block size 16. *Shared system prompt*: {r['requests']} requests "
             f"sent together, a {r['system']}-token system prompt and {r['unique']} tokens of their own, "
             f"{r['max_tokens']} tokens each. *Conversation turns*: {r['conversations']} conversations of "
             f"{r['turns']} turns, each turn sent together, its prompt the conversation so far and {r['unique']} new "
             f"tokens ({r['system']} at the start), {r['max_tokens']} tokens each. The same engine with prefix caching "
             f"off (the baseline) and on, {r['rounds']} alternating rounds after a warm-up round, every round on "
             "new tokens; median [min–max].", "",
             "| workload | engine | wall s | TTFT median ms | TTFT p90 ms | prompt tokens computed | cached |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    base = {c["workload"]: c for c in r["cells"] if c["engine"] == "prefix caching off"}
    for c in r["cells"]:
        w, t, p = c["wall_s"], c["ttft_median_s"], c["ttft_p90_s"]
        ratio = "" if c is base[c["workload"]] else f" ({base[c['workload']]['wall_s']['median'] / w['median']:.2f}× faster)"
        lines.append(f"| {c['workload']} | {c['engine']} | {w['median']:.3f} [{w['min']:.3f}–{w['max']:.3f}]{ratio} | "
                     f"{t['median'] * 1e3:.1f} [{t['min'] * 1e3:.1f}–{t['max'] * 1e3:.1f}] | {p['median'] * 1e3:.1f} | "
                     f"{c['prefill_tokens']['median']:.0f} of {c['prompt_tokens']['median']:.0f} | "
                     f"{c['cached_tokens']['median']:.0f} |")
    return "\n".join(lines) + "\n"
