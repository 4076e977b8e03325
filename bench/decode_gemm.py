"""The decode step's matmuls alone: weight-read bandwidth of each GEMM of the Qwen3-8B shape
at 32 / 64 / 128 rows, cuBLAS against cuBLASLt (``torch.backends.cuda.preferred_blas_library``).

    python -m bench decode_gemm [--tiny] [--device cuda:0] [--reps 20]
    python -m bench decode_gemm --triton-splitk       # a split-K Triton GEMM against cuBLASLt
    python -m bench decode_gemm --cublaslt-algos      # every algorithm cuBLASLt's heuristic offers

A decode step of ``M`` sequences multiplies ``M`` rows by every weight once: per layer the
packed q/k/v projection (4096 → 6144), the output projection (4096 → 4096), the packed
gate/up projection (4096 → 24576) and the down projection (12288 → 4096), 36 layers, then the
LM head (4096 → 151936).  Each GEMM kind runs over 36 distinct weight tensors (so none is
served from the 50 MB L2), captured in one CUDA graph; the figure is the median of ``--reps``
replays (CUDA events).  "all" is the whole sequence of a step's matmuls in one graph.
Bandwidth = weight bytes / time (the activations are a few MB).  ``--tiny``: a small shape on
the CPU, eager, the default library only (a smoke run of the code path).

``--cublaslt-algos`` (CUDA): the question "does cuBLASLt itself have a faster algorithm than
the one torch runs?" — torch takes the heuristic's first answer for its workspace; here every
algorithm the heuristic offers with ``--workspace-mib`` of workspace (at most ``--top``) is
timed the same way (ctypes onto torch's libcublasLt, ``bench/cublaslt.py``), checked against
``F.linear`` and for repeating bit for bit, per kind (the LM head too) and row count; the
result's ``step_ms`` adds a step's GEMMs up with torch's picks and with the faster of torch's
pick and the fastest offered, per kind.
Result ``decode_gemm_cublaslt_algos``.

``--triton-splitk`` (CUDA, Triton): the question "would a GEMM of our own beat cuBLAS on these
skinny shapes?" for one candidate, a deterministic split-K Triton GEMM: S programs per output
tile each sum a K range in float32 into a workspace, and the last to finish (a counter, as in
the attention merge) adds the S partials in order s = 0..S-1 and stores the tile.  Every
block-N × block-K × S of the sweep, per kind and row count, against cuBLASLt; each config is
checked against ``F.linear`` and for repeating bit for bit.  Result ``decode_gemm_splitk``.
"""
from __future__ import annotations

import argparse
import statistics
import time

from bench.common import default_device, int_list, write_result

SHAPES = {"qkv": (4096, 6144), "o": (4096, 4096), "gate_up": (4096, 24576), "down": (12288, 4096)}
VOCAB, LAYERS = 151936, 36


def _timer(device, reps):
    import torch

    def run(fn) -> float:
        if not device.startswith("cuda"):
            fn()
            ts = []
            for _ in range(reps):
                t0 = time.perf_counter()
                fn()
                ts.append(time.perf_counter() - t0)
            return statistics.median(ts)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(3):
                fn()
        torch.cuda.current_stream().wait_stream(side)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g, stream=side):   # the warm-up's stream: what a kernel keeps per stream is made there
            fn()
        g.replay()
        torch.cuda.synchronize()
        ts = []
        for _ in range(reps):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            g.replay()
            b.record()
            b.synchronize()
            ts.append(a.elapsed_time(b) / 1e3)
        return statistics.median(ts)
    return run


SPLITK_CONFIGS = [(bn, bk, s) for bn in (32, 64, 128) for bk in (128, 256) for s in (1, 2, 4, 8)]


