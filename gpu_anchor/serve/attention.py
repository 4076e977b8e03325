"""Attention over the paged KV cache.

Cache layout, per layer: one tensor ``[2, num_blocks, block_size, num_kv_heads, head_dim]``
(K then V).  Token ``p`` of a sequence lives in slot ``block_table[p // bs] * bs + p % bs``.

Two paths with one contract — ``attend(q, cache, meta) -> [T, num_heads, head_dim]``
where query token ``t`` (absolute position ``meta.positions[t]`` of sequence
``meta.token_seq[t]``) attends causally to keys ``0..positions[t]`` of its sequence:

- CUDA: split-KV Triton kernels ("flash-decoding").  A token's keys are cut into chunks of
  ``CHUNK`` tokens and its chunks into ``n = min(ceil(keys / SPLIT_KEYS), MAX_SPLITS)``
  splits (split s takes chunks s, s + n, ...).  Each split's partial softmax is computed by
  one program, which loads each chunk's K and V as whole ``CHUNK × head_dim`` tiles (gathered
  through the block table) and scores the whole GQA group with ``tl.dot``; the last of a
  (token, KV head)'s programs to finish merges the partials in one fixed order
  (``MERGE_IN_SPLIT``; else a second kernel does).  The split size is fixed, so a token's output depends only on its own context;
  how many programs share a token's splits is sized to the launch (about ``PROGRAMS``), which
  moves work between programs without changing a bit.  One sequence of 4 096 tokens is 16
  splits × 8 KV heads = 128 programs instead of 32 (``bench decode_attention``).
- CPU (and the reference for tests): per sequence, gather its blocks and run SDPA.

CUDA-graph capture (``cuda_graphs.py``): both kernels' grids depend only on the number of
query tokens (fixed per captured batch size), the KV head count and the block table's width
(fixed: it bounds a token's splits); everything per step (positions, slots, block tables) is
read from device buffers, so a captured launch stays valid for every step of that batch size.
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
    lora: torch.Tensor | None = None   # [T] int64: each token's LoRA adapter slot, -1 for none (lora.py)


def to_device(t: torch.Tensor, device) -> torch.Tensor:
    """A host tensor of a step's inputs on ``device``, by a copy that never waits for the stream
    (pinned on CUDA: a step launched ahead is enqueued while the one before still runs)."""
    device = torch.device(device)
    if device.type != "cuda":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)


def step_inputs(plan: dict, device) -> tuple[torch.Tensor, AttnMeta, torch.Tensor]:
    """The tensors of an eager step — token ids, attention metadata, rows to sample — from
    its plan: host lists ``ids``, ``pos``, ``slots``, ``tseq`` (per token), ``q_starts``,
    ``q_lens``, ``ctx``, ``tables`` (per sequence), ``rows``, and ``lora`` (per token, when the
    engine serves adapters).  Rank 0 builds the plan; every
    rank of a tensor-parallel group builds the same tensors from it."""
    tables = plan["tables"]
    width = max(len(t) for t in tables)
    bt = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)
    meta = AttnMeta(to_device(torch.tensor(plan["pos"], dtype=torch.long), device),
                    to_device(torch.tensor(plan["slots"], dtype=torch.long), device),
                    to_device(torch.tensor(plan["tseq"], dtype=torch.int32), device),
                    to_device(bt, device), plan["q_starts"], plan["q_lens"], plan["ctx"], tables)
    if plan.get("lora") is not None:
        meta.lora = to_device(torch.tensor(plan["lora"], dtype=torch.long), device)
    return (to_device(torch.tensor(plan["ids"], dtype=torch.long), device), meta,
            to_device(torch.tensor(plan["rows"], dtype=torch.long), device))


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
    def _split_kv_kernel(Q, C, MO, ML, BT, TSEQ, TPOS, scale, O, SEM,
                         sq_t, sq_h, sc_kv, sc_b, sc_s, sc_h, s_bt, so_t, so_h,
                         G: tl.constexpr, GP: tl.constexpr, D: tl.constexpr, BS: tl.constexpr,
                         CHUNK: tl.constexpr, SC: tl.constexpr, MAXS: tl.constexpr, CAPPED: tl.constexpr,
                         TILE: tl.constexpr, IEEE: tl.constexpr, MERGE: tl.constexpr):
        # program (t, kvh, p) of P: query token t, the GQA group of KV head kvh, the token's
        # splits p, p + P, ... of its n = min(ceil(chunks / SC), MAXS) (split s: chunks s, s + n,
        # ... of CHUNK keys, so the splits differ by one chunk at most); writes each split's
        # unnormalised partial (acc, max, sum) at row [token, head] * MAXS + split (MAXS =
        # MAX_SPLITS rows a head).  A token has at most its table's splits, so only a table wider
        # than MAXS splits (CAPPED) needs the minimum; without it the kernel compiles to 80
        # registers instead of 94-96 (sm_90, Triton 3.6), and 60621e2's kernel, which had no
        # minimum, was 5-9 % faster from 128 x 320 to 128 x 1 024 tokens x context on the
        # H200 than the same with it (decode_attention_capped_*.json).  MERGE: the last of the
        # group's live programs to finish (a counter in SEM) merges the token's partials into O
        # and sets the counter back to 0; else ``_combine_kernel`` merges them
        t = tl.program_id(0)
        kvh = tl.program_id(1)
        first = tl.program_id(2)
        n_prog = tl.num_programs(2)
        seq = tl.load(TSEQ + t)
        pos = tl.load(TPOS + t)
        n_chunks = pos // CHUNK + 1
        n_splits = (n_chunks + SC - 1) // SC
        if CAPPED:
            n_splits = tl.minimum(n_splits, MAXS)
        if first < n_splits:
            g = tl.arange(0, GP)
            d = tl.arange(0, D)
            j = tl.arange(0, CHUNK)
            gmask = g < G
            heads = kvh * G + g
            base = t * (G * tl.num_programs(1)) + heads          # [T, Hq] row of the partials
            q = tl.load(Q + t * sq_t + heads[:, None] * sq_h + d[None, :], mask=gmask[:, None], other=0.0)
            for sp in range(first, n_splits, n_prog):
                m_i = tl.full([GP], float("-inf"), tl.float32)
                l_i = tl.zeros([GP], tl.float32)
                acc = tl.zeros([GP, D], tl.float32)
                for c in range(sp, n_chunks, n_splits):
                    kpos = c * CHUNK + j
                    # slots past the query's position may hold anything (fresh memory, NaN
                    # patterns): never load them (0 * NaN would poison the accumulator), nor
                    # their table entries
                    live = kpos <= pos
                    blk = tl.load(BT + seq * s_bt + kpos // BS, mask=live, other=0).to(tl.int64)
                    off = blk[:, None] * sc_b + (kpos % BS)[:, None] * sc_s + kvh * sc_h + d[None, :]
                    k = tl.load(C + off, mask=live[:, None], other=0.0)
                    v = tl.load(C + sc_kv + off, mask=live[:, None], other=0.0)
                    if IEEE:   # float32 caches: exact products, as the reference computes them
                        sc = tl.dot(q, tl.trans(k), input_precision="ieee") * scale
                    else:
                        sc = tl.dot(q, tl.trans(k)).to(tl.float32) * scale
                    sc = tl.where(live[None, :], sc, float("-inf"))
                    m_new = tl.maximum(m_i, tl.max(sc, 1))
                    p = tl.exp(sc - m_new[:, None])
                    alpha = tl.exp(m_i - m_new)
                    l_i = l_i * alpha + tl.sum(p, 1)
                    if IEEE:
                        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
                    else:
                        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v).to(tl.float32)
                    m_i = m_new
                row = base * MAXS + sp
                tl.store(MO + row[:, None] * D + d[None, :], acc, mask=gmask[:, None])
                tl.store(ML + row * 2, m_i, mask=gmask)
                tl.store(ML + row * 2 + 1, l_i, mask=gmask)
            if MERGE:
                # every thread's partials stored before the count (barrier), the count a release at
                # GPU scope; the merging program's acquire makes all partials visible to it, and it
                # reads them from L2 (.cg), never from a stale L1 line
                tl.debug_barrier()
                sem = SEM + t * tl.num_programs(1) + kvh
                if tl.atomic_add(sem, 1, sem="acq_rel", scope="gpu") == tl.minimum(n_splits, n_prog) - 1:
                    tl.debug_barrier()
                    _merge_group(MO, ML, O, base, n_splits, heads, gmask, t, so_t, so_h, GP, D, MAXS, TILE)
                    tl.store(sem, 0)

    @triton.jit
    def _merge_group(MO, ML, O, base, n_splits, heads, gmask, t, so_t, so_h,
                     GP: tl.constexpr, D: tl.constexpr, MAXS: tl.constexpr, TILE: tl.constexpr):
        # the group's partials merged over the token's splits in one fixed order — TILE splits at
        # a time, tile after tile — that depends only on the number of splits
        d = tl.arange(0, D)
        s = tl.arange(0, TILE)
        m_run = tl.full([GP], float("-inf"), tl.float32)
        l_run = tl.zeros([GP], tl.float32)
        acc_run = tl.zeros([GP, D], tl.float32)
        for s0 in range(0, n_splits, TILE):
            rows = base[:, None] * MAXS + (s0 + s)[None, :]                      # [GP, TILE]
            live = gmask[:, None] & (s0 + s < n_splits)[None, :]
            m = tl.load(ML + rows * 2, mask=live, other=float("-inf"), cache_modifier=".cg")
            ls = tl.load(ML + rows * 2 + 1, mask=live, other=0.0, cache_modifier=".cg")
            acc = tl.load(MO + rows[:, :, None] * D + d[None, None, :], mask=live[:, :, None], other=0.0,
                          cache_modifier=".cg")
            mx = tl.maximum(m_run, tl.max(m, 1))
            w = tl.where(live, tl.exp(m - mx[:, None]), 0.0)
            a = tl.exp(m_run - mx)
            acc_run = acc_run * a[:, None] + tl.sum(acc * w[:, :, None], 1)
            l_run = l_run * a + tl.sum(ls * w, 1)
            m_run = mx
        out = acc_run / l_run[:, None]
        tl.store(O + t * so_t + heads[:, None] * so_h + d[None, :], out.to(O.dtype.element_ty), mask=gmask[:, None])

    @triton.jit
    def _combine_kernel(MO, ML, O, TPOS, so_t, so_h, G: tl.constexpr, GP: tl.constexpr, D: tl.constexpr,
                        CHUNK: tl.constexpr, SC: tl.constexpr, MAXS: tl.constexpr, CAPPED: tl.constexpr,
                        TILE: tl.constexpr):
        # program (t, kvh): the merge the split kernel's last program does, in a launch of its own
        t = tl.program_id(0)
        kvh = tl.program_id(1)
        pos = tl.load(TPOS + t)
        n_splits = (pos // CHUNK + SC) // SC
        if CAPPED:
            n_splits = tl.minimum(n_splits, MAXS)
        g = tl.arange(0, GP)
        heads = kvh * G + g
        _merge_group(MO, ML, O, t * (G * tl.num_programs(1)) + heads, n_splits, heads, g < G, t, so_t, so_h,
                     GP, D, MAXS, TILE)


# Split-KV ("flash-decoding") constants.  A token's keys are cut into chunks of CHUNK (one
# program's tile: K and V loaded whole, CHUNK × head_dim each) and its chunks into one split per
# SPLIT_KEYS keys, at most MAX_SPLITS (longer contexts make longer splits); each split's partial
# softmax is kept and the partials are merged in one fixed order.  All of it is a function of
# the token's own context, never of the batch: a token's result is the same whatever else is in
# the step.  How many programs share a token's splits is free — it changes who computes a
# partial, not its bits — so a launch takes about PROGRAMS programs, at most one per split.
# Token slices bound the partials' memory (tokens × heads × MAX_SPLITS × head_dim float32) to
# PARTIALS_BYTES for long prefill steps (256 tokens of Qwen3-8B's 32 heads: 68 MB).
# Measured on the H200 (Qwen3-8B's heads, 36 layers in a CUDA graph, ``bench decode_attention``,
# decode_attention_splits4.json and decode_attention_sweep_split_keys.json): the earlier 4
# splits per token took 2.21 ms at 1 × 4 096 tokens × context (32 programs for the GPU's 132
# SMs), these 0.69 ms; 128 keys per split was up to 1.17x slower from 4 to 16 tokens, 512 up to
# 1.6x from 1 to 16; a target of 1 024 programs 1.10-1.16x slower at 128 × 320, 64 × 1 024 and
# 128 × 1 024 than 2 048, 4 096 or 8 192, which tied there; 4 096 was 5 % faster than 2 048 at
# 128 × 1 024 with tables as wide as the context and with 32 768-key tables, the same elsewhere
# (decode_attention_capped_*.json, decode_attention_sweep_wide.json).  Earlier sweep: chunk {32, 64, 128} ×
# warps {2, 4, 8} × stages {1, 2}: 32, 4 warps, 2 stages.
CHUNK = 32
SPLIT_KEYS = 256
MAX_SPLITS = 16
PROGRAMS = 4096
MERGE_TILE = 4
WARPS, STAGES = 4, 2
# The split kernel's registers a thread when no cap is compiled in: ptxas gives it 80 (sm_90,
# Triton 3.6), which lets 6 programs of 4 warps share an SM; at 64 it is 8 (the register file is
# 64 K), so a 64 x 320 launch's 1 024 programs fit the H200's 132 SMs in one wave instead of two.
# The 8 values it spills live outside the loop over a split's chunks.  H200, alternating in one
# call: 1.08 against 1.17 ms at 64 x 320, 2-3.5 % faster from 128 x 320 to 128 x 1 024, 1-3 %
# slower at 16 x 1 024 (decode_attention_regs_*.json).  The capped variant (94 registers) would
# spill 20 and was not measured so: it keeps ptxas's count.
REGISTERS = 64
TOKEN_SLICE = 256
PARTIALS_BYTES = 128 << 20
# The merge of a group's partials runs in the split kernel's last program (a counter per token
# and KV head) instead of a second launch per layer: the same reduction, one launch fewer.
MERGE_IN_SPLIT = True
_COUNTERS: dict = {}


def launch_shape(tokens: int, kv_heads: int, max_keys: int, heads: int, head_dim: int) -> tuple[int, int, int]:
    """``(token_slice, programs per (token, KV head), max splits)`` of a launch over block tables
    of ``max_keys`` keys: the partials of a slice (``MAX_SPLITS`` rows a head whatever the
    table's width, so that no kernel is compiled per width) fit in ``PARTIALS_BYTES``; the
    programs are about ``PROGRAMS`` in all, one per split at most.  A function of the shapes
    only (a CUDA graph's launch stays valid)."""
    max_splits = min(-(-max_keys // SPLIT_KEYS), MAX_SPLITS)
    per_token = heads * MAX_SPLITS * (head_dim + 2) * 4
    n = max(1, min(tokens, TOKEN_SLICE, PARTIALS_BYTES // per_token))
    return n, max(1, min(max_splits, -(-PROGRAMS // (n * kv_heads)))), max_splits


def _merge_counters(device: torch.device, hkv: int) -> torch.Tensor:
    """The split kernel's per-(token, KV head) counters: zero between launches (the merging
    program sets its counter back), one set per device and stream, since two streams' launches
    could overlap; made on the warm-up before a CUDA graph captures them, never freed.  A
    graph's launches use its capture stream's set wherever it is replayed, so the graphs of one
    capture stream must not be replayed at once on two streams (the engine runs every step,
    eager or replayed, on its one stream)."""
    stream = torch.cuda.current_stream(device).cuda_stream if device.type == "cuda" else 0
    key = (device, stream, hkv)
    c = _COUNTERS.get(key)
    if c is None:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError("attention's merge counters are made on a stream's first launch, which must not "
                               "be inside a CUDA-graph capture: run the step once on the capture stream first")
        c = _COUNTERS[key] = torch.zeros(TOKEN_SLICE * hkv, dtype=torch.int32, device=device)
    return c


def attend_triton(q: torch.Tensor, cache: torch.Tensor, meta: AttnMeta, scale: float) -> torch.Tensor:
    _, nb, bs, hkv, d = cache.shape
    T, hq, _ = q.shape
    g = hq // hkv
    if d & (d - 1) or d < 16 or bs & (bs - 1):
        raise ValueError(f"the Triton path needs a power-of-two head_dim >= 16 and block_size, got {d}, {bs}")
    if SPLIT_KEYS % CHUNK or CHUNK & (CHUNK - 1) or MERGE_TILE & (MERGE_TILE - 1):
        raise ValueError(f"attention's constants: SPLIT_KEYS a multiple of CHUNK, CHUNK and MERGE_TILE powers "
                         f"of two, got {SPLIT_KEYS}, {CHUNK}, {MERGE_TILE}")
    q = q.to(cache.dtype)
    if q.stride(2) != 1 or q.stride(1) != d:    # a token's heads may sit in a wider row (packed qkv)
        q = q.contiguous()
    out = torch.empty(T, hq, d, dtype=q.dtype, device=q.device)
    bt = meta.block_tables
    n, programs, max_splits = launch_shape(T, hkv, bt.shape[1] * bs, hq, d)
    mo = torch.empty(n, hq, MAX_SPLITS, d, dtype=torch.float32, device=q.device)
    ml = torch.empty(n, hq, MAX_SPLITS, 2, dtype=torch.float32, device=q.device)
    sem = _merge_counters(q.device, hkv) if MERGE_IN_SPLIT else mo
    consts = dict(G=g, GP=max(16, triton.next_power_of_2(g)), D=d, CHUNK=CHUNK, SC=SPLIT_KEYS // CHUNK,
                  MAXS=MAX_SPLITS, CAPPED=-(-bt.shape[1] * bs // SPLIT_KEYS) > MAX_SPLITS, TILE=MERGE_TILE)
    # an NVIDIA-only launch option (ROCm's Triton refuses the keyword)
    regs = {} if consts["CAPPED"] or torch.version.hip else {"maxnreg": REGISTERS}
    for lo in range(0, T, n):     # one slice for every decode step of up to TOKEN_SLICE sequences
        hi = min(T, lo + n)
        tseq, tpos = meta.token_seq[lo:hi], meta.positions[lo:hi]
        o = out[lo:hi]
        _split_kv_kernel[(hi - lo, hkv, programs)](
            q[lo:hi], cache, mo, ml, bt, tseq, tpos, scale, o, sem,
            q.stride(0), q.stride(1), cache.stride(0), cache.stride(1), cache.stride(2), cache.stride(3),
            bt.stride(0), o.stride(0), o.stride(1), BS=bs, IEEE=cache.dtype == torch.float32,
            MERGE=MERGE_IN_SPLIT, num_warps=WARPS, num_stages=STAGES, **regs, **consts)
        if not MERGE_IN_SPLIT:
            _combine_kernel[(hi - lo, hkv)](mo, ml, o, tpos, o.stride(0), o.stride(1), **consts)
    return out
