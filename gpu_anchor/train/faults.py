"""Fault injection for the step protocol: SIGKILL this process at a named point.

Arm with ``GPU_ANCHOR_TRAIN_FAULT="<phase>@<step>[:<chunk>]"`` (read when an
``AnchoredOptimizer`` is built) or ``arm(...)`` in-process; phases are
``protocol.PHASES``.  The kill is a real SIGKILL: no finalizers, no atexit, exactly
what the recovery must survive.  Unarmed, ``hit`` costs one comparison.
"""
from __future__ import annotations

import os
import signal

from .protocol import PHASES

ENV = "GPU_ANCHOR_TRAIN_FAULT"

_armed: tuple[str, int, int | None] | None = None
observer = None   # optional callable(phase, step, chunk): lets tests count visited points


def parse(spec: str) -> tuple[str, int, int | None]:
    try:
        phase, rest = spec.split("@", 1)
        step_s, _, chunk_s = rest.partition(":")
        out = (phase.strip(), int(step_s), int(chunk_s) if chunk_s else None)
    except ValueError:
        raise ValueError(f"bad fault spec {spec!r}: expected '<phase>@<step>[:<chunk>]'") from None
    if out[0] not in PHASES:
        raise ValueError(f"bad fault spec {spec!r}: phase must be one of {', '.join(PHASES)}")
    return out


def arm(spec: str | None) -> None:
    global _armed
    _armed = parse(spec) if spec else None


def arm_from_env() -> None:
    spec = os.environ.get(ENV)
    if spec:
        arm(spec)


def armed(phase: str, step: int, chunk: int | None = None) -> bool:
    a = _armed
    return a is not None and a[0] == phase and a[1] == step and (a[2] is None or a[2] == chunk)


def hit(phase: str, step: int, chunk: int | None = None, before_kill=None) -> None:
    """Called by the protocol at each point; kills the process if this point is armed."""
    if observer is not None:
        observer(phase, step, chunk)
    if _armed is not None and armed(phase, step, chunk):
        if before_kill is not None:
            before_kill()
        os.kill(os.getpid(), signal.SIGKILL)
