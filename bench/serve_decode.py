"""Decode against the memory-bandwidth roofline, a per-kernel profile of a decode step, and
the engines' start-up under the same conditions (parts of ``bench/serve_throughput.py``).

Roofline.  A decode step of ``B`` sequences must at least read every weight once (the
embedding only for its ``B`` rows) and every live KV entry of every layer once, and write one
K/V entry per sequence and layer:

    bytes(step) = weights − embedding + B·hidden·itemsize + Σ_seq context · L·2·Hkv·D·itemsize
                  + B · L·2·Hkv·D·itemsize

from the engine's own tensors (shapes and dtypes as bound).  The fraction of the roofline is
``Σ bytes / (Σ step seconds × bandwidth)`` over the decode-only steps of a run (a step's
seconds: host wall around ``Engine.step``, which ends by reading the sampled ids, so it holds
the whole GPU step and any host time the GPU waited for).  Bandwidths: the H200's 4.8 TB/s
specification, and a measured device-to-device copy (read + write bytes over its time).

Start-up: each engine built in a fresh process (``--startup-child``), the same sequence as
the throughput part (construct, two short requests, capture every graph, one full-width
batch), alternating anchored and plain, in two conditions: *warm* (a Triton cache primed by
one discarded start, shared by every start) and *cold* (an empty Triton cache for each start).
"""
from __future__ import annotations

import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

from bench.step_profile import ATTENTION, MATMUL, by_category, by_kernel, first_match

H200_SPEC_BPS = 4.8e12


# ------------------------------------------------------------------ roofline
def step_bytes_model(eng) -> tuple[int, int, int]:
    """``(fixed, per_seq, per_ctx_token)`` bytes of a decode step of ``eng``: weights read once
    (the embedding only per sequence), per sequence its embedding row and its new K/V, per
    context token its K/V in every layer."""
    w = eng.model.w
    emb = w["model.embed_tokens.weight"]
    nbytes = sum(t.numel() * t.element_size() for t in w.values())
    tied = eng.model.lm_head is emb
    fixed = nbytes - (0 if tied else emb.numel() * emb.element_size())
    kv = eng.model.kv[0]
    per_tok = len(eng.model.kv) * 2 * kv.shape[3] * kv.shape[4] * kv.element_size()
    row = emb.shape[1] * emb.element_size()
    return fixed, (0 if tied else row) + per_tok, per_tok


def copy_bandwidth(device: str, nbytes: int, repeat: int = 5) -> dict | None:
    """Device-to-device copy of ``nbytes``: (read + write) bytes / seconds, best of ``repeat``."""
    import torch
    if not device.startswith("cuda"):
        return None
    x = torch.empty(nbytes, dtype=torch.uint8, device=device)
    y = torch.empty_like(x)
    y.copy_(x)
    times = []
    for _ in range(repeat):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        y.copy_(x)
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / 1e3)
    del x, y
    torch.cuda.empty_cache()
    return {"bytes": nbytes, "best_bps": 2 * nbytes / min(times), "median_bps": 2 * nbytes / statistics.median(times)}


