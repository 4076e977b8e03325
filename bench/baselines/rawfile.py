"""Raw snapshot files: one byte buffer per generation plus an atomically replaced index.

``<dir>/gen<k>.bin`` holds the bytes at the offsets of ``state.layout``; ``<dir>/latest.json``
names the complete generation, its step and layout.  The index is replaced by rename
only after the generation is complete, so a kill at any point leaves the previous
checkpoint restorable; the older generation is deleted after the index moves on.
"""
from __future__ import annotations

import json
import os

import torch

from . import state


def commit(directory: str, gen_file: str, step: int, entries: list[dict], total: int) -> None:
    tmp = os.path.join(directory, "latest.json.tmp")
    with open(tmp, "w") as f:
        json.dump({"step": step, "file": gen_file, "total": total, "layout": entries}, f)
    os.replace(tmp, os.path.join(directory, "latest.json"))


def latest(directory: str) -> dict | None:
    try:
        with open(os.path.join(directory, "latest.json")) as f:
            return json.load(f)
    except FileNotFoundError:
        return None


def remove_others(directory: str, keep: str) -> None:
    for n in os.listdir(directory):
        if n.startswith("gen") and n != keep and not n.endswith(".tmp"):
            try:
                os.unlink(os.path.join(directory, n))
            except FileNotFoundError:
                pass


def map_file(path: str, total: int) -> torch.Tensor:
    """The file as a uint8 tensor over a shared mapping (page cache, no copy)."""
    return torch.from_file(path, shared=True, size=total, dtype=torch.uint8)


def restore_into(directory: str, named: list[tuple[str, torch.Tensor]]) -> int | None:
    """Copy the latest complete generation into ``named``'s tensors; returns its step."""
    idx = latest(directory)
    if idx is None:
        return None
    entries, _ = state.layout(named)
    if state.layout_json(entries) != state.layout_json(idx["layout"]):
        raise RuntimeError(f"checkpoint in {directory} was written for another model/optimizer layout")
    buf = map_file(os.path.join(directory, idx["file"]), idx["total"])
    state.copy_batched([t for _, t in named], state.views(buf, entries), non_blocking=False)
    state.sync(named[0][1].device)
    return int(idx["step"])
