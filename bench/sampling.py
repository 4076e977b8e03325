"""The engine's sampler alone: one decode step's draw for a batch of rows, by kind of sampling.

    python -m bench sampling [--tiny] [--device cuda:0] [--rows 32,64,128] [--reps 20]
                             [--launches 4096x16,8192x8] [--out DIR]

Rows of bf16 logits over Qwen3's vocabulary (151 936; ``--tiny``: 1 000) go through
``gpu_anchor.serve.sampling.sample_ids`` as the engine calls it, per kind: greedy, temperature
0.8, top-k 50, top-p 0.95, top-k 50 with top-p 0.95, and Qwen3's recommended temperature 0.7,
top-k 20, top-p 0.8 (every row alike, seeds per row).  A figure
is the wall time of one call followed by a device synchronisation (the call's host work
included: it builds the rows' parameters on the host), min / median / max over ``--reps`` calls
after two warm-up calls.  Beside it, the top-p mask alone two ways: the sorted definition
(``_top_p_mask``: a stable sort of each row, a running sum, a scatter) and, on CUDA with
Triton, the kernel the engine uses (``_top_p_mask_cuda``: no sort), with whether the two masks
are equal bit for bit; and the draw from the kept probabilities two ways: the tensor ops
(``_draw``: fixed-point weights, a running sum, ``searchsorted``) and the kernel (``_draw_cuda``),
ids compared.  ``--launches BLOCKxWARPS,...``: both kernels again at each launch shape (elements
a program loads at a time, warps a program), the shipped one being ``sampling.TOP_P_LAUNCH`` /
``DRAW_LAUNCH``.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch

from bench.common import default_device, int_list, write_result

KINDS = {"greedy": dict(), "temperature 0.8": dict(temperature=0.8), "top-k 50": dict(temperature=0.8, top_k=50),
         "top-p 0.95": dict(temperature=0.8, top_p=0.95), "top-k 50 + top-p 0.95": dict(temperature=0.8, top_k=50, top_p=0.95),
         "Qwen3's default (T 0.7, top-k 20, top-p 0.8)": dict(temperature=0.7, top_k=20, top_p=0.8)}


def _times(fn, device: str, reps: int) -> dict:
    for _ in range(2):
        fn()
    out = []
    for _ in range(reps):
        if device.startswith("cuda"):
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        fn()
        if device.startswith("cuda"):
            torch.cuda.synchronize(device)
        out.append((time.perf_counter() - t0) * 1e3)
    return {"min": min(out), "median": statistics.median(out), "max": max(out), "n": reps}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench sampling", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tiny", action="store_true", help="a 1 000-token vocabulary (a CPU dry run)")
    ap.add_argument("--device", default=None)
    ap.add_argument("--rows", default="32,64,128", help="batch sizes, comma-separated")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--launches", default="", help="also time both kernels at these BLOCKxWARPS launch shapes")
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    rows = int_list(ap, "--rows", a.rows)
    if not rows or any(r < 1 for r in rows):
        ap.error(f"--rows: each batch size must be >= 1, got {a.rows!r}")
    if a.reps < 1:
        ap.error(f"--reps must be >= 1, got {a.reps}")
    try:
        launches = [tuple(int(v) for v in x.split("x")) for x in a.launches.split(",") if x.strip()]
    except ValueError:
        launches = None
    if launches is None or any(len(x) != 2 or x[0] < 16 or x[0] & (x[0] - 1) or x[1] not in (1, 2, 4, 8, 16, 32)
                               for x in launches):
        ap.error(f"--launches takes BLOCKxWARPS pairs (BLOCK a power of two >= 16, WARPS 1-32, a power of two), "
                 f"got {a.launches!r}")
    from gpu_anchor.serve import sampling as S
    from gpu_anchor.serve.sequence import SamplingParams
    device = default_device(a.device)
    V = 1000 if a.tiny else 151936
    kernel = device.startswith("cuda") and S.triton is not None
    g = torch.Generator().manual_seed(0)
    ms, mask, draw, shapes = {}, {}, {}, {}
    for B in rows:
        logits = (torch.randn(B, V, generator=g) * 3).to(torch.bfloat16).to(device)
        idx = list(range(B))
        for kind, kw in KINDS.items():
            params = [SamplingParams(seed=b, **kw) for b in range(B)]
            ms[f"{kind}/{B}"] = _times(lambda: S.sample_ids(logits, params, idx), device, a.reps)
        probs = torch.softmax(logits.float() / 0.8, -1)
        p = torch.full((B,), 0.95, device=device)
        k = torch.full((B,), V, device=device)
        mask[f"sorted/{B}"] = _times(lambda: S._top_p_mask(probs, k, p), device, a.reps)
        keep = S._top_p_mask(probs, k, p)
        u24 = torch.randint(0, 1 << 24, (B,), generator=g).to(device)
        draw[f"tensor ops/{B}"] = _times(lambda: S._draw(probs, keep, u24), device, a.reps)
        if kernel:
            mask[f"kernel/{B}"] = _times(lambda: S._top_p_mask_cuda(probs, k, p), device, a.reps)
            mask[f"kernel/{B}"]["equal_to_sorted"] = bool(torch.equal(S._top_p_mask_cuda(probs, k, p), keep))
            draw[f"kernel/{B}"] = _times(lambda: S._draw_cuda(probs, keep, u24), device, a.reps)
            draw[f"kernel/{B}"]["equal_to_tensor_ops"] = bool(torch.equal(S._draw_cuda(probs, keep, u24),
                                                                          S._draw(probs, keep, u24)))
            shipped = (S.TOP_P_LAUNCH, S.DRAW_LAUNCH)
            try:
                for shape in launches:
                    S.TOP_P_LAUNCH = S.DRAW_LAUNCH = shape
                    row = shapes.setdefault(f"{shape[0]}x{shape[1]}", {})
                    row[f"top_p/{B}"] = _times(lambda: S._top_p_mask_cuda(probs, k, p), device, a.reps)["median"]
                    row[f"draw/{B}"] = _times(lambda: S._draw_cuda(probs, keep, u24), device, a.reps)["median"]
                    row[f"equal/{B}"] = bool(torch.equal(S._top_p_mask_cuda(probs, k, p), keep)
                                             and torch.equal(S._draw_cuda(probs, keep, u24), S._draw(probs, keep, u24)))
            finally:
                S.TOP_P_LAUNCH, S.DRAW_LAUNCH = shipped
    result = {"device": device, "vocab": V, "rows": rows, "reps": a.reps, "dtype": "bfloat16",
              "top_p_kernel": kernel, "sample_ms": ms, "top_p_mask_ms": mask, "draw_ms": draw,
              "shipped_launches": {"top_p": list(S.TOP_P_LAUNCH), "draw": list(S.DRAW_LAUNCH)},
              "launch_shapes_ms": shapes}
    print(write_result("sampling" + ("_tiny" if a.tiny else ""), result, a.out))
    return 0


def _two_ways(cells: dict, rows: list, caption: str, ways: tuple, same: str) -> list[str]:
    """A table of one operation done two ways, median ms per batch size; a kernel whose output
    differed from the reference's is flagged."""
    if not cells:
        return []
    out = ["", caption, "", "| way | " + " | ".join(f"{b} rows" for b in rows) + " |", "| --- |" + " ---: |" * len(rows)]
    for way in ways:
        if f"{way}/{rows[0]}" in cells:
            out.append(f"| {way} | " + " | ".join(
                f"{m['median']:.3f}" + ("" if m.get(same, True) else " (differs!)")
                for m in (cells[f"{way}/{b}"] for b in rows)) + " |")
    return out


