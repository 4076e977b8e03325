"""The serving worker every inference benchmark runs, for every method alike.

    python -m bench.baselines.server --method {replay,kv_memory,gpu_anchor} --model-dir DIR
        --device D --state-dir DIR --events FILE [--concurrency C] [--requests N] [--next-request K]

Runs gpu-anchor's serving engine (``gpu_anchor.serve.engine``) over a seeded
ShareGPT-like workload at a fixed concurrency.  ``gpu_anchor``: the engine as shipped
(weights and KV cache anchored in the daemon, metadata in its journal).  Baselines: the
same engine with the memory provider swapped (``replay.ReplayAnchor`` /
``kv_memory.KVMemoryAnchor``): plain allocations, metadata in a tmpfs journal.
Events (JSON lines, wall-clock ``t``): ``process``, ``imported``, ``engine`` (timings,
restored requests), ``step`` (tokens, finished and admitted request indices, the
step's duration ``dt`` and whether it replayed a CUDA graph; emitted after the step's
commit), ``resumed`` (every restored request produced a token), ``paused`` (tests:
``--pause-after-steps``), ``done``.  A standby of the
warm fork server can run it after a fault (``standby``); its pre-warm, ``prewarm`` below, runs
a 1-layer scratch engine (``gpu_anchor.serve.prewarm``) with this command line's shapes; ``hot``
also attaches the engine to the live one's anchored state (a hot standby), which ``main`` takes over.
"""
from __future__ import annotations

import time

T_PROCESS = time.time()

import argparse  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import os  # noqa: E402
import random  # noqa: E402

from bench.baselines.trainer import Events  # noqa: E402


