"""What a dead engine's prefix cache is worth to the engine restarted after it (the cached blocks'
journal records: ``gpu_anchor/serve/block_manager.py``, "Cached blocks across a restart").

Per round, on a private daemon, in a fresh namespace:

1. engine A (a child process, anchored, prefix caching on) serves turn 1 of ``--conversations``
   conversations, each a ``--history``-token start of its own and ``--unique`` new tokens,
   ``--max-tokens`` each, all together, to their end; idle, its cached blocks recorded, it is
   SIGKILLed;
2. engine B (another child) starts on the namespace and serves turn 2 of every conversation (its
   turn 1, A's answer and ``--unique`` new tokens), all together, to their end.

Two arms, alternating: ``found again`` (B adopts A's records, as the engine does) and
``forgotten`` (B skips them: what a restart found until 2026-12-06, nothing).  Per arm: B's start
(``Engine()``, the restore included), turn 2's wall time and time to first token (median, p90),
its prompt tokens found cached; and A's turn-1 wall time with the recording on (``found again``)
and off (``forgotten``: ``BlockManager.recording`` off), the cost of the records; the
``unrecord`` round trips B waited for when it reused recorded blocks.  Median [min-max] over
``--rounds``.

    python -m bench prefix_restart --device cuda:0 --layers 8     # Qwen3-8B shape cut to 8 layers
    python -m bench prefix_restart --tiny                         # toy sizes on the CPU
"""
from __future__ import annotations

import argparse
import os
import random
import statistics
import tempfile
import time

from bench.common import private_daemon, write_result
from bench import models
from bench.protocol import Cell

ARMS = ("found again", "forgotten")


def _serve(eng, prompts, max_tokens: int, tag: str) -> tuple[list, dict]:
    from gpu_anchor.serve.sequence import SamplingParams
    t0 = time.perf_counter()
    rids = [f"{tag}{i}" for i in range(len(prompts))]
    q0, h0 = eng.scheduler.prefix_queries, eng.scheduler.prefix_hits
    for rid, p in zip(rids, prompts):
        eng.add_request(rid, p, SamplingParams(max_tokens=max_tokens, ignore_eos=True))
    out, first = {rid: [] for rid in rids}, {}
    while eng.has_work():
        for rid, i, ids, _ in eng.step():
            if ids and rid not in first:
                first[rid] = time.perf_counter() - t0
            out[rid][i:i + len(ids)] = ids
    ttft = sorted(first.values())
    return [out[r] for r in rids], {"wall_s": time.perf_counter() - t0, "ttft_median_s": statistics.median(ttft),
                                    "ttft_p90_s": ttft[int(0.9 * (len(ttft) - 1))],
                                    "prompt_tokens": sum(map(len, prompts)),
                                    "cached_tokens": eng.scheduler.prefix_hits - h0,
                                    "looked_up": eng.scheduler.prefix_queries - q0}


def _engine_a(cfg, prompts, max_tokens, record, conn):
    from gpu_anchor.serve.engine import Engine
    eng = Engine(cfg)
    eng.blocks.recording = record
    outs, t = _serve(eng, prompts, max_tokens, "a")
    conn.send((outs, {"a_wall_s": t["wall_s"], "a_cached_blocks": eng.blocks.num_cached}))
    time.sleep(3600)                 # SIGKILLed here, idle


def _engine_b(cfg, prompts, max_tokens, adopt, conn):
    from gpu_anchor.serve import commit
    from gpu_anchor.serve.engine import Engine
    if not adopt:
        commit.read_cached = lambda raw: ([], [], 0)       # the engine as it was: nothing found again
    t0 = time.perf_counter()
    eng = Engine(cfg)
    start = time.perf_counter() - t0
    found = eng.blocks.num_cached
    _, t = _serve(eng, prompts, max_tokens, "b")
    conn.send(dict(t, b_start_s=start, b_restore_s=eng.timings.get("restore_s"), b_found_blocks=found,
                   b_unrecords=eng.commits.unrecords, b_unrecord_s=eng.commits.unrecord_s))


def _child(target, *args):
    import multiprocessing as mp

    from bench.common import FORKSERVER_PRELOAD
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(FORKSERVER_PRELOAD)
    recv, send = ctx.Pipe(duplex=False)
    p = ctx.Process(target=target, args=(*args, send))
    p.start()
    send.close()
    return p, recv


