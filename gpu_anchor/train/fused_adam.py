"""The fused anchored Adam/AdamW update: one pass that updates a chunk in place while it keeps,
for each block being written, its pre-step bytes in a small undo ring (CUDA, Triton).

Contract (``FusedAdam.apply``): for every updated slice of chunk ``i`` the kernel reads
``p, g, exp_avg, exp_avg_sq`` (``max_exp_avg_sq`` with amsgrad) once and writes the updated
values in place, block by block (``BLOCK`` elements, one tag each).  The update is
bit-identical to what ``kinds.AdamKind.apply`` (torch's own ``adam`` functional, foreach path)
computes for the same group — and is only used where that was checked on this device
(``FusedAdam.usable``): every rounding point of torch's foreach ops is reproduced (each op's
result rounded to the parameter dtype, fp32 opmath, host-computed bias corrections, correctly
rounded ``sqrt``/``/``, and nvcc's fma contraction — which is compiled in is decided by running
torch and the kernel side by side, not assumed).

Undo ring (docs/training.md, "Fused undo"): the start of undo slot ``i % 2`` is cut into ring
slots of ``RING_STRIDE`` bytes.  A launch runs ``G`` persistent programs; program ``r`` takes
its blocks in table order and uses its two ring slots in turn: a block's old values into the
slot, then the block's tag ``started(v, slot)`` (``v = encode_progress(s, i)``), then its new
values in place; after its last block, the tag of that block becomes ``finished(v, slot)``.
Per program, at any instant: every block before its last started or finished one is written
(the later tag's release covered its stores); its last block is written if tagged finished,
else (in flight) has its complete pre-step image in the slot its tag names; its other blocks
are untouched.  ``restore`` copies back each program's in-flight block and settles the tags;
the redo then writes only the blocks not written.  The tags are also the step's cursor
(``last_started``): no word moves between chunks.  The ring is small (two blocks a program),
so that its stores can stay in L2 instead of costing memory bandwidth as an image of the whole chunk does.
"""
from __future__ import annotations

import struct

import torch

BLOCK = 1024            # elements per tag: a program's vector, and the unit of the ring, restore and redo
PROGRAMS_PER_SM = 8     # persistent programs a launch runs per SM, at most
RING_STRIDE = 4 * BLOCK * 4         # bytes a ring slot: four saved tensors (amsgrad) of fp32 at most
RING_SLOTS = 1 << 14    # ring slots a tag can name (the encoding's range)
RING_MIN_BYTES = 64 * RING_STRIDE   # an undo slot holds at least this many bytes of ring
STARTED, FINISHED = 0, 1
REGISTERS: int | None = 64   # registers a thread (Triton maxnreg, NVIDIA only); None: ptxas chooses
L2_HINTS = True         # eviction hints (NVIDIA): the ring's stores stay in L2, the streamed tensors leave first
DTYPES = (torch.bfloat16, torch.float32)
# (structure key, device) -> the fma flag verified in this process, or None (not reproducible):
# a variant is verified once per process, with the first hyper-parameters it meets (a standby
# verifies it with the job's before any fault: ``gpu_anchor.train.standby_warm``)
_VERIFIED: dict = {}


def tag_code(v: int, slot: int, kind: int) -> int:
    """The tag of a block of (step, chunk) ``v = encode_progress(step, chunk)`` saved in ring
    slot ``slot``: negative, below the reset value -1, a range of its own per ``v``; linear in
    ``slot`` (``tag_code(v, s + k, STARTED) == tag_code(v, s, STARTED) - 2 * k``).  A tag equal
    to ``v`` itself says the block is written (set by ``restore``)."""
    if not 0 <= slot < RING_SLOTS:
        raise ValueError(f"ring slot {slot} out of range")
    return -2 - ((v * RING_SLOTS + slot) * 2 + kind)


def decode_tag(t: int) -> tuple[int, int | None, int | None] | None:
    """``(v, slot, kind)`` of a started / finished tag, ``(v, None, None)`` of a written one,
    None of a reset one."""
    if t >= 0:
        return t, None, None
    if t == -1:
        return None
    k = -2 - t
    q, kind = divmod(k, 2)
    return q // RING_SLOTS, q % RING_SLOTS, kind


