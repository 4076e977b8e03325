"""The Triton kernel of ``fused_adam`` (imported only when Triton is; see that module's contract).

A persistent grid: program ``r`` of ``G`` takes blocks ``r, r + G, r + 2G, ...`` of the launch's
block table, one after the other, and owns two ring slots, ``2r`` and ``2r + 1`` (``RS``
elements each from ``ring``), which its blocks use in turn.  Per block of ``VEC`` elements:

1. load ``p, g, m, v (, x)``; store ``p, m, v (, x)`` into the block's ring slot; compute the new
   values in registers (the fence below waits for the ring stores only after the arithmetic);
2. barrier, the block's tag ← ``started`` (naming the ring slot; release/acquire at GPU scope),
   barrier;
3. store the new values in place.

One fence a block: the program's next started tag (its release covers this block's in-place
stores) is what says this block is done, and the block after that — the first to overwrite
this block's ring slot — stores nothing before that tag has landed.  After its last block a
program tags that one ``finished`` (release).  The ring is ``2G`` slots, about 13 MB, so that its
stores can be overwritten in L2 instead of costing memory bandwidth; ``HINTS`` asks L2 to keep
them (``evict_last``) and to let the streamed tensors go first (``evict_first``): without the
hints the ring's stores reach memory (docs/training.md, "L2 hints").

Every arithmetic step mirrors one op of torch's ``_multi_tensor_adam`` (named beside it);
``enable_fp_fusion=False`` at launch keeps Triton from contracting anything itself, so the only
fmas are the explicit ones chosen by ``FMA``.  ``FAULT`` (tests only; compiled out otherwise):
blocks ``>= stop`` are not finished — each program's first such block is saved and tagged
started, then written with NaN in place of its new values (what a kill mid-store leaves), and
the program stops there (no finished tag).
"""
import triton
import triton.language as tl

_COLS = tl.constexpr(6)      # table row: p, g, exp_avg, exp_avg_sq, max_exp_avg_sq, numel


@triton.jit
def _rnd(x, T: tl.constexpr):
    # torch stores every foreach op's result in the tensor dtype: round there (RNE)
    return x.to(T).to(tl.float32)


@triton.jit
def _madd(a, b, c, FMA: tl.constexpr):
    # c + a * b as nvcc compiles it: contracted to one fma, or rounded product then add
    if FMA:
        return tl.fma(a, b, c)
    else:
        return c + a * b


@triton.jit
def _new_values(p0, g0, m0, v0, x0, decay, wd, w1, omw1, beta2, omb2, step_size, bc2_sqrt, eps,
                T: tl.constexpr, AMSGRAD: tl.constexpr, MAXIMIZE: tl.constexpr, WD: tl.constexpr,
                LERP_SMALL: tl.constexpr, FMA: tl.constexpr):
    p = p0.to(tl.float32)
    g = g0.to(tl.float32)
    m = m0.to(tl.float32)
    v = v0.to(tl.float32)
    if MAXIMIZE:
        g = -g
    if WD == 1:        # AdamW: p.mul_(1 - lr * wd)
        p = _rnd(p * decay, T)
    elif WD == 2:      # Adam: grad = grad + wd * p (a new tensor of the grad's dtype)
        g = _rnd(_madd(wd, p, g, FMA), T)
    d = g - m          # exp_avg.lerp_(grad, 1 - beta1), torch's two-branch lerp
    if LERP_SMALL:
        m = _rnd(_madd(w1, d, m, FMA), T)
    else:
        m = _rnd(_madd(-d, omw1, g, FMA), T)
    v = _rnd(v * beta2, T)                        # exp_avg_sq.mul_(beta2)
    v = _rnd(_madd(omb2, g * g, v, FMA), T)       # .addcmul_(grad, grad, 1 - beta2)
    den = v
    x = v
    if AMSGRAD:
        x = x0.to(tl.float32)
        x = tl.where(x != x, x, tl.where(v != v, v, tl.where(v > x, v, x)))   # maximum, NaN wins
        den = x
    den = _rnd(tl.sqrt_rn(den), T)                # _foreach_sqrt -> a tensor of the dtype
    den = _rnd(tl.div_rn(den, bc2_sqrt), T)      # .div_(bias_correction2_sqrt)
    den = _rnd(den + eps, T)                      # .add_(eps)
    p = _madd(step_size, tl.div_rn(m, den), p, FMA)   # p.addcdiv_(exp_avg, den, -lr / bc1)
    return p, m, v, x


@triton.jit
def _tag(tags, tag_idx, value):
    # One thread publishes (release: the CTA's stores, ordered before it by the barrier, land
    # first); acquire + barrier: none of the CTA's later stores is issued before it has landed.
    tl.debug_barrier()
    tl.atomic_xchg(tags + tag_idx, value, sem="acq_rel", scope="gpu")
    tl.debug_barrier()


