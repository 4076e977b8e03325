"""The interface every training checkpoint baseline implements.

    ck = METHODS[name](directory, device)
    step0 = ck.restore(model, opt)       # None: nothing saved yet (fresh start)
    ...
    ck.save(model, opt, step)            # call after opt.step(); returns when training may continue
    ck.wait()                            # background persistence finished (async methods)

``save`` returns only when the training loop may modify the state again, so its
duration is the method's blocking time.  A save that a SIGKILL interrupts must never
leave a corrupt checkpoint behind: the previous complete one stays restorable.
"""
from __future__ import annotations

import os


class TrainCheckpoint:
    name = "?"
    label = "?"
    restores_from = "disk"

    def __init__(self, directory: str, device: str) -> None:
        self.directory = directory
        self.device = device
        os.makedirs(directory, exist_ok=True)
        self.notes: dict = {}

    def save(self, model, opt, step: int) -> None:
        raise NotImplementedError

    def wait(self) -> None:
        """Block until the last save is durable where ``restore`` reads it."""

    def restore(self, model, opt) -> int | None:
        raise NotImplementedError

    def close(self) -> None:
        self.wait()