def title(result: dict) -> str:
    return f"The sampler alone: one decode step's draw, {result.get('vocab', '?')}-token vocabulary"


def render(r: dict) -> str:
    rows = r["rows"]
    out = ["ms per call (wall, synchronised; median, min-max over " + str(r["reps"]) + " calls):", "",
           "| kind | " + " | ".join(f"{b} rows" for b in rows) + " |", "| --- |" + " ---: |" * len(rows)]
    for kind in (k for k in KINDS if f"{k}/{rows[0]}" in r["sample_ms"]):    # results from before a kind was added
        out.append(f"| {kind} | " + " | ".join(
            f"{m['median']:.3f} ({m['min']:.3f}-{m['max']:.3f})" for m in (r["sample_ms"][f"{kind}/{b}"] for b in rows))
            + " |")
    out += _two_ways(r.get("top_p_mask_ms", {}), rows, "The top-p mask alone (p = 0.95, every row):",
                     ("sorted", "kernel"), "equal_to_sorted")
    out += _two_ways(r.get("draw_ms", {}), rows, "The draw from the kept probabilities alone (top-p 0.95's mask):",
                     ("tensor ops", "kernel"), "equal_to_tensor_ops")
    if r.get("launch_shapes_ms"):
        sh = r.get("shipped_launches", {})
        out += ["", "Both kernels by launch shape (elements a load x warps; median ms; shipped: top-p "
                f"{'x'.join(map(str, sh.get('top_p', [])))}, draw {'x'.join(map(str, sh.get('draw', [])))}):", "",
                "| shape | " + " | ".join(f"top-p {b} | draw {b}" for b in rows) + " |",
                "| --- |" + " ---: | ---: |" * len(rows)]
        for shape, row in r["launch_shapes_ms"].items():
            out.append(f"| {shape} | " + " | ".join(
                f"{row[f'top_p/{b}']:.3f} | {row[f'draw/{b}']:.3f}" + ("" if row[f"equal/{b}"] else " (differs!)")
                for b in rows) + " |")
    if not r.get("top_p_kernel"):
        out.append("\nNo CUDA/Triton here: the engine's top-p is the sorted mask.")
    return "\n".join(out)


if __name__ == "__main__":
    sys.exit(main())
