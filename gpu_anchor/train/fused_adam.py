"""The fused anchored Adam/AdamW update: one pass that saves a chunk's pre-step bytes into
its undo slot and updates the chunk in place (CUDA, Triton).

Contract (``FusedAdam.apply``): for every updated slice of chunk ``i`` the kernel reads
``p, g, exp_avg, exp_avg_sq`` (``max_exp_avg_sq`` with amsgrad) once, writes the values it
read into the slice's places in undo slot ``i % 2``, and writes the updated values in place.
The update is bit-identical to what ``kinds.AdamKind.apply`` (torch's own ``adam``
functional, foreach path) computes for the same group — and is only used where that was
checked on this device (``FusedAdam.usable``): every rounding point of torch's foreach ops
is reproduced (each op's result rounded to the parameter dtype, fp32 opmath, host-computed
bias corrections, correctly rounded ``sqrt``/``/``, and nvcc's fma contraction — which is
compiled in is decided by running torch and the kernel side by side, not assumed).

Undo ordering (docs/training.md, "fused undo"): the kernel cannot finish the undo image
before touching the chunk, so the image is complete per *block* of ``BLOCK`` elements:
a program stores its block's old values, then (after a CTA barrier, with release
semantics) the block's tag ``encode_progress(step, i)`` in ``<prefix>.undo.tags``, and only
after that (acquire + barrier) its new values.  A block whose tag is not ``(step, i)``
was never written by this step's chunk ``i``; ``restore`` copies back only tagged blocks.
The tags are also the step's cursor (``last_started``): no word moves between chunks.
"""
from __future__ import annotations

import struct

import torch

BLOCK = 1024            # elements per program, and per undo tag (the restore granularity)
_COLS = 10              # table row: p, g, exp_avg, exp_avg_sq, max_exp_avg_sq, their 4 undo places, numel
REGISTERS: int | None = 64   # registers a thread (Triton maxnreg, NVIDIA only); None: ptxas chooses
DTYPES = (torch.bfloat16, torch.float32)
# (structure key, device) -> the fma flag verified in this process, or None (not reproducible):
# a variant is verified once per process, with the first hyper-parameters it meets (a standby
# verifies it with the job's before any fault: ``gpu_anchor.train.standby_warm``)
_VERIFIED: dict = {}


def unavailable_reason(device: torch.device) -> str | None:
    """Why the fused update cannot run on ``device`` (None: it can, subject to ``usable``)."""
    if device.type != "cuda":
        return "not a CUDA device"
    try:
        import triton  # noqa: F401
    except Exception as e:   # Triton is optional: without it the copy + torch update runs
        return f"Triton is not importable ({type(e).__name__})"
    return None


def tagged(device: torch.device, kind) -> bool:
    """Whether an optimizer of ``kind`` on ``device`` keeps the per-block undo tags: CUDA and
    plain Adam/AdamW, even where the kernel cannot run (a step it began rolls back by them)."""
    from .kinds import AdamKind
    return device.type == "cuda" and type(kind) is AdamKind


def blocks(n: int) -> int:
    return (n + BLOCK - 1) // BLOCK


def _f32(x: float) -> float:
    """``x`` rounded to fp32 (round to nearest even), as a double scalar becomes a kernel's opmath."""
    return struct.unpack("f", struct.pack("f", x))[0]


def scalars(hp: dict, count: int) -> dict:
    """The kernel's fp32 scalars for a group ``hp`` and a step count before this step,
    computed as torch's non-capturable foreach path computes them (host doubles, then
    fp32 as a foreach op's scalar argument)."""
    beta1, beta2 = hp["betas"]
    lr, wd = hp["lr"], hp["weight_decay"]
    t = float(count + 1)
    w1 = 1 - beta1
    bc1, bc2 = 1 - beta1 ** t, 1 - beta2 ** t
    return dict(decay=_f32(1 - lr * wd), wd=_f32(wd), w1=_f32(w1),
                omw1=_f32(1.0 - _f32(w1)),      # opmath_t(1) - weight, in fp32 (exact for w >= 0.5)
                beta2=_f32(beta2), omb2=_f32(1 - beta2), step_size=_f32((lr / bc1) * -1),
                bc2_sqrt=_f32(bc2 ** 0.5), eps=_f32(hp["eps"]))


def structure(hp: dict, dtype: torch.dtype) -> tuple | None:
    """What selects a kernel variant (None: a configuration the kernel does not cover)."""
    if dtype not in DTYPES or hp.get("fused") or hp.get("capturable") or hp.get("differentiable"):
        return None
    if hp.get("foreach") is False:          # torch's single-tensor path rounds differently
        return None
    wd = 0 if hp["weight_decay"] == 0 else (1 if hp.get("decoupled_weight_decay") else 2)
    return (dtype, bool(hp["amsgrad"]), bool(hp["maximize"]), wd, abs(_f32(1 - hp["betas"][0])) < 0.5)


