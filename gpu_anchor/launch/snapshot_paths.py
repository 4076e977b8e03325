"""Reading the checkpoint directory (torch-free, for the supervisor): which steps
are complete.  Layout and commit rule: see ``gpu_anchor.launch.snapshot``."""
from __future__ import annotations

import json
import os
import re
import shutil

DIR_ENV, EVERY_ENV, KEEP_ENV = "GPU_ANCHOR_CHECKPOINT_DIR", "GPU_ANCHOR_CHECKPOINT_EVERY", "GPU_ANCHOR_CHECKPOINT_KEEP"
RESTORE_ENV = "GPU_ANCHOR_RESTORE"
MODE_ENV = "GPU_ANCHOR_CHECKPOINT_MODE"          # concurrent (default) | stop-the-world
RESTORE_MODE_ENV = "GPU_ANCHOR_RESTORE_MODE"     # full (default) | on_demand
CHECKPOINT_MODES, RESTORE_MODES = ("concurrent", "stop-the-world"), ("full", "on_demand")
_STEP_RE = re.compile(r"^step-(\d{9})$")


def step_dir(directory: str, step: int) -> str:
    return os.path.join(directory, f"step-{step:09d}")


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


