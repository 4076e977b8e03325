"""The fused anchored Adam kernel alone against torch's AdamW kernels, on one device.

    python -m bench adam_kernel [--tiny] [--device cuda:0] [--reps 10] [--chunks 76] [--graph]
                                [--variants 1024x8,1024x8nh,1024x4x8r96] [--registers 64,56]

A 1.24 B bf16 parameter set (llama3.2-1b's) in 76 chunks, as the step protocol runs it: per
chunk one launch of ``fused_adam``'s kernel (reads p, g, m, v; writes the new p, m, v in place,
each block's old p, m, v into its program's slot of the undo ring first), against torch's
``_fused_adamw_`` (``AdamW(fused=True)``: one multi-tensor pass, no undo), torch's foreach AdamW
(the default), a copy of every chunk into an undo slot alone, and that copy followed by torch's
fused kernel (what the protocol runs without its own kernel: a copy step).  Each figure is the
median of ``--reps`` passes over every chunk, CUDA events, after one warm-up pass.  The
bandwidth column counts the bytes each variant must move to memory (7 tensor passes for the
anchored kernel and for torch's fused one: the ring's stores are meant to stay in L2), not what
it moved.  ``--variants BxP[xW][nh][rR],...``: the kernel with blocks (one tag each) of ``B``
elements (``fused_adam.BLOCK``), ``P`` persistent programs a SM (``fused_adam.PROGRAMS_PER_SM``)
of ``W`` warps (default 4); ``nh``: without the L2 eviction hints (``fused_adam.L2_HINTS``);
capped at ``R`` registers a thread (default ``fused_adam.REGISTERS``).  ``--registers N,...``
adds the shipped one capped at each N (Triton's ``maxnreg``).  ``--chunks``: the same parameters
in another number of chunks.  Launched from Python, a chunk costs the host about 20 µs, so ``--graph`` captures each
variant's pass in a CUDA graph and times its replays (torch's foreach AdamW, which reads its
step counts on the host, is left out there).  Without CUDA and Triton (``--tiny`` on a CPU)
only the torch variants run, on a small set.
"""
from __future__ import annotations

import argparse
import re
import statistics
import sys

import torch

from bench.common import default_device, int_list, write_result

# (BLOCK, programs a SM, warps, L2 hints, registers a thread or None: fused_adam.REGISTERS)
VARIANTS = [(1024, 8, 4, True, None), (1024, 8, 4, False, None), (1024, 6, 4, True, None), (1024, 8, 8, True, None),
            (512, 8, 4, True, None)]
_SPEC = re.compile(r"(\d+)x(\d+)(?:x(\d+))?(nh)?(?:r(\d+))?")
HP = dict(lr=1e-4, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1, amsgrad=False, maximize=False, foreach=None,
          fused=None, capturable=False, differentiable=False, decoupled_weight_decay=True)


def variant(block: int, programs: int, regs: int | None, warps: int = 4, hints: bool = True) -> str:
    return (f"anchored_ring_block{block}_pps{programs}" + (f"_w{warps}" if warps != 4 else "")
            + ("" if hints else "_nohints") + (f"_regs{regs}" if regs else ""))


def shipped() -> str:
    """The variant name of the launch ``fused_adam`` makes (its registers cap only on NVIDIA)."""
    from gpu_anchor.train import fused_adam
    return variant(fused_adam.BLOCK, fused_adam.PROGRAMS_PER_SM, None if torch.version.hip else fused_adam.REGISTERS,
                   hints=fused_adam.L2_HINTS)


def parse_variants(text: str) -> list[tuple] | None:
    """``BxP[xW][nh][rR],...`` as ``VARIANTS`` rows, or None where one is malformed."""
    out = []
    for v in (v.strip() for v in text.split(",")):
        m = _SPEC.fullmatch(v)
        if not v or m is None:
            return None
        block, pps, warps, nh, regs = m.groups()
        out.append((int(block), int(pps), int(warps or 4), nh is None, int(regs) if regs else None))
        if out[-1][0] < 128 or out[-1][0] & (out[-1][0] - 1) or out[-1][1] < 1 or out[-1][2] not in (1, 2, 4, 8, 16) \
                or (regs is not None and not 16 <= int(regs) <= 255):
            return None
    return out or None