def launch(rows: torch.Tensor, blks: torch.Tensor, nblocks: int, tags: torch.Tensor, tag_value: int,
           key: tuple, fma: bool, sc: dict) -> None:
    dtype, amsgrad, maximize, wd, small = key
    import triton.language as tl
    from .fused_adam_kernel import adam_undo
    regs = {} if REGISTERS is None or torch.version.hip else {"maxnreg": REGISTERS}
    adam_undo[(nblocks,)](rows, blks, tags, tag_value, sc["decay"], sc["wd"], sc["w1"], sc["omw1"], sc["beta2"],
                          sc["omb2"], sc["step_size"], sc["bc2_sqrt"], sc["eps"],
                          T=tl.bfloat16 if dtype == torch.bfloat16 else tl.float32, AMSGRAD=amsgrad,
                          MAXIMIZE=maximize, WD=wd, LERP_SMALL=small, FMA=fma, BLOCK=BLOCK,
                          num_warps=4, enable_fp_fusion=False, **regs)


class FusedAdam:
    """The fused update over a chunk plan's views (built by ``ChunkExecutor``).

    ``slices[i][k]``: ``(tensors, undo)`` of slice ``k`` of chunk ``i`` — ``tensors`` =
    ``[p, g, exp_avg, exp_avg_sq(, max_exp_avg_sq)]`` views, ``undo`` = their undo places
    (parameter and states, same order).  ``tags``: int64 ``[2, max_blocks]`` anchored.
    """

    def __init__(self, slices, tags: torch.Tensor) -> None:
        self._slices = slices
        self.tags = tags
        self._bases = []          # per chunk: first tag index of each slice
        for chunk in slices:
            base, acc = [], 0
            for tensors, _ in chunk:
                base.append(acc)
                acc += blocks(tensors[0].numel())
            self._bases.append(base)
        self._tables: dict = {}   # (chunk, slices) -> (rows, blks, nblocks) on the device
        self._variant: dict = {}  # structure key -> fma flag that matches torch, or None

    @staticmethod
    def max_blocks(numels_per_chunk) -> int:
        return max(sum(blocks(n) for n in c) for c in numels_per_chunk)

    def usable(self, key: tuple | None, hp: dict, device: torch.device) -> bool:
        """True once the kernel variant for ``key`` reproduced torch's update bit for bit here."""
        if key is None:
            return False
        if key not in self._variant:
            self._variant[key] = verified(key, hp, device)
        return self._variant[key] is not None

    def apply(self, i: int, groups, tag_value: int) -> None:
        """``groups``: ``[(key, scalars, slice indices)]`` (one launch each) for chunk ``i``."""
        tags = self.tags[i % 2]
        for key, sc, ks in groups:
            rows, blks, nb = self._table(i, tuple(ks))
            launch(rows, blks, nb, tags, tag_value, key, self._variant[key], sc)

    def _table(self, i: int, ks: tuple):
        t = self._tables.get((i, ks))
        if t is None:
            t = self._tables[(i, ks)] = table([self._slices[i][k] for k in ks],
                                              [self._bases[i][k] for k in ks], self.tags.device)
        return t

    def last_started(self, step: int) -> int | None:
        """The last chunk of ``step`` whose update began: the highest ``i`` with a block of
        slot ``i % 2`` tagged ``encode_progress(step, i)`` (None: no block of ``step`` is).

        Chunk ``i``'s kernel starts after chunk ``i - 1``'s has finished (one stream), and a
        block's in-place stores follow its tag, so every chunk before it is written and
        every chunk after it untouched: a fused step's cursor, without a word per chunk."""
        from .protocol import encode_progress
        seen = [set(self.tags[k].cpu().tolist()) for k in range(2)]
        started = [i for i in range(len(self._slices)) if encode_progress(step, i) in seen[i % 2]]
        return max(started, default=None)

    def restore(self, i: int, tag_value: int) -> int:
        """Copy back every block of chunk ``i`` tagged ``tag_value``; returns how many."""
        n_all = sum(blocks(t[0].numel()) for t, _ in self._slices[i])
        tagged = (self.tags[i % 2][:n_all] == tag_value).cpu().tolist()
        done = 0
        for (tensors, undo), base in zip(self._slices[i], self._bases[i]):
            n = tensors[0].numel()
            live = [tensors[0]] + tensors[2:]        # the gradient is not saved: it is the redo log
            for a, b in _runs(tagged[base:base + blocks(n)]):
                lo, hi = a * BLOCK, min(b * BLOCK, n)
                for dst, src in zip(live, undo):
                    dst[lo:hi].copy_(src[lo:hi])
                done += b - a
        return done


