"""The client against a real host daemon: zero-copy tensors, lifetime rules, journal, errors."""
from __future__ import annotations

import gc
import multiprocessing as mp
import os
import subprocess
import sys

import pytest
import torch

import gpu_anchor
from gpu_anchor import errors
from gpu_anchor.client import client as client_mod

FORK = mp.get_context("fork")


def _run(target, *args):
    p = FORK.Process(target=target, args=args)
    p.start()
    p.join(60)
    assert p.exitcode == 0, f"child exited with {p.exitcode}"


def _child_writes(ns):
    c = gpu_anchor.connect("cpu", namespace=ns)
    t = c.tensor("w", (64, 64), torch.float32)
    t.copy_(torch.arange(64 * 64, dtype=torch.float32).view(64, 64))
    b = c.tensor("flags", (10,), torch.bool)
    b.copy_(torch.tensor([True, False] * 5))
    os._exit(0)  # like a crash: no finalizers


def test_same_name_same_memory_in_a_new_process(host_daemon):
    _run(_child_writes, "job")
    c = gpu_anchor.connect("cpu", namespace="job")
    bound = c.bind([("w", (64, 64), torch.float32), ("flags", (10,), torch.bool), ("new", (3,), torch.bfloat16)])
    assert [b.status for b in bound] == ["matched", "matched", "created"]
    assert torch.equal(bound[0].tensor, torch.arange(64 * 64, dtype=torch.float32).view(64, 64))
    assert bound[1].tensor.tolist() == [True, False] * 5
    assert bound[2].tensor.dtype == torch.bfloat16 and bound[2].tensor.shape == (3,)


def test_tensor_is_zero_copy_and_shared_between_clients(host_daemon):
    a = gpu_anchor.connect("cpu", namespace="job")
    b = gpu_anchor.connect("cpu", namespace="job")
    x = a.tensor("x", (1000,), torch.int64)
    y = b.tensor("x", (1000,), torch.int64)
    x.fill_(7)
    assert int(y.sum()) == 7000  # same memory, no copy
    del y
    gc.collect()
    a.flush_frees()
    assert "x" in a.names()  # one client's tensor dying must not free memory another still uses


def test_gc_of_last_tensor_frees_but_exit_and_crash_do_not(host_daemon):
    c = gpu_anchor.connect("cpu", namespace="job")
    t = c.tensor("temp", (8,), torch.float32)
    view = t[2:4]
    del t
    gc.collect()
    assert "temp" in c.names()  # a view still holds it
    del view
    gc.collect()
    assert "temp" not in c.names()

    code = ("import torch, gpu_anchor\n"
            "c = gpu_anchor.connect('cpu', namespace='job')\n"
            "keep = c.tensor('kept_at_exit', (4,), torch.float32); keep.fill_(3)\n"
            "gone = c.tensor('deleted', (4,), torch.float32); del gone\n"
            "c.names()  # the free rides on the next request\n"
            "def main():\n"
            "    model = c.tensor('local_model', (4,), torch.float32); model.fill_(9)\n"
            "    raise RuntimeError('crash')\n"
            "try:\n"
            "    main()\n"
            "except RuntimeError:\n"
            "    pass  # a wrapper that catches and exits: main's frame (and the model) is gone\n"
            )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
    names = c.names()
    assert "kept_at_exit" in names and "deleted" not in names
    assert "local_model" in names  # frees still queued at exit are dropped: never lose state
    assert c.tensor("kept_at_exit", (4,), torch.float32).tolist() == [3.0] * 4


def _child_drops_inherited(tensor_holder):
    tensor_holder.clear()  # the parent's leases die in the child
    gc.collect()
    os._exit(0)


def test_forked_child_never_frees_parents_objects(host_daemon):
    c = gpu_anchor.connect("cpu", namespace="job")
    holder = [c.tensor("p", (4,), torch.float32)]
    _run(_child_drops_inherited, holder)
    c.flush_frees()
    assert "p" in c.names()
    _run(_child_reuses_parents_client, c)


def _child_reuses_parents_client(c):
    try:
        c.names()
    except RuntimeError as e:
        os._exit(0 if "connect" in str(e) else 2)
    os._exit(1)


