"""The supervisor's decision table, as a pure function (torch-free, no processes).

    decide(Observation) -> Decision(action, reason)

Inputs are what the supervisor observed after a worker left: how it left
(exit code or signal), whether the daemons answer and are the same instances
the job started with, device health (NVML where present), and whether the
job's anchored state is consistent (its journal says so and its objects are
there).  Actions:

- ``done``      every rank exited 0: the job is finished.
- ``restart``   shallow failure: restart the local group in place; workers
                reattach to the anchored state (nothing is copied).
- ``restore``   destructive or unsure: fresh daemon(s), restore the last
                complete checkpoint into them, then restart.
- ``stop``      give up: restarts exhausted, crash loop, or nothing to restore.

The table (first matching row wins) is in docs/supervisor.md; keep both in step.
"""
from __future__ import annotations

import signal
from dataclasses import dataclass

# Signals after which the process may have scribbled over memory it could write.
# Anchored state is still protected by the job's commit protocol (only committed
# steps are ever read back), so these are shallow too; listed for the reason text.
_CRASH_SIGNALS = {signal.SIGSEGV, signal.SIGBUS, signal.SIGILL, signal.SIGFPE, signal.SIGABRT}


@dataclass(frozen=True)
class Exit:
    """How one worker left: ``code`` (>= 0) or ``signal`` (the number that killed it)."""
    rank: int
    code: int | None = None
    signal: int | None = None

    @classmethod
    def from_status(cls, rank: int, returncode: int) -> "Exit":
        """From a ``Popen.returncode``-style value (negative = killed by that signal)."""
        return cls(rank, signal=-returncode) if returncode < 0 else cls(rank, code=returncode)

    @property
    def ok(self) -> bool:
        return self.signal is None and self.code == 0

    def describe(self) -> str:
        if self.signal is not None:
            try:
                name = signal.Signals(self.signal).name
            except ValueError:
                name = f"signal {self.signal}"
            return f"rank {self.rank} killed by {name}"
        return f"rank {self.rank} exited with code {self.code}"

    def key(self) -> str:
        return f"sig{self.signal}" if self.signal is not None else f"exit{self.code}"


@dataclass(frozen=True)
class Observation:
    """Everything ``decide`` looks at.  ``device_healthy`` None = unknown (no NVML)."""
    exits: tuple[Exit, ...]                 # the first failure first
    group_size: int
    daemons_alive: bool = True
    daemons_same: bool = True               # same daemon instances as when the job bound its state
    device_healthy: bool | None = True
    device_problem: str = ""
    journal_consistent: bool = True
    journal_problem: str = ""
    restarts_done: int = 0
    max_restarts: int = 3
    have_checkpoint: bool = False
    crash_loop: bool = False                # same step + same exit, repeatedly (see CrashLoop)
    crash_loop_detail: str = ""


@dataclass(frozen=True)
class Decision:
    action: str          # done | restart | restore | stop
    reason: str
    kind: str = ""       # shallow | destructive | "" (done/stop)


def decide(obs: Observation) -> Decision:
    if not obs.exits:
        raise ValueError("decide() needs at least one worker exit")
    first = obs.exits[0]
    if len(obs.exits) == obs.group_size and all(e.ok for e in obs.exits):
        return Decision("done", "all ranks exited 0")
    if first.ok:
        # A rank finished while others still run: not a failure; the caller waits.
        return Decision("done", f"rank {first.rank} finished (exit 0)")
    what = first.describe()
    if obs.restarts_done >= obs.max_restarts:
        return Decision("stop", f"{what}; restart budget spent ({obs.restarts_done}/{obs.max_restarts}, --max-restarts)")
    if obs.crash_loop:
        return Decision("stop", f"{what}; crash loop: {obs.crash_loop_detail}. Anchored state is kept: fix the "
                                "code and rerun the same command to continue from the last committed step")

    destructive = []
    if not obs.daemons_alive:
        destructive.append("a daemon is not answering (its memory is gone)")
    elif not obs.daemons_same:
        destructive.append("a daemon was replaced since the state was bound (its memory is gone)")
    if obs.device_healthy is False:
        destructive.append(f"device unhealthy: {obs.device_problem or 'NVML reports a fault'}")
    if obs.daemons_alive and obs.daemons_same and not obs.journal_consistent:
        destructive.append(f"anchored state inconsistent: {obs.journal_problem or 'journal check failed'}")
    if destructive:
        if not obs.have_checkpoint:
            return Decision("stop", f"{what}; {'; '.join(destructive)}; no complete checkpoint to restore "
                                    "(use --checkpoint-dir/--checkpoint-every)")
        return Decision("restore", f"{what}; {'; '.join(destructive)} -> restore last checkpoint", "destructive")

    sig = first.signal
    how = "crash" if sig in _CRASH_SIGNALS else ("killed" if sig is not None else "exit")
    health = "device healthy" if obs.device_healthy else "device health unknown (no NVML)"
    return Decision("restart", f"{what} ({how}); daemons alive, {health}, journal consistent -> restart in place",
                    "shallow")


class CrashLoop:
    """Remembers failures as ``(committed step, exit key)``; a loop is the same pair
    ``limit`` times in a row (the job makes no progress and dies the same way)."""

    def __init__(self, limit: int = 3) -> None:
        self.limit = limit
        self._last: tuple | None = None
        self._count = 0

    def record(self, step: int | None, exit_key: str) -> bool:
        point = (step, exit_key)
        self._count = self._count + 1 if point == self._last else 1
        self._last = point
        return self.limit > 0 and self._count >= self.limit

    def detail(self) -> str:
        step, key = self._last or (None, "")
        at = f"at step {step}" if step is not None else "before the first committed step"
        return f"{self._count} failures in a row {at} with {key}"

    def reset(self) -> None:
        self._last, self._count = None, 0
