"""Checkpoints of a namespace: round trip through safetensors + manifest, the
commit marker, and a writer killed mid-write never taken for complete."""
from __future__ import annotations

import multiprocessing as mp
import os
import signal
import time

import pytest
import torch

import gpu_anchor
from gpu_anchor.checkpoint import format as snapshot_paths, settings as ckpt_settings, snapshot
from gpu_anchor.journal_keys import RESTORED_KEY


def _fill(client, step):
    g = torch.Generator().manual_seed(step)
    a = client.tensor("model.w", (33, 17), torch.float32)
    a.copy_(torch.randn(33, 17, generator=g))
    b = client.tensor("opt.m", (1000,), torch.bfloat16)
    b.copy_(torch.randn(1000, generator=g).to(torch.bfloat16))
    c = client.tensor("counts", (5,), torch.int64)
    c.copy_(torch.arange(5) * step)
    e = client.tensor("empty", (0, 4), torch.float16)
    client.journal.commit({"gpu_anchor/step": b"%d" % step, "cursor": bytes([0, 255, step % 256])})
    return [a, b, c, e]


def test_roundtrip_restores_objects_and_journal(host_daemon, tmp_path):
    client = gpu_anchor.connect("cpu", namespace="snap")
    held = _fill(client, 7)
    want = {n: t.clone() for n, t in zip(["model.w", "opt.m", "counts", "empty"], held)}
    want_journal = client.journal.get_many()
    cap = snapshot.capture(client, 7)
    snapshot.write(str(tmp_path), 7, 0, 1, [cap])
    assert snapshot_paths.latest_complete(str(tmp_path), 1) == 7
    # the file is plain safetensors
    from safetensors.torch import load_file
    assert torch.equal(load_file(str(tmp_path / "step-000000007" / "rank0" / "cpu.safetensors"))["model.w"],
                       want["model.w"])
    del held, cap
    client.drop_namespace()
    assert client.names() == []
    stats = snapshot.restore(str(tmp_path), 7, 0)
    assert stats["cpu"]["objects"] == 4
    fresh = gpu_anchor.connect("cpu", namespace="snap")
    for name, t in want.items():
        got = fresh.lookup(name, t.shape, t.dtype)
        assert got is not None and torch.equal(got, t), name
    j = fresh.journal.get_many()
    assert j.pop(RESTORED_KEY) == b"7"
    assert j == want_journal


def test_capture_refuses_a_step_that_is_not_the_committed_one(host_daemon):
    client = gpu_anchor.connect("cpu", namespace="snap2")
    _held = _fill(client, 3)
    with pytest.raises(RuntimeError, match="committed step is 3"):
        snapshot.capture(client, 4)


def _fill_in_child(namespace, step, sock_dir):
    os.environ["GPU_ANCHOR_SOCKET_DIR"] = sock_dir
    _fill(gpu_anchor.connect("cpu", namespace=namespace), step)  # exits holding them: they stay


def test_at_step_only_when_due_and_objects_not_freed(host_daemon, socket_dir, tmp_path, monkeypatch):
    monkeypatch.setenv(ckpt_settings.DIR_ENV, str(tmp_path))
    monkeypatch.setenv(ckpt_settings.EVERY_ENV, "5")
    ctx = mp.get_context("fork")
    p = ctx.Process(target=_fill_in_child, args=("snap3", 4, socket_dir))
    p.start(), p.join()
    client = gpu_anchor.connect("cpu", namespace="snap3")
    assert not snapshot.at_step(4, client)
    p = ctx.Process(target=_fill_in_child, args=("snap3", 5, socket_dir))
    p.start(), p.join()
    assert snapshot.at_step(5, client)   # this process never bound the objects itself
    snapshot.wait()
    assert snapshot_paths.latest_complete(str(tmp_path), 1) == 5
    assert not snapshot.at_step(5, client)  # already on disk
    import gc
    gc.collect()
    assert len(client.names()) == 4  # looking at objects for a snapshot never frees them


def _slow_writer(directory, step, sock_dir):
    os.environ["GPU_ANCHOR_SOCKET_DIR"] = sock_dir
    os.environ["GPU_ANCHOR_SNAPSHOT_THROTTLE_S"] = "5"
    client = gpu_anchor.connect("cpu", namespace="snap4")
    cap = snapshot.capture(client, step)
    snapshot.write(directory, step, 0, 1, [cap])


def test_writer_killed_mid_write_leaves_a_torn_step_that_is_ignored(host_daemon, socket_dir, tmp_path):
    client = gpu_anchor.connect("cpu", namespace="snap4")
    held = _fill(client, 10)
    snapshot.write(str(tmp_path), 10, 0, 1, [snapshot.capture(client, 10)])
    held = _fill(client, 20)
    p = mp.get_context("fork").Process(target=_slow_writer, args=(str(tmp_path), 20, socket_dir))
    p.start()
    part = tmp_path / "step-000000020" / "rank0" / "cpu.safetensors"
    deadline = time.monotonic() + 30
    while not (part.exists() and part.stat().st_size > 0) and time.monotonic() < deadline:
        time.sleep(0.01)
    os.kill(p.pid, signal.SIGKILL)
    p.join()
    assert part.exists() and not (part.parent / "COMMITTED").exists()
    assert snapshot_paths.latest_complete(str(tmp_path), 1) == 10
    del held
    client.drop_namespace()
    snapshot.restore(str(tmp_path), 10, 0)
    assert int(client.journal.get("gpu_anchor/step")) == 10
    with pytest.raises(FileNotFoundError):
        snapshot.restore(str(tmp_path), 20, 0)
