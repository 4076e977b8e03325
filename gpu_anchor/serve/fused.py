"""Fused row kernels of the decoder layer: fewer, larger launches for the same maths.

The plain forward (``model_runner``) spells a layer as torch ops: an RMSNorm is eight
kernels, rotary five per tensor, the residual adds and ``silu(gate) * up`` one each — about
58 launches a layer, 2 100 for a 36-layer model, most of them a few microseconds of work
on 64 rows.  On the GPU these three kernels replace them:

- ``add_rms_norm(x, w, eps, residual)``: ``h = residual + x`` (stored) and ``rms(h) · w``;
  without ``residual``, the norm alone.
- ``qk_norm_rope_store(q, k, v, ...)``: per head, Qwen3's ``q_norm`` / ``k_norm`` (if
  given), rotary on q and k in place, and this step's K/V stored into their cache slots
  (``attention.write_kv``'s contract: a slot of -1 writes nothing).
- ``silu_mul(gate, up)``: ``silu(gate) * up``.

Contract: each computes a row from that row alone (so a token's result never depends on
the batch), and rounds to the tensor dtype exactly where the torch ops do — the norm's
``(x · rstd).to(dtype)`` before the weight, each product and sum of the rotary — so the
only difference from the torch spelling is the order of the norm's float32 sum of squares.
The norm's ``1 / sqrt_rn`` maths is the batch-invariant mode's (``batch_invariant.rms_norm``
calls ``add_rms_norm`` without a residual).  ``available`` says when they apply; anywhere
else (CPU, float64, a head size that is not a power of two) the caller keeps the torch ops.
"""
from __future__ import annotations

import torch

try:  # Triton ships with CUDA builds of torch; CPU-only installs may lack it.
    import triton
    import triton.language as tl
except Exception:  # pragma: no cover - depends on the install
    triton = None


def available(device: torch.device, dtype: torch.dtype, head_dim: int) -> bool:
    return (triton is not None and torch.device(device).type == "cuda"
            and dtype in (torch.bfloat16, torch.float16, torch.float32)
            and head_dim >= 16 and not head_dim & (head_dim - 1))


# no multiply-add contraction: ``a * b`` rounded, then the sum rounded, as the torch ops round
# (with contraction on, a bf16 rotary output differed from torch's in the last bit for ~24 % of
# its elements on the H200)
EXACT = {"enable_fp_fusion": False}


