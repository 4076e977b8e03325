"""``torch.distributed.checkpoint.async_save``: PyTorch's own asynchronous checkpoint.

Save: ``get_state_dict`` (fully qualified names for model and optimizer), then
``async_save`` with a stager configured as the PyTorch docs recommend for repeated
checkpoints (``DefaultStager``: pinned, cached staging buffers, reused by every save) where
the installed torch allows it; it returns once the state is staged on the host, and the
file write runs in a background thread.  When the write completes, ``latest`` moves to that
checkpoint (a rename), so a kill mid-write leaves the previous one.  Restore: ``dcp.load``
into the rebuilt tensors, ``set_state_dict``.  Works without an initialised process group
(``no_dist``).

Whether a cached stager survives a save is not guessed from the version: ``stager_support``
stages a small state dict twice with one stager before the first real save (torch 2.11's
``async_save`` closes a caller's stager after each save, pytorch#183413; the probe also tries
the user-side workaround, a stager whose ``close`` waits for ours).  The result is in the
method's notes.
"""
from __future__ import annotations

import os
import shutil
import tempfile

import torch

from .base import TrainCheckpoint


def _dcp():
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    return dcp, get_state_dict, set_state_dict


def _options(device: str):
    from torch.distributed.checkpoint.staging import StagingOptions
    pin = torch.device(device).type == "cuda"
    # synchronous staging: async_save returns when the host copy is complete, so the caller
    # may step the optimizer right away (async staging would need a second wait before the
    # next step, which is the same blocking time)
    return StagingOptions(use_pinned_memory=pin, use_shared_memory=False, use_async_staging=False,
                          use_non_blocking_copy=pin)


def _stager_classes():
    from torch.distributed.checkpoint.staging import DefaultStager

    class KeptOpenStager(DefaultStager):
        """A ``DefaultStager`` that ``async_save`` cannot close between saves (its owner closes it)."""

        def close(self) -> None:
            pass

        def close_for_real(self) -> None:
            DefaultStager.close(self)
    return DefaultStager, KeptOpenStager


def _reused_twice(stager, device: str) -> str | None:
    """None if two ``async_save`` calls through ``stager`` both stage and write; else why not."""
    dcp, _, _ = _dcp()
    d = tempfile.mkdtemp(prefix="dcp-stager-probe-")
    try:
        for i in range(2):
            sd = {"w": torch.full((64,), float(i), device=device)}
            fut = dcp.async_save(sd, checkpoint_id=os.path.join(d, str(i)), no_dist=True, async_stager=stager)
            getattr(fut, "upload_completion", fut).result()
            back = {"w": torch.empty(64, device=device)}
            dcp.load(back, checkpoint_id=os.path.join(d, str(i)), no_dist=True)
            if not torch.equal(back["w"].cpu(), torch.full((64,), float(i))):
                return f"save {i + 1} wrote the wrong data"
        return None
    except Exception as e:  # noqa: BLE001 - the reason is the result
        return f"save {i + 1} failed: {type(e).__name__}: {e}"
    finally:
        shutil.rmtree(d, ignore_errors=True)


def stager_support(device: str, known: dict | None = None):
    """``(stager or None, note, kind)``: a cached stager that two saves in a row can use, found by
    trying (``kind``: "default", "kept_open" or "none"); ``known``: an earlier probe's ``kind`` and
    ``note`` for this torch, reused instead of probing again."""
    try:
        default, kept_open = _stager_classes()
        opts = _options(device)
    except (ImportError, TypeError) as e:
        return None, f"async_save's default (no configurable DefaultStager in torch {torch.__version__}: {e})", "none"
    if known and known.get("torch") == torch.__version__:
        kind = known["kind"]
        return ({"default": default, "kept_open": kept_open}[kind](opts) if kind != "none" else None,
                known["note"], kind)
    stager = default(opts)
    why = _reused_twice(stager, device)
    if why is None:
        return stager, (f"DefaultStager(pinned={opts.use_pinned_memory}, cached; reuse probed in torch "
                        f"{torch.__version__})"), "default"
    stager = kept_open(opts)
    why_kept = _reused_twice(stager, device)
    if why_kept is None:
        return stager, (f"DefaultStager(pinned={opts.use_pinned_memory}, cached), kept open across saves: torch "
                        f"{torch.__version__} closes a caller's stager after a save (probe: {why}; "
                        "pytorch#183413)"), "kept_open"
    return None, (f"async_save's default, a new one per save: no cached stager survives a save in torch "
                  f"{torch.__version__} (probe: {why}; kept open: {why_kept})"), "none"


class DcpAsync(TrainCheckpoint):
    name = "dcp_async"
    label = "torch DCP async_save"

    PROBE = "stager-probe.json"

    def __init__(self, directory: str, device: str) -> None:
        super().__init__(directory, device)
        self._future = None
        self._stager = self._probed = None

    def _choose_stager(self) -> None:
        """At the first save (a restore never pays for it): the probe's answer, kept next to the
        checkpoints so that a restarted worker reuses it."""
        import json
        path = os.path.join(self.directory, self.PROBE)
        try:
            with open(path) as f:
                known = json.load(f)
        except (OSError, ValueError):
            known = None
        self._stager, note, kind = stager_support(self.device, known)
        self.notes["stager"] = note
        if known is None:
            with open(path + ".tmp", "w") as f:
                json.dump({"torch": torch.__version__, "kind": kind, "note": note}, f)
            os.replace(path + ".tmp", path)
        self._probed = True

    def save(self, model, opt, step: int) -> None:
        dcp, get_state_dict, _ = _dcp()
        self.wait()
        if not self._probed:
            self._choose_stager()
        msd, osd = get_state_dict(model, opt)
        target = os.path.join(self.directory, f"step{step}")
        kw = {"async_stager": self._stager} if self._stager is not None else {}
        fut = dcp.async_save({"model": msd, "optim": osd}, checkpoint_id=target, no_dist=True, **kw)
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

    def close(self) -> None:
        super().close()
        if self._stager is not None:
            getattr(self._stager, "close_for_real", self._stager.close)()
            self._stager = None

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
