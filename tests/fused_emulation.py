"""A CPU stand-in for the fused Adam kernel, so that the step protocol around it runs on a CPU.

The kernel itself (``gpu_anchor.train.fused_adam_kernel``) needs CUDA and Triton; its numerics
(bit for bit against torch) and its torn-block restore are tested on the GPU
(``tests/test_train_fused_adam.py``, ``tests/test_train_gpu.py``).  What a CPU can test is the
protocol of fused steps: the cursor read from the tags, the rollback of tagged blocks only, a
kill while a recovery redoes a chunk.  ``emulated(monkeypatch)`` makes ``fused_adam`` bind tags
and run on the CPU with ``apply`` below: per block, in program order, the old values into the
undo places, the block's tag, then the new values.  A SIGKILL between any two of those stores
leaves what a killed kernel may leave.  The update is Adam/AdamW in fp32 opmath, rounded per
op to the tensor dtype: deterministic, not bit-equal to torch's (no test compares it to torch).
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


def apply(self, i: int, groups, tag_value: int) -> None:
    """``FusedAdam.apply`` on the CPU, block by block (module docstring)."""
    tags = self.tags[i % 2]
    for key, sc, ks in groups:
        for k in ks:
            tensors, undo = self._slices[i][k]
            saved = [tensors[0]] + tensors[2:]                # p, exp_avg, exp_avg_sq(, max_exp_avg_sq)
            base, n = self._bases[i][k], tensors[0].numel()
            for j in range(fused_adam.blocks(n)):
                lo, hi = j * fused_adam.BLOCK, min((j + 1) * fused_adam.BLOCK, n)
                for src, dst in zip(saved, undo):
                    dst[lo:hi].copy_(src[lo:hi])
                new = _update(key, sc, tensors, lo, hi)
                tags[base + j] = tag_value
                for dst, x in zip(tensors[2:] + [tensors[0]], new):
                    dst[lo:hi].copy_(x.to(key[0]))


def emulated(monkeypatch) -> None:
    """Fused steps on the CPU, with the stand-in, in this process and the workers it forks."""
    real = fused_adam.unavailable_reason
    monkeypatch.setattr(fused_adam, "tagged", lambda device, kind: type(kind) is AdamKind)
    monkeypatch.setattr(fused_adam, "unavailable_reason", lambda d: None if d.type == "cpu" else real(d))
    monkeypatch.setattr(fused_adam, "verified", lambda key, hp, device: True)
    monkeypatch.setattr(fused_adam.FusedAdam, "apply", apply)
