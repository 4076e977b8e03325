"""What the supervisor asks of a worker's checkpoints (torch-free).

The supervisor builds one ``CheckpointSettings`` from its command line; a worker is another
process, so the settings cross in environment variables (``to_env`` / ``from_env``, the
table in docs/supervisor.md) and nowhere else: library code takes a ``CheckpointSettings``.
"""
from __future__ import annotations

import os
from dataclasses import dataclass

CHECKPOINT_MODES = ("concurrent", "stop-the-world")
RESTORE_MODES = ("full", "on_demand")

DIR_ENV = "GPU_ANCHOR_CHECKPOINT_DIR"
EVERY_ENV = "GPU_ANCHOR_CHECKPOINT_EVERY"
KEEP_ENV = "GPU_ANCHOR_CHECKPOINT_KEEP"
MODE_ENV = "GPU_ANCHOR_CHECKPOINT_MODE"
RESTORE_MODE_ENV = "GPU_ANCHOR_RESTORE_MODE"
RESTORE_ENV = "GPU_ANCHOR_RESTORE"        # DIR:STEP (run) or auto:DIR (torchrun): restore before user code
ENV_NAMES = (DIR_ENV, EVERY_ENV, KEEP_ENV, MODE_ENV, RESTORE_MODE_ENV, RESTORE_ENV)


@dataclass(frozen=True)
class CheckpointSettings:
    directory: str | None = None     # None: no checkpoints
    every: int = 0                   # steps between checkpoints (0: none)
    keep: int = 2                    # complete steps kept on disk
    mode: str = "concurrent"         # concurrent | stop-the-world
    restore_mode: str = "full"       # full | on_demand (after a destructive failure)
    restore: str | None = None       # what to restore before the user's code (see RESTORE_ENV)

    def __post_init__(self) -> None:
        if self.mode not in CHECKPOINT_MODES:
            raise ValueError(f"checkpoint mode must be one of {CHECKPOINT_MODES}, not {self.mode!r}")
        if self.restore_mode not in RESTORE_MODES:
            raise ValueError(f"restore mode must be one of {RESTORE_MODES}, not {self.restore_mode!r}")

    @property
    def enabled(self) -> bool:
        return bool(self.directory) and self.every > 0

    @property
    def concurrent(self) -> bool:
        return self.enabled and self.mode == "concurrent"

    def due(self, step: int) -> bool:
        """A checkpoint is taken at this committed step."""
        return self.enabled and step > 0 and step % self.every == 0

    def to_env(self) -> dict[str, str]:
        env = {RESTORE_MODE_ENV: self.restore_mode}
        if self.enabled:
            env.update({DIR_ENV: os.path.abspath(self.directory), EVERY_ENV: str(self.every),
                        KEEP_ENV: str(self.keep), MODE_ENV: self.mode})
        if self.restore:
            env[RESTORE_ENV] = self.restore
        return env

    @classmethod
    def from_env(cls, env=None) -> "CheckpointSettings":
        env = os.environ if env is None else env
        return cls(directory=env.get(DIR_ENV) or None, every=int(env.get(EVERY_ENV, "0") or 0),
                   keep=int(env.get(KEEP_ENV, "2") or 2), mode=env.get(MODE_ENV) or "concurrent",
                   restore_mode=env.get(RESTORE_MODE_ENV) or "full", restore=env.get(RESTORE_ENV) or None)
