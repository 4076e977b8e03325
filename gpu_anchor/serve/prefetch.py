"""L2 prefetch of the weight a decode step's next GEMM reads, issued beside the kernel before it.

A decode step is memory-bound, but not every kernel keeps the HBM busy: attention reads a
layer's KV at 2.6-2.8 TB/s on the H200, below what the memory gives, and the output
projection after it (a 4 096 x 4 096 weight, 33.5 MB for Qwen3-8B) is a GEMM of only 64
column tiles at 64 rows, too few to saturate it (it reads its weight at ~2 TB/s).  The L2 (50
MB on the H200) holds that weight whole, so a tiny kernel on a second stream asks the memory
system to bring it into the L2 while attention runs (``cp.async.bulk.prefetch.L2``: one
instruction per 16 KiB piece, no registers or shared memory to speak of; ``evict_last`` so that
attention's streaming KV does not push it out), and the GEMM then reads it from the L2.

Contract: a prefetch changes no value anywhere, only where bytes sit in the cache; the GEMM
waits for it (``join``), so it can never be slower than both, and the results are the same
bits with or without it (tested on the GPU).  Only decode-sized steps use it (``MAX_ROWS``):
a GEMM over many rows is compute-bound and re-reads its weight from the L2 anyway.
"""
from __future__ import annotations

import os

import torch

try:  # Triton ships with CUDA builds of torch; CPU-only installs may lack it.
    import triton
    import triton.language as tl
except Exception:  # pragma: no cover - depends on the install
    triton = None

PIECE = 16 << 10        # bytes one prefetch instruction asks for
PIECES_PER_PROGRAM = 32  # one warp, a piece a thread
MAX_ROWS = 256          # steps with more tokens than this prefetch nothing
ENV = "GPU_ANCHOR_L2_PREFETCH"   # "0" turns it off (A/B runs)


def enabled() -> bool:
    return os.environ.get(ENV, "1") != "0"


def _mode() -> tuple[bool, bool]:
    m = os.environ.get(ENV, "1")
    return "normal" not in m, "nojoin" not in m


def usable(device: torch.device) -> bool:
    """sm_90 and later (the bulk prefetch is a Hopper instruction), with Triton."""
    device = torch.device(device)
    return (triton is not None and device.type == "cuda"
            and torch.cuda.get_device_capability(device)[0] >= 9)


class WeightPrefetch:
    """``start(w)`` forks a side stream off the current one and prefetches ``w`` there;
    ``join()`` makes the current stream wait for it.  Capturable in a CUDA graph (the fork
    and the join become the graph's edges)."""

    def __init__(self, device: torch.device) -> None:
        self.device = torch.device(device)
        self.side = torch.cuda.Stream(self.device)
        self._open = False
        self.evict_last, self.wait = _mode()

    def start(self, w: torch.Tensor) -> bool:
        if self._open and self.wait:
            raise RuntimeError("a prefetch is already in flight; join it first")
        if not w.is_contiguous() or w.data_ptr() % 16:
            return False
        nbytes = w.numel() * w.element_size()
        full, tail = divmod(nbytes, PIECE)
        tail -= tail % 16
        pieces = full + (1 if tail else 0)
        if not pieces:
            return False
        self.side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.side):
            grid = (triton.cdiv(pieces, PIECES_PER_PROGRAM),)
            _prefetch_kernel[grid](w, full, pieces, tail, PIECE=PIECE, BLOCK=PIECES_PER_PROGRAM,
                                   EVICT_LAST=self.evict_last, num_warps=1)
        self._open = True
        return True

    def join(self, final: bool = False) -> None:
        if self._open and (self.wait or final):
            torch.cuda.current_stream(self.device).wait_stream(self.side)
            self._open = False


if triton is not None:
    @triton.jit
    def _prefetch_kernel(X, full, pieces, tail, PIECE: tl.constexpr, BLOCK: tl.constexpr, EVICT_LAST: tl.constexpr):
        # thread i asks for piece i: PIECE bytes, a last partial one ``tail`` bytes (a multiple
        # of 16, as the instruction needs); threads past the end ask for the first 16 bytes again
        i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        base = X.to(tl.pointer_type(tl.int8))
        live = i < pieces
        ptr = tl.where(live, base + i.to(tl.int64) * PIECE, base)
        size = tl.where(i < full, PIECE, tl.where(live, tail, 16)).to(tl.int32)
        if EVICT_LAST:
            tl.inline_asm_elementwise(
                "{ .reg .b64 pol; createpolicy.fractional.L2::evict_last.b64 pol, 1.0; "
                "cp.async.bulk.prefetch.L2.global.L2::cache_hint [$1], $2, pol; mov.u32 $0, 0; }",
                "=r,l,r", [ptr, size], dtype=tl.int32, is_pure=False, pack=1)
        else:
            tl.inline_asm_elementwise(
                "cp.async.bulk.prefetch.L2.global [$1], $2; mov.u32 $0, 0;",
                "=r,l,r", [ptr, size], dtype=tl.int32, is_pure=False, pack=1)
