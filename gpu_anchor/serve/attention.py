"""Attention over the paged KV cache.

Cache layout, per layer: one tensor ``[2, num_blocks, block_size, num_kv_heads, head_dim]``
(K then V).  Token ``p`` of a sequence lives in slot ``block_table[p // bs] * bs + p % bs``.

Two paths with one contract — ``attend(q, cache, meta) -> [T, num_heads, head_dim]``
where query token ``t`` (absolute position ``meta.positions[t]`` of sequence
``meta.token_seq[t]``) attends causally to keys ``0..positions[t]`` of its sequence:

- CUDA: a Triton kernel; one program per (query token, KV head) walks the block table
  and keeps an online softmax over the GQA group (no gather of the whole context).
- CPU (and the reference for tests): per sequence, gather its blocks and run SDPA.

CUDA-graph capture (``cuda_graphs.py``): both kernels' grids depend only on the number of
query tokens (fixed per captured batch size) and the KV head count; everything per step
(positions, slots, block tables) is read from device buffers, and the block table has a
fixed width, so a captured launch stays valid for every step of that batch size.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

try:  # Triton ships with CUDA builds of torch; CPU-only installs may lack it.
    import triton
    import triton.language as tl
except Exception:  # pragma: no cover - depends on the install
    triton = None


@dataclass
class AttnMeta:
    positions: torch.Tensor      # [T] int64, absolute position of each query token
    slots: torch.Tensor          # [T] int64, flat cache slot each token's K/V goes to
    token_seq: torch.Tensor      # [T] int32, row of block_tables for each token
    block_tables: torch.Tensor   # [B, max_blocks] int32 (padded with 0)
    # host-side copies for the CPU path
    q_starts: list[int]
    q_lens: list[int]
    ctx_lens: list[int]          # keys visible to the sequence's last query token
    tables: list[list[int]]


def step_inputs(plan: dict, device) -> tuple[torch.Tensor, AttnMeta, torch.Tensor]:
    """The tensors of an eager step — token ids, attention metadata, rows to sample — from
    its plan: host lists ``ids``, ``pos``, ``slots``, ``tseq`` (per token), ``q_starts``,
    ``q_lens``, ``ctx``, ``tables`` (per sequence), ``rows``.  Rank 0 builds the plan; every
    rank of a tensor-parallel group builds the same tensors from it."""
    tables = plan["tables"]
    width = max(len(t) for t in tables)
    bt = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)
    meta = AttnMeta(torch.tensor(plan["pos"], dtype=torch.long).to(device, non_blocking=True),
                    torch.tensor(plan["slots"], dtype=torch.long).to(device, non_blocking=True),
                    torch.tensor(plan["tseq"], dtype=torch.int32).to(device, non_blocking=True),
                    bt.to(device, non_blocking=True), plan["q_starts"], plan["q_lens"], plan["ctx"], tables)
    return (torch.tensor(plan["ids"], dtype=torch.long).to(device), meta,
            torch.tensor(plan["rows"], dtype=torch.long).to(device))


def write_kv(cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor) -> None:
    """Store this step's K/V ([T, Hkv, D]) into their slots (overwrites: replay-safe).
    A negative slot writes nothing: the padding rows of a CUDA-graph batch use -1, so they
    never touch a block that a committed sequence owns (an index_put would wrap -1 around)."""
    _, nb, bs, h, d = cache.shape
    if cache.is_cuda and triton is not None and cache.is_contiguous():
        k, v = k.contiguous(), v.contiguous()
        n = h * d
        _store_kv_kernel[(k.shape[0],)](k, v, cache, slots, k.stride(0), v.stride(0), cache.stride(0),
                                        N=n, BLOCK=triton.next_power_of_2(n))
        return
    if slots.numel() and int(slots.min()) < 0:      # CPU only (the emulated graph path)
        keep = slots >= 0
        k, v, slots = k[keep], v[keep], slots[keep]
    cache[0].view(nb * bs, h, d)[slots] = k.to(cache.dtype)
    cache[1].view(nb * bs, h, d)[slots] = v.to(cache.dtype)


def attend(q: torch.Tensor, cache: torch.Tensor, meta: AttnMeta, scale: float) -> torch.Tensor:
    if q.is_cuda and triton is not None and cache.dtype != torch.float64:
        return attend_triton(q, cache, meta, scale)
    return attend_reference(q, cache, meta, scale)


def attend_reference(q: torch.Tensor, cache: torch.Tensor, meta: AttnMeta, scale: float) -> torch.Tensor:
    _, nb, bs, hkv, d = cache.shape
    hq = q.shape[1]
    out = torch.empty_like(q)
    for start, n, ctx, table in zip(meta.q_starts, meta.q_lens, meta.ctx_lens, meta.tables):
        blocks = torch.tensor(table[: -(-ctx // bs)], dtype=torch.long, device=q.device)
        k = cache[0][blocks].reshape(-1, hkv, d)[:ctx]
        v = cache[1][blocks].reshape(-1, hkv, d)[:ctx]
        if hq != hkv:
            k = k.repeat_interleave(hq // hkv, dim=1)
            v = v.repeat_interleave(hq // hkv, dim=1)
        qs = q[start:start + n]
        # query i sits at position ctx - n + i and sees keys 0..ctx - n + i
        qpos = torch.arange(ctx - n, ctx, device=q.device)[:, None]
        mask = torch.arange(ctx, device=q.device)[None, :] <= qpos
        o = F.scaled_dot_product_attention(qs.transpose(0, 1), k.transpose(0, 1).to(qs.dtype),
                                           v.transpose(0, 1).to(qs.dtype), attn_mask=mask, scale=scale)
        out[start:start + n] = o.transpose(0, 1)
    return out


if triton is not None:
    @triton.jit
    def _store_kv_kernel(K, V, C, SLOTS, sk_t, sv_t, sc_kv, N: tl.constexpr, BLOCK: tl.constexpr):
        # one program per token; the cache is contiguous, so a slot's [Hkv, D] row is N values
        t = tl.program_id(0)
        slot = tl.load(SLOTS + t).to(tl.int64)
        if slot >= 0:
            offs = tl.arange(0, BLOCK)
            m = offs < N
            k = tl.load(K + t * sk_t + offs, mask=m)
            v = tl.load(V + t * sv_t + offs, mask=m)
            tl.store(C + slot * N + offs, k.to(C.dtype.element_ty), mask=m)
            tl.store(C + sc_kv + slot * N + offs, v.to(C.dtype.element_ty), mask=m)

    @triton.jit
    def _paged_attn_kernel(Q, C, O, BT, TSEQ, TPOS, scale,
                           sq_t, sq_h, sc_kv, sc_b, sc_s, sc_h, so_t, so_h, s_bt,
                           G: tl.constexpr, GP: tl.constexpr, D: tl.constexpr, BS: tl.constexpr, IEEE: tl.constexpr):
        t = tl.program_id(0)
        kvh = tl.program_id(1)
        seq = tl.load(TSEQ + t)
        pos = tl.load(TPOS + t)
        g = tl.arange(0, GP)
        d = tl.arange(0, D)
        n = tl.arange(0, BS)
        gmask = g < G
        heads = kvh * G + g
        q = tl.load(Q + t * sq_t + heads[:, None] * sq_h + d[None, :], mask=gmask[:, None], other=0.0)
        m_i = tl.full([GP], float("-inf"), tl.float32)
        l_i = tl.zeros([GP], tl.float32)
        acc = tl.zeros([GP, D], tl.float32)
        n_blocks = pos // BS + 1
        for b in range(0, n_blocks):
            blk = tl.load(BT + seq * s_bt + b).to(tl.int64)
            off = blk * sc_b + n[:, None] * sc_s + kvh * sc_h + d[None, :]
            kpos = b * BS + n
            # slots past the query's position may hold anything (fresh memory, NaN patterns):
            # never load them, since 0 * NaN would poison the accumulator
            live = (kpos <= pos)[:, None]
            k = tl.load(C + off, mask=live, other=0.0)
            v = tl.load(C + sc_kv + off, mask=live, other=0.0)
            if IEEE:   # float32 caches: exact products, as the reference computes them
                s = tl.dot(q, tl.trans(k), input_precision="ieee") * scale
            else:
                s = tl.dot(q, tl.trans(k)).to(tl.float32) * scale
            s = tl.where(kpos[None, :] <= pos, s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            p = tl.exp(s - m_new[:, None])
            alpha = tl.exp(m_i - m_new)
            l_i = l_i * alpha + tl.sum(p, 1)
            if IEEE:
                acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
            else:
                acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v).to(tl.float32)
            m_i = m_new
        acc = acc / l_i[:, None]
        tl.store(O + t * so_t + heads[:, None] * so_h + d[None, :], acc.to(O.dtype.element_ty), mask=gmask[:, None])


def attend_triton(q: torch.Tensor, cache: torch.Tensor, meta: AttnMeta, scale: float) -> torch.Tensor:
    _, nb, bs, hkv, d = cache.shape
    T, hq, _ = q.shape
    g = hq // hkv
    if d & (d - 1) or d < 16 or bs < 16 or bs & (bs - 1):
        raise ValueError(f"the Triton path needs power-of-two head_dim and block_size >= 16, got {d}, {bs}")
    q = q.to(cache.dtype).contiguous()
    out = torch.empty_like(q)
    bt = meta.block_tables
    _paged_attn_kernel[(T, hkv)](
        q, cache, out, bt, meta.token_seq, meta.positions, scale,
        q.stride(0), q.stride(1), cache.stride(0), cache.stride(1), cache.stride(2), cache.stride(3),
        out.stride(0), out.stride(1), bt.stride(0),
        G=g, GP=max(16, triton.next_power_of_2(g)), D=d, BS=bs, IEEE=cache.dtype == torch.float32)
    return out
