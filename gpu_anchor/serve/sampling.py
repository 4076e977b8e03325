"""Token sampling on the device: greedy, temperature, min-p, top-k, top-p, with a counter-based RNG.

The uniform number that picks output token ``i`` of a request is a pure function of
``(seed, i)`` (``uniform``): an integer hash computed with tensor ops, so the CPU and the GPU
draw the same number, and a request's sampling state is (seed, #tokens generated): nothing
but the committed token count needs persisting, and a recomputed step draws what it drew
before the crash.

One step's work is a few batched kernels over ``[B, V]``, no per-row Python, no host sync
until the chosen ids are read:

- every row: ``argmax`` (greedy rows keep it; ties go to the lowest index);
- when some row samples: softmax of ``logits / T``; with ``min_p``, the tokens less likely than
  ``min_p`` x the row's most likely one dropped and the softmax taken again; for rows with
  top-k (and no top-p) one ``topk`` of the batch's largest k gives each row's k-th value, and
  the tokens above it plus
  the lowest-indexed ties make the k kept; top-p (with or without top-k) keeps what a stable
  sort (ties rank by index) keeps, the mass taken in probability order — on CUDA found without
  sorting, by bisections over the probabilities' values (``_top_p_mask_cuda``), elsewhere by
  that sort; then an
  inverse CDF over the kept probabilities *in vocabulary order*: the first token whose running
  sum passes ``u × kept mass``.  No full-vocabulary sort on CUDA.  Running sums
  are taken over probabilities in fixed point (``_fixed``), so they are exact: a float scan
  on CUDA is not even the same from one run to the next.

Each row is computed from its own logits and parameters only (every op is row-wise), so the
batch a request lands in does not change its draw.
"""
from __future__ import annotations

import torch

from .attention import to_device
from .sequence import SamplingParams

try:  # Triton ships with CUDA builds of torch; CPU-only installs may lack it.
    import triton
    import triton.language as tl
except Exception:  # pragma: no cover - depends on the install
    triton = None

_M32 = 0xFFFFFFFF
_K1, _K2 = 0x7FEB352D, 0x846CA68B      # lowbias32 (C. Wellons): a well-mixing 32-bit bijection
_C1, _C2 = 0x9E3779B9, 0x632BE5AB


# ------------------------------------------------------------------ the counter-based RNG
def _mul32(x, c: int):
    """``x * c mod 2**32`` for ``x`` in [0, 2**32) without overflowing int64 (the product is
    split at 16 bits): the same arithmetic for Python ints and int64 tensors."""
    return ((x & 0xFFFF) * c + (((x >> 16) * c) & 0xFFFF) * 65536) & _M32


def _mix(x):
    x = x ^ (x >> 16)
    x = _mul32(x, _K1)
    x = x ^ (x >> 15)
    x = _mul32(x, _K2)
    return x ^ (x >> 16)


def _hash(seed_lo, seed_hi, index):
    h = _mix((seed_lo + _C1) & _M32)
    h = _mix(h ^ seed_hi)
    h = _mix(h ^ index)
    return _mix((h + _C2) & _M32)


def _split(seed: int) -> tuple[int, int]:
    s = int(seed) & 0x7FFFFFFFFFFFFFFF
    return s & _M32, s >> 32


def uniform(seed: int, index: int) -> float:
    """The uniform number in [0, 1) that picks output token ``index`` of a request seeded
    ``seed``: 24 bits of a hash of (seed, index), exactly what ``sample`` draws on a device."""
    lo, hi = _split(seed)
    return (_hash(lo, hi, int(index) & _M32) >> 8) * 2.0 ** -24