def _warps(block: int) -> int:
    return max(1, min(16, block // 256))


def add_rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float,
                 residual: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(h, rms(h) · w)`` over the last dimension, ``h = residual + x`` (``x`` itself when
    no residual: then ``h`` is ``x``).  Rows of ``x`` need unit stride in the last dimension."""
    D = x.shape[-1]
    x2 = x.reshape(-1, D)
    if x2.stride(1) != 1:
        x2 = x2.contiguous()
    R = x2.shape[0]
    y = torch.empty(R, D, dtype=x.dtype, device=x.device)
    h = x2 if residual is None else torch.empty(R, D, dtype=x.dtype, device=x.device)
    r2 = x2 if residual is None else residual.reshape(-1, D)
    if R:
        block = triton.next_power_of_2(D)
        _add_rms_kernel[(R,)](x2, r2, w, y, h, x2.stride(0), r2.stride(0), D, eps,
                              HAS_RES=residual is not None, BLOCK=block, num_warps=_warps(block), **EXACT)
    return (x if residual is None else h.view(x.shape)), y.view(x.shape)


def qk_norm_rope_store(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_w, k_w, eps: float,
                       cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor,
                       cache: torch.Tensor, slots: torch.Tensor) -> None:
    """In place on ``q`` [T, Hq, D] and ``k`` [T, Hkv, D] (unit stride within a token):
    per-head RMSNorm with ``q_w`` / ``k_w`` (both None: none), then rotary with the
    ``cos`` / ``sin`` tables [positions, D] at ``positions``; then ``k`` and ``v`` go to the
    cache ``[2, blocks, block_size, Hkv, D]`` (contiguous) at ``slots`` (-1: nowhere)."""
    T, hq, d = q.shape
    hkv = k.shape[1]
    if not T:
        return
    for t in (q, k, v):
        if t.stride(2) != 1 or t.stride(1) != d:
            raise ValueError("qk_norm_rope_store needs each token's heads contiguous")
    norm = q_w is not None
    _qk_rope_store_kernel[(T, hq + hkv)](
        q, k, v, q_w if norm else q, k_w if norm else k, cos, sin, positions, cache, slots,
        q.stride(0), k.stride(0), v.stride(0), cos.stride(0), cache.stride(0), eps,
        HQ=hq, HKV=hkv, D=d, HALF=d // 2, NORM=norm, num_warps=1 if d <= 128 else 2, **EXACT)


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` (both [T, I], unit stride in the last dimension)."""
    T, n = gate.shape
    out = torch.empty(T, n, dtype=gate.dtype, device=gate.device)
    if T:
        block = 1024
        _silu_mul_kernel[(T, triton.cdiv(n, block))](gate, up, out, gate.stride(0), up.stride(0), n,
                                                      BLOCK=block, num_warps=4, **EXACT)
    return out


if triton is not None:
    @triton.jit
    def _add_rms_kernel(X, R, W, Y, H, s_x, s_r, D, eps, HAS_RES: tl.constexpr, BLOCK: tl.constexpr):
        r = tl.program_id(0).to(tl.int64)
        offs = tl.arange(0, BLOCK)
        ok = offs < D
        x = tl.load(X + r * s_x + offs, mask=ok, other=0.0).to(tl.float32)
        if HAS_RES:     # h = residual + x, rounded as the torch add rounds it
            x = (x + tl.load(R + r * s_r + offs, mask=ok, other=0.0).to(tl.float32)).to(Y.dtype.element_ty)
            tl.store(H + r * D + offs, x, mask=ok)
            x = x.to(tl.float32)
        inv = 1.0 / tl.sqrt_rn(tl.sum(x * x, axis=0) / D + eps)
        xn = (x * inv).to(Y.dtype.element_ty).to(tl.float32)
        w = tl.load(W + offs, mask=ok, other=0.0).to(tl.float32)
        tl.store(Y + r * D + offs, (w * xn).to(Y.dtype.element_ty), mask=ok)

    @triton.jit
    def _qk_rope_store_kernel(Q, K, V, QW, KW, COS, SIN, POS, C, SLOTS, s_q, s_k, s_v, s_rope, s_kv, eps,
                              HQ: tl.constexpr, HKV: tl.constexpr, D: tl.constexpr, HALF: tl.constexpr,
                              NORM: tl.constexpr):
        # program (token t, head h): heads 0..HQ-1 are q's, HQ.. are k's (which also store K/V)
        t = tl.program_id(0).to(tl.int64)
        h = tl.program_id(1)
        offs = tl.arange(0, D)
        part = (offs + HALF) % D       # rotate_half: x[i + D/2] negated for the first half
        sign = tl.where(offs < HALF, -1.0, 1.0)
        if h < HQ:
            row = Q + t * s_q + h * D
            wrow = QW
        else:
            row = K + t * s_k + (h - HQ) * D
            wrow = KW
        dt = Q.dtype.element_ty
        x = tl.load(row + offs).to(tl.float32)
        xp = tl.load(row + part).to(tl.float32)
        if NORM:
            inv = 1.0 / tl.sqrt_rn(tl.sum(x * x, axis=0) / D + eps)
            x = (tl.load(wrow + offs).to(tl.float32) * (x * inv).to(dt).to(tl.float32)).to(dt).to(tl.float32)
            xp = (tl.load(wrow + part).to(tl.float32) * (xp * inv).to(dt).to(tl.float32)).to(dt).to(tl.float32)
        pos = tl.load(POS + t).to(tl.int64)
        c = tl.load(COS + pos * s_rope + offs).to(tl.float32)
        s = tl.load(SIN + pos * s_rope + offs).to(tl.float32)
        # q * cos + rotate_half(q) * sin, each product and the sum rounded as torch rounds them
        y = ((x * c).to(dt).to(tl.float32) + (sign * xp * s).to(dt).to(tl.float32)).to(dt)
        tl.store(row + offs, y)
        if h >= HQ:
            slot = tl.load(SLOTS + t).to(tl.int64)
            if slot >= 0:
                kvh = h - HQ
                dst = C + slot * (HKV * D) + kvh * D + offs
                tl.store(dst, y.to(C.dtype.element_ty))
                tl.store(dst + s_kv, tl.load(V + t * s_v + kvh * D + offs).to(C.dtype.element_ty))

    @triton.jit
    def _silu_mul_kernel(G, U, O, s_g, s_u, N, BLOCK: tl.constexpr):
        t = tl.program_id(0).to(tl.int64)
        offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        ok = offs < N
        g = tl.load(G + t * s_g + offs, mask=ok, other=0.0).to(tl.float32)
        u = tl.load(U + t * s_u + offs, mask=ok, other=0.0).to(tl.float32)
        a = tl.div_rn(g, 1.0 + tl.exp(-g)).to(O.dtype.element_ty).to(tl.float32)
        tl.store(O + t * N + offs, (a * u).to(O.dtype.element_ty), mask=ok)
