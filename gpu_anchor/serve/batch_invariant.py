"""Batch-invariant ops for ``gpu-anchor serve --deterministic``.

Contract: for every op here, the result for one row (a token) is a function of that row's
inputs and the weights only — bit for bit the same whether the row is computed alone, in a
decode batch of 32, at row 700 of a 2048-token prefill, or in a CUDA graph padded with
dummy rows.  Each reduction is done in an order that depends only on its length (the
hidden size, the head size, the context length), never on the number of rows.  With every
op of the forward like that (``Model(deterministic=True)``), the K/V a prefill recomputes
after a destructive failure equal the K/V that decode steps wrote token by token, and a
faulted run's tokens equal the fault-free run's.

Why a mode at all: cuBLAS picks its GEMM kernel — tile shape, split-K — by the problem
size, so ``F.linear`` on ``M`` rows sums a row's products in an order that depends on
``M``; torch's reductions (RMSNorm's mean) likewise pick their thread layout by the number
of outputs.  Those differences are rounding noise (~1e-3 relative in bf16) but they flip
near-tie tokens, and once one token differs the rest of the stream does too.

- ``linear(x, w, bias)``, ``x [M, K] @ w[N, K]^T``: CUDA — a Triton GEMM with ONE tile
  configuration for every ``M`` (``BLOCK_M = BLOCK_N = BLOCK_K = 64``, no split-K): each
  output element accumulates ``K`` in chunks of 64, in order, in float32 (tensor-core dots
  for bf16/fp16, IEEE dots for float32).  ``M`` is not specialised on.  CPU — one
  ``F.linear`` call per row, each of the same shape ``[1, K]``.
- ``rms_norm(x, w, eps)`` over the last dimension: CUDA — one Triton program per row, the
  sum of squares as one ``tl.sum`` over a block of ``next_power_of_2(D)``; CPU — the sum of
  squares as a pairwise tree of elementwise adds whose shape depends only on ``D``.
  (Same maths as ``model_runner._rms``: float32 statistics, ``w * x.to(dtype)``.)
- ``attend``: CUDA — ``attention.attend_triton`` as it is: split-KV with a fixed chunk size
  and keys per split, a token's split count a function of its context length only (the number
  of programs sharing its splits, sized to the launch, moves work, not bits), and the partials
  merged over its splits in one fixed order, so a token's output depends only on its
  query, its position and its sequence's cache — not on the other tokens of the step, nor on
  prefill vs decode.  CPU — the reference SDPA per query token (each call's shape depends
  only on that token's context length).
- ``sample``: ``sampling.sample_ids`` with each sampled row drawn by a call of its own (shape
  ``[1, V]``; one host copy of the ids at the end): its softmax and sort are row-wise, but
  torch's CUDA ``cumsum`` picks its thread layout by the number of rows (and scans a single
  row with cub), so the cumulative distribution a draw is compared with would depend on how
  many rows share the step.
  Greedy rows are one ``argmax`` over all rows (a max is exact in any order; ties go to the
  lowest id).
- everything else in the forward is elementwise or a gather (embedding, rotary, SiLU,
  residual adds, casts) and so invariant already.

Not covered, and said where it applies: tensor parallelism with more than 2 ranks (NCCL's
all-reduce order depends on the message size, i.e. the batch; with 2 ranks each element is
a single ``a + b``, which is exact in either order); float64 on CUDA (refused: there is no
float64 tensor-core dot and the float64 attention runs the host reference).  Sampling
(``sampling.py``) is row-wise by construction; see docs/serving.md, "Determinism".
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from . import fused

try:  # Triton ships with CUDA builds of torch; CPU-only installs may lack it.
    import triton
    import triton.language as tl
except Exception:  # pragma: no cover - depends on the install
    triton = None

BLOCK_M = BLOCK_N = BLOCK_K = 64     # the one GEMM tile, for every M (see the module's doc)
GEMM_WARPS, GEMM_STAGES = 4, 3


def supported(device: torch.device, dtype: torch.dtype) -> str:
    """"" if deterministic mode can run on ``device`` in ``dtype``, else why not."""
    if device.type != "cuda":
        return ""
    if dtype not in (torch.float32, torch.bfloat16, torch.float16):
        return f"--deterministic on CUDA supports float32, bfloat16 and float16, not {dtype}"
    if triton is None:
        return "--deterministic on CUDA needs Triton (it ships with CUDA builds of torch)"
    return ""


# ------------------------------------------------------------------ linear
def linear(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, w, bias)`` whose row ``i`` depends only on ``x[i]`` (``x``: [..., K])."""
    lead, K = x.shape[:-1], x.shape[-1]
    x2 = x.reshape(-1, K)
    N = w.shape[0]
    if x.is_cuda:
        y = _linear_triton(x2, w, bias)
    else:
        y = torch.empty(x2.shape[0], N, dtype=x.dtype, device=x.device)
        for i in range(x2.shape[0]):       # every call [1, K]: the same kernel, the same order
            y[i] = F.linear(x2[i:i + 1].clone(), w, bias)[0]
    return y.reshape(*lead, N)


def _linear_triton(x: torch.Tensor, w: torch.Tensor, bias) -> torch.Tensor:
    M, K = x.shape
    N = w.shape[0]
    if x.stride(1) != 1:
        x = x.contiguous()
    if w.stride(1) != 1:
        w = w.contiguous()
    y = torch.empty(M, N, dtype=x.dtype, device=x.device)
    if M == 0:
        return y
    grid = (triton.cdiv(M, BLOCK_M), triton.cdiv(N, BLOCK_N))
    _gemm_kernel[grid](x, w, bias if bias is not None else w, y, M, N, K, x.stride(0), w.stride(0), y.stride(0),
                       HAS_BIAS=bias is not None, IEEE=x.dtype == torch.float32,
                       BM=BLOCK_M, BN=BLOCK_N, BK=BLOCK_K, num_warps=GEMM_WARPS, num_stages=GEMM_STAGES)
    return y