def request(seed: int, i: int, vocab: int, tiny: bool = False) -> tuple[list[int], int]:
    """Request ``i`` of the seeded trace: (prompt ids, output length) with ShareGPT-like
    long-tailed lengths: lognormal, medians ~180 prompt / ~150 output tokens, clipped to
    [8, 2048] / [8, 1024] (tiny: /16).  Each request has its own generator, so a restarted
    engine makes only the requests it admits (making a 10 000-request trace up front took
    ~1.7 s of every restart's resume time on the H200 host, for every method)."""
    rng = random.Random(seed * 1_000_003 + i)
    div = 16 if tiny else 1
    p = int(min(2048, max(8, rng.lognormvariate(math.log(180), 0.9))) // div) or 1
    o = int(min(1024, max(8, rng.lognormvariate(math.log(150), 0.9))) // div) or 1
    return [rng.randrange(3, vocab) for _ in range(p)], o


def workload(seed: int, n: int, vocab: int, tiny: bool = False) -> list[tuple[list[int], int]]:
    """The first ``n`` requests of the trace (``request``)."""
    return [request(seed, i, vocab, tiny) for i in range(n)]


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m bench.baselines.server")
    p.add_argument("--method", required=True, choices=("replay", "kv_memory", "gpu_anchor"))
    p.add_argument("--model-dir", required=True)
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--state-dir", required=True, help="baselines: tmpfs directory for metadata / KV mirror")
    p.add_argument("--namespace", default="bench-serve")
    p.add_argument("--events", required=True)
    p.add_argument("--concurrency", type=int, default=64)
    p.add_argument("--requests", type=int, default=10000)
    p.add_argument("--next-request", type=int, default=0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--num-blocks", type=int, default=4096)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--max-batched-tokens", type=int, default=8192)
    p.add_argument("--max-model-len", type=int, default=4096)
    p.add_argument("--tiny", action="store_true")
    p.add_argument("--record-tokens", action="store_true", help="put every token into the events (tests)")
    p.add_argument("--pause-after-steps", type=int, default=None,
                   help="tests: once this many steps are done, stop at the next step that leaves every slot busy "
                        "and wait to be killed (so a kill always finds requests in flight, however fast the run)")
    return p


def lost_requests(events_path: str, restored: set[str]) -> list[int]:
    """Requests an earlier engine admitted (``step`` events in ``events_path``) that neither
    finished nor came back with the restarted engine: the engine died before their admission
    was committed (the commit may complete during the next step), so they are admitted again
    from the start, as a client would resend them.  The same rule for every method."""
    adm, fin = set(), set()
    try:
        with open(events_path, "rb") as f:
            for line in f:
                try:
                    e = json.loads(line)
                except ValueError:  # a line torn by a SIGKILL
                    continue
                if e.get("ev") == "step":
                    adm.update(e.get("adm", ()))
                    fin.update(e.get("fin", ()))
    except FileNotFoundError:
        return []
    return sorted(adm - fin - {int(r[1:]) for r in restored})


def main(argv=None) -> int:
    args = parser().parse_args(argv)
    ev = Events(args.events)
    ev("process", t_process=T_PROCESS)
    import torch

    import gpu_anchor.serve.engine as E
    from gpu_anchor.serve.sequence import SamplingParams
    ev("imported")
    cfg = engine_config(args)
    eng = _take_over_hot(cfg)
    hot = eng is not None
    anchor_cls = None
    if args.method != "gpu_anchor":
        from bench.baselines.kv_memory import KVMemoryAnchor
        from bench.baselines.replay import ReplayAnchor
        anchor_cls = KVMemoryAnchor if args.method == "kv_memory" else ReplayAnchor
        anchor_cls.model_dir, anchor_cls.state_dir = args.model_dir, args.state_dir
        E.Anchor = anchor_cls  # the engine's memory provider, swapped for the baseline's
    if eng is None:
        eng = E.Engine(cfg)
    if hasattr(eng.anchor, "attach"):
        eng.anchor.attach(eng)
    timings = dict(eng.timings, **(anchor_cls.timings if anchor_cls else {}))
    pending = {s.rid for s in eng.restored}
    ev("engine", timings=timings, restored=len(pending), notes=eng.recovery_notes[:3],
       weights_loaded=eng.weights_loaded, hot=int(hot),
       **({"toks": [[s.rid, 0, list(s.output_ids)] for s in eng.restored]} if args.record_tokens else {}))
    nxt = args.next_request
    steps = 0
    readmit = lost_requests(args.events, pending)
    if readmit:
        ev("readmit", ids=readmit)
    while True:
        adm, adm_t = [], time.time()
        while len(eng.scheduler.seqs) < args.concurrency and (readmit or nxt < args.requests):
            i = readmit.pop(0) if readmit else nxt
            nxt += i == nxt
            rid = f"r{i}"
            if rid not in eng.scheduler.seqs:
                prompt, n_out = request(args.seed, i, eng.mc.vocab_size, args.tiny)
                eng.add_request(rid, prompt, SamplingParams(max_tokens=n_out, ignore_eos=True))
                adm.append(i)
        if not eng.has_work():
            break
        t_step, graphs = time.perf_counter(), eng.step_counts["graph"]
        events = eng.step()
        dt, graph = time.perf_counter() - t_step, eng.step_counts["graph"] > graphs
        got = {e[0] for e in events}
        fin = [int(e[0][1:]) for e in events if e[3]]
        ev("step", n=sum(len(e[2]) for e in events), fin=fin, adm=adm, adm_t=adm_t, live=len(eng.scheduler.seqs),
           dt=round(dt, 5), graph=graph,
           **({"toks": [[e[0], e[1], list(e[2])] for e in events]} if args.record_tokens else {}))
        if pending:
            pending -= got
            if not pending:
                ev("resumed")
        steps += 1
        if args.pause_after_steps is not None and steps >= args.pause_after_steps and \
                len(eng.scheduler.seqs) >= args.concurrency:
            ev("paused", steps=steps)
            while True:
                time.sleep(60)
    if args.device.startswith("cuda"):
        torch.cuda.synchronize()
    ev("done", next_request=nxt)
    return 0


def engine_config(args):
    import gpu_anchor.serve.engine as E
    return E.EngineConfig(model=args.model_dir, device=args.device, dtype=args.dtype, block_size=args.block_size,
                          num_blocks=args.num_blocks, max_num_seqs=args.concurrency,
                          max_batched_tokens=args.max_batched_tokens, max_model_len=args.max_model_len,
                          anchor=args.method == "gpu_anchor", namespace=args.namespace)


PREWARM_ENV = "BENCH_SERVE_PREWARM"
HOT = None            # a hot standby's attached engine (``hot``), in this module of the standby process


def prewarm(device: str) -> dict:
    """A standby's pre-warm: a 1-layer scratch engine with the shapes of the command line in
    ``BENCH_SERVE_PREWARM`` (JSON list), before the method's memory provider exists (the scratch
    engine must not touch any method's state)."""
    from gpu_anchor.serve.prewarm import warm_engine
    return warm_engine(engine_config(parser().parse_args(json.loads(os.environ[PREWARM_ENV]))))


def hot(device: str) -> dict:
    """A hot standby's preparation (mode ``hot`` of ``bench recovery_serve``, gpu-anchor only): the
    pre-warm above, then the engine of the command line attached to the live engine's anchored
    state without writing it (``Engine(standby=True)``: weights and KV mapped, decode graphs
    captured).  ``main`` takes it over after the fault.  Made only once the live engine serves."""
    global HOT
    import gpu_anchor.serve.engine as E
    info = prewarm(device)
    args = parser().parse_args(json.loads(os.environ[PREWARM_ENV]))
    if args.method != "gpu_anchor":
        raise ValueError(f"a hot standby maps gpu-anchor's state; method {args.method} has none to map")
    HOT = E.Engine(engine_config(args), standby=True)
    return dict(info, hot=1, **HOT.timings)


def _take_over_hot(cfg):
    """In the standby that ran ``hot``: its engine, taken over, if it was built for ``cfg``; else None."""
    import dataclasses
    import sys
    me = sys.modules.get("bench.baselines.server")
    eng = getattr(me, "HOT", None) if me is not None else None
    if eng is None:
        return None
    me.HOT = None
    if dataclasses.replace(eng.cfg, graph_after_steps=cfg.graph_after_steps) != cfg:
        return None
    eng.take_over()
    return eng


if __name__ == "__main__":
    raise SystemExit(main())
