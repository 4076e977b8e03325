"""Adoption: native tensors that the block's modules and optimizers hold are anchored at exit.

Loaders make tensors the dispatch mode never turns into placeholders: transformers
loads weights on a thread pool, ``torch.load`` and safetensors build tensors over
storages they read themselves, ``accelerate`` and ``load_state_dict(assign=True)`` put
those tensors into modules.  At the scope's exit every *native* tensor that is a
parameter or buffer of a module, or optimizer state, reachable from the block's locals,
on a device whose daemon answers, and not already anchored, is adopted:

- tensors are grouped by the bytes they cover in one storage (a tensor and its views;
  weights that share a file mapping but not bytes stay apart); each group is one
  object, named by the first access path reaching a contiguous tensor that covers it
  whole, else by the first path + ``@base`` (bytes);
- *created*: the native bytes are copied into the anchored memory; *matched*: the
  anchored bytes win — a restart's fresh load from disk is dropped, never applied;
- every tensor of the group is swapped, in place, for the same view of the anchored
  memory (identity, ``Parameter``-ness, ``requires_grad`` and attributes kept).

Tensors that stay native are reported with the reason (:func:`classify`).
"""
from __future__ import annotations

import torch

from gpu_anchor.client.client import anchored_name

from .placeholders import Placeholder, Store


class Adopted(Store):
    """One adopted object: the native tensors over it and the byte offset of its start."""

    __slots__ = ("members", "lo")


def _span(t: torch.Tensor) -> int:
    """Elements from the tensor's first to its last, strides included."""
    if t.numel() == 0:
        return 0
    return 1 + sum((s - 1) * st for s, st in zip(t.shape, t.stride()) if s > 0)


def classify(tensors, anchored, reason) -> tuple[list, dict[str, str], list[str]]:
    """Split the walk's native tensors into adoption candidates and reported ones.

    ``tensors``: ``(path, tensor, is_state)`` in BFS order, only those the block made (not
    reachable before it); ``anchored(device)``: whether a daemon answers there;
    ``reason(device)``: why not.  Returns ``(candidates, not_anchored, unprotected_state)``:
    ``not_anchored`` maps path → reason; ``unprotected_state`` names the module parameters,
    buffers and optimizer state among them that no daemon holds.
    """
    cand, skipped, state_missing = [], {}, []
    for path, t, state in tensors:
        if isinstance(t, Placeholder) or t.numel() == 0:
            continue
        dev = t.device
        if dev.type == "meta":
            if state:
                skipped[path] = ("still on the meta device (never materialised): load it or call to_empty() "
                                 "in the block")
            continue
        if dev.type not in ("cpu", "cuda"):
            skipped[path] = f"on {dev}, which gpu-anchor does not manage"
            continue
        if anchored_name(t) is not None:
            continue                                  # already anchored (a Client's tensor)
        device = "cpu" if dev.type == "cpu" else f"cuda:{dev.index if dev.index is not None else 0}"
        if not anchored(device):
            skipped[path] = reason(device)
            if state:
                state_missing.append(path)
            continue
        if not state:
            skipped[path] = ("a plain tensor a loader made (not a module parameter/buffer or optimizer state): "
                             "not adopted; build it inside the block (then it is anchored), or delete it")
            continue
        if t.is_sparse or t.layout != torch.strided or t.is_quantized:
            skipped[path] = f"layout {t.layout} is not supported (strided dense tensors only)"
            state_missing.append(path)
            continue
        cand.append((path, t, device))
    return cand, skipped, state_missing


def group(cand, first_index: int) -> list[Adopted]:
    """One :class:`Adopted` store per run of overlapping bytes within one storage."""
    by_storage: dict[tuple, list] = {}
    for order, (path, t, device) in enumerate(cand):
        isz = t.element_size()
        lo = t.storage_offset() * isz
        by_storage.setdefault((device, t.untyped_storage().data_ptr()), []).append(
            (lo, lo + _span(t) * isz, order, path, t))
    out: list[Adopted] = []
    for (device, _), items in sorted(by_storage.items(), key=lambda kv: min(i[2] for i in kv[1])):
        items.sort(key=lambda i: (i[0], i[2]))
        runs: list[list] = []
        for it in items:
            if runs and it[0] < runs[-1][0][1]:
                runs[-1][0][1] = max(runs[-1][0][1], it[1])
                runs[-1][1].append(it)
            else:
                runs.append([[it[0], it[1]], [it]])
        for (lo, hi), members in runs:
            members.sort(key=lambda i: i[2])           # BFS order: the first path names the object
            whole = next((m for m in members if m[0] == lo and m[1] == hi and m[4].is_contiguous()), None)
            if whole is not None:
                name, meta = whole[3], torch.empty(whole[4].shape, dtype=whole[4].dtype, device="meta")
            else:
                name, meta = members[0][3] + "@base", torch.empty((hi - lo,), dtype=torch.uint8, device="meta")
            s = Adopted(first_index + len(out), device, meta)
            s.name, s.members, s.lo = name, [m[4] for m in members], lo
            out.append(s)
    return out


def member_view(base: torch.Tensor, t: torch.Tensor, lo: int) -> torch.Tensor:
    """The view of anchored ``base`` that native member ``t`` (starting ``lo`` bytes into it) maps to."""
    isz = t.element_size()
    off = t.storage_offset() * isz - lo
    flat = base.reshape(-1).view(torch.uint8)[off: off + _span(t) * isz].view(t.dtype)
    return flat.as_strided(t.shape, t.stride(), flat.storage_offset())


def fill(stores: list[Adopted]) -> None:
    """Created objects get their native bytes (the only copy adoption makes)."""
    with torch.no_grad():
        for s in stores:
            if s.status == "created":
                for t in s.members:
                    member_view(s.real, t, s.lo).copy_(t)


def swap_all(stores: list[Adopted], swap) -> None:
    """Swap every member, in place, for its view of the anchored memory."""
    for s in stores:
        for t in s.members:
            view = member_view(s.real, t, s.lo)
            if isinstance(t, torch.nn.Parameter):
                new = torch.nn.Parameter(view, requires_grad=t.requires_grad)
            else:
                new = view.detach().requires_grad_(t.requires_grad) if t.requires_grad else view.detach()
            for k, v in t.__dict__.items():
                new.__dict__.setdefault(k, v)
            swap(t, new)
            del new
        s.members = []
        s.real = None