# ------------------------------------------------------------------ RMSNorm
def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dimension, each row on its own (``model_runner._rms``'s maths)."""
    D = x.shape[-1]
    if x.is_cuda:
        return _rms_triton(x.reshape(-1, D), w, eps).reshape(x.shape)
    dt = x.dtype
    xf = x.to(torch.float32)
    inv = torch.rsqrt(_tree_sum(xf * xf) / D + eps)
    return w * (xf * inv).to(dt)


def _rms_triton(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return fused.add_rms_norm(x, w, eps)[1]     # one program per row: batch-invariant as it is


def _tree_sum(sq: torch.Tensor) -> torch.Tensor:
    """Sum over the last dimension as a pairwise tree of elementwise adds (zero-padded to a
    power of two): the order depends on the length only.  Returns [..., 1]."""
    n = sq.shape[-1]
    width = 1 << max(0, (n - 1).bit_length())
    if width != n:
        sq = F.pad(sq, (0, width - n))
    while width > 1:
        width //= 2
        sq = sq[..., :width] + sq[..., width:]
    return sq


# ------------------------------------------------------------------ sampling
def sample(logits: torch.Tensor, params: list, indices: list[int]) -> list[int]:
    """``sampling.sample`` (same arguments, same draws) whose sampled rows do not depend on the
    other rows of the step: each is drawn by a call of its own, on the device; one host copy."""
    return sample_ids(logits, params, indices).tolist()


def sample_ids(logits: torch.Tensor, params: list, indices: list[int]) -> torch.Tensor:
    """``sample`` without the host copy: the ids as an int64 tensor on the device."""
    from . import sampling
    ids = logits.argmax(dim=-1)
    rows = [b for b, p in enumerate(params) if not p.greedy]
    if rows:
        ids = ids.clone()
        for b in rows:
            ids[b:b + 1] = sampling.sample_ids(logits[b:b + 1], [params[b]], [indices[b]])
    return ids


# ------------------------------------------------------------------ attention
def attend(q: torch.Tensor, cache: torch.Tensor, meta, scale: float) -> torch.Tensor:
    """``attention.attend`` with a batch-invariant CPU path (CUDA's kernel is one already)."""
    from . import attention
    if q.is_cuda:
        if attention.triton is None or cache.dtype == torch.float64:
            raise RuntimeError(supported(q.device, cache.dtype) or "--deterministic: no Triton attention")
        return attention.attend_triton(q, cache, meta, scale)
    _, nb, bs, hkv, d = cache.shape
    hq = q.shape[1]
    out = torch.empty_like(q)
    for start, n, ctx, table in zip(meta.q_starts, meta.q_lens, meta.ctx_lens, meta.tables):
        blocks = torch.tensor(table[: -(-ctx // bs)], dtype=torch.long, device=q.device)
        k = cache[0][blocks].reshape(-1, hkv, d)[:ctx].to(q.dtype)
        v = cache[1][blocks].reshape(-1, hkv, d)[:ctx].to(q.dtype)
        if hq != hkv:
            k = k.repeat_interleave(hq // hkv, dim=1)
            v = v.repeat_interleave(hq // hkv, dim=1)
        k, v = k.transpose(0, 1), v.transpose(0, 1)
        for i in range(n):       # the query at position ctx - n + i sees keys 0 .. ctx - n + i
            seen = ctx - n + i + 1
            qi = q[start + i][:, None, :].clone()
            o = F.scaled_dot_product_attention(qi, k[:, :seen].contiguous(), v[:, :seen].contiguous(), scale=scale)
            out[start + i] = o[:, 0]
    return out


if triton is not None:
    @triton.jit(do_not_specialize=["M"])
    def _gemm_kernel(X, W, B, Y, M, N, K, sx_m, sw_n, sy_m,
                     HAS_BIAS: tl.constexpr, IEEE: tl.constexpr,
                     BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
        # program (m, n) computes Y[m*BM:(m+1)*BM, n*BN:(n+1)*BN]; programs along M run next to
        # each other, so a W tile is read from memory once and from L2 by the other M tiles
        pm = tl.program_id(0)
        pn = tl.program_id(1)
        rm = (pm * BM + tl.arange(0, BM)).to(tl.int64)
        rn = (pn * BN + tl.arange(0, BN)).to(tl.int64)
        rk = tl.arange(0, BK)
        m_ok = rm < M
        n_ok = rn < N
        acc = tl.zeros([BM, BN], dtype=tl.float32)
        for k0 in range(0, K, BK):     # the order of the K chunks is fixed: 0, 64, 128, ...
            kk = k0 + rk
            k_ok = kk < K
            a = tl.load(X + rm[:, None] * sx_m + kk[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0)
            b = tl.load(W + rn[None, :] * sw_n + kk[:, None], mask=n_ok[None, :] & k_ok[:, None], other=0.0)
            if IEEE:
                acc = tl.dot(a, b, acc, input_precision="ieee")
            else:
                acc = tl.dot(a, b, acc)
        if HAS_BIAS:
            acc += tl.load(B + rn, mask=n_ok, other=0.0).to(tl.float32)[None, :]
        tl.store(Y + rm[:, None] * sy_m + rn[None, :], acc.to(Y.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])
