"""Serving-engine migration downtime: live migration vs stop-and-restart.

    python -m bench migration                       # Qwen3-8B shape, random bf16 weights, cuda:0 -> cuda:1
    python -m bench migration --tiny                # toy size, host daemon -> another host daemon

One engine on the source serves ``--requests`` greedy requests; once each has produced
``--warm-tokens`` tokens it is migrated (``serve.migration``: pre-copy while it
keeps serving, cut-over between two steps, on-demand restore on the destination).
Downtime = the old engine's last published token → the new engine's first, as a client
sees it.  Baseline (stop-and-restart): a fresh engine on the destination loads the same
weights from safetensors and recomputes every in-flight request's prefill (prompt +
delivered tokens), to its first token.  The baseline excludes process start, imports and
CUDA context creation, and reads safetensors just written (page cache): both favour it.
After the migration the run continues to completion and is compared with a fault-free
run of the same requests (``identical_outputs``; bf16 greedy on the same GPU model).
"""
from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import tempfile
import time

from bench.common import write_result


def _sync(device: str) -> None:
    import torch
    if device.startswith("cuda"):
        torch.cuda.synchronize(device)


def _engine_cfg(args, model: str, device: str, socket: str | None, anchor: bool, random_weights: bool):
    from gpu_anchor.serve.engine import EngineConfig
    return EngineConfig(model=model, random_weights=random_weights, seed=1, device=device, dtype=args.dtype,
                        block_size=16, num_blocks=args.num_blocks, max_num_seqs=max(64, args.requests),
                        max_batched_tokens=args.max_batched_tokens, max_model_len=args.prompt_len +
                        args.max_tokens + 16, anchor=anchor, namespace="bench-migrate", socket=socket,
                        cpu_threads=1 if device == "cpu" else None)


def _requests(args, vocab: int):
    from gpu_anchor.serve.sequence import SamplingParams
    rng = random.Random(7)
    return [(f"r{i}", [rng.randrange(10, vocab - 10) for _ in range(args.prompt_len)],
             SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True))
            for i in range(args.requests)]


def _run_migration(args, model, result, save):
    import gpu_anchor
    from gpu_anchor.checkpoint import migrate
    from gpu_anchor.serve.migration import EngineMigration, provide
    provide(migrate)     # what gpu-anchor serve does for its engines
    from gpu_anchor.serve.engine import Engine
    from gpu_anchor.serve.sequence import SamplingParams
    t0 = time.perf_counter()
    eng = Engine(_engine_cfg(args, model, args.src, args.src_socket, True, True))
    result["build_s"] = time.perf_counter() - t0
    reqs = _requests(args, eng.mc.vocab_size)
    out = {rid: [] for rid, _, _ in reqs}

    def publish(events):
        for rid, i, ids, _ in events:
            out[rid][i:] = ids
        return bool(events)

    for rid, prompt, p in reqs:
        eng.add_request(rid, prompt, SamplingParams(**p.to_dict()))
    steps = []
    while min(len(v) for v in out.values()) < args.warm_tokens:
        ts = time.perf_counter()
        publish(eng.step())
        _sync(args.src)
        steps.append(time.perf_counter() - ts)
    result["decode_step_s"] = statistics.median(steps[-5:])
    mig = EngineMigration(eng, args.dst, socket=args.dst_socket)
    t0 = time.perf_counter()
    mig.start()
    pre_steps, last_old = [], time.perf_counter()
    while not mig.ready():
        ts = time.perf_counter()
        if publish(eng.step()):
            last_old = time.perf_counter()
        _sync(args.src)
        pre_steps.append(time.perf_counter() - ts)
    if publish(eng.flush()):
        last_old = time.perf_counter()
    state = {s.rid: (list(s.prompt_ids), s.params.to_dict(), list(s.output_ids)) for s in eng.scheduler.seqs.values()}
    eng = None
    new, events = mig.cutover()
    publish(events)
    first_new = None
    while first_new is None and new.has_work():
        if publish(new.step()):
            first_new = time.perf_counter()
        mig.poll()
    _sync(args.dst)
    row = dict(mig.stats, downtime_s=(first_new - last_old) if first_new else None,
               precopy_wall_s=time.perf_counter() - t0, steps_during_precopy=len(pre_steps),
               step_s_during_precopy=statistics.median(pre_steps) if pre_steps else None,
               in_flight_requests=len(state))
    result["live"] = row
    save()
    while new.has_work():
        publish(new.step())
        mig.poll()
    row.update(mig.finish())
    row["placement"] = mig.placement
    save()
    weights = {n: t.detach().to("cpu") for n, t in new.model.w.items()}
    del new, mig
    gpu_anchor.connect(args.dst, namespace="bench-migrate", socket=args.dst_socket).drop_namespace()
    return reqs, out, state, weights


