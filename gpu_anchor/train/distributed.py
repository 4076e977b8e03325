"""Agreeing on the step to resume across ranks (decision logic is plain Python).

Each rank journals its own protocol state in its own device's daemon.  In ``step``
every rank commits its gradient-finalization boundary and then joins a collective
(``boundary_barrier``) before it writes any chunk.  Hence, at any instant:

* if some rank has not committed the boundary of step ``s``, no rank has written a
  chunk of step ``s`` (they are all before the barrier or dead);
* a rank that passed the barrier of step ``s`` knows that every rank holds the redo
  log of step ``s``, so every rank can finish step ``s`` alone.

At restart every rank reports ``(committed_steps, in_flight_step or None)``; ``decide``
returns what this rank does: ``"finish"`` its in-flight step, ``"discard"`` it (nobody
wrote a chunk of it), or ``"none"``; after that all ranks stand at the same step.
"""
from __future__ import annotations


class DisagreementError(RuntimeError):
    pass


def decide(states: list[tuple[int, int | None]], rank: int) -> str:
    """``states[r] = (committed, in_flight)``; ``in_flight`` is ``committed`` or ``None``."""
    lo = min(c for c, _ in states)
    hi = max(c + (1 if f is not None else 0) for c, f in states)
    if hi - lo > 1:
        raise DisagreementError(f"ranks are more than one step apart: {states}")
    for c, f in states:
        if f is not None and f != c:
            raise DisagreementError(f"corrupt state {states}")
    committed, in_flight = states[rank]
    if hi == lo:
        return "none"
    # hi == lo + 1: step ``lo`` is in flight or committed somewhere.
    everyone_has_redo = all(c == hi or f == lo for c, f in states)
    if everyone_has_redo:
        return "finish" if in_flight is not None else "none"
    if any(c == hi for c, _ in states):
        raise DisagreementError(f"a rank committed step {lo} while another never finalized it: {states}")
    return "discard" if in_flight is not None else "none"


def decide_device(states: list[tuple[int, int | None, bool]], rank: int) -> str:
    """The device-progress variant: ``states[r] = (committed, in_flight, started)``.

    ``started``: rank r's device word shows its in-flight step (the word moves only after
    backward and the boundary barrier on that rank's stream, and the barrier completes
    only once every rank's backward has).  So if any rank started step ``s``, or already
    committed it, every rank holds its final gradients and finishes it; otherwise no rank
    wrote a chunk of it and every rank discards it.
    """
    for c, f, _ in states:
        if f is not None and f != c:
            raise DisagreementError(f"corrupt state {states}")
    lo = min(c for c, _, _ in states)
    hi = max(c + (1 if f is not None else 0) for c, f, _ in states)
    if hi - lo > 1:
        raise DisagreementError(f"ranks are more than one step apart: {states}")
    went = hi > lo and any(c == hi or (f is not None and st) for c, f, st in states)
    if went and any(c == lo and f is None for c, f, _ in states):
        raise DisagreementError(f"step {lo} went ahead on one rank while another never finalized it: {states}")
    if states[rank][1] is None:
        return "none"
    return "finish" if went else "discard"


def world():
    """``(rank, world_size)`` of the default process group, or ``(0, 1)`` without one."""
    try:
        import torch.distributed as dist
    except ImportError:
        return 0, 1
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def gather_states(state: tuple[int, int | None]) -> list[tuple[int, int | None]]:
    import torch.distributed as dist
    out: list = [None] * dist.get_world_size()
    dist.all_gather_object(out, state)
    return [tuple(s) for s in out]


class BoundaryBarrier:
    """One tiny all-reduce after the boundary commit; enqueued on the stream, no host wait."""

    def __init__(self, device) -> None:
        import torch
        import torch.distributed as dist
        self._dist = dist
        dev = device if dist.get_backend() == "nccl" else "cpu"
        self._flag = torch.ones(1, dtype=torch.int32, device=dev)

    def __call__(self) -> None:
        self._dist.all_reduce(self._flag, op=self._dist.ReduceOp.MAX)
