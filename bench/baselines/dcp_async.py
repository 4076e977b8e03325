"""``torch.distributed.checkpoint.async_save``: PyTorch's own asynchronous checkpoint.

Save: ``get_state_dict`` (fully qualified names for model and optimizer), then
``async_save`` with the default stager configured as the PyTorch docs recommend for
repeated checkpoints (pinned, cached staging buffers); it returns once the state is
staged on the host, and the file write runs in a background thread.  When the write
completes, ``latest`` moves to that checkpoint (a rename), so a kill mid-write leaves the
previous one.  Restore: ``dcp.load`` into the rebuilt tensors, ``set_state_dict``.
Works without an initialised process group (``no_dist``).
"""
from __future__ import annotations

import os
import shutil

import torch

from .base import TrainCheckpoint


def _dcp():
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    return dcp, get_state_dict, set_state_dict


class DcpAsync(TrainCheckpoint):
    name = "dcp_async"
    label = "torch DCP async_save"

    def __init__(self, directory: str, device: str) -> None:
        super().__init__(directory, device)
        self._future = None
        self._stager = None
        try:
            from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
            pin = torch.device(device).type == "cuda"
            # synchronous staging: async_save returns when the host copy is complete, so
            # the caller may step the optimizer right away (async staging would need a
            # second wait before the next step, which is the same blocking time)
            self._stager = DefaultStager(StagingOptions(use_pinned_memory=pin, use_shared_memory=False,
                                                        use_async_staging=False, use_non_blocking_copy=pin))
            self.notes["stager"] = f"DefaultStager(pinned={pin}, cached)"
        except (ImportError, TypeError):
            self.notes["stager"] = "default"

    def save(self, model, opt, step: int) -> None:
        dcp, get_state_dict, _ = _dcp()
        self.wait()
        msd, osd = get_state_dict(model, opt)
        target = os.path.join(self.directory, f"step{step}")
        kw = {"async_stager": self._stager} if self._stager is not None else {}
        try:
            fut = dcp.async_save({"model": msd, "optim": osd}, checkpoint_id=target, no_dist=True, **kw)
        except Exception as e:  # an older torch that refuses this stager (TypeError), or cannot reuse
            if not kw:          # it: torch 2.11's DefaultStager.stage() closes itself, so the second
                raise           # save fails with KeyError: <class 'type'> (pytorch/pytorch#183413)
            self._stager = None
            why = ("closes itself after one stage in this torch: pytorch#183413" if isinstance(e, KeyError)
                   else f"refused: {e}")
            self.notes["stager"] = f"async_save's default, a new one per save (the cached DefaultStager {why})"
            fut = dcp.async_save({"model": msd, "optim": osd}, checkpoint_id=target, no_dist=True)
        fut = getattr(fut, "upload_completion", fut)  # AsyncSaveResponse in newer torch
        fut.add_done_callback(lambda f, s=step: self._written(f, s))
        self._future = fut

    def _written(self, fut, step: int) -> None:
        if fut.exception() is not None:
            return
        tmp = os.path.join(self.directory, "latest.tmp")
        with open(tmp, "w") as f:
            f.write(str(step))
        os.replace(tmp, os.path.join(self.directory, "latest"))
        for n in os.listdir(self.directory):
            if n.startswith("step") and n != f"step{step}":
                shutil.rmtree(os.path.join(self.directory, n), ignore_errors=True)

    def wait(self) -> None:
        if self._future is not None:
            fut, self._future = self._future, None
            fut.result()

    def restore(self, model, opt) -> int | None:
        try:
            with open(os.path.join(self.directory, "latest")) as f:
                step = int(f.read())
        except FileNotFoundError:
            return None
        dcp, get_state_dict, set_state_dict = _dcp()
        msd, osd = get_state_dict(model, opt)  # creates optimizer state to load into
        sd = {"model": msd, "optim": osd}
        dcp.load(sd, checkpoint_id=os.path.join(self.directory, f"step{step}"), no_dist=True)
        set_state_dict(model, opt, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
        return step
