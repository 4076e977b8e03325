"""The fused anchored Adam kernel alone against torch's AdamW kernels, on one device.

    python -m bench adam_kernel [--tiny] [--device cuda:0] [--reps 10] [--chunks 76] [--graph] [--registers 64,56]

A 1.24 B bf16 parameter set (llama3.2-1b's) in 76 chunks, as the step protocol runs it: per
chunk one launch of ``fused_adam``'s kernel (reads p, g, m, v; writes the old p, m, v into the
undo slot and the new ones in place), against torch's ``_fused_adamw_`` (``AdamW(fused=True)``:
one multi-tensor pass, no undo), torch's foreach AdamW (the default), the undo copy alone, and
the copy followed by torch's fused kernel (what the protocol would run without its own
kernel).  Each figure is the median of ``--reps`` passes over every chunk, CUDA events, after
one warm-up pass; the kernel's block size and warps are swept.  The bandwidth column counts
the bytes each variant must move (10 tensor passes for the anchored kernel, 7 for torch's
fused one), not what it moved.  ``--chunks``: more, smaller chunks make the two undo slots small
enough to stay in the GPU's L2 (50 MB on the H200: at 640 chunks both slots take 23 MB), which
is what the kernel's undo writes would need to stop costing memory bandwidth; the result's name
then says the count.  Launched from Python, a chunk costs the host about 20 µs, so with hundreds
of chunks the host is part of the time: ``--graph`` captures each variant's pass in a CUDA graph and
times its replays (only the shipped block size and warps; torch's foreach AdamW, which reads its
step counts on the host, is left out there).  Variants named without ``_regs`` take the registers
ptxas chooses (72 a thread on sm_90: 7 programs of 4 warps an SM); the shipped launch caps them at
``fused_adam.REGISTERS`` (64: 8 an SM, 16 bytes spilled), and ``--registers N,...`` adds the
shipped block and warps capped at each N (Triton's ``maxnreg``; 56 lets 9 and spills 72 bytes).
``<shipped>_word_fill`` is the shipped launch with an 8-byte fill before each chunk: what moving
the step's progress word between chunks would cost (a fused step reads its cursor from its tags).
Without CUDA and Triton (``--tiny`` on a CPU) only the torch variants run, on a small set.
"""
from __future__ import annotations

import argparse
import statistics
import sys

import torch

from bench.common import default_device, int_list, write_result

SHIPPED_LAUNCH = (1024, 4)                   # fused_adam.BLOCK and the launch's num_warps
VARIANTS = [(1024, 4), (2048, 8), (1024, 2), (1024, 8), (512, 2), (512, 4), (256, 2)]
HP = dict(lr=1e-4, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1, amsgrad=False, maximize=False, foreach=None,
          fused=None, capturable=False, differentiable=False, decoupled_weight_decay=True)


def variant(block: int, warps: int, regs: int | None) -> str:
    return f"anchored_block{block}_warps{warps}" + (f"_regs{regs}" if regs else "")


def shipped() -> str:
    """The variant name of the launch ``fused_adam`` makes (its registers cap only on NVIDIA)."""
    from gpu_anchor.train import fused_adam
    return variant(*SHIPPED_LAUNCH, None if torch.version.hip else fused_adam.REGISTERS)


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
    ap.add_argument("--registers", default="", metavar="N,...",
                    help="also the shipped launch capped at N registers a thread (maxnreg), per N")
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    caps = int_list(ap, "--registers", a.registers)
    if any(not 16 <= c <= 255 for c in caps):
        ap.error(f"--registers: each cap must be from 16 to 255, got {a.registers!r}")
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
        launches = [(b, w, None) for b, w in ([SHIPPED_LAUNCH] if a.graph else VARIANTS)]
        shipped_cap = None if torch.version.hip else fused_adam.REGISTERS     # ROCm's Triton has no maxnreg
        launches += [SHIPPED_LAUNCH + (c,) for c in sorted({*caps, shipped_cap} - {None}, reverse=True)]
        for block, warps, regs in launches:
            name = variant(block, warps, regs)
            ms[name] = time_ms(_anchored(fused_adam, P, G, M, V, U, n, block, warps, device, regs))
            passes[name] = 10
        # What a progress word moved before each chunk would add (copy steps move it; fused
        # steps read their cursor from the tags instead).
        word = torch.zeros(1, dtype=torch.int64, device=device)
        ms[shipped() + "_word_fill"] = time_ms(_anchored(fused_adam, P, G, M, V, U, n, *SHIPPED_LAUNCH, device,
                                                         shipped_cap, word=word))
    gbps = {k: round(passes[k] * 2 * n * chunks / (v * 1e-3) / 1e9, 1) for k, v in ms.items() if k in passes}
    result = {"params": n * chunks, "chunks": chunks, "dtype": "bfloat16", "device": device, "reps": a.reps,
              "ms": {k: round(v, 3) for k, v in ms.items()}, "gb_per_s_required_bytes": gbps,
              "shipped": shipped(), "kernel_unavailable": why, "cuda_graph": a.graph}
    if "torch_fused_adamw" in ms and result["shipped"] in ms:
        result["anchored_minus_torch_fused_ms"] = round(ms[result["shipped"]] - ms["torch_fused_adamw"], 3)
    name = ("adam_kernel" + (f"_chunks{chunks}" if a.chunks is not None else "") + ("_graph" if a.graph else "")
            + ("_tiny" if a.tiny else ""))
    print(write_result(name, result, a.out))
    return 0


def _kernel_unavailable(device: str) -> str | None:
    from gpu_anchor.train import fused_adam
    return fused_adam.unavailable_reason(torch.device(device))


def _anchored(fused_adam, P, G, M, V, U, n, block, warps, device, regs=None, word=None):
    import triton.language as tl
    from gpu_anchor.train.fused_adam_kernel import adam_undo
    key = fused_adam.structure(HP, torch.bfloat16)
    sc = fused_adam.scalars(HP, 5)
    nbl = (n + block - 1) // block
    tags = torch.full((2, nbl), -1, dtype=torch.int64, device=device)
    blks = torch.tensor([[0, j, j] for j in range(nbl)], dtype=torch.int64, device=device)
    rows = []
    for i in range(len(P)):
        u = U[i % 2]
        addrs = [P[i].data_ptr(), G[i].data_ptr(), M[i].data_ptr(), V[i].data_ptr(), 0,
                 u[0].data_ptr(), u[1].data_ptr(), u[2].data_ptr(), 0, n]
        rows.append(torch.tensor([addrs], dtype=torch.int64, device=device))

    def run():
        for i, r in enumerate(rows):
            if word is not None:
                word.fill_(i)
            adam_undo[(nbl,)](r, blks, tags[i % 2], 7, sc["decay"], sc["wd"], sc["w1"], sc["omw1"], sc["beta2"],
                              sc["omb2"], sc["step_size"], sc["bc2_sqrt"], sc["eps"], T=tl.bfloat16, AMSGRAD=False,
                              MAXIMIZE=False, WD=1, LERP_SMALL=key[4], FMA=True, BLOCK=block, num_warps=warps,
                              maxnreg=regs, enable_fp_fusion=False)
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
                     "than torch's fused AdamW: the undo writes (3 of its 10 tensor passes).")
    if r.get("kernel_unavailable"):
        lines.append(f"\nAnchored kernel not run: {r['kernel_unavailable']}.")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