def test_conflict_names_object_and_both_shapes_and_keeps_data(host_daemon):
    c = gpu_anchor.connect("cpu", namespace="job")
    t = c.tensor("kv", (2, 3), torch.float16)
    t.fill_(1.5)
    with pytest.raises(gpu_anchor.ConflictError) as e:
        c.tensor("kv", (2, 2), torch.float16)
    msg = str(e.value)
    assert "'kv'" in msg and "float16[2, 3]" in msg and "float16[2, 2]" in msg
    assert e.value.conflicts[0]["name"] == "kv"
    assert c.tensor("kv", (2, 3), torch.float16).tolist() == [[1.5] * 3] * 2
    assert c.lookup("absent", (1,), torch.float32) is None and "absent" not in c.names()
    r = c.tensor("kv", (5,), torch.float16, policy="replace")
    assert r.shape == (5,)


def test_many_dtypes_and_zero_size(host_daemon):
    c = gpu_anchor.connect("cpu", namespace="job")
    for dtype in (torch.float32, torch.bfloat16, torch.float16, torch.int8, torch.uint8, torch.int32,
                  torch.int64, torch.float64, torch.bool, torch.complex64):
        t = c.tensor(f"t_{dtype}", (3, 5), dtype)
        assert t.dtype == dtype and t.shape == (3, 5) and t.is_contiguous()
        assert t.data_ptr() % 512 == 0 or t.data_ptr() % 4096 == t.data_ptr() % 4096
    z = c.tensor("empty", (0, 4), torch.float32)
    assert z.shape == (0, 4)


def test_journal_roundtrip_and_atomicity(host_daemon):
    c = gpu_anchor.connect("cpu", namespace="job")
    v = c.journal.commit({"cursor": b"3", "blob": bytes(range(256)) * 100})
    assert c.journal.get("blob") == bytes(range(256)) * 100
    with pytest.raises(errors.VersionMismatch):
        c.journal.commit({"cursor": b"4"}, expect_version=v - 1)
    assert c.journal.get("cursor") == b"3"
    c.journal.commit({"cursor": b"4"}, deletes=["blob"], expect_version=v)
    assert c.journal.get_many() == {"cursor": b"4"}
    assert gpu_anchor.connect("cpu", namespace="other").journal.get_many() == {}


def test_host_namespace_carries_the_rank(host_daemon, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "1")
    assert gpu_anchor.connect("cpu", namespace="job").namespace == "job/rank1"
    monkeypatch.setenv("GPU_ANCHOR_NAMESPACE", "envjob")
    assert gpu_anchor.connect("cpu").namespace == "envjob/rank1"


def test_missing_daemon_says_how_to_start_one(socket_dir):
    with pytest.raises(gpu_anchor.DaemonUnavailable) as e:
        gpu_anchor.connect("cpu")
    assert "gpu-anchor daemon --device cpu" in str(e.value)


def test_socket_precedence(host_daemon, monkeypatch, tmp_path):
    path, _ = host_daemon
    monkeypatch.setenv("GPU_ANCHOR_SOCKET_DIR", str(tmp_path / "nowhere"))
    with pytest.raises(gpu_anchor.DaemonUnavailable):
        gpu_anchor.connect("cpu")
    monkeypatch.setenv("GPU_ANCHOR_SOCKET", path)
    assert gpu_anchor.connect("cpu").socket_path == path
    assert gpu_anchor.connect("cpu", socket=path).socket_path == path


def test_daemon_death_is_reported_and_mapped_memory_stays(host_daemon):
    path, proc = host_daemon
    c = gpu_anchor.connect("cpu", namespace="job")
    t = c.tensor("x", (16,), torch.float32)
    t.fill_(2)
    proc.kill()
    proc.wait()
    t.add_(1)  # the mapping outlives the daemon
    assert t.tolist() == [3.0] * 16
    with pytest.raises(gpu_anchor.DaemonUnavailable):
        c.names()
    client_mod._pending_frees.clear()


def test_objects_since_skips_an_unchanged_table(host_daemon):
    c = gpu_anchor.connect("cpu", namespace="since")
    v0, objs = c.objects_since(None)
    assert objs == {}
    assert c.objects_since(v0) == (v0, None)
    t = c.tensor("a", (4,))
    v1, objs = c.objects_since(v0)
    assert v1 != v0 and list(objs) == ["a"] and objs["a"].shape == (4,)
    c.tensor("a", (4,))  # matched: no change
    assert c.objects_since(v1) == (v1, None)
    c.free("a")
    v2, objs = c.objects_since(v1)
    assert v2 not in (v0, v1) and objs == {}
    del t