def decode_run(eng, prompts, sp, device, phases) -> dict:
    """Run ``prompts`` to completion, timing every step; decode-only steps are summed for the
    roofline (their bytes from ``step_bytes_model`` and the running sequences' contexts).
    ``sp``: the sampling parameters of every request, or a list of one per request."""
    import torch
    from gpu_anchor.serve.sequence import SamplingParams, Status
    fixed, per_seq, per_ctx = step_bytes_model(eng)
    s0, c0, b0 = eng.steps, eng.committer.commits, eng.committer.bytes
    t0, n0 = dict(eng.step_times), dict(eng.step_counts)
    base = eng._arrivals
    for i, p in enumerate(prompts):
        eng.add_request(f"dec-{base + i}", p, SamplingParams(**(sp[i] if isinstance(sp, list) else sp).to_dict()))
    tokens = dec_s = dec_bytes = 0.0
    dec_steps = dec_tokens = 0
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    start = time.perf_counter()
    while eng.has_work():
        run = [s for s in eng.scheduler.seqs.values() if s.status is Status.RUNNING]
        ctx = sum(s.num_computed + 1 for s in run)
        t = time.perf_counter()
        events = eng.step()
        dt = time.perf_counter() - t
        tokens += sum(len(e[2]) for e in events)
        if not eng._prefill_step and run:
            dec_steps += 1
            dec_tokens += len(run)
            dec_s += dt
            dec_bytes += fixed + per_seq * len(run) + per_ctx * ctx
    tokens += sum(len(e[2]) for e in eng.flush())
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    wall = time.perf_counter() - start
    steps = eng.steps - s0
    return {"seconds": wall, "tokens": tokens, "tokens_per_s": tokens / wall, "steps": steps,
            "graph_steps": eng.step_counts["graph"] - n0["graph"], "eager_steps": eng.step_counts["eager"] - n0["eager"],
            # launched after the previous step's read / ahead of it; rows computed ahead and dropped
            **{f"{k}_steps": eng.step_counts[k] - n0[k] for k in ("sync", "async", "discarded")},
            "commits": eng.committer.commits - c0, "commit_bytes": eng.committer.bytes - b0,
            "decode_steps": dec_steps, "decode_s": dec_s, "decode_bytes": dec_bytes,
            "decode_tokens_per_s": dec_tokens / dec_s if dec_s else None,
            "decode_step_ms": dec_s * 1e3 / dec_steps if dec_steps else None,
            "decode_bytes_per_step": dec_bytes / dec_steps if dec_steps else None,
            "step_ms": {k: (eng.step_times[k] - t0[k]) * 1e3 / max(steps, 1) for k in phases}}


def sweep(engines: dict, streams: list[int], rounds: int, make_prompts, sp, device, phases, bw: dict,
          modes: dict | None = None) -> dict:
    """For each stream count: ``rounds`` runs of each engine, alternating (order flips every
    round); tokens/s and the decode steps' roofline fraction, median [min–max].  ``modes``:
    name -> asynchronous scheduling on or off for that entry's runs (one engine may appear
    under two names)."""
    out = {}
    for n in streams:
        prompts = make_prompts(n)
        runs = {k: [] for k in engines}
        order = list(engines)
        for r in range(rounds):
            for name in (order if r % 2 == 0 else order[::-1]):
                if modes:
                    engines[name].set_async_scheduling(modes[name])
                x = decode_run(engines[name], prompts, sp, device, phases)
                if x["decode_s"]:
                    x["roofline_fraction"] = {k: x["decode_bytes"] / (x["decode_s"] * v) for k, v in bw.items()}
                runs[name].append(x)
                print(f"[bench] {n} streams, round {r}, {name}: {x['tokens_per_s']:.0f} tok/s, decode step "
                      f"{x['decode_step_ms'] or 0:.2f} ms, roofline {x.get('roofline_fraction')}", flush=True)
        out[str(n)] = {k: _cells(v) for k, v in runs.items()}
    return out


def _cells(runs: list[dict]) -> dict:
    def cell(vals):
        vals = [v for v in vals if v is not None]
        return {"median": statistics.median(vals), "min": min(vals), "max": max(vals), "n": len(vals)} if vals else None
    keys = runs[0].get("roofline_fraction", {}).keys()
    return {"tokens_per_s": cell([r["tokens_per_s"] for r in runs]),
            "decode_tokens_per_s": cell([r["decode_tokens_per_s"] for r in runs]),
            "decode_step_ms": cell([r["decode_step_ms"] for r in runs]),
            "decode_bytes_per_step": cell([r["decode_bytes_per_step"] for r in runs]),
            "roofline_fraction": {k: cell([r["roofline_fraction"][k] for r in runs]) for k in keys},
            "step_ms": {k: statistics.median(r["step_ms"][k] for r in runs) for k in runs[0]["step_ms"]},
            "steps": {k: statistics.median(r.get(f"{k}_steps", 0) for r in runs) for k in ("sync", "async", "discarded")},
            "runs": runs}