def _round(common: dict, a, rng, vocab: int, arm: str, namespace: str) -> dict:
    from gpu_anchor.serve.engine import EngineConfig
    cfg = EngineConfig(**common, namespace=namespace)

    def toks(n):
        return [rng.randrange(10, vocab - 10) for _ in range(n)]
    turn1 = [toks(a.history) + toks(a.unique) for _ in range(a.conversations)]
    p, recv = _child(_engine_a, cfg, turn1, a.max_tokens, arm == "found again")
    try:
        answers, x = recv.recv()
    finally:
        p.kill()                   # SIGKILL, idle: its KV and journal stay with the daemon
        p.join()
    turn2 = [t + o + toks(a.unique) for t, o in zip(turn1, answers)]
    p, recv = _child(_engine_b, cfg, turn2, a.max_tokens, arm == "found again")
    try:
        x.update(recv.recv())
    finally:
        p.join(60)
        if p.is_alive():
            p.kill()
            p.join()
    return x


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    models.add_shape_args(ap)
    ap.add_argument("--conversations", type=int, default=32)
    ap.add_argument("--history", type=int, default=2048, help="tokens of each conversation's start")
    ap.add_argument("--unique", type=int, default=64, help="new tokens of each turn")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--spare-blocks", type=int, default=64,
                    help="KV blocks beyond turn 1's (turn 2 then reuses some recorded cached blocks)")
    models.add_run_args(ap)
    a = ap.parse_args(argv)
    device, dtype = models.device_and_dtype(a)
    if a.tiny:
        a.conversations, a.history, a.unique, a.max_tokens, a.rounds = 4, 64, 8, 8, 1
    mc = models.config(a.model, tiny=a.tiny, layers=a.layers)
    tmp = tempfile.mkdtemp(prefix="prefix-restart-")
    mc.save_pretrained(tmp)
    longest = a.history + 2 * (a.unique + a.max_tokens) + 16
    blocks = a.conversations * -(-(a.history + a.unique + a.max_tokens) // 16) + a.spare_blocks
    common = dict(model=os.path.join(tmp, "config.json"), random_weights=True, seed=0, device=device, dtype=dtype,
                  block_size=16, num_blocks=blocks, max_num_seqs=a.conversations, max_model_len=longest + 16,
                  max_batched_tokens=2048, prefix_caching=True)
    runs: dict = {arm: [] for arm in ARMS}
    with private_daemon(device):
        for r in range(a.rounds + 1):            # round 0 warms the forkserver and the daemon; not kept
            for arm in (ARMS if r % 2 == 0 else ARMS[::-1]):
                x = _round(common, a, random.Random(1000 * r), mc.vocab_size, arm, f"pc-restart-{r}-{ARMS.index(arm)}")
                if r:
                    runs[arm].append(x)
                print(f"[bench] round {r} {arm}: B found {x['b_found_blocks']} blocks, turn 2 {x['wall_s']:.3f} s, "
                      f"TTFT median {x['ttft_median_s'] * 1e3:.1f} ms, {x['cached_tokens']} of {x['prompt_tokens']} "
                      f"prompt tokens cached; A's turn 1 {x['a_wall_s']:.3f} s; {x['b_unrecords']} unrecord(s)",
                      flush=True)
    cells = [{"arm": arm, **{m: Cell([x[m] for x in xs]).summary() for m in xs[0] if xs[0][m] is not None}}
             for arm, xs in runs.items()]
    by = {c["arm"]: c for c in cells}
    med = lambda arm, m: by[arm][m]["median"]      # noqa: E731
    summary = {"turn2_wall_ratio": med("forgotten", "wall_s") / med("found again", "wall_s"),
               "turn2_ttft_ratio": med("forgotten", "ttft_median_s") / med("found again", "ttft_median_s"),
               "turn1_recording_pct": 100 * (med("found again", "a_wall_s") / med("forgotten", "a_wall_s") - 1)}
    name = models.result_name("prefix_restart", device, a.tiny)
    print(write_result(name, {"model": a.model, "layers": mc.num_hidden_layers, "device": device, "dtype": dtype,
                              "conversations": a.conversations, "history": a.history, "unique": a.unique,
                              "max_tokens": a.max_tokens, "num_blocks": blocks, "rounds": a.rounds, "cells": cells,
                              "summary": summary}, a.out))
    return 0


def title(r: dict) -> str:
    return f"Serving: a dead engine's prefix cache found again by the next one ({r['model']} shape, {r['device']})"


def render(r: dict) -> str:
    lines = [f"{r['layers']} layers, {r['dtype']}, block size 16, {r['num_blocks']} KV blocks. Engine A serves turn 1 "
             f"of {r['conversations']} conversations (a {r['history']}-token start each, {r['unique']} new tokens, "
             f"{r['max_tokens']} tokens out), goes idle and is SIGKILLed; engine B starts on the same namespace and "
             f"serves turn 2 (turn 1, A's answer, {r['unique']} new tokens). *found again*: B adopts A's records of "
             "its cached blocks (the engine now); *forgotten*: B skips them (a restart until 2026-12-06), and A runs "
             f"without recording them. {r['rounds']} alternating rounds after a warm-up round, new tokens each round; "
             "median [min–max].", "",
             "| arm | B's blocks found | B's start s | turn 2 wall s | turn 2 TTFT median ms | turn 2 TTFT p90 ms | "
             "prompt tokens cached | A's turn 1 wall s | B's unrecord round trips (s waited) |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    def cell(c, m, scale=1.0, digits=3):
        x = c[m]
        return f"{x['median'] * scale:.{digits}f} [{x['min'] * scale:.{digits}f}–{x['max'] * scale:.{digits}f}]"
    for c in r["cells"]:
        lines.append(f"| {c['arm']} | {c['b_found_blocks']['median']:.0f} | {cell(c, 'b_start_s')} | {cell(c, 'wall_s')} | "
                     f"{cell(c, 'ttft_median_s', 1e3, 1)} | {cell(c, 'ttft_p90_s', 1e3, 1)} | "
                     f"{c['cached_tokens']['median']:.0f} of {c['prompt_tokens']['median']:.0f} | {cell(c, 'a_wall_s')} | "
                     f"{c['b_unrecords']['median']:.0f} ({c['b_unrecord_s']['median']:.4f}) |")
    s = r["summary"]
    lines += ["", f"Turn 2 {s['turn2_wall_ratio']:.2f}× faster and its median time to first token "
                  f"{s['turn2_ttft_ratio']:.2f}× shorter with the cache found again; A's turn 1 with its blocks "
                  f"recorded {s['turn1_recording_pct']:+.1f} % against without (one run each per round: noise "
                  "included)."]
    return "\n".join(lines) + "\n"
