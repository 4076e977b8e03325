"""Restore from a concurrent checkpoint after a destructive failure: full and on-demand.

Both continue to the same bits as the fault-free run; on-demand restore starts
the job before its objects are loaded and loads the touched ones first.
"""
from __future__ import annotations

import contextlib
import multiprocessing
import os

import torch

import gpu_anchor
from gpu_anchor.checkpoint import restore as od
from gpu_anchor.checkpoint.concurrent import ConcurrentCheckpointer
from gpu_anchor.testing.workload import Job
from gpu_anchor.checkpoint.writeset import WriteSetTracker
from gpu_anchor.checkpoint import snapshot

STEPS, AT = 7, 3


def _train(ns, directory=None, steps=STEPS):
    client = gpu_anchor.connect("cpu", namespace=ns)
    job, tracker = Job(client), WriteSetTracker()
    ckpt = ConcurrentCheckpointer([client], directory, tracker, policy="cow", throttle_s=0.01) if directory else None
    with tracker:
        for s in range(1, steps + 1):
            job.step(s)
            job.commit(s)
            if ckpt:
                ckpt.boundary(s, due=s == AT)
    if ckpt:
        ckpt.finish(steps)
    return job.snapshot()


def _continue(client, tracker=None, probe=None):
    job = Job(client)
    start = job.committed_step()
    assert start == AT
    first = probe() if probe is not None else None  # the job is built and about to run
    ctx = tracker if tracker is not None else contextlib.nullcontext()
    with ctx:
        for s in range(start + 1, STEPS + 1):
            job.step(s)
            job.commit(s)
    return job.snapshot(), first


def _same(a, b):
    assert sorted(a) == sorted(b)
    bad = [k for k in a if not torch.equal(a[k], b[k])]
    assert not bad, bad


def test_full_and_on_demand_restore_continue_like_the_fault_free_run(host_daemon, tmp_path):
    want = _train("ref")
    ckdir = str(tmp_path / "ck")
    _train("job", ckdir)

    # destructive failure: the namespace's memory and journal are gone
    gpu_anchor.connect("cpu", namespace="job").drop_namespace()
    stats = snapshot.restore(ckdir, AT, 0)
    assert stats["cpu"]["objects"] == 18
    full, _ = _continue(gpu_anchor.connect("cpu", namespace="job"))
    _same(full, want)

    gpu_anchor.connect("cpu", namespace="job").drop_namespace()
    tracker = WriteSetTracker()
    r = od.OnDemandRestore(ckdir, tracker, step=AT, throttle_s=0.05).start()
    client = gpu_anchor.connect("cpu", namespace="job")
    assert od.incomplete(client) == AT
    q = r.queue
    lazy, loaded_at_start = _continue(client, tracker, probe=lambda: len(q.foreground) + len(q.background))
    stats = r.wait()
    _same(lazy, want)
    assert loaded_at_start < stats["objects"], "the job started before its objects were loaded"
    assert stats["on_demand"], "objects touched by ops were loaded on demand"
    assert od.incomplete(client) is None and client.journal.get("gpu_anchor/inconsistent") is None
    assert client.journal.get("gpu_anchor/checkpoint/touch_order") is None


def test_background_order_follows_first_touch(host_daemon, tmp_path):
    ckdir = str(tmp_path / "ck")
    _train("job", ckdir)
    gpu_anchor.connect("cpu", namespace="job").drop_namespace()
    r = od.OnDemandRestore(ckdir, WriteSetTracker(), step=AT).start()
    stats = r.wait()
    # forward touches layer 0 first (one addmm reads its bias and weight together: views such as
    # ``weight.t()`` touch no bytes and are not recorded), the backward-then-update order puts
    # optimizer state last
    assert sorted(stats["background"][:2]) == ["model.0.bias", "model.0.weight"]
    assert stats["background"][-1].startswith("optim.")


def _crash_mid_restore(ckdir, sock):
    os.environ["GPU_ANCHOR_SOCKET_DIR"] = sock
    torch.set_num_threads(1)  # the parent's thread pool does not survive fork
    r = od.OnDemandRestore(ckdir, WriteSetTracker(), step=AT, throttle_s=0.05).start()
    while len(r.queue.background) < 3:
        pass
    os.kill(os.getpid(), 9)


def test_crash_during_on_demand_restore_is_detected_and_redone(host_daemon, tmp_path):
    want = _train("ref")
    ckdir = str(tmp_path / "ck")
    _train("job", ckdir)
    gpu_anchor.connect("cpu", namespace="job").drop_namespace()
    p = multiprocessing.get_context("fork").Process(target=_crash_mid_restore,
                                                    args=(ckdir, os.environ["GPU_ANCHOR_SOCKET_DIR"]))
    p.start()
    p.join(60)
    assert p.exitcode == -9
    client = gpu_anchor.connect("cpu", namespace="job")
    assert od.incomplete(client) == AT, "a torn restore must not look like intact state"
    from gpu_anchor.launch import health
    view = health.read_namespace("cpu", client.socket_path, "job")
    assert view["inconsistent"] and "on-demand restore" in view["inconsistent"], view
    tracker = WriteSetTracker()
    r = od.OnDemandRestore(ckdir, tracker, step=AT).start()
    got, _ = _continue(gpu_anchor.connect("cpu", namespace="job"), tracker)
    r.wait()
    _same(got, want)


def test_supervisor_env_checkpoints_and_on_demand_context(host_daemon, tmp_path, monkeypatch):
    from gpu_anchor.checkpoint.format import latest_complete, list_steps
    from gpu_anchor.checkpoint.settings import DIR_ENV, EVERY_ENV, KEEP_ENV
    want = _train("ref")
    ckdir = str(tmp_path / "ck")
    monkeypatch.setenv(DIR_ENV, ckdir)
    monkeypatch.setenv(EVERY_ENV, "3")
    monkeypatch.setenv(KEEP_ENV, "5")
    client = gpu_anchor.connect("cpu", namespace="job")
    job, tracker = Job(client), WriteSetTracker()
    ckpt = ConcurrentCheckpointer.from_env([client], tracker, throttle_s=0.002)
    with tracker:
        for s in range(1, STEPS + 1):
            job.step(s)
            job.commit(s)
            ckpt.boundary(s)
    ckpt.finish(STEPS)
    steps = list_steps(ckdir)
    assert len(steps) == 2 and steps[0] == 3 and steps[1] >= 6 and latest_complete(ckdir, 1) == steps[1]
    del job
    client.drop_namespace()
    with od.on_demand(ckdir, step=AT) as r:
        got, _ = _continue(gpu_anchor.connect("cpu", namespace="job"))
    assert r.done
    _same(got, want)