@triton.jit
def _block(base, start, n, slot, tags, tag_idx, started, decay, wd, w1, omw1, beta2, omb2, step_size,
           bc2_sqrt, eps, T: tl.constexpr, AMSGRAD: tl.constexpr, MAXIMIZE: tl.constexpr, WD: tl.constexpr,
           LERP_SMALL: tl.constexpr, FMA: tl.constexpr, MASKED: tl.constexpr, VEC: tl.constexpr, HINTS: tl.constexpr,
           HALTED):
    pp = tl.multiple_of(tl.load(base + 0).to(tl.pointer_type(T)), 16)
    gp = tl.multiple_of(tl.load(base + 1).to(tl.pointer_type(T)), 16)
    mp = tl.multiple_of(tl.load(base + 2).to(tl.pointer_type(T)), 16)
    vp = tl.multiple_of(tl.load(base + 3).to(tl.pointer_type(T)), 16)
    ar = tl.arange(0, VEC)
    offs = start + ar
    mask = None
    if MASKED:
        mask = offs < n
    # HINTS: the streamed tensors leave L2 first, the ring's slots last (they are rewritten
    # every other block, so their stores are meant to be overwritten in L2, not written back)
    STREAM: tl.constexpr = "evict_first" if HINTS else ""
    KEEP: tl.constexpr = "evict_last" if HINTS else ""
    p0 = tl.load(pp + offs, mask=mask, eviction_policy=STREAM)
    g0 = tl.load(gp + offs, mask=mask, eviction_policy=STREAM)
    m0 = tl.load(mp + offs, mask=mask, eviction_policy=STREAM)
    v0 = tl.load(vp + offs, mask=mask, eviction_policy=STREAM)
    tl.store(slot + ar, p0, mask=mask, eviction_policy=KEEP)
    tl.store(slot + VEC + ar, m0, mask=mask, eviction_policy=KEEP)
    tl.store(slot + 2 * VEC + ar, v0, mask=mask, eviction_policy=KEEP)
    x0 = v0
    xp = pp
    if AMSGRAD:
        xp = tl.multiple_of(tl.load(base + 4).to(tl.pointer_type(T)), 16)
        x0 = tl.load(xp + offs, mask=mask, eviction_policy=STREAM)
        tl.store(slot + 3 * VEC + ar, x0, mask=mask, eviction_policy=KEEP)
    p, m, v, x = _new_values(p0, g0, m0, v0, x0, decay, wd, w1, omw1, beta2, omb2, step_size, bc2_sqrt,
                             eps, T, AMSGRAD, MAXIMIZE, WD, LERP_SMALL, FMA)
    _tag(tags, tag_idx, started)
    if HALTED:                 # FAULT only: a kill between the in-place stores
        nan = tl.full(p.shape, float("nan"), tl.float32)
        p, m, v, x = nan, nan, nan, nan
    if AMSGRAD:
        tl.store(xp + offs, x.to(T), mask=mask, eviction_policy=STREAM)
    tl.store(mp + offs, m.to(T), mask=mask, eviction_policy=STREAM)
    tl.store(vp + offs, v.to(T), mask=mask, eviction_policy=STREAM)
    tl.store(pp + offs, p.to(T), mask=mask, eviction_policy=STREAM)


@triton.jit
def adam_ring(rows, blks, nblk, tags, ring, started_base, stop, decay, wd, w1, omw1, beta2, omb2,
              step_size, bc2_sqrt, eps, T: tl.constexpr, AMSGRAD: tl.constexpr, MAXIMIZE: tl.constexpr,
              WD: tl.constexpr, LERP_SMALL: tl.constexpr, FMA: tl.constexpr, VEC: tl.constexpr,
              RS: tl.constexpr, FAULT: tl.constexpr, HINTS: tl.constexpr):
    r = tl.program_id(0)
    G = tl.num_programs(0)
    b = r
    h = r * 0                                        # which half of the program's two ring slots
    last = tl.load(blks + 3 * r + 2)                 # every program has a block (G <= nblk)
    started_last = started_base.to(tl.int64)
    stopped = r < 0
    while b < nblk:        # (a while loop: the interpreter's range() takes no tensor bounds)
        row = tl.load(blks + 3 * b)
        start = tl.load(blks + 3 * b + 1) * VEC
        tag_idx = tl.load(blks + 3 * b + 2)
        base = rows + row * _COLS
        n = tl.load(base + 5)
        live = True
        halted = False
        if FAULT:
            live = b < stop + G          # this program's blocks up to its first at or past stop
            halted = b >= stop
            stopped = stopped | halted
        if live:
            k = 2 * r + h
            slot = ring + k.to(tl.int64) * RS
            started = started_base - 2 * k.to(tl.int64)      # fused_adam.tag_code(v, first + k, STARTED)
            if start + VEC <= n:    # full blocks take the unmasked (vectorised) path
                _block(base, start, n, slot, tags, tag_idx, started, decay, wd, w1, omw1, beta2, omb2,
                       step_size, bc2_sqrt, eps, T, AMSGRAD, MAXIMIZE, WD, LERP_SMALL, FMA, False, VEC, HINTS, halted)
            else:
                _block(base, start, n, slot, tags, tag_idx, started, decay, wd, w1, omw1, beta2, omb2,
                       step_size, bc2_sqrt, eps, T, AMSGRAD, MAXIMIZE, WD, LERP_SMALL, FMA, True, VEC, HINTS, halted)
            last = tag_idx
            started_last = started
            h = 1 - h
        b += G
    if not stopped:            # the last block's stores have landed: it is done
        tl.debug_barrier()
        tl.atomic_xchg(tags + last, started_last - 1, sem="release", scope="gpu")
