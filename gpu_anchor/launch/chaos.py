"""Fault injection for demos and tests: SIGKILL workers (or a daemon) at random instants.

A kill is armed only once the current generation of workers has finished a
step (so every kill interrupts real work and every recovery is measured), then
fires after a random delay in [0.5, 1.5] × ``every`` seconds.
"""
from __future__ import annotations

import os
import random
import signal
import time


class Chaos:
    def __init__(self, kills: int = 0, every: float = 1.0, seed: int | None = None, target: str = "worker") -> None:
        if kills < 0 or every <= 0:
            raise ValueError("--chaos-kills must be >= 0 and --chaos-kill-every > 0")
        if target not in ("worker", "daemon"):
            raise ValueError(f"--chaos-target must be worker or daemon, got {target!r}")
        self.left = kills
        self.every = every
        self.target = target
        self.rng = random.Random(seed)
        self.due: float | None = None

    @property
    def active(self) -> bool:
        return self.left > 0

    def arm(self) -> None:
        """The generation made progress: schedule the next kill (if any left and none scheduled)."""
        if self.left > 0 and self.due is None:
            self.due = time.monotonic() + self.every * self.rng.uniform(0.5, 1.5)

    def disarm(self) -> None:
        self.due = None

    def timeout(self) -> float | None:
        return None if self.due is None else max(0.0, self.due - time.monotonic())

    def fire(self, worker_pids: dict[int, int], daemon_pids: dict[str, int]) -> tuple[str, int] | None:
        """Kill something if due; returns (what, pid)."""
        if self.due is None or time.monotonic() < self.due or self.left <= 0:
            return None
        self.due = None
        if self.target == "daemon" and daemon_pids:
            dev = self.rng.choice(sorted(daemon_pids))
            what, pid = f"daemon {dev}", daemon_pids[dev]
        elif worker_pids:
            rank = self.rng.choice(sorted(worker_pids))
            what, pid = f"rank {rank}", worker_pids[rank]
        else:
            return None
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            return None
        self.left -= 1
        return what, pid