def _captured(fn):
    """``fn``'s launches captured in a CUDA graph (after one eager warm-up on a side stream, which
    compiles Triton kernels outside the capture); returns the graph's replay."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph.replay


def _timer(device: str, reps: int, graph: bool = False):
    cuda = device.startswith("cuda")

    def run(fn) -> float:
        import time
        if graph:
            fn = _captured(fn)
        fn()
        times = []
        for _ in range(reps):
            if cuda:
                a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                a.record()
                fn()
                b.record()
                torch.cuda.synchronize()
                times.append(a.elapsed_time(b))
            else:
                t0 = time.perf_counter()
                fn()
                times.append((time.perf_counter() - t0) * 1e3)
        return statistics.median(times)
    return run


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench adam_kernel", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tiny", action="store_true", help="a small set (2 chunks of 64 Ki elements)")
    ap.add_argument("--device", default=None)
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--chunks", type=int, default=None, help="chunks of the parameter set (default 76, the "
                    "optimizer's default for llama3.2-1b)")
    ap.add_argument("--graph", action="store_true", help="time each pass as a CUDA graph's replay (CUDA only)")
    ap.add_argument("--variants", default=None, metavar="BxP[xW][nh][rR],...",
                    help="kernel variants: blocks of B elements (a power of two from 128), P programs a SM of "
                         "W warps (1 to 16, a power of two; default 4), nh: without the L2 eviction hints, R "
                         "registers a thread (16 to 255) (default: a sweep around the shipped one)")
    ap.add_argument("--registers", default="", metavar="N,...",
                    help="also the shipped launch capped at N registers a thread (maxnreg), per N")
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    caps = int_list(ap, "--registers", a.registers)
    if any(not 16 <= c <= 255 for c in caps):
        ap.error(f"--registers: each cap must be from 16 to 255, got {a.registers!r}")
    variants = VARIANTS
    if a.variants is not None:
        variants = parse_variants(a.variants)
        if variants is None:
            ap.error(f"--variants takes BxP[xW][nh][rR] (B a power of two from 128, P >= 1, W a power of two "
                     f"up to 16, R from 16 to 255) separated by commas, got {a.variants!r}")
    device = "cpu" if a.tiny and not torch.cuda.is_available() else default_device(a.device)
    if a.graph and not device.startswith("cuda"):
        ap.error(f"--graph needs a CUDA device, got {device}")
    chunks, total = (2, 1 << 17) if a.tiny else (76, 1_235_814_400)
    if a.chunks is not None:
        if a.chunks < 1:
            ap.error(f"--chunks must be >= 1, got {a.chunks}")
        chunks = a.chunks
    n = (total // chunks) // 16 * 16
    dt = torch.bfloat16
    gen = torch.Generator(device=device).manual_seed(0)
    P = [torch.randn(n, device=device, dtype=dt, generator=gen) * 0.02 for _ in range(chunks)]
    G = [torch.randn(n, device=device, dtype=dt, generator=gen) * 1e-3 for _ in range(chunks)]
    M = [torch.zeros(n, device=device, dtype=dt) for _ in range(chunks)]
    V = [torch.zeros(n, device=device, dtype=dt) for _ in range(chunks)]
    U = [[torch.empty(n + 64, device=device, dtype=dt) for _ in range(3)] for _ in range(2)]
    time_ms = _timer(device, a.reps, a.graph)
    ms, passes = {}, {}

    def copy_undo():
        for i in range(chunks):
            torch._foreach_copy_([u[:n] for u in U[i % 2]], [P[i], M[i], V[i]])
    from torch.optim.adam import adam as adam_fn
    steps_host = [torch.tensor(5.0) for _ in range(chunks)]

    def foreach():
        adam_fn(P, G, M, V, [], steps_host, foreach=True, lr=HP["lr"], beta1=0.9, beta2=0.95,
                weight_decay=HP["weight_decay"], eps=HP["eps"], amsgrad=False, maximize=False,
                decoupled_weight_decay=True)
    if not a.graph:
        ms["torch_foreach_adamw"] = time_ms(foreach)
    ms["undo_copy_only"], passes["undo_copy_only"] = time_ms(copy_undo), 6
    why = _kernel_unavailable(device)
    if device.startswith("cuda"):
        steps_dev = [torch.tensor(5.0, device=device) for _ in range(chunks)]

        def torch_fused():
            torch._fused_adamw_(P, G, M, V, [], steps_dev, lr=HP["lr"], beta1=0.9, beta2=0.95,
                                weight_decay=HP["weight_decay"], eps=HP["eps"], amsgrad=False, maximize=False)
        ms["torch_fused_adamw"], passes["torch_fused_adamw"] = time_ms(torch_fused), 7
        ms["undo_copy_then_torch_fused"] = time_ms(lambda: (copy_undo(), torch_fused()))
    if why is None:
        from gpu_anchor.train import fused_adam
        cap = None if torch.version.hip else fused_adam.REGISTERS     # ROCm's Triton has no maxnreg
        launches = [(bl, pps, w, h, cap if r is None or torch.version.hip else r) for bl, pps, w, h, r in variants]
        launches += [(fused_adam.BLOCK, fused_adam.PROGRAMS_PER_SM, 4, fused_adam.L2_HINTS, c)
                     for c in sorted(set(caps) - {cap}, reverse=True)]
        for block, pps, warps, hints, regs in launches:
            name = variant(block, pps, regs, warps, hints)
            ms[name] = time_ms(_anchored(fused_adam, P, G, M, V, n, block, pps, device, regs, warps, hints))
            passes[name] = 7
    gbps = {k: round(passes[k] * 2 * n * chunks / (v * 1e-3) / 1e9, 1) for k, v in ms.items() if k in passes}
    result = {"params": n * chunks, "chunks": chunks, "dtype": "bfloat16", "device": device, "reps": a.reps,
              "ms": {k: round(v, 3) for k, v in ms.items()}, "gb_per_s_required_bytes": gbps,
              "shipped": shipped(), "kernel_unavailable": why, "cuda_graph": a.graph}
    if "torch_fused_adamw" in ms and result["shipped"] in ms:
        result["anchored_minus_torch_fused_ms"] = round(ms[result["shipped"]] - ms["torch_fused_adamw"], 3)
    result["variants"] = [list(v) for v in variants] if why is None else []
    name = ("adam_kernel" + (f"_chunks{chunks}" if a.chunks is not None else "") + ("_graph" if a.graph else "")
            + ("_tiny" if a.tiny else ""))
    print(write_result(name, result, a.out))
    return 0


def _kernel_unavailable(device: str) -> str | None:
    from gpu_anchor.train import fused_adam
    return fused_adam.unavailable_reason(torch.device(device))


def _anchored(fused_adam, P, G, M, V, n, block, pps, device, regs=None, warps=4, hints=True):
    """One pass of the kernel over every chunk, blocks of ``block`` elements, ``pps`` programs a SM
    of ``warps`` warps, with or without the L2 eviction hints."""
    import triton.language as tl
    from gpu_anchor.train.fused_adam_kernel import adam_ring
    key = fused_adam.structure(HP, torch.bfloat16)
    sc = fused_adam.scalars(HP, 5)
    nbl = (n + block - 1) // block
    programs = min(nbl, pps * torch.cuda.get_device_properties(device).multi_processor_count)
    ring = [torch.empty(2 * programs * 3 * block, device=device, dtype=torch.bfloat16) for _ in range(2)]
    tags = torch.full((2, nbl), -1, dtype=torch.int64, device=device)
    blks = torch.tensor([[0, j, j] for j in range(nbl)], dtype=torch.int64, device=device)
    rows = [torch.tensor([[P[i].data_ptr(), G[i].data_ptr(), M[i].data_ptr(), V[i].data_ptr(), 0, n]],
                         dtype=torch.int64, device=device) for i in range(len(P))]

    def run():
        for i, r in enumerate(rows):
            adam_ring[(programs,)](r, blks, nbl, tags[i % 2], ring[i % 2], fused_adam.tag_code(7 + i, 0, 0), -1,
                                   sc["decay"], sc["wd"], sc["w1"], sc["omw1"], sc["beta2"], sc["omb2"],
                                   sc["step_size"], sc["bc2_sqrt"], sc["eps"], T=tl.bfloat16, AMSGRAD=False,
                                   MAXIMIZE=False, WD=1, LERP_SMALL=key[4], FMA=True, VEC=block, RS=3 * block,
                                   FAULT=False, HINTS=hints, num_warps=warps, maxnreg=regs, enable_fp_fusion=False)
    return run


def title(result: dict) -> str:
    return (f"Fused anchored Adam kernel vs torch's AdamW kernels ({result.get('params', 0) / 1e9:.2f} B bf16 "
            f"parameters, {result.get('chunks', '?')} chunks)")


def render(r: dict) -> str:
    lines = ["| variant | ms per pass over every chunk | GB/s of the bytes it must move |", "| --- | ---: | ---: |"]
    for k, v in r["ms"].items():
        lines.append(f"| {k}{' (shipped)' if k == r.get('shipped') else ''} | {v:.2f} | "
                     f"{r['gb_per_s_required_bytes'].get(k, '—')} |")
    if r.get("anchored_minus_torch_fused_ms") is not None:
        lines.append(f"\nThe shipped anchored kernel takes {r['anchored_minus_torch_fused_ms']:.2f} ms per step more "
                     "than torch's fused AdamW (negative: less).")
    if r.get("kernel_unavailable"):
        lines.append(f"\nAnchored kernel not run: {r['kernel_unavailable']}.")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
