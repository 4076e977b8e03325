"""Serving throughput with vs without anchoring, vs transformers' ``generate_batch``, and
SIGKILL -> first resumed token on every open stream.

    PYTHONPATH=. python bench/serve_throughput.py --out $OUT/serve_throughput.json      # H200
    PYTHONPATH=. python bench/serve_throughput.py --tiny --out /tmp/s.json             # CPU smoke

Model: Qwen3-8B-shaped (36 layers, hidden 4096, GQA 32/8, head_dim 128, vocab 151936) with
seeded random bf16 weights; ``--tiny`` swaps in a 2-layer model on the CPU.
1. throughput: the same engine code, anchored (daemon memory + one journal commit per step)
   vs plain allocations without a journal, both with CUDA-graph decode (``--no-cuda-graphs``:
   eager).  Both engines live in this process, warmed up (every graph size captured, one
   full-width batch); then ``--rounds`` runs of each on the same requests, alternating (the
   order flips every round): median, min, max of each and the ratio of medians, with each
   engine's host time per step by phase.  ``--eager-rounds`` more runs with the graphs set
   aside show what the eager forward gives (and whether its tokens equal the graphs').
   Also a CPU micro-benchmark of the commit's host cost for 64 decoding sequences.
   The runs cover ``--streams-list`` (32, 64, 128) streams; for each, tokens/s and the decode
   steps' fraction of the memory-bandwidth roofline (``bench/serve_decode.py``: bytes read per
   step from the engine's own tensors, over the 4.8 TB/s specification and over a measured
   device-to-device copy), plus runs with temperature sampling (and top-p) at ``--requests``
   streams.  ``--profile`` prints each engine's decode step by kernel (attention, matmuls,
   sampling, the rest) from torch.profiler.
1b. start-up: each engine built in a fresh process, alternating, both with a warm Triton cache
   and both with a cold one (``serve_decode.startup``); the in-process engines' phases too.
2. ``generate_batch`` (transformers' continuous batching) on the same prompts, greedy.
3. recovery: ``gpu-anchor serve --random-weights`` in its own processes; ``--streams``
   streaming requests; SIGKILL the engine once every stream has tokens; for each stream the
   time from the kill to its next token, plus the engine's own breakdown (process start,
   CUDA init, bind, weights (0 = not reloaded), metadata restore, first step).  The same is
   measured for ``--no-anchor`` (weights re-initialised, every request prefilled again).
"""
from __future__ import annotations

import argparse
import gc
import http.client
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run as a script too
from bench import serve_decode as D  # noqa: E402
from bench.common import get_json, stop_process  # noqa: E402
from bench.serve_throughput_report import PHASES, render  # noqa: E402,F401  (render: python -m bench report)

QWEN3_8B = dict(model_type="qwen3", architectures=["Qwen3ForCausalLM"], vocab_size=151936, hidden_size=4096,
                intermediate_size=12288, num_hidden_layers=36, num_attention_heads=32, num_key_value_heads=8,
                head_dim=128, max_position_embeddings=40960, rms_norm_eps=1e-6, rope_theta=1000000.0,
                hidden_act="silu", tie_word_embeddings=False, bos_token_id=151643, eos_token_id=151645,
                initializer_range=0.02)
TINY = dict(QWEN3_8B, vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, head_dim=16, initializer_range=0.2,
            bos_token_id=1, eos_token_id=2)


def _prompts(n, length, vocab, seed=0):
    rng = random.Random(seed)
    return [[rng.randrange(1000 % vocab, vocab) for _ in range(length)] for _ in range(n)]


def _max_model_len(args) -> int:
    """``--max-model-len``, else just room for a prompt and its tokens (the block tables, and so
    attention's grid, are as wide as this)."""
    return args.max_model_len or args.prompt_len + args.max_tokens + 8


