"""What ``gpu-anchor run`` was asked to do, and how to read its command line (torch-free)."""
from __future__ import annotations

import os
import re
import shutil
import socket
from dataclasses import dataclass, field

_PYTHON_RE = re.compile(r"^python(\d+(\.\d+)?)?$")
_PY_FLAGS_NOARG = {"-u", "-O", "-OO", "-B", "-E", "-s", "-I", "-S", "-q", "-b", "-bb", "-P"}
_PY_FLAGS_ARG = {"-X", "-W"}


# What every warm worker imports before it forks: torch, and gpu-anchor's own worker-side
# modules (managed_scope pulls in torch._dynamo, ~1.2 s a worker otherwise pays after a kill).
DEFAULT_PRELOAD = ("torch", "gpu_anchor.scope", "gpu_anchor.train.optimizer")


@dataclass
class RunConfig:
    command: list[str]
    nproc: int = 1
    namespace: str | None = None
    max_restarts: int = 3
    backoff: float = 1.0
    crash_loop: int = 3
    checkpoint_dir: str | None = None
    checkpoint_every: int = 0
    checkpoint_keep: int = 2
    checkpoint_mode: str = "concurrent"
    restore_mode: str = "full"
    device_type: str = "auto"
    warm: bool = True
    # a standby worker per rank (CUDA context made) takes over after a failure; the env
    # default lets benchmarks that drive `gpu-anchor run` compare both ways
    warm_pool: bool = field(default_factory=lambda: os.environ.get("GPU_ANCHOR_WARM_POOL") == "1")
    # module:function each standby runs on scratch tensors before any failure (runtime.warm.run_prewarm)
    prewarm: str | None = None
    preload: list[str] = field(default_factory=lambda: list(DEFAULT_PRELOAD))
    keep_daemons: bool = False
    resume: bool = True
    chaos_kills: int = 0
    chaos_every: float = 2.0
    chaos_seed: int | None = None
    chaos_target: str = "worker"
    master_addr: str = "127.0.0.1"
    hang_timeout: float = 0.0
    quiet: bool = False


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
