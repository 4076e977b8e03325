"""The Triton kernel of ``fused_adam`` (imported only when Triton is; see that module's contract).

One program = one block of ``BLOCK`` elements of one slice: load, store the old values
into the undo places, compute the new values, publish the block's tag, then store them.
Every arithmetic step mirrors one op of torch's ``_multi_tensor_adam`` (named beside it);
``enable_fp_fusion=False`` at launch keeps Triton from contracting anything itself, so
the only fmas are the explicit ones chosen by ``FMA``.
"""
import triton
import triton.language as tl


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
def _block(base, start, n, tags, tag_idx, tag_value, decay, wd, w1, omw1, beta2, omb2, step_size,
           bc2_sqrt, eps, T: tl.constexpr, AMSGRAD: tl.constexpr, MAXIMIZE: tl.constexpr,
           WD: tl.constexpr, LERP_SMALL: tl.constexpr, FMA: tl.constexpr, MASKED: tl.constexpr,
           BLOCK: tl.constexpr):
    offs = start + tl.arange(0, BLOCK)
    if MASKED:
        mask = offs < n
    else:
        mask = None
    pp = tl.multiple_of(tl.load(base + 0).to(tl.pointer_type(T)), 16)
    gp = tl.multiple_of(tl.load(base + 1).to(tl.pointer_type(T)), 16)
    mp = tl.multiple_of(tl.load(base + 2).to(tl.pointer_type(T)), 16)
    vp = tl.multiple_of(tl.load(base + 3).to(tl.pointer_type(T)), 16)
    up = tl.multiple_of(tl.load(base + 5).to(tl.pointer_type(T)), 16)
    um = tl.multiple_of(tl.load(base + 6).to(tl.pointer_type(T)), 16)
    uv = tl.multiple_of(tl.load(base + 7).to(tl.pointer_type(T)), 16)
    p0 = tl.load(pp + offs, mask=mask)
    g0 = tl.load(gp + offs, mask=mask)
    m0 = tl.load(mp + offs, mask=mask)
    v0 = tl.load(vp + offs, mask=mask)
    tl.store(up + offs, p0, mask=mask)
    tl.store(um + offs, m0, mask=mask)
    tl.store(uv + offs, v0, mask=mask)
    if AMSGRAD:
        xp = tl.multiple_of(tl.load(base + 4).to(tl.pointer_type(T)), 16)
        ux = tl.multiple_of(tl.load(base + 8).to(tl.pointer_type(T)), 16)
        x0 = tl.load(xp + offs, mask=mask)
        tl.store(ux + offs, x0, mask=mask)
    # The new values are computed in registers while the undo stores drain; the tag waits
    # for them only after that (below), so the fence's wait overlaps the arithmetic.
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
    if AMSGRAD:
        x = x0.to(tl.float32)
        x = tl.where(x != x, x, tl.where(v != v, v, tl.where(v > x, v, x)))   # maximum, NaN wins
        den = x
    den = _rnd(tl.sqrt_rn(den), T)                # _foreach_sqrt -> a tensor of the dtype
    den = _rnd(tl.div_rn(den, bc2_sqrt), T)      # .div_(bias_correction2_sqrt)
    den = _rnd(den + eps, T)                      # .add_(eps)
    p = _madd(step_size, tl.div_rn(m, den), p, FMA)   # p.addcdiv_(exp_avg, den, -lr / bc1)
    # The block's image is stored: publish its tag (one thread, release: the CTA's undo
    # stores, ordered before it by the barrier, land first), then let the in-place
    # stores go (acquire + barrier: none is issued before the tag has landed).
    tl.debug_barrier()
    tl.atomic_xchg(tags + tag_idx, tag_value, sem="acq_rel", scope="gpu")
    tl.debug_barrier()
    if AMSGRAD:
        tl.store(xp + offs, x.to(T), mask=mask)
    tl.store(mp + offs, m.to(T), mask=mask)
    tl.store(vp + offs, v.to(T), mask=mask)
    tl.store(pp + offs, p.to(T), mask=mask)

@triton.jit
def adam_undo(rows, blks, tags, tag_value, decay, wd, w1, omw1, beta2, omb2, step_size, bc2_sqrt, eps,
              T: tl.constexpr, AMSGRAD: tl.constexpr, MAXIMIZE: tl.constexpr, WD: tl.constexpr,
              LERP_SMALL: tl.constexpr, FMA: tl.constexpr, BLOCK: tl.constexpr):
    b = tl.program_id(0)
    row = tl.load(blks + 3 * b)
    start = tl.load(blks + 3 * b + 1) * BLOCK
    tag_idx = tl.load(blks + 3 * b + 2)
    base = rows + row * 10
    n = tl.load(base + 9)
    if start + BLOCK <= n:    # full blocks take the unmasked (vectorised) path
        _block(base, start, n, tags, tag_idx, tag_value, decay, wd, w1, omw1, beta2, omb2, step_size,
               bc2_sqrt, eps, T, AMSGRAD, MAXIMIZE, WD, LERP_SMALL, FMA, False, BLOCK)
    else:
        _block(base, start, n, tags, tag_idx, tag_value, decay, wd, w1, omw1, beta2, omb2, step_size,
               bc2_sqrt, eps, T, AMSGRAD, MAXIMIZE, WD, LERP_SMALL, FMA, True, BLOCK)