def uniforms(seed_lo: torch.Tensor, seed_hi: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """``uniform`` for int64 tensors of seed halves and indices: float32 [B].  On CUDA one
    Triton launch (the tensor-op form is ~70 tiny kernels); elsewhere the tensor ops."""
    if seed_lo.is_cuda and triton is not None:
        out = torch.empty(seed_lo.shape, dtype=torch.float32, device=seed_lo.device)
        n = out.numel()
        # the kernel reads flat memory: the callers pass columns of one [B, 4] tensor (stride 4)
        seed_lo, seed_hi, index = seed_lo.contiguous(), seed_hi.contiguous(), index.contiguous()
        _uniform_kernel[(1,)](seed_lo, seed_hi, index, out, n, BLOCK=max(16, triton.next_power_of_2(n)))
        return out
    return (_hash(seed_lo, seed_hi, index & _M32) >> 8).to(torch.float32) * 2.0 ** -24


if triton is not None:
    @triton.jit
    def _mix_u32(x):
        x = x ^ (x >> 16)
        x = x * 0x7FEB352D
        x = x ^ (x >> 15)
        x = x * 0x846CA68B
        return x ^ (x >> 16)

    @triton.jit
    def _uniform_kernel(LO, HI, IDX, OUT, n, BLOCK: tl.constexpr):
        # the hash of ``_hash`` in uint32 arithmetic, which wraps mod 2**32 as ``_mul32`` does
        offs = tl.arange(0, BLOCK)
        m = offs < n
        lo = tl.load(LO + offs, mask=m, other=0).to(tl.uint32)
        hi = tl.load(HI + offs, mask=m, other=0).to(tl.uint32)
        ix = tl.load(IDX + offs, mask=m, other=0).to(tl.uint32)
        h = _mix_u32(lo + 0x9E3779B9)
        h = _mix_u32(h ^ hi)
        h = _mix_u32(h ^ ix)
        h = _mix_u32(h + 0x632BE5AB)
        tl.store(OUT + offs, (h >> 8).to(tl.float32) * (1.0 / 16777216.0), mask=m)

    @triton.jit
    def _draw_kernel(PROBS, KEEP, U24, OUT, V, stride, HAS_KEEP: tl.constexpr, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        base = PROBS + row * stride
        offs = tl.arange(0, BLOCK)
        total = tl.zeros([], dtype=tl.int64)
        for start in range(0, V, BLOCK):
            m = start + offs < V
            w = (tl.load(base + start + offs, mask=m, other=0.0) * 4294967296.0).to(tl.int64)
            if HAS_KEEP:
                w = tl.where(tl.load(KEEP + row * V + start + offs, mask=m, other=0) != 0, w, 0)
            total += tl.sum(w, 0)
        target = (tl.load(U24 + row) * total) >> 24
        seen = tl.zeros([], dtype=tl.int64)
        pick = V - 1
        for start in range(0, V, BLOCK):
            m = start + offs < V
            w = (tl.load(base + start + offs, mask=m, other=0.0) * 4294967296.0).to(tl.int64)
            if HAS_KEEP:
                w = tl.where(tl.load(KEEP + row * V + start + offs, mask=m, other=0) != 0, w, 0)
            run = seen + tl.cumsum(w, 0)
            pick = tl.minimum(pick, tl.min(tl.where((run > target) & m, start + offs, V - 1), 0))
            seen += tl.sum(w, 0)
        tl.store(OUT + row, pick.to(tl.int64))

    @triton.jit
    def _weight(x, m, COUNT: tl.constexpr):
        # what a token weighs in a prefix's running sum: its _fixed mass, or 1 (COUNT)
        if COUNT:
            return m.to(tl.int64)
        else:
            return (x * 4294967296.0).to(tl.int64)

    @triton.jit
    def _window_pass(base, V, lo, hi, mid, COUNT: tl.constexpr, BLOCK: tl.constexpr):
        # one bisection step over the row: the weight of its tokens of bits >= mid, and how many
        # of its tokens lie in [mid, hi] and in [lo, mid)
        offs = tl.arange(0, BLOCK)
        acc = tl.zeros([BLOCK], dtype=tl.int64)
        up = tl.zeros([BLOCK], dtype=tl.int32)
        dn = tl.zeros([BLOCK], dtype=tl.int32)
        for start in range(0, V, BLOCK):
            m = start + offs < V
            x = tl.load(base + start + offs, mask=m, other=0.0)
            b = x.to(tl.int32, bitcast=True)
            ge = (b >= mid) & m
            acc += tl.where(ge, _weight(x, m, COUNT), 0)
            up += (ge & (b <= hi)).to(tl.int32)
            dn += ((b >= lo) & (b < mid) & m).to(tl.int32)
        return tl.sum(acc, 0), tl.sum(up, 0), tl.sum(dn, 0)

    @triton.jit
    def _prefix(base, V, need, total, top, CAND, CIDX, row, COUNT: tl.constexpr, BLOCK: tl.constexpr):
        # The prefix of the order (bits descending, index ascending) kept while the weight
        # ranked before a token is below `need`, as (t, cut): kept = bits > t, or bits == t and
        # index < cut.  t, the largest bits whose tokens (bits >= t) weigh `need`, lies in
        # [lo, hi]: passes over the row halve that window until it holds one value or few
        # enough tokens for the registers.
        offs = tl.arange(0, BLOCK)
        everything = total < need               # the whole row weighs less: keep it all
        lo = tl.where(everything, -1, 0)
        hi = tl.where(everything, -1, top)
        n_in = V                                # tokens of bits in [lo, hi]
        while (lo < hi) & (n_in > BLOCK):
            mid = lo + (hi - lo + 1) // 2
            g, up, dn = _window_pass(base, V, lo, hi, mid, COUNT, BLOCK)
            if g >= need:
                lo = mid
                n_in = up
            else:
                hi = mid - 1
                n_in = dn
        # one more pass: the weight above the window, and (if it is still open) its tokens
        # gathered in vocabulary order, values and indices
        gather = lo < hi
        above = tl.zeros([BLOCK], dtype=tl.int64)
        seen = tl.zeros([], dtype=tl.int32)
        if lo >= 0:
            for start in range(0, V, BLOCK):
                m = start + offs < V
                x = tl.load(base + start + offs, mask=m, other=0.0)
                b = x.to(tl.int32, bitcast=True)
                above += tl.where((b > hi) & m, _weight(x, m, COUNT), 0)
                sel = (b >= lo) & (b <= hi) & m & gather
                pos = seen + tl.cumsum(sel.to(tl.int32), 0) - 1
                tl.store(CAND + row * BLOCK + pos, x, mask=sel)
                tl.store(CIDX + row * BLOCK + pos, start + offs, mask=sel)
                seen += tl.sum(sel.to(tl.int32), 0)
        weight_above = tl.sum(above, 0)
        tl.debug_barrier()                      # the gathered tokens, stored by other threads
        k = offs < seen
        cx = tl.load(CAND + row * BLOCK + offs, mask=k, other=0.0)
        cb = tl.where(k, cx.to(tl.int32, bitcast=True), -1)
        cw = _weight(cx, k, COUNT)
        while lo < hi:                          # the rest of the bisection, in registers
            mid = lo + (hi - lo + 1) // 2
            if weight_above + tl.sum(tl.where(cb >= mid, cw, 0), 0) >= need:
                lo = mid
            else:
                hi = mid - 1
        cut = V
        if lo >= 0:          # ties at lo: the first j of them, in vocabulary order
            if COUNT:
                w = tl.full([], 1, tl.int64)
            else:
                w = (lo.to(tl.float32, bitcast=True) * 4294967296.0).to(tl.int64)
            j = (need - weight_above - tl.sum(tl.where(cb > lo, cw, 0), 0) + w - 1) // w
            if gather:
                tie = cb == lo
                ci = tl.load(CIDX + row * BLOCK + offs, mask=k, other=0)
                cut = tl.min(tl.where(tie & (tl.cumsum(tie.to(tl.int64), 0) == j), ci + 1, V), 0)
            else:
                count = tl.zeros([], dtype=tl.int64)
                for start in range(0, V, BLOCK):
                    x = tl.load(base + start + offs, mask=start + offs < V, other=0.0)
                    tie = (x.to(tl.int32, bitcast=True) == lo) & (start + offs < V)
                    run = count + tl.cumsum(tie.to(tl.int64), 0)
                    cut = tl.minimum(cut, tl.min(tl.where(tie & (run == j), start + offs + 1, V), 0))
                    count += tl.sum(tie.to(tl.int64), 0)
        tl.debug_barrier()                      # CAND and CIDX are free for the next prefix
        return lo, cut

    @triton.jit
    def _top_p_kernel(PROBS, NEED, KNEED, KEEP, CAND, CIDX, V, stride, BLOCK: tl.constexpr):
        # One program per row; see ``_top_p_mask_cuda`` for what it computes and why.
        row = tl.program_id(0).to(tl.int64)
        base = PROBS + row * stride
        offs = tl.arange(0, BLOCK)
        acc = tl.zeros([BLOCK], dtype=tl.int64)
        top = tl.zeros([BLOCK], dtype=tl.int32)
        for start in range(0, V, BLOCK):
            x = tl.load(base + start + offs, mask=start + offs < V, other=0.0)
            acc += (x * 4294967296.0).to(tl.int64)
            top = tl.maximum(top, x.to(tl.int32, bitcast=True))
        tp, cp = _prefix(base, V, tl.load(NEED + row), tl.sum(acc, 0), tl.max(top, 0), CAND, CIDX, row, False, BLOCK)
        tk, ck = _prefix(base, V, tl.load(KNEED + row), V.to(tl.int64), tl.max(top, 0), CAND, CIDX, row, True, BLOCK)
        for start in range(0, V, BLOCK):
            m = start + offs < V
            i = start + offs
            b = tl.load(base + start + offs, mask=m, other=0.0).to(tl.int32, bitcast=True)
            keep = ((b > tp) | ((b == tp) & (i < cp))) & ((b > tk) | ((b == tk) & (i < ck)))
            tl.store(KEEP + row * V + i, keep, mask=m)


# ------------------------------------------------------------------ sampling
def sample(logits: torch.Tensor, params: list[SamplingParams], indices: list[int]) -> list[int]:
    """``logits`` [B, V]; ``indices[b]`` is the output index the row's token will take."""
    return sample_ids(logits, params, indices).tolist()


def sample_ids(logits: torch.Tensor, params: list[SamplingParams], indices: list[int]) -> torch.Tensor:
    """``sample`` without the host copy: the chosen ids as an int64 tensor [B] on the device."""
    greedy = logits.argmax(dim=-1)
    if all(p.greedy for p in params):
        return greedy
    dev, (B, V) = logits.device, logits.shape
    # one host -> device copy of the rows' parameters: (temperature, top_p, min_p) and (top_k, seed halves, index)
    fl = torch.tensor([(p.temperature, p.top_p, p.min_p) for p in params], dtype=torch.float32)
    it = torch.tensor([(p.top_k if 0 < p.top_k < V else V, *_split(p.seed or 0), i)
                       for p, i in zip(params, indices)], dtype=torch.long)
    fl, it = to_device(fl, dev), to_device(it, dev)
    sampled, top_p = fl[:, 0] > 0, fl[:, 1]
    top_k = it[:, 0]
    x = logits.float() / torch.where(sampled, fl[:, 0], 1.0)[:, None]     # greedy rows: any finite scale
    probs = torch.softmax(x, dim=-1)
    if any(p.min_p > 0 and not p.greedy for p in params):
        # vLLM's min-p, before top-k and top-p, which then see the distribution it leaves
        x = x.masked_fill(probs < fl[:, 2:3] * probs.amax(dim=-1, keepdim=True), float("-inf"))
        probs = torch.softmax(x, dim=-1)
    keep = None
    kmax = max((p.top_k for p in params if 0 < p.top_k < V and p.top_p >= 1.0), default=0)
    if kmax:
        keep = _top_k_mask(x, top_k, kmax)
        if kmax < V:
            keep |= (top_k >= V)[:, None] | (top_p < 1.0)[:, None]    # rows without top-k, or sorted below
    p_rows = [b for b, p in enumerate(params) if not p.greedy and p.top_p < 1.0]
    if p_rows and probs.is_cuda and triton is not None:
        mask = _top_p_mask_cuda(probs, torch.where(top_p < 1.0, top_k, V), top_p)
        keep = mask if keep is None else keep & mask
    elif p_rows:
        keep = torch.ones(B, V, dtype=torch.bool, device=dev) if keep is None else keep
        rows = to_device(torch.tensor(p_rows, dtype=torch.long), dev)
        keep[rows] = _top_p_mask(probs[rows], top_k[rows], top_p[rows])
    u24 = (uniforms(it[:, 1], it[:, 2], it[:, 3]) * float(1 << 24)).to(torch.int64)
    draw = _draw_cuda if probs.is_cuda and triton is not None else _draw
    return torch.where(sampled, draw(probs, keep, u24), greedy)


def _draw(probs: torch.Tensor, keep: torch.Tensor | None, u24: torch.Tensor) -> torch.Tensor:
    """Per row, the inverse CDF of the kept probabilities in vocabulary order at ``u24 / 2**24``:
    the first token whose running sum (fixed point) passes ``u24 × kept mass >> 24``."""
    w = _fixed(probs)
    if keep is not None:
        w = torch.where(keep, w, torch.zeros((), device=w.device, dtype=w.dtype))
    cdf = torch.cumsum(w, dim=-1)                 # integers: exact, whatever order the scan adds in
    total = cdf[:, -1:]
    target = (u24[:, None] * total) >> 24         # in [0, total): the first entry past it has weight > 0
    return torch.searchsorted(cdf, target, right=True).squeeze(1).clamp_(max=probs.shape[-1] - 1)


def _draw_cuda(probs: torch.Tensor, keep: torch.Tensor | None, u24: torch.Tensor) -> torch.Tensor:
    """``_draw`` in one kernel (one program a row, two passes over it): the same integers, so the
    same ids, without the [B, V] int64 weights and running sums in memory."""
    B, V = probs.shape
    probs = probs.float().contiguous()
    out = torch.empty(B, dtype=torch.int64, device=probs.device)
    _draw_kernel[(B,)](probs, probs if keep is None else keep, u24.contiguous(), out, V, probs.stride(0),
                       HAS_KEEP=keep is not None, BLOCK=DRAW_LAUNCH[0], num_warps=DRAW_LAUNCH[1])
    return out


FIXED_BITS = 32
# (elements a program takes per load, warps a program): one program a row, every pass from L2
TOP_P_LAUNCH = (8192, 16)
DRAW_LAUNCH = (16384, 16)


def _fixed(p: torch.Tensor) -> torch.Tensor:
    """Probabilities as int64 multiples of 2**-32 (scaling a float32 by a power of two and
    truncating are exact).  Running sums are then integer sums: exact in any order, so the
    inverse CDF and top-p do not depend on how a scan kernel splits a row (CUDA's single-row
    cumsum adds floats in an order that varies from run to run).  A token of probability
    below 2**-32 is never drawn."""
    return (p.float() * float(1 << FIXED_BITS)).to(torch.int64)


def _top_k_mask(x: torch.Tensor, k: torch.Tensor, kmax: int) -> torch.Tensor:
    """Per row, the ``k[b]`` largest entries of ``x`` (ties: the lowest indices), as a mask."""
    vals = torch.topk(x, kmax, dim=-1, sorted=True).values
    kth = vals.gather(1, (k.clamp(max=kmax) - 1)[:, None])
    above = x > kth
    tied = x == kth
    room = k[:, None] - above.sum(-1, keepdim=True)
    return above | (tied & (torch.cumsum(tied, dim=-1) <= room))


def _top_p_mask(probs: torch.Tensor, k: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """Top-k and top-p of the (full) distribution by a stable sort: a token is kept when fewer
    than ``k`` tokens rank before it and the mass ranked before it is below ``p`` (the most
    likely token always).  Returned in vocabulary order."""
    sp, si = torch.sort(probs, dim=-1, descending=True, stable=True)
    rank = torch.arange(probs.shape[-1], device=probs.device)[None, :]
    ws = _fixed(sp)
    before = torch.cumsum(ws, dim=-1) - ws
    keep = (rank < k[:, None]) & ((before < _fixed(p)[:, None]) | (rank == 0))
    return torch.zeros_like(keep).scatter_(1, si, keep)


def _top_p_mask_cuda(probs: torch.Tensor, k: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """``_top_p_mask`` for every row at once, without sorting (CUDA, Triton): the same mask,
    bit for bit.  Rows with ``p >= 1`` keep everything, and their ``k`` must be ``V``.

    The sorted definition keeps a prefix of the order (probability descending, index
    ascending): the tokens ranked before the first one whose preceding mass reaches ``p``, and
    the first ``k``.  Each prefix is found by value: ``t``, the largest float32 bit pattern
    (bits order non-negative floats as their values) whose tokens of bits ``>= t`` hold at least
    ``p``'s mass (in fixed point), or number ``k``, by bisection — passes over the row halve a
    window of bits around ``t`` until it holds one value or at most a block of tokens, which one
    more pass gathers (in vocabulary order) for the rest of the bisection in registers.  Every
    token above ``t`` is kept, and of the tokens equal to ``t`` (all of weight ``w``: their mass,
    or 1) the first ``ceil((need - weight above t) / w)`` in vocabulary order.  Integer sums, so
    no order of addition changes it; the intersection of the two prefixes is the shorter one."""
    B, V = probs.shape
    probs = probs.float().contiguous()
    need = torch.where(p < 1.0, _fixed(p).clamp(min=1), torch.full_like(_fixed(p), 1 << 62))
    kneed = torch.where(k < V, k, V + 1).to(torch.int64)      # V + 1 tokens never weigh: keep them all
    keep = torch.empty(B, V, dtype=torch.bool, device=probs.device)
    block, warps = TOP_P_LAUNCH
    cand = torch.empty(B, block, dtype=torch.float32, device=probs.device)
    cidx = torch.empty(B, block, dtype=torch.int32, device=probs.device)
    _top_p_kernel[(B,)](probs, need, kneed, keep, cand, cidx, V, probs.stride(0), BLOCK=block, num_warps=warps)
    return keep


def token_logprobs(logits: torch.Tensor, chosen: list[int], ks: list[int],
                   ranks: bool = False) -> list[tuple]:
    """Log-probabilities of the model's distribution (the raw logits, before temperature,
    top-k and top-p, as vLLM reports them by default): for each row ``b`` the chosen token's
    and the ``ks[b]`` most likely tokens' ``[[id, logprob], ...]``, most likely first; with
    ``ranks``, a third entry: the chosen token's rank, vLLM's (1 + how many other tokens are at
    least as likely)."""
    lp = torch.log_softmax(logits.float(), dim=-1)
    at = lp.gather(1, torch.tensor(chosen, device=lp.device)[:, None])
    picked = at.squeeze(1).tolist()
    rank = (lp >= at).sum(1).tolist() if ranks else None
    k = max(ks)
    if k == 0:
        tops = [[] for _ in picked]
    else:
        vals, ids = lp.topk(k, dim=-1)
        vals, ids = vals.tolist(), ids.tolist()
        tops = [[[i, v] for i, v in zip(ids[b][:ks[b]], vals[b][:ks[b]])] for b in range(len(picked))]
    if ranks:
        return list(zip(picked, tops, rank))
    return list(zip(picked, tops))
