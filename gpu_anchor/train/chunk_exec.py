"""Carrying out one chunk: views over anchored memory, undo copies, the optimizer call.

Built once per worker from the chunk plan: for chunk ``i``, the parameter / gradient /
state slices (views of anchored tensors, no copies) and their places in undo slot
``i % 2``.  The protocol (``optimizer.py``) decides *when*; this module only does.

Two ways to save and update a chunk: ``copy_to_undo`` then ``apply`` (any optimizer), or
``apply_fused`` (Adam/AdamW on CUDA with Triton: one kernel updates block by block, each
block's old bytes in a small undo ring while it is written, per-block tags; ``fused_adam``) —
used only where ``fused_groups`` says so.
"""
from __future__ import annotations

import torch

from . import chunking
from .kinds import AdamKind, settle_cpu_sqrt
from .protocol import slot_of


class ChunkExecutor:
    def __init__(self, params, chunks, elem_sizes, undo_slots, kind, tags=None) -> None:
        self._params = params
        self._chunks = chunks
        self._kind = kind
        if params and params[0].flat.device.type == "cpu":     # before any chunk is updated here
            settle_cpu_sqrt({q.flat.dtype for q in params})
        self._views, self._undo_src, self._undo_dst = [], [], []
        per_slice = []
        for i, chunk in enumerate(chunks):
            offs = chunking.layout(chunk, elem_sizes)
            views, src, dst, mine = [], [], [], []
            slot = undo_slots[slot_of(i)]
            for s, row in zip(chunk, offs):
                q = params[s.param]
                pv = q.flat[s.start:s.stop]
                sv = {k: t[s.start:s.stop] for k, t in q.sflat.items()}
                views.append((pv, q.gflat[s.start:s.stop], sv))
                n = s.stop - s.start
                saved = [pv] + list(sv.values())
                places = [slot[off:off + n * t.element_size()].view(t.dtype) for t, off in zip(saved, row)]
                src += saved
                dst += places
                mine.append([pv, views[-1][1]] + list(sv.values()))
            per_slice.append(mine)
            self._views.append(views)
            self._undo_src.append(src)
            self._undo_dst.append(dst)
        self.fused = None
        if tags is not None and isinstance(kind, AdamKind) and type(kind) is AdamKind:
            from .fused_adam import FusedAdam
            self.fused = FusedAdam(per_slice, tags, undo_slots)

    def apply(self, i, mask, counts, steps, hps) -> None:
        """Run the optimizer's functional update on chunk ``i`` (parameters with a gradient only)."""
        by_group: dict[int, list] = {}
        for k, s in enumerate(self._chunks[i]):
            if mask[s.param]:
                by_group.setdefault(self._params[s.param].group, []).append((k, s))
        views = self._views[i]
        for gi, items in by_group.items():
            params = [views[k][0] for k, _ in items]
            grads = [views[k][1] for k, _ in items]
            states = [views[k][2] for k, _ in items]
            cnts = [counts[s.param] for _, s in items]
            stp = [steps[i][k] for k, _ in items] if steps is not None else []
            for k, name, t in self._kind.apply(params, grads, states, cnts, stp, hps[gi]):
                states[k][name].copy_(t)

    def fused_groups(self, i, mask, counts, hps, memo=None):
        """The launches of the fused update of chunk ``i`` — ``[(key, scalars, slices)]`` —
        or None when any updated slice's configuration is not verified for it."""
        from .fused_adam import scalars, structure
        memo = {} if memo is None else memo
        by: dict = {}
        for k, s in enumerate(self._chunks[i]):
            if mask[s.param]:
                q = self._params[s.param]
                by.setdefault((q.group, counts[s.param], q.flat.dtype), []).append(k)
        out = []
        for (gi, count, dtype), ks in by.items():
            key = structure(hps[gi], dtype)
            if not self.fused.usable(key, hps[gi], self._params[0].flat.device):
                return None
            if (gi, count) not in memo:
                memo[(gi, count)] = scalars(hps[gi], count)
            out.append((key, memo[(gi, count)], ks))
        return out if self.fused.fits(len(out)) else None

    def fused_step(self, mask, counts, hps) -> list | None:
        """Per chunk, the fused launches for this step; None: this step saves by copy."""
        if self.fused is None:
            return None
        memo: dict = {}
        plan = [self.fused_groups(i, mask, counts, hps, memo) for i in range(len(self._chunks))]
        return None if any(p is None for p in plan) else plan

    def apply_fused(self, i, groups, tag_value, stop=None) -> None:
        self.fused.apply(i, groups, tag_value, stop)

    def restore_fused(self, i, tag_value) -> int:
        return self.fused.restore(i, tag_value)

    def step_tensors(self, counts, hps, device=None):
        """Per-slice step counters for this step (Adam increments them; the counts live in the journal)."""
        if not self._kind.has_step:
            return None
        from torch.optim.optimizer import _get_scalar_dtype
        t = torch.tensor([float(counts[s.param]) for c in self._chunks for s in c], dtype=_get_scalar_dtype())
        if any(hp.get("fused") or hp.get("capturable") for hp in hps):
            t = t.to(self._params[0].flat.device)
        out, k = [], 0
        for c in self._chunks:
            out.append([t[k + j] for j in range(len(c))])
            k += len(c)
        return out

    def copy_to_undo(self, i) -> None:
        torch._foreach_copy_(self._undo_dst[i], self._undo_src[i])

    def copy_from_undo(self, i) -> None:
        torch._foreach_copy_(self._undo_src[i], self._undo_dst[i])

    def scribble(self, i) -> None:
        """Fault injection only (copy steps): leave chunk ``i`` visibly half written before the kill.
        A fused step is stopped inside its kernel instead (``apply_fused(..., stop=)``)."""
        for t in self._undo_src[i]:
            t[: max(1, t.numel() // 2)].fill_(float("nan"))
