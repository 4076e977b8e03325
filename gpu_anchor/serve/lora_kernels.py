"""A Triton kernel for the LoRA terms of a decode step: one launch per group of projections.

``lora_slots.Adapters`` computes, for a group of projections that read the same input ``x`` (q/k/v,
o, gate/up, down) and whose outputs are consecutive column ranges of one packed output ``y``:

    t = (x Aᵀ) ⊙ mask          A [members·S·R, in]: every member's slots, stacked
    y[:, member] += t_member Bᵀ_member

With torch ops that is a matmul, a product and one accumulating matmul per member: 15 launches a
decoder layer.  Here the first matmul stays cuBLAS's, and ``expand_`` does the rest in one launch:
one program per (column block of ``y``, token block) masks the tokens' ``t`` of the block's
member to their adapter's ``R`` columns, multiplies by that member's ``B`` rows and adds the
product to ``y`` in float32, rounding once (as ``addmm_`` with ``beta = 1`` does; a token without
an adapter adds exact zeros).  A column block belongs to one member (``Layout``: the block width
divides every member's width); a block of a member the adapters do not target is skipped.

Sums run in another order than cuBLAS's, so the terms may differ from the torch path in the
last bit.  What it saves is measured by ``python -m bench lora_decode`` (docs/serving.md).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

try:  # Triton ships with CUDA builds of torch; CPU-only installs may lack it.
    import triton
    import triton.language as tl
except Exception:  # pragma: no cover - depends on the install
    triton = None

def available(device, dtype: torch.dtype) -> bool:
    return (triton is not None and torch.device(device).type == "cuda"
            and dtype in (torch.bfloat16, torch.float16, torch.float32))


@dataclass
class Layout:
    """Where the column blocks of a group's packed output ``y`` read: ``table`` [blocks, 2] int32
    holds per block the member's index among the stacked ones (-1: not targeted) and its first
    row in the stacked ``B``; ``block``: the block width."""
    table: torch.Tensor
    block: int


def layout(widths: list[int], stacked: list[int | None], b_rows: list[int], device) -> Layout | None:
    """``widths``: each member's output columns, in ``y``'s order; ``stacked``: its index among the
    members with adapter tensors (None: none); ``b_rows``: its first row in the stacked ``B``.
    None when no block width of at least 16 divides every member's width."""
    block = next((b for b in (64, 32, 16) if all(w % b == 0 for w in widths)), None)
    if block is None:
        return None
    rows = []
    for w, s, b0 in zip(widths, stacked, b_rows):
        rows += [(-1, 0) if s is None else (s, b0 + c) for c in range(0, w, block)]
    return Layout(torch.tensor(rows, dtype=torch.int32, device=device), block)


def expand_(y: torch.Tensor, t: torch.Tensor, slots: torch.Tensor, B: torch.Tensor, lay: Layout,
            capacity: int, rank: int) -> None:
    """``y`` [T, N] (unit column stride) += per column block, ``t``'s member columns (``x Aᵀ``
    [T, members·S·R]) in the token's slot (``slots`` [T], -1: none) × ``B``'s rows."""
    T = y.shape[0]
    if not T:
        return
    sr = capacity * rank
    block_m = max(16, min(64, triton.next_power_of_2(T)))
    grid = (lay.table.shape[0], triton.cdiv(T, block_m))
    _expand_kernel[grid](t, slots, B, lay.table, y, T, t.stride(0), B.stride(0), y.stride(0), sr, rank,
                         BLOCK_M=block_m, BLOCK_N=lay.block, BLOCK_SR=max(16, triton.next_power_of_2(sr)),
                         IEEE=y.dtype == torch.float32, num_warps=4)


if triton is not None:
    @triton.jit
    def _expand_kernel(T_IN, SLOTS, B, TABLE, Y, T, s_t, s_b, s_y, SR, R, BLOCK_M: tl.constexpr,
                       BLOCK_N: tl.constexpr, BLOCK_SR: tl.constexpr, IEEE: tl.constexpr):
        blk = tl.program_id(0)
        member = tl.load(TABLE + 2 * blk)
        if member >= 0:
            b0 = tl.load(TABLE + 2 * blk + 1)
            m = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
            j = tl.arange(0, BLOCK_SR)
            n = tl.arange(0, BLOCK_N)
            slot = tl.load(SLOTS + m, mask=m < T, other=-1)
            mine = (m[:, None] < T) & (j[None, :] < SR) & (j[None, :] // R == slot[:, None])
            t = tl.load(T_IN + m[:, None] * s_t + member * SR + j[None, :], mask=mine, other=0.0)
            bt = tl.load(B + (b0 + n)[None, :] * s_b + j[:, None], mask=j[:, None] < SR, other=0.0)
            if IEEE:
                acc = tl.dot(t, bt, input_precision="ieee")
            else:
                acc = tl.dot(t, bt)
            yp = Y + m[:, None] * s_y + blk * BLOCK_N + n[None, :]
            y = tl.load(yp, mask=m[:, None] < T, other=0.0)
            tl.store(yp, (y.to(tl.float32) + acc).to(Y.dtype.element_ty), mask=m[:, None] < T)