# ------------------------------------------------------------------ profile
CATEGORIES = (   # first match wins
    ("attention", r"split_kv|combine_kernel|paged_attn|" + ATTENTION),
    ("kv write", r"store_kv|index_put"),
    ("sampling", r"argmax|softmax|scan|cumsum|sort|topk|uniform_kernel|searchsorted|nextafter"),
    ("matmul", MATMUL),
    ("memcpy/memset", r"memcpy|memset|aten::copy_|aten::to\b"),
)


def categorize(name: str) -> str:
    return first_match(name, CATEGORIES, "other (norms, rotary, elementwise, embedding)")


def profile_decode(eng, prompts, sp, device, steps: int = 5) -> dict:
    """Prefill ``prompts``, then profile ``steps`` decode steps: device time per step by
    category and the top kernels (on the CPU: self CPU time of the aten ops)."""
    import torch
    from torch.profiler import ProfilerActivity, profile
    from gpu_anchor.serve.sequence import SamplingParams
    base = eng._arrivals
    for i, p in enumerate(prompts):
        eng.add_request(f"prof-{base + i}", p, SamplingParams(**sp.to_dict()))
    while eng.has_work():          # up to the first decode-only step (and one more, for graphs)
        eng.step()
        if not eng._prefill_step:
            break
    eng.step()
    cuda = device.startswith("cuda")
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    done = 0
    with profile(activities=acts) as prof:
        t = time.perf_counter()
        while done < steps and eng.has_work():
            eng.step()
            done += 1
        if cuda:
            torch.cuda.synchronize()
        wall = time.perf_counter() - t
    while eng.has_work():
        eng.step()
    eng.flush()
    rows = by_kernel(prof, done, cuda)
    cats = by_category(rows, categorize)
    busy = sum(cats.values())
    return {"steps": done, "wall_ms_per_step": wall * 1e3 / max(done, 1), "busy_ms_per_step": busy,
            "kernels_per_step": sum(c for _, _, c in rows), "clock": "device" if cuda else "cpu (aten self time)",
            "by_category_ms": cats,
            "top": [{"name": n[:160], "ms_per_step": ms, "calls_per_step": c, "category": categorize(n)}
                    for n, ms, c in rows[:25]]}


def print_profile(label: str, p: dict) -> None:
    print(f"\n[profile] {label}: {p['steps']} decode steps; wall {p['wall_ms_per_step']:.2f} ms/step, "
          f"{p['clock']} busy {p['busy_ms_per_step']:.2f} ms/step, {p['kernels_per_step']:.0f} "
          f"{'kernels' if p['clock'] == 'device' else 'ops (nested ones too)'}/step")
    for cat, ms in p["by_category_ms"].items():
        print(f"  {cat:<48} {ms:8.3f} ms/step  {ms / max(p['busy_ms_per_step'], 1e-9):6.1%}")
    print("  top kernels (ms/step, calls/step):")
    for k in p["top"][:15]:
        print(f"    {k['ms_per_step']:8.3f} {k['calls_per_step']:7.1f}  [{k['category'][:9]}] {k['name'][:110]}")
    sys.stdout.flush()


# ------------------------------------------------------------------ start-up
STARTUP_PHASES = ("construct_s", "first_requests_s", "capture_s", "full_width_s")


