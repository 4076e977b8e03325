"""The DCP baseline finds out by trying whether a cached stager survives a save (CPU): the
installed torch's, a torch that closes a caller's stager after each save (pytorch#183413,
simulated), and one where no stager can be reused."""
from __future__ import annotations

import pytest

pytest.importorskip("torch.distributed.checkpoint.staging")

import torch.distributed.checkpoint as dcp  # noqa: E402
from torch.distributed.checkpoint.staging import DefaultStager  # noqa: E402

from bench.baselines import dcp_async  # noqa: E402


def test_this_torch_reuses_a_cached_stager():
    stager, note, kind = dcp_async.stager_support("cpu")
    assert kind in ("default", "kept_open", "none") and note
    if kind != "none":
        assert isinstance(stager, DefaultStager)


def _closing_async_save(monkeypatch):
    """async_save as torch 2.11 has it: a caller's stager is closed after the save, and a closed
    DefaultStager cannot stage again."""
    real_save, real_stage, real_close = dcp.async_save, DefaultStager.stage, DefaultStager.close

    def stage(self, *a, **k):
        if getattr(self, "_closed_by_test", False):
            raise KeyError(type)
        return real_stage(self, *a, **k)

    def close(self):
        self._closed_by_test = True
        real_close(self)

    def async_save(*a, async_stager=None, **k):
        out = real_save(*a, async_stager=async_stager, **k)
        if async_stager is not None:
            async_stager.close()
        return out
    monkeypatch.setattr(DefaultStager, "stage", stage)
    monkeypatch.setattr(DefaultStager, "close", close)
    monkeypatch.setattr(dcp, "async_save", async_save)


def test_a_torch_that_closes_the_stager_gets_the_kept_open_stager(monkeypatch):
    _closing_async_save(monkeypatch)
    stager, note, kind = dcp_async.stager_support("cpu")
    assert kind == "kept_open" and "pytorch#183413" in note and "KeyError" in note
    assert dcp_async._reused_twice(stager, "cpu") is None        # it does survive saves
    # a restarted worker takes the recorded answer instead of probing again
    again = dcp_async.stager_support("cpu", {"torch": dcp_async.torch.__version__, "kind": kind, "note": note})
    assert again[1:] == (note, kind)


def test_no_reusable_stager_falls_back_to_the_default_per_save(monkeypatch):
    monkeypatch.setattr(dcp_async, "_reused_twice", lambda stager, device: "save 2 failed: KeyError")
    stager, note, kind = dcp_async.stager_support("cpu")
    assert stager is None and kind == "none" and "a new one per save" in note