def _run_reference(args, model, reqs, out, result):
    from gpu_anchor.serve.engine import Engine
    from gpu_anchor.serve.sequence import SamplingParams
    eng = Engine(_engine_cfg(args, model, args.src, None, False, True))
    got = eng.generate([p for _, p, _ in reqs], [SamplingParams(**p.to_dict()) for _, _, p in reqs])
    same = [got[i] == out[rid] for i, (rid, _, _) in enumerate(reqs)]
    result["identical_outputs"] = all(same)
    result["identical_requests"] = f"{sum(same)}/{len(same)}"


def _run_baseline(args, model, state, weights, result, save):
    from safetensors.torch import save_file

    from gpu_anchor.serve.engine import Engine
    from gpu_anchor.serve.sequence import SamplingParams
    mdir = tempfile.mkdtemp(prefix="ga-migrate-model-")
    with open(model) as f:
        cfgd = json.load(f)
    with open(os.path.join(mdir, "config.json"), "w") as f:
        json.dump(cfgd, f)
    t0 = time.perf_counter()
    save_file(weights, os.path.join(mdir, "model.safetensors"))
    weights.clear()
    row = {"save_s": time.perf_counter() - t0}
    t0 = time.perf_counter()
    eng = Engine(_engine_cfg(args, mdir, args.dst, None, False, False))
    _sync(args.dst)
    row["engine_init_s"] = time.perf_counter() - t0
    row["weights_s"] = eng.timings.get("weights_s")
    for rid, (prompt, p, done) in state.items():
        eng.add_request(rid, prompt, SamplingParams(**p), done)
    row["recomputed_tokens"] = sum(len(p) + len(d) for p, _, d in state.values())
    while eng.has_work():
        if eng.step():
            break
    _sync(args.dst)
    row["downtime_s"] = time.perf_counter() - t0
    result["restart"] = row
    save()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench migration")
    ap.add_argument("--tiny", action="store_true", help="smoke run: toy model, host daemon -> another host daemon")
    ap.add_argument("--shape", default="qwen3-8b")
    ap.add_argument("--src", default="cuda:0")
    ap.add_argument("--dst", default="cuda:1")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--prompt-len", type=int, default=1024)
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--warm-tokens", type=int, default=8, help="tokens each request has before the migration")
    ap.add_argument("--kv-gib", type=float, default=8.0)
    ap.add_argument("--max-batched-tokens", type=int, default=4096)
    ap.add_argument("--no-baseline", action="store_true")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    tiny = args.tiny
    if tiny:
        args.src = args.dst = "cpu"
        args.dtype, args.requests, args.prompt_len, args.max_tokens, args.warm_tokens = "float32", 8, 24, 24, 4
        args.kv_gib, args.max_batched_tokens = 0.01, 256
    name = "migration" + ("_tiny" if tiny else "")
    sock = tempfile.mkdtemp(prefix="ga-migbench-")
    os.environ["GPU_ANCHOR_SOCKET_DIR"] = sock
    from bench.models import config
    from gpu_anchor.client import control
    from gpu_anchor.serve.model_runner import head_dim
    mc = config(args.shape, tiny=tiny)
    per_block = 2 * mc.num_hidden_layers * 16 * mc.num_key_value_heads * head_dim(mc) * (4 if tiny else 2)
    args.num_blocks = max(-(-(args.prompt_len + args.max_tokens + 1) // 16) * args.requests + 8,
                          int(args.kv_gib * (1 << 30) // per_block))
    model = os.path.join(sock, "config.json")
    with open(model, "w") as f:
        json.dump(mc.to_dict(), f, default=str)
    args.src_socket = os.path.join(sock, "src.sock")
    args.dst_socket = os.path.join(sock, "dst.sock")
    procs = [control.start(args.src, args.src_socket), control.start(args.dst, args.dst_socket)]
    result = {"shape": args.shape + (" (tiny)" if tiny else ""), "src": args.src, "dst": args.dst,
              "dtype": args.dtype, "requests": args.requests, "prompt_len": args.prompt_len,
              "warm_tokens": args.warm_tokens, "num_blocks": args.num_blocks,
              "kv_cache_bytes": args.num_blocks * per_block,
              "paper": "PhoenixOS (SOSP'25), Llama2-13B: 9.8 s -> 2.3 s",
              "notes": "downtime = last token published by the old engine -> first by the new one; the restart "
                       "baseline excludes process start/imports/CUDA init and reads safetensors from page cache"}

    def save():
        return write_result(name, result, args.out)

    try:
        reqs, out, state, weights = _run_migration(args, model, result, save)
        _run_reference(args, model, reqs, out, result)
        save()
        if not args.no_baseline:
            _run_baseline(args, model, state, weights, result, save)
        print(json.dumps({k: result.get(k) for k in ("live", "restart", "identical_requests")}, indent=1,
                         default=str))
        return 0
    except Exception as e:
        result["error"] = f"{type(e).__name__}: {e}"
        save()
        raise
    finally:
        for path, p in zip((args.src_socket, args.dst_socket), procs):
            control.stop(args.src if path == args.src_socket else args.dst, path)
            p.wait(timeout=30)


def title(r: dict) -> str:
    return (f"Serving: live migration of an engine {r.get('src', '?')} → {r.get('dst', '?')} "
            f"vs stop-and-restart ({r.get('shape', '?')})")


def render(r: dict) -> str:
    live, base = r.get("live", {}), r.get("restart", {})

    def s(v):
        return "—" if v is None else f"{v:.3f} s"
    lines = [f"{r['shape']}, {r['requests']} greedy requests of {r['prompt_len']} prompt tokens, "
             f"{r['src']} → {r['dst']}, KV cache {r['kv_cache_bytes'] / 2**30:.2f} GiB. {r.get('paper', '')}.", "",
             "| Path | Downtime (last token → first token) | Details |", "| --- | --- | --- |"]
    if live:
        lines.append(f"| live migration | **{s(live.get('downtime_s'))}** | cut-over {s(live.get('cutover_s'))} "
                     f"(recopy of {live.get('recopied')} dirty objects {s(live.get('recopy_s'))}, engine rebuild "
                     f"{s(live.get('engine_init_s'))}); pre-copy {s(live.get('precopy_s'))} while serving "
                     f"{live.get('steps_during_precopy')} steps; rest streamed in {s(live.get('stream_s'))}; "
                     f"{live.get('restored')} requests restored with their KV |")
    if base:
        lines.append(f"| stop-and-restart | {s(base.get('downtime_s'))} | engine init {s(base.get('engine_init_s'))} "
                     f"(safetensors {s(base.get('weights_s'))}); {base.get('recomputed_tokens')} prefill tokens "
                     f"recomputed |")
    lines += ["", f"Outputs identical to a fault-free run: {r.get('identical_requests', '—')} requests."]
    if r.get("error"):
        lines.append(f"\n**Run failed:** {r['error']}")
    lines.append("\n" + r.get("notes", ""))
    return "\n".join(lines)