def startup_child(args, config_path, anchored: bool) -> dict:
    """Body of ``--startup-child``: the throughput part's warm-up of one engine, timed."""
    t = time.perf_counter()
    import torch
    from gpu_anchor.serve.engine import Engine
    from gpu_anchor.serve.sequence import SamplingParams
    out = {"anchored": anchored, "imports_s": time.perf_counter() - t}
    vocab = json.load(open(config_path))["vocab_size"]
    from bench.serve_throughput import _engine_cfg, _prompts, _sync
    t = time.perf_counter()
    cfg = _engine_cfg(args, config_path, anchored, f"bench-startup-{os.getpid()}")
    eng = Engine(cfg)
    _sync(args.device)
    out["construct_s"] = time.perf_counter() - t
    out["engine_timings"] = dict(eng.timings)
    t = time.perf_counter()
    eng.generate(_prompts(2, 16, vocab, seed=1), SamplingParams(max_tokens=4))
    _sync(args.device)
    out["first_requests_s"] = time.perf_counter() - t
    t = time.perf_counter()
    eng.capture_graphs()
    _sync(args.device)
    out["capture_s"] = time.perf_counter() - t
    t = time.perf_counter()
    eng.generate(_prompts(args.requests, args.prompt_len, vocab), SamplingParams(max_tokens=8, ignore_eos=True))
    _sync(args.device)
    out["full_width_s"] = time.perf_counter() - t
    out["ready_s"] = sum(out[k] for k in STARTUP_PHASES)
    if eng.anchor.client is not None:
        eng.anchor.client.drop_namespace()
    del eng
    if args.device.startswith("cuda"):
        torch.cuda.empty_cache()
    return out


def startup(args, config_path, modes=("warm", "cold"), n: int = 3) -> dict:
    """Fresh-process start-ups, alternating anchored and plain, ``n`` of each per mode."""
    res = {}
    script = os.path.join(os.path.dirname(os.path.abspath(__file__)), "serve_throughput.py")
    base = [sys.executable, script, "--config-path", config_path, "--socket", args.socket, "--device", args.device,
            "--dtype", args.dtype, "--requests", str(args.requests), "--prompt-len", str(args.prompt_len),
            "--max-tokens", str(args.max_tokens), "--block-size", str(args.block_size),
            "--max-batched-tokens", str(args.max_batched_tokens)]
    root = tempfile.mkdtemp(prefix="serve-startup-")

    def child(mode_flag: str, cache: str) -> dict:
        env = dict(os.environ, TRITON_CACHE_DIR=cache, PYTHONPATH=os.getcwd())
        t = time.time()
        r = subprocess.run(base + ["--startup-child", mode_flag], capture_output=True, text=True, env=env,
                           timeout=600)
        if r.returncode:
            raise RuntimeError(f"start-up child ({mode_flag}) failed: {r.stderr[-2000:]}")
        d = json.loads(r.stdout.strip().splitlines()[-1])
        d["process_s"] = time.time() - t
        return d

    try:
        for mode in modes:
            warm_cache = os.path.join(root, "warm")
            if mode == "warm":
                child("plain", warm_cache)        # primes the shared cache; discarded
            runs = {"anchored": [], "plain": []}
            for i in range(n):
                for name in (("anchored", "plain") if i % 2 == 0 else ("plain", "anchored")):
                    cache = warm_cache if mode == "warm" else os.path.join(root, f"cold-{name}-{i}")
                    runs[name].append(child(name, cache))
                    x = runs[name][-1]
                    print(f"[bench] start-up {mode} {name}: ready {x['ready_s']:.2f} s (construct "
                          f"{x['construct_s']:.2f}, first requests {x['first_requests_s']:.2f}, capture "
                          f"{x['capture_s']:.2f}, full width {x['full_width_s']:.2f}); process {x['process_s']:.2f} s",
                          flush=True)
            med = {k: {p: statistics.median(r[p] for r in v) for p in STARTUP_PHASES + ("ready_s", "process_s")}
                   for k, v in runs.items()}
            res[mode] = {"runs": runs, "median": med, "n": n,
                         "anchored_over_plain_ready": med["anchored"]["ready_s"] / med["plain"]["ready_s"]}
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return res


# ------------------------------------------------------------------ report
def _c(cell, fmt="{:.0f}") -> str:
    if not cell:
        return "–"
    return f"{fmt.format(cell['median'])} [{fmt.format(cell['min'])}–{fmt.format(cell['max'])}] (n = {cell['n']})"


