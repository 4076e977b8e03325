"""What ``gpu-anchor run`` was asked to do (``SupervisorConfig``, nested per concern), and how to
read its command line (torch-free)."""
from __future__ import annotations

import os
import re
import shutil
import socket
from dataclasses import dataclass, field

from gpu_anchor.checkpoint.settings import CheckpointSettings

_PYTHON_RE = re.compile(r"^python(\d+(\.\d+)?)?$")
_PY_FLAGS_NOARG = {"-u", "-O", "-OO", "-B", "-E", "-s", "-I", "-S", "-q", "-b", "-bb", "-P"}
_PY_FLAGS_ARG = {"-X", "-W"}


# What every warm worker imports before it forks: torch, gpu-anchor's own worker-side modules,
# and torch._dynamo, which torch.optim.Optimizer's constructor imports at its first call (torch's
# dynamo-disable wrapper; managed_scope keeps it out): ~1.1 s a worker otherwise pays after a kill.
DEFAULT_PRELOAD = ("torch", "torch._dynamo", "gpu_anchor.scope", "gpu_anchor.train.optimizer")


@dataclass
class RestartPolicy:
    """The decision table's knobs (docs/supervisor.md), for ``run`` and ``serve`` alike."""
    max_restarts: int = 3          # restarts and restores before the job stops
    backoff: float = 1.0           # seconds before a restart that follows a failure without progress (doubles)
    crash_loop: int = 3            # failures in a row at the same step with the same exit: stop (0: never)
    hang_timeout: float = 0.0      # no new committed step for this long: kill the group (0: off)


def _standby_from_env() -> bool | None:
    """``GPU_ANCHOR_WARM_POOL=1`` / ``0``: a parent's choice (benchmarks compare both ways); unset: None."""
    v = os.environ.get("GPU_ANCHOR_WARM_POOL")
    return None if v in (None, "") else v == "1"


@dataclass
class WarmStart:
    """How a (re)started worker gets its interpreter."""
    enabled: bool = True           # a fork server (zygote) that preloaded ``preload``; False: cold starts
    # a standby worker per rank (its CUDA context made) takes over after a failure.  None (the
    # default): on when the job runs on GPUs — the fast path without flags — and off for CPU-only
    # jobs, where a standby would save only a fork (``resolve_standby``)
    standby: bool | None = field(default_factory=_standby_from_env)
    # module:function each standby runs on scratch tensors before any failure (runtime.warm.run_prewarm)
    prewarm: str | None = None
    # without ``prewarm``: each standby replays one step of a 1-layer copy of the job's model, as
    # recorded by the worker's first step (runtime.auto_prewarm; transformers models)
    auto_prewarm: bool = True
    # a failed worker's successor starts at the worker's death, not its exit, and waits at a
    # start gate before touching anchored state until the failure is classified (early_start.py)
    early_start: bool = True
    preload: list[str] = field(default_factory=lambda: list(DEFAULT_PRELOAD))


def resolve_standby(warm: WarmStart, devices: list[str]) -> bool:
    """Whether ``gpu-anchor run`` keeps standbys: as asked, else on for GPU jobs (a standby there
    saves the CUDA context and, with ``prewarm``, the first step's kernel loading), off for CPU
    jobs.  Never without the fork server (standbys are forked from it)."""
    if not warm.enabled:
        return False
    if warm.prewarm:
        return True
    if warm.standby is not None:
        return warm.standby
    return any(d.startswith("cuda") for d in devices)


@dataclass
class ChaosConfig:
    """Fault injection (``launch.chaos``)."""
    kills: int = 0
    every: float = 2.0
    seed: int | None = None
    target: str = "worker"         # worker | daemon


@dataclass
class SupervisorConfig:
    """Everything ``gpu-anchor run`` was asked (nested, one dataclass per concern)."""
    command: list[str]
    nproc: int = 1
    namespace: str | None = None
    device_type: str = "auto"
    master_addr: str = "127.0.0.1"
    keep_daemons: bool = False
    resume: bool = True            # restore the newest checkpoint when the daemons hold nothing of the job
    quiet: bool = False
    restart: RestartPolicy = field(default_factory=RestartPolicy)
    warm: WarmStart = field(default_factory=WarmStart)
    checkpoint: CheckpointSettings = field(default_factory=CheckpointSettings)
    chaos: ChaosConfig = field(default_factory=ChaosConfig)


def split_python(command: list[str]) -> tuple[str, list[str]] | None:
    """``(interpreter, target)`` for a ``python [flags] script|-m mod|-c code ...`` command, else None."""
    if not command or not _PYTHON_RE.match(os.path.basename(command[0])):
        return None
    python = shutil.which(command[0]) or command[0]
    i = 1
    while i < len(command):
        a = command[i]
        if a in _PY_FLAGS_NOARG:
            i += 1
        elif a in _PY_FLAGS_ARG:
            i += 2
        elif a in ("-m", "-c"):
            return (python, command[i:]) if i + 1 < len(command) else None
        elif a.startswith("-"):
            return None  # unknown interpreter flag: run it cold, exactly as given
        else:
            return python, command[i:]
    return None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
