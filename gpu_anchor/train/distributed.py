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


def device_report(committed: int, in_flight: bool, cursor: int | None, chunks: int) -> tuple[int, int | None, bool]:
    """What a device-progress rank reports to ``decide_device``: ``(committed, in_flight, started)``.

    ``cursor`` is ``device_resume_point``'s answer for the in-flight step.  A step whose
    device word says it is fully written (``cursor == chunks``) only lacks its commit (the
    journal lags the device by up to one step): the rank reports it as committed and lands
    that commit itself — otherwise it would look a step behind a peer that landed it.
    """
    if not in_flight:
        return committed, None, False
    if cursor == chunks:
        return committed + 1, None, False
    return committed, committed, cursor is not None


def decide_device(states: list[tuple[int, int | None, bool]], rank: int) -> str:
    """The device-progress variant: ``states[r] = (committed, in_flight, started)`` (see
    ``device_report``); ``started``: rank r's device word shows its in-flight step.

    A word moves past the boundary only after backward and the boundary barrier on that
    rank's stream, and the barrier completes only once every rank's backward has.  So a
    step ``f`` went ahead — every rank holds its final gradients and must finish it — if
    some rank started it or committed it; otherwise no device wrote a chunk of it and it
    is discarded.  Each rank's journal lags its device by up to one step, so ranks may be
    two steps apart here (one still finishing ``s``, another having announced ``s+1``);
    after the decisions every rank must stand at the same step, else the states cannot
    come from one job and ``DisagreementError`` is raised.
    """
    for c, f, _ in states:
        if f is not None and f != c:
            raise DisagreementError(f"corrupt state {states}")

    def went(f: int) -> bool:
        return any(c > f or (g == f and st) for c, g, st in states)

    ends = {c + (1 if f is not None and went(f) else 0) for c, f, _ in states}
    if len(ends) != 1:
        raise DisagreementError(f"ranks cannot agree on a step: {states}")
    f = states[rank][1]
    if f is None:
        return "none"
    return "finish" if went(f) else "discard"


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