def ring_elements(ring: torch.Tensor, dtype: torch.dtype, first: int = 0) -> torch.Tensor:
    """An undo slot's bytes from ring slot ``first`` on, as elements of ``dtype``."""
    es = dtype.itemsize
    return ring[first * RING_STRIDE:ring.numel() // es * es].view(dtype)


def max_programs(device: torch.device) -> int:
    """The persistent grid's size on ``device`` (a few on a host: the CPU stand-in of the tests)."""
    if device.type != "cuda":
        return 3
    return PROGRAMS_PER_SM * torch.cuda.get_device_properties(device).multi_processor_count


def ring_slot_bytes(launches: int, device: torch.device) -> int:
    """An undo slot that holds the ring alone: two ring slots for every program of each of a
    chunk's ``launches`` launches, and at least ``RING_MIN_BYTES``."""
    return max(RING_MIN_BYTES, 2 * launches * max_programs(device) * RING_STRIDE)


def ring_capacity(slot_bytes: int) -> int:
    """Ring slots an undo slot of ``slot_bytes`` holds (the launches of a chunk share them)."""
    return min(RING_SLOTS, slot_bytes // RING_STRIDE)


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


def launch(rows: torch.Tensor, blks: torch.Tensor, nblocks: int, tags: torch.Tensor, ring: torch.Tensor,
           tag_value: int, key: tuple, fma: bool, sc: dict, programs: int, first: int = 0,
           stop: int | None = None) -> None:
    """One launch of ``programs`` persistent programs over the first ``nblocks`` rows of ``blks``.
    ``ring``: the undo slot's bytes; the launch uses ring slots ``first .. first + 2 * programs - 1``.
    ``stop`` (tests): blocks from there on are left as a kill inside the kernel would leave them."""
    dtype, amsgrad, maximize, wd, small = key
    import triton.language as tl
    from .fused_adam_kernel import adam_ring
    if not (0 < programs <= nblocks and first + 2 * programs <= ring_capacity(ring.numel())):
        raise ValueError(f"{programs} programs from ring slot {first}: the ring or the table is too small")
    es = dtype.itemsize
    view = ring_elements(ring, dtype, first)
    regs = {} if REGISTERS is None or torch.version.hip else {"maxnreg": REGISTERS}
    hints = bool(L2_HINTS and not torch.version.hip)
    adam_ring[(programs,)](rows, blks, nblocks, tags, view, tag_code(tag_value, first, STARTED),
                           -1 if stop is None else stop, sc["decay"], sc["wd"], sc["w1"], sc["omw1"], sc["beta2"],
                           sc["omb2"], sc["step_size"], sc["bc2_sqrt"], sc["eps"],
                           T=tl.bfloat16 if dtype == torch.bfloat16 else tl.float32, AMSGRAD=amsgrad,
                           MAXIMIZE=maximize, WD=wd, LERP_SMALL=small, FMA=fma, VEC=BLOCK, RS=RING_STRIDE // es,
                           FAULT=stop is not None, HINTS=hints, num_warps=4, enable_fp_fusion=False, **regs)


class FusedAdam:
    """The fused update over a chunk plan's views (built by ``ChunkExecutor``).

    ``slices[i][k]``: the tensors ``[p, g, exp_avg, exp_avg_sq(, max_exp_avg_sq)]`` of slice
    ``k`` of chunk ``i`` (views); ``tags``: int64 ``[2, max_blocks]`` anchored; ``undo``: the
    two anchored undo slots (bytes), whose start holds chunk ``i``'s ring in slot ``i % 2``.
    A block's tag index is its slice's first index (slices in chunk order) + its block in the slice.
    """

    def __init__(self, slices, tags: torch.Tensor, undo) -> None:
        self._slices = slices
        self.tags = tags
        self._undo = undo
        self._bases = []          # per chunk: first tag index of each slice
        for chunk in slices:
            base, acc = [], 0
            for tensors in chunk:
                base.append(acc)
                acc += blocks(tensors[0].numel())
            self._bases.append(base)
        self._tables: dict = {}   # (chunk, slices) -> (rows, blks, nblocks) on the device
        self._variant: dict = {}  # structure key -> fma flag that matches torch, or None
        self._redo: dict = {}     # chunk -> (tag value, indices of blocks written): set by restore
        self._programs = max_programs(tags.device)
        self.capacity = min(ring_capacity(u.numel()) for u in undo)

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

    def fits(self, launches: int) -> bool:
        """Whether a chunk's ``launches`` launches find two ring slots each."""
        return 2 * launches <= self.capacity

    def apply(self, i: int, groups, tag_value: int, stop: int | None = None) -> None:
        """``groups``: ``[(key, scalars, slice indices)]`` (one launch each) for chunk ``i``.
        After ``restore(i, tag_value)`` the blocks it found written are left out.  ``stop``
        (tests): each launch stops at its block ``stop`` as a kill would leave it."""
        skip = self._redo.pop(i, None)
        jobs = []
        for key, sc, ks in groups:
            rows, blks, nb = self._table(i, tuple(ks))
            if skip is not None and skip[0] == tag_value and skip[1].numel():
                blks = blks[~torch.isin(blks[:, 2], skip[1])]
                nb = blks.shape[0]
            if nb:
                jobs.append((key, sc, tuple(ks), rows, blks, nb))
        first = 0
        for n, (key, sc, ks, rows, blks, nb) in enumerate(jobs):
            left = len(jobs) - n - 1                   # launches after this one keep two slots each
            programs = min(nb, self._programs, (self.capacity - first) // 2 - left)
            if programs < 1:
                raise RuntimeError(f"chunk {i}: {len(jobs)} launches do not fit a ring of {self.capacity} slots")
            self._launch(i, key, sc, ks, rows, blks, nb, tag_value, programs, first, stop)
            first += 2 * programs

    def _launch(self, i, key, sc, ks, rows, blks, nb, tag_value, programs, first, stop) -> None:
        launch(rows, blks, nb, self.tags[i % 2], self._undo[i % 2], tag_value, key, self._variant[key], sc,
               programs, first, stop)

    def _table(self, i: int, ks: tuple):
        t = self._tables.get((i, ks))
        if t is None:
            t = self._tables[(i, ks)] = table([self._slices[i][k] for k in ks],
                                              [self._bases[i][k] for k in ks], self.tags.device)
        return t

    def last_started(self, step: int) -> int | None:
        """The last chunk of ``step`` whose update began: the highest ``i`` with a block of
        slot ``i % 2`` tagged for ``(step, i)`` (None: no block of ``step`` is).

        Chunk ``i``'s kernels start after chunk ``i - 1``'s have finished (one stream), and a
        block's in-place stores follow its started tag, so every chunk before it is written and
        every chunk after it untouched: a fused step's cursor, without a word per chunk."""
        from .protocol import encode_progress
        seen = [{d[0] for d in map(decode_tag, set(self.tags[k].cpu().tolist())) if d is not None}
                for k in range(2)]
        started = [i for i in range(len(self._slices)) if encode_progress(step, i) in seen[i % 2]]
        return max(started, default=None)

    def restore(self, i: int, tag_value: int) -> int:
        """Copy back the block each program of chunk ``i`` had in flight (its last tagged one,
        when tagged started: ``fused_adam_kernel``) from the ring slot its tag names, then settle
        the tags: every other started or finished block of ``tag_value`` becomes written (its
        tag ``tag_value``), the restored ones reset (-1).  Returns how many were restored; the
        next ``apply(i, …, tag_value)`` leaves out the written blocks.

        A kill in between is recovered the same way: until the tags change nothing is written
        but the same bytes again, and the tags change in an order that never lets a written
        block pass for a program's last: first the started blocks that are not last, then the
        finished ones, then the restored ones."""
        n_all = sum(blocks(t[0].numel()) for t in self._slices[i])
        tags = self.tags[i % 2]
        seen = tags[:n_all].cpu().tolist()
        written, programs = [], {}
        for j, t in enumerate(seen):
            d = decode_tag(t)
            if d is None or d[0] != tag_value:
                continue
            if d[1] is None:
                written.append(j)
            else:
                programs.setdefault(d[1] // 2, []).append((j, d[1], d[2]))
        in_flight, settle_started, settle_finished = {}, [], []
        for items in programs.values():
            items.sort()
            j, slot, kind = items[-1]
            if kind == STARTED:
                in_flight[j] = slot
            else:
                settle_finished.append(j)
            settle_started += [j for j, _, k in items[:-1]]
        self._copy_back(i, in_flight)
        for group, value in ((settle_started, tag_value), (settle_finished, tag_value), (list(in_flight), -1)):
            if group:
                tags.index_fill_(0, torch.tensor(group, device=tags.device), value)
        done = written + settle_started + settle_finished
        self._redo[i] = (tag_value, torch.tensor(sorted(done), dtype=torch.int64, device=tags.device))
        return len(in_flight)

    def _copy_back(self, i: int, in_flight: dict) -> None:
        """Blocks ``{tag index: ring slot}`` of chunk ``i`` from the ring, a gather per tensor."""
        for tensors, base in zip(self._slices[i], self._bases[i]):
            n = tensors[0].numel()
            mine = [(j - base, r) for j, r in in_flight.items() if base <= j < base + blocks(n)]
            if not mine:
                continue
            saved = [tensors[0]] + tensors[2:]           # the gradient is not saved: it is the redo log
            es = tensors[0].element_size()
            ring = ring_elements(self._undo[i % 2], tensors[0].dtype)
            dst, src = [], []
            for j, r in mine:
                lo, hi = j * BLOCK, min((j + 1) * BLOCK, n)
                dst.append(torch.arange(lo, hi))
                src.append(torch.arange(hi - lo) + r * (RING_STRIDE // es))
            dst_i = torch.cat(dst).to(ring.device)
            src_i = torch.cat(src).to(ring.device)
            for t, x in enumerate(saved):
                x.index_copy_(0, dst_i, ring.index_select(0, src_i + t * BLOCK))


def table(slices, bases, device):
    """Device tables for one launch: per slice a row of addresses + numel, per block
    ``(row, block in slice, tag index)``."""
    rows, blks = [], []
    for r, (tensors, base) in enumerate(zip(slices, bases)):
        p, g, m, v = tensors[:4]
        x = tensors[4] if len(tensors) > 4 else None
        addrs = [t.data_ptr() if t is not None else 0 for t in (p, g, m, v, x)]
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
    ring = torch.full((4 * RING_STRIDE,), 255, dtype=torch.uint8, device=device)   # two programs' slots
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
            rows, blks, nb = table([t[:1] + [g] + t[1:]], [base], device)
            launch(rows, blks, nb, tags, ring, 100 + step, key, fma, scalars(hp, counts[k] + step), min(2, nb))
            if not _ring_holds(ring, tags[base:base + nb], before[k], sizes[k], min(2, nb), 100 + step):
                return False
            base += blocks(sizes[k])
        for k in range(len(sizes)):
            for a, b in zip(ref[k], mine[k]):
                if not _same_bits(a, b):
                    return False
    return True


def _ring_holds(ring, tags, before, n, programs, v) -> bool:
    """After a whole launch over one slice: program ``p``'s blocks ``p, p + G, ...`` are tagged
    started in its slots ``2p, 2p + 1`` in turn, its last finished, and that last slot holds
    the last block's pre-step bytes."""
    seen = tags.tolist()
    nb = len(seen)
    for p in range(programs):
        mine = list(range(p, nb, programs))
        for m, j in enumerate(mine):
            want = (v, 2 * p + m % 2, FINISHED if j == mine[-1] else STARTED)
            if decode_tag(seen[j]) != want:
                return False
        lo, hi = mine[-1] * BLOCK, min((mine[-1] + 1) * BLOCK, n)
        es = before[0].element_size()
        view = ring_elements(ring, before[0].dtype)
        for x, a in enumerate(before):
            at = (2 * p + (len(mine) - 1) % 2) * (RING_STRIDE // es) + x * BLOCK
            if not _same_bits(a[lo:hi], view[at:at + hi - lo]):
                return False
    return True


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    iv = torch.int16 if a.element_size() == 2 else torch.int32
    return bool(torch.equal(a.view(iv), b.view(iv)))
