"""The decode step's matmuls alone: weight-read bandwidth of each GEMM of the Qwen3-8B shape
at 32 / 64 / 128 rows, cuBLAS against cuBLASLt (``torch.backends.cuda.preferred_blas_library``).

    python -m bench decode_gemm [--tiny] [--device cuda:0] [--reps 20]

A decode step of ``M`` sequences multiplies ``M`` rows by every weight once: per layer the
packed q/k/v projection (4096 → 6144), the output projection (4096 → 4096), the packed
gate/up projection (4096 → 24576) and the down projection (12288 → 4096), 36 layers, then the
LM head (4096 → 151936).  Each GEMM kind runs over 36 distinct weight tensors (so none is
served from the 50 MB L2), captured in one CUDA graph; the figure is the median of ``--reps``
replays (CUDA events).  "all" is the whole sequence of a step's matmuls in one graph.
Bandwidth = weight bytes / time (the activations are a few MB).  ``--tiny``: a small shape on
the CPU, eager, the default library only (a smoke run of the code path).
"""
from __future__ import annotations

import argparse
import statistics
import time

from bench.common import default_device, write_result

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
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    import torch
    device = "cpu" if args.tiny else default_device(args.device)
    if args.tiny:
        shapes, vocab, layers, libs, dtype = {k: (kk // 64, n // 64) for k, (kk, n) in SHAPES.items()}, 512, 2, ["default"], torch.float32
    else:
        shapes, vocab, layers, dtype = SHAPES, VOCAB, LAYERS, torch.bfloat16
        libs = args.libs.split(",") if device.startswith("cuda") else ["default"]
    rows = [int(r) for r in args.rows.split(",")]
    res = measure(device, rows, libs, args.reps, shapes, vocab, layers, dtype)
    path = write_result("decode_gemm" + ("_tiny" if args.tiny else ""),
                        {"device": device, "rows": rows, "layers": layers, "shapes": shapes, "vocab": vocab,
                         "results": res}, args.out)
    print(f"wrote {path}")
    return 0


def title(r: dict) -> str:
    return f"Decode GEMMs of the 8B shape: cuBLAS vs cuBLASLt ({r.get('device', '?')})"


def render(r: dict) -> str:
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
