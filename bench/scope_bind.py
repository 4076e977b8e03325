"""managed_scope bind time vs model size: a fully-matching restart must cost the same for 10×
the parameters (same tensor count), and far less than building the model natively.

    python -m bench scope_bind --device cuda:0                       # H200: 1B and ~10B Llama, bf16
    python -m bench scope_bind --device cpu --presets tiny tiny10    # CPU, small presets
    python -m bench scope_bind --tiny                                # smoke: tiny + tiny10, CPU, one restart

For each preset, in worker processes forked from this one (which imports torch and
transformers but never touches CUDA — the warm-restart setting): a native build
(no gpu-anchor), one *create* run (build inside the scope: recipes replayed into fresh
anchored memory; the worker then exits, leaving the objects anchored), and ``--repeats``
*restart* runs (everything matches: nothing is replayed).  Reported per run: the time of
the ``with`` block (constructing the model on placeholders) and of the scope exit (naming,
bind + mapping, RNG settle, swap).  Memory overhead: bytes the daemon reserved vs the bytes
of the same tensors built natively.
"""
from __future__ import annotations

import argparse
import os
import multiprocessing as mp
import statistics
import time

from bench.common import private_daemon, write_result

PRESETS = {
    # name: (hidden, intermediate, layers, heads, kv_heads, vocab)
    "tiny": (64, 256, 4, 4, 2, 1024),
    "tiny10": (208, 800, 4, 4, 2, 3200),            # ~10x tiny's parameters, same tensor count
    "small": (512, 2048, 4, 4, 2, 8000),            # ~20 M parameters
    "small10": (1600, 6400, 4, 4, 2, 25000),        # ~10x small, same tensor count
    "llama-1b": (2048, 8192, 16, 32, 8, 128256),     # Llama 3.2 1B shape
    "llama-1b-x10": (6656, 26624, 16, 32, 8, 128256),  # ~9-10x the parameters, same tensor count
}


def _config(preset: str):
    from transformers import LlamaConfig
    h, i, n, a, kv, v = PRESETS[preset]
    return LlamaConfig(hidden_size=h, intermediate_size=i, num_hidden_layers=n, num_attention_heads=a,
                       num_key_value_heads=kv, vocab_size=v, max_position_embeddings=4096,
                       tie_word_embeddings=True)


def _sync(device: str) -> None:
    import torch
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def _worker(phase: str, device: str, preset: str, namespace: str, dtype: str, q) -> None:
    import torch
    from transformers import LlamaForCausalLM
    try:
        if device == "cpu":
            torch.set_num_threads(1)  # forked from a parent whose thread pool does not survive fork
        torch.set_default_dtype(getattr(torch, dtype))
        torch.manual_seed(0)
        cfg = _config(preset)
        out: dict = {"phase": phase}
        if phase in ("create", "drop"):
            import gpu_anchor
            out["freed"] = gpu_anchor.connect(device, namespace=namespace).drop_namespace()
            if phase == "drop":
                q.put(out)
                return
        if phase == "native":
            t0 = time.perf_counter()
            with torch.device(device):
                model = LlamaForCausalLM(cfg)
            _sync(device)
            out["build_s"] = time.perf_counter() - t0
            tensors = {t.data_ptr(): t.nbytes for t in list(model.parameters()) + list(model.buffers())}
            out.update(params=sum(p.numel() for p in model.parameters()), tensors=len(tensors),
                       bytes=sum(tensors.values()))
            q.put(out)
            return
        from gpu_anchor.scope.scope import ManagedScope
        scope = ManagedScope(namespace)
        t0 = time.perf_counter()
        with scope:
            with torch.device(device):
                model = LlamaForCausalLM(cfg)
            t1 = time.perf_counter()
        _sync(device)
        t2 = time.perf_counter()
        r = scope.report
        out.update(block_ms=1e3 * (t1 - t0), exit_ms=1e3 * (t2 - t1), timings_ms=r.timings_ms,
                   matched=len(r.matched), created=len(r.created), replayed_ops=r.replayed_ops, rng=r.rng,
                   eager_evaluations=r.eager_evaluations)
        if device.startswith("cuda"):
            out["worker_cuda_allocated"] = torch.cuda.memory_allocated()
        if phase == "create":
            import gpu_anchor
            st = gpu_anchor.connect(device, namespace=namespace).status()
            out.update(reserved_bytes=st["reserved_bytes"], object_bytes=st["namespaces"][scope.namespace]["object_bytes"])
        q.put(out)
        del model
    except Exception as e:  # report, do not hang the parent
        q.put({"phase": phase, "error": f"{type(e).__name__}: {e}"})


