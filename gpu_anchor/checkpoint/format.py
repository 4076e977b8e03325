"""The checkpoint format (torch-free): what the supervisor and the workers both read.

Layout (open formats)::

    DIR/step-000000500/rank0/cuda0.safetensors     objects of one namespace on one device
    DIR/step-000000500/rank0/manifest.json         step, rank, world size, files, sizes, journals
    DIR/step-000000500/rank0/COMMITTED             written last, after fsync of everything else

A step is complete only when every rank 0..WORLD_SIZE-1 has COMMITTED and each file has
the size its manifest names, so a snapshot torn by a crash (of the worker, the node, or the
writer) is never taken for complete; the previous complete step is used instead.  The
writer and the restore (torch) are ``gpu_anchor.checkpoint.snapshot``; the journal keys a
checkpoint carries are in ``gpu_anchor.journal_keys``.
"""
from __future__ import annotations

import json
import os
import re
import shutil

FORMAT = "gpu-anchor-snapshot/1"      # manifest["format"]
# torch dtype name -> safetensors dtype code (the object files are safetensors)
SAFETENSORS_DTYPES = {"float32": "F32", "float16": "F16", "bfloat16": "BF16", "float64": "F64", "int64": "I64",
                      "int32": "I32", "int16": "I16", "int8": "I8", "uint8": "U8", "bool": "BOOL",
                      "float8_e4m3fn": "F8_E4M3", "float8_e5m2": "F8_E5M2"}
_STEP_RE = re.compile(r"^step-(\d{9})$")


def step_dir(directory: str, step: int) -> str:
    return os.path.join(directory, f"step-{step:09d}")


def rank_dir(directory: str, step: int, rank: int) -> str:
    return os.path.join(step_dir(directory, step), f"rank{rank}")


def read_manifest(rdir: str) -> dict | None:
    """The manifest of a committed rank directory whose files are whole, else None."""
    try:
        with open(os.path.join(rdir, "COMMITTED")) as f:
            marked = int(f.read().strip())
        with open(os.path.join(rdir, "manifest.json")) as f:
            man = json.load(f)
    except (OSError, ValueError):
        return None
    if man.get("step") != marked:
        return None
    for entry in man.get("files", []):
        try:
            if os.path.getsize(os.path.join(rdir, entry["file"])) != entry["bytes"]:
                return None
        except OSError:
            return None
    return man


def complete_ranks(sdir: str, world: int) -> dict[int, bool]:
    return {r: read_manifest(os.path.join(sdir, f"rank{r}")) is not None for r in range(world)}


def list_steps(directory: str) -> list[int]:
    if not directory or not os.path.isdir(directory):
        return []
    return sorted(int(m.group(1)) for m in map(_STEP_RE.match, os.listdir(directory)) if m)


def latest_complete(directory: str, world: int) -> int | None:
    """The newest step every rank committed (torn or partial steps are skipped)."""
    for step in reversed(list_steps(directory)):
        sdir = step_dir(directory, step)
        mans = [read_manifest(os.path.join(sdir, f"rank{r}")) for r in range(world)]
        if all(m is not None and m["world_size"] == world for m in mans):
            return step
    return None


def prune(directory: str, world: int, keep: int) -> None:
    """Delete complete steps beyond the newest ``keep``, and torn ones older than the newest complete."""
    steps = list_steps(directory)
    complete = [s for s in steps if all(complete_ranks(step_dir(directory, s), world).values())]
    if not complete:
        return
    keep_set = set(complete[-max(keep, 1):])
    newest = complete[-1]
    for s in steps:
        if s not in keep_set and s < newest:
            shutil.rmtree(step_dir(directory, s), ignore_errors=True)


