"""Carrying out one chunk: views over anchored memory, undo copies, the optimizer call.

Built once per worker from the chunk plan: for chunk ``i``, the parameter / gradient /
state slices (views of anchored tensors, no copies) and their places in undo slot
``i % 2``.  The protocol (``optimizer.py``) decides *when*; this module only does.
"""
from __future__ import annotations

import torch

from . import chunking
from .protocol import slot_of


class ChunkExecutor:
    def __init__(self, params, chunks, elem_sizes, undo_slots, kind) -> None:
        self._params = params
        self._chunks = chunks
        self._kind = kind
        self._views, self._undo_src, self._undo_dst = [], [], []
        for i, chunk in enumerate(chunks):
            offs = chunking.layout(chunk, elem_sizes)
            views, src, dst = [], [], []
            slot = undo_slots[slot_of(i)]
            for s, row in zip(chunk, offs):
                q = params[s.param]
                pv = q.flat[s.start:s.stop]
                sv = {k: t[s.start:s.stop] for k, t in q.sflat.items()}
                views.append((pv, q.gflat[s.start:s.stop], sv))
                n = s.stop - s.start
                for t, off in zip([pv] + list(sv.values()), row):
                    src.append(t)
                    dst.append(slot[off:off + n * t.element_size()].view(t.dtype))
            self._views.append(views)
            self._undo_src.append(src)
            self._undo_dst.append(dst)

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
        """Fault injection only: leave chunk ``i`` visibly half written before the kill."""
        for t in self._undo_src[i]:
            t[: max(1, t.numel() // 2)].fill_(float("nan"))