def _runs(flags):
    """``[(a, b)]``: the maximal runs of True in ``flags``."""
    out, start = [], None
    for j, f in enumerate(list(flags) + [False]):
        if f and start is None:
            start = j
        elif not f and start is not None:
            out.append((start, j))
            start = None
    return out


def table(slices, bases, device):
    """Device tables for one launch: per slice a row of addresses + numel, per block
    ``(row, block in slice, tag index)``."""
    rows, blks = [], []
    for r, ((tensors, undo), base) in enumerate(zip(slices, bases)):
        p, g, m, v = tensors[:4]
        x = tensors[4] if len(tensors) > 4 else None
        up, um, uv = undo[:3]
        ux = undo[3] if len(undo) > 3 else None
        addrs = [t.data_ptr() if t is not None else 0 for t in (p, g, m, v, x, up, um, uv, ux)]
        if any(a % 16 for a in addrs):
            raise ValueError("fused Adam needs 16-byte aligned slices")
        rows.append(addrs + [p.numel()])
        blks += [[r, j, base + j] for j in range(blocks(p.numel()))]
    return (torch.tensor(rows, dtype=torch.int64).to(device), torch.tensor(blks, dtype=torch.int64).to(device),
            len(blks))


def verified(key: tuple, hp: dict, device: torch.device) -> bool | None:
    """``verify``'s answer for ``key`` on ``device``, computed once per process."""
    d = torch.device(device)
    if d.type == "cuda" and d.index is None:
        d = torch.device("cuda", torch.cuda.current_device())
    where = (key, str(d))
    if where not in _VERIFIED:
        _VERIFIED[where] = verify(key, hp, device)
    return _VERIFIED[where]


def verify(key: tuple, hp: dict, device: torch.device, fmas=(True, False)) -> bool | None:
    """Run torch's update (``kinds.AdamKind``, the path the copy mode takes) and the kernel
    side by side for three steps on probe tensors; the fma flag whose results (and undo
    images) match bit for bit, or None."""
    for fma in fmas:
        if _probe(key, hp, device, fma):
            return fma
    import warnings
    warnings.warn(f"gpu_anchor: the fused Adam update does not reproduce torch's here for {key} "
                  "(hyper-parameters as given); using the undo copy + torch's update", RuntimeWarning)
    return None


def _probe(key, hp, device, fma) -> bool:
    from torch.optim.optimizer import _get_scalar_dtype
    from .kinds import AdamKind
    dtype, amsgrad = key[0], key[1]
    gen = torch.Generator().manual_seed(20)
    sizes, counts = [3 * BLOCK + 40, 1000, BLOCK], [0, 6, 999]
    names = ["exp_avg", "exp_avg_sq"] + (["max_exp_avg_sq"] if amsgrad else [])

    def rnd(n, scale, pos=False):
        x = torch.randn(n, generator=gen) * scale
        x[:: 7] = 0.0                                      # exact zeros (first steps, dead units)
        return (x.abs() if pos else x).to(dtype).to(device)

    ref = [[rnd(n, 0.05), rnd(n, 1e-3), rnd(n, 1e-6, True)] for n in sizes]
    for t, c in zip(ref, counts):
        if c == 0:
            t[1].zero_(), t[2].zero_()
        if amsgrad:
            t.append(t[2] * 1.5)
    mine = [[x.clone() for x in t] for t in ref]
    undo = [[torch.empty(BLOCK * blocks(n) + 64, dtype=dtype, device=device) for _ in t] for n, t in zip(sizes, ref)]
    tags = torch.full((sum(blocks(n) for n in sizes),), -1, dtype=torch.int64, device=device)
    kind = AdamKind()
    for step in range(3):
        grads = [rnd(n, 1e-2) for n in sizes]
        before = [[x.clone() for x in t] for t in mine]
        for k, (t, g) in enumerate(zip(ref, grads)):    # one call per count, as the chunk executor groups them
            stp = [torch.tensor(float(counts[k] + step), dtype=_get_scalar_dtype())]
            kind.apply([t[0]], [g], [dict(zip(names, t[1:]))], [counts[k] + step], stp, hp)
        base = 0
        for k, (t, g) in enumerate(zip(mine, grads)):
            sl = [(t[:1] + [g] + t[1:], [u[:sizes[k]] for u in undo[k]])]
            rows, blks, nb = table(sl, [base], device)
            launch(rows, blks, nb, tags, 100 + step, key, fma, scalars(hp, counts[k] + step))
            base += blocks(sizes[k])
        for k in range(len(sizes)):
            for a, b in zip(ref[k], mine[k]):
                if not _same_bits(a, b):
                    return False
            for a, u in zip(before[k], undo[k]):
                if not _same_bits(a, u[:sizes[k]]):
                    return False
        if not bool((tags == 100 + step).all()):
            return False
    return True


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    iv = torch.int16 if a.element_size() == 2 else torch.int32
    return bool(torch.equal(a.view(iv), b.view(iv)))
