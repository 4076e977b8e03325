"""The worker side of ``gpu-anchor run --checkpoint-every`` and of on-demand restore.

The supervisor's step listener (``gpu_anchor.launch.boundary``) calls ``boundary`` after
every committed step when the supervisor asked for checkpoints in ``concurrent`` mode (the
default; ``--checkpoint-mode stop-the-world`` keeps ``snapshot.at_step``).  One
``ConcurrentCheckpointer`` per process, created at the first due step with the clients
passed there, policy soft copy-on-write: the checkpoint is the state of the due step (a
consistent point the caller guarantees), copied while the job runs on; a flight that is
through completes at a later boundary and is written in the background; an unfinished
one is finished at interpreter exit.  Later calls must pass the same namespaces.

``restore_on_demand`` is the worker's ``GPU_ANCHOR_RESTORE_MODE=on_demand`` hook: the
checkpoint's objects are bound and its journal committed with the "restoring" markers,
the user's code starts at once, each op touching an unloaded object loads it first, and
``poll`` (called from every ``boundary``, on the training thread) removes the tracker's
dispatch mode once everything is in.  A crash before that leaves the namespaces marked
inconsistent, so the supervisor restores again.  Code that reaches anchored memory
outside aten ops before the restore is done (NCCL on a just-restored buffer, raw
pointers) must call ``ensure_restored()`` first.
"""
from __future__ import annotations

import atexit

from .settings import CheckpointSettings

_ckpt = None
_restoring = None     # (OnDemandRestore, tracker) while objects stream in


def boundary(step: int, clients, settings: CheckpointSettings) -> bool:
    """Checkpoint bookkeeping at a committed step; True if a checkpoint started here."""
    global _ckpt
    poll()
    if not settings.directory:
        return False
    if _ckpt is None:
        if not settings.due(step):
            return False
        from .concurrent import ConcurrentCheckpointer
        from .writeset import WriteSetTracker
        _ckpt = ConcurrentCheckpointer.from_env(list(clients), WriteSetTracker(), settings, policy="cow")
        atexit.register(finish)
    before = len(_ckpt.results), _ckpt.in_flight
    _ckpt.boundary(step)
    started = _ckpt.in_flight and (not before[1] or len(_ckpt.results) > before[0])
    return bool(started)


def finish() -> None:
    """Complete and write an in-flight checkpoint (at exit; tests)."""
    if _ckpt is not None:
        _ckpt.finish()


def restore_on_demand(directory: str, step: int, rank: int, device_map: dict) -> dict:
    """Start an on-demand restore of ``step`` and activate its tracker on this thread."""
    global _restoring
    from .restore import OnDemandRestore
    from .writeset import WriteSetTracker
    tracker = WriteSetTracker()
    r = OnDemandRestore(directory, tracker, step=step, rank=rank, device_map=device_map).start()
    tracker.__enter__()
    _restoring = (r, tracker)
    return dict(r.stats, objects=len(r.targets), mode="on_demand")


def poll() -> bool:
    """True when no on-demand restore is streaming any more (its tracker is then off)."""
    global _restoring
    if _restoring is None:
        return True
    r, tracker = _restoring
    if not r.done:
        return False
    r.wait()
    tracker.__exit__(None, None, None)
    _restoring = None
    return True


def ensure_restored() -> None:
    """Block until an on-demand restore in progress has loaded everything."""
    if _restoring is not None:
        _restoring[0].wait()
        poll()