def _engine_cfg(args, config_path, anchor, namespace, seqs=None):
    from gpu_anchor.serve.engine import EngineConfig
    per_seq = -(-(args.prompt_len + args.max_tokens + 1) // args.block_size)
    seqs = seqs or args.requests
    return EngineConfig(model=config_path, random_weights=True, seed=0, device=args.device, dtype=args.dtype,
                        block_size=args.block_size, num_blocks=per_seq * seqs + 8,
                        max_num_seqs=seqs, max_batched_tokens=args.max_batched_tokens,
                        max_model_len=_max_model_len(args), anchor=anchor, namespace=namespace,
                        socket=args.socket, **({"blas_library": args.blas_library} if args.blas_library else {}))


def _sync(device):
    import torch
    if device.startswith("cuda"):
        torch.cuda.synchronize()



def _summary(runs: list[dict]) -> dict:
    """Median, min, max tokens/s of ``runs`` and their host time per step by phase."""
    tps = [r["tokens_per_s"] for r in runs]
    return {"median": statistics.median(tps), "min": min(tps), "max": max(tps), "n": len(tps),
            "step_ms": {k: statistics.median(r["step_ms"][k] for r in runs) for k in PHASES},
            "wall_ms_per_step": statistics.median(r["seconds"] * 1e3 / max(r["steps"], 1) for r in runs)}


def throughput(args, config_path) -> dict:
    """Warm both engines up (every graph size captured), then, for each stream count, alternate
    anchored and plain runs of the same requests (the order flips every round) and compare
    medians; decode steps against the bandwidth roofline; sampled runs; ``--profile``."""
    from gpu_anchor.serve.engine import Engine
    from gpu_anchor.serve.sequence import SamplingParams
    vocab = json.load(open(config_path))["vocab_size"]
    prompts = _prompts(args.requests, args.prompt_len, vocab)
    sp = SamplingParams(max_tokens=args.max_tokens, ignore_eos=True)
    streams = sorted(set(args.streams_list) | {args.requests})
    engines, graphs, build = {}, {}, {}
    for name, anchor in (("anchored", True), ("plain", False)):
        t = time.perf_counter()
        cfg = _engine_cfg(args, config_path, anchor, "bench-throughput", seqs=max(streams))
        cfg.cuda_graphs = not args.no_cuda_graphs
        cfg.async_scheduling = args.async_scheduling == "on"
        eng = engines[name] = Engine(cfg)
        _sync(args.device)
        t1 = time.perf_counter()
        eng.generate(_prompts(2, 16, vocab, seed=1), SamplingParams(max_tokens=4))   # compile kernels
        _sync(args.device)
        t2 = time.perf_counter()
        graphs[name] = eng.capture_graphs()
        t3 = time.perf_counter()
        eng.generate(prompts, SamplingParams(max_tokens=min(8, args.max_tokens), ignore_eos=True))  # full width
        _sync(args.device)
        t4 = time.perf_counter()
        # in one process the first engine also pays what a process pays once (Triton compiles,
        # cuBLAS set-up, the HF meta model): the fair comparison is ``startup`` (fresh processes)
        build[name] = {"construct_s": t1 - t, "first_requests_s": t2 - t1, "capture_s": t3 - t2,
                       "full_width_s": t4 - t3, "ready_s": t4 - t, "engine_timings": dict(eng.timings)}
        print(f"[bench] {name} engine ready in {t4 - t:.1f} s ({build[name]}); graphs {graphs[name]}", flush=True)
    bw = {"spec_4.8TB/s": D.H200_SPEC_BPS} if args.device.startswith("cuda") else {}
    copy = D.copy_bandwidth(args.device, 4 << 30)
    if copy:
        bw["measured_copy"] = copy["best_bps"]
    if not bw:       # the CPU smoke: a nominal figure, only to exercise the arithmetic
        bw["nominal_cpu_20GB/s"] = 20e9

    def make(n):
        return _prompts(n, args.prompt_len, vocab)
    # --async-scheduling both: each engine runs in both modes, alternating with the others
    # ("anchored" / "plain" synchronous, "…, async" launching decode steps ahead)
    variants, modes = engines, None
    if args.async_scheduling == "both":
        variants = {f"{k}{sfx}": e for k, e in engines.items() for sfx in ("", ", async")}
        modes = {k: k.endswith(", async") for k in variants}
    sweep = D.sweep(variants, streams, args.rounds, make, sp, args.device, PHASES, bw, modes)
    sampled = {}
    for label, extra in (("temperature 0.8", {"temperature": 0.8}),
                         ("temperature 0.8, top-p 0.95", {"temperature": 0.8, "top_p": 0.95}),
                         ("temperature 0.7, top-k 20, top-p 0.8", {"temperature": 0.7, "top_k": 20, "top_p": 0.8})):
        ssp = SamplingParams(**dict(sp.to_dict(), seed=11, **extra))
        sampled[label] = D.sweep(variants, [args.requests], min(args.rounds, 3), make, ssp, args.device, PHASES,
                                 bw, modes)[str(args.requests)]
    for e in engines.values():           # the rest runs in the engines' configured mode
        e.set_async_scheduling(args.async_scheduling == "on")
    cell = sweep[str(args.requests)]
    runs = {k: v["runs"] for k, v in cell.items()}
    summary = {k: dict(_summary(v), decode=cell[k]) for k, v in runs.items()}
    res = {"runs": runs, "summary": summary, "graphs": graphs, "cuda_graphs": not args.no_cuda_graphs,
           "async_scheduling": args.async_scheduling,
           "median_tokens_per_s": {k: v["median"] for k, v in summary.items()},
           "anchored_over_plain": summary["anchored"]["median"] / summary["plain"]["median"],
           "engine_build_in_process": build, "bandwidth_bps": bw, "copy_bandwidth": copy,
           "sweep": {n: {k: {kk: vv for kk, vv in c.items() if kk != "runs"} for k, c in x.items()}
                     for n, x in sweep.items()},
           "sweep_runs": {n: {k: c["runs"] for k, c in x.items()} for n, x in sweep.items() if n != str(args.requests)},
           "sampled": {lab: {k: {kk: vv for kk, vv in c.items() if kk != "runs"} for k, c in x.items()}
                       for lab, x in sampled.items()}}
    if modes:      # async over sync, same engine, medians of alternating runs
        res["async_over_sync"] = {k: summary[f"{k}, async"]["median"] / summary[k]["median"] for k in engines}
        res["async_decode_step_ms"] = {k: {m: cell[k + sfx]["decode_step_ms"]["median"] for m, sfx in
                                           (("sync", ""), ("async", ", async"))} for k in engines}
    if args.profile:
        res["profile"] = {}
        n = args.requests
        for label, eng_name, p, eager in (("plain, greedy, graphs", "plain", sp, False),
                                          ("anchored, greedy, graphs", "anchored", sp, False),
                                          ("plain, temperature 0.8, graphs", "plain",
                                           SamplingParams(**dict(sp.to_dict(), temperature=0.8, seed=3)), False),
                                          ("plain, greedy, eager", "plain", sp, True)):
            e = engines[eng_name]
            kept = e.graphs
            if eager:
                e.graphs = None
            try:
                res["profile"][label] = D.profile_decode(e, make(n)[:n], SamplingParams(
                    **dict(p.to_dict(), max_tokens=max(args.max_tokens, 16))), args.device)
            finally:
                e.graphs = kept
            D.print_profile(f"{label}, {n} streams", res["profile"][label])
    few = SamplingParams(max_tokens=16, ignore_eos=True)
    res["anchored_and_plain_outputs_equal"] = engines["anchored"].generate(prompts[:4], few) == \
        engines["plain"].generate(prompts[:4], few)
    if engines["plain"].graphs is not None and args.eager_rounds:
        # the same engines with the graphs set aside: what the eager forward gives, and whether
        # graph and eager decode pick the same tokens (bf16: a padded GEMM may flip a near-tie)
        kept = {k: e.graphs for k, e in engines.items()}
        ref = engines["plain"].generate(prompts[:8], SamplingParams(max_tokens=32, ignore_eos=True))
        for e in engines.values():
            e.graphs = None
        eager = {k: [] for k in engines}
        order = list(engines)
        for r in range(args.eager_rounds):
            for name in order:
                eager[name].append(D.decode_run(engines[name], prompts, sp, args.device, PHASES))
                print(f"[bench] eager round {r} {name}: {eager[name][-1]['tokens_per_s']:.0f} tok/s", flush=True)
        alt = engines["plain"].generate(prompts[:8], SamplingParams(max_tokens=32, ignore_eos=True))
        for k, e in engines.items():
            e.graphs = kept[k]
        es = {k: _summary(v) for k, v in eager.items()}
        res["eager"] = {"runs": eager, "summary": es,
                        "anchored_over_plain": es["anchored"]["median"] / es["plain"]["median"],
                        "graph_tokens_equal_to_eager": sum(a == b for x, y in zip(ref, alt) for a, b in zip(x, y))
                        / sum(map(len, ref))}
    for eng in engines.values():
        if eng.anchor.client is not None:
            eng.anchor.client.drop_namespace()
    engines.clear()
    gc.collect()
    if args.device.startswith("cuda"):
        import torch
        torch.cuda.empty_cache()
    return res


def commit_microbench(n_seqs: int = 64, steps: int = 256, prompt_len: int = 256, block_size: int = 16) -> dict:
    """Host cost of the per-step commit for ``n_seqs`` decoding sequences (CPU only): the
    snapshot at the end of a step (on the critical path) and its encoding (done while the
    next forward runs on the GPU), and the bytes each commit carries."""
    from gpu_anchor.serve.commit import Committer
    from gpu_anchor.serve.sequence import SamplingParams, Sequence, Status

    class _Sink:
        def commit(self, puts, deletes=()):
            pass
    c = Committer(_Sink())
    seqs = []
    for i in range(n_seqs):
        s = Sequence(f"gen-{i}", list(range(prompt_len)), SamplingParams(max_tokens=steps))
        s.status, s.num_computed = Status.RUNNING, prompt_len
        s.block_table = list(range(i * 64, i * 64 + prompt_len // block_size + 1))
        seqs.append(s)
    c.commit(seqs)
    snap_s = build_s = 0.0
    nbytes = 0
    for step in range(steps):
        for s in seqs:
            s.output_ids.append(step)
            s.num_computed += 1
            if s.num_computed % block_size == 0:
                s.block_table.append(100000 + len(s.block_table))
        t0 = time.perf_counter()
        snap = c.snapshot(seqs)
        t1 = time.perf_counter()
        puts, _ = c.build(snap)
        build_s += time.perf_counter() - t1
        snap_s += t1 - t0
        nbytes += sum(len(k) + len(v) for k, v in puts.items())
    return {"sequences": n_seqs, "steps": steps, "snapshot_us_per_step": snap_s / steps * 1e6,
            "build_us_per_step": build_s / steps * 1e6, "bytes_per_commit": nbytes / steps}


def hf_generate_batch(args, config_path) -> dict:
    """transformers' ``generate_batch`` (continuous batching) timed as the engines are: warmed on
    the same prompts (one untimed full run), then ``--rounds`` timed runs of those prompts, each
    from the call to its return with the device synchronised at both ends."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig
    cfg = AutoConfig.for_model(**json.load(open(config_path)))
    vocab = cfg.vocab_size
    prompts = _prompts(args.requests, args.prompt_len, vocab)
    with torch.device(args.device):
        model = AutoModelForCausalLM.from_config(cfg, dtype=getattr(torch, args.dtype)).eval()
    if not hasattr(model, "generate_batch"):
        return {"error": "this transformers has no generate_batch"}
    gcfg = GenerationConfig(max_new_tokens=args.max_tokens, do_sample=False, eos_token_id=-1, pad_token_id=0)
    model.generate_batch(inputs=prompts, generation_config=gcfg)     # warm-up: the same requests, untimed
    runs = []
    for r in range(args.rounds):
        _sync(args.device)
        t = time.perf_counter()
        out = model.generate_batch(inputs=prompts, generation_config=gcfg)
        _sync(args.device)
        dt = time.perf_counter() - t
        n = sum(len(o.generated_tokens) for o in out.values())
        runs.append({"seconds": dt, "tokens": n, "tokens_per_s": n / dt})
        print(f"[bench] generate_batch round {r}: {n / dt:.0f} tok/s", flush=True)
    del model
    gc.collect()
    if args.device.startswith("cuda"):
        torch.cuda.empty_cache()
    tps = [x["tokens_per_s"] for x in runs]
    return {"runs": runs, "median_tokens_per_s": statistics.median(tps), "min_tokens_per_s": min(tps),
            "max_tokens_per_s": max(tps), "n": len(runs), "warmup": "the same prompts, one full run",
            "tokens_per_s": statistics.median(tps)}


def recovery(args, config_path, anchor: bool) -> dict:
    """Start ``gpu-anchor serve``, then ``--kills`` times: open streams, SIGKILL the engine, time
    each stream's resumption (the server restarts the engine by itself)."""
    tmp = tempfile.mkdtemp(prefix="serve-bench-")
    port_file = os.path.join(tmp, "port")
    per_seq = -(-(args.prompt_len + args.max_tokens + 1) // args.block_size)
    cmd = [sys.executable, "-m", "gpu_anchor.serve", config_path, "--random-weights", "--device", args.device,
           "--dtype", args.dtype, "--block-size", str(args.block_size),
           "--num-blocks", str(per_seq * args.streams + 8), "--max-num-seqs", str(args.streams),
           "--max-num-batched-tokens", str(args.max_batched_tokens),
           "--max-model-len", str(_max_model_len(args)),
           "--port", "0", "--port-file", port_file, "--namespace", f"bench-recovery-{int(anchor)}"]
    # a fresh engine after each kill for both (the hot standby, the default on one GPU, is bench serve_takeover's)
    cmd += ["--socket", args.socket, "--no-hot-standby", "--no-prewarm"] if anchor else ["--no-anchor"]
    log = open(os.path.join(tmp, "serve.log"), "wb")
    proc = subprocess.Popen(cmd, stdout=log, stderr=log, env=dict(os.environ, PYTHONPATH=os.getcwd()))
    try:
        t0 = time.time()
        while not os.path.exists(port_file) or get_json(f"http://127.0.0.1:{open(port_file).read()}/health").get(
                "status") != "ok":
            if proc.poll() is not None or time.time() - t0 > 600:
                raise RuntimeError("server did not come up: " + open(log.name).read()[-3000:])
            time.sleep(0.2)
        base = f"http://127.0.0.1:{open(port_file).read()}"
        cold_start = time.time() - t0
        vocab = json.load(open(config_path))["vocab_size"]
        kills = [_kill_round(args, base, _prompts(args.streams, args.prompt_len, vocab, seed=7 + k))
                 for k in range(args.kills)]
        health = get_json(base + "/health")
        med = [k["median"] for k in kills if k]
        return {"anchored": anchor, "streams": args.streams, "server_cold_start_s": cold_start, "kills": kills,
                "kill_to_first_resumed_token_s": {"min": min(k["min"] for k in kills if k),
                                                  "median": statistics.median(med),
                                                  "max": max(k["max"] for k in kills if k), "n": len(med)}
                if med else None,
                "streams_resumed": min((k["streams_resumed"] for k in kills if k), default=0),
                "engine_breakdown_s": health.get("last_recovery"), "token_mismatches": health.get("token_mismatches")}
    finally:
        stop_process(proc)


def _kill_round(args, base: str, prompts) -> dict | None:
    """Open a stream per prompt, SIGKILL the engine once every stream has tokens, and return the
    time from the kill to each stream's next token (min / median / max over the streams)."""
    stamps = [[] for _ in prompts]
    host, port = base.rsplit("/", 1)[1].split(":")

    def run(i):   # plain http.client SSE reader: the openai package may be absent on the GPU host
        conn = http.client.HTTPConnection(host, int(port), timeout=900)
        body = json.dumps({"prompt": prompts[i], "max_tokens": args.max_tokens,
                           "temperature": 0, "stream": True, "ignore_eos": True})
        conn.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
        resp = conn.getresponse()
        for line in resp:
            if line.startswith(b"data: {"):
                stamps[i].append(time.time())     # one chunk per token batch
        conn.close()

    while not get_json(base + "/health").get("engine_pid"):   # the previous round's engine is back
        time.sleep(0.05)
    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    while min(len(s) for s in stamps) < 8:
        if not any(t.is_alive() for t in threads):
            raise RuntimeError("streams ended before the kill: raise --max-tokens")
        time.sleep(0.01)
    pid = get_json(base + "/health")["engine_pid"]
    # Freeze the engine at an arbitrary point, let tokens already on the wire arrive,
    # then kill it: every token after t_kill comes from the next engine.
    os.kill(pid, signal.SIGSTOP)
    time.sleep(1.0)
    t_kill = time.time()
    os.kill(pid, signal.SIGKILL)
    for t in threads:
        t.join()
    gaps = [g for g in (next((x - t_kill for x in s if x > t_kill), None) for s in stamps) if g is not None]
    return {"min": min(gaps), "median": statistics.median(gaps), "max": max(gaps),
            "streams_resumed": len(gaps)} if gaps else None


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tiny", action="store_true", help="2-layer model on the CPU (smoke run)")
    ap.add_argument("--device", default=None)
    ap.add_argument("--dtype", default=None)
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--streams", type=int, default=64)
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--max-model-len", type=int, default=None,
                    help="the engines' max_model_len (default: prompt + max tokens + 8), as a deployment sets it")
    ap.add_argument("--max-batched-tokens", type=int, default=4096)
    ap.add_argument("--rounds", type=int, default=5, help="timed runs of each engine (and of generate_batch)")
    ap.add_argument("--kills", type=int, default=3, help="engine SIGKILLs per recovery measurement (n >= 3)")
    ap.add_argument("--eager-rounds", type=int, default=1, help="runs of each mode with the graphs set aside")
    ap.add_argument("--no-cuda-graphs", action="store_true", help="eager decode in both modes")
    ap.add_argument("--async-scheduling", choices=("off", "on", "both"), default="off",
                    help="decode steps launched ahead of the previous step's read (the engine's async_scheduling); "
                         "both: each engine in both modes, alternating, with their ratio")
    ap.add_argument("--blas-library", choices=("auto", "cublas", "cublaslt"), default=None,
                    help="both engines' CUDA matmul library (default: the engine's default)")
    ap.add_argument("--skip-hf", action="store_true")
    ap.add_argument("--skip-recovery", action="store_true")
    ap.add_argument("--skip-recovery-baseline", action="store_true")
    ap.add_argument("--streams-list", default="32,64,128", help="stream counts of the roofline sweep")
    ap.add_argument("--profile", action="store_true", help="print a decode step by kernel (torch.profiler)")
    ap.add_argument("--startup-modes", default="warm,cold", help="fresh-process start-ups: warm and/or cold Triton cache")
    ap.add_argument("--startup-n", type=int, default=3, help="start-ups of each engine per mode (n >= 3)")
    ap.add_argument("--skip-startup", action="store_true")
    ap.add_argument("--out", default=None, help="JSON path (default: $OUT/serve_throughput.json or stdout)")
    ap.add_argument("--startup-child", choices=("anchored", "plain"), help=argparse.SUPPRESS)
    ap.add_argument("--config-path", help=argparse.SUPPRESS)
    ap.add_argument("--socket", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    args.streams_list = [int(x) for x in args.streams_list.split(",") if x]
    if args.max_model_len is not None and args.max_model_len < args.prompt_len + args.max_tokens + 1:
        ap.error(f"--max-model-len {args.max_model_len}: a request of --prompt-len {args.prompt_len} and "
                 f"--max-tokens {args.max_tokens} needs at least {args.prompt_len + args.max_tokens + 1}")
    if args.startup_child:      # one engine start-up in this fresh process (``serve_decode.startup``)
        print(json.dumps(D.startup_child(args, args.config_path, args.startup_child == "anchored")))
        return 0
    if args.tiny:  # a smoke run: every code path, a few seconds of work
        args.device = args.device or "cpu"
        args.dtype = args.dtype or "float32"
        args.requests = args.streams = min(args.requests, 8)
        args.prompt_len, args.max_tokens = min(args.prompt_len, 32), min(args.max_tokens, 40)
        args.rounds, args.eager_rounds, args.kills = min(args.rounds, 1), min(args.eager_rounds, 1), 1
        args.streams_list = [x for x in (4, 8) if x <= args.requests]
        args.startup_n, args.startup_modes = 1, "warm"
    args.device = args.device or "cuda:0"
    args.dtype = args.dtype or "bfloat16"
    from gpu_anchor.client import control
    sockdir = tempfile.mkdtemp(prefix="serve-bench-sock-")
    args.socket = os.path.join(sockdir, args.device.replace(":", "") + ".sock")
    daemon = control.start(args.device, args.socket)
    config_path = os.path.join(sockdir, "config.json")
    with open(config_path, "w") as f:
        json.dump(TINY if args.tiny else QWEN3_8B, f)
    from gpu_anchor.serve import attention
    res = {"model": "tiny-qwen3" if args.tiny else "Qwen3-8B-shaped random bf16", "device": args.device,
           "dtype": args.dtype, "requests": args.requests, "prompt_len": args.prompt_len,
           "max_tokens": args.max_tokens, "max_model_len": _max_model_len(args),
           "attention_split_keys": attention.SPLIT_KEYS}
    out = args.out or (os.path.join(os.environ["OUT"], "serve_throughput.json") if os.environ.get("OUT") else None)

    def save():   # after every part: a later failure or timeout keeps what was measured
        if out:
            # --out names a results directory (as every scenario takes) or a .json file
            out_dir, name = (os.path.dirname(out) or ".", os.path.basename(out)[:-5]) if out.endswith(".json") \
                else (out, "serve_throughput_tiny" if args.tiny else "serve_throughput")
            res["title"] = "Serving: throughput with and without anchoring, and recovery"
            from bench.common import write_result
            write_result(name, res, out_dir)

    def part(key, fn, *a):
        t = time.perf_counter()
        try:
            res[key] = fn(*a)
        except Exception as e:   # report, do not hide: the other numbers still stand
            import traceback
            traceback.print_exc()
            res[key] = {"error": f"{type(e).__name__}: {e}"[:2000]}
        res.setdefault("part_seconds", {})[key] = time.perf_counter() - t
        save()

    part("commit_microbench", commit_microbench)
    try:
        part("throughput", throughput, args, config_path)
        if not args.skip_startup:
            part("startup", D.startup, args, config_path, [m for m in args.startup_modes.split(",") if m],
                 args.startup_n)
        if not args.skip_hf:
            part("hf_generate_batch", hf_generate_batch, args, config_path)
            if "tokens_per_s" in res["hf_generate_batch"] and "median_tokens_per_s" in res["throughput"]:
                res["anchored_over_generate_batch"] = (res["throughput"]["median_tokens_per_s"]["anchored"]
                                                       / res["hf_generate_batch"]["tokens_per_s"])
        if not args.skip_recovery:
            part("recovery_anchored", recovery, args, config_path, True)
            if not args.skip_recovery_baseline:
                part("recovery_no_anchor", recovery, args, config_path, False)
    finally:
        control.stop(args.device, args.socket)
        daemon.wait(30)
    save()
    text = json.dumps(res, indent=2)
    print(text)
    return 0


if __name__ == "__main__":
    main()