def _run(ctx, *args, timeout=900) -> dict:
    q = ctx.Queue()
    p = ctx.Process(target=_worker, args=(*args, q))
    p.start()
    out = q.get(timeout=timeout)
    p.join(timeout)
    if "error" in out:
        raise RuntimeError(f"{args[0]} worker failed: {out['error']}")
    return out


def measure(device: str, preset: str, repeats: int, dtype: str) -> dict:
    from transformers import LlamaForCausalLM  # noqa: F401 — imported once, inherited by the forks
    ctx = mp.get_context("fork")
    ns = f"bench-scope-{preset}"
    native = _run(ctx, "native", device, preset, ns, dtype)
    create = _run(ctx, "create", device, preset, ns, dtype)
    restarts = [_run(ctx, "restart", device, preset, ns, dtype) for _ in range(repeats)]
    _run(ctx, "drop", device, preset, ns, dtype)
    exit_ms = [r["exit_ms"] for r in restarts]
    block_ms = [r["block_ms"] for r in restarts]
    return {
        "preset": preset, "shape": dict(zip(("hidden", "intermediate", "layers", "heads", "kv_heads", "vocab"),
                                            PRESETS[preset])),
        "dtype": dtype, "params": native["params"], "tensors": native["tensors"], "native_bytes": native["bytes"],
        "native_build_s": native["build_s"],
        "create": create, "restarts": restarts,
        "restart_bind_ms_median": statistics.median(exit_ms),
        "restart_block_ms_median": statistics.median(block_ms),
        "restart_all_matched": all(r["created"] == 0 and r["matched"] == create["created"] for r in restarts),
        "restart_replayed_ops": max(r["replayed_ops"] for r in restarts),
        "memory_overhead_pct": 100.0 * (create["reserved_bytes"] - native["bytes"]) / native["bytes"],
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tiny", action="store_true", help="smoke run: presets tiny tiny10 on CPU, one restart")
    ap.add_argument("--device", default=None, help="cpu or cuda:N (default: cuda:0 when available)")
    ap.add_argument("--presets", nargs="+", default=None, choices=sorted(PRESETS))
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--dtype", default=None, help="default: bfloat16 on CUDA, float32 on CPU")
    ap.add_argument("--out", default=None, help="results directory (default bench/results)")
    a = ap.parse_args(argv)
    if a.tiny:
        a.device, a.presets, a.repeats = "cpu", ["tiny", "tiny10"], 1
    # Workers are forked: this process must not initialise CUDA (an NVML-based check does not).
    os.environ.setdefault("PYTORCH_NVML_BASED_CUDA_CHECK", "1")
    from bench.common import default_device
    device = default_device(a.device)
    presets = a.presets or (["llama-1b", "llama-1b-x10"] if device.startswith("cuda") else ["tiny", "tiny10"])
    dtype = a.dtype or ("bfloat16" if device.startswith("cuda") else "float32")
    with private_daemon(device):
        rows = [measure(device, p, a.repeats, dtype) for p in presets]
    base = rows[0]
    for r in rows:
        r["param_ratio_vs_first"] = r["params"] / base["params"]
        r["bind_ratio_vs_first"] = r["restart_bind_ms_median"] / base["restart_bind_ms_median"]
        print(f"{r['preset']:>14}: {r['params'] / 1e6:9.1f} M params, {r['tensors']} tensors | native build "
              f"{r['native_build_s']:.2f} s | create exit {r['create']['exit_ms']:.0f} ms | restart: block "
              f"{r['restart_block_ms_median']:.1f} ms, bind {r['restart_bind_ms_median']:.1f} ms "
              f"(replayed ops {r['restart_replayed_ops']}, all matched {r['restart_all_matched']}) | "
              f"memory overhead {r['memory_overhead_pct']:.3f} %")
    path = write_result(f"scope_bind_{device.replace(':', '')}" + ("_tiny" if a.tiny else ""), {"device": device, "rows": rows}, a.out)
    print("wrote", path)
    return 0


# ---------------------------------------------------------------- report
def title(r: dict) -> str:
    return f"managed_scope bind time vs model size ({r.get('device', '?')})"


def render(r: dict) -> str:
    """Issue 3's targets: restart bind < 100 ms for 1B on the H200; 10× the parameters bind in the same
    time within noise; memory overhead ≤ 1 % (the overhead target is judged on ≥ 0.5 B-parameter rows)."""
    from bench.common import verdict
    rows = r.get("rows", [])
    cuda = str(r.get("device", "")).startswith("cuda")
    out = ["| model | params | tensors | native build | create: scope exit | restart: `with` block | "
           "restart: scope exit (naming + bind + map + swap) | replayed on restart | all matched | "
           "memory overhead |", "| --- |" + " ---: |" * 9]
    for x in rows:
        out.append(f"| {x['preset']} ({x['dtype']}) | {x['params'] / 1e6:,.1f} M | {x['tensors']} | "
                   f"{x['native_build_s'] * 1e3:.0f} ms | {x['create']['exit_ms']:.0f} ms | "
                   f"{x['restart_block_ms_median']:.0f} ms | {x['restart_bind_ms_median']:.1f} ms | "
                   f"{x['restart_replayed_ops']} ops | {'yes' if x['restart_all_matched'] else '**no**'} | "
                   f"{x['memory_overhead_pct']:.2f} % |")
    out += ["", "Restart figures are medians over the restarts; \"scope exit\" is the bind a restarted worker pays, "
                "the `with` block is the model's own constructor running on placeholders.", ""]
    t = ["| target (issue 3) | measured | verdict |", "| --- | --- | --- |"]
    big = [x for x in rows if x["params"] >= 5e8]
    if cuda and big:
        b = big[0]
        t.append(f"| restart bind < 100 ms for a 1B model on the GPU | {b['restart_bind_ms_median']:.1f} ms "
                 f"({b['preset']}) | {verdict(b['restart_bind_ms_median'] < 100)} |")
    if len(rows) >= 2:
        a, z = rows[0], rows[-1]
        sa = [q["exit_ms"] for q in a["restarts"]]
        sz = [q["exit_ms"] for q in z["restarts"]]
        overlap = min(sz) <= max(sa) and min(sa) <= max(sz)
        t.append(f"| {z['param_ratio_vs_first']:.1f}× the parameters (same tensor count): same bind time within "
                 f"noise | {z['restart_bind_ms_median']:.1f} vs {a['restart_bind_ms_median']:.1f} ms median "
                 f"({z['bind_ratio_vs_first']:.2f}×); samples {min(sz):.1f}–{max(sz):.1f} vs "
                 f"{min(sa):.1f}–{max(sa):.1f} ms | "
                 + ("met (sample ranges overlap)" if overlap else
                    f"**MISSED** strictly: the sample ranges do not overlap ({len(sa)} samples each), though the "
                    f"bind grows {z['bind_ratio_vs_first']:.2f}× for {z['param_ratio_vs_first']:.1f}× the "
                    f"parameters") + " |")
    if big:
        t.append("| memory overhead (daemon reserved vs native bytes) ≤ 1 % | "
                 + ", ".join(f"{x['memory_overhead_pct']:.2f} % ({x['preset']})" for x in big)
                 + f" | {verdict(all(x['memory_overhead_pct'] <= 1 for x in big))} |")
    else:
        t.append("| memory overhead ≤ 1 % (for the 1B model) | not judged on these small models (see the last "
                 "column: allocation rounding dominates) | — |")
    return "\n".join(out + t)


if __name__ == "__main__":
    import sys
    sys.exit(main())
