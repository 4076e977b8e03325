"""Synchronous ``torch.save`` of model + optimizer to local disk (DeepSpeed's native pattern).

Save: ``torch.save({"model": state_dict, "optim": state_dict, "step"})`` of the live
(GPU) tensors to a temporary file, then an atomic rename; the training loop waits for
all of it.  Restore: ``torch.load(mmap=True, weights_only=True)`` (no second copy of the
file in memory) and ``load_state_dict`` on a model built without initialisation.
"""
from __future__ import annotations

import os

import torch

from .base import TrainCheckpoint


class TorchSave(TrainCheckpoint):
    name = "torch_save"
    label = "torch.save (DeepSpeed native)"

    def _path(self) -> str:
        return os.path.join(self.directory, "ckpt.pt")

    def save(self, model, opt, step: int) -> None:
        tmp = self._path() + ".tmp"
        torch.save({"model": model.state_dict(), "optim": opt.state_dict(), "step": step}, tmp)
        os.replace(tmp, self._path())

    def restore(self, model, opt) -> int | None:
        if not os.path.exists(self._path()):
            return None
        try:
            ck = torch.load(self._path(), map_location="cpu", mmap=True, weights_only=True)
        except RuntimeError:  # a file written by an old torch without mmap support
            ck = torch.load(self._path(), map_location="cpu", weights_only=True)
        model.load_state_dict(ck["model"])
        opt.load_state_dict(ck["optim"])
        return int(ck["step"])
