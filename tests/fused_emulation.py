"""A CPU stand-in for the fused Adam kernel, so that the step protocol around it runs on a CPU.

The kernel itself (``gpu_anchor.train.fused_adam_kernel``) needs CUDA and Triton; its numerics
(bit for bit against torch) and its ring restore are tested on the GPU and under Triton's
interpreter (``tests/test_train_fused_adam.py``, ``tests/test_train_gpu.py``).  What a CPU can
test is the protocol of fused steps: the cursor read from the tags, the restore of the blocks in
flight only, a kill while a recovery redoes a chunk.  ``emulated(monkeypatch)`` makes
``fused_adam`` bind tags and run on the CPU with ``_launch`` below: the kernel's programs one
block each in turn (one order the GPU may run them in), and per block, as the kernel stores
them, the old values into the program's ring slot, the block's started tag, the new values in
place; after a program's last block its finished tag.  A SIGKILL between any two of those
stores leaves what a killed kernel may leave.  The update is Adam/AdamW in fp32 opmath, rounded
per op to the tensor dtype: deterministic, not bit-equal to torch's (no test compares it to torch).
"""
from __future__ import annotations

import torch

from gpu_anchor.train import fused_adam
from gpu_anchor.train.kinds import AdamKind


def _update(key: tuple, sc: dict, tensors: list, lo: int, hi: int) -> list:
    dtype, amsgrad, maximize, wd, _ = key

    def rnd(x):
        return x.to(dtype).float()
    p, g, m, v = (t[lo:hi].float() for t in tensors[:4])
    if maximize:
        g = -g
    if wd == 1:
        p = rnd(p * sc["decay"])
    elif wd == 2:
        g = rnd(g + sc["wd"] * p)
    m = rnd(m + sc["w1"] * (g - m))
    v = rnd(rnd(v * sc["beta2"]) + sc["omb2"] * g * g)
    new = [m, v]
    den = v
    if amsgrad:
        den = torch.maximum(tensors[4][lo:hi].float(), v)
        new.append(den)
    den = rnd(rnd(rnd(den.sqrt()) / sc["bc2_sqrt"]) + sc["eps"])
    return new + [p + sc["step_size"] * (m / den)]


def _launch(self, i, key, sc, ks, rows, blks, nb, tag_value, programs, first, stop) -> None:
    """``FusedAdam._launch`` on the CPU (module docstring)."""
    tags = self.tags[i % 2]
    blks = blks.tolist()[:nb]
    ring = self._undo[i % 2]
    es = key[0].itemsize
    view = fused_adam.ring_elements(ring, key[0])
    last: dict = {}
    for b, (row, j, idx) in enumerate(blks):
        p = b % programs
        if p in last and last[p] is None:          # stopped
            continue
        slot = first + 2 * p + (b // programs) % 2
        tensors = self._slices[i][ks[row]]
        saved = [tensors[0]] + tensors[2:]                # p, exp_avg, exp_avg_sq(, max_exp_avg_sq)
        n = tensors[0].numel()
        lo, hi = j * fused_adam.BLOCK, min((j + 1) * fused_adam.BLOCK, n)
        at = slot * (fused_adam.RING_STRIDE // es)
        for x, src in enumerate(saved):
            view[at + x * fused_adam.BLOCK:at + x * fused_adam.BLOCK + hi - lo].copy_(src[lo:hi])
        tags[idx] = fused_adam.tag_code(tag_value, slot, fused_adam.STARTED)
        if stop is not None and b >= stop:
            for dst in saved:
                dst[lo:(lo + hi) // 2 + 1].fill_(float("nan"))
            last[p] = None
            continue
        new = _update(key, sc, tensors, lo, hi)
        for dst, x in zip(tensors[2:] + [tensors[0]], new):
            dst[lo:hi].copy_(x.to(key[0]))
        last[p] = (idx, slot)
    for p, at in last.items():
        if at is not None:
            tags[at[0]] = fused_adam.tag_code(tag_value, at[1], fused_adam.FINISHED)


def emulated(monkeypatch) -> None:
    """Fused steps on the CPU, with the stand-in, in this process and the workers it forks."""
    real = fused_adam.unavailable_reason
    monkeypatch.setattr(fused_adam, "tagged", lambda device, kind: type(kind) is AdamKind)
    monkeypatch.setattr(fused_adam, "unavailable_reason", lambda d: None if d.type == "cpu" else real(d))
    monkeypatch.setattr(fused_adam, "verified", lambda key, hp, device: True)
    monkeypatch.setattr(fused_adam.FusedAdam, "_launch", _launch)
