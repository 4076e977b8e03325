"""In-memory checkpoint: copy the state into host shared memory (/dev/shm) that outlives
the worker; a restarted worker maps it and copies it back.

Two slots (``gen1.bin`` / ``gen2.bin`` in a tmpfs directory) alternate so that a kill
during a copy leaves the other slot, still named by ``latest.json``, intact.  On CUDA the
slots are registered as pinned memory (``cudaHostRegister``) once per worker, as a careful
user would, so the blocking copy runs at pinned-memory bandwidth; the one-off
registration time is reported separately (``notes.register_s``).  Restore maps the slot
from tmpfs (no file read) and copies it into the rebuilt tensors.
"""
from __future__ import annotations

import os
import shutil
import time

import torch

from . import rawfile, state
from .base import TrainCheckpoint


def _register(buf: torch.Tensor) -> bool:
    try:
        rc = torch.cuda.cudart().cudaHostRegister(buf.data_ptr(), buf.numel(), 0)
        return int(rc) == 0 if not isinstance(rc, tuple) else int(rc[0]) == 0
    except Exception:
        return False


class InMemory(TrainCheckpoint):
    name = "inmemory"
    label = "in-memory (/dev/shm)"
    restores_from = "host memory"

    def __init__(self, directory: str, device: str) -> None:
        super().__init__(directory, device)
        self._slots: dict[int, list[torch.Tensor]] = {}
        self._next = 1

    def _slot(self, k: int, named):
        if not self._slots:
            # both slots at once, as a careful user sets up the buffers: registering the second
            # slot inside a later save would charge a one-off cost to a steady-state checkpoint
            entries, total = state.layout(named)
            free = shutil.disk_usage(self.directory).free
            if 2 * total > free:
                raise RuntimeError(f"in-memory checkpoint needs 2 x {total / 2**30:.1f} GiB in {self.directory}, "
                                   f"{free / 2**30:.1f} GiB free (pass a bigger tmpfs with --shm-dir)")
            self._entries, self._total = entries, total
            for j in (1, 2):
                path = os.path.join(self.directory, f"gen{j}.bin")
                buf = torch.from_file(path, shared=True, size=total, dtype=torch.uint8)
                t0 = time.perf_counter()
                if torch.device(self.device).type == "cuda":
                    self.notes["pinned"] = _register(buf)
                    self.notes["register_s"] = self.notes.get("register_s", 0.0) + time.perf_counter() - t0
                self._slots[j] = (buf, state.views(buf, entries))
        return self._slots[k][1]

    def close(self) -> None:
        super().close()
        if torch.device(self.device).type == "cuda" and self.notes.get("pinned"):
            for buf, _ in self._slots.values():  # a registration outliving us breaks the next registrant
                torch.cuda.cudart().cudaHostUnregister(buf.data_ptr())
        self._slots.clear()

    def save(self, model, opt, step: int) -> None:
        named = state.named_state(model, opt)
        idx = rawfile.latest(self.directory)
        k = 2 if idx is not None and idx["file"] == "gen1.bin" else 1  # never overwrite the live slot
        views = self._slot(k, named)
        state.copy_batched(views, [t for _, t in named])
        state.sync(self.device)
        rawfile.commit(self.directory, f"gen{k}.bin", step, self._entries, self._total)

    def restore(self, model, opt) -> int | None:
        state.ensure_optimizer_state(opt)
        return rawfile.restore_into(self.directory, state.named_state(model, opt))
