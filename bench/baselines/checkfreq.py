"""CheckFreq-style checkpointing: a blocking snapshot into pinned host memory, then an
asynchronous persist to disk in a background thread (Mohan et al., FAST '21).

Save: wait for the previous persist (CheckFreq never runs two at once), copy every
tensor into one preallocated pinned buffer with batched non-blocking copies, synchronise
— training may continue from here — and hand the buffer to the writer thread, which
writes one raw file and then moves the index (see ``rawfile``).  Restore reads the
latest complete file from disk (page cache) straight into the rebuilt tensors.
"""
from __future__ import annotations

import os
import threading
import time

import torch

from . import rawfile, state
from .base import TrainCheckpoint


class CheckFreq(TrainCheckpoint):
    name = "checkfreq"
    label = "CheckFreq (pinned snapshot + async persist)"

    def __init__(self, directory: str, device: str) -> None:
        super().__init__(directory, device)
        self._buf = None
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._gen = 0

    def _alloc(self, named):
        self._entries, self._total = state.layout(named)
        t0 = time.perf_counter()
        pin = torch.device(self.device).type == "cuda"
        self._buf = torch.empty(self._total, dtype=torch.uint8, pin_memory=pin)
        self._views = state.views(self._buf, self._entries)
        self.notes["pinned_alloc_s"] = time.perf_counter() - t0
        self.notes["pinned"] = pin

    def save(self, model, opt, step: int) -> None:
        self.wait()
        named = state.named_state(model, opt)
        if self._buf is None:
            self._alloc(named)
        state.copy_batched(self._views, [t for _, t in named])
        state.sync(self.device)
        self._gen += 1
        self._thread = threading.Thread(target=self._persist, args=(step, f"gen{self._gen}.bin"), daemon=True)
        self._thread.start()

    def _persist(self, step: int, name: str) -> None:
        try:
            t0 = time.perf_counter()
            path = os.path.join(self.directory, name)
            with open(path + ".tmp", "wb") as f:
                f.write(memoryview(self._buf.numpy()))
            os.replace(path + ".tmp", path)
            rawfile.commit(self.directory, name, step, self._entries, self._total)
            rawfile.remove_others(self.directory, name)
            self.notes["persist_s"] = time.perf_counter() - t0
        except BaseException as e:  # surfaced by the next wait()
            self._error = e

    def wait(self) -> None:
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._error is not None:
            e, self._error = self._error, None
            raise RuntimeError("CheckFreq background persist failed") from e

    def restore(self, model, opt) -> int | None:
        state.ensure_optimizer_state(opt)
        return rawfile.restore_into(self.directory, state.named_state(model, opt))