def render(r: dict) -> list[str]:
    """Markdown lines for docs/benchmarks.md: the roofline sweep, sampled runs, start-up, profile."""
    tp, out = r.get("throughput", {}), []
    sw = tp.get("sweep")
    if sw:
        bw = tp.get("bandwidth_bps", {})
        keys = list(bw)
        out += ["", "Decode against the memory-bandwidth roofline (bytes per decode step = weights read once, the "
                "embedding only for the step's rows, + every live K/V entry of every layer + the new K/V; "
                "fraction = bytes / (step seconds × bandwidth) over the decode-only steps; bandwidths: "
                + ", ".join(f"{k} = {v / 1e12:.2f} TB/s" for k, v in bw.items()) + "):", "",
                "| streams | engine | tokens/s (whole run) | decode tokens/s | decode step ms | MB read per step | "
                "steps sync / async | " + " | ".join(f"roofline ({k})" for k in keys) + " |",
                "| --- | --- | --- | --- | --- | --- | --- |" + " --- |" * len(keys)]
        rows = [(n, name, c) for n, x in sorted(sw.items(), key=lambda kv: int(kv[0])) for name, c in x.items()]
        rows += [(f"{r['requests']}, {label}", name, c) for label, x in tp.get("sampled", {}).items()
                 for name, c in x.items()]
        for n, name, c in rows:
            st = c.get("steps", {})
            out.append(f"| {n} | {name} | {_c(c['tokens_per_s'])} | {_c(c['decode_tokens_per_s'])} | "
                       f"{_c(c['decode_step_ms'], '{:.2f}')} | {c['decode_bytes_per_step']['median'] / 1e6:.0f} | "
                       f"{st.get('sync', 0):.0f} / {st.get('async', 0):.0f} | "
                       + " | ".join(_c(c["roofline_fraction"].get(k), "{:.1%}") for k in keys) + " |")
    st = r.get("startup")
    if st and "error" not in st:
        out += ["", "Engine start-up, each in a fresh process, anchored and plain alternating (seconds, median "
                "[min–max]; ready = construct + two short requests + capture of every graph + one full-width "
                "batch; warm: one Triton cache primed by a discarded start and shared; cold: an empty Triton "
                "cache for every start):", "",
                "| condition | engine | ready | construct | first requests | capture | full width | process |",
                "| --- | --- | --- | --- | --- | --- | --- | --- |"]
        for mode, x in st.items():
            for name, runs in x["runs"].items():
                cells = [_c({"median": statistics.median(v), "min": min(v), "max": max(v), "n": len(v)}, "{:.2f}")
                         for v in ([q[k] for q in runs] for k in ("ready_s",) + STARTUP_PHASES + ("process_s",))]
                out.append(f"| {mode} | {name} | " + " | ".join(cells) + " |")
            out.append(f"| {mode} | anchored / plain (ready) | {x['anchored_over_plain_ready']:.2f}× | goal ≤ 1.2×: "
                       f"{'met' if x['anchored_over_plain_ready'] <= 1.2 else 'MISSED'} |  |  |  |  |  |")
    b = tp.get("engine_build_in_process")
    if b:
        out += ["", "The same engines built one after the other in the benchmark's process (the first one also pays "
                "per-process costs: Triton compiles, cuBLAS set-up, the HF meta model): "
                + "; ".join(f"{k} ready {v['ready_s']:.2f} s (construct {v['construct_s']:.2f}, of which model "
                            f"specs {v['engine_timings'].get('model_specs_s', float('nan')):.2f} and bind "
                            f"{v['engine_timings'].get('bind_s', float('nan')):.2f}; first requests "
                            f"{v['first_requests_s']:.2f}; capture {v['capture_s']:.2f}; full width "
                            f"{v['full_width_s']:.2f})" for k, v in b.items()) + "."]
    for label, p in (tp.get("profile") or {}).items():
        cats = ", ".join(f"{k} {v:.2f}" for k, v in p["by_category_ms"].items())
        out += ["", f"Profile, {label}: wall {p['wall_ms_per_step']:.2f} ms per decode step, {p['clock']} busy "
                f"{p['busy_ms_per_step']:.2f} ms ({cats} ms)."]
    return out