def _splitk_kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def splitk(X, W, Y, WS, CNT, M, N, K, sxm, swn, sym, BM: tl.constexpr, BN: tl.constexpr,
               BK: tl.constexpr, S: tl.constexpr):
        n = tl.program_id(0)
        s = tl.program_id(1)
        rm = tl.arange(0, BM)
        rn = n * BN + tl.arange(0, BN)
        rk = tl.arange(0, BK)
        k0 = s * (K // S)
        acc = tl.zeros([BM, BN], tl.float32)
        for k in range(k0, k0 + K // S, BK):
            x = tl.load(X + rm[:, None] * sxm + (k + rk)[None, :], mask=rm[:, None] < M, other=0.0)
            w = tl.load(W + rn[:, None] * swn + (k + rk)[None, :])
            acc += tl.dot(x, tl.trans(w))
        rows = rm[:, None] < M
        if S == 1:
            tl.store(Y + rm[:, None] * sym + rn[None, :], acc.to(Y.dtype.element_ty), mask=rows)
        else:
            tl.store(WS + (s * M + rm[:, None]) * N + rn[None, :], acc, mask=rows)
            tl.debug_barrier()
            if tl.atomic_add(CNT + n, 1, sem="acq_rel", scope="gpu") == S - 1:
                tl.debug_barrier()
                tot = tl.zeros([BM, BN], tl.float32)
                for j in tl.static_range(S):
                    tot += tl.load(WS + (j * M + rm[:, None]) * N + rn[None, :], mask=rows, other=0.0,
                                   cache_modifier=".cg")
                tl.store(Y + rm[:, None] * sym + rn[None, :], tot.to(Y.dtype.element_ty), mask=rows)
                tl.store(CNT + n, 0)
    return splitk


def splitk_linear(kernel, x, w, cfg, counters):
    """``x @ w.T`` by the split-K kernel with ``cfg = (block_n, block_k, splits)``."""
    import torch
    import triton
    bn, bk, s = cfg
    m, k = x.shape
    n = w.shape[0]
    y = torch.empty(m, n, device=x.device, dtype=x.dtype)
    ws = torch.empty(s, m, n, device=x.device, dtype=torch.float32) if s > 1 else y
    kernel[(n // bn, s)](x, w, y, ws, counters, m, n, k, x.stride(0), w.stride(0), y.stride(0),
                         BM=max(16, triton.next_power_of_2(m)), BN=bn, BK=bk, S=s, num_warps=4,
                         num_stages=4 if bk == 128 else 3)
    return y


def measure_splitk(device: str, rows: list[int], reps: int, shapes: dict, layers: int, dtype) -> dict:
    import torch
    import torch.nn.functional as F
    kernel = _splitk_kernel()
    counters = torch.zeros(8192, dtype=torch.int32, device=device)
    if device.startswith("cuda"):
        torch.backends.cuda.preferred_blas_library("cublaslt")
    run = _timer(device, reps)
    out = {}
    for kind, (k, n) in shapes.items():
        ws = [torch.randn(n, k, device=device, dtype=dtype) * 0.02 for _ in range(layers)]
        for m in rows:
            x = torch.randn(m, k, device=device, dtype=dtype)
            ref = F.linear(x, ws[0])
            row = {"cublaslt_us": run(lambda: [F.linear(x, w) for w in ws]) / layers * 1e6, "configs": {}}
            for cfg in SPLITK_CONFIGS:
                if (k // cfg[2]) % cfg[1] or n % cfg[0]:
                    continue
                try:
                    y = splitk_linear(kernel, x, ws[0], cfg, counters)
                    diff = (y.float() - ref.float()).abs().max().item()
                    cell = {"max_abs_difference": diff,
                            # a few units in the last place of the output dtype at the largest output
                            "matches": diff <= 0.03 * ref.float().abs().max().item(),
                            "repeats_bit_for_bit": all(torch.equal(splitk_linear(kernel, x, ws[0], cfg, counters), y)
                                                       for _ in range(3))}
                    if cell["matches"]:
                        cell["us"] = run(lambda: [splitk_linear(kernel, x, w, cfg, counters) for w in ws]) / layers * 1e6
                except Exception as e:   # a config the GPU cannot hold (shared memory): recorded, not timed
                    cell = {"error": f"{type(e).__name__}: {str(e)[:120]}"}
                row["configs"]["x".join(map(str, cfg))] = cell
            timed = {c: v for c, v in row["configs"].items() if "us" in v}
            best = min(timed, key=lambda c: timed[c]["us"]) if timed else None
            row.update(best=best, best_us=timed[best]["us"] if best else None,
                       best_over_cublaslt=timed[best]["us"] / row["cublaslt_us"] if best else None)
            out[f"{kind}/{m}"] = row
            print(f"{kind:8s} M={m:4d}  cuBLASLt {row['cublaslt_us']:.1f} us  best split-K {best} "
                  f"{row['best_us'] or float('nan'):.1f} us", flush=True)
        ws = None
    return out


def measure_algos(device: str, rows: list[int], reps: int, top: int, workspace_mib: int) -> dict:
    import torch
    import torch.nn.functional as F
    from bench import cublaslt
    torch.backends.cuda.preferred_blas_library("cublaslt")
    lib, handle = cublaslt.load()
    dt = torch.bfloat16
    workspace = torch.empty(workspace_mib << 20, dtype=torch.uint8, device=device)
    run = _timer(device, reps)
    cells = {}
    for kind, (k, n) in dict(SHAPES, lm_head=(SHAPES["qkv"][0], VOCAB)).items():
        count = 1 if kind == "lm_head" else LAYERS
        ws = [torch.randn(n, k, device=device, dtype=dt) * 0.02 for _ in range(count)]
        for m in rows:
            x = torch.randn(m, k, device=device, dtype=dt)
            ys = [torch.empty(m, n, device=device, dtype=dt) for _ in range(count)]
            ref = F.linear(x, ws[0])
            lin = cublaslt.Linear(lib, handle, m, k, n, workspace.numel())
            cell = {"torch_us": run(lambda: [F.linear(x, w) for w in ws]) / count * 1e6, "candidates": []}
            try:
                for rank, cand in enumerate(lin.candidates(top)):
                    lin(x, ws[0], ys[0], cand, workspace)
                    first = ys[0].clone()
                    repeats = all((lin(x, ws[0], ys[0], cand, workspace), torch.equal(ys[0], first))[1]
                                  for _ in range(3))
                    us = run(lambda: [lin(x, w, y, cand, workspace) for w, y in zip(ws, ys)]) / count * 1e6
                    cell["candidates"].append({"rank": rank, "us": us, "equal_to_torch": torch.equal(first, ref),
                                               "repeats_bit_for_bit": repeats,
                                               "max_abs_difference": (first.float() - ref.float()).abs().max().item(),
                                               "workspace_bytes": cand.workspace_size, "waves": cand.waves,
                                               **lin.config(cand)})
            finally:
                torch.cuda.synchronize()     # the matmuls enqueued with the descriptors are done
                lin.close()
            # with nothing offered (not seen), torch's pick stands for the fastest
            best = min(cell["candidates"], key=lambda c: c["us"], default={"rank": None, "us": cell["torch_us"]})
            cell.update(best_rank=best["rank"], best_us=best["us"], best_over_torch=best["us"] / cell["torch_us"])
            cells[f"{kind}/{m}"] = cell
            print(f"{kind:8s} M={m:4d}  torch {cell['torch_us']:.1f} us  best of {len(cell['candidates'])} "
                  f"{best['us']:.1f} us (rank {best['rank']}, tile {best.get('tile')}, split-K {best.get('split_k')})",
                  flush=True)
        ws = None
        torch.cuda.empty_cache()
    cublaslt.unload(lib, handle)
    step = {}
    for m in rows:
        cs = {kind: cells[f"{kind}/{m}"] for kind in (*SHAPES, "lm_head")}
        pick = {kind: (c["torch_us"], min(c["torch_us"], c["best_us"])) for kind, c in cs.items()}
        step[str(m)] = {"torch_ms": sum(t * (1 if k == "lm_head" else LAYERS) for k, (t, _) in pick.items()) / 1e3,
                        "best_ms": sum(b * (1 if k == "lm_head" else LAYERS) for k, (_, b) in pick.items()) / 1e3}
    return {"top": top, "workspace_mib": workspace_mib, "cells": cells, "step_ms": step}


def measure(device: str, rows: list[int], libs: list[str], reps: int, shapes: dict, vocab: int, layers: int,
            dtype) -> dict:
    import torch
    import torch.nn.functional as F
    dev = torch.device(device)
    w = {k: [torch.randn(n, kk, device=dev, dtype=dtype) * 0.02 for _ in range(layers)] for k, (kk, n) in shapes.items()}
    head = torch.randn(vocab, shapes["qkv"][0], device=dev, dtype=dtype) * 0.02
    size = dtype.itemsize if hasattr(dtype, "itemsize") else torch.empty(0, dtype=dtype).element_size()
    run = _timer(device, reps)
    out = {}
    for lib in libs:
        if device.startswith("cuda"):
            torch.backends.cuda.preferred_blas_library(lib)
        for m in rows:
            x = {k: torch.randn(m, kk, device=dev, dtype=dtype) for k, (kk, _) in shapes.items()}
            row = {}
            for k in shapes:
                t = run(lambda k=k: [F.linear(x[k], wk) for wk in w[k]])
                nbytes = sum(wk.numel() for wk in w[k]) * size
                row[k] = {"us_per_gemm": t / layers * 1e6, "tb_per_s": nbytes / t / 1e12}
            t = run(lambda: F.linear(x["qkv"], head))
            row["lm_head"] = {"us_per_gemm": t * 1e6, "tb_per_s": head.numel() * size / t / 1e12}

            def step():
                for i in range(layers):
                    for k in shapes:
                        F.linear(x[k], w[k][i])
                F.linear(x["qkv"], head)
            t = run(step)
            nbytes = (sum(wk.numel() for ws in w.values() for wk in ws) + head.numel()) * size
            row["all"] = {"ms": t * 1e3, "tb_per_s": nbytes / t / 1e12}
            out[f"{lib}/{m}"] = row
            print(f"{lib:9s} M={m:4d}  all {row['all']['ms']:.3f} ms  {row['all']['tb_per_s']:.2f} TB/s  "
                  + "  ".join(f"{k} {row[k]['tb_per_s']:.2f}" for k in (*shapes, "lm_head")), flush=True)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench decode_gemm", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--device", default=None)
    ap.add_argument("--rows", default="32,64,128")
    ap.add_argument("--libs", default="cublas,cublaslt")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--triton-splitk", action="store_true",
                    help="sweep a deterministic split-K Triton GEMM against cuBLASLt instead (CUDA)")
    ap.add_argument("--cublaslt-algos", action="store_true",
                    help="time every algorithm cuBLASLt's heuristic offers against torch's pick instead (CUDA)")
    ap.add_argument("--top", type=int, default=64, help="--cublaslt-algos: ask the heuristic for at most this many")
    ap.add_argument("--workspace-mib", type=int, default=32, help="--cublaslt-algos: the workspace it may use")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    import torch
    device = "cpu" if args.tiny else default_device(args.device)
    if args.cublaslt_algos:
        rows = int_list(ap, "--rows", args.rows)
        if args.top < 1 or args.workspace_mib < 0:
            ap.error(f"--top must be >= 1 and --workspace-mib >= 0, got {args.top} and {args.workspace_mib}")
        if args.tiny or not device.startswith("cuda"):
            ap.error("--cublaslt-algos calls cuBLASLt: it needs a CUDA device")
        res = measure_algos(device, rows, args.reps, args.top, args.workspace_mib)
        path = write_result("decode_gemm_cublaslt_algos", {"device": device, "rows": rows, "layers": LAYERS,
                                                           "shapes": SHAPES, "vocab": VOCAB, **res}, args.out)
        print(f"wrote {path}")
        return 0
    if args.triton_splitk:
        try:
            import triton  # noqa: F401
        except ImportError:
            triton = None
        if args.tiny or not device.startswith("cuda") or triton is None:
            ap.error("--triton-splitk times a Triton kernel: it needs a CUDA device with Triton")
        rows = int_list(ap, "--rows", args.rows)
        res = measure_splitk(device, rows, args.reps, SHAPES, LAYERS, torch.bfloat16)
        path = write_result("decode_gemm_splitk", {"device": device, "rows": rows, "layers": LAYERS, "shapes": SHAPES,
                                                   "configs": ["x".join(map(str, c)) for c in SPLITK_CONFIGS],
                                                   "splitk": res}, args.out)
        print(f"wrote {path}")
        return 0
    if args.tiny:
        shapes, vocab, layers, libs, dtype = {k: (kk // 64, n // 64) for k, (kk, n) in SHAPES.items()}, 512, 2, ["default"], torch.float32
    else:
        shapes, vocab, layers, dtype = SHAPES, VOCAB, LAYERS, torch.bfloat16
        libs = args.libs.split(",") if device.startswith("cuda") else ["default"]
    rows = int_list(ap, "--rows", args.rows)
    res = measure(device, rows, libs, args.reps, shapes, vocab, layers, dtype)
    path = write_result("decode_gemm" + ("_tiny" if args.tiny else ""),
                        {"device": device, "rows": rows, "layers": layers, "shapes": shapes, "vocab": vocab,
                         "results": res}, args.out)
    print(f"wrote {path}")
    return 0


def _render_splitk(r: dict) -> str:
    out = ["A deterministic split-K Triton GEMM (block N × block K × splits swept; the fastest config that matched "
           "`F.linear`) against cuBLASLt; µs per GEMM, each kind over "
           f"{r['layers']} distinct weights in one CUDA graph.", "",
           "| GEMM / rows | cuBLASLt (µs) | best split-K (µs) | config | split-K / cuBLASLt | repeats bit for bit |",
           "| --- | ---: | ---: | --- | ---: | --- |"]
    for key, row in r["splitk"].items():
        b = row["best"]
        out.append(f"| {key} | {row['cublaslt_us']:.1f} | " + (f"{row['best_us']:.1f} | {b} | {row['best_over_cublaslt']:.3f} | "
                   f"{'yes' if row['configs'][b]['repeats_bit_for_bit'] else '**no**'} |" if b else "— | — | — | — |"))
    return "\n".join(out)


def _render_algos(r: dict) -> str:
    out = [f"Every algorithm cuBLASLt's heuristic offered (at most {r['top']}, {r['workspace_mib']} MiB of workspace) "
           "against torch's `F.linear` (the heuristic's first answer for torch's own workspace); µs per GEMM, "
           f"each kind over {r['layers']} distinct weights in one CUDA graph (the LM head: one).", "",
           "| GEMM / rows | torch (µs) | offered | heuristic's first (µs) | fastest (µs) | its rank | tile / split-K / stages "
           "| fastest / torch | equal to torch | repeats bit for bit |",
           "| --- | ---: | ---: | ---: | ---: | ---: | --- | ---: | --- | --- |"]
    for key, c in r["cells"].items():
        if not c["candidates"]:
            out.append(f"| {key} | {c['torch_us']:.1f} | 0 | — | — | — | — | — | — | — |")
            continue
        b = c["candidates"][c["best_rank"]]
        out.append(f"| {key} | {c['torch_us']:.1f} | {len(c['candidates'])} | {c['candidates'][0]['us']:.1f} | "
                   f"{b['us']:.1f} | {b['rank']} | {b.get('tile')} / {b.get('split_k')} / {b.get('stages')} | "
                   f"{c['best_over_torch']:.3f} | {'yes' if b['equal_to_torch'] else 'no'} | "
                   f"{'yes' if b['repeats_bit_for_bit'] else '**no**'} |")
    out += ["", "A decode step's GEMMs added up (36 layers + the LM head), ms: " + "; ".join(
        f"{m} rows {s['torch_ms']:.3f} with torch's picks, {s['best_ms']:.3f} with the faster of torch's and the "
        "fastest offered, per kind"
        for m, s in r["step_ms"].items()) + "."]
    return "\n".join(out)


def title(r: dict) -> str:
    if "cells" in r:
        return f"Decode GEMMs of the 8B shape: every cuBLASLt algorithm its heuristic offers ({r.get('device', '?')})"
    if "splitk" in r:
        return f"Decode GEMMs of the 8B shape: a split-K Triton GEMM vs cuBLASLt ({r.get('device', '?')})"
    return f"Decode GEMMs of the 8B shape: cuBLAS vs cuBLASLt ({r.get('device', '?')})"


def render(r: dict) -> str:
    if "cells" in r:
        return _render_algos(r)
    if "splitk" in r:
        return _render_splitk(r)
    res = r["results"]
    kinds = [k for k in ("qkv", "o", "gate_up", "down", "lm_head")]
    out = [f"Weight-read bandwidth, TB/s (each kind over {r['layers']} distinct weights in one CUDA graph; median "
           f"of the replays); \"all\" = every matmul of a decode step in one graph.", "",
           "| library | rows | all (ms) | all (TB/s) | " + " | ".join(kinds) + " |",
           "| --- | ---: | ---: | ---: | " + " | ".join("---:" for _ in kinds) + " |"]
    for key, row in res.items():
        lib, m = key.split("/")
        out.append(f"| {lib} | {m} | {row['all']['ms']:.3f} | {row['all']['tb_per_s']:.2f} | "
                   + " | ".join(f"{row[k]['tb_per_s']:.2f}" for k in kinds) + " |")
    return "\n".join(out)
