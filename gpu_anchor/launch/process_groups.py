"""A worker keeps every torch process group it destroys until it exits (torch-free until torch is).

Why: ``~ProcessGroupGloo`` joins gloo's worker threads, and a gloo worker thread may need the GIL
to finish: the last step's DDP all-reduce captured the thread-local state of backward, which
holds a Python object (torch stashes the ``contextvars`` context there), and the thread that ran
the all-reduce releases that work, under the GIL, some time after it completed.  When the last
reference to the group is dropped by Python code — after ``dist.destroy_process_group()``, the
DDP module's reducer, freed when ``main()`` returns — the destructor runs with the GIL held and
waits for a thread that waits for the GIL: the worker hangs for ever (the CI hang of
docs/supervisor.md, forced with gdb there).  A worker ends with ``os._exit``
(``runtime.exit_path``), which runs no destructor: so a group kept referenced here is never
destroyed in the process, and nothing joins those threads.

What changes for the user: ``dist.destroy_process_group`` does all it did (each backend's
``shutdown``, the group's bookkeeping cleared, a new ``init_process_group`` possible), except
freeing the destroyed groups' objects: their threads and sockets go when the worker exits.

``install()`` patches ``torch.distributed.destroy_process_group`` now if torch is imported, else
when ``torch.distributed.distributed_c10d`` is first imported (a cold worker imports torch in the
user's code).
"""
from __future__ import annotations

import functools
import importlib.abc
import sys

_C10D = "torch.distributed.distributed_c10d"
kept: list = []      # every group a destroy_process_group call was given or implied, until os._exit


def _patch(c10d) -> None:
    original = c10d.destroy_process_group
    if getattr(original, "_gpu_anchor_keeps_groups", False):
        return

    @functools.wraps(original)
    def destroy_process_group(group=None):
        if group is None or group is c10d.GroupMember.WORLD:
            kept.extend(c10d._world.pg_map)            # WORLD destroys every group
        elif group is not c10d.GroupMember.NON_GROUP_MEMBER:
            kept.append(group)
        return original(group)

    destroy_process_group._gpu_anchor_keeps_groups = True
    c10d.destroy_process_group = destroy_process_group
    dist = sys.modules.get("torch.distributed")
    if dist is not None and getattr(dist, "destroy_process_group", None) is original:
        dist.destroy_process_group = destroy_process_group


class _PatchOnImport(importlib.abc.MetaPathFinder):
    """Patches ``distributed_c10d`` right after it executes (before ``torch.distributed`` copies
    its names), then leaves ``sys.meta_path``."""

    def find_spec(self, fullname, path, target=None):
        if fullname != _C10D:
            return None
        sys.meta_path.remove(self)
        import importlib.util
        spec = importlib.util.find_spec(fullname)
        if spec is None or spec.loader is None:
            return spec
        run = spec.loader.exec_module

        def exec_module(module):
            run(module)
            _patch(module)
        spec.loader.exec_module = exec_module
        return spec


def install() -> None:
    """Keep destroyed process groups alive until this worker's ``os._exit`` (see the module docstring)."""
    c10d = sys.modules.get(_C10D)
    if c10d is not None:
        _patch(c10d)
    elif not any(isinstance(f, _PatchOnImport) for f in sys.meta_path):
        sys.meta_path.insert(0, _PatchOnImport())
